/* The one-tensor record: a message that is one CUDA tensor in an exported pool, as a few
 * hundred bytes of fixed layout (no pickle, no JSON), and the DLPack tensor the receiver hands
 * its backend: a view of the pool's block whose deleter gives the block back.
 *
 * Layout (little-endian, the only byte order these machines have), OMNI_TREC_FIXED bytes then
 * the variable part:
 *     0  magic "OTR1"            4  u16 version (1), u8 ndim, u8 dtype code
 *     8  u32 device             12  u32 slot
 *    16  u64 offset             24  u64 nbytes
 *    32  u8 flags (requires_grad 1, keyed 2), u8 pool name length, u8 key length, 5 reserved (0)
 *    40  the pool's memory handle (64)   104  the slot's event handle (64)
 *   168  shape, i64 x ndim; strides (elements), i64 x ndim; pool name; key
 * Decode trusts nothing: exact length, magic, version, known dtype, ndim, names (printable,
 * no '/'), shape and strides non-negative, shape x itemsize == nbytes and every element the
 * strides reach inside nbytes, all without overflow. Checks against the pool (slot, block,
 * handles) are the receiver's, which has the pool's segment. */
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define MAGIC "OTR1"
#define VERSION 1
#define FIXED 168

/* DLPack 0.8 (the "dltensor" capsule every framework takes) */
typedef struct { int32_t device_type, device_id; } DLDevice;
typedef struct { uint8_t code, bits; uint16_t lanes; } DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;
enum { kDLCPU = 1, kDLCUDA = 2 };

/* our dtype codes -> DLPack (code, bits); the order is the wire's (omni_transport.h) */
static const DLDataType DTYPES[OMNI_TREC_DTYPES] = {
    {6, 8, 1},  {1, 8, 1},  {0, 8, 1},  {0, 16, 1}, {0, 32, 1}, {0, 64, 1},  {1, 16, 1}, {1, 32, 1},
    {1, 64, 1}, {2, 16, 1}, {4, 16, 1}, {2, 32, 1}, {2, 64, 1}, {5, 64, 1}, {5, 128, 1},
};

int omni_trec_itemsize(uint32_t dtype) {
    return dtype < OMNI_TREC_DTYPES ? DTYPES[dtype].bits / 8 : 0;
}

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* A pool name is a segment name: printable ASCII without '/'. A key is any text without
 * control characters (its UTF-8 is checked by the Python side, which decodes it). */
static int bad_name(const char *s, size_t n, int is_key) {
    if (n == 0) return !is_key;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == 0x7f || (!is_key && (c > 0x7e || c == '/'))) return 1;
    }
    return 0;
}

/* The tensor's shape, strides and dtype fill exactly nbytes and stay inside them. */
static int check_geometry(const omni_trec *t) {
    int item = omni_trec_itemsize(t->dtype);
    if (!item) return omni_fail(OMNI_EINVAL, "tensor record: dtype code %u unknown", t->dtype);
    if (t->ndim > OMNI_TREC_MAX_DIMS)
        return omni_fail(OMNI_EINVAL, "tensor record: %u dimensions (at most %d)", t->ndim,
                         OMNI_TREC_MAX_DIMS);
    uint64_t numel = 1, last = 0; /* last: the highest element index the strides reach */
    for (uint32_t i = 0; i < t->ndim; i++) {
        if (t->shape[i] < 0 || t->strides[i] < 0)
            return omni_fail(OMNI_EINVAL, "tensor record: negative size or stride in dim %u", i);
        uint64_t d = (uint64_t)t->shape[i];
        if (d && numel > UINT64_MAX / d)
            return omni_fail(OMNI_EINVAL, "tensor record: shape overflows");
        numel *= d;
    }
    if (numel > UINT64_MAX / (uint64_t)item || numel * (uint64_t)item != t->nbytes)
        return omni_fail(OMNI_EINVAL, "tensor record: shape x itemsize is not its %llu bytes",
                         (unsigned long long)t->nbytes);
    if (numel) {
        for (uint32_t i = 0; i < t->ndim; i++) {
            uint64_t span = (uint64_t)(t->shape[i] - 1), s = (uint64_t)t->strides[i];
            if (s && span > (UINT64_MAX - last) / s)
                return omni_fail(OMNI_EINVAL, "tensor record: strides overflow");
            last += span * s;
        }
        if (last >= numel) /* a view reaching past its elements (or overlapping them) */
            return omni_fail(OMNI_EINVAL, "tensor record: strides reach past the tensor");
    }
    return OMNI_OK;
}

