/* Named shared-memory segments, mode 0600, with a table of user pids so that the last user to
 * close unlinks the name, and a closing survivor of a crash (or the supervisor, through
 * omni_unlink_leftovers) removes what the dead left behind. */
#include "segment.h"

#include <dirent.h>
#include <limits.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "atomics.h"

static uint64_t page_size(void) { return (uint64_t)sysconf(_SC_PAGESIZE); }

static int valid_name(const char *name) {
    size_t n = strlen(name);
    if (n == 0 || n > OMNI_SEG_NAME_MAX) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.'))
            return 0;
    }
    return name[0] != '.';
}

static int take_slot(struct seg_header *h) {
    uint64_t me = omni_self_id();
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < OMNI_SEG_MAX_USERS; i++) {
            uint64_t cur = load_acquire_u64(&h->users[i]);
            /* second pass: reuse the slot of a dead user */
            if ((cur == 0 || (pass == 1 && omni_id_dead(cur))) && cas_u64(&h->users[i], cur, me))
                return i;
        }
    return -1;
}

/* 1 when no live process is recorded. */
static int no_live_users(struct seg_header *h) {
    for (int i = 0; i < OMNI_SEG_MAX_USERS; i++) {
        uint64_t id = load_seq_cst_u64(&h->users[i]);
        if (id != 0 && !omni_id_dead(id)) return 0;
    }
    return 1;
}

/* The file is ours alone: a regular file of this user, no access for group or others. Another
 * user could have created the name first (/dev/shm is world-writable); such a file is refused,
 * never used. */
static int check_owner(int fd, const struct stat *st, const char *name) {
    (void)fd;
    if (!S_ISREG(st->st_mode))
        return omni_fail(OMNI_EFORMAT, "%s: not a regular file", name);
    if (st->st_uid != geteuid())
        return omni_fail(OMNI_EFORMAT, "%s: owned by uid %u, not by this user (uid %u): refused",
                         name, (unsigned)st->st_uid, (unsigned)geteuid());
    if (st->st_mode & 077)
        return omni_fail(OMNI_EFORMAT, "%s: mode %04o gives others access, expected 0600: refused",
                         name, (unsigned)(st->st_mode & 07777));
    return OMNI_OK;
}

/* Every header field against the file and the kind; fills the handle's private copies. */
static int check_header(struct omni_segment *s, const struct seg_header *h, int kind,
                        uint64_t st_size) {
    uint64_t page = page_size();
    const char *name = s->name + 1;
    uint32_t version = __atomic_load_n(&h->version, __ATOMIC_RELAXED);
    uint32_t hkind = __atomic_load_n(&h->kind, __ATOMIC_RELAXED);
    uint64_t file_size = load_relaxed_u64(&h->file_size);
    uint64_t data_offset = load_relaxed_u64(&h->data_offset);
    uint64_t mirror_len = load_relaxed_u64(&h->mirror_len);
    if (version != OMNI_SEG_VERSION || (int)hkind != kind)
        return omni_fail(OMNI_EFORMAT, "%s: segment version %u kind %u, expected version %d kind %d",
                         name, version, hkind, OMNI_SEG_VERSION, kind);
    if (file_size != st_size || data_offset != page || file_size <= data_offset ||
        file_size > OMNI_SEG_MAX_BYTES)
        return omni_fail(OMNI_EFORMAT, "%s: header says %llu bytes with data at %llu, the file "
                         "has %llu: corrupt", name, (unsigned long long)file_size,
                         (unsigned long long)data_offset, (unsigned long long)st_size);
    uint64_t data = file_size - data_offset;
    int ring_ok = mirror_len == data && data >= page && (data & (data - 1)) == 0;
    if (kind == OMNI_SEG_KIND_RING ? !ring_ok : mirror_len != 0)
        return omni_fail(OMNI_EFORMAT, "%s: mirror of %llu bytes over a data area of %llu: corrupt",
                         name, (unsigned long long)mirror_len, (unsigned long long)data);
    s->file_size = file_size;
    s->data_offset = data_offset;
    s->mirror_len = mirror_len;
    return OMNI_OK;
}

/* Maps the file, and for rings its data area a second time right after it, so that a record
 * that wraps is still one contiguous range of addresses. */
static int map_file(struct omni_segment *s, int fd, uint64_t file_size, uint64_t mirror_len) {
    uint64_t total = file_size + mirror_len;
    uint8_t *base = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) return omni_fail_errno("mmap reserve", s->name + 1);
    if (mmap(base, file_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED ||
        (mirror_len && mmap(base + file_size, mirror_len, PROT_READ | PROT_WRITE,
                            MAP_SHARED | MAP_FIXED, fd, (off_t)(file_size - mirror_len)) == MAP_FAILED)) {
        int rc = omni_fail_errno("mmap", s->name + 1);
        munmap(base, total);
        return rc;
    }
    s->base = base;
    s->map_len = total;
    s->hdr = (struct seg_header *)base;
    return OMNI_OK;
}

