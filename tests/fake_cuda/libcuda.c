/*
 * An emulated CUDA driver for CI without a GPU.
 *
 * Built by tests/gpu.rs into a temporary directory as `libcuda.so` and put first on
 * LD_LIBRARY_PATH of a re-executed test process, so cudarc (which dlopens libcuda by
 * name) drives it instead of NVIDIA's driver. It implements only the driver entry points
 * that cudarc's context, stream and event code and kvtier's CUDA tier call, and it is
 * strict where a real driver is strict, so the CUDA code paths can fail on real bugs:
 *
 *  - device memory is a separate host allocation at addresses no host pointer has
 *    (above 2^48, with unmapped gaps between allocations); only the driver touches it, and
 *    an address outside every allocation is CUDA_ERROR_INVALID_VALUE;
 *  - every asynchronous copy is queued on its stream and run later, after a delay, by that
 *    stream's worker thread: reading the destination before waiting on an event recorded
 *    after the copy sees stale bytes;
 *  - an event completes only after the work queued before it on its stream;
 *    cuStreamWaitEvent holds back a stream until the event completes;
 *  - calls that need a context fail with CUDA_ERROR_INVALID_CONTEXT when none is current
 *    on the calling thread;
 *  - cuMemHostRegister records ranges: overlapping ones are
 *    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, unmapped memory is CUDA_ERROR_INVALID_VALUE,
 *    and so is a shared mapping of a file on a filesystem other than tmpfs or hugetlbfs:
 *    Linux (6.5 on) refuses a driver's long-term writable pin of such pages, which need
 *    dirty tracking, and the real driver then returns CUDA_ERROR_INVALID_VALUE (seen on an
 *    H200 with driver 580 for an arena file on ext4);
 *    one larger than KVTIER_FAKE_CUDA_MAX_REGISTER_BYTES is CUDA_ERROR_OUT_OF_MEMORY;
 *  - 2-D copies honour both pitches and the x/y offsets; batched copies copy every entry;
 *  - cuLaunchHostFunc queues a host function on the stream; the stream's worker calls it
 *    (on its own thread, never the caller's) after the work queued before it, and the
 *    work queued after it waits until it returns.
 *
 * Environment (read once, at cuInit):
 *   KVTIER_FAKE_CUDA_VERSION=N              cuDriverGetVersion reports N (default 12080)
 *   KVTIER_FAKE_CUDA_NO_BATCH=1             cuMemcpyBatchAsync returns CUDA_ERROR_NOT_SUPPORTED
 *   KVTIER_FAKE_CUDA_HANG=1                 copies are queued but never run (a hung stream)
 *   KVTIER_FAKE_CUDA_DELAY_US=N             each copy operation waits N us first (default 50)
 *   KVTIER_FAKE_CUDA_MAX_REGISTER_BYTES=N   largest single cuMemHostRegister (default: none)
 *
 * kvtier_fake_cuda_stats() exposes counters so tests can check how the driver was used
 * (among them every completion query and synchronize, so a test can tell a blocking wait
 * from a polling one); kvtier_fake_cuda_release_hang() lets a hung stream's work run, so a
 * test can see what a completion arriving after a timeout does.
 * Not a performance model: timings measured on it mean nothing.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct fake_ctx *CUcontext;
typedef struct fake_stream *CUstream;
typedef struct fake_event *CUevent;
typedef void (*CUhostFn)(void *user_data);

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};

enum { MEMORYTYPE_HOST = 1, MEMORYTYPE_DEVICE = 2, MEMORYTYPE_ARRAY = 3, MEMORYTYPE_UNIFIED = 4 };

typedef struct {
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void *srcHost;
    CUdeviceptr srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    CUdeviceptr dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} CUDA_MEMCPY2D;

typedef struct {
    int type;
    int id;
} CUmemLocation;

typedef struct {
    int srcAccessOrder;
    CUmemLocation srcLocHint, dstLocHint;
    unsigned int flags;
} CUmemcpyAttributes;

/* ---- state ---------------------------------------------------------------------- */

