/* The SPSC shared-memory ring: one producer process, one consumer process, records of a header
 * plus N buffers, copied in once and read in place. Layout and ordering contract:
 * docs/transport.md. Counters only grow; a position maps to data[pos & mask], and because the
 * data area is mapped twice back to back, a record that crosses the end is still contiguous.
 *
 * Nothing read from the shared memory is trusted: another process of the same user (or a bug)
 * may write anything there. Every value read from it is loaded once into a local, validated,
 * and only the local is used; a bad value is OMNI_ECORRUPT, never an access outside the
 * mapping. */
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "atomics.h"
#include "segment.h"

#define RING_CTL_OFFSET 256
#define REC_MAGIC 0x31434552u /* "REC1" */
#define REC_ALIGN 64u
#define REC_FIXED 24u /* size, header_len, nbufs, magic */
#define STATE_NONE 0u
#define STATE_ATTACHED 1u
#define STATE_CLOSED 2u
#define SLICE_MS 50       /* longest sleep between liveness checks while the peer has no pidfd */
#define PIDFD_SLICE_MS 1000 /* with a pidfd: its readiness is the death signal, this a backstop */
#define RNAME(r) ((r)->seg.name + 1) /* without the leading slash */
/* The contention check of the spin (see spin_wait; docs/transport.md, "Waking up"). */
#define RAN_NS 2500          /* a sched_yield this long ran another task (alone: ~0.2 us) */
#define HELD_MIN_NS 20000    /* the core counts as held only when lost this long, at least */
#define HELD_STREAK 3        /* spins in a row that lost the core: it is contended */
#define BACKOFF_MIN 4        /* waits that sleep at once after the first contended spin */
#define BACKOFF_MAX 256      /* ... doubling each time the probe after them is contended again */

/* One cache line per side, written only by that side's process: `owner` by CAS at claim,
 * `bell` before `state` becomes ATTACHED (release), `state` at claim and close, `pos` on every
 * push / release, `wake_ns` before it rings the peer. The exception is `sleeping`: set to 1 by
 * that side just before it sleeps, exchanged back to 0 by whichever side wakes it. */
struct ring_side {
    uint64_t pos;      /* producer: head = bytes published; consumer: tail = bytes released */
    uint64_t owner;    /* omni_self_id() of the side's process, 0 while unclaimed */
    uint32_t state;
    uint32_t sleeping;
    uint64_t bell[2];  /* random name of this side's doorbell socket */
    uint64_t wake_ns;  /* monotonic time this side last rang the peer's doorbell */
    uint8_t pad[OMNI_CACHELINE - 48];
} __attribute__((aligned(OMNI_CACHELINE)));

struct ring_ctl {
    uint64_t capacity; /* data bytes, a power of two; constant after create */
    uint8_t pad[OMNI_CACHELINE - 8];
    struct ring_side side[2]; /* [OMNI_PRODUCER], [OMNI_CONSUMER] */
};
_Static_assert(RING_CTL_OFFSET >= sizeof(struct seg_header), "ring control overlaps header");
_Static_assert(RING_CTL_OFFSET + sizeof(struct ring_ctl) <= 4096, "ring control beyond page");
_Static_assert(sizeof(struct ring_side) == OMNI_CACHELINE, "one cache line per side");

/* A record, at a position that is a multiple of REC_ALIGN: this fixed part, lens[nbufs], the
 * header bytes, then each buffer at the next multiple of REC_ALIGN. size covers all of it. */
struct rec_hdr {
    uint64_t size;
    uint64_t header_len;
    uint32_t nbufs;
    uint32_t magic;
    uint64_t lens[];
};
_Static_assert(sizeof(struct rec_hdr) == REC_FIXED, "record framing");

