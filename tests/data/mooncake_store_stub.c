/*
 * A stand-in for libmooncake_store.so, for tests of kvtier's `mooncake-c` backend where the
 * real library is not built. It implements every function of upstream's C ABI exactly as
 * the vendored header (include/upstream/mooncake/store_c.h) declares it, keeping objects in
 * process memory, and follows upstream's return codes: -1 a bad argument, -704 not found,
 * -706 leased (an object read since it was written cannot be removed unforced), -600
 * buffer too small, -200 store full. It is compiled by the tests that use it, never shipped.
 *
 * Test hooks, read at mooncake_store_setup:
 *   device_name "stall-ms=N"  every batch_is_exist waits N ms first (a stalled master).
 *   KVTIER_STUB_LOG (env)     a file that gets one line per batch put/get/exist call: "put N".
 * Compiled with -DKVTIER_STUB_WRONG_ABI, it leaves out mooncake_store_remove_all, as a
 * library built from another version of the header would.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../include/upstream/mooncake/store_c.h"

#define MAX_OBJECTS 8192

struct object {
    char *key;
    void *bytes;
    size_t len;
    int leased;
};

struct stub {
    pthread_mutex_t lock;
    struct object objects[MAX_OBJECTS];
    int setup;
    long stall_ms;
    FILE *log;
};

static struct object *find(struct stub *s, const char *key) {
    for (int i = 0; i < MAX_OBJECTS; i++)
        if (s->objects[i].key && strcmp(s->objects[i].key, key) == 0) return &s->objects[i];
    return NULL;
}

static void drop(struct object *o) {
    free(o->key);
    free(o->bytes);
    memset(o, 0, sizeof *o);
}

static void note(struct stub *s, const char *op, size_t n) {
    if (s->log) {
        fprintf(s->log, "%s %zu\n", op, n);
        fflush(s->log);
    }
}

/* Stores one object; 0 or a negative code. The caller holds the lock. */
static int put_one(struct stub *s, const char *key, const void *value, size_t size) {
    if (find(s, key)) return 0; /* keys name immutable content: already there is success */
    for (int j = 0; j < MAX_OBJECTS; j++) {
        struct object *o = &s->objects[j];
        if (o->key) continue;
        o->key = strdup(key);
        o->bytes = malloc(size ? size : 1);
        if (!o->key || !o->bytes) {
            drop(o);
            return -200;
        }
        memcpy(o->bytes, value, size);
        o->len = size;
        o->leased = 0;
        return 0;
    }
    return -200;
}

/* Reads one object into buffer; its length or a negative code. The caller holds the lock. */
static int64_t get_one(struct stub *s, const char *key, void *buffer, size_t size) {
    struct object *o = find(s, key);
    if (!o) return -704;
    if (size < o->len) return -600;
    memcpy(buffer, o->bytes, o->len);
    o->leased = 1;
    return (int64_t)o->len;
}

mooncake_store_t mooncake_store_create() {
    struct stub *s = calloc(1, sizeof(struct stub));
    if (s) pthread_mutex_init(&s->lock, NULL);
    return s;
}

