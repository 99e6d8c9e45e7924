"""`decodefs warm --cluster`: fill the cluster's L2 ahead of training on Dask workers.

The client indexes the version's originals and splits the uuids into batches;
each worker decodes its batch with ``decode_image`` and publishes the entries
straight to L2 (a create that never overwrites), skipping what L2 already
holds, so a warm run again resumes. Workers need the originals at the same
paths and the L2 (its credentials the standard AWS way), not a mount. A worker
whose Pillow or codecs decode differently from the client's refuses to
publish (its arrays would land under another fingerprint, where no node
looks). Dask is an optional extra (``decodefs[cluster]``): only this module
imports it, and only when called.
"""

from __future__ import annotations

import functools
import importlib
import math
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from tqdm import tqdm

from .config import Config, L2Config
from .decode import DecodeError, DecodeSettings, decode_image, decoder_fingerprint, npy_bytes
from .decode import npy_file_size as _npy_file_size
from .entry import EntryKey, encode_trailer
from .l2 import L2Backend, L2Error, object_name, open_backend
from .protocol import TRAILER_SIZE
from .source import OriginalMissing, scan_source

__all__ = ["BatchResult", "ClusterWarmReport", "WarmSpec", "cluster_warm", "warm_batch"]

_BATCH_MAX: Final = 32  # arrays a task decodes: small enough for a lively progress bar


@dataclass(frozen=True)
class WarmSpec:
    """What every worker needs (sent with each task; small and picklable)."""

    l2: L2Config
    version: str
    size: int
    settings: DecodeSettings
    layout: str  # which original a key names: part of the fingerprint
    max_pixels: int
    fingerprint_hex: str  # the client's: a worker that decodes differently refuses


@dataclass
class BatchResult:
    decoded: int = 0  # decoded and published (or found published meanwhile)
    skipped: int = 0  # L2 held them already
    failed: dict[str, str] = field(default_factory=dict)  # uuid -> reason


@dataclass
class ClusterWarmReport:
    total: int
    workers: int = 0
    decoded: int = 0
    skipped: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # uuids the version does not have
    seconds: float = 0.0
    interrupted: bool = False

    @property
    def done(self) -> int:
        return self.decoded + self.skipped


class SchedulerUnreachable(Exception):
    """The Dask scheduler did not answer (a user error: the address)."""


def warm_batch(spec: WarmSpec, items: Sequence[tuple[str, str]]) -> BatchResult:
    """On a worker: decode and publish each (uuid, path) that L2 does not hold yet."""
    result = BatchResult()
    fingerprint = decoder_fingerprint(spec.settings, keys=spec.layout)
    if fingerprint.hex != spec.fingerprint_hex:
        reason = (
            f"this worker decodes with other libraries (fingerprint {fingerprint.hex[:12]}, "
            f"the client's {spec.fingerprint_hex[:12]}): {fingerprint.description['libraries']}"
        )
        result.failed = {uuid: reason for uuid, _ in items}
        return result
    backend = _backend(spec.l2)
    expected = _npy_file_size(spec.size) + TRAILER_SIZE
    for uuid, path in items:
        key = EntryKey(spec.version, spec.size, uuid)
        name = object_name(key, fingerprint.hex)
        try:
            if backend.size(name) == expected:  # daemons verify it when they fetch it
                result.skipped += 1
                continue
            try:
                array = decode_image(path, spec.size, spec.settings, max_pixels=spec.max_pixels)
            except DecodeError as exc:
                result.failed[uuid] = f"{path}: {exc.reason}"
                continue
            except OSError as exc:
                result.failed[uuid] = f"{path}: {exc.strerror or exc}"
                continue
            payload = npy_bytes(array)
            if backend.size(name) is not None:
                backend.delete(name)  # of the wrong length: verified bad
            backend.create(name, payload + encode_trailer(key, payload, fingerprint.digest))
            result.decoded += 1
        except L2Error as exc:
            result.failed[uuid] = f"L2 {spec.l2.url}: {exc}"
    return result


def _probe(address: str) -> None:
    """Fail at once for a TCP scheduler address nothing listens at (Dask retries for long)."""
    if not address.startswith("tcp://"):
        return
    host, _, port = address[len("tcp://") :].rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except (OSError, ValueError) as exc:
        raise SchedulerUnreachable(f"cannot reach the Dask scheduler at {address}: {exc}") from None


@functools.cache
def _backend(config: L2Config) -> L2Backend:
    """One L2 client per worker process (a boto3 client is thread-safe and slow to make)."""
    return open_backend(config)


def cluster_warm(
    address: str,
    config: Config,
    version: str,
    size: int,
    uuids: Sequence[str] | None,
    progress: bool = True,
) -> ClusterWarmReport:
    """Warm ``version`` at ``size`` into ``config.l2`` on the Dask cluster at ``address``."""
    # Imported here (an optional extra), and untyped: distributed's own hints are partial.
    distributed: Any = importlib.import_module("distributed")
    Client, as_completed = distributed.Client, distributed.as_completed  # noqa: N806
    assert config.l2 is not None
    settings = config.versions[version]
    source = scan_source(version, settings.source, settings.extensions, settings.duplicates)
    wanted = list(source.uuids) if uuids is None else list(dict.fromkeys(uuids))
    report = ClusterWarmReport(total=len(wanted))
    items: list[tuple[str, str]] = []
    for uuid in wanted:
        index = source.find(uuid)
        if index is None:
            report.missing.append(uuid)
            continue
        try:
            items.append((uuid, source.original_path(index)))
        except OriginalMissing as exc:
            report.failed[uuid] = str(exc)
    spec = WarmSpec(
        l2=config.l2,
        version=version,
        size=size,
        settings=settings.decode,
        layout=settings.layout,
        max_pixels=config.max_pixels,
        fingerprint_hex=settings.fingerprint().hex,
    )
    started = time.monotonic()
    _probe(address)
    try:
        client = Client(address, timeout="20s")
    except (OSError, TimeoutError) as exc:
        raise SchedulerUnreachable(f"cannot reach the Dask scheduler at {address}: {exc}") from None
    bar = tqdm(total=len(items), unit="img", disable=not progress, mininterval=0.5, smoothing=0.1)
    futures: list[Any] = []
    try:
        report.workers = len(client.scheduler_info().get("workers", {}))
        per_batch = max(1, min(_BATCH_MAX, math.ceil(len(items) / max(1, 4 * report.workers))))
        batches = [items[i : i + per_batch] for i in range(0, len(items), per_batch)]
        futures = client.map(warm_batch, [spec] * len(batches), batches, pure=False)
        sizes = {future.key: len(batch) for future, batch in zip(futures, batches, strict=True)}
        for future in as_completed(futures):
            batch = sizes[future.key]
            try:
                result: BatchResult = future.result()
            except Exception as exc:  # the task itself failed (a worker without decodefs ...)
                index = futures.index(future)
                for uuid, _ in batches[index]:
                    report.failed[uuid] = f"the task failed on its worker: {exc!r}"
            else:
                report.decoded += result.decoded
                report.skipped += result.skipped
                report.failed.update(result.failed)
            bar.update(batch)
    except KeyboardInterrupt:
        report.interrupted = True
        client.cancel(futures)
    finally:
        bar.close()
        client.close()
        report.seconds = time.monotonic() - started
    return report