uint64_t omni_trec_size(const omni_trec *t) {
    return FIXED + 16ull * t->ndim + strnlen(t->pool, OMNI_TREC_NAME_MAX + 1) +
           strnlen(t->key, OMNI_TREC_NAME_MAX + 1);
}

int omni_trec_encode(const omni_trec *t, uint8_t *out, uint64_t cap, uint64_t *len) {
    size_t np = strnlen(t->pool, OMNI_TREC_NAME_MAX + 1), nk = strnlen(t->key, OMNI_TREC_NAME_MAX + 1);
    if (np > OMNI_TREC_NAME_MAX || nk > OMNI_TREC_NAME_MAX || bad_name(t->pool, np, 0) ||
        bad_name(t->key, nk, 1))
        return omni_fail(OMNI_EINVAL, "tensor record: pool or key name empty, too long or odd");
    if (t->flags & ~(uint32_t)(OMNI_TREC_REQUIRES_GRAD | OMNI_TREC_KEYED))
        return omni_fail(OMNI_EINVAL, "tensor record: unknown flags 0x%x", t->flags);
    int rc = check_geometry(t);
    if (rc != OMNI_OK) return rc;
    uint64_t n = omni_trec_size(t);
    if (cap < n) return omni_fail(OMNI_EINVAL, "tensor record: %llu bytes do not fit in %llu",
                                  (unsigned long long)n, (unsigned long long)cap);
    memset(out, 0, FIXED);
    memcpy(out, MAGIC, 4);
    out[4] = VERSION & 0xff;
    out[5] = VERSION >> 8;
    out[6] = (uint8_t)t->ndim;
    out[7] = (uint8_t)t->dtype;
    put32(out + 8, t->device);
    put32(out + 12, t->slot);
    put64(out + 16, t->offset);
    put64(out + 24, t->nbytes);
    out[32] = (uint8_t)t->flags;
    out[33] = (uint8_t)np;
    out[34] = (uint8_t)nk;
    memcpy(out + 40, t->mem_handle, OMNI_IPC_HANDLE_BYTES);
    memcpy(out + 104, t->event_handle, OMNI_IPC_HANDLE_BYTES);
    uint8_t *p = out + FIXED;
    for (uint32_t i = 0; i < t->ndim; i++, p += 8) put64(p, (uint64_t)t->shape[i]);
    for (uint32_t i = 0; i < t->ndim; i++, p += 8) put64(p, (uint64_t)t->strides[i]);
    memcpy(p, t->pool, np);
    memcpy(p + np, t->key, nk);
    *len = n;
    return OMNI_OK;
}

int omni_trec_is_record(const uint8_t *buf, uint64_t len) {
    return len >= 4 && memcmp(buf, MAGIC, 4) == 0;
}

int omni_trec_decode(const uint8_t *buf, uint64_t len, omni_trec *t) {
    memset(t, 0, sizeof *t);
    if (len < FIXED || memcmp(buf, MAGIC, 4) != 0)
        return omni_fail(OMNI_EINVAL, "not a tensor record (%llu bytes)", (unsigned long long)len);
    unsigned version = buf[4] | (unsigned)buf[5] << 8;
    if (version != VERSION)
        return omni_fail(OMNI_EINVAL, "tensor record version %u (this side reads %d)", version,
                         VERSION);
    t->ndim = buf[6];
    t->dtype = buf[7];
    t->device = get32(buf + 8);
    t->slot = get32(buf + 12);
    t->offset = get64(buf + 16);
    t->nbytes = get64(buf + 24);
    t->flags = buf[32];
    unsigned np = buf[33], nk = buf[34];
    if (t->ndim > OMNI_TREC_MAX_DIMS)
        return omni_fail(OMNI_EINVAL, "tensor record: %u dimensions (at most %d)", t->ndim,
                         OMNI_TREC_MAX_DIMS);
    if (t->flags & ~(uint32_t)(OMNI_TREC_REQUIRES_GRAD | OMNI_TREC_KEYED))
        return omni_fail(OMNI_EINVAL, "tensor record: unknown flags 0x%x", t->flags);
    for (int i = 35; i < 40; i++)
        if (buf[i]) return omni_fail(OMNI_EINVAL, "tensor record: reserved bytes set");
    if (np > OMNI_TREC_NAME_MAX || nk > OMNI_TREC_NAME_MAX ||
        len != FIXED + 16ull * t->ndim + np + nk)
        return omni_fail(OMNI_EINVAL, "tensor record: %llu bytes, not what its %u dims and names "
                                      "take", (unsigned long long)len, t->ndim);
    memcpy(t->mem_handle, buf + 40, OMNI_IPC_HANDLE_BYTES);
    memcpy(t->event_handle, buf + 104, OMNI_IPC_HANDLE_BYTES);
    const uint8_t *p = buf + FIXED;
    for (uint32_t i = 0; i < t->ndim; i++, p += 8) t->shape[i] = (int64_t)get64(p);
    for (uint32_t i = 0; i < t->ndim; i++, p += 8) t->strides[i] = (int64_t)get64(p);
    memcpy(t->pool, p, np);
    memcpy(t->key, p + np, nk);
    if (bad_name(t->pool, np, 0) || bad_name(t->key, nk, 1))
        return omni_fail(OMNI_EINVAL, "tensor record: pool or key name empty or odd");
    return check_geometry(t);
}

