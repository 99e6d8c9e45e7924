/* What the module (batchread.c) and the row reader (rows.inc, compiled once per
 * instruction set) share: a batch to read, and the statuses of its rows. */
#ifndef DECODEFS_ROWS_H
#define DECODEFS_ROWS_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* preadv2, RWF_NOWAIT; first, before any system header */
#endif

#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* rows_avx2.c and rows_avx512.c hold builds of rows.inc for AVX2 and AVX-512F (GCC's target
 * pragma and __builtin_cpu_supports pick and compile them) */
#define DECODEFS_X86_BUILDS 1
#endif

enum { NOWAIT_TRUSTED = 2 };
enum { ROW_OK = 0, ROW_MISSING = 1, ROW_NOT_CACHED = 2, ROW_BAD = 3, ROW_GONE = 4, ROW_UNREAD = 5 };

#define TRAILER_SIZE 40 /* protocol.TRAILER ("<4sI16sQQ").size */
#define EXPECT_SIZE 32  /* the trailer but its checksum: magic, format, fingerprint, length */
#define HEADER_MAX 4096 /* npy.HEADER_BOUND */

struct batch {
    int dirfd;              /* the store directory */
    unsigned char *rows;    /* row p at rows + p * row_bytes */
    size_t row_bytes;
    ssize_t n;              /* items */
    const int32_t *positions; /* item i's row (NULL: row i) */
    /* Kept files alone (read_kept), or NULL: item i is key index[i], and fds, maps, seeds,
     * checked and ctimes hold every key's (a reader's own arrays, which other threads
     * change under its lock: read here atomically). An item whose key has no kept file,
     * or was not looked up on this mount (verified[key] != generation), is ROW_UNREAD;
     * nothing is opened, and used[i] is the kept descriptor read (-1: none). */
    const int64_t *index;
    const uint32_t *verified;
    uint32_t generation;
    int32_t *used;
    int32_t *fds;           /* item i's kept descriptor, or -1: open names[i] */
    uint64_t *maps;         /* item i's kept descriptor's mapping (its address), or 0 */
    int map;                /* map the descriptors kept here */
    const char **names;     /* item i's entry path below dirfd, or NULL */
    const uint64_t *seeds;  /* item i's checksum seed */
    const unsigned char *header;
    size_t head_len;
    const unsigned char *expect; /* EXPECT_SIZE bytes */
    uid_t owner;
    ssize_t keep;           /* how many descriptors opened here may stay open in fds */
    int nowait;             /* a row not in the page cache: start reading it ahead, ROW_NOT_CACHED;
                             * NOWAIT_TRUSTED: a mapped row is copied without asking (mincore) */
    uint64_t token;         /* the store's change token now (0: none) */
    uint64_t *checked;      /* item i's kept descriptor was looked at when the token was this */
    int64_t *ctimes;        /* item i's kept descriptor's file's ctime (ns) when opened */
    int32_t *status;        /* item i's ROW_ status */
};

/* A file's inode change time in ns: chmod, chown, an ACL, a link or unlink change it. */
static inline int64_t ctime_ns(const struct stat *st) {
    return (int64_t)st->st_ctim.tv_sec * 1000000000 + st->st_ctim.tv_nsec;
}

extern int decodefs_nowait_works; /* until a file system says EOPNOTSUPP */

/* Where a SIGBUS in this thread's copy out of a mapping jumps (a file truncated in place
 * under the copy), or NULL: batchread.c's handler (guard.c) */
extern __thread sigjmp_buf *decodefs_guard;

/* A key's slot in a kept-files batch's arrays (read by other threads' calls meanwhile). */
#define LOAD(slot) __atomic_load_n(&(slot), __ATOMIC_RELAXED)
#define STORE(slot, value) __atomic_store_n(&(slot), (value), __ATOMIC_RELAXED)

ssize_t read_rows_base(struct batch *b);
uint64_t checksum_base(const void *data, size_t len, uint64_t seed);
uint64_t copy_checksum_base(void *dst, const void *src, size_t len, size_t skip, uint64_t seed);
#ifdef DECODEFS_X86_BUILDS
ssize_t read_rows_avx2(struct batch *b);
uint64_t checksum_avx2(const void *data, size_t len, uint64_t seed);
uint64_t copy_checksum_avx2(void *dst, const void *src, size_t len, size_t skip, uint64_t seed);
ssize_t read_rows_avx512(struct batch *b);
uint64_t checksum_avx512(const void *data, size_t len, uint64_t seed);
uint64_t copy_checksum_avx512(void *dst, const void *src, size_t len, size_t skip, uint64_t seed);
#endif

#endif
