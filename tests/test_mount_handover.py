"""The mount outlives the process serving it: reload, restart and crash under readers.

Real mounts held by a real holder (`decodefs mount --foreground`), read by
reader processes that check every array's bytes against an independent
decode, while serving processes are replaced, killed and stopped. A failed
read or a wrong byte fails the test; so does any error line the holder or a
serving process logs that the test did not cause.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.conftest import MountFactory
from tests.helpers import (
    Mount,
    decodefs,
    errno_of,
    is_live_mount,
    reference_npy,
    wait_until,
    write_config,
)

SIZE = 64
KILLED = (r"killed by SIGKILL",)

# A reader of the mount: loops over the paths (shuffled) until the stop file appears,
# checking each array's pixels; writes what it saw as JSON. Modes: np.load, a plain
# open/read, decodefs.read_array (the store directly, else the mount).
_READER = r"""
import hashlib, io, json, os, random, sys, time
import numpy as np
mode, listing, stop, out = sys.argv[1:5]
expected = json.load(open(listing))
paths = list(expected)
random.seed(os.getpid())
ok = wrong = passes = 0
failed = {}
longest = 0.0
if mode == "read_array":
    from decodefs import read_array
while not os.path.exists(stop):
    random.shuffle(paths)
    for path in paths:
        started = time.perf_counter()
        try:
            if mode == "np":
                pixels = np.load(path).tobytes()
            elif mode == "raw":
                with open(path, "rb", buffering=0) as f:
                    pixels = np.load(io.BytesIO(f.read())).tobytes()
            else:
                pixels = read_array(path).tobytes()
        except Exception as exc:
            name = f"{type(exc).__name__}:{getattr(exc, 'errno', '')}"
            failed[name] = failed.get(name, 0) + 1
        else:
            if hashlib.sha256(pixels).hexdigest() == expected[path]:
                ok += 1
            else:
                wrong += 1
        longest = max(longest, time.perf_counter() - started)
    passes += 1
    with open(out + ".passes", "w") as f:
        f.write(str(passes))
