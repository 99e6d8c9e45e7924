"""`decodefs adopt`: an existing <version>/<size>/<uu>/<uuid>.npy cache becomes store entries.

Run as a user would (the CLI in a subprocess), then checked as a user would:
the mount serves every adopted array without decoding, `decodefs verify`
passes, and what was not adopted is still in the cache.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from decodefs import DecodeSettings, decode_image
from decodefs.common.config import load_config
from decodefs.common.decode import decoder_fingerprint
from decodefs.common.entry import EntryKey, encode_trailer
from decodefs.common.protocol import TRAILER_SIZE
from decodefs.store.store import Store
from tests.conftest import MountFactory
from tests.helpers import decodefs, reference_npy, wait_until, write_config

SIZE = 48


def write_cache(cache: Path, photos: dict[str, Path], size: int = SIZE) -> dict[str, Path]:
    """A team's cache as their own code wrote it: np.save of the default decode. uuid -> file."""
    files = {}
    for uuid, original in photos.items():
        path = cache / "v1" / str(size) / uuid[:2] / f"{uuid}.npy"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(reference_npy(original, size))
        files[uuid] = path
    return files


def cache_files(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()}


def adopt(cache: Path, config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return decodefs("adopt", cache, "v1", str(SIZE), "--config", config, *args)


def test_adopt_move_takes_the_cache_into_the_store_and_the_mount_serves_it_undecoded(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    files = write_cache(cache, photos)
    unknown = cache / "v1" / str(SIZE) / "zz" / "zz-no-such-original.npy"
    unknown.parent.mkdir()
    unknown.write_bytes(reference_npy(photos["coffee-webp"], SIZE))
    bad = cache / "v1" / str(SIZE) / "as" / "astronaut-palette.npy"
    np.save(bad, np.zeros((SIZE, SIZE, 3), np.float32))  # right uuid, wrong array
    misplaced = cache / "v1" / str(SIZE) / "zz" / "camera-gray.npy"
    os.rename(files.pop("camera-gray"), misplaced)  # not in its <uu>/
    (cache / "v1" / str(SIZE) / "ch" / "notes.txt").write_text("not an array")
    elsewhere = tmp_path / "someone-elses.npy"  # the right bytes, but not the cache's file
    os.rename(files.pop("coffee-webp"), elsewhere)
    (cache / "v1" / str(SIZE) / "co" / "coffee-webp.npy").symlink_to(elsewhere)
    config = write_config(tmp_path / "adopt.toml", tmp_path / "store", {"v1": photos_dir})

    result = adopt(cache, config, "--sample", "100", "--move")
    assert result.returncode == 0, result.stderr
    adopted = len(photos) - 3
    # Every candidate sampled; the float array was found no .npy of ours, not compared.
    assert f"sample: {adopted} arrays decoded again, each equal byte for byte" in result.stdout
    assert f"adopted {adopted} arrays of v1/{SIZE}" in result.stdout
    assert f"0 copied (the cache keeps them), {adopted} moved into the store" in result.stdout
    assert "left in the cache: 1 with no original in the version (e.g. zz-no-such-original)" in (
        result.stderr
    )
    assert "left in the cache: 3 not a stored array's .npy" in result.stderr
    assert cache_files(cache) == {  # moved away: what was not adopted stays
        f"v1/{SIZE}/zz/zz-no-such-original.npy",
        f"v1/{SIZE}/as/astronaut-palette.npy",
        f"v1/{SIZE}/zz/camera-gray.npy",
        f"v1/{SIZE}/co/coffee-webp.npy",
        f"v1/{SIZE}/ch/notes.txt",
    }
    assert elsewhere.read_bytes() == reference_npy(photos["coffee-webp"], SIZE)
    verify = decodefs("verify", config)
    assert verify.returncode == 0 and f"{adopted} ok, 0 corrupt" in verify.stdout, verify.stdout
    entry = tmp_path / "store" / "v1" / str(SIZE) / "ch" / "chelsea-444.npy"
    assert entry.stat().st_mode & 0o777 == 0o600  # the store's modes (root's originals)

    mount = mounts({"v1": photos_dir})  # the same store
    for uuid, original in photos.items():
        if uuid not in ("astronaut-palette", "camera-gray", "coffee-webp"):
            path = mount.path("v1", str(SIZE), f"{uuid}.npy")
            assert path.read_bytes() == reference_npy(original, SIZE), uuid
    stats = mount.stats()
    assert stats["decodes"] == 0 and stats["hits"] == adopted  # served, never decoded
    assert stats["store_entries"] == adopted  # each with its catalog row

    again = adopt(cache, config)  # while the daemon runs: refused, one line naming it
    assert again.returncode == 1 and again.stdout == ""
    assert again.stderr.startswith("decodefs: error: the store ")
    pid = stats["holder_pid"]  # the mount's holder: it keeps the store's lock
    assert f"is in use by a running decodefs daemon (pid {pid}); stop it first" in again.stderr
    assert f"it is the daemon of {mount.mountpoint} (stop it: `decodefs umount " in again.stderr
    assert len(again.stderr.splitlines()) == 1


def test_adopt_copies_by_default_and_move_copies_files_that_are_not_the_store_users_alone(
    photos_dir: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    files = write_cache(cache, photos)
    shared = files["chelsea-444"].parent
    shared.chmod(0o775)  # a group may write here: its files are copied, not moved
    linked = files["hubble-original"]
    os.link(linked, tmp_path / "another-name.npy")  # a second link: copied
    config = write_config(tmp_path / "adopt.toml", tmp_path / "store", {"v1": photos_dir})

    result = adopt(cache, config, "--sample", "2", "--move")
    assert result.returncode == 0, result.stderr
    copied = {u for u, p in files.items() if p.parent == shared or p == linked}
    moved = len(photos) - len(copied)
    assert f"{len(copied)} copied (the cache keeps them), {moved} moved into the store" in (
        result.stdout
    )
    assert cache_files(cache) == {str(files[u].relative_to(cache)) for u in copied}
    for uuid in copied:  # a copy leaves the file as it was
        assert files[uuid].read_bytes() == reference_npy(photos[uuid], SIZE)
    assert decodefs("verify", config).returncode == 0

    everything = tmp_path / "cache-copied"
    write_cache(everything, photos)
    before = {p: p.read_bytes() for p in everything.rglob("*.npy")}
    store = tmp_path / "store-2"
    config2 = write_config(tmp_path / "adopt2.toml", store, {"v1": photos_dir})
    result = adopt(everything, config2)  # the default: copies, whoever owns the files
    assert result.returncode == 0, result.stderr
    assert f"{len(photos)} copied (the cache keeps them), 0 moved into the store" in result.stdout
    assert {p: p.read_bytes() for p in everything.rglob("*.npy")} == before
    for path, data in before.items():
        entry = store / path.relative_to(everything)
        assert entry.read_bytes()[:-TRAILER_SIZE] == data
    again = adopt(everything, config2, "--copy")  # resumes: what is stored is skipped
    assert again.returncode == 0, again.stderr
    assert f"adopted 0 arrays of v1/{SIZE}" in again.stdout
    assert f"{len(photos)} were stored already" in again.stdout


def test_a_cache_decoded_another_way_is_refused_or_its_differing_arrays_skipped(
    photos_dir: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    config = write_config(tmp_path / "adopt.toml", tmp_path / "store", {"v1": photos_dir})
    cache = tmp_path / "cache"
    files = write_cache(cache, photos)
    victims = sorted(photos)[4:6]
    for victim in victims:
        data = bytearray(files[victim].read_bytes())
        data[-1] ^= 1  # one pixel, one bit
        files[victim].write_bytes(bytes(data))
    before = cache_files(cache)

    result = adopt(cache, config, "--sample", "100")  # every array sampled
    assert result.returncode == 1
    assert result.stderr.startswith(
        f"decodefs: error: 2 of {len(photos)} sampled arrays differ from what decode_image "
        "makes of their originals with versions.v1's decode settings (resample = "
        '"bilinear", fit = "stretch", exif_transpose = false, draft = false; Pillow '
    )
    assert f"e.g. {victims[0]}: {files[victims[0]]} (first difference at byte " in result.stderr
    assert "nothing adopted" in result.stderr and "--skip-differing" in result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert cache_files(cache) == before
    assert not list((tmp_path / "store").glob("v1/*/*/*.npy"))

    # On request: every array checked, the two that differ left in the cache, named.
    result = adopt(cache, config, "--sample", "1", "--skip-differing")
    assert result.returncode == 0, result.stderr
    assert f"checked: {len(photos) - 2} arrays decoded again, each equal" in result.stdout
    assert f"adopted {len(photos) - 2} arrays" in result.stdout
    assert (
        f"left in the cache: 2 that differ from a fresh decode (e.g. {victims[0]}: "
        f"{files[victims[0]]} (first difference at byte "
    ) in result.stderr
    assert cache_files(cache) == before  # copied: the cache keeps everything
    assert sorted(p.stem for p in (tmp_path / "store").glob("v1/*/*/*.npy")) == sorted(
        set(photos) - set(victims)
    )

    bicubic = tmp_path / "cache-bicubic"  # decoded with other settings
    for uuid, original in photos.items():
        path = bicubic / "v1" / str(SIZE) / uuid[:2] / f"{uuid}.npy"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, decode_image(original, SIZE, DecodeSettings(resample="bicubic")))
    result = adopt(bicubic, config, "--sample", "2")
    assert result.returncode == 1
    assert "error: all 2 sampled arrays differ" in result.stderr
    assert "set them under [versions.v1] (resample, fit, exif_transpose, draft)" in result.stderr

    # A mirror version names originals by relative path, the cache by stem: refused.
    mirror = write_config(
        tmp_path / "mirror.toml", tmp_path / "store", {"v1": photos_dir}, version_layout="mirror"
    )
    result = adopt(cache, mirror)
    assert result.returncode == 1
    assert result.stderr.startswith("decodefs: error: version 'v1' has layout = 'mirror'")
    assert cache_files(cache) == before


def test_adopt_leaves_the_other_versions_of_the_store_alone(
    photos_dir: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    # The config also has a mirror version, whose arrays the daemon stored under that
    # version's own fingerprint (its layout included): adopt must open the store with
    # the same fingerprints, or the store takes them for stale and discards them.
    config_path = write_config(tmp_path / "adopt.toml", tmp_path / "store", {"v1": photos_dir})
    with config_path.open("a") as config_file:
        config_file.write(f'[versions.folders]\nsource = "{photos_dir}"\nlayout = "mirror"\n')
    config = load_config(config_path)
    store = Store.from_config(config)  # as the daemon opens it
    store.open()
    store.close()
    kept = tmp_path / "store" / "folders" / "kept"
    kept.write_bytes(b"an array the daemon stored")
    marker = (tmp_path / "store" / "folders" / ".fingerprint.json").read_bytes()

    write_cache(tmp_path / "cache", photos)
    result = adopt(tmp_path / "cache", config_path)
    assert result.returncode == 0, result.stderr
    assert "discarding" not in result.stderr
    assert kept.read_bytes() == b"an array the daemon stored"
    assert (tmp_path / "store" / "folders" / ".fingerprint.json").read_bytes() == marker


def tiny_corpus(directory: Path, count: int) -> dict[str, Path]:
    """``count`` small PNG originals (a large cache adopts for long enough to interrupt)."""
    rng = np.random.default_rng(3)
    paths = {}
    for i in range(count):
        path = directory / f"d{i % 8}" / f"{i:05d}-tiny.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(buffer, "PNG")
        path.write_bytes(buffer.getvalue())
        paths[path.stem] = path
    return paths


def test_adopt_is_interruptible_and_resumes(tmp_path: Path) -> None:
    originals = tiny_corpus(tmp_path / "originals", 2000)
    cache = tmp_path / "cache"
    write_cache(cache, originals)
    config = write_config(
        tmp_path / "adopt.toml", tmp_path / "store", {"v1": tmp_path / "originals"}
    )
    store_arrays = tmp_path / "store" / "v1" / str(SIZE)

    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "decodefs",
            "adopt",
            cache,
            "v1",
            str(SIZE),
            "--config",
            config,
            "--move",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(
        lambda: store_arrays.is_dir() and any(store_arrays.glob("*/*.npy")),
        what="entries adopted",
    )
    process.send_signal(signal.SIGINT)  # Ctrl-C
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "interrupted; run the same command again to resume" in stderr
    stored = sum(1 for _ in store_arrays.glob("*/*.npy"))
    left = sum(1 for _ in cache.rglob("*.npy"))
    assert 0 < stored < len(originals) and stored + left == len(originals)  # none half-moved
    assert f"adopted {stored:,} arrays" in stdout
    assert not list((tmp_path / "store" / ".tmp").iterdir())
    verify = decodefs("verify", config)
    assert verify.returncode == 0 and f"{stored:,} ok, 0 corrupt" in verify.stdout
    for path in cache.rglob("*.npy"):  # the rest of the cache as it was
        assert path.stat().st_size == 128 + SIZE * SIZE * 3

    # A move cut short after its trailer went on (kill -9, power cut) is taken as it is;
    # other bytes after the array are not ours: that file stays.
    cut_short, garbage = sorted(cache.rglob("*.npy"))[:2]
    payload = cut_short.read_bytes()
    digest = decoder_fingerprint(DecodeSettings()).digest
    key = EntryKey("v1", SIZE, cut_short.stem)
    cut_short.write_bytes(payload + encode_trailer(key, payload, digest))
    garbage.write_bytes(garbage.read_bytes() + bytes(TRAILER_SIZE))

    again = adopt(cache, config, "--sample", "3", "--move")
    assert again.returncode == 0, again.stderr
    assert f"adopted {left - 1:,} arrays" in again.stdout
    assert "left in the cache: 1 not a stored array's .npy" in again.stderr
    assert sum(1 for _ in store_arrays.glob("*/*.npy")) == len(originals) - 1
    assert list(cache.rglob("*.npy")) == [garbage]
    assert decodefs("verify", config).returncode == 0
