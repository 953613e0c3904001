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
/* 1 when pid no longer runs (gone, or a zombie waiting to be reaped). */
OMNI_HIDDEN int omni_pid_dead(pid_t pid);
OMNI_HIDDEN int omni_pidfd_open(pid_t pid);

#endif
