#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
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

int64_t omni_deadline(int64_t timeout_ns) {
    int64_t now = omni_now_ns();
    if (timeout_ns < 0 || timeout_ns > INT64_MAX - now) return INT64_MAX;
    return now + timeout_ns;
}

/* Reads /proc/<pid>/stat: state letter and start time (field 22). Returns 0 when the process
 * does not exist, 1 when read, -1 when it could not be read for another reason. */
static int proc_stat(pid_t pid, char *state, uint64_t *start) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT || errno == ESRCH ? 0 : -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return n == 0 || errno == ESRCH ? 0 : -1;
    buf[n] = 0;
    /* the command name is parenthesised and may hold spaces or ')': the fields start after the
     * last ')'. Field 3 is the state, field 22 the start time. */
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ') return -1;
    p += 2;
    *state = *p;
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (!p) return -1;
        p++;
    }
    char *end;
    errno = 0;
    unsigned long long v = strtoull(p, &end, 10);
    if (end == p || errno) return -1;
    *start = (uint64_t)v;
    return 1;
}

static uint64_t make_id(pid_t pid, uint64_t start) {
    return (start << OMNI_ID_PID_BITS) | ((uint64_t)pid & ((1u << OMNI_ID_PID_BITS) - 1));
}

uint64_t omni_self_id(void) {
    /* cached per process (a forked child computes its own) */
    static pid_t cached_pid;
    static uint64_t cached_id;
    pid_t pid = getpid();
    if (__atomic_load_n(&cached_pid, __ATOMIC_ACQUIRE) != pid) {
        char state;
        uint64_t start = 0;
        if (proc_stat(pid, &state, &start) != 1) start = 0; /* no /proc: pid only */
        __atomic_store_n(&cached_id, make_id(pid, start), __ATOMIC_RELAXED);
        __atomic_store_n(&cached_pid, pid, __ATOMIC_RELEASE);
    }
    return __atomic_load_n(&cached_id, __ATOMIC_RELAXED);
}

int omni_id_dead(uint64_t id) {
    pid_t pid = omni_id_pid(id);
    if (pid <= 0) return 0;
    char state;
    uint64_t start;
    int rc = proc_stat(pid, &state, &start);
    if (rc == 0) return 1;
    if (rc < 0) return kill(pid, 0) == -1 && errno == ESRCH;
    /* a killed process not yet reaped by its parent is dead for us */
    if (state == 'Z' || state == 'X') return 1;
    return make_id(pid, start) != id;
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

void omni_test_hook(const char *point) {
    const char *hook = getenv("OMNI_TRANSPORT_TEST_HOOK");
    if (!hook) return;
    size_t n = strlen(point);
    if (strncmp(hook, point, n) != 0 || hook[n] != ':') return;
    if (strcmp(hook + n + 1, "kill") == 0) raise(SIGKILL);
    if (strcmp(hook + n + 1, "stop") == 0) raise(SIGSTOP);
}
