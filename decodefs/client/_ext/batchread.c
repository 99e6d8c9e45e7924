/* decodefs.client._batchread: a batch of store entries read into the rows of one array,
 * each checked as it is copied; the compiled twin of rows.py's read_entries_py and
 * read_kept_py (the same rows, the same statuses), used where it builds.
 *
 * One call reads every item of a batch with the GIL released. An item's entry file is a
 * descriptor the caller keeps open, or a path below the store's directory descriptor,
 * opened here (and left open, and mapped, for the caller while it allows). A kept
 * entry in the page cache is copied out of its mapping, else the bytes are read by
 * preadv2; either way in pieces straight into the item's row, each piece fed to the
 * entry's xxh3-64 while it is still in the CPU's cache: the check rides on the copy.
 * A copy out of a file truncated in place meanwhile (SIGBUS) fails its row. An item is
 * OK only if its file is a regular file of the daemon's alone (checked when opened) of
 * the expected length, still linked, with the expected .npy header and trailer (magic,
 * store format, decoder fingerprint, length) and the checksum of the bytes read. Any
 * other status sends the item back to the caller, which finds out why (the Python
 * check) and reads it through the mount. This file knows the trailer's layout, nothing
 * of keys, mounts or torch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "rows.h"

int decodefs_nowait_works = 1;
__thread sigjmp_buf *decodefs_guard;

/* SIGBUS: a copy out of a mapping whose file was truncated in place (the daemon never
 * does that; a person or a test may). In a guarded copy of this thread, it jumps back
 * (the row fails its check); anywhere else it is none of ours: the handler that was
 * there before is put back and sees the signal as if this one had never been. */
static struct sigaction previous_sigbus;
static int guarding; /* ours was installed (and may have been replaced since) */

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    (void)context;
    sigjmp_buf *jump = decodefs_guard;
    if (jump != NULL) { /* this thread is in a guarded copy: its fault (or the same fault
                         * raised again by a handler that ran first, as faulthandler does) */
        decodefs_guard = NULL;
        siglongjmp(*jump, 1);
    }
    static volatile sig_atomic_t passed_on;
    if (passed_on) { /* back here from the handler passed to: end as a SIGBUS ends */
        signal(SIGBUS, SIG_DFL);
        raise(sig);
        return;
    }
    passed_on = 1;
    sigaction(SIGBUS, &previous_sigbus, NULL);
    guarding = 0;
    if (info->si_code <= 0)
        raise(sig); /* sent, not a fault: it does not come again by itself */
}

/* Ours is the SIGBUS handler now, installed again if someone replaced it since (pytest
 * and faulthandler.disable() put back what they found first, for one). Once per call. */
static int guard_sigbus(void) {
    struct sigaction current;
    if (guarding && sigaction(SIGBUS, NULL, &current) == 0 &&
        (current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus)
        return 1;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &previous_sigbus) != 0)
        return 0;
    guarding = 1;
    return 1;
}

/* The builds of rows.inc, each for an instruction set; the widest this CPU runs is used. */
struct build {
    const char *name;
    ssize_t (*read_rows)(struct batch *);
    uint64_t (*checksum)(const void *, size_t, uint64_t);
    uint64_t (*copy_checksum)(void *, const void *, size_t, size_t, uint64_t);
};
static const struct build builds[] = { /* each one's instructions a superset of the last's */
    {"base", read_rows_base, checksum_base, copy_checksum_base},
#ifdef DECODEFS_X86_BUILDS
    {"avx2", read_rows_avx2, checksum_avx2, copy_checksum_avx2},
    {"avx512", read_rows_avx512, checksum_avx512, copy_checksum_avx512},
#endif
};
#define COMPILED (sizeof builds / sizeof *builds)
static size_t runnable = 1; /* builds[0, runnable) run on this CPU (found at import) */
#define CHOSEN (&builds[runnable - 1])

/* The build named `name` (NULL: the one chosen), or NULL with ValueError set if this CPU
 * does not run it. */
