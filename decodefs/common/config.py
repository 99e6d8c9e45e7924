"""The TOML config: parsed, defaulted and validated in one place.

Every mistake is found, not just the first: one ConfigError carries them all,
each naming the file and the offending key, raised before anything is mounted.
This module knows nothing of FUSE or the store's layout.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import stat
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Final, Literal, TypeVar, cast, get_args

from .decode import (
    DEFAULT_MAX_PIXELS,
    FITS,
    RESAMPLE_FILTERS,
    DecodeSettings,
    decoder_fingerprint,
)
from .fingerprint import Fingerprint
from .inodes import SIZE_LIMIT
from .source import Duplicates, Layout

__all__ = [
    "ACCESS_VALUES",
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_EXTENSIONS",
    "LOG_LEVELS",
    "WORKERS_MAX",
    "Access",
    "Config",
    "ConfigError",
    "L2Config",
    "VersionConfig",
    "load_config",
    "metrics_host_port",
    "parse_byte_size",
    "parse_config",
]

DEFAULT_CONFIG_PATH: Final = Path("/etc/decodefs/config.toml")
DEFAULT_EXTENSIONS: Final = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")
# The most threads of one kind a config may ask for (decode_workers, io_workers, l2_workers).
WORKERS_MAX: Final = 256
# A version name is a path component both in the mount and in the store.
log = logging.getLogger(__name__)
_VERSION_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}")
_BYTE_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)
_BYTE_UNITS: Final = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

LogLevel = Literal["debug", "info", "warning", "error"]
# Who gets an array of a size no version lists stored on flash: nobody ("memory": served
# from memory, decoded again when the memory cache dropped it), the daemon's own user
# ("owner"), or every user ("everyone").
UnlistedSizes = Literal["memory", "owner", "everyone"]
# Who may read the arrays, through the mount and in the store: the users who may read
# each one's original ("originals", as root), the daemon's own user ("owner"), or every
# local user ("everyone"); the last two were ``allow_other = false`` and ``true``.
Access = Literal["originals", "owner", "everyone"]
ACCESS_VALUES: Final[tuple[Access, ...]] = get_args(Access)
LOG_LEVELS: Final[tuple[LogLevel, ...]] = get_args(LogLevel)


def default_access() -> Access:
    """access when a config does not set it: what the originals allow, as root; else
    the daemon's own user (only root can show other users' files as theirs)."""
    return "originals" if os.geteuid() == 0 else "owner"


def default_decode_workers() -> int:
    """decode_workers when a config does not set it: the cores, but never more than a
    config may set (a machine of more cores than WORKERS_MAX must still load a config
    that leaves the key out)."""
    return min(os.cpu_count() or 1, WORKERS_MAX)


T = TypeVar("T")


class ConfigError(Exception):
    """Config problems a user can fix; each names the key (and the file, once loaded).

    ``problems`` holds one line per mistake; ``str()`` joins them with newlines.
    """

    def __init__(self, *problems: str) -> None:
        self.problems: tuple[str, ...] = problems
        super().__init__("\n".join(problems))


# The defaults of every key live in the dataclasses below (and DecodeSettings): the
# parser, the key lists, ``as_dict`` and docs/configuration.md's tables (checked by
# tests/test_config.py) all take them from there.


@dataclass(frozen=True)
class VersionConfig:
    """One dataset version: where its originals are and how they are decoded."""

    name: str
    source: Path
    sizes: tuple[int, ...] = (224,)  # also the top-level ``sizes`` default
    decode: DecodeSettings = field(default_factory=DecodeSettings)  # its fields: table keys
    extensions: frozenset[str] = frozenset(DEFAULT_EXTENSIONS)
    duplicates: Duplicates = "error"
    warm: bool = False
    # "uuid": <size>/<uuid>.npy by file stem; "mirror": the source's own relative paths.
    layout: Layout = "uuid"

    def fingerprint(self) -> Fingerprint:
        """What the version's stored arrays must have been made by (and keyed by)."""
        return decoder_fingerprint(self.decode, keys=self.layout)

    def as_dict(self) -> dict[str, object]:
        """Its keys as a config file spells them (the decode settings flattened)."""
        value = _plain_fields(self, leave_out=("name", "decode"))
        return {**value, **_plain_fields(self.decode)}


