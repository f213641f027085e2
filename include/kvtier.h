/*
 * kvtier.h: the plain C ABI of the kvtier engine client (one engine rank).
 *
 * For Python ctypes and anything else that calls C. No Rust types cross it: opaque
 * handles, fixed-width integers, byte buffers. Every function returns an int32_t code,
 * KVTIER_OK (0) on success or a negative KVTIER_ERR_* code; the message of the last
 * failure on the calling thread is kvtier_last_error(). Null pointers, wrong struct sizes
 * and mismatched array lengths return an error code; they never abort the process. Every
 * call has a timeout (the connect option timeout_ms, 5 s by default).
 *
 * Page hashes are opaque byte strings of 8 to 32 bytes chosen by the engine. A batch is
 * `count` hashes of `hash_len` bytes each, back to back (a u64 block hash is 8 bytes,
 * big-endian, so its hex key reads like the number).
 *
 * A client handle is thread-safe: calls on one handle are serialised. A handle is an
 * opaque id, never a pointer kvtier dereferences: a call on a closed handle (or on any
 * value that did not come from kvtier_connect) returns KVTIER_ERR_CLOSED, a second
 * kvtier_close of one handle returns KVTIER_ERR_CLOSED and frees nothing, and a close
 * while another thread's call is in flight on the handle lets that call finish first.
 */
#ifndef KVTIER_H
#define KVTIER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Return codes ------------------------------------------------------------------ */
#define KVTIER_OK 0
#define KVTIER_ERR_NULL (-1)             /* a required pointer argument was null */
#define KVTIER_ERR_INVALID (-2)          /* bad argument: struct size, hash length, enum */
#define KVTIER_ERR_EMPTY_BATCH (-3)      /* a batch with no entries */
#define KVTIER_ERR_LENGTH_MISMATCH (-4)  /* parallel arrays of different lengths */
#define KVTIER_ERR_UNAVAILABLE (-5)      /* daemon not reachable; retry later */
#define KVTIER_ERR_TIMEOUT (-6)          /* daemon did not answer in time */
#define KVTIER_ERR_PROTOCOL (-7)         /* unexpected answer from the daemon */
#define KVTIER_ERR_ARENA (-8)            /* host arena could not be mapped, or bad slot */
#define KVTIER_ERR_DEVICE (-9)           /* device copy failed, or bad device slot/part */
#define KVTIER_ERR_LAYOUT (-10)          /* invalid layout or identity */
#define KVTIER_ERR_INTERNAL (-11)        /* a bug inside kvtier; close the handle */
#define KVTIER_ERR_BUFFER_TOO_SMALL (-12)
#define KVTIER_ERR_UNSUPPORTED (-13)     /* kvtier was built without the `cuda` feature */
#define KVTIER_ERR_CLOSED (-14)          /* handle closed already, or not from kvtier_connect */
#define KVTIER_ERR_UNTRUSTED (-15)       /* the socket's peer or the arena is another uid's than
                                          * the daemon's expected uid (message names both) */
/* The daemon refused the request: code = KVTIER_ERR_REMOTE_BASE - daemon code, with
 * daemon codes 1 bad_frame, 2 unsupported_version, 3 frame_too_large, 4 unknown_message,
 * 5 not_connected, 6 layout_mismatch, 7 bad_layout, 8 unknown_grant, 9 no_space,
 * 10 bad_hint, 11 bad_request, 12 too_many_connections, 13 shutting_down, 14 internal,
 * 15 recovering (the daemon is rebuilding its index after a restart; retry shortly). */
#define KVTIER_ERR_REMOTE_BASE (-100)

/* ---- Enumerations ------------------------------------------------------------------ */
#define KVTIER_ATTENTION_MHA 0u
#define KVTIER_ATTENTION_MLA 1u
#define KVTIER_ORDER_LAYER_FIRST 0u
#define KVTIER_ORDER_PAGE_FIRST 1u

/* Element types (kvtier_connect_options_t.dtype). Unspecified: only dtype_bytes is known;
 * its pages are an identity of their own, never shared with a named dtype's. */
#define KVTIER_DTYPE_UNSPECIFIED 0u
#define KVTIER_DTYPE_F16 1u
#define KVTIER_DTYPE_BF16 2u
#define KVTIER_DTYPE_F32 3u
#define KVTIER_DTYPE_FP8_E4M3 4u
#define KVTIER_DTYPE_FP8_E5M2 5u
#define KVTIER_DTYPE_U8 6u

