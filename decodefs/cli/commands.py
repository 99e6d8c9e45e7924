"""The `decodefs` command: argument parsing, config loading, logging set-up.

One error model: a user error (bad config, bad file, busy or dead mount
point) is found before anything is mounted or written, and printed as one
line per problem starting ``decodefs: error:`` (exit 1; bad arguments exit 2
through argparse), never as a traceback. Details that follow such a line are
indented. This module checks what the user named; the work itself is done by
the modules below it (daemon, warm, verify, sample).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from ..common.config import DEFAULT_CONFIG_PATH, LOG_LEVELS, Config, ConfigError, load_config
from ..common.protocol import (
    CONFIG_FILE,
    FS_TYPE,
    STATS_FILE,
    STATUS_DIR,
    STORE_MARKER,
)
from ..common.stats_schema import STATS, Stat
from ..common.version import package_version
from ..store import DEFAULT_SAMPLE

__all__ = ["main"]

log = logging.getLogger("decodefs")

EXIT_ERROR = 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.run(args)
        return result
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not _is_user_error(exc):
            raise
        _print_error(exc)
        return EXIT_ERROR


def _print_error(exc: BaseException) -> None:
    """``decodefs: error: <line>`` for every line of a user error (a ConfigError has
    one per problem); indented lines are details of the line above and printed as they are."""
    for line in _error_text(exc).splitlines() or [type(exc).__name__]:
        print(line if line[:1].isspace() else f"decodefs: error: {line}", file=sys.stderr)


def _error_text(exc: BaseException) -> str:
    """A user error's text; for a store another process holds, which one and how to stop it."""
    text = str(exc)
    pid = getattr(exc, "holder_pid", None)
    if isinstance(pid, int) and pid > 0:
        text += _store_holder_hint(pid)
    return text