static const struct build *build_named(const char *name) {
    if (name == NULL)
        return CHOSEN;
    for (size_t k = 0; k < runnable; k++)
        if (strcmp(builds[k].name, name) == 0)
            return &builds[k];
    PyErr_Format(PyExc_ValueError, "no build %s runs on this CPU (see BUILDS)", name);
    return NULL;
}

static int get(PyObject *obj, Py_buffer *view, int flags, Py_ssize_t want, const char *what) {
    if (PyObject_GetBuffer(obj, view, flags | PyBUF_C_CONTIGUOUS) != 0)
        return 0;
    if (want >= 0 && view->len != want) {
        PyErr_Format(PyExc_ValueError, "read_rows: %s holds %zd bytes, not %zd", what, view->len,
                     want);
        return 0;
    }
    return 1;
}

/* Release the buffer views a call got (a view it never got is empty). */
static void release(Py_buffer *const *views, size_t count) {
    for (size_t k = 0; k < count; k++)
        if (views[k]->obj)
            PyBuffer_Release(views[k]);
}
#define RELEASE(...)                                                                      \
    do {                                                                                  \
        Py_buffer *const views_[] = {__VA_ARGS__};                                        \
        release(views_, sizeof views_ / sizeof *views_);                                  \
    } while (0)

/* The chosen build's read_rows(b) with the GIL released; -1 with MemoryError set if it had
 * no memory. */
static ssize_t read_released(struct batch *b) {
    ssize_t got;
    Py_BEGIN_ALLOW_THREADS
    got = CHOSEN->read_rows(b);
    Py_END_ALLOW_THREADS
    if (got < 0)
        PyErr_NoMemory();
    return got;
}

PyDoc_STRVAR(read_rows_doc,
"read_rows(dirfd, rows, row_bytes, positions, fds, maps, names, seeds, header, expect,\n"
"          owner, keep, map, nowait, token, checked, ctimes, status)\n"
"    -> how many descriptors it opened and left in fds\n\n"
"Item i (of len(positions), int32) is read into row positions[i] of rows (row_bytes\n"
"each): the entry open at fds[i] (int32), or where fds[i] is -1 the entry at names[i]\n"
"(bytes, below dirfd; None: not stored), checked against header (the .npy header),\n"
"copied out of the mapping maps[i] (uint64, 0: none) with nowait if it is in the page\n"
"cache (nowait 2: without asking the kernel whether it is); with map, the descriptors\n"
"left open are mapped too (their maps[i] set).\n"
"expect (the trailer but its checksum) and seeds[i] (uint64). status[i] (int32) says how\n"
"it went: OK, MISSING, NOT_CACHED (not in the page cache; with nowait, its reading ahead\n"
"started), BAD (failed a check), GONE (a kept descriptor's file was unlinked since;\n"
"left open: the caller closes it). Up to keep descriptors opened here are left open in fds.\n"
"A kept descriptor is looked at (fstat) unless checked[i] (uint64) is token, the store's\n"
"change token now (0: none): if its file is unlinked or its inode changed since ctimes[i]\n"
"(int64, ns) it is GONE, else checked[i] becomes token. A descriptor opened here has\n"
"its ctime in ctimes[i] and token in checked[i].");