static int create(struct omni_segment *s, int kind, uint64_t data_size, uint64_t mirror_len) {
    uint64_t page = page_size();
    int fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return omni_fail_errno("shm_open create", s->name + 1);
    uint64_t file_size = page + data_size;
    int rc = OMNI_OK;
    if (ftruncate(fd, (off_t)file_size) != 0) rc = omni_fail_errno("ftruncate", s->name + 1);
    if (rc == OMNI_OK) rc = map_file(s, fd, file_size, mirror_len);
    close(fd);
    if (rc != OMNI_OK) {
        shm_unlink(s->name);
        return rc;
    }
    struct seg_header *h = s->hdr;
    h->users[0] = omni_self_id();
    s->slot = 0;
    s->file_size = file_size;
    s->data_offset = page;
    s->mirror_len = mirror_len;
    h->version = OMNI_SEG_VERSION;
    h->kind = (uint32_t)kind;
    h->file_size = file_size;
    h->data_offset = page;
    h->mirror_len = mirror_len;
    /* pairs with the acquire load of magic in attach(): everything above is visible there */
    store_release_u64(&h->magic, OMNI_SEG_MAGIC);
    return OMNI_OK;
}

static int attach(struct omni_segment *s, int kind) {
    const char *name = s->name + 1;
    int fd = shm_open(s->name, O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) return omni_fail_errno("shm_open attach", name);
    omni_test_hook("attach");
    uint64_t page = page_size();
    struct stat st;
    int64_t deadline = omni_now_ns() + 2000000000LL;
    struct seg_header *h = MAP_FAILED;
    int rc = OMNI_OK;
    /* the creator may still be between shm_open and publishing magic: wait a little */
    for (;;) {
        if (fstat(fd, &st) != 0) {
            rc = omni_fail_errno("fstat", name);
            break;
        }
        if ((rc = check_owner(fd, &st, name)) != OMNI_OK) break;
        if ((uint64_t)st.st_size >= page) {
            if (h == MAP_FAILED) h = mmap(NULL, page, PROT_READ, MAP_SHARED, fd, 0);
            if (h == MAP_FAILED) {
                rc = omni_fail_errno("mmap", name);
                break;
            }
            if (load_acquire_u64(&h->magic) == OMNI_SEG_MAGIC) break;
        }
        if (omni_now_ns() > deadline) {
            rc = omni_fail(OMNI_EFORMAT, "%s: not an omni_transport segment", name);
            break;
        }
        usleep(1000);
    }
    if (rc == OMNI_OK) rc = check_header(s, h, kind, (uint64_t)st.st_size);
    if (h != MAP_FAILED) munmap(h, page);
    if (rc == OMNI_OK) rc = map_file(s, fd, s->file_size, s->mirror_len);
    if (rc != OMNI_OK) {
        close(fd);
        return rc;
    }
    s->slot = take_slot(s->hdr);
    if (s->slot < 0) {
        close(fd);
        munmap(s->base, s->map_len);
        s->base = NULL;
        return omni_fail(OMNI_EROLE, "%s: more than %d processes have it open", name,
                         OMNI_SEG_MAX_USERS);
    }
    /* The last user may have closed (and unlinked the name) between our shm_open and our
     * taking a slot: then we hold a file that nobody else will ever find. Now that we are in
     * the table no closer unlinks it, so one look at the name settles it. */
    struct stat now;
    int fd2 = shm_open(s->name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0);
    int same = fd2 >= 0 && fstat(fd2, &now) == 0 && now.st_ino == st.st_ino &&
               now.st_dev == st.st_dev;
    if (fd2 >= 0) close(fd2);
    close(fd);
    if (!same) {
        /* leave without unlinking: the name, if it exists, is someone else's file now */
        cas_u64(&s->hdr->users[s->slot], omni_self_id(), 0);
        munmap(s->base, s->map_len);
        s->base = NULL;
        return omni_fail(OMNI_ECLOSED, "%s: its last user closed it while we attached", name);
    }
    return OMNI_OK;
}

int omni_seg_open(struct omni_segment *s, const char *name, int create_it, int kind,
                  uint64_t data_size, uint64_t mirror_len) {
    memset(s, 0, sizeof *s);
    if (!valid_name(name))
        return omni_fail(OMNI_EINVAL,
                         "segment name '%s': use 1-%d characters of [A-Za-z0-9._-], not "
                         "starting with '.'",
                         name, OMNI_SEG_NAME_MAX);
    s->name[0] = '/';
    strcpy(s->name + 1, name);
    return create_it ? create(s, kind, data_size, mirror_len) : attach(s, kind);
}

static void leave(struct omni_segment *s);

