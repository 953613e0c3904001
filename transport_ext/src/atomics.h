/* Every atomic operation of the transport, in one place. Each shared word has exactly one
 * writer side (documented at its field in ring.c and in docs/transport.md); the pairing of each
 * release with its acquire is written at the call site. */
#ifndef OMNI_ATOMICS_H
#define OMNI_ATOMICS_H

#include <stdint.h>

#define OMNI_CACHELINE 64

static inline uint64_t load_acquire_u64(const uint64_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline uint64_t load_relaxed_u64(const uint64_t *p) {
    return __atomic_load_n(p, __ATOMIC_RELAXED);
}
static inline void store_release_u64(uint64_t *p, uint64_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
static inline uint32_t load_acquire_u32(const uint32_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline void store_release_u32(uint32_t *p, uint32_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
static inline int cas_u64(uint64_t *p, uint64_t expected, uint64_t desired) {
    return __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST,
                                       __ATOMIC_SEQ_CST);
}
/* The sleep / wake handshake (Dekker): the sleeper stores its flag then loads the counter; the
 * waker stores the counter then loads the flag. Both sides use sequentially consistent
 * operations so at least one of them sees the other's store: no lost wake-up. */
static inline void store_seq_cst_u32(uint32_t *p, uint32_t v) {
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
}
static inline uint32_t exchange_seq_cst_u32(uint32_t *p, uint32_t v) {
    return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
static inline uint64_t load_seq_cst_u64(const uint64_t *p) {
    return __atomic_load_n(p, __ATOMIC_SEQ_CST);
}
static inline uint32_t load_seq_cst_u32(const uint32_t *p) {
    return __atomic_load_n(p, __ATOMIC_SEQ_CST);
}
static inline void fence_seq_cst(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

#endif