static PyObject *read_rows(PyObject *self, PyObject *args) {
    int dirfd, map, nowait;
    Py_ssize_t row_bytes, keep;
    unsigned long owner;
    unsigned long long token;
    PyObject *rows_obj, *positions_obj, *fds_obj, *maps_obj, *names_obj, *seeds_obj, *status_obj;
    PyObject *checked_obj, *ctimes_obj;
    Py_buffer header, expect;
    (void)self;
    if (!PyArg_ParseTuple(args, "iOnOOOOOy*y*knpiKOOO", &dirfd, &rows_obj, &row_bytes,
                          &positions_obj, &fds_obj, &maps_obj, &names_obj, &seeds_obj, &header,
                          &expect, &owner, &keep, &map, &nowait, &token, &checked_obj,
                          &ctimes_obj, &status_obj))
        return NULL;
    Py_buffer rows = {0}, positions = {0}, fds = {0}, maps = {0}, seeds = {0}, status = {0};
    Py_buffer checked = {0}, ctimes = {0};
    PyObject *names = NULL, *result = NULL;
    const char **name_of = NULL;
    Py_ssize_t n = 0;
    if (!get(positions_obj, &positions, PyBUF_SIMPLE, -1, "positions"))
        goto done;
    n = positions.len / (Py_ssize_t)sizeof(int32_t);
    if (!get(rows_obj, &rows, PyBUF_WRITABLE, -1, "rows") ||
        !get(fds_obj, &fds, PyBUF_WRITABLE, n * (Py_ssize_t)sizeof(int32_t), "fds") ||
        !get(maps_obj, &maps, PyBUF_WRITABLE, n * (Py_ssize_t)sizeof(uint64_t), "maps") ||
        !get(seeds_obj, &seeds, PyBUF_SIMPLE, n * (Py_ssize_t)sizeof(uint64_t), "seeds") ||
        !get(checked_obj, &checked, PyBUF_WRITABLE, n * (Py_ssize_t)sizeof(uint64_t), "checked") ||
        !get(ctimes_obj, &ctimes, PyBUF_WRITABLE, n * (Py_ssize_t)sizeof(int64_t), "ctimes") ||
        !get(status_obj, &status, PyBUF_WRITABLE, n * (Py_ssize_t)sizeof(int32_t), "status"))
        goto done;
    if (map && !guard_sigbus()) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if (row_bytes <= 0 || header.len > HEADER_MAX || expect.len != EXPECT_SIZE || keep < 0) {
        PyErr_SetString(PyExc_ValueError, "read_rows: a bad row size, header or trailer");
        goto done;
    }
    const int32_t *position_of = positions.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (position_of[i] < 0 || (position_of[i] + 1) * row_bytes > rows.len) {
            PyErr_SetString(PyExc_IndexError, "read_rows: a position outside rows");
            goto done;
        }
    }
    names = PySequence_Tuple(names_obj); /* ours: its items live while the GIL is released */
    if (names == NULL)
        goto done;
    if (PyTuple_GET_SIZE(names) != n) {
        PyErr_SetString(PyExc_ValueError, "read_rows: one name (or None) per item");
        goto done;
    }
    name_of = PyMem_Calloc((size_t)n + 1, sizeof *name_of);
    if (name_of == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        if (name == Py_None)
            continue;
        if (!PyBytes_Check(name)) {
            PyErr_SetString(PyExc_TypeError, "read_rows: a name is bytes or None");
            goto done;
        }
        name_of[i] = PyBytes_AS_STRING(name);
    }
    struct batch b = {
        .dirfd = dirfd,
        .rows = rows.buf,
        .row_bytes = (size_t)row_bytes,
        .n = n,
        .positions = position_of,
        .fds = fds.buf,
        .maps = maps.buf,
        .map = map,
        .names = name_of,
        .seeds = seeds.buf,
        .header = header.buf,
        .head_len = (size_t)header.len,
        .expect = expect.buf,
        .owner = (uid_t)owner,
        .keep = keep,
        .nowait = nowait,
        .token = token,
        .checked = checked.buf,
        .ctimes = ctimes.buf,
        .status = status.buf,
    };
    ssize_t kept = read_released(&b);
    if (kept >= 0)
        result = PyLong_FromSsize_t(kept);
done:
    PyMem_Free(name_of);
    Py_XDECREF(names);
    RELEASE(&rows, &positions, &fds, &maps, &seeds, &checked, &ctimes, &status, &header, &expect);
    return result;
}