# -- L2: the cluster's second tier (cluster/tier.py, cluster/backends.py) ---------------------


@dataclass(frozen=True)
class L2Config:
    """Where the cluster's shared tier lives, and how long a node waits for it."""

    url: str  # "s3://bucket/prefix" or the absolute path of a shared directory
    endpoint: str | None = None  # an S3-compatible endpoint (None: AWS)
    region: str | None = None  # None: boto3's default chain, else us-east-1
    timeout_seconds: float = 5.0  # every L2 call
    lease_seconds: float = 10.0  # how long a node's claim to decode an array holds (0: no lease)
    retry_seconds: float = 1.0  # first pause after L2 failed; doubles up to 60 s
    workers: int = 8  # threads for L2 calls
    publish_queue_bytes: int = 256 << 20  # arrays waiting to be published; past it, dropped

    @property
    def is_s3(self) -> bool:
        return self.url.startswith("s3://")

    @property
    def bucket(self) -> str:
        return self.url[len("s3://") :].partition("/")[0]

    @property
    def prefix(self) -> str:
        return self.url[len("s3://") :].partition("/")[2].strip("/")

    def as_dict(self) -> dict[str, object]:
        return _plain_fields(self)


@dataclass(frozen=True)
class Config:
    store: Path
    versions: Mapping[str, VersionConfig]
    path: Path | None = None
    mountpoint: Path | None = None
    access: Access = field(default_factory=default_access)
    max_store_bytes: int | None = None
    # Keep this much of the store's filesystem free (0: no such limit): one user
    # asking for many arrays can never fill the flash.
    min_free_fraction: float | None = 0.05
    min_size: int = 8
    max_size: int = 4096
    decode_workers: int = field(default_factory=default_decode_workers)
    io_workers: int = 8
    memory_cache_bytes: int = 512 << 20
    decode_memory_bytes: int = 1 << 30
    unlisted_sizes: UnlistedSizes = "memory"
    max_pixels: int = DEFAULT_MAX_PIXELS
    error_cache_seconds: float = 10.0
    log_level: LogLevel = "info"
    # Where Prometheus may scrape the metrics over HTTP ("127.0.0.1:9464"; None: nowhere).
    metrics_address: str | None = None
    # Keep a second serving process ready beside the one serving, so that a crash is
    # answered in milliseconds rather than a process's start (its memory: the cost).
    standby: bool = True
    l2: L2Config | None = None

    @property
    def allow_other(self) -> bool:
        """Whether the mount lets other users' processes in (FUSE ``allow_other``): the
        kernel then checks each file's owner, group and mode (``default_permissions``)."""
        return self.access != "owner"

    def fingerprints(self) -> dict[str, Fingerprint]:
        """Each version's fingerprint, as the store is opened with: whoever opens the
        store must pass the same ones, or it discards a version's arrays as stale."""
        return {name: version.fingerprint() for name, version in self.versions.items()}

    def as_dict(self) -> dict[str, object]:
        """The effective config, for /.decodefs/config.json (``l2`` only when set)."""
        return _plain_fields(self, leave_out=() if self.l2 is not None else ("l2",))


def _plain_fields(value: Any, leave_out: tuple[str, ...] = ()) -> dict[str, object]:
    """A config dataclass's fields as JSON values, by field name."""
    return {
        f.name: _plain(getattr(value, f.name)) for f in fields(value) if f.name not in leave_out
    }


def _plain(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, frozenset):
        return sorted(value)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        return {name: _plain(item) for name, item in value.items()}
    if is_dataclass(value) and hasattr(value, "as_dict"):
        return value.as_dict()
    return value


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a config file (a path, as a str or a Path); raise ConfigError
    naming every problem."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not a TOML config: byte {exc.start} is not UTF-8 text"
        ) from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_config(raw, base_dir=path.parent.resolve(), path=path)


def parse_config(raw: Mapping[str, Any], base_dir: Path, path: Path | None = None) -> Config:
    """Validate an already-parsed TOML table. Relative paths are taken from base_dir."""
    parser = _Parser(base_dir)
    config = parser.config(raw, path)
    if parser.problems or config is None:
        where = f"{path}: " if path else ""
        raise ConfigError(*(f"{where}{problem}" for problem in parser.problems))
    return config


