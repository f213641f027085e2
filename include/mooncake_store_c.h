/*
 * kvtier's declarations of the subset of Mooncake Store's C ABI it calls.
 *
 * These mirror the functions that upstream Mooncake exports from libmooncake_store.so
 * (mooncake-store/include/store_c.h); kvtier declares them itself so that the build needs
 * no Mooncake source tree. bindgen turns this file into Rust bindings that load the
 * library at run time (feature `mooncake-c`, library path in MOONCAKE_STORE_LIBRARY).
 *
 * Conventions of the ABI: every function returns 0 or a non-negative length on success
 * and a negative Mooncake ErrorCode otherwise (-704 object not found, -706 object has a
 * lease, -600 invalid parameters such as a buffer too small). Strings are copied by the
 * callee; buffers passed to *_from / *_into must lie in memory registered with
 * mooncake_store_register_buffer.
 */
#ifndef KVTIER_MOONCAKE_STORE_C_H
#define KVTIER_MOONCAKE_STORE_C_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* An opaque client handle. */
typedef void *mooncake_store_t;

/* Placement options of a put; NULL means the store's defaults (one replica). */
typedef struct mooncake_replicate_config {
    size_t replica_num;
    int with_soft_pin;
    int with_hard_pin;
    const char **preferred_segments;
    size_t preferred_segments_count;
} mooncake_replicate_config_t;

mooncake_store_t mooncake_store_create(void);
void mooncake_store_destroy(mooncake_store_t store);

/* Connects to the master and mounts global_segment_size bytes of this process's memory. */
int mooncake_store_setup(mooncake_store_t store, const char *local_hostname, const char *metadata_server,
                         uint64_t global_segment_size, uint64_t local_buffer_size, const char *protocol,
                         const char *device_name, const char *master_server_addr);

int mooncake_store_register_buffer(mooncake_store_t store, void *buffer, size_t size);
int mooncake_store_unregister_buffer(mooncake_store_t store, void *buffer);

/* results_out[i] receives 0 or a negative code for keys[i]. */
int mooncake_store_batch_put_from(mooncake_store_t store, const char **keys, void **buffers, const size_t *sizes,
                                  size_t count, const mooncake_replicate_config_t *config, int *results_out);

/* results_out[i] receives the object's length or a negative code. */
int mooncake_store_batch_get_into(mooncake_store_t store, const char **keys, void **buffers, const size_t *sizes,
                                  size_t count, int64_t *results_out);

/* results_out[i] receives 1 (exists), 0 (absent) or a negative code. */
int mooncake_store_batch_is_exist(mooncake_store_t store, const char **keys, size_t count, int *results_out);

int mooncake_store_remove(mooncake_store_t store, const char *key, int force);

int mooncake_store_health_check(mooncake_store_t store);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_MOONCAKE_STORE_C_H */
