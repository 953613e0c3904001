/* CUDA IPC through the driver API, resolved at run time with dlopen("libcuda.so.1"): the
 * library builds and runs without a CUDA toolkit, and these calls return OMNI_ENOCUDA when no
 * driver is installed. Calls run in the calling thread's current context; when there is none
 * (a process that has not touched CUDA yet) the device's primary context is made current, the
 * same context the CUDA runtime (and so torch) uses. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common.h"

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUevent;
typedef void *CUstream;
typedef uint64_t CUdeviceptr;
typedef struct { char reserved[OMNI_IPC_HANDLE_BYTES]; } CUipcMemHandle;
typedef struct { char reserved[OMNI_IPC_HANDLE_BYTES]; } CUipcEventHandle;

#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_EVENT_INTERPROCESS 0x4
#define CUDA_ERROR_NOT_READY 600

static struct {
    void *lib;
    CUresult (*cuInit)(unsigned);
    CUresult (*cuGetErrorString)(CUresult, const char **);
    CUresult (*cuDeviceGet)(CUdevice *, int);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuCtxGetCurrent)(CUcontext *);
    CUresult (*cuCtxSetCurrent)(CUcontext);
    CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
    CUresult (*cuMemFree)(CUdeviceptr);
    CUresult (*cuIpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
    CUresult (*cuIpcOpenMemHandle)(CUdeviceptr *, CUipcMemHandle, unsigned);
    CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
    CUresult (*cuEventCreate)(CUevent *, unsigned);
    CUresult (*cuEventDestroy)(CUevent);
    CUresult (*cuEventRecord)(CUevent, CUstream);
    CUresult (*cuEventSynchronize)(CUevent);
    CUresult (*cuEventQuery)(CUevent);
    CUresult (*cuIpcGetEventHandle)(CUipcEventHandle *, CUevent);
    CUresult (*cuIpcOpenEventHandle)(CUevent *, CUipcEventHandle);
    CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned);
    CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
    CUresult (*cuLaunchHostFunc)(CUstream, void (*)(void *), void *);
    CUresult (*cuStreamSynchronize)(CUstream);
    CUresult (*cuCtxSynchronize)(void);
} cu;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static char load_error[256];
static int device_ordinal = 0;

/* The versioned name first (what cuda.h maps the plain name to), else the plain one. */
#define SYM(field, name)                                                            \
    do {                                                                            \
        *(void **)&cu.field = dlsym(cu.lib, name);                                  \
        if (!cu.field) {                                                            \
            char plain_[64];                                                        \
            snprintf(plain_, sizeof plain_, "%s", name);                            \
            char *v_ = strstr(plain_, "_v2");                                       \
            if (v_) *v_ = 0;                                                        \
            *(void **)&cu.field = dlsym(cu.lib, plain_);                            \
        }                                                                           \
        if (!cu.field) {                                                            \
            snprintf(load_error, sizeof load_error, "libcuda.so.1 lacks %s", name); \
            return;                                                                 \
        }                                                                           \
    } while (0)