#define DEVICE_BASE 0x00d0000000000000ULL
#define DEVICE_GAP (1ULL << 20)
#define MAX_ALLOCS 4096
#define MAX_REGS 4096

struct fake_ctx {
    int device;
};

struct alloc {
    CUdeviceptr addr;
    size_t size;
    unsigned char *mem;
};

struct reg {
    uintptr_t base;
    size_t len;
};

/* One row-wise copy: `height` rows of `width` bytes. */
struct seg {
    unsigned char *dst;
    const unsigned char *src;
    size_t width, height, dpitch, spitch;
};

enum { OP_COPY, OP_RECORD, OP_WAIT, OP_HOST };

struct op {
    int kind;
    struct op *next;
    struct seg *segs;
    size_t nsegs;
    struct fake_event *ev;
    uint64_t gen;
    CUhostFn fn;
    void *user_data;
};

struct fake_stream {
    struct fake_stream *next_live;
    struct op *head, *tail;
    int busy, destroyed;
};

struct fake_event {
    struct fake_event *next_live;
    uint64_t recorded, completed;
    int refs;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int initialized;
static struct fake_ctx primary = {0};
static int primary_refs;
static __thread CUcontext current;

static struct alloc allocs[MAX_ALLOCS];
static size_t n_allocs;
static CUdeviceptr next_addr = DEVICE_BASE;
static struct reg regs[MAX_REGS];
static size_t n_regs;
static struct fake_stream *streams;     /* live streams, the default one included */
static struct fake_stream default_stream;
static struct fake_event *events;

static int cfg_version = 12080, cfg_no_batch, cfg_hang;
static long cfg_delay_us = 50;
static unsigned long long cfg_max_register;

enum {
    ST_ALLOCS,
    ST_FREES,
    ST_LIVE_DEVICE_BYTES,
    ST_REGISTERS,
    ST_REGISTER_FAILURES,
    ST_UNREGISTERS,
    ST_LIVE_REGISTRATIONS,
    ST_COPIES,
    ST_COPIES_2D,
    ST_BATCHES,
    ST_BATCH_ENTRIES,
    ST_PAGEABLE_COPIES,
    ST_BYTES,
    ST_STREAM_WAITS,
    ST_EVENT_RECORDS,
    ST_HUNG_OPS,
    ST_HOST_FUNCS,
    ST_HOST_FUNCS_RUN,
    ST_EVENT_QUERIES,
    ST_STREAM_QUERIES,
    ST_EVENT_SYNCS,
    ST_STREAM_SYNCS,
    ST_COPIES_RUN,
    ST_COUNT
};
static uint64_t stats[ST_COUNT];

static void bump(int which, uint64_t by) { __atomic_fetch_add(&stats[which], by, __ATOMIC_RELAXED); }

/* ---- helpers (called with `mu` held unless said otherwise) ----------------------- */

static long env_long(const char *name, long dflt) {
    const char *v = getenv(name);
    return v && *v ? strtol(v, NULL, 10) : dflt;
}

/* Device address range -> the driver's backing memory, or NULL when any byte of it lies
 * outside every allocation. */
static unsigned char *resolve(CUdeviceptr addr, size_t n) {
    for (size_t i = 0; i < n_allocs; i++) {
        struct alloc *a = &allocs[i];
        if (addr >= a->addr && addr - a->addr <= a->size && n <= a->size - (addr - a->addr))
            return a->mem + (addr - a->addr);
    }
    return NULL;
}

static int is_device(CUdeviceptr addr) { return addr >= DEVICE_BASE; }

static int registered(const void *p, size_t n) {
    uintptr_t b = (uintptr_t)p;
    for (size_t i = 0; i < n_regs; i++)
        if (b >= regs[i].base && b - regs[i].base <= regs[i].len && n <= regs[i].len - (b - regs[i].base))
            return 1;
    return 0;
}

static struct fake_stream *stream_of(CUstream h) {
    /* NULL is the legacy default stream, 0x1 CU_STREAM_LEGACY, 0x2 the per-thread one. */
    if (h == NULL || (uintptr_t)h == 1 || (uintptr_t)h == 2)
        return &default_stream;
    for (struct fake_stream *s = streams; s; s = s->next_live)
        if (s == h)
            return s;
    return NULL;
}

static struct fake_event *event_of(CUevent h) {
    for (struct fake_event *e = events; e; e = e->next_live)
        if (e == h)
            return e;
    return NULL;
}

static void event_unref(struct fake_event *e) {
    if (--e->refs == 0)
        free(e);
}

static void push(struct fake_stream *s, struct op *o) {
    o->next = NULL;
    if (s->tail)
        s->tail->next = o;
    else
        s->head = o;
    s->tail = o;
    pthread_cond_broadcast(&cv);
}

static int idle(struct fake_stream *s) { return s->head == NULL && !s->busy; }

static void *worker(void *arg) {
    struct fake_stream *s = arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        struct op *o = s->head;
        if (!o) {
            if (s->destroyed)
                break;
            pthread_cond_wait(&cv, &mu);
            continue;
        }
        if (o->kind == OP_WAIT && o->ev->completed < o->gen) {
            pthread_cond_wait(&cv, &mu);
            continue;
        }
        if (o->kind == OP_COPY && cfg_hang) {
            bump(ST_HUNG_OPS, 1);
            while (cfg_hang)
                pthread_cond_wait(&cv, &mu);
            continue;
        }
        s->head = o->next;
        if (!s->head)
            s->tail = NULL;
        s->busy = 1;
        if (o->kind == OP_COPY) {
            pthread_mutex_unlock(&mu);
            if (cfg_delay_us > 0)
                usleep((useconds_t)cfg_delay_us);
            for (size_t i = 0; i < o->nsegs; i++) {
                struct seg *g = &o->segs[i];
                for (size_t r = 0; r < g->height; r++)
                    memcpy(g->dst + r * g->dpitch, g->src + r * g->spitch, g->width);
            }
            bump(ST_COPIES_RUN, 1);
            pthread_mutex_lock(&mu);
            free(o->segs);
        } else if (o->kind == OP_HOST) {
            /* Like the driver's callback thread: outside every lock, in stream order.
             * Counted before the call, so whoever the function wakes sees the count. */
            pthread_mutex_unlock(&mu);
            bump(ST_HOST_FUNCS_RUN, 1);
            o->fn(o->user_data);
            pthread_mutex_lock(&mu);
        } else if (o->kind == OP_RECORD) {
            if (o->ev->completed < o->gen)
                o->ev->completed = o->gen;
            event_unref(o->ev);
        } else {
            event_unref(o->ev);
        }
        free(o);
        s->busy = 0;
        pthread_cond_broadcast(&cv);
    }
    free(s);
    pthread_mutex_unlock(&mu);
    return NULL;
}