def metrics_host_port(value: object) -> tuple[str, int]:
    """``metrics_address`` as (host, port): "" for every address; ValueError if it is none."""
    match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]*):([0-9]{1,5})", str(value))
    if not isinstance(value, str) or match is None or not 0 < int(match.group(2)) < 65536:
        raise ValueError(
            f'expected "HOST:PORT" such as "127.0.0.1:9464" (":9464": every address), got {value!r}'
        )
    return match.group(1).strip("[]"), int(match.group(2))


def parse_byte_size(value: object) -> int:
    """An int of bytes, or a string like "512M", "60G", "1.5TiB" (powers of 1024)."""
    if isinstance(value, bool):
        raise ValueError('expected a byte size such as 536870912 or "512M"')
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must not be negative")
        return value
    if isinstance(value, str):
        match = _BYTE_SIZE.fullmatch(value.strip())
        if match:
            return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).upper()])
    raise ValueError(f'{value!r} is not a byte size such as 536870912 or "512M"')


# The l2* keys (L2Config, parsed by l2_config below): "l2" is its url.
L2_KEYS: Final = ("l2", *(f"l2_{f.name}" for f in fields(L2Config) if f.name != "url"))
# Config's fields that are no key of a file (``path``: where it was read from), and
# the keys that are no field of it (``sizes``: every version's default).
_NOT_KEYS: Final = ("path", "l2")
_TOP_KEYS: Final = (
    *(f.name for f in fields(Config) if f.name not in _NOT_KEYS),
    "sizes",
    "allow_other",  # the old name of access = "everyone" (true) or "owner" (false)
    *L2_KEYS,
)
_VERSION_KEYS: Final = (
    *(f.name for f in fields(VersionConfig) if f.name not in ("name", "decode")),
    *(f.name for f in fields(DecodeSettings)),
)


