/* Internal helpers shared by the C sources: thread-local error text, clocks, liveness. */
#ifndef OMNI_COMMON_H
#define OMNI_COMMON_H

#include <stdint.h>
#include <sys/types.h>

#include "omni_transport.h"

#define OMNI_HIDDEN __attribute__((visibility("hidden")))

/* Records the error text and returns code. */
OMNI_HIDDEN int omni_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
OMNI_HIDDEN int omni_fail_errno(const char *what, const char *name);
OMNI_HIDDEN int64_t omni_now_ns(void);
/* now + timeout_ns without overflow (INT64_MAX: never). timeout_ns < 0: never. */
OMNI_HIDDEN int64_t omni_deadline(int64_t timeout_ns);

/* A process identity that is never reused: (start time in clock ticks since boot << 22) | pid.
 * pid_max is at most 2^22, so the pid fits; the start time tells a reused pid from the process
 * that held it before. 0 is "nobody". */
#define OMNI_ID_PID_BITS 22
OMNI_HIDDEN uint64_t omni_self_id(void);
static inline int32_t omni_id_pid(uint64_t id) {
    return (int32_t)(id & ((1u << OMNI_ID_PID_BITS) - 1));
}
/* 1 when the process of id no longer runs: gone, a zombie waiting to be reaped, or its pid now
 * belongs to another process (start time differs). */
OMNI_HIDDEN int omni_id_dead(uint64_t id);
OMNI_HIDDEN int omni_pidfd_open(pid_t pid);

/* Test hooks: when the environment variable OMNI_TRANSPORT_TEST_HOOK is "<point>:kill" or
 * "<point>:stop", the process SIGKILLs or SIGSTOPs itself at that point (tests use it to hit
 * the windows between two steps of a protocol). Points: "claim" (after the side's owner CAS,
 * before ATTACHED), "attach" (after shm_open, before taking a user slot). */
OMNI_HIDDEN void omni_test_hook(const char *point);

#endif
