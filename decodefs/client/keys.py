"""A version's keys as a mount lists them, and class labels from a folder dataset's keys.

A key names one original: its file stem in the uuid layout (``0a1b2c``), its
path without the extension in the mirror layout (``cat/0001``); it is what
``MountDataset``, ``LiveDataset`` and ``decodefs warm --uuids`` take. This
module only lists the mount's directories: it reads no array, no store and
no config.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ..common.names import key_of
from ..common.protocol import CONFIG_FILE, STATUS_DIR
from ..common.status import read_status

__all__ = ["class_labels", "list_keys", "missing_directory"]


def list_keys(
    mountpoint: str | os.PathLike[str], version: str, size: int | None = None
) -> list[str]:
    """Every key of ``version``, sorted, as ``<mountpoint>/<version>/<size>/`` lists them.

    ``size`` defaults to the first size the version lists (every size lists the
    same keys). Listing never decodes. Raises FileNotFoundError naming what is
    missing: the mount, the version (and which the mount has) or the size.
    """
    root = os.fspath(mountpoint)
    if size is None:
        size = _first_size(root, version)
    directory = os.path.join(root, version, str(size))
    if not os.path.isdir(directory):
        raise FileNotFoundError(missing_directory(root, version, size))
    keys = []

    def fail(error: OSError) -> None:
        raise error

    for folder, subfolders, names in os.walk(directory, onerror=fail):
        subfolders.sort()
        relative = os.path.relpath(folder, directory)
        prefix = "" if relative == "." else relative.replace(os.sep, "/") + "/"
        found = (key_of(prefix + name) for name in names)
        keys += [key for key in found if key is not None]
    return sorted(keys)


def class_labels(keys: Iterable[str]) -> tuple[list[str], list[int]]:
    """``(classes, labels)`` of a folder dataset's keys (``cat/0001``): the classes are
    the sorted names of the keys' first folders, ``labels[i]`` the index of
    ``keys[i]``'s class, as torchvision's ImageFolder numbers them. ValueError
    for a key in no folder."""
    folders = []
    for key in keys:
        folder, slash, _ = key.partition("/")
        if not slash:
            raise ValueError(f"key {key!r} is in no class folder (keys look like 'cat/0001')")
        folders.append(folder)
    classes = sorted(set(folders))
    index = {name: i for i, name in enumerate(classes)}
    return classes, [index[folder] for folder in folders]


def missing_directory(mountpoint: str, version: str, size: int) -> str:
    """Why ``<mountpoint>/<version>/<size>`` is not there: no mount, no such version,
    or a size out of the mount's bounds."""
    try:
        names = os.listdir(mountpoint)
    except OSError as exc:
        return f"{mountpoint} cannot be listed ({exc.strerror}): is decodefs mounted there?"
    if STATUS_DIR not in names:
        return f"{mountpoint} is not a decodefs mount: is decodefs mounted there?"
    versions = sorted(n for n in names if not n.startswith("."))
    if version not in versions:
        return f"{mountpoint} has no version {version!r} (it has: {', '.join(versions) or 'none'})"
    try:
        config = read_status(mountpoint, CONFIG_FILE)
        bounds = f" ({config['min_size']} to {config['max_size']})"
    except (OSError, ValueError, KeyError, TypeError):
        bounds = ""
    return (
        f"{mountpoint}/{version} has no size {size}: sizes are within the config's "
        f"min_size..max_size{bounds}"
    )


def _first_size(mountpoint: str, version: str) -> int:
    directory = os.path.join(mountpoint, version)
    try:
        sizes = [name for name in os.listdir(directory) if name.isdigit()]
    except OSError:
        raise FileNotFoundError(missing_directory(mountpoint, version, 0)) from None
    if not sizes:
        raise FileNotFoundError(f"{directory} lists no size")
    return int(sizes[0])