PyDoc_STRVAR(read_kept_doc,
"read_kept(rows, row_bytes, index, verified, generation, fds, maps, seeds, header, expect,\n"
"          nowait, checked, ctimes, status, used, directory, root, changes)\n\n"
"read_rows for the items whose key has a kept file, without opening any: item i (of\n"
"len(index), int64) is key index[i], read into row i of rows. verified (uint32), fds,\n"
"maps, seeds, checked and ctimes are per key (a reader's own arrays, of one length),\n"
"read as read_rows reads its per-item ones. A key with no kept descriptor (fds -1),\n"
"or not looked up on this mount (verified[key] != generation), is UNREAD; used[i]\n"
"(int32) is the descriptor item i read (-1: none), for the caller to let go of one\n"
"found GONE.\n"
"First, in the same release of the GIL, it looks at what tells whether these are\n"
"still the mount's, the stats of directory and root (bytes paths), and reads the\n"
"store's change token from the descriptor changes (-1: none; the token 0); the reads\n"
"go by that token. Returns (stated, st_dev, st_ino, the root's st_dev, the root's\n"
"st_mtime_ns, token, faults, failed): stated 0 (and the stats 0) if either stat\n"
"failed; faults, this thread's major page faults during the reads; failed, how many\n"
"items are not OK.");

/* What read_kept looks at before its reads: the directory's and the mount root's stat,
 * and the store's change token (8 bytes, little-endian, at the start of its file). */
struct looked {
    int stated;
    struct stat directory, root;
    uint64_t token;
};

static int stat_again(const char *path, struct stat *st) {
    int got;
    do /* as Python's os.stat: a signal does not fail it */
        got = stat(path, st);
    while (got != 0 && errno == EINTR);
    return got;
}

static void look(const char *directory, const char *root, int changes, struct looked *seen) {
    seen->stated = stat_again(directory, &seen->directory) == 0 &&
                   stat_again(root, &seen->root) == 0;
    if (!seen->stated) {
        memset(&seen->directory, 0, sizeof seen->directory);
        memset(&seen->root, 0, sizeof seen->root);
    }
    unsigned char bytes[8];
    ssize_t got = -1;
    seen->token = 0;
    if (changes >= 0) {
        do /* as Python's os.pread */
            got = pread(changes, bytes, sizeof bytes, 0);
        while (got < 0 && errno == EINTR);
    }
    if (got == (ssize_t)sizeof bytes)
        for (int k = 7; k >= 0; k--)
            seen->token = seen->token << 8 | bytes[k];
}

static long major_faults(void) {
    struct rusage usage;
    return getrusage(RUSAGE_THREAD, &usage) == 0 ? usage.ru_majflt : 0;
}