struct omni_ring {
    struct omni_segment seg;
    struct ring_ctl *ctl;
    uint8_t *data;
    uint64_t capacity, mask; /* validated copy: never read back from the segment */
    int role;            /* -1 until claimed */
    uint64_t local_pos;  /* producer: its head; consumer: read cursor (popped, maybe unreleased) */
    uint64_t released;   /* consumer: the tail it last stored */
    uint64_t peer_cache; /* producer: last tail seen; consumer: last head seen */
    uint64_t spin_ns;    /* the most a wait spins (set by the caller) */
    uint64_t spin_cur;   /* adaptive budget <= spin_ns (see adapt_spin) */
    int contention_check; /* 0: the spin as before 2026-12-03 (for measurements) */
    int yield_first;      /* the last event came in a yield that ran the peer on our core */
    uint32_t sleep_waits; /* waits left that sleep without spinning (our core is contended) */
    uint32_t backoff;     /* what sleep_waits is set to at the next contended spin / 2 */
    uint32_t held;        /* spins in a row that lost the core for longer than they spin */
    uint64_t counts[OMNI_WAIT_COUNTS]; /* what blocking waits did (omni_ring_wait_counts) */
    int bell;            /* our doorbell: abstract datagram socket, connected to the peer's */
    int bell_connected;  /* 1 once connected to the peer's doorbell */
    uint64_t peer_id;    /* the peer's identity, once seen attached */
    int peer_pidfd;      /* held from the first sight of the attached peer */
    int peer_dead;       /* the peer was found dead when first seen */
    int peer_refused;    /* its doorbell refused a wake-up: its socket is gone */
    /* validated (offset, length) of buffers OMNI_RECORD_INLINE_BUFS.. of the last record */
    uint64_t *ext;
    uint64_t ext_cap, ext_n, ext_end;
};

static inline uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) & ~(a - 1); }

static socklen_t bell_addr(const uint64_t bell[2], struct sockaddr_un *a) {
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    /* abstract namespace (leading NUL): the name disappears with the socket, even on a crash */
    int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "omni-ring-%016llx%016llx",
                     (unsigned long long)bell[0], (unsigned long long)bell[1]);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

/* Our doorbell: bound to a random abstract name, drawn at claim (128 bits: nobody can take it
 * first, since nobody could know it before it was bound). A connected unix datagram socket
 * accepts datagrams only from the socket it is connected to (others get EPERM), and a socket
 * may connect to it only while it is unconnected or connected back: so the first side stays
 * unconnected until its peer connected to it, and from then on no other process can ring
 * either side, whatever it reads in /proc/net/unix. In the window before the peer attaches a
 * stranger's datagram is only a spurious wake-up (a waiter re-checks the counters, and wakes
 * every SLICE_MS then anyway). */
static int make_bell(struct omni_ring *r, uint64_t bell[2]) {
    r->bell = socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (r->bell < 0) return omni_fail_errno("doorbell socket", RNAME(r));
    struct sockaddr_un a;
    for (int attempt = 0;; attempt++) {
        if (getrandom(bell, 16, 0) != 16) break;
        socklen_t len = bell_addr(bell, &a);
        if (bind(r->bell, (struct sockaddr *)&a, len) == 0) return OMNI_OK;
        if (errno != EADDRINUSE || attempt == 3) break;
    }
    int rc = omni_fail_errno("doorbell bind", RNAME(r));
    close(r->bell);
    r->bell = -1;
    return rc;
}

/* On the first sight of the attached peer: hold its pidfd (a pid could be reused; the pidfd's
 * process cannot). Then, until it succeeds, connect our doorbell to the peer's. Slow path
 * only. */
