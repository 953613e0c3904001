"""cffi (ABI mode) binding of libomni_transport.so.

The C declarations below mirror transport_ext/include/omni_transport.h.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import cffi

ABI_VERSION = 5

ffi = cffi.FFI()
ffi.cdef(
    """
    enum {
        OMNI_OK = 0, OMNI_EFULL = 1, OMNI_EEMPTY = 2, OMNI_ETIMEOUT = 3, OMNI_ECLOSED = 4,
        OMNI_ETOOLARGE = 5, OMNI_ESYS = 6, OMNI_EROLE = 7, OMNI_EFORMAT = 8,
        OMNI_ENOCUDA = 9, OMNI_ECUDA = 10, OMNI_EINVAL = 11,
    };
    enum { OMNI_PRODUCER = 0, OMNI_CONSUMER = 1 };
    uint32_t omni_transport_abi_version(void);
    const char *omni_last_error(void);

    typedef struct omni_segment omni_segment;
    int omni_segment_create(const char *name, uint64_t size, omni_segment **out);
    int omni_segment_attach(const char *name, omni_segment **out);
    uint8_t *omni_segment_data(omni_segment *s);
    uint64_t omni_segment_size(const omni_segment *s);
    void omni_segment_close(omni_segment *s);
    int omni_unlink_leftovers(const char *prefix, char *out, uint64_t out_len, int *removed);
    uint32_t omni_load_acquire_u32(const uint32_t *p);
    void omni_store_release_u32(uint32_t *p, uint32_t v);

    typedef struct omni_ring omni_ring;
    typedef struct {
        uint64_t end;
        uint64_t at;
        uint64_t size;
        uint64_t header_off;
        uint64_t header_len;
        uint64_t nbufs;
        uint64_t buf_off[8];
        uint64_t buf_len[8];
    } omni_record;
    int omni_ring_create(const char *name, uint64_t capacity, omni_ring **out);
    int omni_ring_attach(const char *name, omni_ring **out);
    void omni_ring_close(omni_ring *r);
    void omni_ring_close_ex(omni_ring *r, int keep_mapping);
    uint64_t omni_ring_capacity(const omni_ring *r);
    void omni_ring_set_spin_ns(omni_ring *r, uint64_t spin_ns);
    int omni_ring_claim(omni_ring *r, int role);
    int omni_ring_push(omni_ring *r, const void *header, uint64_t header_len,
                       const void *const *bufs, const uint64_t *lens, uint32_t nbufs,
                       int64_t timeout_ns);
    int omni_ring_pop(omni_ring *r, int64_t timeout_ns, omni_record *rec);
    int omni_record_buffer(const omni_ring *r, const omni_record *rec, uint32_t i,
                           uint64_t *off, uint64_t *len);
    const uint8_t *omni_ring_data(const omni_ring *r);
    void omni_ring_release(omni_ring *r, uint64_t end);
    int omni_ring_doorbell_fd(omni_ring *r);
    int omni_ring_peer_fd(omni_ring *r);
    int omni_ring_arm(omni_ring *r);
    void omni_ring_disarm(omni_ring *r);
    int omni_ring_peer_gone(omni_ring *r);

    int omni_cuda_available(void);
    int omni_cuda_set_device(int device);
    int omni_cuda_mem_alloc(uint64_t nbytes, uint64_t *dptr);
    int omni_cuda_mem_free(uint64_t dptr);
    int omni_cuda_ipc_get_mem_handle(uint64_t dptr, uint8_t *handle64);
    int omni_cuda_ipc_open_mem_handle(const uint8_t *handle64, uint64_t *dptr);
    int omni_cuda_ipc_close_mem_handle(uint64_t dptr);
    int omni_cuda_event_create_ipc(uint64_t *event);
    int omni_cuda_event_destroy(uint64_t event);
    int omni_cuda_event_record(uint64_t event, uint64_t stream);
    int omni_cuda_event_synchronize(uint64_t event);
    int omni_cuda_event_query(uint64_t event);
    int omni_cuda_ipc_get_event_handle(uint64_t event, uint8_t *handle64);
    int omni_cuda_ipc_open_event_handle(const uint8_t *handle64, uint64_t *event);
    int omni_cuda_stream_wait_event(uint64_t stream, uint64_t event);
    int omni_cuda_memcpy_dtod_async(uint64_t dst, uint64_t src, uint64_t nbytes,
                                    uint64_t stream);
    """
)


def _library_candidates() -> list[Path]:
    # A source checkout (or a regular install) has the library next to this file; an editable
    # install maps the Python files to the source tree while the library stays in site-packages,
    # where the distribution's file list finds it.
    here = Path(__file__).resolve().parent
    found = sorted(here.glob("libomni_transport*.so"))
    try:
        files = metadata.files("omni-server") or []
    except metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.name.startswith("libomni_transport") and entry.name.endswith(".so"):
            found.append(Path(entry.locate()).resolve())
    return found


def _load():
    here = Path(__file__).resolve().parent
    candidates = _library_candidates()
    if not candidates:
        raise ImportError(
            f"libomni_transport.so not found next to {here}: install the package with "
            "`pip install .` or build it with `cmake -S . -B build && cmake --build build`"
        )
    # A stale build (say, an editable install's, older than a dev build) is skipped, not used.
    seen = []
    for path in candidates:
        lib = ffi.dlopen(str(path))
        found = lib.omni_transport_abi_version()
        if found == ABI_VERSION:
            return lib
        seen.append(f"{path} (ABI {found})")
    raise ImportError(
        f"libomni_transport ABI {ABI_VERSION} needed, found only {', '.join(seen)}: rebuild it "
        "(`cmake -S . -B build/dev && cmake --build build/dev`, or reinstall the package)"
    )


lib = _load()