static PyObject *read_kept(PyObject *self, PyObject *args) {
    int nowait, changes;
    Py_ssize_t row_bytes;
    unsigned long generation;
    const char *directory, *root;
    PyObject *rows_obj, *index_obj, *verified_obj, *fds_obj, *maps_obj, *seeds_obj;
    PyObject *checked_obj, *ctimes_obj, *status_obj, *used_obj;
    Py_buffer header, expect;
    (void)self;
    if (!PyArg_ParseTuple(args, "OnOOkOOOy*y*iOOOOyyi", &rows_obj, &row_bytes, &index_obj,
                          &verified_obj, &generation, &fds_obj, &maps_obj, &seeds_obj, &header,
                          &expect, &nowait, &checked_obj, &ctimes_obj, &status_obj, &used_obj,
                          &directory, &root, &changes))
        return NULL;
    Py_buffer rows = {0}, index = {0}, verified = {0}, fds = {0}, maps = {0}, seeds = {0};
    Py_buffer checked = {0}, ctimes = {0}, status = {0}, used = {0};
    PyObject *result = NULL;
    Py_ssize_t n = 0, keys = 0;
    if (!get(index_obj, &index, PyBUF_SIMPLE, -1, "index") ||
        !get(fds_obj, &fds, PyBUF_WRITABLE, -1, "fds"))
        goto done;
    n = index.len / (Py_ssize_t)sizeof(int64_t);
    keys = fds.len / (Py_ssize_t)sizeof(int32_t);
    if (!get(rows_obj, &rows, PyBUF_WRITABLE, -1, "rows") ||
        !get(verified_obj, &verified, PyBUF_SIMPLE, keys * (Py_ssize_t)sizeof(uint32_t), "verified") ||
        !get(maps_obj, &maps, PyBUF_SIMPLE, keys * (Py_ssize_t)sizeof(uint64_t), "maps") ||
        !get(seeds_obj, &seeds, PyBUF_SIMPLE, keys * (Py_ssize_t)sizeof(uint64_t), "seeds") ||
        !get(checked_obj, &checked, PyBUF_WRITABLE, keys * (Py_ssize_t)sizeof(uint64_t), "checked") ||
        !get(ctimes_obj, &ctimes, PyBUF_WRITABLE, keys * (Py_ssize_t)sizeof(int64_t), "ctimes") ||
        !get(status_obj, &status, PyBUF_WRITABLE, n * (Py_ssize_t)sizeof(int32_t), "status") ||
        !get(used_obj, &used, PyBUF_WRITABLE, n * (Py_ssize_t)sizeof(int32_t), "used"))
        goto done;
    if (row_bytes <= 0 || header.len > HEADER_MAX || expect.len != EXPECT_SIZE) {
        PyErr_SetString(PyExc_ValueError, "read_kept: a bad row size, header or trailer");
        goto done;
    }
    if (n * row_bytes > rows.len) {
        PyErr_SetString(PyExc_IndexError, "read_kept: more items than rows");
        goto done;
    }
    const int64_t *key_of = index.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (key_of[i] < 0 || key_of[i] >= keys) {
            PyErr_SetString(PyExc_IndexError, "read_kept: a key outside the arrays");
            goto done;
        }
    }
    if (!guard_sigbus()) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    struct batch b = { /* no positions (row i), names, owner or room to keep: nothing opened */
        .dirfd = -1,
        .rows = rows.buf,
        .row_bytes = (size_t)row_bytes,
        .n = n,
        .index = key_of,
        .verified = verified.buf,
        .generation = (uint32_t)generation,
        .used = used.buf,
        .fds = fds.buf,
        .maps = maps.buf,
        .seeds = seeds.buf,
        .header = header.buf,
        .head_len = (size_t)header.len,
        .expect = expect.buf,
        .nowait = nowait,
        .checked = checked.buf,
        .ctimes = ctimes.buf,
        .status = status.buf,
    };
    struct looked seen;
    ssize_t got;
    long faults;
    Py_ssize_t failed = 0;
    Py_BEGIN_ALLOW_THREADS
    look(directory, root, changes, &seen);
    b.token = seen.token;
    faults = major_faults();
    got = CHOSEN->read_rows(&b);
    faults = major_faults() - faults;
    for (Py_ssize_t i = 0; i < n; i++)
        failed += b.status[i] != ROW_OK;
    Py_END_ALLOW_THREADS
    if (got < 0)
        PyErr_NoMemory();
    else
        result = Py_BuildValue(
            "(iKKKLKln)", seen.stated, (unsigned long long)seen.directory.st_dev,
            (unsigned long long)seen.directory.st_ino, (unsigned long long)seen.root.st_dev,
            (long long)seen.root.st_mtim.tv_sec * 1000000000 + seen.root.st_mtim.tv_nsec,
            (unsigned long long)seen.token, faults, failed);
done:
    RELEASE(&rows, &index, &verified, &fds, &maps, &seeds, &checked, &ctimes, &status, &used,
            &header, &expect);
    return result;
}

PyDoc_STRVAR(gone_doc, "gone(fds, out, checked, ctimes, token): out[i] (uint8) = 1 where the file\n"
"open at fds[i] (int32, -1: none) is unlinked (evicted, replaced), changed since ctimes[i]\n"
"(its inode's ctime, ns: other readers) or no longer open, else 0 and checked[i] = token;\n"
"a file whose checked[i] is token (not 0) is not looked at. Without the GIL.");

