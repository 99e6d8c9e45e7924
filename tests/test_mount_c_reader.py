"""A reader in another language: a small C program reads arrays through the mount.

It parses the .npy header itself (magic, version, header length, 'descr',
'fortran_order', 'shape'), reads the pixels and writes them to stdout; they
must be numpy's pixels byte for byte. It also sends the two requests any
language can make with open flags: O_NONBLOCK (warm) and O_SYNC (recheck).
"""

from __future__ import annotations

import io
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from decodefs.common.protocol import TRAILER_SIZE
from tests.conftest import MountFactory
from tests.helpers import reference_npy

NPYREAD_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void fail(const char *what) {
    fprintf(stderr, "npyread: %s\n", what);
    exit(1);
}

static void read_full(int fd, void *buffer, size_t length) {
    size_t done = 0;
    while (done < length) {
        ssize_t got = read(fd, (char *)buffer + done, length - done);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) fail(strerror(errno));
        if (got == 0) fail("file ends early");
        done += (size_t)got;
    }
}

int main(int argc, char **argv) {
    if (argc != 3) fail("usage: npyread read|warm|recheck FILE");
    int flags = O_RDONLY;
    if (strcmp(argv[1], "warm") == 0) flags |= O_NONBLOCK;  /* "decode and store it" */
    if (strcmp(argv[1], "recheck") == 0) flags |= O_SYNC;   /* "check the stored entry again" */
    int fd = open(argv[2], flags);
    if (fd < 0) fail(strerror(errno));
    if (strcmp(argv[1], "warm") == 0) return close(fd) == 0 ? 0 : 1;

    unsigned char start[10];
    read_full(fd, start, sizeof start);
    if (memcmp(start, "\x93NUMPY", 6) != 0) fail("no .npy magic");
    unsigned major = start[6], minor = start[7];
    size_t header_length, prefix;
    if (major == 1) {
        header_length = start[8] | (size_t)start[9] << 8;
        prefix = 10;
    } else if (major == 2 || major == 3) {
        unsigned char more[2];
        read_full(fd, more, 2);
        header_length = start[8] | (size_t)start[9] << 8 | (size_t)more[0] << 16
                        | (size_t)more[1] << 24;
        prefix = 12;
    } else {
        fail("unknown .npy version");
    }
    char *header = malloc(header_length + 1);
    read_full(fd, header, header_length);
    header[header_length] = '\0';
    if (!strstr(header, "'descr': '|u1'")) fail("not uint8");
    if (!strstr(header, "'fortran_order': False")) fail("not C order");
    const char *shape = strstr(header, "'shape': (");
    long height, width, channels;
    if (!shape || sscanf(shape + 10, "%ld, %ld, %ld)", &height, &width, &channels) != 3)
        fail("no 3-d shape");
    size_t length = (size_t)height * (size_t)width * (size_t)channels;
    unsigned char *pixels = malloc(length);
    read_full(fd, pixels, length);
    unsigned char extra;
    if (read(fd, &extra, 1) != 0) fail("bytes after the array");
    close(fd);

    unsigned long long sum = 0;
    for (size_t i = 0; i < length; i++) sum += pixels[i];
    fprintf(stderr, "version %u.%u header %zu shape %ld %ld %ld sum %llu\n",
            major, minor, prefix + header_length, height, width, channels, sum);
    if (fwrite(pixels, 1, length, stdout) != length) fail("cannot write");
    return 0;
}
"""


@pytest.fixture(scope="module")
def npyread(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The C reader, compiled for this test with warnings as errors."""
    gcc = shutil.which("gcc")
    assert gcc, "gcc is installed by scripts/system-packages.sh"
    directory = tmp_path_factory.mktemp("c-reader")
    (directory / "npyread.c").write_text(NPYREAD_C)
    binary = directory / "npyread"
    subprocess.run(
        [gcc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-o", binary, "npyread.c"],
        cwd=directory,
        check=True,
    )
    return binary


def run(binary: Path, mode: str, path: Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([binary, mode, path], capture_output=True, timeout=60)


def test_a_c_program_reads_the_arrays_numpy_reads(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], npyread: Path
) -> None:
    mount = mounts({"v1": photos_dir})
    for size in (37, 224):
        for uuid, original in photos.items():
            want = np.load(io.BytesIO(reference_npy(original, size)))
            for path in (
                mount.path("v1", str(size), f"{uuid}.npy"),
                mount.path("v1", str(size), uuid[:2], f"{uuid}.npy"),
            ):
                result = run(npyread, "read", path)
                assert result.returncode == 0, result.stderr
                assert result.stdout == want.tobytes() == np.load(path).tobytes()
                assert result.stderr.decode() == (
                    f"version 1.0 header 128 shape {size} {size} 3 sum {int(want.sum())}\n"
                )
    assert mount.stats()["decodes"] == 2 * len(photos)  # the second path read the same entry


def test_a_c_program_asks_for_a_warm_and_a_recheck(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], npyread: Path
) -> None:
    mount = mounts({"v1": photos_dir})
    uuid, original = next(iter(sorted(photos.items())))
    path = mount.path("v1", "64", f"{uuid}.npy")

    warm = run(npyread, "warm", path)  # O_NONBLOCK: decoded and stored, nothing read
    assert warm.returncode == 0, warm.stderr
    stats = mount.stats()
    assert stats["warm_decodes"] == 1 and stats["store_entries"] == 1
    assert stats["bytes_served"] == 0

    entry = mount.config.parent / "store" / "v1" / "64" / uuid[:2] / f"{uuid}.npy"
    assert run(npyread, "read", path).stdout == reference_npy(original, 64)[128:]  # verified now
    damaged = bytearray(entry.read_bytes())
    damaged[-TRAILER_SIZE - 1] ^= 0xFF  # a pixel flipped on flash after it was verified
    entry.write_bytes(bytes(damaged))
    recheck = run(npyread, "recheck", path)  # O_SYNC: the daemon checks the entry again
    assert recheck.returncode == 0, recheck.stderr
    assert recheck.stdout == reference_npy(original, 64)[128:]
    assert mount.stats()["corrupt_entries"] == 1  # found, deleted, rebuilt
    assert entry.read_bytes()[:-TRAILER_SIZE] == reference_npy(original, 64)
