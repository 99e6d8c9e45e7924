"""Test corpora, an independent reference decode, and a real-mount harness."""

from __future__ import annotations

import collections
import contextlib
import errno
import inspect
import io
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import skimage.data
import trio
from PIL import Image

T = TypeVar("T")

SKIMAGE_DATA = Path(skimage.data.__file__).parent
MOUNT_TIMEOUT = 60.0
POLL_SECONDS = 0.01
# How long a wait gives a condition by default; scripts/mutation.sh shortens it,
# since a mutant that breaks a condition would otherwise cost the whole wait.
WAIT_SECONDS = float(os.environ.get("DECODEFS_TEST_WAIT_SECONDS", "30"))


# -- waiting on conditions --------------------------------------------------


def interruptible() -> None:
    """A Popen ``preexec_fn``: SIGINT as a terminal gives it, even to a run started as a
    background job (whose SIGINT the shell ignores, which Python would keep: Ctrl-C
    would then never reach the command under test)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_until(predicate: Callable[[], T], timeout: float = 30.0, what: str | None = None) -> T:
    """Poll ``predicate`` until it returns something true, and return that.

    On timeout, fail with what was waited for and the last value seen (or the
    exception the predicate last raised). A condition with a deadline, never a
    fixed sleep: the poll interval only bounds how soon a met condition is seen.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            seen: object = predicate()
        except AssertionError:
            raise
        except Exception as exc:  # e.g. a status file not there yet
            seen = exc
        else:
            if seen:
                return seen  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(
                f"waited {timeout} s for {what or _describe(predicate)}; last saw {seen!r}"
            )
        time.sleep(POLL_SECONDS)


async def wait_for(predicate: Callable[[], T], timeout: float = 30.0, what: str | None = None) -> T:
    """``wait_until`` for trio tests: polls between checkpoints. The deadline is real
    time, so a MockClock that jumps ahead cannot end the wait early."""
    deadline = time.monotonic() + timeout
    while True:
        seen: object = predicate()
        if seen:
            return seen  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(
                f"waited {timeout} s for {what or _describe(predicate)}; last saw {seen!r}"
            )
        await trio.sleep(POLL_SECONDS)


def _describe(predicate: Callable[[], object]) -> str:
    try:
        return inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        return repr(predicate)


# -- the reference decode ---------------------------------------------------


def reference_npy(path: Path, size: int) -> bytes:
    """What a training pipeline computes, written independently of decodefs."""
    # The issue's expression, verbatim (Pillow defines Image.BILINEAR at run time).
    array = np.asarray(Image.open(path).convert("RGB").resize((size, size), Image.BILINEAR))  # type: ignore[attr-defined]
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


# -- corpora ----------------------------------------------------------------


def write_photos(directory: Path) -> dict[str, Path]:
    """Real photographs re-encoded the ways originals arrive. uuid -> path."""
    astronaut = Image.open(SKIMAGE_DATA / "astronaut.png").convert("RGB")
    coffee = Image.open(SKIMAGE_DATA / "coffee.png").convert("RGB")
    chelsea = Image.open(SKIMAGE_DATA / "chelsea.png").convert("RGB")
    camera = Image.open(SKIMAGE_DATA / "camera.png")
    rocket = Image.open(SKIMAGE_DATA / "rocket.jpg")
    logo = Image.open(SKIMAGE_DATA / "logo.png")
    assert logo.mode == "RGBA"

    originals: dict[str, tuple[Image.Image, str, dict[str, Any]]] = {
        "astronaut-baseline": (astronaut, "jpg", {"quality": 90}),
        "coffee-progressive": (coffee, "jpeg", {"quality": 85, "progressive": True}),
        "chelsea-444": (chelsea, "JPG", {"quality": 95, "subsampling": 0}),
        "camera-gray": (camera.convert("L"), "jpg", {"quality": 90}),
        "rocket-cmyk": (rocket.convert("CMYK"), "jpg", {"quality": 90}),
        "logo-alpha": (logo, "png", {}),
        "astronaut-palette": (astronaut.quantize(64), "png", {}),
        "coffee-webp": (coffee, "webp", {"quality": 80}),
        "chelsea-bmp": (chelsea, "bmp", {}),
        "camera-tiff": (camera, "TIFF", {"compression": "tiff_deflate"}),
        "hubble-original": (
            Image.open(SKIMAGE_DATA / "hubble_deep_field.jpg"),
            "jpg",
            {"quality": 92},
        ),
    }
    paths = {}
    for i, (uuid, (image, extension, options)) in enumerate(sorted(originals.items())):
        path = directory / f"group-{i % 3}" / "nested" / f"{uuid}.{extension}"
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path, **options)
        paths[uuid] = path
    assert Image.open(paths["coffee-progressive"]).info.get("progressive")
    assert Image.open(paths["rocket-cmyk"]).mode == "CMYK"
    return paths