def _store_holder_hint(pid: int) -> str:
    """What process ``pid`` (holding a store's lock) is: the daemon of which mount point,
    or which command; found without touching any mount that does not answer."""
    from ..common.mounts import daemon_mountpoint

    mountpoint = daemon_mountpoint(pid)
    if mountpoint is not None:
        return f"; it is the daemon of {mountpoint} (stop it: `decodefs umount {mountpoint}`)"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    words = [
        os.path.basename(os.fsdecode(a)) if i == 0 else os.fsdecode(a)
        for i, a in enumerate(argv)
        if a
    ]
    command = " ".join(words)
    return f"; pid {pid} is `{command[:200]}`" if command else ""


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (argparse reports anything else, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="decodefs",
        description="Serve decoded, resized images as .npy files from a verified flash cache.",
    )
    parser.add_argument("--version", action="version", version=f"decodefs {package_version()}")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")

    config_help = f"TOML config (default: $DECODEFS_CONFIG, else {DEFAULT_CONFIG_PATH})"
    default_config = None  # resolved by _config_path, which knows where it came from

    mount = commands.add_parser("mount", help="mount the filesystem (returns once it is live)")
    mount.add_argument(
        "mountpoint", type=Path, nargs="?", help="default: the config's `mountpoint`"
    )
    mount.add_argument("--config", type=Path, default=default_config, help=config_help)
    mount.add_argument(
        "--foreground",
        "-f",
        action="store_true",
        help="stay attached; log to stderr (systemd, tests)",
    )
    mount.add_argument(
        "--log-file",
        type=Path,
        help="where a background daemon logs (default: ~/.local/state/decodefs/<mountpoint>.log)",
    )
    mount.add_argument("--log-level", choices=LOG_LEVELS, help="overrides log_level")
    mount.add_argument(
        "--mkdir", action="store_true", help="create the mount point if it is missing (systemd)"
    )
    mount.add_argument(
        "--nonempty",
        action="store_true",
        help="mount over a directory that has files (they are hidden while mounted)",
    )
    mount.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    mount.set_defaults(run=_mount)

    umount = commands.add_parser("umount", help="unmount and wait for the daemon to exit")
    umount.add_argument(
        "mountpoint", type=Path, nargs="?", help="default: the config's `mountpoint`"
    )
    umount.add_argument("--config", type=Path, default=default_config, help=config_help)
    umount.add_argument(
        "--lazy", "-z", action="store_true", help="detach now even if files are open"
    )
    umount.add_argument(
        "--if-stale",
        action="store_true",
        help="only clear a mount whose daemon is gone; never touch a live one (systemd)",
    )
    umount.set_defaults(run=_umount)

    warm = commands.add_parser(
        "warm",
        help="decode and store a version's arrays ahead of training",
        usage="%(prog)s MOUNTPOINT VERSION SIZE [--uuids FILE] [--jobs N]\n"
        "       %(prog)s --cluster SCHEDULER VERSION SIZE [--uuids FILE] [--config FILE]",
    )
    warm.add_argument(
        "mountpoint", type=Path, nargs="?", help="a live decodefs mount (none with --cluster)"
    )
    warm.add_argument("version")
    warm.add_argument("size", type=_int_at_least(1))
    warm.add_argument("--uuids", type=Path, help="a file of uuids, one a line (default: all)")
    warm.add_argument(
        "--jobs",
        "-j",
        type=_int_at_least(1),
        default=os.cpu_count() or 1,
        help="files in flight (default: cores)",
    )
    # -- decodefs warm --cluster (cluster_warm.py) --
    warm.add_argument(
        "--cluster",
        metavar="SCHEDULER",
        help="fill the config's l2 on the Dask cluster at this scheduler address instead "
        "of a mount (needs decodefs[cluster])",
    )
    warm.add_argument("--config", type=Path, default=default_config, help=config_help)
    warm.set_defaults(run=_warm, parser=warm)

    adopt = commands.add_parser(
        "adopt",
        help="import an existing cache of <version>/<size>/<uu>/<uuid>.npy files into the store",
    )
    adopt.add_argument("cache_dir", type=Path, help="the cache (holding <version>/<size>/<uu>/)")
    adopt.add_argument("version")
    adopt.add_argument("size", type=int)
    adopt.add_argument("--config", type=Path, default=default_config, help=config_help)
    adopt.add_argument(
        "--sample",
        type=_int_at_least(1),
        default=DEFAULT_SAMPLE,
        help="arrays decoded again and compared byte for byte first (default: %(default)s)",
    )
    how = adopt.add_mutually_exclusive_group()
    how.add_argument(
        "--copy",
        action="store_true",
        help="copy every file, leaving the cache as it was (the default)",
    )
    how.add_argument(
        "--move",
        action="store_true",
        help="move files into the store instead of copying them: the cache loses them "
        "(only files that are the store user's alone on the store's filesystem; "
        "the others are copied)",
    )
    adopt.add_argument(
        "--skip-differing",
        action="store_true",
        help="check every array, not a sample, and leave those that differ from a fresh "
        "decode in the cache (as slow as decoding them all)",
    )
    adopt.set_defaults(run=_adopt)

    verify = commands.add_parser("verify", help="check every stored entry offline")
    verify.add_argument(
        "target",
        type=Path,
        help="a config file (checks against the current decode settings) or a store directory",
    )
    verify.add_argument(
        "--remove", action="store_true", help="delete bad entries (no daemon may use the store)"
    )
    verify.set_defaults(run=_verify)

    stats = commands.add_parser("stats", help="print a mounted daemon's counters")
    stats.add_argument("mountpoint", type=Path)
    shown = stats.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help=f"print the raw {STATS_FILE}")
    shown.add_argument(
        "--all", action="store_true", help="print every figure, with its unit and meaning"
    )
    stats.set_defaults(run=_stats)

    sample = commands.add_parser(
        "make-sample",
        help="write a corpus of photo-like sample JPEGs",
        description="Write photo-like sample JPEGs named <uuid>.jpg under DIRECTORY/batch-NN/, "
        "the same for a seed; files already there are kept, so a re-run is quick.",
    )
    sample.add_argument("directory", type=Path, help="where the JPEGs go (created if missing)")
    sample.add_argument(
        "--count", type=_int_at_least(0), default=32, help="how many (default: %(default)s)"
    )
    sample.add_argument(
        "--width", type=_int_at_least(1), default=1600, help="pixels (default: %(default)s)"
    )
    sample.add_argument(
        "--height", type=_int_at_least(1), default=1200, help="pixels (default: %(default)s)"
    )
    sample.add_argument(
        "--seed",
        type=_int_at_least(0),
        default=0,
        help="the same seed makes the same images (default: %(default)s)",
    )
    sample.set_defaults(run=_make_sample)
    return parser


def _load_config(args: argparse.Namespace) -> Config:
    """The config the user named with --config, else $DECODEFS_CONFIG's, else the default.

    A config the user did not name that does not exist is a UsageError saying
    how to name one (sets ``args.config`` to the path used).
    """
    given: Path | None = args.config
    from_env = os.environ.get("DECODEFS_CONFIG")
    args.config = given or Path(from_env or DEFAULT_CONFIG_PATH)
    if given is None and not os.path.lexists(args.config):
        origin = "$DECODEFS_CONFIG names it" if from_env else "the default"
        raise UsageError(
            f"no config file at {args.config} ({origin}); name yours with --config FILE "
            "or $DECODEFS_CONFIG (a minimal one: docs/configuration.md)"
        )
    return load_config(args.config)


