#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static __thread char last_error[512];

const char *omni_last_error(void) { return last_error; }

int omni_fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return code;
}

int omni_fail_errno(const char *what, const char *name) {
    int e = errno;
    return omni_fail(OMNI_ESYS, "%s(%s): %s (errno %d)", what, name ? name : "", strerror(e), e);
}

int64_t omni_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int omni_pid_dead(pid_t pid) {
    if (pid <= 0) return 0;
    if (kill(pid, 0) == -1 && errno == ESRCH) return 1;
    /* kill() succeeds on a zombie: a crashed peer whose parent has not reaped it yet is dead
     * for us. The state is the field after the parenthesised command name. */
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *paren = strrchr(buf, ')');
    return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

int omni_pidfd_open(pid_t pid) {
#ifdef SYS_pidfd_open
    return (int)syscall(SYS_pidfd_open, pid, 0);
#else
    (void)pid;
    errno = ENOSYS;
    return -1;
#endif
}