/* Bytes inside one page of one (part, layer) (kvtier_connect_options_t.kv_order): NHD
 * [token][head][dim]; HND [head][token][dim]; PACKED_*: K and V packed per token and head
 * ([..][K dims, V dims], vLLM's 4-D blocks), the packed run registered as two halves. */
#define KVTIER_KV_ORDER_NHD 0u
#define KVTIER_KV_ORDER_HND 1u
#define KVTIER_KV_ORDER_PACKED_NHD 2u
#define KVTIER_KV_ORDER_PACKED_HND 3u

#define KVTIER_PART_K 0u
#define KVTIER_PART_V 1u
#define KVTIER_PART_LATENT 2u

#define KVTIER_TIER_DEVICE 0u
#define KVTIER_TIER_HOST 1u
#define KVTIER_TIER_POOL 2u

#define KVTIER_LOAD_BEST_EFFORT 0u   /* take what is complete now */
#define KVTIER_LOAD_WAIT_COMPLETE 1u /* wait for pages being stored (bounded by the daemon) */
#define KVTIER_LOAD_TIMEOUT 2u       /* wait at most wait_ms, then take what is complete */

#define KVTIER_PHASE_REASONING 0u
#define KVTIER_PHASE_ACTING 1u
#define KVTIER_PHASE_PAUSED 2u
#define KVTIER_PHASE_ENDED 3u

/* Advice kinds (kvtier_take_advice's "kind"). Page advice names page hashes; session
 * advice names a session the daemon's pressure controller paused or let resume. */
#define KVTIER_ADVICE_EVICT_FIRST 0u   /* evict these device pages first (colder copy exists) */
#define KVTIER_ADVICE_OFFLOAD 1u       /* store these device pages to host */
#define KVTIER_ADVICE_READY_TO_LOAD 2u /* staged in host: load them now */
#define KVTIER_ADVICE_PAUSE 3u         /* stop admitting this session's turns */
#define KVTIER_ADVICE_RESUME 4u        /* the session may run again */

#define KVTIER_HINT_SHARE 1u
#define KVTIER_HINT_PREFETCH 2u
#define KVTIER_HINT_DEMOTE 3u
#define KVTIER_HINT_PIN 4u
#define KVTIER_HINT_RETAIN 5u

#define KVTIER_TARGET_PAGES 0u
#define KVTIER_TARGET_PREFIX 1u
#define KVTIER_TARGET_SESSION 2u

#define KVTIER_OUTCOME_ACCEPTED 0u
#define KVTIER_OUTCOME_CLIPPED 1u
#define KVTIER_OUTCOME_DEFERRED 2u
#define KVTIER_OUTCOME_IGNORED 3u

/* Hint reasons: 0 none, 1 unknown_pages, 2 pin_budget, 3 max_ttl, 4 queue_full,
 * 5 pool_degraded, 6 no_space, 7 already_there, 8 not_complete, 9 unknown_session,
 * 10 wrong_tier, 11 in_flight, 12 no_pool, 13 unknown_action, 14 unsupported_version. */

/* ---- Types ------------------------------------------------------------------------- */
typedef struct kvtier_client kvtier_client_t;

/* Set struct_size = sizeof(kvtier_connect_options_t). Strings are NUL-terminated UTF-8;
 * lora and salt may be null (empty). The size is the version: a struct that ends at
 * timeout_ms (the first version) is accepted too, with has_daemon_uid = 0.
 * Before anything is sent, the process serving the socket (SO_PEERCRED) and the arena file
 * it names must belong to the expected daemon uid: daemon_uid when has_daemon_uid is
 * non-zero, else this process's effective uid; otherwise KVTIER_ERR_UNTRUSTED. */
typedef struct kvtier_connect_options {
    size_t struct_size;
    const char *socket;
    const char *instance;
    const char *model;
    const char *lora;
    const char *salt;
    uint16_t tp_rank, tp_size, pp_rank, pp_size, dp_rank;
    uint32_t layers, kv_heads, head_dim, dtype_bytes, page_tokens;
    uint32_t attention;  /* KVTIER_ATTENTION_* */
    uint32_t byte_order; /* KVTIER_ORDER_* */
    uint32_t timeout_ms; /* every call's timeout; 0 = 5000 */
    /* Second version of the struct (a first-version struct_size, ending at timeout_ms,
     * still connects, with dtype unspecified and NHD order). */
    uint32_t dtype;      /* KVTIER_DTYPE_*: part of a page's identity */
    uint32_t kv_order;   /* KVTIER_KV_ORDER_*: bytes inside one page of one (part, layer) */
    /* Third version: the daemon's uid (a second-version struct_size, ending at kv_order,
     * still connects, expecting this process's uid). */
    uint32_t has_daemon_uid; /* non-zero: daemon_uid is the daemon's uid */
    uint32_t daemon_uid;
} kvtier_connect_options_t;

