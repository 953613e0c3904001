/* Public C API of the omni-server native transport. omni_transport/_ffi.py feeds this very file
 * to cffi (ABI mode): it is the one statement of the API and of the omni_record layout. Keep it
 * within what cffi parses: integer #defines, enums, typedefs, prototypes; the lines starting with
 * '#' other than integer #defines and the OMNI_API marker are dropped before parsing. The shared-memory layout, the
 * memory-ordering contract and slot ownership are described in docs/transport.md.
 *
 * Every function returning int returns OMNI_OK or one of the OMNI_E* codes below; after an
 * error, omni_last_error() (thread-local) says what happened. */
#ifndef OMNI_TRANSPORT_H
#define OMNI_TRANSPORT_H

#include <stdint.h>

#define OMNI_API __attribute__((visibility("default")))

#define OMNI_ABI_VERSION 9

enum {
    OMNI_OK = 0,
    OMNI_EFULL = 1,        /* push with timeout 0 on a ring without room */
    OMNI_EEMPTY = 2,       /* pop with timeout 0 on an empty ring */
    OMNI_ETIMEOUT = 3,     /* the timeout passed */
    OMNI_ECLOSED = 4,      /* the peer closed the ring or died */
    OMNI_ETOOLARGE = 5,    /* the record can never fit in the ring */
    OMNI_ESYS = 6,         /* a system call failed (message says which, with errno) */
    OMNI_EROLE = 7,        /* another live process already holds this side of the ring */
    OMNI_EFORMAT = 8,      /* attach: not a segment of this version and kind, not this user's,
                              or a header that does not match the file */
    OMNI_ENOCUDA = 9,      /* the CUDA driver library could not be loaded */
    OMNI_ECUDA = 10,       /* a CUDA driver call failed */
    OMNI_EINVAL = 11,      /* bad argument */
    OMNI_ECORRUPT = 12,    /* a counter or record in the ring failed validation */
};

OMNI_API uint32_t omni_transport_abi_version(void);
OMNI_API const char *omni_last_error(void);

/* ---- named segments (shared by the ring and the CUDA pool's release table) ---- */

/* A process-local handle on a named POSIX shared-memory segment (mode 0600). attach refuses a
 * file of another user or with access for others, and checks every header field against the
 * file (OMNI_EFORMAT). The segment keeps the identities (pid and start time) of its users; it is unlinked by the last user that closes, or by a closing user that
 * finds every other recorded user dead. Any thread may call these; a handle is not thread safe. */
typedef struct omni_segment omni_segment;
OMNI_API int omni_segment_create(const char *name, uint64_t size, omni_segment **out);
OMNI_API int omni_segment_attach(const char *name, omni_segment **out);
OMNI_API uint8_t *omni_segment_data(omni_segment *s); /* size bytes, 64-byte aligned, zeroed at create */
OMNI_API uint64_t omni_segment_size(const omni_segment *s);
OMNI_API void omni_segment_close(omni_segment *s);
/* The other recorded users of the segment: how many run, and how many died without leaving. */
OMNI_API void omni_segment_users(const omni_segment *s, int *alive, int *dead);
/* Remove /dev/shm segments whose name starts with prefix and that no live process uses
 * (crash cleanup). Writes the removed names into out (each NUL-terminated, an empty name
 * ends the list, as many as fit in out_len) and their count into *removed. */
OMNI_API int omni_unlink_leftovers(const char *prefix, char *out, uint64_t out_len,
                                   int *removed);

/* Atomic access to 32-bit words of a segment (e.g. the CUDA pool's block states). */
OMNI_API uint32_t omni_load_acquire_u32(const uint32_t *p);
OMNI_API void omni_store_release_u32(uint32_t *p, uint32_t v);

/* ---- SPSC ring ---- */

typedef struct omni_ring omni_ring;

enum { OMNI_PRODUCER = 0, OMNI_CONSUMER = 1 };

#define OMNI_RECORD_INLINE_BUFS 8