class _Parser:
    """Checks every key, recording each mistake in ``problems`` and going on.

    A check that fails yields a stand-in value (the default) so that the keys
    after it are still checked; the stand-ins are never used, because a parse
    with problems raises. Problems are listed in the order the keys are checked
    below. ``integer``, ``number``, ``byte_size`` and ``path`` raise ConfigError
    for their caller to choose the stand-in (``check``); the others record the
    mistake themselves.
    """

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.problems: list[str] = []
        self.defaults = Config(store=Path(), versions={})
        self.version_defaults = VersionConfig(name="", source=Path())

    def check(self, compute: Callable[[], T], fallback: T) -> T:
        try:
            return compute()
        except ConfigError as exc:
            self.problems.extend(exc.problems)
            return fallback

    # -- the top-level keys, in the order their problems are listed --

    def config(self, raw: Mapping[str, Any], path: Path | None) -> Config | None:
        """The whole file; None if any key of it is a mistake."""
        defaults = self.defaults
        self.reject_unknown(raw, _TOP_KEYS, prefix="")
        store = self.required_store(raw)
        low, high = self.size_bounds(raw)
        default_sizes = self.sizes(
            raw.get("sizes", list(self.version_defaults.sizes)), "sizes", low, high
        )
        versions = self.versions(raw, default_sizes, low, high)
        log_level = self.choice(raw, "log_level", defaults.log_level, LOG_LEVELS)
        max_store_bytes, min_free_fraction = self.store_limits(raw)
        mountpoint = None
        if "mountpoint" in raw:
            mountpoint = self.check(lambda: self.path(raw["mountpoint"], "mountpoint"), None)
        access = self.access(raw)
        decode_workers = self.workers(raw, "decode_workers", defaults.decode_workers)
        io_workers = self.workers(raw, "io_workers", defaults.io_workers)
        memory_cache_bytes, decode_memory_bytes = self.memory_budgets(raw)
        unlisted_sizes = self.choice(
            raw, "unlisted_sizes", defaults.unlisted_sizes, get_args(UnlistedSizes)
        )
        max_pixels, error_cache_seconds = self.decode_limits(raw)
        metrics_address = self.metrics_address(raw)
        standby = self.boolean(raw, "standby", defaults.standby, None)
        l2 = l2_config(self, raw)
        if self.problems or store is None:
            return None
        return Config(
            store=store,
            versions=versions,
            path=path,
            mountpoint=mountpoint,
            access=access,
            max_store_bytes=max_store_bytes,
            min_free_fraction=min_free_fraction,
            min_size=low,
            max_size=high,
            decode_workers=decode_workers,
            io_workers=io_workers,
            memory_cache_bytes=memory_cache_bytes,
            decode_memory_bytes=decode_memory_bytes,
            unlisted_sizes=cast(UnlistedSizes, unlisted_sizes),
            max_pixels=max_pixels,
            error_cache_seconds=error_cache_seconds,
            log_level=cast(LogLevel, log_level),
            metrics_address=metrics_address,
            standby=standby,
            l2=l2,
        )

    def access(self, raw: Mapping[str, Any]) -> Access:
        """``access``, or the deprecated ``allow_other`` that it replaces (true:
        "everyone", false: "owner"); both set, they must agree."""
        access = cast(Access, self.choice(raw, "access", self.defaults.access, ACCESS_VALUES))
        if "allow_other" not in raw:
            return access
        allow_other = self.boolean(raw, "allow_other", False, None)
        implied: Access = "everyone" if allow_other else "owner"
        if "access" in raw and raw["access"] in ACCESS_VALUES and access != implied:
            self.problems.append(
                f"allow_other = {str(allow_other).lower()} and access = {access!r} disagree: "
                f"allow_other is the old name of access = {implied!r}; keep access alone"
            )
        elif "access" not in raw:
            log.warning(
                "allow_other = %s is deprecated: it means access = %r (set that instead)",
                str(allow_other).lower(),
                implied,
            )
        return implied

    def required_store(self, raw: Mapping[str, Any]) -> Path | None:
        """``store``, which every config must set."""
        if "store" not in raw:
            self.problems.append("store: missing (the directory on flash where arrays are kept)")
            return None
        return self.check(lambda: self.store(raw["store"]), None)

    def store(self, value: object) -> Path:
        store = self.path(value, "store")
        reason = _never_a_directory(store)
        if reason is not None:
            raise ConfigError(f"store: {store} can never be a directory: {reason}")
        return store

    def size_bounds(self, raw: Mapping[str, Any]) -> tuple[int, int]:
        """``min_size`` and ``max_size``; the widest bounds stand in for a mistake in either."""
        defaults = self.defaults
        min_size = self.check(
            lambda: self.integer(raw, "min_size", defaults.min_size, low=1, high=SIZE_LIMIT),
            None,
        )
        max_size = self.check(
            lambda: self.integer(raw, "max_size", defaults.max_size, low=1, high=SIZE_LIMIT),
            None,
        )
        if min_size is not None and max_size is not None and min_size > max_size:
            self.problems.append(f"min_size: {min_size} is larger than max_size ({max_size})")
            min_size = max_size = None
        # Without usable bounds, sizes are checked against the widest ones
        # (no follow-on complaint about a bound that is itself the mistake).
        low = 1 if min_size is None else min_size
        high = SIZE_LIMIT if max_size is None else max_size
        return low, high

    def versions(
        self, raw: Mapping[str, Any], default_sizes: tuple[int, ...], low: int, high: int
    ) -> dict[str, VersionConfig]:
        """The ``[versions.<name>]`` tables, at least one; those without a mistake."""
        versions_raw = raw.get("versions")
        versions: dict[str, VersionConfig] = {}
        if not isinstance(versions_raw, Mapping) or not versions_raw:
            self.problems.append(
                "versions: missing; add at least one [versions.<name>] table with a source"
            )
            return versions
        for name, table in versions_raw.items():
            version = self.version(name, table, default_sizes, low, high)
            if version is not None:
                versions[name] = version
        return versions

    def store_limits(self, raw: Mapping[str, Any]) -> tuple[int | None, float | None]:
        """``max_store_bytes`` and ``min_free_fraction`` (None: no such limit)."""
        max_store_bytes = None
        if "max_store_bytes" in raw:
            max_store_bytes = self.check(lambda: self.byte_size(raw, "max_store_bytes", 0), None)
            if max_store_bytes is not None and max_store_bytes <= 0:
                self.problems.append(
                    "max_store_bytes: must be positive (leave it out for no limit)"
                )
        min_free_fraction: float | None = self.defaults.min_free_fraction
        if "min_free_fraction" in raw:
            fraction = self.check(lambda: self.number(raw, "min_free_fraction", 0.0), None)
            min_free_fraction = fraction or None
            if min_free_fraction is not None and not 0 < min_free_fraction < 1:
                self.problems.append(
                    f"min_free_fraction: {min_free_fraction} is not between 0 and 1 "
                    "(e.g. 0.1; 0 for no such limit)"
                )
        return max_store_bytes, min_free_fraction

    def memory_budgets(self, raw: Mapping[str, Any]) -> tuple[int, int]:
        """``memory_cache_bytes`` and ``decode_memory_bytes``."""
        defaults = self.defaults
        memory_cache_bytes = self.check(
            lambda: self.byte_size(raw, "memory_cache_bytes", defaults.memory_cache_bytes),
            defaults.memory_cache_bytes,
        )
        decode_memory_bytes = self.check(
            lambda: self.byte_size(raw, "decode_memory_bytes", defaults.decode_memory_bytes),
            defaults.decode_memory_bytes,
        )
        return memory_cache_bytes, decode_memory_bytes

    def decode_limits(self, raw: Mapping[str, Any]) -> tuple[int, float]:
        """``max_pixels`` and ``error_cache_seconds``."""
        defaults = self.defaults
        # Pillow's Image.open refuses more than twice its default on its own.
        max_pixels = self.check(
            lambda: self.integer(
                raw, "max_pixels", defaults.max_pixels, low=1, high=2 * DEFAULT_MAX_PIXELS
            ),
            defaults.max_pixels,
        )
        error_cache_seconds = self.check(
            lambda: self.number(raw, "error_cache_seconds", defaults.error_cache_seconds),
            defaults.error_cache_seconds,
        )
        return max_pixels, error_cache_seconds

    def metrics_address(self, raw: Mapping[str, Any]) -> str | None:
        """``metrics_address``: "HOST:PORT" ("127.0.0.1:9464", "[::1]:9464", ":9464" for
        every address); None if unset."""
        value = raw.get("metrics_address")
        if value is None:
            return None
        try:
            metrics_host_port(value)
        except ValueError as exc:
            self.problems.append(f"metrics_address: {exc}")
            return None
        return cast(str, value)

    # -- one [versions.<name>] table --

    def version(
        self,
        name: str,
        table: object,
        default_sizes: tuple[int, ...],
        min_size: int,
        max_size: int,
    ) -> VersionConfig | None:
        """One ``[versions.<name>]`` table; None if any key of it is a mistake."""
        key = f"versions.{name}"
        before = len(self.problems)
        if not _VERSION_NAME.fullmatch(name):
            self.problems.append(
                f"{key}: a version name is letters, digits, '_', '.', '+' or '-' "
                "(at most 128, not starting with '.' or '-')"
            )
        if not isinstance(table, Mapping):
            self.problems.append(f"{key}: expected a table such as [versions.{name}]")
            return None
        self.reject_unknown(table, _VERSION_KEYS, prefix=f"{key}.")
        source = self.source(table, key)
        sizes = self.sizes(
            table.get("sizes", list(default_sizes)), f"{key}.sizes", min_size, max_size
        )
        decode = self.decode_settings(table, key)
        defaults = self.version_defaults
        extensions = self.extensions(
            table.get("extensions", sorted(defaults.extensions)), f"{key}.extensions"
        )
        duplicates = self.choice(
            table, "duplicates", defaults.duplicates, get_args(Duplicates), key
        )
        warm = self.boolean(table, "warm", defaults.warm, key)
        layout = self.choice(table, "layout", defaults.layout, get_args(Layout), key)
        if len(self.problems) > before or source is None:
            return None
        return VersionConfig(
            name=name,
            source=source,
            sizes=sizes,
            decode=decode,
            extensions=extensions,
            duplicates=cast(Duplicates, duplicates),
            warm=warm,
            layout=cast(Layout, layout),
        )

    def source(self, table: Mapping[str, Any], key: str) -> Path | None:
        """A version's ``source``, which must be a directory."""
        if "source" not in table:
            self.problems.append(f"{key}.source: missing (the directory of original images)")
            return None
        source = self.check(lambda: self.path(table["source"], f"{key}.source"), None)
        if source is not None and not source.is_dir():
            self.problems.append(f"{key}.source: {source} is not a directory")
        return source

    def decode_settings(self, table: Mapping[str, Any], key: str) -> DecodeSettings:
        """A version's decode keys: ``resample``, ``fit``, ``exif_transpose``, ``draft``."""
        defaults = DecodeSettings()
        resample = self.choice(table, "resample", defaults.resample, tuple(RESAMPLE_FILTERS), key)
        fit = self.choice(table, "fit", defaults.fit, FITS, key)
        exif_transpose = self.boolean(table, "exif_transpose", defaults.exif_transpose, key)
        draft = self.boolean(table, "draft", defaults.draft, key)
        return DecodeSettings(
            resample=cast(Any, resample),
            fit=cast(Any, fit),
            exif_transpose=exif_transpose,
            draft=draft,
        )

    # -- kinds of value --

    def path(self, value: object, key: str) -> Path:
        if not isinstance(value, str) or not value or "\0" in value:
            raise ConfigError(f"{key}: expected a path string, got {value!r}")
        path = Path(value).expanduser()
        return path if path.is_absolute() else (self.base_dir / path)

    def sizes(self, value: object, key: str, low: int, high: int) -> tuple[int, ...]:
        """The valid sizes of the list; every bad item is recorded."""
        if not isinstance(value, list):
            self.problems.append(f"{key}: expected a list of integers such as [224]")
            return ()
        sizes: list[int] = []
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int):
                self.problems.append(f"{key}[{i}]: expected an integer, got {item!r}")
            elif not low <= item <= high:
                self.problems.append(
                    f"{key}[{i}]: {item} is outside min_size..max_size ({low}..{high})"
                )
            else:
                sizes.append(item)
        return tuple(sorted(set(sizes)))

    def extensions(self, value: object, key: str) -> frozenset[str]:
        """The valid extensions of the list; every bad item is recorded."""
        if not isinstance(value, list) or not value:
            self.problems.append(f'{key}: expected a non-empty list such as ["jpg", "png"]')
            return frozenset()
        result = set()
        for i, item in enumerate(value):
            if not isinstance(item, str) or not re.fullmatch(r"\.?[A-Za-z0-9]+", item):
                self.problems.append(
                    f'{key}[{i}]: expected an extension such as "jpg", got {item!r}'
                )
            else:
                result.add(item.lstrip(".").lower())
        return frozenset(result)

    def reject_unknown(self, table: Mapping[str, Any], known: tuple[str, ...], prefix: str) -> None:
        for key in table:
            if key not in known:
                hint = difflib.get_close_matches(key, known, n=1)
                suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
                self.problems.append(f"{prefix}{key}: unknown key{suggestion}")

    def integer(
        self, table: Mapping[str, Any], name: str, default: int, *, low: int, high: int
    ) -> int:
        value = table.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        if not low <= value <= high:
            raise ConfigError(f"{name}: {value} is outside {low}..{high}")
        return value

    def workers(self, table: Mapping[str, Any], name: str, default: int) -> int:
        """A thread count, 1..WORKERS_MAX; a mistake is recorded (the default stands in)."""
        return self.check(
            lambda: self.integer(table, name, default, low=1, high=WORKERS_MAX), default
        )

    def number(self, table: Mapping[str, Any], name: str, default: float) -> float:
        value = table.get(name, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 <= value < math.inf  # also refuses nan
        ):
            raise ConfigError(f"{name}: expected a non-negative number, got {value!r}")
        return float(value)

    def byte_size(self, table: Mapping[str, Any], name: str, default: int) -> int:
        try:
            return parse_byte_size(table.get(name, default))
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None

    def boolean(
        self, table: Mapping[str, Any], name: str, default: bool, prefix: str | None
    ) -> bool:
        """true or false; a mistake is recorded (the default stands in)."""
        value = table.get(name, default)
        if not isinstance(value, bool):
            key = f"{prefix}.{name}" if prefix else name
            self.problems.append(f"{key}: expected true or false, got {value!r}")
            return default
        return value

    def choice(
        self,
        table: Mapping[str, Any],
        name: str,
        default: str,
        allowed: tuple[str, ...],
        prefix: str | None = None,
    ) -> str:
        """One of ``allowed``; a mistake is recorded (the default stands in)."""
        key = f"{prefix}.{name}" if prefix else name
        value = table.get(name, default)
        if value not in allowed:
            self.problems.append(f"{key}: {value!r} is not one of {', '.join(map(repr, allowed))}")
            return default
        return cast(str, value)


