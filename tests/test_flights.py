"""One decode per key across serving processes of one mount (store/flights.py).

While two serving processes overlap (one answering what it had read, the next
already serving), a key both are asked for is decoded once: the second waits
on the first's claim, then finds its entry stored. Here the other process is
real: it shares the store's lock (as the holder hands it on), claims a key,
decodes and stores it when told to.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import trio

from decodefs.common.entry import EntryKey
from decodefs.store.flights import FlightClaims
from tests.conftest import DaemonFactory
from tests.helpers import reference_npy, wait_for

# The other serving process: opens the same store on the lock it is handed, claims the
# key, says so, waits for a line, decodes and stores the array, lets the claim go.
_OTHER = r"""
import sys
from pathlib import Path
from decodefs.common.config import load_config
from decodefs.common.decode import decode_image
from decodefs.common.npy import npy_bytes
from decodefs.common.entry import EntryKey
from decodefs.store.store import Store
config_path, lock_fd, version, size, key, original = sys.argv[1:7]
config = load_config(Path(config_path))
store = Store.from_config(config, lock_dir=sys.argv[7])
store.open(held_lock=int(lock_fd))
assert not store.lock_taken
entry = EntryKey(version, int(size), key)
assert store.flights.claim(entry)
print("claimed", flush=True)
sys.stdin.readline()
store.write(entry, npy_bytes(decode_image(original, int(size), config.versions[version].decode)))
store.flights.release(entry)
store.close()
print("stored", flush=True)
"""


async def test_a_key_another_serving_process_decodes_is_waited_for_and_not_decoded_again(
    daemons: DaemonFactory, photos: dict[str, Path], photos_dir: Path, tmp_path: Path
) -> None:
    daemon = daemons({"v1": photos_dir}, version_keys={"sizes": [64]})
    key = EntryKey("v1", 64, "chelsea-444")
    config = tmp_path / "config.toml"
    config.write_text(f'store = "{daemon.store.root}"\n[versions.v1]\nsource = "{photos_dir}"\n')
    lock = daemon.store.lock_fd
    assert lock is not None
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _OTHER,
            str(config),
            str(lock),
            *map(str, key),
            str(photos["chelsea-444"]),
            str(tmp_path / "locks"),
        ],
        pass_fds=(lock,),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None and other.stdin is not None
        assert other.stdout.readline() == "claimed\n"
        assert not daemon.store.flights.claim(key)  # another process holds it
        got: list[bytes] = []

        async def read() -> None:
            got.append(await daemon.array("v1", 64, "chelsea-444"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await wait_for(lambda: daemon.engine.metrics.claim_waits == 1)
            assert daemon.engine.metrics.decodes == 0 and not got  # waiting, not decoding
            other.stdin.write("go\n")
            other.stdin.flush()
        assert other.stdout.readline() == "stored\n"
        assert got == [reference_npy(photos["chelsea-444"], 64)]
        metrics = daemon.engine.metrics
        assert metrics.decodes == 0 and metrics.hits == 1 and metrics.misses == 0
    finally:
        other.kill()
        other.wait()


def test_claims_conflict_between_processes_only_and_go_with_their_process(
    tmp_path: Path,
) -> None:
    lock = os.open(tmp_path / "store.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        ours = FlightClaims.beside(lock)
        key = EntryKey("v1", 64, "k")
        assert ours.claim(key) and ours.claim(key)  # our own: a process never waits on itself
        script = (
            "import os, sys\n"
            "from decodefs.common.entry import EntryKey\n"
            "from decodefs.store.flights import FlightClaims\n"
            "claims = FlightClaims.beside(int(sys.argv[1]))\n"
            "print(claims.claim(EntryKey('v1', 64, 'k')), claims.claim(EntryKey('v1', 64, 'j')))\n"
        )
        seen = subprocess.run(
            [sys.executable, "-c", script, str(lock)], pass_fds=(lock,), capture_output=True,
            text=True, check=True,
        ).stdout  # fmt: skip
        assert seen.split() == ["False", "True"]
        ours.release(key)
        seen = subprocess.run(
            [sys.executable, "-c", script, str(lock)], pass_fds=(lock,), capture_output=True,
            text=True, check=True,
        ).stdout  # fmt: skip
        assert seen.split() == ["True", "True"]  # and its claims went with it
        assert ours.claim(key)
        ours.close()
    finally:
        os.close(lock)