/* A record popped from the ring, valid until it is released: the consumer's own copy of what it
 * validated (every offset + length lies within [0, 2 * capacity) of omni_ring_data(r)). All words
 * are uint64_t. Offsets `at` and `*_off` are bytes from omni_ring_data(r): the record and
 * everything in it is contiguous there, thanks to the mirror mapping. The first
 * OMNI_RECORD_INLINE_BUFS buffers are described inline, the others by omni_record_buffer. */
typedef struct {
    uint64_t end;          /* ring position after this record: pass to omni_ring_release */
    uint64_t at;           /* offset of the record in the data area, < capacity */
    uint64_t size;         /* bytes of the record, framing included */
    uint64_t header_off;
    uint64_t header_len;
    uint64_t nbufs;
    uint64_t buf_off[OMNI_RECORD_INLINE_BUFS];
    uint64_t buf_len[OMNI_RECORD_INLINE_BUFS];
} omni_record;

/* capacity is rounded up to a power of two (at least one page). The data area is mapped twice,
 * back to back, so that every record is contiguous in memory even when it wraps. */
OMNI_API int omni_ring_create(const char *name, uint64_t capacity, omni_ring **out);
OMNI_API int omni_ring_attach(const char *name, omni_ring **out);
/* Marks this side closed, wakes the peer, unmaps; the handle is freed. With keep_mapping the
 * memory stays mapped (until the process exits) for views the caller could not take back. */
OMNI_API void omni_ring_close(omni_ring *r);
OMNI_API void omni_ring_close_ex(omni_ring *r, int keep_mapping);
OMNI_API uint64_t omni_ring_capacity(const omni_ring *r);
/* How long a blocking wait spins before it declares itself asleep (0: never spin). */
OMNI_API void omni_ring_set_spin_ns(omni_ring *r, uint64_t spin_ns);
/* 1 (the default): the spin watches whether its core is contended (a yield that ran the peer:
 * the next wait yields at once; the core held by another task longer than the spin: the next
 * waits sleep at once, with a backoff). 0: the spin as before ABI 9, for measurements. */
OMNI_API void omni_ring_set_contention_check(omni_ring *r, int on);
/* What this handle's blocking waits did so far (push waiting for room, pop for a record), by
 * index: spun (the event came while it spun), handed over (of those: right after a yield that
 * ran the peer on our core), slept, slept at once (of those: without spinning, because the core
 * was found contended). For tests and benchmarks. */
enum {
    OMNI_WAIT_SPUN = 0,
    OMNI_WAIT_HANDED_OVER = 1,
    OMNI_WAIT_SLEPT = 2,
    OMNI_WAIT_SLEPT_AT_ONCE = 3,
    OMNI_WAIT_COUNTS = 4
};
OMNI_API void omni_ring_wait_counts(const omni_ring *r, uint64_t *out); /* OMNI_WAIT_COUNTS words */
/* Takes a side of the ring for this handle; push / pop claim on first use. */
OMNI_API int omni_ring_claim(omni_ring *r, int role);

/* Producer only. Copies header and buffers into one record; blocks while the ring is full.
 * timeout_ns < 0: wait forever; 0: OMNI_EFULL at once. */
OMNI_API int omni_ring_push(omni_ring *r, const void *header, uint64_t header_len,
                            const void *const *bufs, const uint64_t *lens, uint32_t nbufs,
                            int64_t timeout_ns);
/* Consumer only. The record stays owned by the consumer until released; records must be
 * released in pop order (release(end) frees everything before end). timeout 0: OMNI_EEMPTY,
 * or OMNI_ECLOSED when the ring is drained and the producer closed or died. A record that
 * fails validation is OMNI_ECORRUPT (and stays at the read position). */
OMNI_API int omni_ring_pop(omni_ring *r, int64_t timeout_ns, omni_record *rec);
/* Buffer i of the record returned by the last pop (any i < nbufs; OMNI_EINVAL for another
 * record): from the consumer's validated copy, never read from the ring again. */
OMNI_API int omni_record_buffer(const omni_ring *r, const omni_record *rec, uint32_t i,
                                uint64_t *off, uint64_t *len);
/* The data area (2 * capacity bytes of address space: the area and its mirror). */
OMNI_API const uint8_t *omni_ring_data(const omni_ring *r);
/* OMNI_EINVAL unless end is the end of a popped, not yet released record. */
OMNI_API int omni_ring_release(omni_ring *r, uint64_t end);

