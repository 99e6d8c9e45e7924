"""The command bodies, one function per command: each checks what the user named
(checks.py), has one module below do the work, and reports it. Only ``run_mount``
loads the daemon; nothing here parses arguments or knows how a status is worded.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from ..client import failed_originals, iter_key_list, warm
from ..common.advice import discarded_warning, empty_version_warning, store_warning
from ..common.config import Config, load_config
from ..common.mounts import MountError, clear_stale, find_mount, prepare_mountpoint, unmount
from ..common.protocol import CONFIG_FILE, FS_TYPE, STATS_FILE, STATUS_DIR
from ..common.status import holder_figures, parse_status, read_status_bytes
from ..holder import ControlError, HolderUnreachable, ask_holder, mount_problem
from ..store import adopt, recorded_digests, verify_store
from .checks import (
    check_l2_client,
    check_log_file,
    count_keys,
    daemon_gone,
    decodefs_mounts,
    default_log_file,
    live_mount,
    mount_failure,
    mounted_at,
    mounted_version,
    named_config,
    named_mountpoint,
    read_keys,
    require_store,
    version_size_dir,
)
from .errors import EXIT_ERROR, UsageError, error_text, exit_status, is_user_error
from .spawn import holder_command, spawn
from .status import (
    counter,
    failed_summary,
    format_all_stats,
    format_stats,
    l2_problem,
    read_stats,
    read_status,
    serving,
)

__all__ = [
    "run_adopt",
    "run_failed",
    "run_make_sample",
    "run_mount",
    "run_stats",
    "run_switch",
    "run_umount",
    "run_verify",
    "run_warm",
]


def run_mount(args: argparse.Namespace) -> int:
    """`decodefs mount`: checks what it can in the user's terminal, then becomes the mount's
    holder (--foreground) or starts one and returns once the mount is live."""
    config = named_config(args)
    check_l2_client(config)
    mountpoint = named_mountpoint(args.mountpoint, config.mountpoint)
    log_file = None
    if not args.foreground:  # the one thing the daemon cannot report: checked first
        log_file = args.log_file or default_log_file(mountpoint)
        check_log_file(log_file, "--log-file" if args.log_file else "log file")
    if args.mkdir:
        with contextlib.suppress(OSError):  # a stale mount there is dealt with below
            os.makedirs(mountpoint, exist_ok=True)
    logging.basicConfig(level=logging.WARNING, format="decodefs: %(message)s", stream=sys.stderr)
    ready = _Ready(args.ready_fd)
    with ready.reporting():  # every mistake said here, before anything is mounted
        prepare_mountpoint(mountpoint, args.nonempty)
        problem = mount_problem(config.access)
        if problem is not None:
            raise MountError(f"cannot mount {mountpoint}: {problem}")
    if log_file is None:
        _become_holder(args, config, mountpoint)
    warning = store_warning(config)
    if warning is not None:  # the daemon logs it too, but the user is here
        print(f"decodefs: warning: {warning}", file=sys.stderr)
    config_path = args.config.resolve()
    pid = spawn(
        mountpoint,
        log_file,
        lambda ready_fd: holder_command(
            mountpoint, config_path, config.log_level, config.access, args.log_level, ready_fd
        ),
    )
    print(f"decodefs: mounted {mountpoint} (daemon pid {pid}, log {log_file})")
    print("\n".join(serving(Path(mountpoint))))
    stats = read_stats(Path(mountpoint))
    versions = stats.get("versions")
    for name in config.versions:
        served = versions.get(name) if isinstance(versions, dict) else None
        if isinstance(served, dict) and served.get("originals") == 0:
            warning = empty_version_warning(config, name)
            print(f"decodefs: warning: {warning}", file=sys.stderr)
        discarded = served.get("discarded") if isinstance(served, dict) else None
        if isinstance(discarded, dict):
            print(f"decodefs: warning: {discarded_warning(name, discarded)}", file=sys.stderr)
    if config.l2 is not None:
        problem = l2_problem(Path(mountpoint), config.l2.timeout_seconds)
        if problem is not None:
            print(f"decodefs: warning: {problem}", file=sys.stderr)
    return 0


def _become_holder(args: argparse.Namespace, config: Config, mountpoint: str) -> NoReturn:
    """Replace this process with the mount's holder (same pid: systemd's main process,
    a caller's child), so that it keeps none of the command's imports."""
    command = holder_command(
        mountpoint, args.config.resolve(), config.log_level, config.access, args.log_level,
        args.ready_fd,
    )  # fmt: skip
    sys.stdout.flush()
    sys.stderr.flush()
    os.chdir("/")  # the holder holds none of the user's directories
    try:
        os.execv(sys.executable, command)
    except OSError as exc:
        raise MountError(
            f"cannot start the mount's holder ({sys.executable}: {exc.strerror}); this user "
            "must be able to run the Python that runs decodefs"
        ) from None


def run_switch(args: argparse.Namespace) -> int:
    """`decodefs reload` and `decodefs restart`: a new serving process takes the mount over."""
    command = args.switch
    mountpoint = named_mountpoint(args.mountpoint, _configured_mountpoint(args))
    info = find_mount(mountpoint)
    if info is None or info.fstype != FS_TYPE:
        raise UsageError(f"{mountpoint} is not a decodefs mount{mounted_at(decodefs_mounts())}")
    config_path = _holder_config(mountpoint)
    if config_path is not None:  # a config that does not load is refused here, in one line
        load_config(Path(config_path))
    try:
        answer = ask_holder(mountpoint, command)
    except HolderUnreachable as exc:
        raise UsageError(
            f"{mountpoint} has no holder to {command} it ({exc}); is it a decodefs mount? "
            "(`decodefs stats` says)"
        ) from None
    except ControlError as exc:
        raise UsageError(f"{command} of {mountpoint} failed: {exc}; the serving process "
                         "before it keeps serving") from None  # fmt: skip
    server = answer.get("server") or {}
    print(f"decodefs: {command}ed {mountpoint}: serving process {server.get('pid')} "
          f"(decodefs {server.get('version')})")  # fmt: skip
    for line in answer.get("changes") or ["nothing else changed"]:
        print(f"  {line}")
    return 0


def _configured_mountpoint(args: argparse.Namespace) -> Path | None:
    if args.mountpoint is not None:
        return None
    return named_config(args).mountpoint


def _holder_config(mountpoint: str) -> str | None:
    """The config file the mount's holder gives its serving processes."""
    try:
        status = ask_holder(mountpoint, "status", timeout=10.0)
    except (HolderUnreachable, ControlError):
        return None
    path = status.get("holder", {}).get("config")
    return path if isinstance(path, str) else None


