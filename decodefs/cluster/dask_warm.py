"""`decodefs warm --cluster`: fill the cluster's L2 ahead of training on Dask workers.

The client indexes the version's originals and splits the uuids into batches;
each worker decodes its batch with ``decode_image`` and publishes the entries
straight to L2 (a create that never overwrites), skipping what L2 already
holds, so a warm run again resumes. A worker claims each array before decoding
it, as nodes do (leases.py): an array a node is decoding is left for later and
then found published, so a warm racing with readers decodes each array once.
It renews a claim while it decodes, and never removes an object but one it has
just read and found bad. Workers need the originals at the same paths and the L2
(its credentials the standard AWS way), not a mount. A worker whose Pillow or
codecs decode differently from the client's refuses to publish (its arrays would
land under another fingerprint, where no node looks). Dask is an optional extra
(``decodefs[cluster]``): only this module imports it, and only when called.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from tqdm import tqdm

from ..common.config import Config, L2Config
from ..common.decode import (
    DecodeError,
    DecodeSettings,
    decode_image,
    decoder_fingerprint,
)
from ..common.entry import EntryKey, encode_trailer
from ..common.npy import npy_bytes
from ..common.npy import npy_file_size as _npy_file_size
from ..common.protocol import TRAILER_SIZE
from ..common.source import OriginalMissing, scan_source
from . import leases
from .backends import L2Backend, L2Error, object_name, open_backend
from .leases import Claim
from .tier import RENEW_LEASES, verify_object

__all__ = [
    "BatchResult",
    "ClusterWarmReport",
    "WarmSpec",
    "cluster_warm",
    "publish_entry",
    "warm_batch",
]

_BATCH_MAX: Final = 32  # arrays a task decodes: small enough for a lively progress bar
_WAITS: Final = 3  # nodes' claims on one array waited out before decoding it anyway
_POLL_FIRST: Final = 0.05  # a pause when every array left is claimed by nodes, then 1.5x ...
_POLL_MAX: Final = 0.5  # ... up to this


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
    skipped: int = 0  # L2 held them already (or a node published them while claimed)
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
    """On a worker: decode and publish each (uuid, path) that L2 does not hold yet. An
    array a node has claimed is left for later in the batch, and looked at again."""
    result = BatchResult()
    fingerprint = decoder_fingerprint(spec.settings, keys=spec.layout)
    if fingerprint.hex != spec.fingerprint_hex:
        reason = (
            f"this worker decodes with other libraries (fingerprint {fingerprint.hex[:12]}, "
            f"the client's {spec.fingerprint_hex[:12]}): {fingerprint.description['libraries']}"
        )
        result.failed = {uuid: reason for uuid, _ in items}
        return result
    worker = _Worker(spec, _backend(spec.l2), fingerprint.hex, fingerprint.digest)
    todo = list(items)
    seen: dict[str, list[str]] = {}  # uuid -> the nodes' claims it waited for
    pause = _POLL_FIRST
    while todo:
        later = []
        for uuid, path in todo:
            try:
                claim = worker.warm(uuid, path, result, claim=len(seen.get(uuid, ())) < _WAITS)
            except L2Error as exc:
                result.failed[uuid] = f"L2 {spec.l2.url}: {exc}"
                continue
            if claim is not None:  # a node decodes it: look again after the others
                waited = seen.setdefault(uuid, [])
                if claim.name not in waited:
                    waited.append(claim.name)
                later.append((uuid, path))
        if later and len(later) == len(todo):  # nothing else to do meanwhile
            time.sleep(pause)
            pause = min(pause * 1.5, _POLL_MAX)
        else:
            pause = _POLL_FIRST
        todo = later
    return result


class _Worker:
    """One worker's view of L2 for a warm: claims under its own name."""

    def __init__(
        self, spec: WarmSpec, backend: L2Backend, fingerprint_hex: str, digest: bytes
    ) -> None:
        self.spec = spec
        self.backend = backend
        self.hex = fingerprint_hex
        self.digest = digest
        self.holder = f"warm:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.expected = _npy_file_size(spec.size) + TRAILER_SIZE

    def warm(self, uuid: str, path: str, result: BatchResult, *, claim: bool) -> Claim | None:
        """Warm one array (counted in ``result``); another node's live claim on it, if it
        has one (then nothing was done). ``claim``: False once enough were waited out."""
        key = EntryKey(self.spec.version, self.spec.size, uuid)
        name = object_name(key, self.hex)
        if self.backend.size(name) == self.expected:  # nodes verify it when they fetch it
            result.skipped += 1
            return None
        mine = None
        if claim and self.spec.l2.lease_seconds > 0:
            found = leases.take(
                self.backend, name, self.holder, time.time(), self.spec.l2.lease_seconds
            )
            if found is not None and found.holder != self.holder:
                return found
            mine = found
        with self._renewed(mine):
            if mine is not None and self.backend.size(name) == self.expected:
                result.skipped += 1  # published and let go just before we claimed
                return None
            try:
                array = decode_image(
                    path, self.spec.size, self.spec.settings, max_pixels=self.spec.max_pixels
                )
            except DecodeError as exc:
                result.failed[uuid] = f"{path}: {exc.reason}"
                return None
            except OSError as exc:
                result.failed[uuid] = f"{path}: {exc.strerror or exc}"
                return None
            payload = npy_bytes(array)
            entry = payload + encode_trailer(key, payload, self.digest)
            publish_entry(self.backend, key, name, entry, self.digest)
            result.decoded += 1
            return None

    @contextlib.contextmanager
    def _renewed(self, claim: Claim | None) -> Iterator[None]:
        """While the body runs, renew ``claim`` (ours) as the tier does (tier.py), from
        a thread; then let go of it."""
        if claim is None:
            yield
            return
        held, stop, lease = [claim], threading.Event(), self.spec.l2.lease_seconds
        taken = claim.expires - lease

        def renew() -> None:
            while not stop.wait(lease / 4):
                now = time.time()
                if now - taken >= RENEW_LEASES * lease:
                    return  # a hung decode: let the nodes go on
                if held[0].expires - now > lease / 2:
                    continue
                try:
                    renewed = leases.renew(self.backend, held[0], now, lease)
                except L2Error:
                    continue  # tried again, until it runs out
                if renewed is None:
                    return  # taken over: it ran out
                held[0] = renewed

        renewer = threading.Thread(target=renew, name="decodefs-warm-renew", daemon=True)
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            renewer.join()  # a renewal under way ends first: it is the term let go of
            leases.release(self.backend, held[0])


def publish_entry(
    backend: L2Backend, key: EntryKey, name: str, entry: bytes, digest: bytes
) -> Literal["created", "kept", "replaced"]:
    """Create the object ``name`` holding ``entry`` (``key``'s). One there already is
    replaced only if it is read now and found bad: a good one (another node's publish)
    or another decodefs format's is kept."""
    if backend.create(name, entry):
        return "created"
    there = backend.get(name, len(entry))
    if there is not None:
        problem, foreign = verify_object(key, there, digest)
        if problem is None or foreign:
            return "kept"
        backend.delete(name)
    return "replaced" if backend.create(name, entry) else "kept"


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
    keys: Sequence[str] | None,
    progress: bool = True,
) -> ClusterWarmReport:
    """Warm ``version`` at ``size`` into ``config.l2`` on the Dask cluster at ``address``."""
    # Imported here (an optional extra), and untyped: distributed's own hints are partial.
    distributed: Any = importlib.import_module("distributed")
    Client, as_completed = distributed.Client, distributed.as_completed  # noqa: N806
    assert config.l2 is not None
    settings = config.versions[version]
    source = scan_source(version, settings.source, settings.extensions, settings.duplicates)
    wanted = list(source.keys) if keys is None else list(dict.fromkeys(keys))
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
