/* The SPSC shared-memory ring: one producer process, one consumer process, records of a header
 * plus N buffers, copied in once and read in place. Layout and ordering contract:
 * docs/transport.md. Counters only grow; a position maps to data[pos & mask], and because the
 * data area is mapped twice back to back, a record that crosses the end is still contiguous. */
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "atomics.h"
#include "segment.h"

#define RING_CTL_OFFSET 128
#define REC_MAGIC 0x31434552u /* "REC1" */
#define REC_ALIGN 64u
#define STATE_NONE 0u
#define STATE_ATTACHED 1u
#define STATE_CLOSED 2u
#define SLICE_MS 50
#define RNAME(r) ((r)->seg.name + 1) /* without the leading slash */ /* longest sleep between liveness checks when the peer has no pidfd */

/* One cache line per side. `pos`, `pid` and `state` are written only by that side's process
 * (pid/state once, by CAS / release store at claim and close). `sleeping` is set to 1 by that
 * side just before it sleeps and exchanged back to 0 by whichever side wakes it. */
struct ring_side {
    uint64_t pos;      /* producer: head = bytes published; consumer: tail = bytes released */
    int32_t pid;
    uint32_t state;
    uint32_t sleeping;
    uint8_t pad[OMNI_CACHELINE - 20];
} __attribute__((aligned(OMNI_CACHELINE)));

struct ring_ctl {
    uint64_t capacity; /* data bytes, a power of two; constant after create */
    uint8_t pad[OMNI_CACHELINE - 8];
    struct ring_side side[2]; /* [OMNI_PRODUCER], [OMNI_CONSUMER] */
};
_Static_assert(RING_CTL_OFFSET >= sizeof(struct seg_header), "ring control overlaps header");
_Static_assert(RING_CTL_OFFSET + sizeof(struct ring_ctl) <= 4096, "ring control beyond page");

/* A record, at a position that is a multiple of REC_ALIGN: this fixed part, lens[nbufs], the
 * header bytes, then each buffer at the next multiple of REC_ALIGN. size covers all of it. */
struct rec_hdr {
    uint64_t size;
    uint64_t header_len;
    uint32_t nbufs;
    uint32_t magic;
    uint64_t lens[];
};

struct omni_ring {
    struct omni_segment seg;
    struct ring_ctl *ctl;
    uint8_t *data;
    uint64_t capacity, mask;
    int role;            /* -1 until claimed */
    uint64_t local_pos;  /* producer: its head; consumer: read cursor (popped, maybe unreleased) */
    uint64_t peer_cache; /* producer: last tail seen; consumer: last head seen */
    uint64_t spin_ns;    /* the most a wait spins (set by the caller) */
    uint64_t spin_cur;   /* adaptive budget <= spin_ns (see adapt_spin) */
    int bell;            /* our doorbell: abstract datagram socket, bound at claim */
    int sender;          /* unbound datagram socket that rings the peer's doorbell */
    struct sockaddr_un peer_addr;
    socklen_t peer_addr_len;
    int peer_pidfd;
};

static inline uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) & ~(a - 1); }

static socklen_t bell_addr(const struct omni_ring *r, int role, struct sockaddr_un *a) {
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    /* abstract namespace (leading NUL): the name disappears with the socket, even on a crash */
    int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "omni-ring-%016llx-%c",
                     (unsigned long long)r->seg.hdr->nonce, role == OMNI_PRODUCER ? 'p' : 'c');
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

static void ring_peer(struct omni_ring *r) {
    if (r->sender < 0) return;
    /* EAGAIN: a wake-up is already queued; ECONNREFUSED: the peer is gone (the liveness
     * check reports it). Neither needs handling here. */
    (void)sendto(r->sender, "w", 1, MSG_DONTWAIT | MSG_NOSIGNAL,
                 (const struct sockaddr *)&r->peer_addr, r->peer_addr_len);
}

