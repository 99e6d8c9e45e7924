"""The command line's grammar: every command, its arguments and their help, each bound
to its command body. Knows nothing of how a command does its work.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from ..common.config import DEFAULT_CONFIG_PATH, LOG_LEVELS
from ..common.protocol import FAILED_FILE, STATS_FILE
from ..common.version import package_version
from ..store import DEFAULT_SAMPLE
from .commands import (
    run_adopt,
    run_failed,
    run_make_sample,
    run_mount,
    run_stats,
    run_switch,
    run_umount,
    run_verify,
    run_warm,
)

__all__ = ["build_parser"]

# The subparsers' add_parser: adds one command and returns its parser.
AddCommand = Callable[..., argparse.ArgumentParser]

_CONFIG_HELP = f"TOML config (default: $DECODEFS_CONFIG, else {DEFAULT_CONFIG_PATH})"


def build_parser() -> argparse.ArgumentParser:
    """The `decodefs` parser; a parsed command's ``run(args)`` runs it."""
    parser = argparse.ArgumentParser(
        prog="decodefs",
        description="Serve decoded, resized images as .npy files from a verified flash cache.",
    )
    parser.add_argument("--version", action="version", version=f"decodefs {package_version()}")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    for add_arguments in (
        _mount_arguments,
        _umount_arguments,
        _reload_arguments,
        _restart_arguments,
        _warm_arguments,
        _adopt_arguments,
        _verify_arguments,
        _stats_arguments,
        _failed_arguments,
        _make_sample_arguments,
    ):
        add_arguments(commands.add_parser)
    return parser


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


def _config_option(command: argparse.ArgumentParser) -> None:
    """--config FILE, without a default: checks.named_config resolves it, knowing from where."""
    command.add_argument("--config", type=Path, default=None, help=_CONFIG_HELP)


def _mount_arguments(add_command: AddCommand) -> None:
    """The arguments of `decodefs mount`."""
    mount = add_command("mount", help="mount the filesystem (returns once it is live)")
    mount.add_argument(
        "mountpoint", type=Path, nargs="?", help="default: the config's `mountpoint`"
    )
    _config_option(mount)
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
    mount.set_defaults(run=run_mount)


def _umount_arguments(add_command: AddCommand) -> None:
    """The arguments of `decodefs umount`."""
    umount = add_command("umount", help="unmount and wait for the daemon to exit")
    umount.add_argument(
        "mountpoint", type=Path, nargs="?", help="default: the config's `mountpoint`"
    )
    _config_option(umount)
    umount.add_argument(
        "--lazy", "-z", action="store_true", help="detach now even if files are open"
    )
    umount.add_argument(
        "--if-stale",
        action="store_true",
        help="only clear a mount whose daemon is gone; never touch a live one (systemd)",
    )
    umount.set_defaults(run=run_umount)


def _reload_arguments(add_command: AddCommand) -> None:
    """The arguments of `decodefs reload`."""
    _switch_arguments(
        add_command,
        "reload",
        help="apply the config and the sources as they are now, without unmounting",
        description="A new serving process reads the mount's config and scans its sources, "
        "then takes the mount over from the running one: readers pause, never fail. A config "
        "that does not load is refused and the running process keeps serving. SIGHUP to the "
        "mount's holder (systemctl reload) does the same.",
    )


def _restart_arguments(add_command: AddCommand) -> None:
    """The arguments of `decodefs restart`."""
    _switch_arguments(
        add_command,
        "restart",
        help="serve the mount from the decodefs installed now (after an upgrade)",
        description="A new serving process, started from the code installed now, takes the "
        "mount over from the running one (it reads the config and the sources too): "
        "readers pause, never fail.",
    )


def _switch_arguments(add_command: AddCommand, switch: str, help: str, description: str) -> None:
    """A command that hands the mount to a new serving process (run_switch)."""
    command = add_command(switch, help=help, description=description)
    command.add_argument(
        "mountpoint", type=Path, nargs="?", help="default: the config's `mountpoint`"
    )
    _config_option(command)
    command.set_defaults(run=run_switch, switch=switch)