static void load(void) {
    cu.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!cu.lib) {
        snprintf(load_error, sizeof load_error,
                 "CUDA unavailable: cannot load the driver library libcuda.so.1 (%s)", dlerror());
        return;
    }
    SYM(cuInit, "cuInit");
    SYM(cuGetErrorString, "cuGetErrorString");
    SYM(cuDeviceGet, "cuDeviceGet");
    SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    SYM(cuCtxGetCurrent, "cuCtxGetCurrent");
    SYM(cuCtxSetCurrent, "cuCtxSetCurrent");
    SYM(cuMemAlloc, "cuMemAlloc_v2");
    SYM(cuMemFree, "cuMemFree_v2");
    SYM(cuIpcGetMemHandle, "cuIpcGetMemHandle");
    SYM(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2");
    SYM(cuIpcCloseMemHandle, "cuIpcCloseMemHandle");
    SYM(cuEventCreate, "cuEventCreate");
    SYM(cuEventDestroy, "cuEventDestroy_v2");
    SYM(cuEventRecord, "cuEventRecord");
    SYM(cuEventSynchronize, "cuEventSynchronize");
    SYM(cuEventQuery, "cuEventQuery");
    SYM(cuIpcGetEventHandle, "cuIpcGetEventHandle");
    SYM(cuIpcOpenEventHandle, "cuIpcOpenEventHandle");
    SYM(cuStreamWaitEvent, "cuStreamWaitEvent");
    SYM(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2");
    SYM(cuLaunchHostFunc, "cuLaunchHostFunc");
    SYM(cuStreamSynchronize, "cuStreamSynchronize");
    SYM(cuCtxSynchronize, "cuCtxSynchronize");
    CUresult rc = cu.cuInit(0);
    if (rc != 0) {
        snprintf(load_error, sizeof load_error, "CUDA unavailable: cuInit failed (CUresult %d)", rc);
        return;
    }
    load_error[0] = 0;
}

static int cuda_fail(const char *what, CUresult rc) {
    const char *msg = NULL;
    if (cu.cuGetErrorString) cu.cuGetErrorString(rc, &msg);
    return omni_fail(OMNI_ECUDA, "%s: %s (CUresult %d)", what, msg ? msg : "unknown error", rc);
}

/* Driver ready and a context current on this thread. */
static int ready(void) {
    pthread_once(&load_once, load);
    if (!cu.lib || load_error[0]) {
        if (!load_error[0] && !cu.lib) snprintf(load_error, sizeof load_error, "CUDA unavailable");
        return omni_fail(OMNI_ENOCUDA, "%s", load_error);
    }
    CUcontext ctx = NULL;
    CUresult rc = cu.cuCtxGetCurrent(&ctx);
    if (rc != 0) return cuda_fail("cuCtxGetCurrent", rc);
    if (ctx) return OMNI_OK;
    CUdevice dev;
    if ((rc = cu.cuDeviceGet(&dev, device_ordinal)) != 0) return cuda_fail("cuDeviceGet", rc);
    if ((rc = cu.cuDevicePrimaryCtxRetain(&ctx, dev)) != 0)
        return cuda_fail("cuDevicePrimaryCtxRetain", rc);
    if ((rc = cu.cuCtxSetCurrent(ctx)) != 0) return cuda_fail("cuCtxSetCurrent", rc);
    return OMNI_OK;
}

#define CALL(what, expr)                            \
    do {                                            \
        int r_ = ready();                           \
        if (r_ != OMNI_OK) return r_;               \
        CUresult c_ = (expr);                       \
        if (c_ != 0) return cuda_fail(what, c_);    \
        return OMNI_OK;                             \
    } while (0)

int omni_cuda_available(void) { return ready() == OMNI_OK; }

int omni_cuda_set_device(int device) {
    device_ordinal = device;
    return OMNI_OK;
}

int omni_cuda_mem_alloc(uint64_t nbytes, uint64_t *dptr) {
    CALL("cuMemAlloc", cu.cuMemAlloc((CUdeviceptr *)dptr, nbytes));
}
int omni_cuda_mem_free(uint64_t dptr) { CALL("cuMemFree", cu.cuMemFree(dptr)); }

int omni_cuda_ipc_get_mem_handle(uint64_t dptr, uint8_t *handle64) {
    CALL("cuIpcGetMemHandle", cu.cuIpcGetMemHandle((CUipcMemHandle *)handle64, dptr));
}

int omni_cuda_ipc_open_mem_handle(const uint8_t *handle64, uint64_t *dptr) {
    CUipcMemHandle h;
    memcpy(&h, handle64, sizeof h);
    CALL("cuIpcOpenMemHandle",
         cu.cuIpcOpenMemHandle((CUdeviceptr *)dptr, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
}

int omni_cuda_ipc_close_mem_handle(uint64_t dptr) {
    CALL("cuIpcCloseMemHandle", cu.cuIpcCloseMemHandle(dptr));
}

int omni_cuda_event_create_ipc(uint64_t *event) {
    CALL("cuEventCreate", cu.cuEventCreate((CUevent *)event,
                                           CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS));
}
int omni_cuda_event_destroy(uint64_t event) {
    CALL("cuEventDestroy", cu.cuEventDestroy((CUevent)(uintptr_t)event));
}
int omni_cuda_event_record(uint64_t event, uint64_t stream) {
    CALL("cuEventRecord", cu.cuEventRecord((CUevent)(uintptr_t)event, (CUstream)(uintptr_t)stream));
}
int omni_cuda_event_synchronize(uint64_t event) {
    CALL("cuEventSynchronize", cu.cuEventSynchronize((CUevent)(uintptr_t)event));
}
int omni_cuda_event_query(uint64_t event) {
    int r = ready();
    if (r != OMNI_OK) return r;
    CUresult c = cu.cuEventQuery((CUevent)(uintptr_t)event);
    if (c == CUDA_ERROR_NOT_READY) return OMNI_EEMPTY;
    return c == 0 ? OMNI_OK : cuda_fail("cuEventQuery", c);
}
int omni_cuda_ipc_get_event_handle(uint64_t event, uint8_t *handle64) {
    CALL("cuIpcGetEventHandle",
         cu.cuIpcGetEventHandle((CUipcEventHandle *)handle64, (CUevent)(uintptr_t)event));
}
int omni_cuda_ipc_open_event_handle(const uint8_t *handle64, uint64_t *event) {
    CUipcEventHandle h;
    memcpy(&h, handle64, sizeof h);
    CALL("cuIpcOpenEventHandle", cu.cuIpcOpenEventHandle((CUevent *)event, h));
}
int omni_cuda_stream_wait_event(uint64_t stream, uint64_t event) {
    CALL("cuStreamWaitEvent",
         cu.cuStreamWaitEvent((CUstream)(uintptr_t)stream, (CUevent)(uintptr_t)event, 0));
}
int omni_cuda_memcpy_dtod_async(uint64_t dst, uint64_t src, uint64_t nbytes, uint64_t stream) {
    CALL("cuMemcpyDtoDAsync",
         cu.cuMemcpyDtoDAsync(dst, src, nbytes, (CUstream)(uintptr_t)stream));
}

/* runs on the driver's callback thread, once the stream reached it: no CUDA calls here */
static void store_free(void *state) { __atomic_store_n((uint32_t *)state, 0, __ATOMIC_RELEASE); }

int omni_cuda_release_after(uint64_t stream, uint32_t *state) {
    int r = ready();
    CUstream s = (CUstream)(uintptr_t)stream;
    if (r == OMNI_OK && cu.cuLaunchHostFunc(s, store_free, state) == 0) return OMNI_OK;
    /* no callback (a context being torn down): wait here, then give the block back; a block
     * must not stay taken for good, and no work of ours on it can run any more */
    if (r == OMNI_OK) cu.cuStreamSynchronize(s);
    store_free(state);
    return OMNI_OK;
}

int omni_cuda_synchronize(void) { CALL("cuCtxSynchronize", cu.cuCtxSynchronize()); }

/* ---- the one-tensor crossing, one call a side (the record's layout: tensor_record.c) ---- */

int omni_trec_export(omni_trec *t, uint64_t pool, uint64_t src, uint64_t stream, uint64_t event,
                     const uint8_t *event_handle, uint32_t *state, uint8_t *out, uint64_t cap,
                     uint64_t *len) {
    /* the record first: a tensor it cannot carry is refused before any GPU work */
    memcpy(t->event_handle, event_handle, OMNI_IPC_HANDLE_BYTES);
    int rc = omni_trec_encode(t, out, cap, len);
    if (rc != OMNI_OK) return rc;
    if ((rc = ready()) != OMNI_OK) return rc;
    CUstream s = (CUstream)(uintptr_t)stream;
    CUresult c;
    if (src && t->nbytes && (c = cu.cuMemcpyDtoDAsync(pool + t->offset, src, t->nbytes, s)) != 0)
        return cuda_fail("cuMemcpyDtoDAsync", c);
    /* the consumer's stream waits on this event: the writes to the block come first */
    if ((c = cu.cuEventRecord((CUevent)(uintptr_t)event, s)) != 0)
        return cuda_fail("cuEventRecord", c);
    /* in flight, ordered before the ring push that carries the record */
    __atomic_store_n(state, 1, __ATOMIC_RELEASE);
    return OMNI_OK;
}

int omni_trec_accept(const omni_trec *t, uint64_t pool_bytes, uint32_t slots, uint32_t device,
                     const uint8_t *mem_handle, const uint8_t *event_handles, uint32_t *states,
                     uint64_t event, uint64_t data, uint64_t stream, uint64_t *live, void **out) {
    /* the slot is checked before its event handle is read */
    if (t->slot >= slots) return omni_trec_check_block(t, pool_bytes, slots, mem_handle, NULL);
    int rc = omni_trec_check_block(t, pool_bytes, slots, mem_handle,
                                   event_handles + (uint64_t)OMNI_IPC_HANDLE_BYTES * t->slot);
    if (rc != OMNI_OK) return rc;
    if (t->device != device)
        return omni_fail(OMNI_EINVAL, "pool %s is on cuda:%u, not %u", t->pool, device, t->device);
    if (!event) return omni_fail(OMNI_EINVAL, "pool %s slot %u: no event opened", t->pool, t->slot);
    /* 1 -> 2 (opened), atomically: a replayed record, or one for a block not in flight, finds
     * another state and is refused; only one open of a block can ever succeed */
    uint32_t *state = states + t->slot, expected = 1;
    if (!__atomic_compare_exchange_n(state, &expected, 2, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return omni_fail(OMNI_EINVAL, "pool %s slot %u is not in flight", t->pool, t->slot);
    if ((rc = ready()) == OMNI_OK) {
        CUresult c = cu.cuStreamWaitEvent((CUstream)(uintptr_t)stream, (CUevent)(uintptr_t)event, 0);
        rc = c ? cuda_fail("cuStreamWaitEvent", c) : omni_trec_view(t, data, 1, stream, state, live, out);
    }
    if (rc != OMNI_OK) __atomic_store_n(state, 0, __ATOMIC_RELEASE); /* never used: back to the producer */
    return rc;
}