/* For event loops, either side (an unclaimed handle is taken as the consumer). The doorbell fd
 * (connected to the peer's: no other process can ring it) becomes readable after omni_ring_arm
 * returned OMNI_OK and the peer made progress (consumer:
 * a record was published; producer: a record was released) or closed. arm returns OMNI_OK when
 * armed (go to sleep), OMNI_EFULL when there is progress already (not armed: pop, or retry the
 * push), OMNI_ECLOSED when the peer is gone (for a consumer: and the ring is empty). disarm
 * drains the doorbell and clears the sleeping flag. peer_fd is a pidfd of the peer (readable
 * when it dies), or -1 while no peer has attached. */
OMNI_API int omni_ring_doorbell_fd(omni_ring *r);
OMNI_API int omni_ring_peer_fd(omni_ring *r);
OMNI_API int omni_ring_arm(omni_ring *r);
OMNI_API void omni_ring_disarm(omni_ring *r);
/* Checks the peer (state flag, then liveness through the pidfd held since it was first seen
 * attached, or a claim that died before attaching): 1 when it closed or died, else 0. */
OMNI_API int omni_ring_peer_gone(omni_ring *r);
/* Consumer only. Spins (never sleeps) up to spin_ns for a record: OMNI_OK with it in rec,
 * OMNI_EEMPTY when none came, OMNI_ECLOSED when the ring is drained and the producer is gone.
 * For an event loop that keeps a hot stream off the doorbell's wake-up: bounded by spin_ns. */
OMNI_API int omni_ring_spin_pop(omni_ring *r, uint64_t spin_ns, omni_record *rec);

/* ---- CUDA IPC (driver API resolved with dlopen at run time) ---- */

#define OMNI_IPC_HANDLE_BYTES 64
OMNI_API int omni_cuda_available(void);
/* Memory: allocate / free a device pool in the current (or the device's primary) context. */
OMNI_API int omni_cuda_set_device(int device);
OMNI_API int omni_cuda_mem_alloc(uint64_t nbytes, uint64_t *dptr);
OMNI_API int omni_cuda_mem_free(uint64_t dptr);
OMNI_API int omni_cuda_ipc_get_mem_handle(uint64_t dptr, uint8_t *handle64);
OMNI_API int omni_cuda_ipc_open_mem_handle(const uint8_t *handle64, uint64_t *dptr);
OMNI_API int omni_cuda_ipc_close_mem_handle(uint64_t dptr);
/* Events: interprocess events (timing disabled). stream is a CUstream / cudaStream_t value. */
OMNI_API int omni_cuda_event_create_ipc(uint64_t *event);
OMNI_API int omni_cuda_event_destroy(uint64_t event);
OMNI_API int omni_cuda_event_record(uint64_t event, uint64_t stream);
OMNI_API int omni_cuda_event_synchronize(uint64_t event);
OMNI_API int omni_cuda_event_query(uint64_t event); /* OMNI_OK done, OMNI_EEMPTY not yet */
OMNI_API int omni_cuda_ipc_get_event_handle(uint64_t event, uint8_t *handle64);
OMNI_API int omni_cuda_ipc_open_event_handle(const uint8_t *handle64, uint64_t *event);
OMNI_API int omni_cuda_stream_wait_event(uint64_t stream, uint64_t event);
OMNI_API int omni_cuda_memcpy_dtod_async(uint64_t dst, uint64_t src, uint64_t nbytes,
                                         uint64_t stream);
/* Once the work queued on stream so far is done, stores 0 (release order) to *state, from the
 * driver's callback thread (cuLaunchHostFunc); if the driver refuses, after synchronizing the
 * stream here. */
OMNI_API int omni_cuda_release_after(uint64_t stream, uint32_t *state);
/* Waits for all work of the current context (host functions included). */
OMNI_API int omni_cuda_synchronize(void);

/* ---- the one-tensor record (tensor_record.c: layout and checks) ---- */