def write_bad_originals(directory: Path, good_jpeg: Path) -> dict[str, Path]:
    """Originals that must fail alone: uuid -> path."""
    directory.mkdir(parents=True, exist_ok=True)
    data = good_jpeg.read_bytes()
    bad = {
        "bad-truncated": (directory / "bad-truncated.jpg", data[: len(data) // 2]),
        "bad-empty": (directory / "bad-empty.jpg", b""),
        "bad-text": (directory / "bad-text.jpg", b"this is not an image\n" * 50),
        "bad-bomb": (directory / "bad-bomb.png", png_header_only(30_000, 30_000)),
        "bad-bigger-than-max-pixels": (
            directory / "bad-bigger-than-max-pixels.png",
            png_header_only(10_000, 10_000),
        ),
    }
    for path, payload in bad.values():
        path.write_bytes(payload)
    return {uuid: path for uuid, (path, _) in bad.items()}


def png_header_only(width: int, height: int) -> bytes:
    """A valid PNG announcing ``width`` x ``height`` with almost no data: a decompression bomb."""

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    rows = zlib.compress(b"\0" * (width + 1) * 4)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")
    )


def write_config(path: Path, store: Path, versions: dict[str, Path], **extra: Any) -> Path:
    """A config file; ``extra`` holds top-level keys and ``version_<key>`` for every version.

    The tests read any size, listed or not, and count what is stored: unless a test
    says otherwise, unlisted sizes are stored for the daemon's own user
    (``unlisted_sizes = "owner"``); ``unlisted_sizes=None`` leaves the key out, for
    the default ("memory", tests/test_mount_nothing_silent.py).
    """
    extra.setdefault("unlisted_sizes", "owner")
    if extra["unlisted_sizes"] is None:
        del extra["unlisted_sizes"]
    version_keys = {k[len("version_") :]: v for k, v in extra.items() if k.startswith("version_")}
    top = {k: v for k, v in extra.items() if not k.startswith("version_")}
    lines = [f"store = {json.dumps(str(store))}"]
    lines += [f"{key} = {_toml(value)}" for key, value in top.items()]
    for name, source in versions.items():
        lines.append(f"[versions.{name}]")
        lines.append(f"source = {json.dumps(str(source))}")
        lines += [f"{key} = {_toml(value)}" for key, value in version_keys.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


# -- real mounts ------------------------------------------------------------

# Daemon log lines that are failures unless a test says it expects them.
_UNEXPECTED = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback")


@dataclass
class Mount:
    """A real decodefs daemon serving a real FUSE mount, driven as a user would."""

    mountpoint: Path
    config: Path
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    expect_errors: Iterable[str] = ()
    wrapper: list[str] = field(default_factory=list)  # e.g. ["prlimit", "--nofile=64:64"]
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> Mount:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        log_stream = open(self.log, "ab")  # noqa: SIM115 - owned by the child
        self.process = subprocess.Popen(
            [
                *self.wrapper,
                *(sys.executable, "-m", "decodefs", "mount", str(self.mountpoint)),
                *("--config", str(self.config), "--foreground"),
            ],
            stdout=log_stream,
            stderr=log_stream,
            env={**os.environ, **self.env},
        )
        log_stream.close()
        wait_until_live(self.mountpoint, self.process, self.log)
        return self

    def path(self, *parts: str) -> Path:
        return self.mountpoint.joinpath(*parts)

    def stats(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.path(".decodefs", "stats.json").read_bytes())
        return data

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int | None:
        """Unmount (always) and return the daemon's exit status."""
        unmount_quietly(self.mountpoint)
        code = None
        if self.process is not None:
            try:
                code = self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                code = self.process.wait()
        return code

    def kill9(self) -> None:
        """Kill the mount's holder: the mount is lost with it (its serving process, told
        by the kernel, dies too, and may say so first)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def unexpected_log_lines(self) -> list[str]:
        allowed = [re.compile(p) for p in self.expect_errors]
        return [
            line
            for line in self.log_text().splitlines()
            if _UNEXPECTED.search(line) and not any(p.search(line) for p in allowed)
        ]


def wait_until_live(mountpoint: Path, process: subprocess.Popen[bytes] | None, log: Path) -> None:
    def live() -> bool:
        if process is not None and process.poll() is not None:
            raise AssertionError(
                f"daemon exited with {process.returncode}:\n{log.read_text(errors='replace')}"
            )
        return is_live_mount(mountpoint)

    try:
        wait_until(live, MOUNT_TIMEOUT, f"the mount at {mountpoint} to answer")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{log.read_text(errors='replace')}") from None


def is_live_mount(mountpoint: Path) -> bool:
    if not is_mounted(mountpoint):
        return False
    try:
        os.statvfs(mountpoint)
    except OSError:
        return False
    return True


def is_mounted(mountpoint: Path) -> bool:
    target = str(mountpoint.absolute())
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        return any(line.split()[4] == target for line in f)


def unmount_quietly(mountpoint: Path) -> None:
    for _ in range(3):
        if not is_mounted(mountpoint):
            return
        subprocess.run(
            ["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True, check=False
        )
        with contextlib.suppress(OSError):
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)


def decodefs(
    *args: str | Path | int, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run the decodefs command as a user would, capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", "decodefs", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def errno_of(fn: Any, *args: Any) -> int:
    """The errno a call fails with (the test fails if it succeeds)."""
    try:
        fn(*args)
    except OSError as exc:
        assert exc.errno is not None
        return exc.errno
    raise AssertionError(f"{fn.__name__}{args} succeeded")


ERRNO_NAMES = errno.errorcode


def abort_fuse_connection(mountpoint: Path) -> None:
    """Abort a hung mount's FUSE connection, so that readers blocked on it return."""
    connections = Path("/sys/fs/fuse/connections")
    if not any(connections.iterdir()):
        subprocess.run(["mount", "-t", "fusectl", "fusectl", str(connections)], check=False)
    with contextlib.suppress(OSError):
        (connections / str(os.minor(os.stat(mountpoint).st_dev)) / "abort").write_text("1")


NOBODY = 65534  # another local user, with no rights of its own


def as_nobody(
    *command: str | Path, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[bytes]:
    """Run ``command`` as another, unprivileged local user (needs root)."""
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *map(str, command)],
        capture_output=True,
        timeout=timeout,
        cwd=cwd,
    )


def python_as_nobody(script: str, *args: str | Path) -> subprocess.CompletedProcess[bytes]:
    """Run a Python ``script`` (with decodefs importable) as another local user."""
    return as_nobody(sys.executable, "-c", script, *args)


# -- the requests a mount's daemon is sent ---------------------------------------

TRACING = Path("/sys/kernel/tracing")
_REQUEST = re.compile(r"connection (\d+) req \d+ opcode \d+ \((\w+)\)")


@contextlib.contextmanager
def fuse_requests(mountpoint: Path) -> Iterator[collections.Counter[str]]:
    """How many FUSE requests of each kind (``"FUSE_LOOKUP"``...) the kernel sent
    ``mountpoint``'s daemon inside the block, from the kernel's fuse tracepoints in a
    trace instance of the block's own (tracefs is mounted for it if it is not). The
    counts are filled in when the block ends."""
    mounted_here = not (TRACING / "instances").is_dir()
    if mounted_here:
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACING)], check=True)
    device = os.stat(mountpoint).st_dev
    assert os.major(device) == 0, device  # the fuse connection's number is its minor
    instance = TRACING / "instances" / f"decodefs-test-{os.getpid()}-{time.monotonic_ns()}"
    counts: collections.Counter[str] = collections.Counter()
    try:
        instance.mkdir()
        try:
            (instance / "events/fuse/fuse_request_send/enable").write_text("1\n")
            yield counts
            (instance / "tracing_on").write_text("0\n")
            for line in (instance / "trace").read_text().splitlines():
                found = _REQUEST.search(line)
                if found is not None and int(found[1]) == os.minor(device):
                    counts[found[2]] += 1
        finally:
            instance.rmdir()
    finally:
        if mounted_here:
            subprocess.run(["umount", str(TRACING)], check=False)