static void drain_bell(struct omni_ring *r) {
    char buf[16];
    while (recv(r->bell, buf, sizeof buf, MSG_DONTWAIT) > 0) {
    }
}

static int finish_open(struct omni_ring *r) {
    r->ctl = (struct ring_ctl *)(r->seg.base + RING_CTL_OFFSET);
    int64_t deadline = omni_now_ns() + 2000000000LL;
    while ((r->capacity = load_acquire_u64(&r->ctl->capacity)) == 0) {
        if (omni_now_ns() > deadline)
            return omni_fail(OMNI_EFORMAT, "%s: ring never initialised", RNAME(r));
        usleep(1000);
    }
    r->mask = r->capacity - 1;
    r->data = r->seg.base + r->seg.hdr->data_offset;
    r->role = -1;
    r->spin_ns = r->spin_cur = 20000;
    r->bell = r->sender = r->peer_pidfd = -1;
    return OMNI_OK;
}

int omni_ring_create(const char *name, uint64_t capacity, omni_ring **out) {
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    if (capacity == 0 || capacity > (1ULL << 40))
        return omni_fail(OMNI_EINVAL, "ring '%s': capacity %llu, give 1 B .. 1 TiB", name,
                         (unsigned long long)capacity);
    uint64_t cap = page;
    while (cap < capacity) cap <<= 1;
    struct omni_ring *r = calloc(1, sizeof *r);
    if (!r) return omni_fail(OMNI_ESYS, "out of memory");
    int rc = omni_seg_open(&r->seg, name, 1, OMNI_SEG_KIND_RING, cap, cap);
    if (rc != OMNI_OK) {
        free(r);
        return rc;
    }
    /* still private to us: the segment magic was published, but attach() also waits for
     * ctl->capacity (see below) */
    struct ring_ctl *ctl = (struct ring_ctl *)(r->seg.base + RING_CTL_OFFSET);
    store_release_u64(&ctl->capacity, cap); /* pairs with the acquire in finish_open */
    finish_open(r);
    *out = r;
    return OMNI_OK;
}

int omni_ring_attach(const char *name, omni_ring **out) {
    struct omni_ring *r = calloc(1, sizeof *r);
    if (!r) return omni_fail(OMNI_ESYS, "out of memory");
    int rc = omni_seg_open(&r->seg, name, 0, OMNI_SEG_KIND_RING, 0, 0);
    if (rc == OMNI_OK) rc = finish_open(r);
    if (rc != OMNI_OK) {
        if (r->seg.base) omni_seg_close(&r->seg);
        free(r);
        return rc;
    }
    *out = r;
    return OMNI_OK;
}

uint64_t omni_ring_capacity(const omni_ring *r) { return r->capacity; }
void omni_ring_set_spin_ns(omni_ring *r, uint64_t spin_ns) { r->spin_ns = r->spin_cur = spin_ns; }

int omni_ring_claim(omni_ring *r, int role) {
    if (role != OMNI_PRODUCER && role != OMNI_CONSUMER)
        return omni_fail(OMNI_EINVAL, "role %d: 0 (producer) or 1 (consumer)", role);
    if (r->role == role) return OMNI_OK;
    const char *what = role == OMNI_PRODUCER ? "producer" : "consumer";
    if (r->role >= 0)
        return omni_fail(OMNI_EROLE, "%s: this handle is the %s; one handle is one side",
                         RNAME(r), r->role == OMNI_PRODUCER ? "producer" : "consumer");
    struct ring_side *me = &r->ctl->side[role];
    int32_t pid = (int32_t)getpid();
    if (!cas_i32(&me->pid, 0, pid))
        return omni_fail(OMNI_EROLE, "%s: process %d already is its %s (SPSC ring)", RNAME(r),
                         load_acquire_i32(&me->pid), what);
    r->bell = socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    r->sender = socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_un a;
    socklen_t len = bell_addr(r, role, &a);
    if (r->bell < 0 || r->sender < 0 || bind(r->bell, (struct sockaddr *)&a, len) != 0) {
        int rc = omni_fail_errno("doorbell socket", RNAME(r));
        if (r->bell >= 0) close(r->bell);
        if (r->sender >= 0) close(r->sender);
        r->bell = r->sender = -1;
        cas_i32(&me->pid, pid, 0); /* give the side back: the claim did not happen */
        return rc;
    }
    r->peer_addr_len = bell_addr(r, 1 - role, &r->peer_addr);
    r->role = role;
    r->local_pos = load_acquire_u64(&me->pos);
    r->peer_cache = load_acquire_u64(&r->ctl->side[1 - role].pos);
    /* pairs with the acquire of state in peer_gone(): the doorbell is bound before the peer can
     * see us attached */
    store_seq_cst_u32(&me->state, STATE_ATTACHED);
    return OMNI_OK;
}

