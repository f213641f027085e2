// test_engine: plays one engine rank against a running kvtier daemon through the cxx
// bridge, and checks every byte that comes back.
//
//   test_engine <socket> <tp_rank> <tp_size> <first_hash> <pages> [host-runs]
//
// Writes the shared test pattern into `pages` device pages, stores them, tells kvtier the
// device copies are gone, loads them back into other device slots and checks the bytes;
// then sends each kind of hint and a few malformed calls. Prints "OK ..." and exits 0, or
// "FAIL: ..." and exits 1. Every rank of the instance must run with the same hashes.
//
// With `host-runs`, the pages are the engine's own host tensors with the heads outside the
// blocks (vLLM's LHBNC: per (part, layer) `[head][slot][token][dim]`), registered through
// `register_host_tensor_runs` with one run per head. This program writes and checks their
// bytes itself, at the addresses that layout gives, so kvtier's run addressing is checked
// against an independent reading of it.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kvtier.h"
#include "kvtier/client.h"
#include "kvtier/src/ffi/cxx.rs.h"

namespace {

struct Failure : std::runtime_error {
    using std::runtime_error::runtime_error;
};

void check(bool ok, const std::string &what) {
    if (!ok) throw Failure(what);
}

// The seed a rank writes for a page (tests/ffi.rs checks the same rule from Rust).
uint64_t seed_of(uint64_t hash, uint16_t tp_rank) {
    return (hash * 0x9e3779b97f4a7c15ull) ^ (static_cast<uint64_t>(tp_rank) << 8);
}

// The seed of one (part index, layer) of a page (`layer_seed` in src/tier/device.rs).
uint64_t layer_seed(uint64_t seed, uint64_t part, uint64_t layer) {
    return seed ^ (part << 56) ^ (layer << 40);
}

// Host KV tensors with the heads outside the blocks: for each (part, layer) one buffer
// `[head][slot][token][dim]`, so a page of one (part, layer) is one run per head, `slots`
// blocks apart. The layer's bytes of a page are its runs in head order.
struct HeadRuns {
    uint32_t heads, slots, piece;  // heads of this rank, pages, bytes of one head's block
    std::vector<std::vector<uint8_t>> tensors;  // parts outer: K layers, then V layers