def _mount(args: argparse.Namespace) -> int:
    config = _load_config(args)
    mountpoint = _mountpoint(args.mountpoint, config.mountpoint)
    log_file = None
    if not args.foreground:  # the one thing the daemon cannot report: checked first
        log_file = args.log_file or _default_log_file(mountpoint)
        _check_log_file(log_file, "--log-file" if args.log_file else "log file")
    if args.mkdir:
        with contextlib.suppress(OSError):  # a stale mount there is dealt with below
            os.makedirs(mountpoint, exist_ok=True)
    from .. import daemon
    from ..common.mounts import prepare_mountpoint

    if log_file is not None:
        logging.basicConfig(
            level=logging.WARNING, format="decodefs: %(message)s", stream=sys.stderr
        )
        # Fail here, in the user's terminal, before the daemon starts.
        prepare_mountpoint(mountpoint, args.nonempty)
        warning = daemon.store_warning(config)
        if warning is not None:  # the daemon logs it too, but the user is here
            print(f"decodefs: warning: {warning}", file=sys.stderr)
        pid = daemon.spawn(
            args.config.resolve(), mountpoint, log_file, args.log_level, args.nonempty
        )
        print(f"decodefs: mounted {mountpoint} (daemon pid {pid}, log {log_file})")
        print("\n".join(_serving(Path(mountpoint))))
        stats = _read_stats(Path(mountpoint))
        versions = stats.get("versions")
        for name in config.versions:
            served = versions.get(name) if isinstance(versions, dict) else None
            if isinstance(served, dict) and served.get("originals") == 0:
                warning = daemon.empty_version_warning(config, name)
                print(f"decodefs: warning: {warning}", file=sys.stderr)
        return 0

    _setup_logging(args.log_level or config.log_level)
    ready_fd: int | None = args.ready_fd

    def on_ready() -> None:
        nonlocal ready_fd
        if ready_fd is not None:
            os.write(ready_fd, b"ready\n")
            os.close(ready_fd)
            ready_fd = None

    try:
        daemon.serve(config, mountpoint, on_ready, args.nonempty)
    except Exception as exc:
        if ready_fd is not None and _is_user_error(exc):
            os.write(ready_fd, f"error: {_error_text(exc)}".encode())  # the parent prints it
        raise
    return 0


def _umount(args: argparse.Namespace) -> int:
    from ..common.mounts import clear_stale, find_mount, unmount

    configured = None
    if args.mountpoint is None:
        try:
            configured = _load_config(args).mountpoint
        except UsageError:  # umount needs no config when it is given a mount point
            points = _decodefs_mounts()
            example = points[0] if len(points) == 1 else "MOUNTPOINT"
            raise UsageError(
                f"no mount point: give one, `decodefs umount {example}`"
                f"{_mounted_at(points)}; without one, umount takes `mountpoint` from the "
                f"config, and there is no config file at {args.config} "
                "(--config FILE or $DECODEFS_CONFIG names one)"
            ) from None
    mountpoint = _mountpoint(args.mountpoint, configured)
    info = find_mount(mountpoint)
    if info is not None and info.fstype != FS_TYPE and not args.if_stale:
        raise UsageError(
            f"{mountpoint} is not a decodefs mount (it is {info.fstype} from {info.source}); "
            "decodefs leaves it alone"
        )
    if args.if_stale:
        logging.basicConfig(level=logging.INFO, format="decodefs: %(message)s", stream=sys.stderr)
        clear_stale(mountpoint)
    else:
        unmount(mountpoint, lazy=args.lazy)
    return 0