/* 1 when the peer closed or died (it must have attached first: a peer that never came is
 * waited for). Slow path only: it may make system calls. */
int omni_ring_peer_gone(omni_ring *r) {
    if (r->role < 0) return 0;
    struct ring_side *peer = &r->ctl->side[1 - r->role];
    uint32_t state = load_acquire_u32(&peer->state);
    if (state == STATE_CLOSED) return 1;
    if (state != STATE_ATTACHED) return 0;
    if (r->peer_pidfd < 0) {
        r->peer_pidfd = omni_pidfd_open(load_acquire_i32(&peer->pid));
        if (r->peer_pidfd < 0 && errno == ESRCH) return 1;
    }
    if (r->peer_pidfd >= 0) {
        struct pollfd p = {.fd = r->peer_pidfd, .events = POLLIN};
        if (poll(&p, 1, 0) == 1) return 1;
        /* a zombie (killed, not yet reaped) counts as dead even before its pidfd fires */
    }
    return omni_pid_dead(load_acquire_i32(&peer->pid));
}

int omni_ring_peer_fd(omni_ring *r) {
    if (r->peer_pidfd < 0) omni_ring_peer_gone(r);
    return r->peer_pidfd;
}

int omni_ring_doorbell_fd(omni_ring *r) { return r->bell; }

/* Space for `need` bytes (producer) or a record (consumer). The loads are seq_cst: they are the
 * second half of the sleeper's Dekker handshake (store sleeping=1, then load the counter). */
static int ready(struct omni_ring *r, uint64_t need) {
    if (r->role == OMNI_PRODUCER) {
        r->peer_cache = load_seq_cst_u64(&r->ctl->side[OMNI_CONSUMER].pos);
        return r->capacity - (r->local_pos - r->peer_cache) >= need;
    }
    r->peer_cache = load_seq_cst_u64(&r->ctl->side[OMNI_PRODUCER].pos);
    return r->peer_cache != r->local_pos;
}

static void adapt_spin(struct omni_ring *r, int64_t wait_start) {
    if (!r->spin_ns) return;
    if (omni_now_ns() - wait_start <= (int64_t)r->spin_ns)
        r->spin_cur = r->spin_ns;
    else
        r->spin_cur = r->spin_cur / 2 < 1000 ? 1000 : r->spin_cur / 2;
}