static void see_peer(struct omni_ring *r) {
    struct ring_side *peer = &r->ctl->side[1 - r->role];
    /* pairs with the peer's seq_cst store of ATTACHED: owner and bell are written before it */
    uint32_t state = load_acquire_u32(&peer->state);
    if (state != STATE_ATTACHED && state != STATE_CLOSED) return;
    if (!r->peer_id) {
        uint64_t id = load_acquire_u64(&peer->owner);
        if (id == 0) return; /* a claim in progress: not attached yet */
        r->peer_id = id;
        r->peer_pidfd = omni_pidfd_open(omni_id_pid(id));
        /* the pidfd was opened on whatever now has that pid: it is the peer only if the peer
         * is still alive after the open (its start time still matches) */
        if (omni_id_dead(id)) {
            r->peer_dead = 1;
            if (r->peer_pidfd >= 0) close(r->peer_pidfd);
            r->peer_pidfd = -1;
        }
    }
    if (r->bell_connected || r->peer_dead || state != STATE_ATTACHED) return;
    uint64_t bell[2] = {load_relaxed_u64(&peer->bell[0]), load_relaxed_u64(&peer->bell[1])};
    struct sockaddr_un a;
    socklen_t len = bell_addr(bell, &a);
    /* fails with ECONNREFUSED when its socket is gone (it closed or died: the liveness checks
     * report that), EPERM in no case of ours (it is unconnected or connected to us) */
    if (connect(r->bell, (struct sockaddr *)&a, len) == 0) r->bell_connected = 1;
}

static void ring_peer(struct omni_ring *r) {
    if (!r->bell_connected) see_peer(r);
    if (!r->bell_connected) return;
    /* when the peer woke: its spin adaptation learns when the event came, not when it ran */
    __atomic_store_n(&r->ctl->side[r->role].wake_ns, (uint64_t)omni_now_ns(), __ATOMIC_RELAXED);
    /* EAGAIN: a wake-up is already queued. ECONNREFUSED: the peer's socket is gone (it
     * closed or died, asleep): noted, so that the next push looks at the peer instead of
     * filling the ring for no one. */
    if (send(r->bell, "w", 1, MSG_DONTWAIT | MSG_NOSIGNAL) < 0 && errno == ECONNREFUSED)
        r->peer_refused = 1;
}

static void drain_bell(struct omni_ring *r) {
    char buf[16];
    while (recv(r->bell, buf, sizeof buf, MSG_DONTWAIT) > 0) {
    }
}