def _warm_arguments(add_command: AddCommand) -> None:
    """The arguments of `decodefs warm`."""
    warm = add_command(
        "warm",
        help="decode and store a version's arrays ahead of training",
        usage="%(prog)s MOUNTPOINT VERSION SIZE [--keys FILE] [--jobs N]\n"
        "       %(prog)s --cluster SCHEDULER VERSION SIZE [--keys FILE] [--config FILE]",
    )
    warm.add_argument(
        "mountpoint", type=Path, nargs="?", help="a live decodefs mount (none with --cluster)"
    )
    warm.add_argument("version")
    warm.add_argument("size", type=_int_at_least(1))
    warm.add_argument(
        "--keys",
        "--uuids",  # its earlier name
        dest="keys",
        type=Path,
        help="a file of keys (uuids, or a mirror version's paths), one a line (default: all)",
    )
    warm.add_argument(
        "--jobs",
        "-j",
        type=_int_at_least(1),
        default=os.cpu_count() or 1,
        help="files in flight (default: cores)",
    )
    # -- decodefs warm --cluster (cluster/dask_warm.py) --
    warm.add_argument(
        "--cluster",
        metavar="SCHEDULER",
        help="fill the config's l2 on the Dask cluster at this scheduler address instead "
        "of a mount (needs decodefs[cluster])",
    )
    _config_option(warm)
    warm.set_defaults(run=run_warm, parser=warm)


def _adopt_arguments(add_command: AddCommand) -> None:
    """The arguments of `decodefs adopt`."""
    adopt = add_command(
        "adopt",
        help="import an existing cache of <version>/<size>/<uu>/<uuid>.npy files into the store",
    )
    adopt.add_argument("cache_dir", type=Path, help="the cache (holding <version>/<size>/<uu>/)")
    adopt.add_argument("version")
    adopt.add_argument("size", type=int)
    _config_option(adopt)
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
    adopt.set_defaults(run=run_adopt)


def _verify_arguments(add_command: AddCommand) -> None:
    """The arguments of `decodefs verify`."""
    verify = add_command("verify", help="check every stored entry offline")
    verify.add_argument(
        "target",
        type=Path,
        help="a config file (checks against the current decode settings) or a store directory",
    )
    verify.add_argument(
        "--remove", action="store_true", help="delete bad entries (no daemon may use the store)"
    )
    verify.set_defaults(run=run_verify)


def _stats_arguments(add_command: AddCommand) -> None:
    """The arguments of `decodefs stats`."""
    stats = add_command("stats", help="print a mounted daemon's counters")
    stats.add_argument("mountpoint", type=Path)
    shown = stats.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help=f"print the raw {STATS_FILE}")
    shown.add_argument(
        "--all", action="store_true", help="print every figure, with its unit and meaning"
    )
    stats.set_defaults(run=run_stats)


def _failed_arguments(add_command: AddCommand) -> None:
    """The arguments of `decodefs failed`."""
    failed = add_command(
        "failed",
        help="list the originals that failed to decode: version, key, path and reason",
        description="One line per original that failed to decode since the mount's daemon "
        "started and has not decoded since: VERSION, KEY, PATH and REASON, separated by tabs "
        f"(the mount's .decodefs/{FAILED_FILE}). Its array is EIO through the mount.",
    )
    failed.add_argument("mountpoint", type=Path)
    failed.add_argument("version", nargs="?", help="only this version's (default: every one)")
    failed.add_argument(
        "--json", action="store_true", help=f"print them as {FAILED_FILE} holds them"
    )
    failed.set_defaults(run=run_failed)


def _make_sample_arguments(add_command: AddCommand) -> None:
    """The arguments of `decodefs make-sample`."""
    sample = add_command(
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
    sample.set_defaults(run=run_make_sample)
