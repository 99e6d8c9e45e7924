"""The `decodefs` command: argument parsing, config loading, logging set-up.

User errors (bad config, busy mount point) are one line on stderr and a
non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from . import __version__
from .config import DEFAULT_CONFIG_PATH, ConfigError, load_config

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
        if _is_user_error(exc):
            print(f"decodefs: error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="decodefs",
        description="Serve decoded, resized images as .npy files from a verified flash cache.",
    )
    parser.add_argument("--version", action="version", version=f"decodefs {__version__}")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")

    config_help = f"TOML config (default: $DECODEFS_CONFIG or {DEFAULT_CONFIG_PATH})"
    default_config = Path(os.environ.get("DECODEFS_CONFIG", DEFAULT_CONFIG_PATH))

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
    mount.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="overrides log_level"
    )
    mount.add_argument(
        "--mkdir", action="store_true", help="create the mount point if it is missing (systemd)"
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

    warm = commands.add_parser("warm", help="decode and store a version's arrays ahead of training")
    warm.add_argument("mountpoint", type=Path)
    warm.add_argument("version")
    warm.add_argument("size", type=int)
    warm.add_argument("--uuids", type=Path, help="a file of uuids, one a line (default: all)")
    warm.add_argument(
        "--jobs",
        "-j",
        type=int,
        default=os.cpu_count() or 1,
        help="files in flight (default: cores)",
    )
    warm.set_defaults(run=_warm)

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
        type=int,
        default=300,
        help="arrays decoded again and compared byte for byte first (default: 300)",
    )
    adopt.add_argument(
        "--copy",
        action="store_true",
        help="copy every file, leaving the cache as it was (default: move the files "
        "that are the store user's alone on the store's filesystem)",
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
    stats.add_argument("--json", action="store_true", help="print the raw stats.json")
    stats.set_defaults(run=_stats)

    sample = commands.add_parser("make-sample", help="write a corpus of photo-like sample JPEGs")
    sample.add_argument("directory", type=Path)
    sample.add_argument("--count", type=int, default=32)
    sample.add_argument("--width", type=int, default=1600)
    sample.add_argument("--height", type=int, default=1200)
    sample.add_argument("--seed", type=int, default=0)
    sample.set_defaults(run=_make_sample)
    return parser


def _mount(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    mountpoint = _mountpoint(args.mountpoint, config.mountpoint)
    if args.mkdir:
        with contextlib.suppress(OSError):  # a stale mount there is dealt with below
            os.makedirs(mountpoint, exist_ok=True)
    from . import daemon

    if not args.foreground:
        logging.basicConfig(
            level=logging.WARNING, format="decodefs: %(message)s", stream=sys.stderr
        )
        daemon.prepare_mountpoint(mountpoint)  # fail here, in the user's terminal
        log_file = args.log_file or _default_log_file(mountpoint)
        pid = daemon.spawn(args.config.resolve(), mountpoint, log_file, args.log_level)
        print(f"decodefs: mounted {mountpoint} (daemon pid {pid}, log {log_file})")
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
        daemon.serve(config, mountpoint, on_ready)
    except Exception as exc:
        if ready_fd is not None and _is_user_error(exc):
            os.write(ready_fd, f"error: {exc}".encode())  # the parent prints it
        raise
    return 0


def _umount(args: argparse.Namespace) -> int:
    from .daemon import clear_stale, unmount

    configured = load_config(args.config).mountpoint if args.mountpoint is None else None
    mountpoint = _mountpoint(args.mountpoint, configured)
    if args.if_stale:
        logging.basicConfig(level=logging.INFO, format="decodefs: %(message)s", stream=sys.stderr)
        clear_stale(mountpoint)
    else:
        unmount(mountpoint, lazy=args.lazy)
    return 0


def _warm(args: argparse.Namespace) -> int:
    from .warm import read_uuid_list, warm

    directory = args.mountpoint / args.version / str(args.size)
    if not directory.is_dir():
        raise UsageError(f"{directory} does not exist (is decodefs mounted, with that version?)")
    uuids = read_uuid_list(args.uuids) if args.uuids else None
    before = _read_stats(args.mountpoint)
    report = warm(
        directory,
        uuids,
        max(1, args.jobs),
        progress=sys.stderr.isatty(),
        refusals=lambda: _counter(_read_stats(args.mountpoint), "warm_not_stored"),
    )
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
            f"decodefs: {len(report.missing):,} uuids are not in {args.version}, "
            f"e.g. {report.missing[0]!r}",
            file=sys.stderr,
        )
    if report.store_full:
        print(
            f"decodefs: the store takes no more ({report.store_full}); warming stopped "
            "(a warm never evicts what training uses)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    if report.interrupted:
        print("decodefs: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    return EXIT_ERROR if report.failed or report.missing else 0


def _adopt(args: argparse.Namespace) -> int:
    from .adopt import AdoptError, adopt

    config = load_config(args.config)
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
            copy=args.copy,
            progress=sys.stderr.isatty(),
            stop=stop,
        )
    except AdoptError as exc:
        raise UsageError(str(exc)) from None
    finally:
        signal.signal(signal.SIGINT, previous)
    what = f"{args.version}/{args.size}"
    rate = report.adopted / report.seconds if report.seconds else 0.0
    if report.sampled:
        print(
            f"decodefs: sample: {report.sampled:,} arrays decoded again, "
            "each equal byte for byte to the cache's"
        )
    print(
        f"decodefs: adopted {report.adopted:,} arrays of {what} in {report.seconds:.1f} s "
        f"({rate:,.1f}/s): {report.moved:,} moved into the store, {report.copied:,} copied; "
        f"{report.already_stored:,} were stored already"
    )
    left = [
        (report.unknown, "with no original in the version", "unknown"),
        (report.bad, "not a stored array's .npy", "bad"),
        (report.undecodable, "whose original cannot be decoded", "undecodable"),
    ]
    for count, why, kind in left:
        if count:
            print(
                f"decodefs: left in the cache: {count:,} {why} (e.g. {report.examples[kind]})",
                file=sys.stderr,
            )
    if report.interrupted:
        print("decodefs: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .decode import decoder_fingerprint
    from .verify import recorded_digests, verify_store

    if args.target.is_dir():
        root = args.target
        digests = recorded_digests(root)
    else:
        config = load_config(args.target)
        root = config.store
        digests = {n: decoder_fingerprint(v.decode).digest for n, v in config.versions.items()}
    if not root.is_dir():
        raise UsageError(f"{root} is not a store directory")
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
    return EXIT_ERROR if report.bad and not args.remove else 0


class UsageError(Exception):
    """A command-line mistake the user can fix (printed as one line)."""


def _mountpoint(given: Path | None, configured: Path | None) -> str:
    if given is None and configured is None:
        raise UsageError("no mount point: give one, or set `mountpoint` in the config")
    return os.path.abspath(given if given is not None else configured)  # type: ignore[arg-type]


def _read_stats(mountpoint: Path) -> dict[str, object]:
    try:
        data = json.loads((mountpoint / ".decodefs" / "stats.json").read_bytes())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _counter(stats: dict[str, object], key: str) -> int:
    """An integer of a stats.json snapshot; 0 if absent (an older daemon) or not one."""
    value = stats.get(key, 0)
    return value if isinstance(value, int) else 0


def _stats(args: argparse.Namespace) -> int:
    path = args.mountpoint / ".decodefs" / "stats.json"
    try:
        raw = path.read_bytes()
    except OSError as exc:
        print(
            f"decodefs: error: cannot read {path}: {exc.strerror} (is decodefs mounted there?)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    if args.json:
        sys.stdout.write(raw.decode())
        return 0
    print(format_stats(json.loads(raw)))
    return 0


def format_stats(stats: dict[str, object]) -> str:
    """The human table printed by `decodefs stats`."""

    def n(key: str) -> int:
        return _counter(stats, key)

    opens = n("hits") + n("misses")
    latency = stats.get("decode_seconds")
    decode_count = latency.get("count", 0) if isinstance(latency, dict) else 0
    decode_sum = latency.get("sum", 0.0) if isinstance(latency, dict) else 0.0
    mean_ms = f"{1000 * decode_sum / decode_count:.0f} ms" if decode_count else "-"
    rows = [
        ("hits", f"{n('hits'):,}"),
        ("misses", f"{n('misses'):,}"),
        ("hit ratio", f"{100 * n('hits') / opens:.1f}%" if opens else "-"),
        ("decodes", f"{n('decodes'):,} (mean {mean_ms})"),
        ("decode errors", f"{n('decode_errors'):,}"),
        ("corrupt entries rebuilt", f"{n('corrupt_entries'):,}"),
        (
            "store",
            f"{_human_bytes(n('store_bytes'))} in {n('store_entries'):,} entries"
            + (f" of {_human_bytes(n('store_max_bytes'))}" if n("store_max_bytes") else "")
            + ("" if stats.get("store_usage_complete", True) else " (still counting)")
            + ("" if stats.get("store_writable", True) else ", NOT WRITABLE"),
        ),
        ("evictions", f"{n('evictions'):,}"),
        ("background warm decodes", f"{n('background_decodes'):,}"),
        (
            "memory fallbacks",
            f"{n('memory_fallbacks'):,} ({_human_bytes(n('memory_cache_bytes'))} held)",
        ),
        ("bytes served", _human_bytes(n("bytes_served"))),
        ("decodes in flight", f"{n('inflight_decodes'):,}"),
    ]
    errors = stats.get("errors")
    if isinstance(errors, dict) and errors:
        rows.append(("errors", ", ".join(f"{k} {v:,}" for k, v in sorted(errors.items()))))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _make_sample(args: argparse.Namespace) -> int:
    from .sample import make_sample_corpus

    paths = make_sample_corpus(args.directory, args.count, args.width, args.height, args.seed)
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
    from .daemon import MountError
    from .source import SourceError
    from .store import StoreError
    from .verify import StoreBusy

    return isinstance(
        exc, ConfigError | MountError | SourceError | StoreError | UsageError | StoreBusy
    )