static int wait_ready(struct omni_ring *r, uint64_t need, int64_t timeout_ns) {
    int64_t start = omni_now_ns();
    int64_t deadline = timeout_ns < 0 ? INT64_MAX : start + timeout_ns;
    /* Spin only while spinning pays: a wait that ended within spin_ns (during the spin or
     * soon after it) restores the full budget; a longer one halves it (down to 1 us). So a
     * busy stream spins, and a quiet one, or a peer starved of CPU on an oversubscribed
     * machine, mostly sleeps. The spin yields the CPU every few microseconds for the same
     * reason. */
    for (uint64_t i = 0; r->spin_ns; i++) {
        if (ready(r, need)) return OMNI_OK;
        cpu_relax();
        if ((i & 63) == 63) {
            int64_t now = omni_now_ns();
            if (now - start >= (int64_t)r->spin_cur || now >= deadline) break;
            /* a runnable peer waiting for this CPU gets it; on an idle CPU this returns at
             * once. Without it, an oversubscribed host spends each spin starving the peer. */
            sched_yield();
        }
    }
    uint32_t *sleeping = &r->ctl->side[r->role].sleeping;
    for (;;) {
        if (ready(r, need)) {
            adapt_spin(r, start);
            return OMNI_OK;
        }
        if (omni_ring_peer_gone(r)) {
            /* a producer may have published its last records before it went */
            return ready(r, need) && r->role == OMNI_CONSUMER ? OMNI_OK : OMNI_ECLOSED;
        }
        int64_t now = omni_now_ns();
        if (now >= deadline) return OMNI_ETIMEOUT;
        store_seq_cst_u32(sleeping, 1);
        if (ready(r, need)) {
            store_seq_cst_u32(sleeping, 0);
            adapt_spin(r, start);
            return OMNI_OK;
        }
        int64_t left_ms = (deadline - now + 999999) / 1000000;
        int ms = r->peer_pidfd >= 0 ? (left_ms > 1000 ? 1000 : (int)left_ms)
                                    : (left_ms > SLICE_MS ? SLICE_MS : (int)left_ms);
        struct pollfd p[2] = {{.fd = r->bell, .events = POLLIN}, {.fd = r->peer_pidfd, .events = POLLIN}};
        int n = poll(p, r->peer_pidfd >= 0 ? 2 : 1, ms);
        if (n < 0 && errno != EINTR) {
            store_seq_cst_u32(sleeping, 0);
            return omni_fail_errno("poll", RNAME(r));
        }
        drain_bell(r);
        store_seq_cst_u32(sleeping, 0);
    }
}

/* After a counter store: wake the peer if it declared itself asleep. The counter store before
 * this is seq_cst, and so is this load: the first half of the waker's Dekker handshake. */
static inline void wake_peer(struct omni_ring *r) {
    uint32_t *s = &r->ctl->side[1 - r->role].sleeping;
    if (load_seq_cst_u32(s) && exchange_seq_cst_u32(s, 0)) ring_peer(r);
}

int omni_ring_push(omni_ring *r, const void *header, uint64_t header_len,
                   const void *const *bufs, const uint64_t *lens, uint32_t nbufs,
                   int64_t timeout_ns) {
    if (r->role != OMNI_PRODUCER) {
        int rc = omni_ring_claim(r, OMNI_PRODUCER);
        if (rc != OMNI_OK) return rc;
    }
    uint64_t first = align_up(sizeof(struct rec_hdr) + 8ULL * nbufs + header_len, REC_ALIGN);
    uint64_t size = first;
    for (uint32_t i = 0; i < nbufs; i++) size += align_up(lens[i], REC_ALIGN);
    if (size > r->capacity)
        return omni_fail(OMNI_ETOOLARGE, "%s: record of %llu bytes (with framing) exceeds the "
                         "ring capacity of %llu bytes", RNAME(r), (unsigned long long)size,
                         (unsigned long long)r->capacity);
    if (load_acquire_u32(&r->ctl->side[OMNI_CONSUMER].state) == STATE_CLOSED)
        return omni_fail(OMNI_ECLOSED, "%s: the consumer closed the ring", RNAME(r));
    if (r->capacity - (r->local_pos - r->peer_cache) < size) {
        /* pairs with the consumer's release of tail: its reads of the space are done */
        r->peer_cache = load_acquire_u64(&r->ctl->side[OMNI_CONSUMER].pos);
        if (r->capacity - (r->local_pos - r->peer_cache) < size) {
            if (timeout_ns == 0)
                return omni_fail(OMNI_EFULL, "%s: ring full", RNAME(r));
            int rc = wait_ready(r, size, timeout_ns);
            if (rc == OMNI_ETIMEOUT)
                return omni_fail(rc, "%s: no room for %llu bytes before the timeout", RNAME(r),
                                 (unsigned long long)size);
            if (rc == OMNI_ECLOSED)
                return omni_fail(rc, "%s: the consumer closed the ring or died", RNAME(r));
            if (rc != OMNI_OK) return rc;
        }
    }
    /* [local_pos, local_pos + size) is ours until head is published */
    uint8_t *p = r->data + (r->local_pos & r->mask);
    struct rec_hdr *h = (struct rec_hdr *)p;
    h->size = size;
    h->header_len = header_len;
    h->nbufs = nbufs;
    h->magic = REC_MAGIC;
    if (nbufs) memcpy(h->lens, lens, 8ULL * nbufs);
    if (header_len) memcpy(p + sizeof *h + 8ULL * nbufs, header, header_len);
    uint64_t off = first;
    for (uint32_t i = 0; i < nbufs; i++) {
        if (lens[i]) memcpy(p + off, bufs[i], lens[i]);
        off += align_up(lens[i], REC_ALIGN);
    }
    r->local_pos += size;
    /* publishes the record: pairs with the consumer's load of head (acquire or seq_cst) */
    __atomic_store_n(&r->ctl->side[OMNI_PRODUCER].pos, r->local_pos, __ATOMIC_SEQ_CST);
    wake_peer(r);
    return OMNI_OK;
}