void mooncake_store_destroy(mooncake_store_t store) {
    struct stub *s = store;
    if (!s) return;
    for (int i = 0; i < MAX_OBJECTS; i++) drop(&s->objects[i]);
    if (s->log) fclose(s->log);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

int mooncake_store_setup(mooncake_store_t store, const char *local_hostname, const char *metadata_server,
                         uint64_t global_segment_size, uint64_t local_buffer_size, const char *protocol,
                         const char *device_name, const char *master_server_addr) {
    struct stub *s = store;
    (void)local_hostname, (void)metadata_server, (void)global_segment_size, (void)local_buffer_size;
    (void)protocol;
    if (!s || !master_server_addr) return -1;
    if (device_name && strncmp(device_name, "stall-ms=", 9) == 0) s->stall_ms = atol(device_name + 9);
    const char *log = getenv("KVTIER_STUB_LOG");
    if (log && *log) s->log = fopen(log, "a");
    s->setup = 1;
    return 0;
}

int mooncake_store_init_all(mooncake_store_t store, const char *protocol, const char *device_name,
                            uint64_t mount_segment_size) {
    (void)protocol, (void)device_name, (void)mount_segment_size;
    return store ? 0 : -1;
}

int mooncake_store_health_check(mooncake_store_t store) {
    if (!store) return -1;
    return ((struct stub *)store)->setup ? 0 : 1;
}

int mooncake_store_put(mooncake_store_t store, const char *key, const void *value, size_t size,
                       const mooncake_replicate_config_t *config) {
    struct stub *s = store;
    (void)config;
    if (!s || !key || (!value && size > 0)) return -1;
    pthread_mutex_lock(&s->lock);
    int rc = put_one(s, key, value, size);
    pthread_mutex_unlock(&s->lock);
    return rc;
}

int mooncake_store_put_from(mooncake_store_t store, const char *key, void *buffer, size_t size,
                            const mooncake_replicate_config_t *config) {
    return mooncake_store_put(store, key, buffer, size, config);
}

int mooncake_store_batch_put_from(mooncake_store_t store, const char **keys, void **buffers, const size_t *sizes,
                                  size_t count, const mooncake_replicate_config_t *config, int *results_out) {
    struct stub *s = store;
    (void)config;
    if (!s || !keys || !buffers || !sizes || !results_out) return -1;
    for (size_t i = 0; i < count; i++)
        if (!keys[i] || (!buffers[i] && sizes[i] > 0)) return -1;
    pthread_mutex_lock(&s->lock);
    note(s, "put", count);
    for (size_t i = 0; i < count; i++) results_out[i] = put_one(s, keys[i], buffers[i], sizes[i]);
    pthread_mutex_unlock(&s->lock);
    return 0;
}

int64_t mooncake_store_get_into(mooncake_store_t store, const char *key, void *buffer, size_t size) {
    struct stub *s = store;
    if (!s || !key || (!buffer && size > 0)) return -1;
    pthread_mutex_lock(&s->lock);
    int64_t rc = get_one(s, key, buffer, size);
    pthread_mutex_unlock(&s->lock);
    return rc;
}

int mooncake_store_batch_get_into(mooncake_store_t store, const char **keys, void **buffers, const size_t *sizes,
                                  size_t count, int64_t *results_out) {
    struct stub *s = store;
    if (!s || !keys || !buffers || !sizes || !results_out) return -1;
    for (size_t i = 0; i < count; i++)
        if (!keys[i] || (!buffers[i] && sizes[i] > 0)) return -1;
    pthread_mutex_lock(&s->lock);
    note(s, "get", count);
    for (size_t i = 0; i < count; i++) results_out[i] = get_one(s, keys[i], buffers[i], sizes[i]);
    pthread_mutex_unlock(&s->lock);
    return 0;
}

int mooncake_store_is_exist(mooncake_store_t store, const char *key) {
    struct stub *s = store;
    if (!s || !key) return -1;
    pthread_mutex_lock(&s->lock);
    int rc = find(s, key) ? 1 : 0;
    pthread_mutex_unlock(&s->lock);
    return rc;
}

int mooncake_store_batch_is_exist(mooncake_store_t store, const char **keys, size_t count, int *results_out) {
    struct stub *s = store;
    if (!s || !keys || !results_out) return -1;
    for (size_t i = 0; i < count; i++)
        if (!keys[i]) return -1;
    if (s->stall_ms > 0) {
        struct timespec t = {s->stall_ms / 1000, (s->stall_ms % 1000) * 1000000L};
        nanosleep(&t, NULL);
    }
    pthread_mutex_lock(&s->lock);
    note(s, "exist", count);
    for (size_t i = 0; i < count; i++) results_out[i] = find(s, keys[i]) ? 1 : 0;
    pthread_mutex_unlock(&s->lock);
    return 0;
}

int64_t mooncake_store_get_size(mooncake_store_t store, const char *key) {
    struct stub *s = store;
    if (!s || !key) return -1;
    pthread_mutex_lock(&s->lock);
    struct object *o = find(s, key);
    int64_t rc = o ? (int64_t)o->len : -704;
    pthread_mutex_unlock(&s->lock);
    return rc;
}

int mooncake_store_get_hostname(mooncake_store_t store, char *buf_out, size_t buf_len) {
    static const char name[] = "stub";
    if (!store || !buf_out || buf_len < sizeof name) return -1;
    memcpy(buf_out, name, sizeof name);
    return 0;
}

int mooncake_store_remove(mooncake_store_t store, const char *key, int force) {
    struct stub *s = store;
    if (!s || !key) return -1;
    pthread_mutex_lock(&s->lock);
    struct object *o = find(s, key);
    int rc = 0;
    if (!o)
        rc = -704;
    else if (o->leased && !force)
        rc = -706;
    else
        drop(o);
    pthread_mutex_unlock(&s->lock);
    return rc;
}

int64_t mooncake_store_remove_by_regex(mooncake_store_t store, const char *pattern, int force) {
    /* The stub matches a pattern as a plain prefix (enough for its tests). */
    struct stub *s = store;
    if (!s || !pattern) return -1;
    int64_t n = 0;
    size_t plen = strlen(pattern);
    pthread_mutex_lock(&s->lock);
    for (int i = 0; i < MAX_OBJECTS; i++) {
        struct object *o = &s->objects[i];
        if (o->key && strncmp(o->key, pattern, plen) == 0 && (force || !o->leased)) {
            drop(o);
            n++;
        }
    }
    pthread_mutex_unlock(&s->lock);
    return n;
}

#ifndef KVTIER_STUB_WRONG_ABI
int64_t mooncake_store_remove_all(mooncake_store_t store, int force) {
    return mooncake_store_remove_by_regex(store, "", force);
}
#endif

int mooncake_store_register_buffer(mooncake_store_t store, void *buffer, size_t size) {
    if (!store || !buffer || size == 0) return -1;
    return 0;
}

int mooncake_store_unregister_buffer(mooncake_store_t store, void *buffer) {
    (void)buffer;
    return store ? 0 : -1;
}