# -- L2 keys ---------------------------------------------------------------------------

# S3's bucket naming rules (3 to 63 of lowercase letters, digits, '.', '-').
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_ENDPOINT = re.compile(r"https?://[^\s/]+(/\S*)?")


def l2_config(parser: _Parser, raw: Mapping[str, Any]) -> L2Config | None:
    """The ``l2*`` keys; None without ``l2`` (then no other l2 key may be set)."""
    if "l2" not in raw:
        for key in L2_KEYS:
            if key in raw:
                parser.problems.append(f"{key}: set without l2 (the shared tier it configures)")
        return None
    value = raw["l2"]
    url = ""
    if isinstance(value, str) and value.startswith("s3://"):
        bucket = value[len("s3://") :].partition("/")[0]
        if not _BUCKET.fullmatch(bucket):
            parser.problems.append(
                f"l2: {bucket!r} is not an S3 bucket name (3 to 63 of a-z, 0-9, '.', '-'), "
                'as in "s3://bucket/prefix"'
            )
        url = value.rstrip("/")
    elif isinstance(value, str) and "://" in value:
        parser.problems.append(
            f'l2: {value!r}: expected "s3://bucket/prefix" or the path of a shared directory'
        )
    else:
        path = parser.check(lambda: parser.path(value, "l2"), None)
        if path is not None:
            reason = _never_a_directory(path)
            if reason is not None:
                parser.problems.append(f"l2: {path} can never be a directory: {reason}")
            url = str(path)
    defaults = L2Config(url="")
    endpoint = raw.get("l2_endpoint")
    if endpoint is not None:
        if not isinstance(endpoint, str) or not _ENDPOINT.fullmatch(endpoint):
            parser.problems.append(
                f'l2_endpoint: expected a URL such as "https://s3.example.com", got {endpoint!r}'
            )
        elif not url.startswith("s3://"):
            parser.problems.append("l2_endpoint: only for an l2 of the form s3://bucket/prefix")
    region = raw.get("l2_region")
    if region is not None and (not isinstance(region, str) or not region):
        parser.problems.append(
            f'l2_region: expected a region name such as "eu-west-1", got {region!r}'
        )

    def seconds(name: str, default: float, *, zero: bool = False) -> float:
        value = parser.check(lambda: parser.number(raw, name, default), default)
        if value == 0 and not zero:
            parser.problems.append(f"{name}: must be more than 0")
        return value

    timeout = seconds("l2_timeout_seconds", defaults.timeout_seconds)
    lease = seconds("l2_lease_seconds", defaults.lease_seconds, zero=True)
    retry = seconds("l2_retry_seconds", defaults.retry_seconds)
    workers = parser.workers(raw, "l2_workers", defaults.workers)
    queue = parser.check(
        lambda: parser.byte_size(raw, "l2_publish_queue_bytes", defaults.publish_queue_bytes),
        defaults.publish_queue_bytes,
    )
    return L2Config(
        url=url,
        endpoint=endpoint if isinstance(endpoint, str) else None,
        region=region if isinstance(region, str) else None,
        timeout_seconds=timeout,
        lease_seconds=lease,
        retry_seconds=retry,
        workers=workers,
        publish_queue_bytes=queue,
    )


def _never_a_directory(path: Path) -> str | None:
    """Why ``path`` can never be a directory (its nearest existing part is not one), or None.

    A path that is merely missing, unreadable or unwritable is not refused
    here: the store is created at start, or the daemon fails open.
    """
    for candidate in (path, *path.parents):
        try:
            mode = os.stat(candidate).st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # a part above it decides
        except OSError:
            return None  # cannot tell (permissions, a dead mount): the daemon finds out
        if stat.S_ISDIR(mode):
            return None
        kind = "a regular file" if stat.S_ISREG(mode) else "not a directory"
        return f"{candidate} is {kind}"
    return None