class _Ready:
    """The pipe a spawning parent waits on (--ready-fd): "ready" once the mount is
    live, or the user error that stopped it, for the parent to print."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            if self._fd is not None and is_user_error(exc):
                os.write(self._fd, f"error: {error_text(exc)}".encode())  # the parent prints it
            raise


def run_umount(args: argparse.Namespace) -> int:
    """`decodefs umount`: unmounts and waits for the daemon; --if-stale clears only a dead mount."""
    configured = None
    if args.mountpoint is None:
        try:
            configured = named_config(args).mountpoint
        except UsageError:  # umount needs no config when it is given a mount point
            points = decodefs_mounts()
            example = points[0] if len(points) == 1 else "MOUNTPOINT"
            raise UsageError(
                f"no mount point: give one, `decodefs umount {example}`"
                f"{mounted_at(points)}; without one, umount takes `mountpoint` from the "
                f"config, and there is no config file at {args.config} "
                "(--config FILE or $DECODEFS_CONFIG names one)"
            ) from None
    mountpoint = named_mountpoint(args.mountpoint, configured)
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


def run_warm(args: argparse.Namespace) -> int:
    """`decodefs warm`: reads a version's arrays through a live mount so the daemon stores them."""
    if args.cluster is not None:
        if args.mountpoint is not None:
            args.parser.error("--cluster takes no MOUNTPOINT: its workers publish to L2 directly")
        return _warm_cluster(args)
    if args.mountpoint is None:
        args.parser.error("the following arguments are required: mountpoint (or --cluster)")
    count = count_keys(args.keys) if args.keys else None  # every line checked first
    directory = version_size_dir(
        live_mount(args.mountpoint, f"warm {{}} {args.version} {args.size}"),
        args.version,
        args.size,
    )
    _refuse_unstored_size(args.mountpoint, args.version, args.size)
    before = read_stats(args.mountpoint)
    if count is None:
        versions = before.get("versions")
        served = versions.get(args.version) if isinstance(versions, dict) else None
        originals = served.get("originals") if isinstance(served, dict) else None
        count = originals if isinstance(originals, int) else None
    try:
        report = warm(
            directory,
            iter_key_list(args.keys) if args.keys else None,
            args.jobs,
            progress=sys.stderr.isatty(),
            refusals=lambda: counter(read_stats(args.mountpoint), "warm_not_stored"),
            total=count,
        )
    except OSError as exc:  # listing the size directory, or reading --keys again
        raise mount_failure(args.mountpoint, exc) from None
    except ValueError as exc:  # --keys changed since it was checked
        raise UsageError(f"--keys {args.keys}: {exc}") from None
    if report.daemon_gone:
        of = f" of {report.total:,}" if report.total is not None else ""
        raise daemon_gone(args.mountpoint, report.daemon_gone, f"after {report.done:,}{of} arrays")
    after = read_stats(args.mountpoint)
    decoded = counter(after, "decodes") - counter(before, "decodes")
    rate = report.done / report.seconds if report.seconds else 0.0
    what = f"{args.version}/{args.size}"
    print(
        f"decodefs: warmed {report.done:,} of {report.total or report.seen:,} arrays of {what} "
        f"in {report.seconds:.1f} s ({rate:,.1f}/s); the daemon decoded {decoded:,} meanwhile"
    )
    log = after.get("log") or "the daemon's log"  # where it goes, as the daemon says
    for key, reason in sorted(report.failed.items())[:20]:
        print(f"decodefs: failed: {key}: {reason} ({log} says why)", file=sys.stderr)
    if report.failed_count > 20:
        print(
            f"decodefs: ... and {report.failed_count - 20:,} more failed (`decodefs failed "
            f"{args.mountpoint} {args.version}` lists every one, with its reason)",
            file=sys.stderr,
        )
    if report.missing_count:
        print(
            f"decodefs: error: {report.missing_count:,} keys of {args.keys} are not "
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
    return exit_status(report.interrupted, failed=bool(report.failed_count or report.missing_count))


def _refuse_unstored_size(mountpoint: Path, version: str, size: int) -> None:
    """A warm of a size the daemon will not store (unlisted, ``unlisted_sizes = "memory"``)
    would decode every original and keep none: a UsageError saying how to store it."""
    config = read_status(mountpoint, CONFIG_FILE)
    versions, unlisted = config.get("versions"), config.get("unlisted_sizes")
    settings = versions.get(version) if isinstance(versions, dict) else None
    sizes = settings.get("sizes") if isinstance(settings, dict) else None
    if not isinstance(sizes, list) or size in sizes or unlisted != "memory":
        return  # listed, stored anyway, or a daemon that does not say
    raise UsageError(
        f"size {size} is not one of {version}'s sizes ({', '.join(map(str, sizes))}), and "
        f'the daemon stores no unlisted size (unlisted_sizes = "memory"): a warm would '
        f"store nothing; add {size} to versions.{version}.sizes in its config and mount again"
    )


def _warm_cluster(args: argparse.Namespace) -> int:
    """`decodefs warm --cluster`: Dask workers decode and publish to the config's L2."""
    config = named_config(args)
    if config.l2 is None:
        raise UsageError(f"{args.config}: no l2 to warm (--cluster fills the cluster's L2)")
    check_l2_client(config)
    if args.version not in config.versions:
        names = ", ".join(sorted(config.versions))
        raise UsageError(f"{args.config} has no version {args.version!r} (it has: {names})")
    if not config.min_size <= args.size <= config.max_size:
        raise UsageError(
            f"size {args.size} is outside min_size..max_size "
            f"({config.min_size}..{config.max_size}) of {args.config}"
        )
    keys = read_keys(args.keys) if args.keys else None
    try:
        from ..cluster import SchedulerUnreachable, cluster_warm
    except ImportError as exc:
        raise UsageError(
            f"--cluster needs Dask: the cluster extra, pip install -e '.[cluster]' in decodefs's "
            f"clone ({exc})"
        ) from None
    try:
        report = cluster_warm(
            args.cluster, config, args.version, args.size, keys, progress=sys.stderr.isatty()
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
    for key, reason in sorted(report.failed.items())[:20]:
        print(f"decodefs: failed: {key}: {reason}", file=sys.stderr)
    if len(report.failed) > 20:
        print(f"decodefs: ... and {len(report.failed) - 20:,} more failed", file=sys.stderr)
    if report.missing:
        print(
            f"decodefs: {len(report.missing):,} keys are not in {args.version}, "
            f"e.g. {report.missing[0]!r}",
            file=sys.stderr,
        )
    return exit_status(report.interrupted, failed=bool(report.failed or report.missing))


def run_adopt(args: argparse.Namespace) -> int:
    """`decodefs adopt`: imports an existing cache into the store (Ctrl-C stops after an entry)."""
    config = named_config(args)
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
    return exit_status(report.interrupted, failed=False)


def run_verify(args: argparse.Namespace) -> int:
    """`decodefs verify`: checks every entry of a store (named by it or by a config) offline."""
    if args.target.is_dir():
        root = args.target
        require_store(root)
        digests = recorded_digests(root)
    else:
        config = load_config(args.target)
        root = config.store
        require_store(root, f"the store of {args.target}")
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


def run_stats(args: argparse.Namespace) -> int:
    """`decodefs stats`: prints a live mount's counters (a table, --all, or --json); when no
    serving process answers, what the mount's holder says."""
    path = args.mountpoint / STATUS_DIR / STATS_FILE
    mountpoint = args.mountpoint
    try:
        mountpoint = live_mount(args.mountpoint, "stats {}")
        raw = read_status_bytes(mountpoint, STATS_FILE)
        stats = parse_status(raw, STATS_FILE)
    except OSError as exc:
        held = _holder_only(args.mountpoint)
        if held is None:
            raise mount_failure(args.mountpoint, exc) from None
        raw, stats = (json.dumps(held, indent=2) + "\n").encode(), held
    except UsageError:
        held = _holder_only(args.mountpoint)
        if held is None:
            raise
        raw, stats = (json.dumps(held, indent=2) + "\n").encode(), held
    except ValueError as exc:
        raise UsageError(f"{path} is not JSON ({exc}); is this decodefs?") from None
    if args.json:
        sys.stdout.write(raw.decode())
        return 0
    if args.all:
        print(format_all_stats(stats))
        return 0
    failed = None  # a daemon older than failed.json, or none serving: the count alone
    if "hits" in stats:
        with contextlib.suppress(OSError, ValueError):
            failed = failed_originals(mountpoint)
    print(format_stats(stats, failed))
    return 0


def run_failed(args: argparse.Namespace) -> int:
    """`decodefs failed`: the originals that failed to decode, one a line (or --json)."""
    mountpoint = live_mount(args.mountpoint, "failed {}")
    if args.version is not None:
        mounted_version(mountpoint, args.version)
    try:
        listed = failed_originals(mountpoint, args.version)
    except OSError as exc:
        raise mount_failure(args.mountpoint, exc) from None
    except ValueError as exc:
        raise UsageError(f"{mountpoint}: {exc}; is this decodefs?") from None
    if args.json:
        sys.stdout.buffer.write(listed.to_json())
        return 0
    for row in listed.failed:
        print(f"{row.version}\t{row.key}\t{row.path}\t{row.reason}")
    print(failed_summary(listed, args.version, read_stats(mountpoint)), file=sys.stderr)
    return 0


def _holder_only(mountpoint: Path) -> dict[str, object] | None:
    """What the mount's holder says of it (no serving process answers), as stats figures."""
    info = find_mount(os.path.realpath(mountpoint))
    if info is None or info.fstype != FS_TYPE:
        return None
    try:
        answer = ask_holder(info.mountpoint, "status", timeout=10.0)
    except (HolderUnreachable, ControlError):
        return None
    holder = answer.get("holder")
    return holder_figures(holder) if isinstance(holder, dict) else None


def run_make_sample(args: argparse.Namespace) -> int:
    """`decodefs make-sample`: writes a corpus of photo-like sample JPEGs."""
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