/* Contiguous prefix of complete pages credited to the nearest tier holding them. */
typedef struct kvtier_prefix_hit {
    uint64_t device, host, pool;
} kvtier_prefix_hit_t;

typedef struct kvtier_store_receipt {
    uint64_t ticket;   /* kvtier_wait on it for completeness across ranks */
    uint64_t written;  /* pages this rank wrote (others were already on host) */
    uint32_t complete; /* pages complete across every rank at commit time */
} kvtier_store_receipt_t;

typedef struct kvtier_ticket_status {
    uint32_t complete, total, failed;
} kvtier_ticket_status_t;

/* Set struct_size = sizeof(kvtier_hint_t). Fields a kind does not use are ignored. */
typedef struct kvtier_hint {
    size_t struct_size;
    uint32_t kind;          /* KVTIER_HINT_* */
    uint32_t target;        /* KVTIER_TARGET_* */
    const uint8_t *hashes;  /* pages / prefix targets */
    size_t hash_len;
    size_t count;
    const char *session;    /* session target */
    uint32_t tier;          /* prefetch/demote destination, pin tier: KVTIER_TIER_* */
    int32_t priority;       /* retain: -128..127 */
    uint64_t ttl_ms;        /* pin, retain */
    uint64_t deadline_ms;   /* prefetch; 0 = none */
} kvtier_hint_t;

typedef struct kvtier_hint_outcome {
    uint32_t outcome;   /* KVTIER_OUTCOME_* */
    uint32_t reason;    /* 0 or a hint reason */
    uint64_t applied;   /* pages the hint applied to (accepted, clipped, deferred) */
    uint64_t requested; /* pages asked for (clipped) */
} kvtier_hint_outcome_t;

/* ---- Errors ------------------------------------------------------------------------ */
/* Message of the last failure on this thread ("" if none); valid until the next call. */
const char *kvtier_last_error(void);
/* A stable name for a code ("ok", "null", "unavailable", "remote", ...). Never null. */
const char *kvtier_error_name(int32_t code);

/* ---- Connection -------------------------------------------------------------------- */
/* The daemon's default control socket, as `kvtier serve` picks it: KVTIER_SOCKET, else
 * kvtier.sock in $XDG_RUNTIME_DIR/kvtier, else in /run/user/<uid>/kvtier when that is this
 * user's private directory, else ./.kvtier. Writes it NUL-terminated into buf (capacity
 * *len) and sets *len to the bytes used; KVTIER_ERR_BUFFER_TOO_SMALL sets *len to the
 * bytes needed (buf may be null then). */
int32_t kvtier_default_socket(char *buf, size_t *len);
int32_t kvtier_connect(const kvtier_connect_options_t *opts, kvtier_client_t **out);
/* Closes the handle; null is a no-op; a handle closed already is KVTIER_ERR_CLOSED. */
int32_t kvtier_close(kvtier_client_t *client);

/* ---- Device region ----------------------------------------------------------------- */
/* Creates an emulated device region of `pages` pages (a host buffer laid out like GPU KV)
 * and registers it; later copies go through it. */
int32_t kvtier_register_emulated(kvtier_client_t *client, uint32_t pages);
/* Allocates a region of `pages` pages on GPU `ordinal` and registers it; the arena is
 * pinned for it. KVTIER_ERR_UNSUPPORTED when kvtier was built without the `cuda` feature,
 * KVTIER_ERR_DEVICE when no driver/GPU is present. */