static CUresult start_worker(struct fake_stream *s) {
    pthread_t t;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    int r = pthread_create(&t, &a, worker, s);
    pthread_attr_destroy(&a);
    return r == 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

#define NEED_INIT()                                                                    \
    do {                                                                               \
        if (!initialized)                                                              \
            return CUDA_ERROR_NOT_INITIALIZED;                                         \
    } while (0)
#define NEED_CTX()                                                                     \
    do {                                                                               \
        NEED_INIT();                                                                   \
        if (current == NULL || primary_refs == 0)                                      \
            return CUDA_ERROR_INVALID_CONTEXT;                                         \
    } while (0)

/* Queues one copy of `nsegs` segments on `h` (takes ownership of `segs`). */
static CUresult enqueue_copy(CUstream h, struct seg *segs, size_t nsegs, uint64_t bytes) {
    struct fake_stream *s = stream_of(h);
    if (!s) {
        free(segs);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    struct op *o = calloc(1, sizeof *o);
    if (!o) {
        free(segs);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    o->kind = OP_COPY;
    o->segs = segs;
    o->nsegs = nsegs;
    bump(ST_BYTES, bytes);
    push(s, o);
    return CUDA_SUCCESS;
}

/* ---- initialisation, devices, contexts ------------------------------------------ */

CUresult cuInit(unsigned int flags) {
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = CUDA_SUCCESS;
    if (!initialized) {
        cfg_version = (int)env_long("KVTIER_FAKE_CUDA_VERSION", 12080);
        cfg_no_batch = env_long("KVTIER_FAKE_CUDA_NO_BATCH", 0) != 0;
        cfg_hang = env_long("KVTIER_FAKE_CUDA_HANG", 0) != 0;
        cfg_delay_us = env_long("KVTIER_FAKE_CUDA_DELAY_US", 50);
        cfg_max_register = (unsigned long long)env_long("KVTIER_FAKE_CUDA_MAX_REGISTER_BYTES", 0);
        default_stream.next_live = NULL;
        r = start_worker(&default_stream);
        if (r == CUDA_SUCCESS)
            initialized = 1;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuDriverGetVersion(int *version) {
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = initialized ? cfg_version : (int)env_long("KVTIER_FAKE_CUDA_VERSION", 12080);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    NEED_INIT();
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = 1;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    NEED_INIT();
    if (!dev)
        return CUDA_ERROR_INVALID_VALUE;
    if (ordinal != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *dev = 0;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    NEED_INIT();
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    strncpy(name, "kvtier emulated CUDA device (no GPU; timings are meaningless)", (size_t)len - 1);
    name[len - 1] = 0;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev) {
    NEED_INIT();
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    switch (attrib) {
    case 75: /* compute capability major */
        *value = 9;
        break;
    case 76: /* minor */
        *value = 0;
        break;
    case 115: /* memory pools: none, so nothing allocates stream-ordered */
    default:
        *value = 0;
    }
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) {
    NEED_INIT();
    if (!ctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    primary_refs++;
    pthread_mutex_unlock(&mu);
    *ctx = &primary;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    NEED_INIT();
    if (dev != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    CUresult r = primary_refs > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    if (primary_refs > 0)
        primary_refs--;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
    NEED_INIT();
    if (!ctx)
        return CUDA_ERROR_INVALID_VALUE;
    *ctx = current;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    NEED_INIT();
    if (ctx != NULL && (ctx != &primary || primary_refs == 0))
        return CUDA_ERROR_INVALID_CONTEXT;
    current = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *dev) {
    NEED_CTX();
    if (!dev)
        return CUDA_ERROR_INVALID_VALUE;
    *dev = current->device;
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    NEED_CTX();
    pthread_mutex_lock(&mu);
    for (;;) {
        int busy = !idle(&default_stream);
        for (struct fake_stream *s = streams; s && !busy; s = s->next_live)
            busy = !idle(s);
        if (!busy)
            break;
        pthread_cond_wait(&cv, &mu);
    }
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

/* ---- memory --------------------------------------------------------------------- */

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    NEED_CTX();
    if (!dptr || bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    unsigned char *mem = calloc(1, bytes);
    if (!mem)
        return CUDA_ERROR_OUT_OF_MEMORY;
    /* Real device memory is not zeroed; make stale reads visible. */
    memset(mem, 0xa5, bytes);
    pthread_mutex_lock(&mu);
    if (n_allocs == MAX_ALLOCS) {
        pthread_mutex_unlock(&mu);
        free(mem);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct alloc *a = &allocs[n_allocs++];
    a->addr = next_addr;
    a->size = bytes;
    a->mem = mem;
    next_addr += ((bytes + DEVICE_GAP - 1) / DEVICE_GAP + 1) * DEVICE_GAP;
    *dptr = a->addr;
    pthread_mutex_unlock(&mu);
    bump(ST_ALLOCS, 1);
    bump(ST_LIVE_DEVICE_BYTES, bytes);
    return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    NEED_CTX();
    /* Like the real call, freeing waits for the work in flight. */
    CUresult r = cuCtxSynchronize();
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < n_allocs; i++) {
        if (allocs[i].addr == dptr) {
            free(allocs[i].mem);
            __atomic_fetch_sub(&stats[ST_LIVE_DEVICE_BYTES], allocs[i].size, __ATOMIC_RELAXED);
            allocs[i] = allocs[--n_allocs];
            pthread_mutex_unlock(&mu);
            bump(ST_FREES, 1);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&mu);
    return CUDA_ERROR_INVALID_VALUE;
}

/* Whether [lo, hi) overlaps a shared mapping of a file that Linux will not pin for
 * writing: one on a filesystem other than tmpfs or hugetlbfs. A file that cannot be
 * looked up again (deleted, memfd) is given the benefit of the doubt. */
static int unpinnable_file(uintptr_t lo, uintptr_t hi) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f)
        return 0;
    char line[4096];
    int bad = 0;
    while (!bad && fgets(line, sizeof line, f)) {
        unsigned long a, b, inode;
        char perms[8];
        int path_at = 0;
        if (sscanf(line, "%lx-%lx %7s %*s %*s %lu %n", &a, &b, perms, &inode, &path_at) < 4)
            continue;
        if (b <= lo || a >= hi || inode == 0 || perms[3] != 's' || line[path_at] != '/')
            continue;
        line[strcspn(line, "\n")] = 0;
        struct statfs st;
        if (statfs(line + path_at, &st) != 0)
            continue;
        if (st.f_type != 0x01021994 /* tmpfs */ && st.f_type != (long)0x958458f6 /* hugetlbfs */)
            bad = 1;
    }
    fclose(f);
    return bad;
}

CUresult cuMemHostRegister_v2(void *p, size_t bytes, unsigned int flags) {
    (void)flags;
    NEED_CTX();
    if (!p || bytes == 0) {
        bump(ST_REGISTER_FAILURES, 1);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (cfg_max_register && bytes > cfg_max_register) {
        bump(ST_REGISTER_FAILURES, 1);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    /* The whole range must be mapped. */
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)p & ~(uintptr_t)(page - 1);
    uintptr_t hi = ((uintptr_t)p + bytes + (uintptr_t)page - 1) & ~(uintptr_t)(page - 1);
    unsigned char vec[256];
    for (uintptr_t at = lo; at < hi;) {
        size_t n = (hi - at) / (uintptr_t)page;
        if (n > sizeof vec)
            n = sizeof vec;
        if (mincore((void *)at, n * (size_t)page, vec) != 0 && errno == ENOMEM) {
            bump(ST_REGISTER_FAILURES, 1);
            return CUDA_ERROR_INVALID_VALUE;
        }
        at += n * (uintptr_t)page;
    }
    if (unpinnable_file(lo, hi)) {
        bump(ST_REGISTER_FAILURES, 1);
        return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&mu);
    uintptr_t b = (uintptr_t)p;
    for (size_t i = 0; i < n_regs; i++) {
        if (b < regs[i].base + regs[i].len && regs[i].base < b + bytes) {
            pthread_mutex_unlock(&mu);
            bump(ST_REGISTER_FAILURES, 1);
            return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
        }
    }
    if (n_regs == MAX_REGS) {
        pthread_mutex_unlock(&mu);
        bump(ST_REGISTER_FAILURES, 1);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    regs[n_regs].base = b;
    regs[n_regs].len = bytes;
    n_regs++;
    pthread_mutex_unlock(&mu);
    bump(ST_REGISTERS, 1);
    bump(ST_LIVE_REGISTRATIONS, 1);
    return CUDA_SUCCESS;
}

CUresult cuMemHostUnregister(void *p) {
    NEED_CTX();
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < n_regs; i++) {
        if (regs[i].base == (uintptr_t)p) {
            regs[i] = regs[--n_regs];
            pthread_mutex_unlock(&mu);
            bump(ST_UNREGISTERS, 1);
            __atomic_fetch_sub(&stats[ST_LIVE_REGISTRATIONS], 1, __ATOMIC_RELAXED);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&mu);
    return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
}

/* ---- copies ---------------------------------------------------------------------- */

static CUresult copy_1d(unsigned char *dst_dev_or_host, const unsigned char *src, size_t n, CUstream h) {
    struct seg *g = malloc(sizeof *g);
    if (!g)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *g = (struct seg){dst_dev_or_host, src, n, 1, 0, 0};
    bump(ST_COPIES, 1);
    return enqueue_copy(h, g, 1, n);
}

/* A 1-D copy between device memory and host memory at `host`, either way. */
static CUresult copy_host_dev(CUdeviceptr dev, void *host, size_t n, CUstream h, int to_host) {
    NEED_CTX();
    if (!host)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    unsigned char *d = resolve(dev, n);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    if (d) {
        if (!registered(host, n))
            bump(ST_PAGEABLE_COPIES, 1);
        r = to_host ? copy_1d(host, d, n, h) : copy_1d(d, host, n, h);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream h) {
    /* Only read from in this direction. */
    return copy_host_dev(dst, (void *)src, n, h, 0);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream h) {
    return copy_host_dev(src, dst, n, h, 1);
}

static CUresult wait_stream(struct fake_stream *s) {
    pthread_mutex_lock(&mu);
    while (!idle(s))
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

/* The synchronous copies run on the default stream and wait for it. */
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    CUresult r = cuMemcpyHtoDAsync_v2(dst, src, n, NULL);
    return r == CUDA_SUCCESS ? wait_stream(&default_stream) : r;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    CUresult r = cuMemcpyDtoHAsync_v2(dst, src, n, NULL);
    return r == CUDA_SUCCESS ? wait_stream(&default_stream) : r;
}

/* One side of a 2-D copy: its first byte, checked against device memory for the whole
 * extent (`rows` rows `pitch` apart, the last one `width` long). */
static CUresult side(int type, const void *host, CUdeviceptr dev, size_t x, size_t y, size_t pitch,
                     size_t width, size_t rows, unsigned char **out, int *on_device) {
    size_t extent = (rows - 1) * pitch + width;
    size_t start = y * pitch + x;
    if (type == MEMORYTYPE_UNIFIED) {
        /* A unified address names either kind of memory; the driver tells them apart. */
        type = is_device(dev) ? MEMORYTYPE_DEVICE : MEMORYTYPE_HOST;
        host = (const void *)(uintptr_t)dev;
    }
    if (type == MEMORYTYPE_DEVICE) {
        *out = resolve(dev + start, extent);
        *on_device = 1;
        return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    }
    if (type == MEMORYTYPE_HOST) {
        if (!host)
            return CUDA_ERROR_INVALID_VALUE;
        *out = (unsigned char *)host + start;
        *on_device = 0;
        if (!registered(*out, extent))
            bump(ST_PAGEABLE_COPIES, 1);
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_INVALID_VALUE; /* arrays are not emulated */
}

CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *c, CUstream h) {
    NEED_CTX();
    if (!c)
        return CUDA_ERROR_INVALID_VALUE;
    if (c->Height == 0 || c->WidthInBytes == 0)
        return CUDA_SUCCESS;
    if (c->srcPitch < c->WidthInBytes + c->srcXInBytes || c->dstPitch < c->WidthInBytes + c->dstXInBytes)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    unsigned char *src, *dst;
    int src_dev, dst_dev;
    CUresult r = side(c->srcMemoryType, c->srcHost, c->srcDevice, c->srcXInBytes, c->srcY, c->srcPitch,
                      c->WidthInBytes, c->Height, &src, &src_dev);
    if (r == CUDA_SUCCESS)
        r = side(c->dstMemoryType, c->dstHost, c->dstDevice, c->dstXInBytes, c->dstY, c->dstPitch,
                 c->WidthInBytes, c->Height, &dst, &dst_dev);
    if (r == CUDA_SUCCESS) {
        struct seg *g = malloc(sizeof *g);
        if (!g) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            *g = (struct seg){dst, src, c->WidthInBytes, c->Height, c->dstPitch, c->srcPitch};
            bump(ST_COPIES_2D, 1);
            r = enqueue_copy(h, g, 1, (uint64_t)c->WidthInBytes * c->Height);
        }
    }
    pthread_mutex_unlock(&mu);
    return r;
}

/* CUDA 12.8's batched copy: every entry is a contiguous copy whose direction the driver
 * works out from the addresses (host and device share one address space). */
CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                            CUmemcpyAttributes *attrs, size_t *attr_idxs, size_t num_attrs, size_t *fail_idx,
                            CUstream h) {
    NEED_CTX();
    if (cfg_no_batch || cfg_version < 12080)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (fail_idx)
        *fail_idx = SIZE_MAX;
    if (!dsts || !srcs || !sizes || count == 0 || !attrs || !attr_idxs || num_attrs == 0 || num_attrs > count ||
        attr_idxs[0] != 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 1; i < num_attrs; i++)
        if (attr_idxs[i] <= attr_idxs[i - 1] || attr_idxs[i] >= count)
            return CUDA_ERROR_INVALID_VALUE;
    struct seg *segs = calloc(count, sizeof *segs);
    if (!segs)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    uint64_t bytes = 0;
    for (size_t i = 0; i < count; i++) {
        unsigned char *d = is_device(dsts[i]) ? resolve(dsts[i], sizes[i]) : (unsigned char *)(uintptr_t)dsts[i];
        unsigned char *s = is_device(srcs[i]) ? resolve(srcs[i], sizes[i]) : (unsigned char *)(uintptr_t)srcs[i];
        if (!d || !s || sizes[i] == 0) {
            pthread_mutex_unlock(&mu);
            free(segs);
            if (fail_idx)
                *fail_idx = i;
            return CUDA_ERROR_INVALID_VALUE;
        }
        if ((!is_device(dsts[i]) && !registered(d, sizes[i])) || (!is_device(srcs[i]) && !registered(s, sizes[i])))
            bump(ST_PAGEABLE_COPIES, 1);
        segs[i] = (struct seg){d, s, sizes[i], 1, 0, 0};
        bytes += sizes[i];
    }
    CUresult r = enqueue_copy(h, segs, count, bytes);
    pthread_mutex_unlock(&mu);
    if (r == CUDA_SUCCESS) {
        bump(ST_BATCHES, 1);
        bump(ST_BATCH_ENTRIES, count);
    }
    return r;
}

/* ---- streams and events ---------------------------------------------------------- */

static CUresult new_stream(CUstream *out) {
    NEED_CTX();
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    struct fake_stream *s = calloc(1, sizeof *s);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    CUresult r = start_worker(s);
    if (r == CUDA_SUCCESS) {
        s->next_live = streams;
        streams = s;
        *out = s;
    } else {
        free(s);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuStreamCreate(CUstream *out, unsigned int flags) {
    (void)flags;
    return new_stream(out);
}

CUresult cuStreamCreateWithPriority(CUstream *out, unsigned int flags, int priority) {
    (void)flags, (void)priority;
    return new_stream(out);
}

CUresult cuStreamDestroy_v2(CUstream h) {
    NEED_CTX();
    pthread_mutex_lock(&mu);
    for (struct fake_stream **p = &streams; *p; p = &(*p)->next_live) {
        if (*p == h) {
            /* Like the real call: returns at once; queued work still runs, then the
             * worker frees the stream. */
            *p = h->next_live;
            h->destroyed = 1;
            pthread_cond_broadcast(&cv);
            pthread_mutex_unlock(&mu);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&mu);
    return CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuStreamSynchronize(CUstream h) {
    NEED_CTX();
    bump(ST_STREAM_SYNCS, 1);
    pthread_mutex_lock(&mu);
    struct fake_stream *s = stream_of(h);
    if (!s) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    while (!idle(s))
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

CUresult cuStreamQuery(CUstream h) {
    NEED_CTX();
    bump(ST_STREAM_QUERIES, 1);
    pthread_mutex_lock(&mu);
    struct fake_stream *s = stream_of(h);
    CUresult r = !s ? CUDA_ERROR_INVALID_HANDLE : idle(s) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuEventCreate(CUevent *out, unsigned int flags) {
    (void)flags;
    NEED_CTX();
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    struct fake_event *e = calloc(1, sizeof *e);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->refs = 1;
    pthread_mutex_lock(&mu);
    e->next_live = events;
    events = e;
    pthread_mutex_unlock(&mu);
    *out = e;
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent h) {
    NEED_INIT();
    pthread_mutex_lock(&mu);
    for (struct fake_event **p = &events; *p; p = &(*p)->next_live) {
        if (*p == h) {
            *p = h->next_live;
            event_unref(h);
            pthread_mutex_unlock(&mu);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&mu);
    return CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuEventRecord(CUevent h, CUstream sh) {
    NEED_CTX();
    pthread_mutex_lock(&mu);
    struct fake_event *e = event_of(h);
    struct fake_stream *s = stream_of(sh);
    struct op *o = e && s ? calloc(1, sizeof *o) : NULL;
    if (!o) {
        pthread_mutex_unlock(&mu);
        return e && s ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_INVALID_HANDLE;
    }
    o->kind = OP_RECORD;
    o->ev = e;
    o->gen = ++e->recorded;
    e->refs++;
    push(s, o);
    pthread_mutex_unlock(&mu);
    bump(ST_EVENT_RECORDS, 1);
    return CUDA_SUCCESS;
}

CUresult cuEventQuery(CUevent h) {
    NEED_INIT();
    bump(ST_EVENT_QUERIES, 1);
    pthread_mutex_lock(&mu);
    struct fake_event *e = event_of(h);
    CUresult r = !e ? CUDA_ERROR_INVALID_HANDLE : e->completed >= e->recorded ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuEventSynchronize(CUevent h) {
    NEED_INIT();
    bump(ST_EVENT_SYNCS, 1);
    pthread_mutex_lock(&mu);
    struct fake_event *e = event_of(h);
    if (!e) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    uint64_t want = e->recorded;
    e->refs++;
    while (e->completed < want)
        pthread_cond_wait(&cv, &mu);
    event_unref(e);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(CUstream sh, CUevent h, unsigned int flags) {
    (void)flags;
    NEED_CTX();
    pthread_mutex_lock(&mu);
    struct fake_event *e = event_of(h);
    struct fake_stream *s = stream_of(sh);
    struct op *o = e && s ? calloc(1, sizeof *o) : NULL;
    if (!o) {
        pthread_mutex_unlock(&mu);
        return e && s ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_INVALID_HANDLE;
    }
    /* Waits for the event's most recent record at the time of this call. */
    o->kind = OP_WAIT;
    o->ev = e;
    o->gen = e->recorded;
    e->refs++;
    push(s, o);
    pthread_mutex_unlock(&mu);
    bump(ST_STREAM_WAITS, 1);
    return CUDA_SUCCESS;
}

/* Queues `fn(user_data)` on the stream, after the work already queued there. */
CUresult cuLaunchHostFunc(CUstream sh, CUhostFn fn, void *user_data) {
    NEED_CTX();
    if (!fn)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    struct fake_stream *s = stream_of(sh);
    struct op *o = s ? calloc(1, sizeof *o) : NULL;
    if (!o) {
        pthread_mutex_unlock(&mu);
        return s ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_INVALID_HANDLE;
    }
    o->kind = OP_HOST;
    o->fn = fn;
    o->user_data = user_data;
    push(s, o);
    pthread_mutex_unlock(&mu);
    bump(ST_HOST_FUNCS, 1);
    return CUDA_SUCCESS;
}

/* ---- errors ---------------------------------------------------------------------- */

static const char *name_of(CUresult r) {
    switch (r) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED";
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    default: return NULL;
    }
}

CUresult cuGetErrorName(CUresult r, const char **out) {
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    *out = name_of(r);
    return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult r, const char **out) {
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    *out = name_of(r);
    return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- test hooks (not part of the CUDA driver API) --------------------------------- */

/* Copies up to `n` counters into `out` (order: the ST_* enum above) and returns how
 * many the driver has. */
size_t kvtier_fake_cuda_stats(uint64_t *out, size_t n) {
    for (size_t i = 0; i < n && i < ST_COUNT; i++)
        out[i] = __atomic_load_n(&stats[i], __ATOMIC_RELAXED);
    return ST_COUNT;
}

/* Lets the work of a hung stream (KVTIER_FAKE_CUDA_HANG=1) run from now on. */
void kvtier_fake_cuda_release_hang(void) {
    pthread_mutex_lock(&mu);
    cfg_hang = 0;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}
