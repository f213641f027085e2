/*
 * A stand-in for libmooncake_store.so, for tests of kvtier's C ABI plumbing (bindings,
 * run-time loading, array and result conventions) where the real library is not built.
 * It keeps objects in process memory and follows upstream's return codes: -704 not
 * found, -706 leased (an object read since it was written cannot be removed unforced),
 * -600 buffer too small. It is compiled by the test that uses it, never shipped.
 */
#include <stdlib.h>
#include <string.h>

#include "../../include/mooncake_store_c.h"

#define MAX_OBJECTS 256

struct object {
    char *key;
    void *bytes;
    size_t len;
    int leased;
};

struct stub {
    struct object objects[MAX_OBJECTS];
    int setup;
};

static struct object *find(struct stub *s, const char *key) {
    for (int i = 0; i < MAX_OBJECTS; i++)
        if (s->objects[i].key && strcmp(s->objects[i].key, key) == 0) return &s->objects[i];
    return NULL;
}

mooncake_store_t mooncake_store_create(void) { return calloc(1, sizeof(struct stub)); }

void mooncake_store_destroy(mooncake_store_t store) {
    struct stub *s = store;
    for (int i = 0; i < MAX_OBJECTS; i++) {
        free(s->objects[i].key);
        free(s->objects[i].bytes);
    }
    free(s);
}

int mooncake_store_setup(mooncake_store_t store, const char *local_hostname, const char *metadata_server,
                         uint64_t global_segment_size, uint64_t local_buffer_size, const char *protocol,
                         const char *device_name, const char *master_server_addr) {
    (void)local_hostname, (void)metadata_server, (void)global_segment_size, (void)local_buffer_size;
    (void)protocol, (void)device_name, (void)master_server_addr;
    ((struct stub *)store)->setup = 1;
    return 0;
}

int mooncake_store_register_buffer(mooncake_store_t store, void *buffer, size_t size) {
    (void)store, (void)buffer, (void)size;
    return 0;
}

int mooncake_store_unregister_buffer(mooncake_store_t store, void *buffer) {
    (void)store, (void)buffer;
    return 0;
}

int mooncake_store_batch_put_from(mooncake_store_t store, const char **keys, void **buffers, const size_t *sizes,
                                  size_t count, const mooncake_replicate_config_t *config, int *results_out) {
    struct stub *s = store;
    (void)config;
    for (size_t i = 0; i < count; i++) {
        results_out[i] = -200;
        if (find(s, keys[i])) {
            results_out[i] = 0;
            continue;
        }
        for (int j = 0; j < MAX_OBJECTS; j++) {
            if (s->objects[j].key) continue;
            s->objects[j].key = strdup(keys[i]);
            s->objects[j].bytes = malloc(sizes[i]);
            memcpy(s->objects[j].bytes, buffers[i], sizes[i]);
            s->objects[j].len = sizes[i];
            s->objects[j].leased = 0;
            results_out[i] = 0;
            break;
        }
    }
    return 0;
}

int mooncake_store_batch_get_into(mooncake_store_t store, const char **keys, void **buffers, const size_t *sizes,
                                  size_t count, int64_t *results_out) {
    for (size_t i = 0; i < count; i++) {
        struct object *o = find(store, keys[i]);
        if (!o) {
            results_out[i] = -704;
        } else if (sizes[i] < o->len) {
            results_out[i] = -600;
        } else {
            memcpy(buffers[i], o->bytes, o->len);
            o->leased = 1;
            results_out[i] = (int64_t)o->len;
        }
    }
    return 0;
}

int mooncake_store_batch_is_exist(mooncake_store_t store, const char **keys, size_t count, int *results_out) {
    for (size_t i = 0; i < count; i++) results_out[i] = find(store, keys[i]) ? 1 : 0;
    return 0;
}

int mooncake_store_remove(mooncake_store_t store, const char *key, int force) {
    struct object *o = find(store, key);
    if (!o) return -704;
    if (o->leased && !force) return -706;
    free(o->key);
    free(o->bytes);
    memset(o, 0, sizeof *o);
    return 0;
}

int mooncake_store_health_check(mooncake_store_t store) { return ((struct stub *)store)->setup ? 0 : 1; }