json.dump({"ok": ok, "wrong": wrong, "failed": failed, "longest": longest}, open(out, "w"))
"""


class Readers:
    """Reader processes looping over the mount until ``stop``."""

    def __init__(self, base: Path, expected: dict[str, str], modes: list[str]) -> None:
        base.mkdir(exist_ok=True)
        self.listing = base / "expected.json"
        self.listing.write_text(json.dumps(expected))
        self.stop_file = base / "stop"
        self.outs = [base / f"reader-{i}.json" for i in range(len(modes))]
        self.processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _READER,
                    mode,
                    str(self.listing),
                    str(self.stop_file),
                    str(out),
                ]
            )
            for mode, out in zip(modes, self.outs, strict=True)
        ]

    def passes(self) -> int:
        """The fewest passes over every path any reader has made."""
        counts = []
        for out in self.outs:
            try:
                counts.append(int(Path(f"{out}.passes").read_text() or 0))
            except (OSError, ValueError):
                counts.append(0)
        return min(counts)

    def wait_passes(self, at_least: int) -> None:
        wait_until(
            lambda: self.passes() >= at_least, 120, f"every reader to make {at_least} passes"
        )

    def stop(self) -> list[dict[str, Any]]:
        self.stop_file.write_text("")
        for process in self.processes:
            assert process.wait(timeout=120) == 0
        return [json.loads(out.read_text()) for out in self.outs]

    def kill(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


@pytest.fixture
def originals(tmp_path: Path, photos: dict[str, Path]) -> Path:
    """A private copy of the photos, flat: the test changes them."""
    directory = tmp_path / "originals"
    directory.mkdir()
    for uuid, path in photos.items():
        shutil.copy(path, directory / f"{uuid}{path.suffix}")
    return directory


def expected_pixels(mount: Mount, source: Path, version: str = "v1") -> dict[str, str]:
    """Path in the mount -> sha256 of the pixels an independent decode gives."""
    expected = {}
    for original in sorted(source.iterdir()):
        pixels = np.load(__import__("io").BytesIO(reference_npy(original, SIZE))).tobytes()
        digest = hashlib.sha256(pixels).hexdigest()
        expected[str(mount.path(version, str(SIZE), f"{original.stem}.npy"))] = digest
    return expected


def serving_pid(mount: Mount) -> int:
    pid = mount.stats()["pid"]
    assert isinstance(pid, int)
    return pid


def wait_replaced(mount: Mount, old_pid: int) -> int:
    """Wait until a serving process other than ``old_pid`` answers; its pid."""
    return wait_until(
        lambda: (pid := serving_pid(mount)) != old_pid and pid, 60, "a new serving process"
    )


@pytest.fixture
def readers(tmp_path: Path) -> Iterator[list[Readers]]:
    started: list[Readers] = []
    try:
        yield started
    finally:
        for group in started:
            group.kill()


def test_reload_restart_crash_and_sigterm_under_readers_fail_no_read(
    mounts: MountFactory, originals: Path, tmp_path: Path, readers: list[Readers]
) -> None:
    mount = mounts({"v1": originals}, version_sizes=[SIZE], expect_errors=KILLED, standby=True)
    expected = expected_pixels(mount, originals)
    group = Readers(tmp_path / "readers", expected, ["np", "raw", "read_array", "np"])
    readers.append(group)
    group.wait_passes(1)  # every array decoded and read once

    config = mount.config.read_text()
    mount.config.write_text(config.replace(f"sizes = [{SIZE}]", f"sizes = [{SIZE}, 32]"))
    pid = serving_pid(mount)
    reloaded = decodefs("reload", mount.mountpoint)
    assert reloaded.returncode == 0, reloaded.stderr
    assert "config: versions.v1.sizes: [64] -> [32, 64]" in reloaded.stdout
    pid = wait_replaced(mount, pid)
    assert sorted(os.listdir(mount.path("v1"))) == ["32", "64"]
    group.wait_passes(group.passes() + 1)

    restarted = decodefs("restart", mount.mountpoint)
    assert restarted.returncode == 0, restarted.stderr
    pid = wait_replaced(mount, pid)
    group.wait_passes(group.passes() + 1)

    standby = wait_until(lambda: mount.stats()["standby_pid"], 60, "a standby ready")
    os.kill(pid, signal.SIGKILL)  # a crash: the standby takes the connection over
    pid = wait_replaced(mount, pid)
    assert pid == standby
    group.wait_passes(group.passes() + 1)

    os.kill(pid, signal.SIGTERM)  # stopped on its own: drained, then replaced
    pid = wait_replaced(mount, pid)
    group.wait_passes(group.passes() + 1)

    seen = group.stop()
    for result in seen:
        assert result["failed"] == {} and result["wrong"] == 0, seen
        assert result["ok"] >= 5 * len(expected)
    stats = mount.stats()
    assert stats["holder_pid"] == mount.process.pid if mount.process else False
    assert stats["handovers"] == 4 and stats["crashes"] == 1, stats
    assert stats["holder_state"] == "serving"
    shown = decodefs("stats", mount.mountpoint).stdout
    holder = mount.process.pid if mount.process else 0
    assert re.search(rf"^holder +{holder} \(decodefs .*\): serving, mounted since ", shown, re.M)
    assert "; 4 handovers, 1 crash, 0 refused" in shown, shown


def test_a_reload_applies_versions_originals_and_decode_settings(
    mounts: MountFactory, originals: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    mount = mounts({"v1": originals}, version_sizes=[SIZE])
    astronaut = mount.path("v1", str(SIZE), "astronaut-baseline.npy")
    coffee = mount.path("v1", str(SIZE), "coffee-progressive.npy")
    sharded = mount.path("v1", str(SIZE), "co", "coffee-progressive.npy")
    for path in (astronaut, coffee, sharded):  # in the kernel's caches: names and pages
        assert path.read_bytes() == reference_npy(photos[path.stem], SIZE)
    # An original rewritten in place (same name, other pixels), one removed, one added,
    # and a second version.
    Image.open(photos["chelsea-444"]).convert("RGB").save(originals / "astronaut-baseline.jpg")
    os.unlink(originals / "coffee-progressive.jpeg")
    shutil.copy(photos["chelsea-444"], originals / "newcomer.jpg")
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(photos["camera-gray"], other / "camera-gray.jpg")
    write_config(mount.config, tmp_path / "store", {"v1": originals, "v2": other},
                 version_sizes=[SIZE])  # fmt: skip

    reloaded = decodefs("reload", mount.mountpoint)
    assert reloaded.returncode == 0, reloaded.stderr
    assert "version v2 added (1 originals)" in reloaded.stdout
    assert "version v1: 1 originals added, 1 removed, 1 changed in place" in reloaded.stdout
    assert astronaut.read_bytes() == reference_npy(originals / "astronaut-baseline.jpg", SIZE)
    assert errno_of(os.stat, coffee) == errno.ENOENT  # its cached name is forgotten
    assert errno_of(os.stat, sharded) == errno.ENOENT
    newcomer = mount.path("v1", str(SIZE), "newcomer.npy")
    assert newcomer.read_bytes() == reference_npy(originals / "newcomer.jpg", SIZE)
    assert sorted(os.listdir(mount.mountpoint)) == [".decodefs", "v1", "v2"]
    assert mount.path("v2", str(SIZE), "camera-gray.npy").read_bytes() == reference_npy(
        other / "camera-gray.jpg", SIZE
    )

    # New decode settings: every cached page of the version was decoded the old way.
    write_config(mount.config, tmp_path / "store", {"v1": originals},
                 version_sizes=[SIZE], version_resample="nearest")  # fmt: skip
    reloaded = decodefs("reload", mount.mountpoint)
    assert reloaded.returncode == 0, reloaded.stderr
    assert "version v2 removed" in reloaded.stdout
    assert "version v1: decode settings changed" in reloaded.stdout
    with Image.open(originals / "astronaut-baseline.jpg") as image:
        nearest = np.asarray(image.convert("RGB").resize((SIZE, SIZE), Image.NEAREST))  # type: ignore[attr-defined]
    assert np.array_equal(np.load(astronaut), nearest)
    assert errno_of(os.stat, mount.path("v2")) == errno.ENOENT
    assert sorted(os.listdir(mount.mountpoint)) == [".decodefs", "v1"]


def test_a_standby_prepared_from_an_edited_config_leaves_its_changes_to_the_reload(
    mounts: MountFactory, originals: Path, tmp_path: Path
) -> None:
    # A standby started after the config file was edited (here: once a crash took the
    # old one) prepares with the edited config; the reload that follows must still find
    # the version removed and the decode settings changed, and the kernel must forget
    # the pages decoded the old way.
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(originals / "camera-gray.jpg", other / "camera-gray.jpg")
    mount = mounts({"v1": originals, "v2": other}, version_sizes=[SIZE], standby=True,
                   expect_errors=KILLED)  # fmt: skip
    astronaut = mount.path("v1", str(SIZE), "astronaut-baseline.npy")
    bilinear = astronaut.read_bytes()  # its pages are in the kernel's cache now
    first = wait_until(lambda: mount.stats()["standby_pid"], 60, "a standby ready")
    write_config(mount.config, tmp_path / "store", {"v1": originals}, version_sizes=[SIZE],
                 version_resample="nearest", standby=True)  # fmt: skip
    os.kill(serving_pid(mount), signal.SIGKILL)  # the standby (the old config) takes over
    wait_until(lambda: serving_pid(mount) == first, 60, "the standby serving")
    wait_until(lambda: mount.stats()["standby_pid"] not in (None, first), 60, "a new standby")
    assert astronaut.read_bytes() == bilinear  # served as the old config says, still
    reloaded = decodefs("reload", mount.mountpoint)
    assert reloaded.returncode == 0, reloaded.stderr
    assert "version v2 removed" in reloaded.stdout, reloaded.stdout
    assert "version v1: decode settings changed" in reloaded.stdout, reloaded.stdout
    with Image.open(originals / "astronaut-baseline.jpg") as image:
        nearest = np.asarray(image.convert("RGB").resize((SIZE, SIZE), Image.NEAREST))  # type: ignore[attr-defined]
    assert np.array_equal(np.load(astronaut), nearest)
    assert errno_of(os.stat, mount.path("v2")) == errno.ENOENT


def test_a_reload_whose_config_does_not_load_is_refused_and_the_mount_keeps_serving(
    mounts: MountFactory, originals: Path
) -> None:
    mount = mounts({"v1": originals}, version_sizes=[SIZE])
    pid = serving_pid(mount)
    good = mount.config.read_text()
    mount.config.write_text(good.replace("sizes =", "sizez ="))
    refused = decodefs("reload", mount.mountpoint)
    assert refused.returncode != 0
    assert refused.stderr.startswith("decodefs: error: ") and "sizez" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert serving_pid(mount) == pid
    assert mount.path("v1", str(SIZE), "camera-gray.npy").read_bytes()
    # SIGHUP (systemctl reload) with the same config: refused by the new serving process,
    # which says why in the log; the old one keeps serving.
    assert mount.process is not None
    mount.process.send_signal(signal.SIGHUP)
    wait_until(lambda: "reload failed" in mount.log_text(), 60, "the refused SIGHUP reload")
    assert serving_pid(mount) == pid and mount.stats()["handovers"] == 0
    mount.expect_errors = (r"cannot serve|reload failed|sizez",)


def fuse_watched_by(pid: int) -> bool:
    """Whether process ``pid`` has its /dev/fuse descriptor in one of its epoll sets."""
    fds = Path(f"/proc/{pid}/fd")
    fuse = {int(fd.name) for fd in fds.iterdir() if os.readlink(fd) == "/dev/fuse"}
    assert fuse, f"process {pid} holds no /dev/fuse descriptor"
    watched = set()
    for fd in fds.iterdir():
        if os.readlink(fd) == "anon_inode:[eventpoll]":
            info = Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text()
            watched |= {int(n) for n in re.findall(r"^tfd:\s*(\d+)", info, re.MULTILINE)}
    return bool(fuse & watched)


def test_the_holder_is_not_woken_by_requests_and_sees_an_unmount_its_server_missed(
    mounts: MountFactory, originals: Path
) -> None:
    # In an epoll set, the descriptor would wake the holder at every request the kernel
    # queues, each wake-up taking the connection's lock from the serving process.
    mount = mounts({"v1": originals}, version_sizes=[SIZE])
    assert mount.process is not None
    for original in originals.iterdir():
        assert mount.path("v1", str(SIZE), f"{original.stem}.npy").read_bytes()
    assert not fuse_watched_by(mount.process.pid)
    # A serving process that reads nothing more (stopped) cannot say the mount ended:
    # the holder looks on its own, and stops.
    pid = serving_pid(mount)
    os.kill(pid, signal.SIGSTOP)
    try:
        subprocess.run(["umount", "--lazy", str(mount.mountpoint)], check=True)
        assert mount.process.wait(timeout=30) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed by then
            os.kill(pid, signal.SIGCONT)
    assert "was unmounted" in mount.log_text()


def test_a_serving_process_that_keeps_dying_is_backed_off_and_the_mount_answers_eio(
    mounts: MountFactory, originals: Path
) -> None:
    mount = mounts({"v1": originals}, version_sizes=[SIZE],
                   expect_errors=(*KILLED, "cannot serve", "EIO", "the next starts"))  # fmt: skip
    path = mount.path("v1", str(SIZE), "camera-gray.npy")
    good_bytes = path.read_bytes()
    good = mount.config.read_text()
    mount.config.write_text("this is not toml [")  # every new serving process fails
    os.kill(serving_pid(mount), signal.SIGKILL)

    def holder_status() -> dict[str, Any]:
        shown = decodefs("stats", mount.mountpoint, "--json")
        assert shown.returncode == 0, shown.stderr
        status: dict[str, Any] = json.loads(shown.stdout)
        return status

    wait_until(lambda: holder_status().get("holder_state") == "backing off", 60, "backing off")
    assert mount.process is not None and fuse_watched_by(mount.process.pid)  # it answers
    assert errno_of(os.open, mount.path("v1", str(SIZE), "astronaut-baseline.npy"),
                    os.O_RDONLY) == errno.EIO  # fmt: skip
    shown = decodefs("stats", mount.mountpoint)
    assert "backing off" in shown.stdout and f"{mount.config}: " in shown.stdout, shown.stdout
    mount.config.write_text(good)  # fixed: the next start succeeds
    wait_until(lambda: is_live_mount(mount.mountpoint) and mount.stats()["pid"], 120, "serving")
    assert path.read_bytes() == good_bytes
    assert mount.stats()["crashes"] >= 2
    assert not fuse_watched_by(mount.process.pid)


def test_an_upgrade_of_the_installed_code_serves_after_a_restart(
    mounts: MountFactory, originals: Path, tmp_path: Path
) -> None:
    installed = tmp_path / "site"
    shutil.copytree(Path(__file__).parents[1] / "decodefs", installed / "decodefs")
    env = {"PYTHONPATH": str(installed)}
    mount = mounts({"v1": originals}, version_sizes=[SIZE], env=env)
    before = mount.stats()["version"]
    version_py = installed / "decodefs" / "common" / "version.py"
    version_py.write_text(
        version_py.read_text()
        + '\n\ndef package_version() -> str:  # an upgrade\n    return "99.0.0"\n'
    )
    restarted = decodefs("restart", mount.mountpoint, env=env)
    assert restarted.returncode == 0, restarted.stderr
    assert "decodefs 99.0.0" in restarted.stdout
    assert mount.stats()["version"] == "99.0.0" != before
    assert mount.path("v1", str(SIZE), "camera-gray.npy").read_bytes()


def test_a_serving_process_stuck_in_a_switch_is_replaced_and_its_requests_sent_again(
    mounts: MountFactory, originals: Path, tmp_path: Path, readers: list[Readers]
) -> None:
    mount = mounts({"v1": originals}, version_sizes=[SIZE],
                   expect_errors=(*KILLED, "did not manage"))  # fmt: skip
    expected = expected_pixels(mount, originals)
    group = Readers(tmp_path / "readers", expected, ["np", "raw"])
    readers.append(group)
    group.wait_passes(1)
    pid = serving_pid(mount)
    os.kill(pid, signal.SIGSTOP)  # it reads requests no more, nor its channel
    try:
        restarted = decodefs("restart", mount.mountpoint)
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed by then
            os.kill(pid, signal.SIGCONT)
    assert restarted.returncode == 0, restarted.stderr
    wait_replaced(mount, pid)
    group.wait_passes(group.passes() + 1)
    for result in group.stop():
        assert result["failed"] == {} and result["wrong"] == 0


def test_the_holder_runs_no_decode_store_or_fuse_library_code(
    mounts: MountFactory, originals: Path
) -> None:
    mount = mounts({"v1": originals}, version_sizes=[SIZE])
    assert mount.process is not None
    holder = mount.process.pid
    maps = Path(f"/proc/{holder}/maps").read_text()
    for library in ("_multiarray_umath", "PIL", "pyfuse3", "_sqlite3", "xxhash", "libfuse3"):
        assert library not in maps, library
    server = Path(f"/proc/{serving_pid(mount)}/maps").read_text()
    assert "pyfuse3" in server and "_multiarray_umath" in server  # the check can see them
    rss = int(Path(f"/proc/{holder}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert rss < 64 << 20
    assert mount.stats()["holder_rss_bytes"] == pytest.approx(rss, rel=0.5)


@pytest.mark.parametrize("what", ["INIT answered otherwise", "no re-send"])
def test_a_serving_process_that_cannot_take_over_falls_back_to_a_plain_remount(
    mounts: MountFactory, originals: Path, tmp_path: Path, what: str
) -> None:
    failpoint = tmp_path / "failpoint"
    env = {
        "DECODEFS_FAILPOINT_INIT_REPLY"
        if what == "INIT answered otherwise"
        else "DECODEFS_FAILPOINT_NO_RESEND": str(failpoint)
    }
    mount = mounts({"v1": originals}, version_sizes=[SIZE], env=env,
                   expect_errors=("remounting", "killed by SIGKILL", "NOTIFY_RESEND"))  # fmt: skip
    path = mount.path("v1", str(SIZE), "camera-gray.npy")
    want = path.read_bytes()
    failpoint.write_text("")  # from now on (another libfuse; a kernel before 6.9)
    if what == "INIT answered otherwise":
        restarted = decodefs("restart", mount.mountpoint)
        assert restarted.returncode == 0, restarted.stderr
        assert "could not hand over (its libfuse answers the kernel's INIT" in restarted.stdout
    else:
        os.kill(serving_pid(mount), signal.SIGKILL)
    wait_until(lambda: mount.stats()["remounts"] == 1, 60, "the remount")
    failpoint.unlink()
    assert path.read_bytes() == want
    stats = mount.stats()
    assert stats["last_problem"].startswith("remounted: ")
    assert stats["handovers_refused"] == (1 if what == "INIT answered otherwise" else 0)
    assert mount.process is not None and mount.process.poll() is None  # the same holder


def test_an_original_changed_while_unmounted_is_served_new_once_the_mount_checked(
    mounts: MountFactory, originals: Path, photos: dict[str, Path]
) -> None:
    """A mount's first serving process looks for originals changed in place (and who
    may read them) before it serves: the remount serves the new pixels."""
    mount = mounts({"v1": originals}, version_sizes=[SIZE])
    path = mount.path("v1", str(SIZE), "astronaut-baseline.npy")
    assert path.read_bytes() == reference_npy(photos["astronaut-baseline"], SIZE)  # stored
    mount.stop()
    Image.open(photos["chelsea-444"]).convert("RGB").save(originals / "astronaut-baseline.jpg")
    mount = mounts({"v1": originals}, version_sizes=[SIZE])
    # Looked for before the mount serves: the first read is the new pixels already.
    assert path.read_bytes() == reference_npy(originals / "astronaut-baseline.jpg", SIZE)