def _warm(args: argparse.Namespace) -> int:
    from ..client import warm

    if args.cluster is not None:
        if args.mountpoint is not None:
            args.parser.error("--cluster takes no MOUNTPOINT: its workers publish to L2 directly")
        return _warm_cluster(args)
    if args.mountpoint is None:
        args.parser.error("the following arguments are required: mountpoint (or --cluster)")
    uuids = _read_uuids(args.uuids) if args.uuids else None
    directory = _version_size_dir(
        _live_mount(args.mountpoint, f"warm {{}} {args.version} {args.size}"),
        args.version,
        args.size,
    )
    before = _read_stats(args.mountpoint)
    try:
        report = warm(
            directory,
            uuids,
            args.jobs,
            progress=sys.stderr.isatty(),
            refusals=lambda: _counter(_read_stats(args.mountpoint), "warm_not_stored"),
        )
    except OSError as exc:  # listing the size directory
        raise _mount_failure(args.mountpoint, exc) from None
    if report.daemon_gone:
        progress = f"after {report.done:,} of {report.total:,} arrays"
        raise _daemon_gone(args.mountpoint, report.daemon_gone, progress)
    after = _read_stats(args.mountpoint)
    decoded = _counter(after, "decodes") - _counter(before, "decodes")
    rate = report.done / report.seconds if report.seconds else 0.0
    what = f"{args.version}/{args.size}"
    print(
        f"decodefs: warmed {report.done:,} of {report.total:,} arrays of {what} "
        f"in {report.seconds:.1f} s ({rate:,.1f}/s); the daemon decoded {decoded:,} meanwhile"
    )
    for uuid, reason in sorted(report.failed.items())[:20]:
        print(f"decodefs: failed: {uuid}: {reason} (the daemon log says why)", file=sys.stderr)
    if report.missing:
        print(
            f"decodefs: error: {len(report.missing):,} uuids of {args.uuids} are not "
            f"originals of {args.version}, e.g. {report.missing[0]!r} (`decodefs.list_keys` "
            f"or `ls {directory}` lists those it has)",
            file=sys.stderr,
        )
    if report.store_full:
        print(
            f"decodefs: the store takes no more ({report.store_full}); warming stopped "
            "(a warm never evicts what training uses)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return _exit_status(report.interrupted, failed=bool(report.failed or report.missing))


def _warm_cluster(args: argparse.Namespace) -> int:
    """`decodefs warm --cluster`: Dask workers decode and publish to the config's L2."""
    config = _load_config(args)
    if config.l2 is None:
        raise UsageError(f"{args.config}: no l2 to warm (--cluster fills the cluster's L2)")
    if args.version not in config.versions:
        names = ", ".join(sorted(config.versions))
        raise UsageError(f"{args.config} has no version {args.version!r} (it has: {names})")
    if not config.min_size <= args.size <= config.max_size:
        raise UsageError(
            f"size {args.size} is outside min_size..max_size "
            f"({config.min_size}..{config.max_size}) of {args.config}"
        )
    uuids = _read_uuids(args.uuids) if args.uuids else None
    try:
        from ..cluster import SchedulerUnreachable, cluster_warm
    except ImportError as exc:
        raise UsageError(
            f"--cluster needs Dask: the cluster extra, pip install -e '.[cluster]' in decodefs's "
            f"clone ({exc})"
        ) from None
    try:
        report = cluster_warm(
            args.cluster, config, args.version, args.size, uuids, progress=sys.stderr.isatty()
        )
    except SchedulerUnreachable as exc:
        raise UsageError(str(exc)) from None
    rate = report.done / report.seconds if report.seconds else 0.0
    print(
        f"decodefs: warmed {report.done:,} of {report.total:,} arrays of "
        f"{args.version}/{args.size} into {config.l2.url} on {report.workers} workers "
        f"in {report.seconds:.1f} s ({rate:,.1f}/s): {report.decoded:,} decoded, "
        f"{report.skipped:,} already there"
    )
    for uuid, reason in sorted(report.failed.items())[:20]:
        print(f"decodefs: failed: {uuid}: {reason}", file=sys.stderr)
    if len(report.failed) > 20:
        print(f"decodefs: ... and {len(report.failed) - 20:,} more failed", file=sys.stderr)
    if report.missing:
        print(
            f"decodefs: {len(report.missing):,} uuids are not in {args.version}, "
            f"e.g. {report.missing[0]!r}",
            file=sys.stderr,
        )
    return _exit_status(report.interrupted, failed=bool(report.failed or report.missing))


def _adopt(args: argparse.Namespace) -> int:
    from ..store import adopt

    config = _load_config(args)
    stop = threading.Event()

    def stop_after_this_entry(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: stop now (every write is atomic)
        stop.set()

    previous = signal.signal(signal.SIGINT, stop_after_this_entry)
    try:
        report = adopt(
            config,
            args.version,
            args.size,
            args.cache_dir,
            sample=args.sample,
            move=args.move,
            skip_differing=args.skip_differing,
            progress=sys.stderr.isatty(),
            stop=stop,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    what = f"{args.version}/{args.size}"
    rate = report.adopted / report.seconds if report.seconds else 0.0
    if report.sampled:
        checked = "checked" if args.skip_differing else "sample"
        print(
            f"decodefs: {checked}: {report.sampled:,} arrays decoded again, "
            "each equal byte for byte to the cache's"
        )
    print(
        f"decodefs: adopted {report.adopted:,} arrays of {what} in {report.seconds:.1f} s "
        f"({rate:,.1f}/s): {report.copied:,} copied (the cache keeps them), "
        f"{report.moved:,} moved into the store; {report.already_stored:,} were stored already"
    )
    left = [
        (report.unknown, "with no original in the version", "unknown"),
        (report.bad, "not a stored array's .npy", "bad"),
        (report.undecodable, "whose original cannot be decoded", "undecodable"),
        (report.differing, "that differ from a fresh decode", "differing"),
    ]
    for count, why, kind in left:
        if count:
            print(
                f"decodefs: left in the cache: {count:,} {why} (e.g. {report.examples[kind]})",
                file=sys.stderr,
            )
    return _exit_status(report.interrupted, failed=False)


def _verify(args: argparse.Namespace) -> int:
    from ..store import recorded_digests, verify_store

    if args.target.is_dir():
        root = args.target
        _require_store(root)
        digests = recorded_digests(root)
    else:
        config = load_config(args.target)
        root = config.store
        _require_store(root, f"the store of {args.target}")
        digests = {n: v.fingerprint().digest for n, v in config.versions.items()}
    report = verify_store(root, digests, remove=args.remove, progress=sys.stderr.isatty())
    for path, reason in sorted(report.bad.items())[:50]:
        print(f"{path}: {reason}")
    if len(report.bad) > 50:
        print(f"... and {len(report.bad) - 50:,} more")
    action = f", {report.removed:,} removed" if args.remove else ""
    versions = ", ".join(sorted(digests)) or "no version"
    corrupt = len(report.bad) - report.stale
    print(
        f"decodefs: checked {report.checked:,} entries of {versions}: "
        f"{report.ok:,} ok, {corrupt:,} corrupt, {report.stale:,} stale{action}"
    )
    return EXIT_ERROR if len(report.bad) > report.removed else 0


def _exit_status(interrupted: bool, failed: bool) -> int:
    """A long command's exit status: 130 if interrupted (saying how to resume), else 1
    if some of its work failed, else 0."""
    if interrupted:
        print("decodefs: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    return EXIT_ERROR if failed else 0


class UsageError(Exception):
    """A command-line mistake the user can fix (printed as one line)."""


def _require_store(root: Path, what: str = "") -> None:
    """A UsageError unless ``root`` is a store a daemon has used (it has the format marker)."""
    name = f"{what} ({root})" if what else str(root)
    if not root.exists():
        raise UsageError(f"{name} does not exist (no daemon has used it yet)")
    if not root.is_dir():
        raise UsageError(f"{name} is not a directory")
    if not (root / STORE_MARKER).is_file():
        raise UsageError(f"{name} is not a decodefs store (it has no {STORE_MARKER} file)")


def _mountpoint(given: Path | None, configured: Path | None) -> str:
    if given is None and configured is None:
        raise UsageError(
            "no mount point: give one, or set `mountpoint` in the config"
            f"{_mounted_at(_decodefs_mounts())}"
        )
    return os.path.abspath(given if given is not None else configured)  # type: ignore[arg-type]


def _decodefs_mounts() -> list[str]:
    """Where decodefs is mounted now (for a user who gave no mount point)."""
    from ..common.mounts import mounts

    return [m.mountpoint for m in mounts() if m.fstype == FS_TYPE]


def _mounted_at(points: list[str]) -> str:
    return f" (decodefs is mounted at {', '.join(points)})" if points else ""


def _check_log_file(path: Path, what: str) -> None:
    """The daemon will be able to create or append to its log; checked without writing."""
    if path.is_dir():
        raise UsageError(f"{what} {path} cannot be written: Is a directory")
    existing = path if path.exists() else path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # the directories below it are created
    if existing != path and not existing.is_dir():
        raise UsageError(f"{what} {path} cannot be written: Not a directory ({existing})")
    needs = os.W_OK if existing == path else os.W_OK | os.X_OK
    if not os.access(existing, needs, effective_ids=os.access in os.supports_effective_ids):
        reason = "Read-only file system" if _read_only(existing) else "Permission denied"
        where = "" if existing == path else f" ({existing})"
        raise UsageError(f"{what} {path} cannot be written: {reason}{where}")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _read_uuids(path: Path) -> list[str]:
    from ..client import read_uuid_list

    try:
        return read_uuid_list(path)
    except IsADirectoryError:
        raise UsageError(f"--uuids {path}: is a directory, not a file of uuids") from None
    except OSError as exc:
        raise UsageError(f"--uuids {path}: cannot read it: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"--uuids {path}: byte {exc.start} is not UTF-8 text") from None
    except ValueError as exc:
        raise UsageError(f"--uuids {path}: {exc}") from None


def _live_mount(path: Path, command: str) -> Path:
    """``path`` if a live decodefs daemon serves it; else a UsageError that says what it is
    (``command``, e.g. "stats {}", is how to run it on the mount point: for a path inside one)."""
    from ..common.mounts import PROBE_TIMEOUT, decodefs_mount_above, find_mount, probe

    real = os.path.realpath(path)  # the mount table holds real paths
    info = find_mount(real)
    if info is None:
        above = decodefs_mount_above(real)
        if above is not None:
            raise UsageError(
                f"{path} is inside the decodefs mount at {above}; give the mount point "
                f"itself: `decodefs {command.replace('{}', str(above), 1)}`"
            )
        raise UsageError(f"{path} is not a decodefs mount (nothing is mounted there)")
    if info.fstype != FS_TYPE:
        raise UsageError(f"{path} is not a decodefs mount (it is {info.fstype})")
    try:
        state = probe(real)
    except OSError as exc:
        raise _mount_failure(path, exc) from None
    if state == "stale":
        raise _daemon_gone(path, "transport endpoint is not connected")
    if state == "hung":
        raise UsageError(
            f"the decodefs daemon of {path} does not answer (waited {PROBE_TIMEOUT:.0f} s); "
            "`kill -USR1` its pid to log where it is stuck"
        )
    return path


_GONE: Final = frozenset({errno.ENOTCONN, errno.ECONNABORTED})


def _daemon_gone(mountpoint: Path, reason: str, progress: str = "") -> UsageError:
    return UsageError(
        f"the decodefs daemon of {mountpoint} is gone ({reason.lower()})"
        f"{' ' + progress if progress else ''}; "
        "run `decodefs mount` again (it clears the dead mount)"
    )


def _mount_failure(mountpoint: Path, exc: OSError) -> UsageError:
    if exc.errno in _GONE:
        return _daemon_gone(mountpoint, exc.strerror or str(exc))
    return UsageError(f"cannot read {exc.filename or mountpoint}: {exc.strerror or exc}")


def _version_size_dir(mountpoint: Path, version: str, size: int) -> Path:
    """``<mountpoint>/<version>/<size>``, or a UsageError naming what the mount lacks."""
    try:
        versions = sorted(n for n in os.listdir(mountpoint) if not n.startswith("."))
    except OSError as exc:
        raise _mount_failure(mountpoint, exc) from None
    if version not in versions:
        raise UsageError(
            f"{mountpoint} has no version {version!r} (it has: {', '.join(versions) or 'none'})"
        )
    directory = mountpoint / version / str(size)
    try:
        os.stat(directory)
    except FileNotFoundError:
        bounds = _read_status(mountpoint, CONFIG_FILE)
        low, high = bounds.get("min_size"), bounds.get("max_size")
        served = f" (it serves sizes {low} to {high})" if low and high else ""
        raise UsageError(f"{mountpoint} serves no size {size} of {version}{served}") from None
    except OSError as exc:
        raise _mount_failure(mountpoint, exc) from None
    return directory


def _serving(mountpoint: Path) -> list[str]:
    """What a live mount serves, one line per version and one for the store (its
    status files; nothing is listed but the first entry of a uuid size directory)."""
    stats, config = _read_stats(mountpoint), _read_status(mountpoint, CONFIG_FILE)
    served = stats.get("versions")
    configured = config.get("versions")
    if not isinstance(served, dict) or not isinstance(configured, dict):
        return []
    width = max((len(name) for name in served), default=0)
    lines = []
    for name, figures in served.items():
        settings = configured.get(name)
        if not isinstance(figures, dict) or not isinstance(settings, dict):
            continue
        sizes = settings.get("sizes") or []
        size = str(sizes[0]) if sizes else "<size>"
        directory = mountpoint / name / size
        if figures.get("layout") == "mirror":
            where = f"{directory}/<folder>/<name>.npy (mirror layout)"
        else:
            first = _first_entry(directory) if figures.get("originals") else None
            where = f"{directory}/<uuid>.npy (uuid layout{f', e.g. {first}' if first else ''})"
        left_out = figures.get("duplicates_left_out")
        skipped = f" ({left_out:,} duplicate names left out)" if left_out else ""
        lines.append(
            f"  {name:<{width}}  {figures.get('originals', 0):,} originals{skipped} from "
            f"{settings.get('source')}, sizes {', '.join(map(str, sizes))}: {where}"
        )
    limit = _counter(stats, "store_max_bytes")
    lines.append(
        f"  store {config.get('store')}: {_human_bytes(_counter(stats, 'store_bytes'))} in "
        f"{_counter(stats, 'store_entries'):,} arrays"
        + (f" (limit {_human_bytes(limit)})" if limit else "")
        + ("" if stats.get("store_writable", True) else ", NOT WRITABLE")
    )
    return lines


def _first_entry(directory: Path) -> str | None:
    """The first name a size directory lists (one READDIR), for an example path."""
    try:
        with os.scandir(directory) as entries:
            first = next(entries, None)
    except OSError:
        return None
    return None if first is None else first.name


def _read_stats(mountpoint: Path) -> dict[str, object]:
    return _read_status(mountpoint, STATS_FILE)


def _read_status(mountpoint: Path, name: str) -> dict[str, object]:
    try:
        data = json.loads((mountpoint / STATUS_DIR / name).read_bytes())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _counter(stats: dict[str, object], key: str) -> int:
    """An integer of a stats.json snapshot; 0 if absent (an older daemon) or not one."""
    value = stats.get(key, 0)
    return value if isinstance(value, int) else 0


def _stats(args: argparse.Namespace) -> int:
    path = _live_mount(args.mountpoint, "stats {}") / STATUS_DIR / STATS_FILE
    try:
        raw = path.read_bytes()
        stats = json.loads(raw)
    except OSError as exc:
        raise _mount_failure(args.mountpoint, exc) from None
    except ValueError as exc:
        raise UsageError(f"{path} is not JSON ({exc}); is this decodefs?") from None
    if args.json:
        sys.stdout.write(raw.decode())
        return 0
    stats = stats if isinstance(stats, dict) else {}
    print(format_all_stats(stats) if args.all else format_stats(stats))
    return 0


_STAT_NAMES: Final = frozenset(stat.name for stat in STATS)


def format_stats(stats: dict[str, object]) -> str:
    """The human table printed by `decodefs stats`: every counter a user acts on."""

    def n(key: str) -> int:
        assert key in _STAT_NAMES, key  # every figure shown is one of protocol.STATS
        return _counter(stats, key)

    reads = n("hits") + n("direct_hits") + n("misses")
    latency = stats.get("decode_seconds")
    decode_count = latency.get("count", 0) if isinstance(latency, dict) else 0
    decode_sum = latency.get("sum", 0.0) if isinstance(latency, dict) else 0.0
    mean_ms = f"{1000 * decode_sum / decode_count:.0f} ms" if decode_count else "-"
    rows = [
        ("hits", f"{n('hits'):,} through the mount"),
        ("direct hits", f"{n('direct_hits'):,} read straight from the store by read_array"),
        ("misses", f"{n('misses'):,} ({n('coalesced'):,} joined a decode already running)"),
        (
            "hit ratio",
            f"{100 * (n('hits') + n('direct_hits')) / reads:.1f}%" if reads else "-",
        ),
        (
            "decodes",
            f"{n('decodes'):,} (mean {mean_ms}); {n('warm_decodes'):,} for warm requests, "
            f"{n('background_decodes'):,} by the background warm",
        ),
        ("decode errors", f"{n('decode_errors'):,} (originals that failed: the log names them)"),
        ("corrupt entries rebuilt", f"{n('corrupt_entries'):,}"),
        (
            "store",
            f"{_human_bytes(n('store_bytes'))} in {n('store_entries'):,} entries"
            + (f" of {_human_bytes(n('store_max_bytes'))}" if n("store_max_bytes") else "")
            + ("" if stats.get("store_usage_complete", True) else " (still counting)")
            + ("" if stats.get("store_writable", True) else ", NOT WRITABLE"),
        ),
        ("evictions", f"{n('evictions'):,}"),
        ("warm not stored", f"{n('warm_not_stored'):,} (the store would not take them)"),
        (
            "memory fallbacks",
            f"{n('memory_fallbacks'):,} ({n('store_write_errors'):,} store write errors; "
            f"{_human_bytes(n('memory_cache_bytes'))} held)",
        ),
        (
            "memory waits",
            f"{n('memory_waits'):,} (memory_cache_bytes), "
            f"{n('decode_memory_waits'):,} (decode_memory_bytes)",
        ),
        ("bytes served", _human_bytes(n("bytes_served"))),
        ("decodes in flight", f"{n('inflight_decodes'):,} ({n('queued_decodes'):,} queued)"),
    ]
    errors = stats.get("errors")
    counts = sorted(errors.items()) if isinstance(errors, dict) else []
    rows.append(("errors", ", ".join(f"{k} {v:,}" for k, v in counts) or "none"))
    versions = stats.get("versions")
    if isinstance(versions, dict):
        for name, figures in sorted(versions.items()):
            if isinstance(figures, dict):
                left = figures.get("duplicates_left_out")
                rows.append(
                    (
                        f"version {name}",
                        f"{figures.get('originals', 0):,} originals ({figures.get('layout')} "
                        "layout)" + (f", {left:,} duplicate names left out" if left else ""),
                    )
                )
    if "l2" in stats:  # the cluster's L2 (cluster.py)
        rows.append(
            (
                "L2",
                f"{stats['l2']} ({stats.get('l2_state')}): {n('l2_hits'):,} hits, "
                f"{n('l2_misses'):,} misses, {n('l2_publishes'):,} published, "
                f"{n('l2_lease_waits'):,} lease waits, {n('l2_corrupt'):,} corrupt",
            )
        )
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def format_all_stats(stats: dict[str, object]) -> str:
    """`decodefs stats --all`: every figure of protocol.STATS the daemon reported, one a
    line: its name, its value with its unit, and what it means."""
    rows = [
        (stat.name, _figure_text(stat, stats[stat.name]), stat.help)
        for stat in STATS
        if stat.name in stats
    ]
    name_width = max((len(name) for name, _, _ in rows), default=0)
    value_width = max((len(value) for _, value, _ in rows), default=0)
    return "\n".join(
        f"{name:<{name_width}}  {value:<{value_width}}  {meaning}" for name, value, meaning in rows
    )


def _figure_text(stat: Stat, value: object) -> str:
    """One figure as `decodefs stats --all` shows it."""
    if value is None:
        return "none"
    if stat.kind == "flag":
        return "yes" if value else "no"
    if stat.kind == "counter by kind":
        counts = sorted(value.items()) if isinstance(value, dict) else []
        return ", ".join(f"{kind} {count:,}" for kind, count in counts) or "none"
    if stat.kind == "histogram":
        figures = value if isinstance(value, dict) else {}
        count, total = figures.get("count", 0), figures.get("sum", 0.0)
        return f"{count:,} (mean {1000 * total / count:.0f} ms)" if count else "0"
    if stat.kind == "per version":
        versions = sorted(value.items()) if isinstance(value, dict) else []
        return ", ".join(
            f"{name}: {figures.get('originals', 0):,} originals ({figures.get('layout')})"
            for name, figures in versions
            if isinstance(figures, dict)
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if stat.unit == "bytes":
        return f"{value:,} bytes ({_human_bytes(int(value))})"
    if stat.unit == "seconds":
        return f"{value:,.1f} s"
    return f"{value:,} {stat.unit}".rstrip()


def _make_sample(args: argparse.Namespace) -> int:
    from ..sample import make_sample_corpus

    directory: Path = args.directory
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"{directory} is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        paths = make_sample_corpus(directory, args.count, args.width, args.height, args.seed)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and exc.filename != str(directory) else ""
        raise UsageError(
            f"cannot write sample images to {directory}: {exc.strerror}{where}"
        ) from None
    print(
        f"decodefs: {len(paths)} sample JPEGs ({args.width}x{args.height}) under {args.directory}"
    )
    return 0


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _default_log_file(mountpoint: str) -> Path:
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", mountpoint.strip("/")) or "root"
    return state / "decodefs" / f"{name}.log"


def _human_bytes(value: int) -> str:
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if amount < 1024 or unit == "TiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    raise AssertionError("unreachable")


def _is_user_error(exc: BaseException) -> bool:
    # Imported late: the daemon pulls in pyfuse3, which `stats` does not need.
    from ..common.mounts import MountError
    from ..common.source import SourceError
    from ..store import AdoptError, StoreBusy, StoreError

    return isinstance(
        exc,
        AdoptError | ConfigError | MountError | SourceError | StoreError | UsageError | StoreBusy,
    )
