// kvtier/client.h: C++ helpers beside the cxx bridge of the kvtier engine client.
//
// The bridge itself (the class kvtier::Client and its option/result structs) is generated
// into "kvtier/src/ffi/cxx.rs.h"; include that header for the API. A failed call throws
// rust::Error whose message starts with "[code N] ", N being a KVTIER_ERR_* code of
// <kvtier.h>; kvtier::error_code reads it back.
#pragma once

#include <cstdint>
#include <vector>

#include "rust/cxx.h"

namespace kvtier {

// The stable code carried by an error from the bridge, or KVTIER_ERR_INTERNAL (-11) when
// the message carries none.
int32_t error_code(const rust::Error &error) noexcept;

// The same, from a bare message ("[code -5] kvtier daemon unavailable: ...").
int32_t error_code_of(const char *message) noexcept;

// Packs u64 block hashes (vLLM-style) as 8-byte big-endian page hashes, the batch layout
// the bridge takes (`hashes`, `hash_len` = 8).
std::vector<uint8_t> pack_u64(const std::vector<uint64_t> &hashes);

}  // namespace kvtier