static PyObject *gone(PyObject *self, PyObject *args) {
    PyObject *fds_obj, *out_obj, *checked_obj, *ctimes_obj;
    unsigned long long token;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOK", &fds_obj, &out_obj, &checked_obj, &ctimes_obj, &token))
        return NULL;
    Py_buffer fds = {0}, out = {0}, checked = {0}, ctimes = {0};
    PyObject *result = NULL;
    if (!get(fds_obj, &fds, PyBUF_SIMPLE, -1, "fds"))
        goto done;
    Py_ssize_t n = fds.len / (Py_ssize_t)sizeof(int32_t);
    if (!get(out_obj, &out, PyBUF_WRITABLE, n, "out") ||
        !get(checked_obj, &checked, PyBUF_WRITABLE, n * (Py_ssize_t)sizeof(uint64_t), "checked") ||
        !get(ctimes_obj, &ctimes, PyBUF_SIMPLE, n * (Py_ssize_t)sizeof(int64_t), "ctimes"))
        goto done;
    const int32_t *fd_of = fds.buf;
    unsigned char *gone_of = out.buf;
    uint64_t *checked_of = checked.buf;
    const int64_t *ctime_of = ctimes.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        struct stat st;
        gone_of[i] = 0;
        if (fd_of[i] < 0 || (token != 0 && checked_of[i] == token))
            continue;
        gone_of[i] = fstat(fd_of[i], &st) != 0 || st.st_nlink == 0 || ctime_ns(&st) != ctime_of[i];
        if (!gone_of[i])
            checked_of[i] = token;
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    RELEASE(&fds, &out, &checked, &ctimes);
    return result;
}

PyDoc_STRVAR(unmap_doc, "unmap(maps, length): munmap each nonzero address of maps (uint64).");

