// C++ helpers of the kvtier bridge: error codes out of rust::Error, hash packing.
#include "kvtier/client.h"

#include <cstdlib>
#include <cstring>

namespace kvtier {

namespace {
constexpr int32_t kInternal = -11;
constexpr char kTag[] = "[code ";
}  // namespace

int32_t error_code_of(const char *message) noexcept {
    if (message == nullptr || std::strncmp(message, kTag, sizeof(kTag) - 1) != 0) {
        return kInternal;
    }
    const char *start = message + sizeof(kTag) - 1;
    char *end = nullptr;
    long code = std::strtol(start, &end, 10);
    if (end == start || *end != ']' || code > 0 || code < -100000) {
        return kInternal;
    }
    return static_cast<int32_t>(code);
}

int32_t error_code(const rust::Error &error) noexcept { return error_code_of(error.what()); }

std::vector<uint8_t> pack_u64(const std::vector<uint64_t> &hashes) {
    std::vector<uint8_t> out;
    out.reserve(hashes.size() * 8);
    for (uint64_t h : hashes) {
        for (int shift = 56; shift >= 0; shift -= 8) {
            out.push_back(static_cast<uint8_t>(h >> shift));
        }
    }
    return out;
}

}  // namespace kvtier