int32_t kvtier_register_cuda(kvtier_client_t *client, uint32_t ordinal, uint32_t pages);
/* Registers the engine's own KV tensors on GPU `ordinal` as this rank's region; kvtier
 * copies pages in and out of them and never frees them. `ptrs[p * layers + l]` is the
 * device address of page 0 of part p (K = 0 then V = 1 for MHA; the latent for MLA),
 * layer l of this rank's PP stage, so n_ptrs = parts x stage layers. Page s of each
 * tensor is the contiguous run of page_tokens x heads x head_dim x dtype bytes at
 * ptrs[i] + s * page_stride, for s < pages (vLLM [2, blocks, ...]: K = t[0], V = t[1],
 * stride one block; [blocks, 2, ...]: stride two blocks; SGLang: k_buffer/v_buffer,
 * stride page_size tokens). `stream` is the engine's compute stream (a CUstream, 0 = the
 * default stream): copies out of the tensors wait for the work queued on it. The tensors
 * must stay allocated until the client is closed or another region is registered.
 * KVTIER_ERR_NULL (null ptrs), KVTIER_ERR_LENGTH_MISMATCH (n_ptrs wrong for the layout),
 * KVTIER_ERR_INVALID (a null address, page_stride below one page, pages 0, overlapping
 * tensors) in every build; then KVTIER_ERR_UNSUPPORTED without the `cuda` feature and
 * KVTIER_ERR_DEVICE without a driver. */
int32_t kvtier_register_cuda_tensors(kvtier_client_t *client, uint32_t ordinal, const uint64_t *ptrs, size_t n_ptrs,
                                     uint64_t page_stride, uint32_t pages, uint64_t stream);
/* Registers the engine's own KV tensors in host memory as this rank's region (vLLM's KV
 * caches on CPU, SGLang's HiCache host pool): kvtier copies pages directly between them
 * and its arena, with no staging buffer. Addresses as kvtier_register_cuda_tensors
 * (ptrs[p * layers + l] is page 0 of part p, layer l; page s at ptrs[i] + s * page_stride,
 * s < pages). With a page-first layout (byte_order 1), n_ptrs = parts instead says each
 * page of part p is one whole page-first object ([token][layer][head][dim]) at
 * ptrs[p] + s * page_stride, copied as one run (SGLang's `page_first` host pool). The
 * memory must stay allocated and mapped until the client is closed or
 * another region is registered. KVTIER_ERR_NULL, KVTIER_ERR_LENGTH_MISMATCH,
 * KVTIER_ERR_INVALID as for the CUDA tensors. */
int32_t kvtier_register_host_tensors(kvtier_client_t *client, const uint64_t *ptrs, size_t n_ptrs,
                                     uint64_t page_stride, uint32_t pages);
/* As kvtier_register_host_tensors and kvtier_register_cuda_tensors, for tensors whose
 * page of one (part, layer) is not one contiguous run but `runs` runs of equal bytes
 * (page bytes / runs), run r of page s at ptrs[i] + s * page_stride + r * run_stride; the
 * page's bytes are the runs in order (vLLM's LHBNC/BHLNC layouts: one run per head, at
 * the head stride). runs = 1 is the entries above (run_stride unused). Layer-first
 * layouts only. KVTIER_ERR_INVALID besides: runs 0, above 1024 or not dividing the page,
 * a run stride below one run, a page-first layout, runs of pages overlapping. */
int32_t kvtier_register_host_tensor_runs(kvtier_client_t *client, const uint64_t *ptrs, size_t n_ptrs,
                                         uint64_t page_stride, uint32_t pages, uint32_t runs, uint64_t run_stride);
int32_t kvtier_register_cuda_tensor_runs(kvtier_client_t *client, uint32_t ordinal, const uint64_t *ptrs,
                                         size_t n_ptrs, uint64_t page_stride, uint32_t pages, uint32_t runs,
                                         uint64_t run_stride, uint64_t stream);
/* Bytes of one object (one part of one page) of this rank. */
int32_t kvtier_object_bytes(const kvtier_client_t *client, size_t *out);
/* Writes the deterministic test pattern of `seed` into every part and layer of a page. */
int32_t kvtier_device_fill_page(kvtier_client_t *client, uint32_t slot, uint64_t seed);
/* *out = 1 when the page holds exactly the pattern of `seed`, else 0. */
int32_t kvtier_device_page_matches(kvtier_client_t *client, uint32_t slot, uint64_t seed, int32_t *out);
/* Copies one object (KVTIER_PART_*) in or out of a device page; len = object bytes. */
int32_t kvtier_device_write_object(kvtier_client_t *client, uint32_t slot, uint32_t part, const uint8_t *data,
                                   size_t len);
int32_t kvtier_device_read_object(kvtier_client_t *client, uint32_t slot, uint32_t part, uint8_t *out, size_t len);

