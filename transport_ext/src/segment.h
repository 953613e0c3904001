/* Named shared-memory segments: layout of the first page and the process-local handle. */
#ifndef OMNI_SEGMENT_H
#define OMNI_SEGMENT_H

#include <stdint.h>

#include "common.h"

#define OMNI_SEG_MAGIC 0x31474553494d4f4fULL /* "OOMISEG1" little endian */
#define OMNI_SEG_VERSION 2
#define OMNI_SEG_MAX_USERS 16
#define OMNI_SEG_KIND_PLAIN 1
#define OMNI_SEG_KIND_RING 2
#define OMNI_SEG_NAME_MAX 200
#define OMNI_SEG_MAX_BYTES (1ULL << 41) /* one page + a ring of 1 TiB, with room */

/* Offset 0 of every segment. Written once by the creator before `magic` is published with a
 * release store (attachers load it with acquire); afterwards only `users` changes (CAS).
 * Another process of the same user could still scribble on it: an attacher validates every
 * field against the file once and keeps its own copy (struct omni_segment). */
struct seg_header {
    uint64_t magic;
    uint32_t version;
    uint32_t kind;
    uint64_t file_size;    /* bytes of the file */
    uint64_t data_offset;  /* start of the user area (one page) */
    uint64_t mirror_len;   /* ring kind: the data area (the last mirror_len bytes), mapped twice */
    uint64_t reserved;
    uint64_t users[OMNI_SEG_MAX_USERS]; /* process ids (omni_self_id) of its users, 0: free */
};

struct omni_segment {
    char name[OMNI_SEG_NAME_MAX + 2]; /* "/" + name */
    uint8_t *base;                    /* mapping of the file, then the mirror when any */
    uint64_t map_len;
    int slot;                         /* our index in users[] */
    struct seg_header *hdr;
    /* validated copies of the header fields: never read back from shared memory */
    uint64_t file_size, data_offset, mirror_len;
};

OMNI_HIDDEN int omni_seg_open(struct omni_segment *s, const char *name, int create, int kind,
                              uint64_t data_size, uint64_t mirror_len);
OMNI_HIDDEN void omni_seg_close(struct omni_segment *s);
/* Leaves the user table (and unlinks when last) but keeps the mapping: views into it that the
 * caller could not take back stay readable until the process exits. */
OMNI_HIDDEN void omni_seg_close_keep_mapping(struct omni_segment *s);

#endif