static PyObject *unmap(PyObject *self, PyObject *args) {
    PyObject *maps_obj;
    Py_ssize_t length;
    (void)self;
    if (!PyArg_ParseTuple(args, "On", &maps_obj, &length))
        return NULL;
    Py_buffer maps = {0};
    if (!get(maps_obj, &maps, PyBUF_SIMPLE, -1, "maps"))
        return NULL;
    const uint64_t *address = maps.buf;
    for (Py_ssize_t i = 0; i < maps.len / (Py_ssize_t)sizeof(uint64_t); i++)
        if (address[i])
            munmap((void *)(uintptr_t)address[i], (size_t)length);
    PyBuffer_Release(&maps);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(probe_doc, "probe(path, length) -> whether a guarded read of the file mapped for length\n"
"bytes (truncated to fewer, say) got through: False after a SIGBUS (for the tests).");

static PyObject *probe(PyObject *self, PyObject *args) {
    const char *path;
    Py_ssize_t length;
    (void)self;
    if (!PyArg_ParseTuple(args, "sn", &path, &length))
        return NULL;
    if (!guard_sigbus())
        return PyErr_SetFromErrno(PyExc_OSError);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
    unsigned char *at = mmap(NULL, (size_t)length, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (at == MAP_FAILED)
        return PyErr_SetFromErrno(PyExc_OSError);
    volatile unsigned sum = 0;
    int through = 0;
    sigjmp_buf jump;
    if (sigsetjmp(jump, 0) == 0) {
        decodefs_guard = &jump;
        for (Py_ssize_t k = 0; k < length; k += 512)
            sum += at[k];
        decodefs_guard = NULL;
        through = 1;
    }
    munmap(at, (size_t)length);
    return PyBool_FromLong(through);
}

PyDoc_STRVAR(checksum_doc, "checksum(data, seed[, build]) -> xxh3-64 of data with seed, as\n"
"read_rows has it; build: one of BUILDS (None or left out: the one read_rows uses)");

static PyObject *checksum(PyObject *self, PyObject *args) {
    Py_buffer data;
    unsigned long long seed;
    const char *name = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*K|z", &data, &seed, &name))
        return NULL;
    const struct build *build = build_named(name);
    PyObject *digest = NULL;
    if (build != NULL)
        digest = PyLong_FromUnsignedLongLong(build->checksum(data.buf, (size_t)data.len, seed));
    PyBuffer_Release(&data);
    return digest;
}

PyDoc_STRVAR(copy_checksum_doc,
"copy_checksum(data, skip, seed, into[, build]) -> xxh3-64 of data with seed,\n"
"data[skip:] copied into the writable buffer into (as long), both in the one pass\n"
"read_rows makes over a mapped entry (skip: its header's length; into: a row, at any\n"
"alignment); build: one of BUILDS (None or left out: the one read_rows uses)");

static PyObject *copy_checksum(PyObject *self, PyObject *args) {
    Py_buffer data, into;
    Py_ssize_t skip;
    unsigned long long seed;
    const char *name = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nKw*|z", &data, &skip, &seed, &into, &name))
        return NULL;
    const struct build *build = build_named(name);
    PyObject *digest = NULL;
    if (build == NULL) {
        /* ValueError set */
    } else if (skip < 0 || skip > data.len)
        PyErr_SetString(PyExc_ValueError, "copy_checksum: skip outside data");
    else if (into.len != data.len - skip)
        PyErr_SetString(PyExc_ValueError, "copy_checksum: into is not data[skip:]'s length");
    else
        digest = PyLong_FromUnsignedLongLong(
            build->copy_checksum(into.buf, data.buf, (size_t)data.len, (size_t)skip, seed));
    PyBuffer_Release(&data);
    PyBuffer_Release(&into);
    return digest;
}

static PyMethodDef methods[] = {
    {"read_rows", read_rows, METH_VARARGS, read_rows_doc},
    {"read_kept", read_kept, METH_VARARGS, read_kept_doc},
    {"gone", gone, METH_VARARGS, gone_doc},
    {"unmap", unmap, METH_VARARGS, unmap_doc},
    {"probe", probe, METH_VARARGS, probe_doc},
    {"checksum", checksum, METH_VARARGS, checksum_doc},
    {"copy_checksum", copy_checksum, METH_VARARGS, copy_checksum_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "_batchread",
    "A batch of store entries read into rows, each checked as it is copied (client/rows.py).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

/* module.attribute = the names of builds[0, count), a tuple; 0 with an exception set */
static int add_names(PyObject *module, const char *attribute, size_t count) {
    PyObject *names = PyTuple_New((Py_ssize_t)count);
    for (size_t k = 0; names != NULL && k < count; k++) {
        PyObject *name = PyUnicode_FromString(builds[k].name);
        if (name == NULL)
            Py_CLEAR(names);
        else
            PyTuple_SET_ITEM(names, (Py_ssize_t)k, name);
    }
    if (names == NULL || PyModule_AddObject(module, attribute, names) != 0) {
        Py_XDECREF(names);
        return 0;
    }
    return 1;
}

PyMODINIT_FUNC PyInit__batchread(void) {
#ifdef DECODEFS_X86_BUILDS
    _Static_assert(COMPILED == 3, "base, avx2, avx512: the order the checks below go by");
    __builtin_cpu_init(); /* AVX-512F only counts on a CPU with AVX2, as every one has it */
    if (__builtin_cpu_supports("avx2"))
        runnable = __builtin_cpu_supports("avx512f") ? 3 : 2;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (!add_names(m, "BUILDS", runnable) || !add_names(m, "COMPILED", COMPILED)) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddStringConstant(m, "VECTOR", CHOSEN->name) ||
        PyModule_AddIntConstant(m, "OK", ROW_OK) ||
        PyModule_AddIntConstant(m, "MISSING", ROW_MISSING) ||
        PyModule_AddIntConstant(m, "NOT_CACHED", ROW_NOT_CACHED) ||
        PyModule_AddIntConstant(m, "BAD", ROW_BAD) ||
        PyModule_AddIntConstant(m, "GONE", ROW_GONE) ||
        PyModule_AddIntConstant(m, "UNREAD", ROW_UNREAD)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