/* ---- Pages ------------------------------------------------------------------------- */
int32_t kvtier_lookup(kvtier_client_t *client, const uint8_t *hashes, size_t hash_len, size_t count,
                      kvtier_prefix_hit_t *out);
/* Offloads pages: slots[i] holds page i in the device region. slot_count must equal count. */
int32_t kvtier_store(kvtier_client_t *client, const uint8_t *hashes, size_t hash_len, size_t count,
                     const uint32_t *slots, size_t slot_count, const char *session, kvtier_store_receipt_t *out);
/* kvtier_store with each page's token ids, which the KV events' BlockStored then carries
 * (token-indexing routers, e.g. Dynamo's, need them): page i's ids are
 * tokens[i * tokens_per_page .. (i + 1) * tokens_per_page] (1 to 4096 a page). `parent`
 * is null or hash_len bytes: the hash of the page before page 0 in its chain (page i's
 * parent is page i - 1). tokens null stores without ids and without the parent, as
 * kvtier_store. */
int32_t kvtier_store_tokens(kvtier_client_t *client, const uint8_t *hashes, size_t hash_len, size_t count,
                            const uint32_t *slots, size_t slot_count, const char *session, const uint8_t *parent,
                            const uint32_t *tokens, size_t tokens_per_page, kvtier_store_receipt_t *out);
/* Loads the leading pages complete on host into slots; *loaded = how many. */
int32_t kvtier_load(kvtier_client_t *client, const uint8_t *hashes, size_t hash_len, size_t count,
                    const uint32_t *slots, size_t slot_count, uint32_t wait_mode, uint32_t wait_ms, size_t *loaded);
int32_t kvtier_poll(kvtier_client_t *client, uint64_t ticket, kvtier_ticket_status_t *out);
int32_t kvtier_wait(kvtier_client_t *client, uint64_t ticket, uint32_t timeout_ms, kvtier_ticket_status_t *out);
/* The engine freed these device pages. */
int32_t kvtier_removed(kvtier_client_t *client, const uint8_t *hashes, size_t hash_len, size_t count);

/* ---- Sessions and hints ------------------------------------------------------------ */
/* parent may be null. phase: KVTIER_PHASE_*. */
int32_t kvtier_session(kvtier_client_t *client, const char *id, const char *parent, uint32_t phase);
/* A request of session id ended: its prompt's page hashes and token counts, no content
 * (session lineage; request traces when the daemon writes them). parent may be null. */
int32_t kvtier_request_end(kvtier_client_t *client, const char *id, const char *parent, uint64_t input_length,
                           uint64_t output_length, const uint8_t *hashes, size_t hash_len, size_t count);
int32_t kvtier_hint(kvtier_client_t *client, const kvtier_hint_t *hint, kvtier_hint_outcome_t *out);
/* Passes on a Dynamo KvHint envelope (JSON text, as a router attached it to the request:
 * vLLM's Request.kv_hints, SGLang's kv_hints). kv.fetch@1.x becomes a prefetch to host;
 * other actions and versions are ignored with a reason. The report (JSON: message_id and
 * per action action_id, outcome {outcome, reason, ...} or error, source_control_endpoint)
 * is written NUL-terminated into report (report_cap bytes); *report_len = its length
 * without the NUL. report may be null with report_cap 0 to skip it. A malformed envelope
 * is KVTIER_ERR_REMOTE_BASE - 10 (bad_hint); KVTIER_ERR_BUFFER_TOO_SMALL means the envelope
 * was applied but the report did not fit (*report_len says how much is needed). */
int32_t kvtier_kv_hints(kvtier_client_t *client, const char *envelope, char *report, size_t report_cap,
                        size_t *report_len);
/* Takes the advice waiting for this rank's namespace (at most max_pages page hashes),
 * oldest first, as NUL-terminated JSON in buf (cap bytes); *len = its length without the
 * NUL: {"more": bool, "advice": [{"kind": KVTIER_ADVICE_*, "name": "pause",
 * "session_id": "..."}, {"kind": 2, "name": "ready_to_load", "hashes": ["<hex>", ...]}]}.
 * Advice is taken once: ask from one rank. KVTIER_ERR_BUFFER_TOO_SMALL keeps the advice
 * for the next call and sets *len to what it needs; "more" true means ask again. */
int32_t kvtier_take_advice(kvtier_client_t *client, uint32_t max_pages, char *buf, size_t cap, size_t *len);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_H */