    uint8_t *run(uint32_t tensor, uint32_t slot, uint32_t head) {
        return tensors[tensor].data() + (static_cast<size_t>(head) * slots + slot) * piece;
    }
    // Writes the pattern of `seed` into page `slot`, as `fill_page` lays it out.
    void fill(uint32_t slot, uint64_t seed, uint32_t layers) {
        for (uint32_t t = 0; t < tensors.size(); ++t) {
            rust::Vec<uint8_t> want = kvtier::pattern(layer_seed(seed, t / layers, t % layers), heads * piece);
            for (uint32_t h = 0; h < heads; ++h) std::copy_n(want.data() + h * piece, piece, run(t, slot, h));
        }
    }
    bool matches(uint32_t slot, uint64_t seed, uint32_t layers) {
        for (uint32_t t = 0; t < tensors.size(); ++t) {
            rust::Vec<uint8_t> want = kvtier::pattern(layer_seed(seed, t / layers, t % layers), heads * piece);
            for (uint32_t h = 0; h < heads; ++h)
                if (!std::equal(want.data() + h * piece, want.data() + (h + 1) * piece, run(t, slot, h))) return false;
        }
        return true;
    }
};

// Runs `f`, which must throw rust::Error with `code`.
template <typename F>
void expect_code(int32_t code, const std::string &what, F f) {
    try {
        f();
    } catch (const rust::Error &e) {
        int32_t got = kvtier::error_code(e);
        check(got == code, what + ": code " + std::to_string(got) + " (" + e.what() + "), want " +
                               std::to_string(code));
        return;
    }
    throw Failure(what + ": no error");
}

kvtier::HintResult send_hint(const kvtier::Client &c, uint32_t kind, uint32_t target,
                             const std::vector<uint8_t> &hashes, const std::string &session, uint32_t tier) {
    kvtier::HintRequest h{};
    h.kind = kind;
    h.target = target;
    for (uint8_t b : hashes) h.hashes.push_back(b);
    h.hash_len = 8;
    h.session = session;
    h.tier = tier;
    h.priority = 3;
    h.ttl_ms = 2000;
    h.deadline_ms = 0;
    kvtier::HintResult r = c.hint(h);
    check(r.outcome <= KVTIER_OUTCOME_IGNORED, "hint outcome out of range");
    std::cout << "hint kind=" << kind << " outcome=" << r.outcome << " reason=" << r.reason
              << " applied=" << r.applied << std::endl;
    return r;
}

int run(int argc, char **argv) {
    check(argc == 6 || (argc == 7 && std::string(argv[6]) == "host-runs"),
          "usage: test_engine <socket> <tp_rank> <tp_size> <first_hash> <pages> [host-runs]");
    const bool host_runs = argc == 7;
    kvtier::ConnectOptions o{};
    o.socket = argv[1];
    o.instance = "cpp-engine";
    o.model = "cpp-model";
    o.tp_rank = static_cast<uint16_t>(std::stoul(argv[2]));
    o.tp_size = static_cast<uint16_t>(std::stoul(argv[3]));
    o.pp_rank = 0;
    o.pp_size = 1;
    o.layers = 4;
    o.kv_heads = 4;
    o.head_dim = 16;
    o.dtype_bytes = 2;
    o.page_tokens = 4;
    o.attention = KVTIER_ATTENTION_MHA;
    o.byte_order = KVTIER_ORDER_LAYER_FIRST;
    o.timeout_ms = 10000;
    const uint64_t first = std::stoull(argv[4]);
    const uint32_t n = static_cast<uint32_t>(std::stoul(argv[5]));
    check(n > 0 && n <= 1024, "pages must be 1..1024");

    rust::Box<kvtier::Client> c = kvtier::connect(o);
    HeadRuns kv{};
    if (host_runs) {
        kv.heads = o.kv_heads / o.tp_size;
        kv.slots = 2 * n;
        kv.piece = o.page_tokens * o.head_dim * o.dtype_bytes;
        std::vector<uint64_t> ptrs;
        for (uint32_t t = 0; t < 2u * o.layers; ++t) {
            // Filled with a byte no pattern run is made of, so a page never copied shows.
            kv.tensors.emplace_back(static_cast<size_t>(kv.heads) * kv.slots * kv.piece, 0xA5);
            ptrs.push_back(reinterpret_cast<uint64_t>(kv.tensors.back().data()));
        }
        c->register_host_tensor_runs(rust::Slice<const uint64_t>(ptrs.data(), ptrs.size()), kv.piece, kv.slots,
                                     kv.heads, static_cast<uint64_t>(kv.slots) * kv.piece);
        std::cout << "host runs=" << kv.heads << std::endl;
    } else {
        c->register_emulated(2 * n);
    }
    const std::string session = "cpp-session";
    c->session(session, "", KVTIER_PHASE_REASONING);

    std::vector<uint64_t> ids;
    std::vector<uint32_t> slots, back;
    for (uint32_t i = 0; i < n; ++i) {
        ids.push_back(first + i);
        slots.push_back(i);
        back.push_back(n + i);
        if (host_runs) {
            kv.fill(i, seed_of(first + i, o.tp_rank), o.layers);
        } else {
            c->fill_page(i, seed_of(first + i, o.tp_rank));
        }
    }
    const std::vector<uint8_t> hashes = kvtier::pack_u64(ids);
    rust::Slice<const uint8_t> hs(hashes.data(), hashes.size());

    kvtier::StoreReceipt r = c->store(hs, 8, rust::Slice<const uint32_t>(slots.data(), slots.size()), session);
    // Complete means every TP rank stored its objects: wait for the peer, bounded.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    kvtier::TicketStatus t{};
    do {
        t = c->wait(r.ticket, 2000);
    } while (t.complete < n && t.failed == 0 && std::chrono::steady_clock::now() < deadline);
    check(t.complete == n, "store ticket completed " + std::to_string(t.complete) + " of " + std::to_string(n));

    kvtier::PrefixHit hit = c->lookup(hs, 8);
    check(hit.device + hit.host == n, "lookup after store: " + std::to_string(hit.host) + " on host");

    c->removed(hs, 8);
    size_t loaded = c->load(hs, 8, rust::Slice<const uint32_t>(back.data(), back.size()), KVTIER_LOAD_WAIT_COMPLETE, 0);
    check(loaded == n, "loaded " + std::to_string(loaded) + " of " + std::to_string(n) + " pages");

    if (host_runs) {
        // Every loaded page holds the pattern at the addresses the heads-outside layout
        // gives, read by this program, not by kvtier.
        for (uint32_t i = 0; i < n; ++i)
            check(kv.matches(n + i, seed_of(first + i, o.tp_rank), o.layers),
                  "host page " + std::to_string(i) + " differs after its load");
    } else {
        // Byte checks: every loaded page holds the pattern, and its objects equal the source's.
        std::vector<uint8_t> a(c->object_bytes()), b(c->object_bytes());
        for (uint32_t i = 0; i < n; ++i) {
            check(c->page_matches(n + i, seed_of(first + i, o.tp_rank)), "page " + std::to_string(i) + " differs");
            for (uint32_t part : {KVTIER_PART_K, KVTIER_PART_V}) {
                c->read_object(i, part, rust::Slice<uint8_t>(a.data(), a.size()));
                c->read_object(n + i, part, rust::Slice<uint8_t>(b.data(), b.size()));
                check(a == b, "object bytes of page " + std::to_string(i) + " differ");
            }
        }
        // The same rule from the bridge: layer 0 of part K is pattern(seed ^ 0 ^ 0).
        rust::Vec<uint8_t> want = kvtier::pattern(seed_of(first, o.tp_rank), a.size() / o.layers);
        c->read_object(n, KVTIER_PART_K, rust::Slice<uint8_t>(a.data(), a.size()));
        check(std::equal(want.begin(), want.end(), a.begin()), "layer 0 of page 0 is not the pattern");

    }

    // Each kind of hint gets an outcome.
    send_hint(*c, KVTIER_HINT_SHARE, KVTIER_TARGET_PAGES, hashes, "", 0);
    send_hint(*c, KVTIER_HINT_PREFETCH, KVTIER_TARGET_PREFIX, hashes, "", KVTIER_TIER_HOST);
    send_hint(*c, KVTIER_HINT_DEMOTE, KVTIER_TARGET_PAGES, hashes, "", KVTIER_TIER_POOL);
    send_hint(*c, KVTIER_HINT_PIN, KVTIER_TARGET_PAGES, hashes, "", KVTIER_TIER_HOST);
    send_hint(*c, KVTIER_HINT_RETAIN, KVTIER_TARGET_SESSION, {}, session, 0);

    // Malformed calls are exceptions with their codes; the process goes on.
    expect_code(KVTIER_ERR_EMPTY_BATCH, "empty lookup", [&] { c->lookup(rust::Slice<const uint8_t>(), 8); });
    expect_code(KVTIER_ERR_LENGTH_MISMATCH, "mismatched store", [&] {
        c->store(hs, 8, rust::Slice<const uint32_t>(slots.data(), slots.size() - 1), session);
    });
    expect_code(KVTIER_ERR_INVALID, "bad hint kind", [&] { send_hint(*c, 99, KVTIER_TARGET_PAGES, hashes, "", 0); });
    if (!host_runs) expect_code(KVTIER_ERR_DEVICE, "slot out of range", [&] { c->fill_page(2 * n, 1); });

    // The advice stream, as the JSON of kvtier_take_advice; page advice may have gone
    // to the other rank (whichever asks first takes it), so only its shape is checked.
    const std::string advice(c->take_advice(4096));
    check(advice.rfind("{\"more\":", 0) == 0 && advice.find("\"advice\":[") != std::string::npos,
          "advice is not the documented JSON: " + advice);
    std::cout << "advice ok" << std::endl;

    c->session(session, "", KVTIER_PHASE_ENDED);
    std::cout << "OK rank=" << o.tp_rank << " loaded=" << loaded << std::endl;
    return 0;
}

}  // namespace

int main(int argc, char **argv) {
    try {
        return run(argc, argv);
    } catch (const rust::Error &e) {
        std::cout << "FAIL: kvtier error " << kvtier::error_code(e) << ": " << e.what() << std::endl;
    } catch (const std::exception &e) {
        std::cout << "FAIL: " << e.what() << std::endl;
    }
    return 1;
}