#define OMNI_TREC_MAX_DIMS 16
#define OMNI_TREC_NAME_MAX 200
#define OMNI_TREC_DTYPES 15 /* codes 0..14: bool uint8 int8 int16 int32 int64 uint16 uint32
                               uint64 float16 bfloat16 float32 float64 complex64 complex128 */
#define OMNI_TREC_REQUIRES_GRAD 1
#define OMNI_TREC_KEYED 2 /* the message was {key: tensor}, not the bare tensor */

typedef struct {
    uint32_t device;
    uint32_t slot;
    uint64_t offset;   /* bytes into the pool, a multiple of 512 */
    uint64_t nbytes;   /* shape x itemsize */
    uint32_t dtype;    /* a code above */
    uint32_t ndim;
    uint32_t flags;    /* OMNI_TREC_REQUIRES_GRAD | OMNI_TREC_KEYED */
    int64_t shape[OMNI_TREC_MAX_DIMS];
    int64_t strides[OMNI_TREC_MAX_DIMS]; /* in elements */
    uint8_t mem_handle[OMNI_IPC_HANDLE_BYTES];
    uint8_t event_handle[OMNI_IPC_HANDLE_BYTES];
    char pool[OMNI_TREC_NAME_MAX + 1];   /* NUL-terminated */
    char key[OMNI_TREC_NAME_MAX + 1];    /* "" for a bare tensor, else its one dict key */
} omni_trec;

/* Bytes of dtype code's element; 0 for an unknown code. */
OMNI_API int omni_trec_itemsize(uint32_t dtype);
OMNI_API uint64_t omni_trec_size(const omni_trec *t);
OMNI_API int omni_trec_encode(const omni_trec *t, uint8_t *out, uint64_t cap, uint64_t *len);
/* 1 when buf starts like a tensor record (pickle never does): no other check. */
OMNI_API int omni_trec_is_record(const uint8_t *buf, uint64_t len);
/* Parses and checks buf (OMNI_EINVAL with the reason for anything off). */
OMNI_API int omni_trec_decode(const uint8_t *buf, uint64_t len, omni_trec *t);
/* The record names a block of this pool: slot, block bounds, both handles. */
OMNI_API int omni_trec_check_block(const omni_trec *t, uint64_t pool_bytes, uint32_t slots,
                                   const uint8_t *mem_handle, const uint8_t *event_handle);
/* A DLPack DLManagedTensor (capsule "dltensor") over data + t->offset; its deleter stores 0 to
 * *state (CUDA: once the work queued on stream is done) and decrements *live, which this call
 * incremented. omni_trec_view_free runs that deleter, for a view no framework took. */
OMNI_API int omni_trec_view(const omni_trec *t, uint64_t data, int cuda, uint64_t stream,
                            uint32_t *state, uint64_t *live, void **out);
OMNI_API void omni_trec_view_free(void *view);
/* The sender's export of one tensor, one call (no Python between the steps): copies the
 * event handle into t, encodes t into out (refusing what omni_trec_encode refuses, before any
 * GPU work), queues the copy of t->nbytes from src into pool + t->offset on stream (src 0: the
 * tensor already lies in its block), records event on stream and stores 1 (in flight, release
 * order) to *state. */
OMNI_API int omni_trec_export(omni_trec *t, uint64_t pool, uint64_t src, uint64_t stream,
                              uint64_t event, const uint8_t *event_handle, uint32_t *state,
                              uint8_t *out, uint64_t cap, uint64_t *len);
/* The receiver's open of a decoded record, one call: the record names a block of the pool
 * (omni_trec_check_block against its geometry, memory handle and the slot's event handle in
 * event_handles) on the pool's device; the slot's state goes 1 -> 2 by compare-and-swap (a
 * replay, or a block not in flight, is refused); stream waits on event (the slot's, opened);
 * *out is the view of omni_trec_view over data. OMNI_EINVAL for a record that does not check
 * out (nothing changed); after the swap, any failure gives the block back (state 0). */
OMNI_API int omni_trec_accept(const omni_trec *t, uint64_t pool_bytes, uint32_t slots,
                              uint32_t device, const uint8_t *mem_handle,
                              const uint8_t *event_handles, uint32_t *states, uint64_t event,
                              uint64_t data, uint64_t stream, uint64_t *live, void **out);

#endif