int omni_ring_pop(omni_ring *r, int64_t timeout_ns, omni_record *rec) {
    if (r->role != OMNI_CONSUMER) {
        int rc = omni_ring_claim(r, OMNI_CONSUMER);
        if (rc != OMNI_OK) return rc;
    }
    if (r->local_pos == r->peer_cache) {
        /* pairs with the producer's seq_cst store of head: the record bytes are visible */
        r->peer_cache = load_acquire_u64(&r->ctl->side[OMNI_PRODUCER].pos);
        if (r->local_pos == r->peer_cache) {
            if (timeout_ns == 0) {
                if (load_acquire_u32(&r->ctl->side[OMNI_PRODUCER].state) == STATE_CLOSED &&
                    load_acquire_u64(&r->ctl->side[OMNI_PRODUCER].pos) == r->local_pos)
                    return omni_fail(OMNI_ECLOSED, "%s: the producer closed the ring", RNAME(r));
                return OMNI_EEMPTY;
            }
            int rc = wait_ready(r, 0, timeout_ns);
            if (rc == OMNI_ETIMEOUT)
                return omni_fail(rc, "%s: no record before the timeout", RNAME(r));
            if (rc == OMNI_ECLOSED)
                return omni_fail(rc, "%s: the producer closed the ring or died", RNAME(r));
            if (rc != OMNI_OK) return rc;
        }
    }
    const uint8_t *p = r->data + (r->local_pos & r->mask);
    const struct rec_hdr *h = (const struct rec_hdr *)p;
    uint64_t avail = r->peer_cache - r->local_pos;
    if (h->magic != REC_MAGIC || h->size == 0 || h->size % REC_ALIGN || h->size > avail ||
        sizeof *h + 8ULL * h->nbufs + h->header_len > h->size)
        return omni_fail(OMNI_EFORMAT, "%s: corrupt record at position %llu", RNAME(r),
                         (unsigned long long)r->local_pos);
    uint64_t at = r->local_pos & r->mask;
    uint64_t off = align_up(sizeof *h + 8ULL * h->nbufs + h->header_len, REC_ALIGN);
    for (uint32_t i = 0; i < h->nbufs; i++) {
        if (i < OMNI_RECORD_INLINE_BUFS) {
            rec->buf_off[i] = at + off;
            rec->buf_len[i] = h->lens[i];
        }
        off += align_up(h->lens[i], REC_ALIGN);
    }
    if (off != h->size)
        return omni_fail(OMNI_EFORMAT, "%s: corrupt record at position %llu (buffers)",
                         RNAME(r), (unsigned long long)r->local_pos);
    r->local_pos += h->size;
    rec->end = r->local_pos;
    rec->at = at;
    rec->size = h->size;
    rec->header_off = at + sizeof *h + 8ULL * h->nbufs;
    rec->header_len = h->header_len;
    rec->nbufs = h->nbufs;
    return OMNI_OK;
}