void omni_seg_close(struct omni_segment *s) {
    if (!s->base) return;
    leave(s);
    munmap(s->base, s->map_len);
    s->base = NULL;
}

void omni_seg_close_keep_mapping(struct omni_segment *s) {
    if (!s->base) return;
    leave(s);
    s->base = NULL;
}

static void leave(struct omni_segment *s) {
    struct seg_header *h = s->hdr;
    uint64_t me = omni_self_id();
    /* Leave first, then look: of two users closing at once, at least the second to look sees
     * no one (the CAS and the fence order our leaving before our loads of the other slots).
     * Both may unlink: the second gets ENOENT, which is fine. */
    cas_u64(&h->users[s->slot], me, 0);
    fence_seq_cst();
    if (no_live_users(h)) shm_unlink(s->name);
}

/* ---- the public plain-segment API ---- */

int omni_segment_create(const char *name, uint64_t size, omni_segment **out) {
    struct omni_segment *s = calloc(1, sizeof *s);
    if (!s) return omni_fail(OMNI_ESYS, "out of memory");
    uint64_t page = page_size();
    int rc = omni_seg_open(s, name, 1, OMNI_SEG_KIND_PLAIN, (size + page - 1) / page * page, 0);
    if (rc != OMNI_OK) {
        free(s);
        return rc;
    }
    *out = s;
    return OMNI_OK;
}

int omni_segment_attach(const char *name, omni_segment **out) {
    struct omni_segment *s = calloc(1, sizeof *s);
    if (!s) return omni_fail(OMNI_ESYS, "out of memory");
    int rc = omni_seg_open(s, name, 0, OMNI_SEG_KIND_PLAIN, 0, 0);
    if (rc != OMNI_OK) {
        free(s);
        return rc;
    }
    *out = s;
    return OMNI_OK;
}

uint8_t *omni_segment_data(omni_segment *s) { return s->base + s->data_offset; }
uint64_t omni_segment_size(const omni_segment *s) { return s->file_size - s->data_offset; }
void omni_segment_users(const omni_segment *s, int *alive, int *dead) {
    *alive = *dead = 0;
    for (int i = 0; i < OMNI_SEG_MAX_USERS; i++) {
        if (i == s->slot) continue;
        uint64_t id = load_seq_cst_u64(&s->hdr->users[i]);
        if (id == 0) continue;
        if (omni_id_dead(id))
            ++*dead;
        else
            ++*alive;
    }
}

void omni_segment_close(omni_segment *s) {
    omni_seg_close(s);
    free(s);
}

uint32_t omni_load_acquire_u32(const uint32_t *p) { return load_acquire_u32(p); }
void omni_store_release_u32(uint32_t *p, uint32_t v) { store_release_u32(p, v); }

/* A leftover: a segment of ours whose recorded users are all dead, or a file that never got
 * its magic (its creator died between shm_open and initialisation) and is older than 10 s. */
static int is_leftover(const char *name) {
    char path[NAME_MAX + 2];
    snprintf(path, sizeof path, "/%s", name);
    int fd = shm_open(path, O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0) return 0;
    struct stat st;
    int leftover = 0;
    /* another user's file under our prefix is not ours to judge (nor to unlink) */
    if (fstat(fd, &st) == 0 && st.st_uid == geteuid()) {
        uint64_t page = page_size();
        struct seg_header *h = MAP_FAILED;
        if ((uint64_t)st.st_size >= page) h = mmap(NULL, page, PROT_READ, MAP_SHARED, fd, 0);
        if (h != MAP_FAILED && load_acquire_u64(&h->magic) == OMNI_SEG_MAGIC)
            leftover = no_live_users(h);
        else
            leftover = time(NULL) - st.st_mtime > 10;
        if (h != MAP_FAILED) munmap(h, page);
    }
    close(fd);
    return leftover;
}

int omni_unlink_leftovers(const char *prefix, char *out, uint64_t out_len, int *removed_out) {
    if (!prefix || !*prefix || strchr(prefix, '/'))
        return omni_fail(OMNI_EINVAL, "prefix '%s': give a non-empty name prefix without '/'",
                         prefix ? prefix : "");
    DIR *d = opendir("/dev/shm");
    if (!d) return omni_fail_errno("opendir", "/dev/shm");
    int removed = 0;
    uint64_t used = 0;
    if (out_len) out[0] = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, prefix, strlen(prefix)) != 0 || !valid_name(e->d_name)) continue;
        if (!is_leftover(e->d_name)) continue;
        char path[NAME_MAX + 2];
        snprintf(path, sizeof path, "/%s", e->d_name);
        if (shm_unlink(path) != 0) continue;
        removed++;
        size_t n = strlen(e->d_name) + 1;
        if (used + n < out_len) {
            memcpy(out + used, e->d_name, n);
            used += n;
            out[used] = 0;
        }
    }
    closedir(d);
    *removed_out = removed;
    return OMNI_OK;
}
