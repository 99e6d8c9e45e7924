"""The CLI's one error model: every user error is one `decodefs: error:` line per problem,
naming what is wrong, exit 1 (2 for bad arguments), no traceback, nothing mounted or written."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from decodefs.common.config import DEFAULT_CONFIG_PATH
from tests.conftest import MountFactory, Tmpfs, needs_root
from tests.helpers import (
    abort_fuse_connection,
    decodefs,
    errno_of,
    is_mounted,
    reference_npy,
    unmount_quietly,
    wait_until,
    write_config,
)

PREFIX = "decodefs: error: "


def assert_user_error(
    result: subprocess.CompletedProcess[str], *fragments: str, status: int = 1, lines: int = 1
) -> None:
    """What the user sees: the exit status, `lines` error lines, each fragment, no traceback."""
    shown = f"exit {result.returncode}\nstdout: {result.stdout!r}\nstderr:\n{result.stderr}"
    assert result.returncode == status, shown
    assert "Traceback" not in result.stderr, shown
    if status == 1:
        assert result.stderr.splitlines() == [
            line for line in result.stderr.splitlines() if line.startswith(PREFIX)
        ], shown
        assert len(result.stderr.splitlines()) == lines, shown
    else:  # argparse: its usage, then one line naming the argument
        assert "error: argument " in result.stderr.splitlines()[-1], shown
    for fragment in fragments:
        assert fragment in result.stderr, shown


@dataclass(frozen=True)
class Scene:
    """Things a user can get wrong, all under tmp_path."""

    tmp: Path
    config: Path  # a good config
    mnt: Path  # an empty directory
    file: Path  # a regular file

    def write(self, name: str, data: bytes | str) -> Path:
        path = self.tmp / name
        if isinstance(data, str):
            data = data.encode()
        path.write_bytes(data)
        return path


@pytest.fixture
def scene(tmp_path: Path, photos_dir: Path) -> Scene:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    file = tmp_path / "file"
    file.write_text("a regular file\n")
    config = write_config(tmp_path / "config.toml", tmp_path / "store", {"v1": photos_dir})
    return Scene(tmp_path, config, mnt, file)


Args = Callable[[Scene], list[str | Path]]
Fragments = Callable[[Scene], list[str]]


@dataclass(frozen=True)
class Case:
    args: Args
    fragments: Fragments
    status: int = 1
    env: Callable[[Scene], dict[str, str]] = lambda s: {}


def _three_mistakes(s: Scene) -> Path:
    return s.write(
        "three.toml",
        f"store = '{s.file / 'store'}'\nsizse = [224]\n"
        f"[versions.v1]\nsource = '{s.tmp}'\nfit = 'zoom'\n",
    )


CASES: dict[str, Case] = {
    "warm --keys missing": Case(
        lambda s: ["warm", s.mnt, "v1", "224", "--keys", s.tmp / "missing.txt"],
        lambda s: [f"--keys {s.tmp / 'missing.txt'}: cannot read it: No such file"],
    ),
    "warm --keys a directory": Case(
        lambda s: ["warm", s.mnt, "v1", "224", "--keys", s.tmp],
        lambda s: [f"--keys {s.tmp}: is a directory"],
    ),
    "warm --keys not UTF-8": Case(
        lambda s: ["warm", s.mnt, "v1", "224", "--keys", s.write("u.txt", b"abc\n\xff\n")],
        lambda s: [f"--keys {s.tmp / 'u.txt'}: byte 4 is not UTF-8 text"],
    ),
    "warm --keys a path": Case(
        lambda s: ["warm", s.mnt, "v1", "224", "--keys", s.write("u.txt", "abc\n../x\n")],
        lambda s: [f"--keys {s.tmp / 'u.txt'}: line 2: '../x' is not a uuid"],
    ),
    "warm on a directory that is not a mount": Case(
        lambda s: ["warm", s.mnt, "v1", "224"],
        lambda s: [f"{s.mnt} is not a decodefs mount (nothing is mounted there)"],
    ),
    "warm --jobs 0": Case(
        lambda s: ["warm", s.mnt, "v1", "224", "--jobs", "0"],
        lambda s: ["--jobs", "must be at least 1, got 0"],
        status=2,
    ),
    "warm --jobs -3": Case(
        lambda s: ["warm", s.mnt, "v1", "224", "-j", "-3"],
        lambda s: ["--jobs", "must be at least 1, got -3"],
        status=2,
    ),
    "warm size 0": Case(
        lambda s: ["warm", s.mnt, "v1", "0"],
        lambda s: ["argument size: must be at least 1"],
        status=2,
    ),
    "make-sample below a file": Case(
        lambda s: ["make-sample", s.file / "photos"],
        lambda s: [f"cannot write sample images to {s.file / 'photos'}: Not a directory"],
    ),
    "make-sample onto a file": Case(
        lambda s: ["make-sample", s.file],
        lambda s: [f"{s.file} is not a directory"],
    ),
    "make-sample --count -1": Case(
        lambda s: ["make-sample", s.tmp / "photos", "--count", "-1"],
        lambda s: ["--count"],
        status=2,
    ),
    "mount --log-file that cannot be created": Case(
        lambda s: ["mount", s.mnt, "--config", s.config, "--log-file", s.file / "x" / "y.log"],
        lambda s: [f"--log-file {s.file / 'x' / 'y.log'} cannot be written: Not a directory"],
    ),
    "mount --log-file that is a directory": Case(
        lambda s: ["mount", s.mnt, "--config", s.config, "--log-file", s.tmp],
        lambda s: [f"--log-file {s.tmp} cannot be written: Is a directory"],
    ),
    "mount with a store below a regular file": Case(
        lambda s: [
            "mount",
            s.mnt,
            "--config",
            s.write("c.toml", f"store = '{s.file}/x'\n[versions.v1]\nsource = '{s.tmp}'\n"),
        ],
        lambda s: [
            f"{s.tmp / 'c.toml'}: store: {s.file}/x can never be a directory: "
            f"{s.file} is a regular file"
        ],
    ),
    "mount over a directory with files": Case(
        lambda s: ["mount", s.tmp, "--config", s.config],
        lambda s: [f"mount point {s.tmp} is not empty", "--nonempty"],
    ),
    "mount with a config that is a directory": Case(
        lambda s: ["mount", s.mnt, "--config", s.tmp],
        lambda s: [f"{s.tmp}: is a directory, not a config file"],
    ),
    "mount with a config that is not UTF-8": Case(
        lambda s: ["mount", s.mnt, "--config", s.write("c.toml", b"store = '\xff'\n")],
        lambda s: [f"{s.tmp / 'c.toml'}: not a TOML config: byte 9 is not UTF-8 text"],
    ),
    "mount with a config that cannot be read": Case(
        lambda s: ["mount", s.mnt, "--config", s.file / "config.toml"],
        lambda s: [f"{s.file / 'config.toml'}: cannot read config: Not a directory"],
    ),
    "verify a directory that is not a store": Case(
        lambda s: ["verify", s.mnt],
        lambda s: [f"{s.mnt} is not a decodefs store (it has no .decodefs-store file)"],
    ),
    "verify a config whose store was never used": Case(
        lambda s: ["verify", s.config],
        lambda s: [f"the store of {s.config} ({s.tmp / 'store'}) does not exist"],
    ),
    "stats of a directory that is not a mount": Case(
        lambda s: ["stats", s.mnt],
        lambda s: [f"{s.mnt} is not a decodefs mount"],
    ),
    "umount of a directory that is not a mount": Case(
        lambda s: ["umount", s.mnt],
        lambda s: [f"{s.mnt} is not mounted"],
    ),
    "mount on a mount point that does not exist": Case(
        lambda s: ["mount", s.tmp / "absent", "--config", s.config],
        lambda s: [
            f"mount point {s.tmp / 'absent'} does not exist: create it "
            f"(`mkdir -p {s.tmp / 'absent'}`), or pass --mkdir"
        ],
    ),
    "mount on a regular file": Case(
        lambda s: ["mount", s.file, "--config", s.config],
        lambda s: [f"mount point {s.file} is not a directory"],
    ),
    "mount with $DECODEFS_CONFIG naming no file": Case(
        lambda s: ["mount", s.mnt],
        lambda s: [
            f"no config file at {s.tmp / 'nope.toml'} ($DECODEFS_CONFIG names it); name yours "
            "with --config FILE or $DECODEFS_CONFIG"
        ],
        env=lambda s: {"DECODEFS_CONFIG": str(s.tmp / "nope.toml")},
    ),
    "umount without a mount point or a config": Case(
        lambda s: ["umount"],
        lambda s: [
            "no mount point: give one, `decodefs umount ",
            f"there is no config file at {s.tmp / 'nope.toml'} (--config FILE or "
            "$DECODEFS_CONFIG names one)",
        ],
        env=lambda s: {"DECODEFS_CONFIG": str(s.tmp / "nope.toml")},
    ),
    "umount without a mount point, the config naming none": Case(
        lambda s: ["umount", "--config", s.config],
        lambda s: ["no mount point: give one, or set `mountpoint` in the config"],
    ),
    "adopt --sample 0": Case(
        lambda s: ["adopt", s.tmp, "v1", "224", "--config", s.config, "--sample", "0"],
        lambda s: ["--sample", "must be at least 1, got 0"],
        status=2,
    ),
    "adopt --copy --move": Case(
        lambda s: ["adopt", s.tmp, "v1", "224", "--config", s.config, "--copy", "--move"],
        lambda s: ["--move: not allowed with argument --copy"],
        status=2,
    ),
}
if not DEFAULT_CONFIG_PATH.exists():  # a machine that has one would mount it
    CASES["mount with no config at the default path"] = Case(
        lambda s: ["mount", s.mnt],
        lambda s: [
            f"no config file at {DEFAULT_CONFIG_PATH} (the default); name yours with "
            "--config FILE or $DECODEFS_CONFIG"
        ],
        env=lambda s: {"DECODEFS_CONFIG": ""},
    )


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_user_errors_are_one_line_and_change_nothing(scene: Scene, case: Case) -> None:
    args = case.args(scene)  # may write the file it names
    before = sorted(p.relative_to(scene.tmp) for p in scene.tmp.rglob("*"))
    result = decodefs(*args, env=case.env(scene))
    assert_user_error(result, *case.fragments(scene), status=case.status)
    assert not is_mounted(scene.mnt) and not is_mounted(scene.tmp)
    after = sorted(p.relative_to(scene.tmp) for p in scene.tmp.rglob("*"))
    assert after == before  # nothing written: no store, no log, no sample


def test_a_config_with_three_mistakes_reports_all_three(scene: Scene) -> None:
    config = _three_mistakes(scene)
    result = decodefs("mount", scene.mnt, "--config", config)
    assert_user_error(
        result,
        f"{PREFIX}{config}: sizse: unknown key (did you mean 'sizes'?)\n",
        f"{PREFIX}{config}: store: {scene.file / 'store'} can never be a directory: "
        f"{scene.file} is a regular file\n",
        f"{PREFIX}{config}: versions.v1.fit: 'zoom' is not one of 'stretch', 'crop', 'pad'\n",
        lines=3,
    )
    assert not is_mounted(scene.mnt)


def test_mount_over_a_directory_with_files_only_with_nonempty(
    scene: Scene, photos: dict[str, Path]
) -> None:
    (scene.mnt / "keep.txt").write_text("mine\n")
    log = scene.tmp / "log"
    assert_user_error(
        decodefs("mount", scene.mnt, "--config", scene.config, "--log-file", log),
        f"mount point {scene.mnt} is not empty (it holds 'keep.txt')",
    )
    for extra in ([], ["--foreground"]):  # the daemon checks too
        result = decodefs("mount", scene.mnt, "--config", scene.config, *extra)
        assert_user_error(result, "is not empty")
    assert not is_mounted(scene.mnt)

    result = decodefs("mount", scene.mnt, "--config", scene.config, "--log-file", log, "--nonempty")
    try:
        assert result.returncode == 0, result.stderr
        uuid, original = next(iter(photos.items()))
        assert (scene.mnt / "v1" / "64" / f"{uuid}.npy").read_bytes() == reference_npy(original, 64)
    finally:
        assert decodefs("umount", scene.mnt).returncode == 0
        unmount_quietly(scene.mnt)
    assert (scene.mnt / "keep.txt").read_text() == "mine\n"  # hidden, never touched


def test_errors_about_a_live_mount_name_what_it_lacks(
    mounts: MountFactory, photos_dir: Path, tmp_path: Path
) -> None:
    mount = mounts({"v1": photos_dir})
    mnt = mount.mountpoint
    pid = mount.stats()["holder_pid"]  # the process that holds the store's lock for the mount
    missing = tmp_path / "missing.txt"
    unknown = tmp_path / "unknown.txt"
    unknown.write_text("no-such-original\n")
    other = tmp_path / "other"
    other.mkdir()
    stop_it = f"it is the daemon of {mnt} (stop it: `decodefs umount {mnt}`)"
    cases = [
        (("warm", mnt, "v2", "224"), f"{mnt} has no version 'v2' (it has: v1)"),
        (("warm", mnt, ".decodefs", "224"), "has no version '.decodefs'"),
        (("warm", mnt, "v1", "5000"), f"{mnt} serves no size 5000 of v1 (it serves sizes 8 to"),
        (("warm", mnt, "v1", "224", "--keys", missing), f"--keys {missing}: cannot read it"),
        (
            ("warm", mnt, "v1", "224", "--keys", unknown),
            f"1 keys of {unknown} are not originals of v1, e.g. 'no-such-original'",
        ),
        (
            ("warm", mnt / "v1", "v1", "224"),
            f"{mnt / 'v1'} is inside the decodefs mount at {mnt}; give the mount point itself: "
            f"`decodefs warm {mnt} v1 224`",
        ),
        (
            ("stats", mnt / "v1" / "224"),
            f"{mnt / 'v1' / '224'} is inside the decodefs mount at {mnt}; give the mount point "
            f"itself: `decodefs stats {mnt}`",
        ),
        (
            ("mount", mnt / "v1", "--config", mount.config),
            f"mount point {mnt / 'v1'} is inside the decodefs mount at {mnt}, which is "
            "read-only; mount on a directory outside it",
        ),
        (
            ("mount", other, "--config", mount.config, "--log-file", tmp_path / "other.log"),
            f"is in use by another decodefs daemon (pid {pid}); give each daemon its own store; "
            + stop_it,
        ),
        (
            ("verify", tmp_path / "store", "--remove"),
            "a decodefs daemon is using the store; stop it to remove entries (verify without "
            f"--remove works while it runs); {stop_it}",
        ),
    ]
    for args, message in cases:
        assert_user_error(decodefs(*args), message)
    assert not is_mounted(other)
    # A size out of bounds is ENOENT through the mount, and the daemon's log says why.
    assert errno_of(os.stat, mnt / "v1" / "5000") == errno.ENOENT
    assert "v1/5000: size 5000 is outside min_size..max_size (8..4096): ENOENT" in (
        mount.log_text()
    )
    assert mount.stats()["decodes"] == 0


def test_class_folders_without_the_mirror_layout_are_pointed_to_it(tmp_path: Path) -> None:
    source = tmp_path / "pets"
    for key in ("cat/0001", "dog/0001", "dog/0002"):
        (source / f"{key}.jpg").parent.mkdir(parents=True, exist_ok=True)
        (source / f"{key}.jpg").write_bytes(b"not decoded: the scan refuses first")
    config = write_config(tmp_path / "c.toml", tmp_path / "store", {"pets": source})
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = decodefs("mount", mnt, "--config", config, "--log-file", tmp_path / "log")
    assert_user_error(
        result,
        "versions.pets.source: 1 uuid(s) have more than one original (e.g. '0001': "
        "cat/0001.jpg, dog/0001.jpg); if these are class folders, set versions.pets.layout = "
        "\"mirror\" (keys become paths: 'cat/0001'); else rename them, or set "
        'versions.pets.duplicates = "skip" to leave them all out',
    )
    assert not is_mounted(mnt)


@pytest.mark.parametrize("how", ["kill -9", "fusectl abort"])
def test_warm_and_stats_on_a_dead_daemon_say_it_is_gone(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], tmp_path: Path, how: str
) -> None:
    mount = mounts(
        {"v1": photos_dir},
        expect_errors=("aborted the FUSE connection",) if how == "fusectl abort" else (),
    )
    for uuid in photos:  # the kernel now caches these names and attributes
        mount.path("v1", "224", f"{uuid}.npy").stat()
    if how == "kill -9":
        mount.kill9()
    else:
        abort_fuse_connection(mount.mountpoint)
        assert mount.process is not None
        # Aborted under it, not unmounted: it fails, so systemd restarts it.
        assert mount.process.wait(timeout=30) == 1
    listing = tmp_path / "uuids.txt"
    listing.write_text("\n".join(photos) + "\n")
    gone = (
        f"the decodefs daemon of {mount.mountpoint} is gone (transport endpoint is not connected)"
    )
    for args in [
        ("warm", mount.mountpoint, "v1", "224"),
        ("warm", mount.mountpoint, "v1", "224", "--keys", listing),
        ("stats", mount.mountpoint),
    ]:
        assert_user_error(decodefs(*args), gone, "decodefs mount")


def test_warm_stops_with_one_line_when_the_daemon_dies_under_it(
    mounts: MountFactory, large: list[Path], tmp_path: Path
) -> None:
    originals = tmp_path / "large"
    originals.mkdir()
    for copy in range(4):  # enough decodes that the warm is still running when the daemon dies
        for path in large:
            shutil.copy(path, originals / f"{copy}-{path.name}")
    mount = mounts({"v1": originals}, sizes=[512])
    warm = subprocess.Popen(
        [sys.executable, "-m", "decodefs", "warm", str(mount.mountpoint), "v1", "512", "-j", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: mount.stats()["decodes"] >= 1, timeout=60, what="the warm's decode")
        assert warm.poll() is None, "the warm finished before the daemon could be killed"
        mount.kill9()
        out, err = warm.communicate(timeout=60)
    finally:
        if warm.poll() is None:
            warm.kill()
            warm.communicate()
    result = subprocess.CompletedProcess(warm.args, warm.returncode, out, err)
    assert_user_error(result, f"the decodefs daemon of {mount.mountpoint} is gone", "after ")


@needs_root
@pytest.mark.parametrize("condition", ["read-only", "full"])
def test_a_store_read_only_or_full_at_start_mounts_with_a_warning(
    tmp_path: Path, photos_dir: Path, photos: dict[str, Path], tmpfs: Tmpfs, condition: str
) -> None:
    flash = tmpfs("1m")
    (flash / "store").mkdir()
    if condition == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(flash)], check=True)
    else:
        subprocess.run(["dd", "if=/dev/zero", f"of={flash}/filler", "bs=4k"], capture_output=True)
    config = write_config(tmp_path / "c.toml", flash / "store", {"v1": photos_dir})
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        result = decodefs("mount", mnt, "--config", config, "--log-file", tmp_path / "log")
        assert result.returncode == 0, result.stderr
        reason = "is on a read-only filesystem" if condition == "read-only" else "full filesystem"
        warning = [line for line in result.stderr.splitlines() if "warning" in line]
        assert len(warning) == 1 and warning[0].startswith("decodefs: warning: store "), warning
        assert reason in warning[0] and "served from memory" in warning[0]
        uuid, original = next(iter(photos.items()))
        assert (mnt / "v1" / "64" / f"{uuid}.npy").read_bytes() == reference_npy(original, 64)
        assert reason in (tmp_path / "log").read_text()  # the daemon logs it as well
    finally:
        decodefs("umount", mnt)
        unmount_quietly(mnt)


@needs_root
def test_umount_leaves_other_filesystems_alone(tmpfs: Tmpfs) -> None:
    other = tmpfs("1m")
    (other / "data").write_text("kept\n")
    assert_user_error(
        decodefs("umount", other), f"{other} is not a decodefs mount (it is tmpfs", "alone"
    )
    config = write_config(other.parent / "c.toml", other.parent / "store", {"v1": other})
    assert_user_error(  # nor does it mount over it, or tell the user to `decodefs umount` it
        decodefs("mount", other, "--config", config, "--log-file", other.parent / "log"),
        f"{other} is the mount point of another filesystem (tmpfs from decodefs-test); mount "
        f"decodefs on another directory (or unmount that one yourself: `umount {other}`)",
    )
    assert is_mounted(other) and (other / "data").read_text() == "kept\n"


@needs_root
def test_a_read_only_filesystem_is_named_not_a_traceback(tmp_path: Path, tmpfs: Tmpfs) -> None:
    read_only = tmpfs("1m")
    subprocess.run(["mount", "-o", "remount,ro", str(read_only)], check=True)
    config = write_config(tmp_path / "c.toml", tmp_path / "store", {"v1": tmp_path})
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cases = [
        (
            ("make-sample", read_only / "photos"),
            f"cannot write sample images to {read_only / 'photos'}: Read-only file system",
        ),
        (
            ("mount", mnt, "--config", config, "--log-file", read_only / "logs" / "d.log"),
            f"--log-file {read_only / 'logs' / 'd.log'} cannot be written: Read-only file system",
        ),
    ]
    for args, message in cases:
        assert_user_error(decodefs(*args), message)
    assert not is_mounted(mnt) and os.listdir(read_only) == []


def test_an_s3_l2_without_boto3_names_the_extra_that_installs_it(scene: Scene) -> None:
    """boto3 comes with the `s3` extra only: a light install told to use an S3 L2 says so,
    before anything is mounted (an interpreter where boto3 cannot be imported)."""
    config = scene.write(
        "s3.toml",
        scene.config.read_text().replace("[versions", 'l2 = "s3://bucket/prefix"\n\n[versions', 1),
    )
    program = (
        "import sys; sys.modules['boto3'] = None\n"
        "from decodefs.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program, "mount", str(scene.mnt), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert_user_error(result, f"{config}: l2 = 's3://bucket/prefix' needs boto3", "decodefs[s3]")
    assert not is_mounted(scene.mnt)