int omni_record_buffer(const omni_ring *r, const omni_record *rec, uint32_t i, uint64_t *off,
                       uint64_t *len) {
    const struct rec_hdr *h = (const struct rec_hdr *)(r->data + rec->at);
    if (i >= h->nbufs) return omni_fail(OMNI_EINVAL, "buffer %u of a record of %u", i, h->nbufs);
    uint64_t o = align_up(sizeof *h + 8ULL * h->nbufs + h->header_len, REC_ALIGN);
    for (uint32_t j = 0; j < i; j++) o += align_up(h->lens[j], REC_ALIGN);
    if (o + h->lens[i] > h->size)
        return omni_fail(OMNI_EFORMAT, "corrupt record: buffer %u beyond its end", i);
    *off = rec->at + o;
    *len = h->lens[i];
    return OMNI_OK;
}

const uint8_t *omni_ring_data(const omni_ring *r) { return r->data; }

void omni_ring_release(omni_ring *r, uint64_t end) {
    /* hands [tail, end) back to the producer: pairs with its acquire / seq_cst load of tail,
     * so our reads of those bytes happen before it overwrites them */
    __atomic_store_n(&r->ctl->side[OMNI_CONSUMER].pos, end, __ATOMIC_SEQ_CST);
    wake_peer(r);
}

int omni_ring_arm(omni_ring *r) {
    if (r->role < 0) {
        int rc = omni_ring_claim(r, OMNI_CONSUMER);
        if (rc != OMNI_OK) return rc;
    }
    uint32_t *sleeping = &r->ctl->side[r->role].sleeping;
    /* producer: "ready" means the consumer released something since the push that failed
     * (peer_cache holds the tail it saw); the caller then retries its push */
    uint64_t seen = r->peer_cache;
    store_seq_cst_u32(sleeping, 1);
    int progressed = ready(r, 0);
    if (r->role == OMNI_PRODUCER) progressed = r->peer_cache != seen;
    if (progressed) {
        store_seq_cst_u32(sleeping, 0);
        return OMNI_EFULL;
    }
    if (omni_ring_peer_gone(r)) {
        store_seq_cst_u32(sleeping, 0);
        if (r->role == OMNI_CONSUMER && ready(r, 0)) return OMNI_EFULL;
        return omni_fail(OMNI_ECLOSED, "%s: the %s closed the ring or died", RNAME(r),
                         r->role == OMNI_CONSUMER ? "producer" : "consumer");
    }
    return OMNI_OK;
}

void omni_ring_disarm(omni_ring *r) {
    if (r->role < 0) return;
    drain_bell(r);
    store_seq_cst_u32(&r->ctl->side[r->role].sleeping, 0);
}

void omni_ring_close(omni_ring *r) { omni_ring_close_ex(r, 0); }

void omni_ring_close_ex(omni_ring *r, int keep_mapping) {
    if (!r) return;
    if (r->role >= 0) {
        /* final: the peer's blocked wait sees it through peer_gone() */
        store_seq_cst_u32(&r->ctl->side[r->role].state, STATE_CLOSED);
        ring_peer(r);
    }
    if (r->bell >= 0) close(r->bell);
    if (r->sender >= 0) close(r->sender);
    if (r->peer_pidfd >= 0) close(r->peer_pidfd);
    if (keep_mapping)
        omni_seg_close_keep_mapping(&r->seg);
    else
        omni_seg_close(&r->seg);
    free(r);
}