static int finish_open(struct omni_ring *r) {
    r->ctl = (struct ring_ctl *)(r->seg.base + RING_CTL_OFFSET);
    r->role = -1;
    r->bell = r->peer_pidfd = -1;
    int64_t deadline = omni_now_ns() + 2000000000LL;
    uint64_t cap;
    while ((cap = load_acquire_u64(&r->ctl->capacity)) == 0) {
        if (omni_now_ns() > deadline)
            return omni_fail(OMNI_EFORMAT, "%s: ring never initialised", RNAME(r));
        usleep(1000);
    }
    /* the segment checked mirror_len against the file: the capacity must be that */
    if (cap != r->seg.mirror_len)
        return omni_fail(OMNI_EFORMAT, "%s: capacity %llu, but the file holds %llu data bytes: "
                         "corrupt", RNAME(r), (unsigned long long)cap,
                         (unsigned long long)r->seg.mirror_len);
    r->capacity = cap;
    r->mask = cap - 1;
    r->data = r->seg.base + r->seg.data_offset;
    r->spin_ns = r->spin_cur = 20000;
    r->contention_check = 1;
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
void omni_ring_set_spin_ns(omni_ring *r, uint64_t spin_ns) {
    if (spin_ns > 1000000000ULL) spin_ns = 1000000000ULL; /* a second: more is a mistake */
    r->spin_ns = r->spin_cur = spin_ns;
}

void omni_ring_set_contention_check(omni_ring *r, int on) {
    r->contention_check = on != 0;
    r->yield_first = 0;
    r->sleep_waits = r->backoff = r->held = 0;
}

void omni_ring_wait_counts(const omni_ring *r, uint64_t *out) {
    memcpy(out, r->counts, sizeof r->counts);
}

int omni_ring_claim(omni_ring *r, int role) {
    if (role != OMNI_PRODUCER && role != OMNI_CONSUMER)
        return omni_fail(OMNI_EINVAL, "role %d: 0 (producer) or 1 (consumer)", role);
    if (r->role == role) return OMNI_OK;
    const char *what = role == OMNI_PRODUCER ? "producer" : "consumer";
    if (r->role >= 0)
        return omni_fail(OMNI_EROLE, "%s: this handle is the %s; one handle is one side",
                         RNAME(r), r->role == OMNI_PRODUCER ? "producer" : "consumer");
    struct ring_side *me = &r->ctl->side[role];
    uint64_t id = omni_self_id();
    uint64_t cur = load_acquire_u64(&me->owner);
    /* a side whose claimer died before it attached was never used: it may be taken again */
    int free_side = cur == 0 || (load_acquire_u32(&me->state) == STATE_NONE && omni_id_dead(cur));
    if (!free_side || !cas_u64(&me->owner, cur, id))
        return omni_fail(OMNI_EROLE, "%s: process %d already is its %s (SPSC ring)", RNAME(r),
                         omni_id_pid(load_acquire_u64(&me->owner)), what);
    omni_test_hook("claim");
    uint64_t bell[2];
    int rc = make_bell(r, bell);
    if (rc != OMNI_OK) {
        cas_u64(&me->owner, id, 0); /* give the side back: the claim did not happen */
        return rc;
    }
    __atomic_store_n(&me->bell[0], bell[0], __ATOMIC_RELAXED);
    __atomic_store_n(&me->bell[1], bell[1], __ATOMIC_RELAXED);
    r->role = role;
    r->local_pos = r->released = load_acquire_u64(&me->pos);
    r->peer_cache = load_acquire_u64(&r->ctl->side[1 - role].pos);
    /* pairs with the acquire of state in see_peer(): owner and doorbell are set before the
     * peer can see us attached */
    store_seq_cst_u32(&me->state, STATE_ATTACHED);
    see_peer(r);
    return OMNI_OK;
}

/* 1 when the peer closed or died (including between its claim and its ATTACHED). A peer that
 * never came is waited for. Slow path only: it makes system calls. */
int omni_ring_peer_gone(omni_ring *r) {
    if (r->role < 0) return 0;
    struct ring_side *peer = &r->ctl->side[1 - r->role];
    uint32_t state = load_acquire_u32(&peer->state);
    if (state == STATE_CLOSED) return 1;
    if (state == STATE_NONE) {
        uint64_t id = load_acquire_u64(&peer->owner);
        return id != 0 && omni_id_dead(id); /* died in its claim window */
    }
    see_peer(r);
    if (r->peer_dead) return 1;
    if (r->peer_pidfd >= 0) {
        /* readable once the process exited (a zombie too) */
        struct pollfd p = {.fd = r->peer_pidfd, .events = POLLIN};
        return poll(&p, 1, 0) == 1;
    }
    return omni_id_dead(r->peer_id); /* no pidfd (old kernel): the identity, never a bare pid */
}

int omni_ring_peer_fd(omni_ring *r) {
    if (r->peer_pidfd < 0) omni_ring_peer_gone(r);
    return r->peer_pidfd;
}

int omni_ring_doorbell_fd(omni_ring *r) { return r->bell; }

/* Space for `need` bytes (producer) or a record (consumer). The loads are seq_cst: they are the
 * second half of the sleeper's Dekker handshake (store sleeping=1, then load the counter). A
 * counter that makes no sense counts as ready: push / pop then validate it and refuse. */
static int ready(struct omni_ring *r, uint64_t need) {
    if (r->role == OMNI_PRODUCER) {
        r->peer_cache = load_seq_cst_u64(&r->ctl->side[OMNI_CONSUMER].pos);
        uint64_t used = r->local_pos - r->peer_cache;
        return used > r->capacity || r->capacity - used >= need;
    }
    r->peer_cache = load_seq_cst_u64(&r->ctl->side[OMNI_PRODUCER].pos);
    return r->peer_cache != r->local_pos;
}

/* Spin only while spinning pays: a wait whose event came within spin_ns of its start restores
 * the full budget; a later one halves it (down to 1 us). The event time of a wait that slept is
 * when the peer rang the doorbell (it notes that in wake_ns), not when the scheduler ran us:
 * a wake-up costs tens of microseconds, more than the spin, and judging by it would shrink the
 * budget for good. So a busy stream spins, and a quiet one mostly sleeps. */
static void adapt_spin(struct omni_ring *r, int64_t start, int slept) {
    if (!r->spin_ns) return;
    int64_t event = omni_now_ns();
    if (slept) {
        /* a value from shared memory: used only when it is plausible, and only for this */
        int64_t rang =
            (int64_t)__atomic_load_n(&r->ctl->side[1 - r->role].wake_ns, __ATOMIC_RELAXED);
        if (rang >= start && rang <= event) event = rang;
    }
    if (event - start <= (int64_t)r->spin_ns)
        r->spin_cur = r->spin_ns;
    else
        r->spin_cur = r->spin_cur / 2 < 1000 ? 1000 : r->spin_cur / 2;
}

/* This spin lost its core to another task for longer than it would spin. Once in a while that
 * is a stranger's burst; HELD_STREAK spins in a row mean a task that wants the core all the
 * time (a stage computing) shares it with us, and then spinning cannot pay: each yield hands it
 * the core for a whole time slice (milliseconds), while a task that sleeps is the one the
 * scheduler runs first when it wakes. So the next waits sleep at once: BACKOFF_MIN, then twice
 * as many each time the spin after them (the probe) loses its core again, at most BACKOFF_MAX;
 * while a backoff is left, one lost spin is enough. A spin that gets its event without losing
 * its core forgets the streak and halves the backoff (one handed over by the peer on our core,
 * a shared core, forgets both): a lucky probe does not buy three more lost time slices. */
static void contended(struct omni_ring *r) {
    r->yield_first = 0;
    /* after a contended spin, until the backoff has decayed, one lost spin is enough */
    if (++r->held < HELD_STREAK && !r->backoff) return;
    r->backoff = r->backoff < BACKOFF_MIN ? BACKOFF_MIN
                 : r->backoff < BACKOFF_MAX ? 2 * r->backoff : BACKOFF_MAX;
    r->sleep_waits = r->backoff;
}

/* The spin of a blocking wait: 1 when the counter became ready, 0 to go to sleep. It yields the
 * CPU every 64 pauses (a runnable peer waiting for this core gets it; on an idle core
 * sched_yield returns at once), and it watches what the yields and the clock say about the core
 * (unless the check is off: then only the budget ends it, as before 2026-12-03):
 * - a yield that took RAN_NS or more and after which the record (or room) was there ran the
 *   peer on our core: the two share it (the usual state of a ping-pong on a machine with one
 *   free core), and the next wait yields at its first look instead of pausing 64 times first:
 *   the handoff is then one context switch (~1 us);
 * - a gap between two looks (a yield, or a preemption between pauses) longer than the budget
 *   and than HELD_MIN_NS: another task held our core for longer than we would spin
 *   (contended()). Both kinds of evidence are only about when to sleep: the sleep itself, and
 *   what makes it safe (the Dekker handshake in wait_ready), are unchanged. */
static int spin_wait(struct omni_ring *r, uint64_t need, int64_t start, int64_t deadline) {
    int64_t budget = (int64_t)r->spin_cur;
    if (!r->spin_ns || !budget) return 0;
    /* a short budget (a stream whose events come late) is overrun by 64 pauses alone */
    int64_t held_max = budget > HELD_MIN_NS ? budget : HELD_MIN_NS;
    int check = r->contention_check;
    if (check && r->sleep_waits) {
        r->sleep_waits--;
        r->counts[OMNI_WAIT_SLEPT_AT_ONCE]++;
        return 0;
    }
    int eager = check && r->yield_first;
    r->yield_first = 0;
    int64_t last = start;
    for (uint64_t i = 0;; i++) {
        if (ready(r, need)) {
            r->held = 0; /* this spin kept its core */
            r->backoff /= 2;
            return 1;
        }
        if (!eager) {
            cpu_relax();
            if ((i & 63) != 63) continue;
        }
        int64_t now = omni_now_ns();
        if (check && now - last > held_max) { /* preempted between two looks */
            contended(r);
            return ready(r, need);
        }
        if (now - start >= budget || now >= deadline) return 0;
        sched_yield();
        if (!check) continue;
        last = omni_now_ns();
        int64_t held = last - now;
        if (held > held_max) {
            contended(r);
            return ready(r, need);
        }
        /* A host whose yield alone took RAN_NS would read every yield as a handover: the next
         * wait would yield at each look, a system call per look on a free core (slower, never
         * wrong). The shortest yield is not a usable yardstick: on a shared core every yield
         * switches. */
        if (held >= RAN_NS && ready(r, need)) {
            r->counts[OMNI_WAIT_HANDED_OVER]++;
            r->yield_first = 1;
            r->backoff = r->held = 0;
            return 1;
        }
    }
}

static int wait_ready(struct omni_ring *r, uint64_t need, int64_t timeout_ns) {
    int64_t start = omni_now_ns();
    int64_t deadline = omni_deadline(timeout_ns);
    if (spin_wait(r, need, start, deadline)) {
        r->counts[OMNI_WAIT_SPUN]++;
        adapt_spin(r, start, 0);
        return OMNI_OK;
    }
    r->counts[OMNI_WAIT_SLEPT]++;
    uint32_t *sleeping = &r->ctl->side[r->role].sleeping;
    for (int slept = 0;; slept = 1) {
        if (ready(r, need)) {
            adapt_spin(r, start, slept);
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
            adapt_spin(r, start, slept);
            return OMNI_OK;
        }
        int64_t left_ms = (deadline - now) / 1000000 + 1;
        int slice = r->peer_pidfd >= 0 ? PIDFD_SLICE_MS : SLICE_MS;
        int ms = left_ms > slice ? slice : (int)left_ms;
        struct pollfd p[2] = {{.fd = r->bell, .events = POLLIN},
                              {.fd = r->peer_pidfd, .events = POLLIN}};
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

/* The producer's view of the consumer's tail, validated: at most capacity behind our head and
 * never ahead of it. */
static int check_tail(struct omni_ring *r) {
    uint64_t used = r->local_pos - r->peer_cache;
    if (used > r->capacity)
        return omni_fail(OMNI_ECORRUPT, "%s: corrupt ring: tail %llu against head %llu",
                         RNAME(r), (unsigned long long)r->peer_cache,
                         (unsigned long long)r->local_pos);
    return OMNI_OK;
}

int omni_ring_push(omni_ring *r, const void *header, uint64_t header_len,
                   const void *const *bufs, const uint64_t *lens, uint32_t nbufs,
                   int64_t timeout_ns) {
    if (r->role != OMNI_PRODUCER) {
        int rc = omni_ring_claim(r, OMNI_PRODUCER);
        if (rc != OMNI_OK) return rc;
    }
    /* every term is checked against the capacity (at most 2^40) before it is added: no sum
     * can wrap */
    uint64_t first = 0, size = r->capacity + 1;
    if (nbufs <= r->capacity / 8 && header_len <= r->capacity) {
        first = align_up(REC_FIXED + 8ULL * nbufs + header_len, REC_ALIGN);
        size = first;
        for (uint32_t i = 0; i < nbufs && size <= r->capacity; i++)
            size += lens[i] <= r->capacity ? align_up(lens[i], REC_ALIGN) : r->capacity + 1;
    }
    if (size > r->capacity)
        return omni_fail(OMNI_ETOOLARGE, "%s: record of %llu bytes (with framing) exceeds the "
                         "ring capacity of %llu bytes", RNAME(r), (unsigned long long)size,
                         (unsigned long long)r->capacity);
    if (load_acquire_u32(&r->ctl->side[OMNI_CONSUMER].state) == STATE_CLOSED ||
        ((r->peer_refused || r->peer_dead) && omni_ring_peer_gone(r)))
        return omni_fail(OMNI_ECLOSED, "%s: the consumer closed the ring or died", RNAME(r));
    uint64_t used = r->local_pos - r->peer_cache;
    if (used > r->capacity || r->capacity - used < size) {
        /* pairs with the consumer's release of tail: its reads of the space are done */
        r->peer_cache = load_acquire_u64(&r->ctl->side[OMNI_CONSUMER].pos);
        int rc = check_tail(r);
        if (rc != OMNI_OK) return rc;
        if (r->capacity - (r->local_pos - r->peer_cache) < size) {
            if (timeout_ns == 0) {
                if (omni_ring_peer_gone(r))
                    return omni_fail(OMNI_ECLOSED, "%s: the consumer closed the ring or died",
                                     RNAME(r));
                return omni_fail(OMNI_EFULL, "%s: ring full", RNAME(r));
            }
            rc = wait_ready(r, size, timeout_ns);
            if (rc == OMNI_ETIMEOUT)
                return omni_fail(rc, "%s: no room for %llu bytes before the timeout", RNAME(r),
                                 (unsigned long long)size);
            if (rc == OMNI_ECLOSED)
                return omni_fail(rc, "%s: the consumer closed the ring or died", RNAME(r));
            if (rc != OMNI_OK) return rc;
            if ((rc = check_tail(r)) != OMNI_OK) return rc;
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
    if (header_len) memcpy(p + REC_FIXED + 8ULL * nbufs, header, header_len);
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

static int corrupt(struct omni_ring *r, const char *what) {
    return omni_fail(OMNI_ECORRUPT, "%s: corrupt record at position %llu: %s", RNAME(r),
                     (unsigned long long)r->local_pos, what);
}

/* Parses the record at the read cursor. Each field is loaded from shared memory exactly once
 * (relaxed atomic loads: the compiler may not load them again), checked, and only the checked
 * copy is used; the order of the checks keeps every sum below 2^42 (no wrap). */
static int parse_record(struct omni_ring *r, omni_record *rec) {
    uint64_t avail = r->peer_cache - r->local_pos;
    if (avail > r->capacity)
        return omni_fail(OMNI_ECORRUPT, "%s: corrupt ring: head %llu against read position %llu",
                         RNAME(r), (unsigned long long)r->peer_cache,
                         (unsigned long long)r->local_pos);
    uint64_t at = r->local_pos & r->mask;
    struct rec_hdr *h = (struct rec_hdr *)(r->data + at); /* at + size <= 2 * capacity below */
    uint64_t size = __atomic_load_n(&h->size, __ATOMIC_RELAXED);
    uint64_t header_len = __atomic_load_n(&h->header_len, __ATOMIC_RELAXED);
    uint32_t nbufs = __atomic_load_n(&h->nbufs, __ATOMIC_RELAXED);
    uint32_t magic = __atomic_load_n(&h->magic, __ATOMIC_RELAXED);
    if (magic != REC_MAGIC) return corrupt(r, "bad magic");
    if (size < REC_ALIGN || size % REC_ALIGN || size > avail)
        return corrupt(r, "size not a multiple of 64 within the published bytes");
    if (nbufs > (size - REC_FIXED) / 8) return corrupt(r, "more buffers than fit");
    uint64_t fixed = REC_FIXED + 8ULL * nbufs; /* <= size */
    if (header_len > size - fixed) return corrupt(r, "header beyond the record");
    if (nbufs > OMNI_RECORD_INLINE_BUFS) {
        uint64_t need = 2ULL * (nbufs - OMNI_RECORD_INLINE_BUFS);
        if (need > r->ext_cap) {
            uint64_t *ext = realloc(r->ext, need * sizeof *ext);
            if (!ext) return omni_fail(OMNI_ESYS, "%s: out of memory for %u buffers", RNAME(r),
                                       nbufs);
            r->ext = ext;
            r->ext_cap = need;
        }
    }
    uint64_t off = align_up(fixed + header_len, REC_ALIGN); /* <= size + 63 */
    for (uint32_t i = 0; i < nbufs; i++) {
        uint64_t len = __atomic_load_n(&h->lens[i], __ATOMIC_RELAXED);
        if (off > size || len > size - off) return corrupt(r, "buffer beyond the record");
        if (i < OMNI_RECORD_INLINE_BUFS) {
            rec->buf_off[i] = at + off;
            rec->buf_len[i] = len;
        } else {
            r->ext[2 * (i - OMNI_RECORD_INLINE_BUFS)] = at + off;
            r->ext[2 * (i - OMNI_RECORD_INLINE_BUFS) + 1] = len;
        }
        off += align_up(len, REC_ALIGN);
    }
    if (off != size) return corrupt(r, "buffers do not fill the record");
    r->local_pos += size;
    r->ext_n = nbufs;
    r->ext_end = r->local_pos;
    rec->end = r->local_pos;
    rec->at = at;
    rec->size = size;
    rec->header_off = at + fixed;
    rec->header_len = header_len;
    rec->nbufs = nbufs;
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
                if (!omni_ring_peer_gone(r)) return OMNI_EEMPTY;
                /* it may have published a last record after our look */
                r->peer_cache = load_acquire_u64(&r->ctl->side[OMNI_PRODUCER].pos);
                if (r->local_pos == r->peer_cache)
                    return omni_fail(OMNI_ECLOSED, "%s: the producer closed the ring or died",
                                     RNAME(r));
            } else {
                int rc = wait_ready(r, 0, timeout_ns);
                if (rc == OMNI_ETIMEOUT)
                    return omni_fail(rc, "%s: no record before the timeout", RNAME(r));
                if (rc == OMNI_ECLOSED)
                    return omni_fail(rc, "%s: the producer closed the ring or died", RNAME(r));
                if (rc != OMNI_OK) return rc;
            }
        }
    }
    return parse_record(r, rec);
}

int omni_ring_spin_pop(omni_ring *r, uint64_t spin_ns, omni_record *rec) {
    int rc = omni_ring_pop(r, 0, rec);
    if (rc != OMNI_EEMPTY || !spin_ns) return rc;
    int64_t start = omni_now_ns();
    for (uint64_t i = 1;; i++) {
        cpu_relax();
        /* pairs with the producer's seq_cst store of head, as in pop */
        if (load_acquire_u64(&r->ctl->side[OMNI_PRODUCER].pos) != r->local_pos)
            return omni_ring_pop(r, 0, rec);
        if ((i & 63) == 0) {
            if (omni_now_ns() - start >= (int64_t)spin_ns) return omni_ring_pop(r, 0, rec);
            sched_yield(); /* a runnable peer on this CPU gets it (see wait_ready) */
        }
    }
}

int omni_record_buffer(const omni_ring *r, const omni_record *rec, uint32_t i, uint64_t *off,
                       uint64_t *len) {
    /* from the validated copies only: never from the ring again */
    if (rec->end != r->ext_end || i >= r->ext_n)
        return omni_fail(OMNI_EINVAL, "buffer %u: not a buffer of the last record popped", i);
    if (i < OMNI_RECORD_INLINE_BUFS) {
        *off = rec->buf_off[i];
        *len = rec->buf_len[i];
    } else {
        *off = r->ext[2 * (i - OMNI_RECORD_INLINE_BUFS)];
        *len = r->ext[2 * (i - OMNI_RECORD_INLINE_BUFS) + 1];
    }
    return OMNI_OK;
}

const uint8_t *omni_ring_data(const omni_ring *r) { return r->data; }

int omni_ring_release(omni_ring *r, uint64_t end) {
    /* positions are counted modulo 2^64, like head and tail */
    uint64_t step = end - r->released;
    if (r->role != OMNI_CONSUMER || step == 0 || step > r->local_pos - r->released ||
        step % REC_ALIGN)
        return omni_fail(OMNI_EINVAL, "%s: release(%llu): not the end of a popped record",
                         RNAME(r), (unsigned long long)end);
    r->released = end;
    /* hands [tail, end) back to the producer: pairs with its acquire / seq_cst load of tail,
     * so our reads of those bytes happen before it overwrites them */
    __atomic_store_n(&r->ctl->side[OMNI_CONSUMER].pos, end, __ATOMIC_SEQ_CST);
    wake_peer(r);
    return OMNI_OK;
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
    if (r->peer_pidfd >= 0) close(r->peer_pidfd);
    free(r->ext);
    if (keep_mapping)
        omni_seg_close_keep_mapping(&r->seg);
    else
        omni_seg_close(&r->seg);
    free(r);
}