int omni_trec_check_block(const omni_trec *t, uint64_t pool_bytes, uint32_t slots,
                          const uint8_t *mem_handle, const uint8_t *event_handle) {
    if (t->slot >= slots)
        return omni_fail(OMNI_EINVAL, "pool %s: slot %u of %u", t->pool, t->slot, slots);
    if (t->offset % 512 || t->offset > pool_bytes || t->nbytes > pool_bytes - t->offset)
        return omni_fail(OMNI_EINVAL, "pool %s: block [%llu, +%llu) is not a block of its %llu bytes",
                         t->pool, (unsigned long long)t->offset, (unsigned long long)t->nbytes,
                         (unsigned long long)pool_bytes);
    if (memcmp(t->mem_handle, mem_handle, OMNI_IPC_HANDLE_BYTES) != 0)
        return omni_fail(OMNI_EINVAL, "pool %s: the record's memory handle is not the pool's",
                         t->pool);
    if (memcmp(t->event_handle, event_handle, OMNI_IPC_HANDLE_BYTES) != 0)
        return omni_fail(OMNI_EINVAL, "pool %s: the record's event handle is not slot %u's",
                         t->pool, t->slot);
    return OMNI_OK;
}

/* ---- the backend's view: a DLPack tensor that releases its block when freed ---- */

typedef struct {
    DLManagedTensor m;
    uint32_t *state;  /* the slot's state word in the pool segment: 0 gives the block back */
    uint64_t stream;  /* CUDA: the release waits for the work queued here (0: the legacy one) */
    uint64_t *live;   /* the receiver's count of views not yet freed */
    int64_t dims[2 * OMNI_TREC_MAX_DIMS];
} lease;

static void lease_free(DLManagedTensor *m) {
    lease *l = (lease *)m;
    if (l->m.dl_tensor.device.device_type == kDLCUDA)
        omni_cuda_release_after(l->stream, l->state);
    else
        __atomic_store_n(l->state, 0, __ATOMIC_RELEASE);
    __atomic_fetch_sub(l->live, 1, __ATOMIC_ACQ_REL);
    free(l);
}

int omni_trec_view(const omni_trec *t, uint64_t data, int cuda, uint64_t stream, uint32_t *state,
                   uint64_t *live, void **out) {
    int rc = check_geometry(t);
    if (rc != OMNI_OK) return rc;
    lease *l = calloc(1, sizeof *l);
    if (!l) return omni_fail(OMNI_ESYS, "tensor view: out of memory");
    for (uint32_t i = 0; i < t->ndim; i++) {
        l->dims[i] = t->shape[i];
        l->dims[OMNI_TREC_MAX_DIMS + i] = t->strides[i];
    }
    DLTensor *d = &l->m.dl_tensor;
    d->data = (void *)(uintptr_t)(data + t->offset);
    d->device.device_type = cuda ? kDLCUDA : kDLCPU;
    d->device.device_id = cuda ? (int32_t)t->device : 0;
    d->ndim = (int32_t)t->ndim;
    d->dtype = DTYPES[t->dtype];
    d->shape = l->dims;
    d->strides = l->dims + OMNI_TREC_MAX_DIMS;
    l->m.manager_ctx = l;
    l->m.deleter = lease_free;
    l->state = state;
    l->stream = stream;
    l->live = live;
    __atomic_fetch_add(live, 1, __ATOMIC_ACQ_REL);
    *out = &l->m;
    return OMNI_OK;
}

void omni_trec_view_free(void *view) {
    DLManagedTensor *m = view;
    m->deleter(m);
}
