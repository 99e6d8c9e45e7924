"""The package's folders and the one rule of which may import which (docs/architecture.md).

The rule, read from the tree itself (every import statement of decodefs/, by
its AST): a folder imports only the folders below it; across folders, only
what the other folder's ``__init__`` exports (for the shared vocabulary,
``common``, its rooms are its exports); nothing imports the daemon (the holder
starts it as a process); the holder imports only rooms of the vocabulary that
need nothing beyond Python itself. And what the rule is for: ``decodefs stats``,
``warm``, ``umount``, ``verify`` and every error path run without pyfuse3 or
trio, and the holder runs no decode, store, SQLite or FUSE library code.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import MountFactory
from tests.helpers import write_config

PACKAGE = Path(__file__).resolve().parents[1] / "decodefs"
FACE = "faces"  # the modules at the package's root: decodefs, decodefs.torch, decodefs.sample

# folder -> the folders it may import. Anything not listed is refused.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "common": frozenset(),
    "store": frozenset({"common"}),
    "cluster": frozenset({"common"}),
    "client": frozenset({"common"}),
    "daemon": frozenset({"common", "store", "cluster"}),
    "holder": frozenset({"common"}),
    "cli": frozenset({"common", "store", "cluster", "client", "holder", FACE}),
    FACE: frozenset({"common", "client"}),
}
# `python -m decodefs` runs the command.
ENTRY_POINT = ("__main__", "cli")
# The rooms of the vocabulary the holder may use: none imports a package beyond Python's.
HOLDER_ROOMS = frozenset(
    {"channel", "mounts", "protocol", "runtime", "startlog", "status", "trusted", "version"}
)


@dataclass(frozen=True)
class Arrow:
    """One import of one decodefs module by another."""

    source: str  # the importing module, dotted below decodefs ("daemon.engine")
    target: str  # the imported module, dotted below decodefs ("store", "common.config", "")
    names: tuple[str, ...]  # what it takes from the target (from-imports)
    function: str | None  # the function the import sits in; None at module level
    line: int

    @property
    def where(self) -> str:
        return f"decodefs/{self.source.replace('.', '/')}.py:{self.line}"


def folder_of(module: str) -> str:
    """The folder a module (dotted below decodefs) belongs to; FACE for the root's."""
    head, dot, _ = module.partition(".")
    return head if head and (dot or (PACKAGE / head).is_dir()) else FACE


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def arrows() -> list[Arrow]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        functions = {
            node: fn.name
            for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
            for node in ast.walk(fn)
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            targets: list[tuple[str, tuple[str, ...]]] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                elif node.module and (node.module + ".").startswith("decodefs."):
                    target = node.module.removeprefix("decodefs").lstrip(".")
                else:
                    continue
                taken = []
                for alias in node.names:  # `from .. import daemon` imports the daemon
                    submodule = f"{target}.{alias.name}" if target else alias.name
                    if is_module(submodule) and alias.name not in folder_exports(target):
                        targets.append((submodule, ()))
                    else:
                        taken.append(alias.name)
                if taken:
                    targets.append((target, tuple(taken)))
            else:
                for alias in node.names:
                    if (alias.name + ".").startswith("decodefs."):
                        targets.append((alias.name.removeprefix("decodefs").lstrip("."), ()))
            for target, names in targets:
                found.append(Arrow(module, target, names, functions.get(node), node.lineno))
    return found


def is_module(module: str) -> bool:
    """Whether ``module`` (dotted below decodefs) is a module or a package of decodefs."""
    path = PACKAGE.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def folder_exports(package: str) -> set[str]:
    """What a folder's ``__init__`` exports; nothing for the root or a room."""
    return exports(package) if package in MAY_IMPORT else set()


def exports(package: str) -> set[str]:
    """The names in ``decodefs.<package>``'s ``__all__`` (read from its source)."""
    path = (
        PACKAGE / package.replace(".", "/") / "__init__.py" if package else PACKAGE / "__init__.py"
    )
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__")


def arrow_problems(arrow: Arrow) -> list[str]:
    """What is wrong with one arrow under the rule (nothing: [])."""
    source, target = folder_of(arrow.source), folder_of(arrow.target) if arrow.target else FACE
    if source == target or (arrow.source, arrow.target) == ENTRY_POINT:
        return []
    if target not in MAY_IMPORT[source]:
        return [f"{arrow.where}: {source} may not import {target} ({arrow.target})"]
    if target == "common":
        room = arrow.target.partition(".")[2]
        taken = {room} if room else set(arrow.names)
        unknown = taken - exports("common")
        if unknown:
            return [f"{arrow.where}: common does not export {sorted(unknown)}"]
        if source == "holder" and taken - HOLDER_ROOMS:
            return [f"{arrow.where}: the holder may not use {sorted(taken - HOLDER_ROOMS)}"]
        return []
    if target == FACE:
        return []
    if arrow.target != target:
        return [f"{arrow.where}: imports the room {arrow.target}, not what {target} exports"]
    unknown = set(arrow.names) - exports(target)
    return [f"{arrow.where}: {target} does not export {sorted(unknown)}"] if unknown else []


def test_every_module_is_in_a_folder_the_rule_names() -> None:
    folders = {folder_of(module_name(path)) for path in PACKAGE.rglob("*.py")}
    assert folders == set(MAY_IMPORT)
    faces = {module_name(p) for p in PACKAGE.glob("*.py")}
    assert faces == {"", "__main__", "reader", "sample", "torch"}


def test_every_import_across_folders_follows_the_rule() -> None:
    found = arrows()
    assert len(found) > 100, "the walk found too few imports to be reading the package"
    problems = [problem for arrow in found for problem in arrow_problems(arrow)]
    assert not problems, "\n".join(problems)


def test_the_holders_vocabulary_needs_nothing_beyond_python() -> None:
    """The rooms the holder may use import no package but Python's own, and no other room."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for room in HOLDER_ROOMS:
        tree = ast.parse((PACKAGE / "common" / f"{room}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.ImportFrom):
                assert node.module in HOLDER_ROOMS, (room, node.module)
                continue
            else:
                continue
            for name in names:
                assert name.partition(".")[0] in stdlib, (room, name)


def test_the_shared_vocabulary_imports_nothing_else_of_decodefs() -> None:
    outside = [
        a.where
        for a in arrows()
        if folder_of(a.source) == "common" and (not a.target or folder_of(a.target) != "common")
    ]
    assert not outside


@pytest.mark.parametrize(
    ("source", "target", "names", "function", "broken"),
    [
        ("store.verify", "store.catalog", ("Catalog",), None, False),  # within a folder
        ("daemon.engine", "store", ("Store",), None, False),
        ("daemon.engine", "store.store", ("Store",), None, True),  # a room, not the face
        ("daemon.engine", "store", ("Capacity",), None, True),  # not exported
        ("store.store", "daemon", ("serve",), None, True),  # upwards
        ("client.reader", "store", ("Store",), None, True),  # sideways
        ("common.entry", "store", ("Store",), None, True),  # the vocabulary imports nothing
        ("cli.commands", "daemon", (), "run_mount", True),  # the holder starts it, by name
        ("cli.commands", "daemon", (), None, True),
        ("cli.commands", "holder", ("ask_holder",), None, False),
        ("holder.supervisor", "common.channel", (), None, False),
        ("holder.supervisor", "common.config", (), None, True),  # Pillow, by decode.py
        ("holder.supervisor", "store", ("Store",), None, True),
        ("holder.servers", "daemon", ("main",), None, True),
        ("client.keys", "common.protocol", ("STATUS_DIR",), None, False),
        ("client.keys", "common.nothing", ("X",), None, True),
        ("torch", "daemon", ("serve",), None, True),
        ("torch", "cli", ("main",), None, True),
        ("__main__", "cli", ("main",), None, False),
    ],
)
def test_the_rule_refuses_what_it_must(
    source: str, target: str, names: tuple[str, ...], function: str | None, broken: bool
) -> None:
    """The checker itself: each kind of arrow it must refuse is refused."""
    assert bool(arrow_problems(Arrow(source, target, names, function, 1))) is broken


# Runs the command in a fresh interpreter where pyfuse3 and trio cannot be imported.
_WITHOUT_DAEMON = textwrap.dedent(
    """
    import importlib.abc, sys

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("pyfuse3", "trio"):
                raise ModuleNotFoundError(f"test_layers refuses {name}", name=name)
            return None

    sys.meta_path.insert(0, Refuse())
    from decodefs.cli import main
    code = main(sys.argv[1:])
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ("pyfuse3", "trio"))
    assert not loaded, loaded
    sys.exit(code)
    """
)


def without_daemon(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_DAEMON, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_error_paths_run_without_pyfuse3_or_trio(tmp_path: Path, originals: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("store = 3\n")
    good = write_config(tmp_path / "good.toml", tmp_path / "store", {"v1": originals})
    empty = tmp_path / "empty"
    empty.mkdir()
    full = tmp_path / "full"
    full.mkdir()
    (full / "a file").write_bytes(b"")
    cases = [
        ("stats", empty),
        ("umount", empty),
        ("warm", empty, "v1", "64"),
        ("verify", tmp_path / "no-such-store"),
        ("mount", empty, "--config", bad),
        ("mount", empty, "--config", tmp_path / "missing.toml"),
        ("mount", full, "--config", good),  # not empty: the mount would hide its files
        ("mount", full, "--config", good, "--foreground"),
        ("mount", tmp_path / "nowhere", "--config", good),
    ]
    for case in cases:
        result = without_daemon(*case)
        assert result.returncode == 1, (case, result.stderr)
        assert result.stderr.startswith("decodefs: error: "), (case, result.stderr)
        assert "Traceback" not in result.stderr, (case, result.stderr)


def test_stats_warm_verify_and_umount_of_a_live_mount_run_without_pyfuse3_or_trio(
    mounts: MountFactory, originals: Path
) -> None:
    mount = mounts({"v1": originals}, sizes=[32])
    warmed = without_daemon("warm", mount.mountpoint, "v1", "32")
    assert warmed.returncode == 0, warmed.stderr
    stats = without_daemon("stats", mount.mountpoint)
    assert stats.returncode == 0, stats.stderr
    assert "decodes" in stats.stdout
    checked = without_daemon("verify", mount.config)  # while the daemon holds the store
    assert checked.returncode == 0 and "0 corrupt" in checked.stdout, checked.stderr
    unmounted = without_daemon("umount", mount.mountpoint)
    assert unmounted.returncode == 0, unmounted.stderr
    assert mount.process is not None and mount.process.wait(timeout=30) == 0
    verified = without_daemon("verify", "--remove", mount.config)  # no daemon holds it now
    assert verified.returncode == 0 and "0 corrupt" in verified.stdout, verified.stderr


# Imports the client in a fresh interpreter where Pillow cannot be imported, and reads an
# array with it: a training process that reads arrays never loads Pillow.
_WITHOUT_PILLOW = textwrap.dedent(
    """
    import importlib.abc, sys

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == "PIL":
                raise ModuleNotFoundError(f"test_layers refuses {name}", name=name)
            return None

    sys.meta_path.insert(0, Refuse())
    import numpy as np
    import decodefs.client
    from decodefs import npy_file_size

    array = np.arange(4 * 4 * 3, dtype=np.uint8).reshape(4, 4, 3)
    np.save(sys.argv[1], array)
    assert (decodefs.client.read_array(sys.argv[1]) == array).all()
    assert npy_file_size(4) == 128 + 4 * 4 * 3
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] == "PIL")
    assert not loaded, loaded
    """
)


def test_the_client_loads_and_reads_without_pillow(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_PILLOW, str(tmp_path / "array.npy")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_the_face_gives_decode_and_the_config_at_their_first_use() -> None:
    import decodefs
    from decodefs.common import config, decode

    for name in decodefs.__all__:
        assert getattr(decodefs, name) is not None, name
    assert decodefs.decode_image is decode.decode_image
    assert decodefs.load_config is config.load_config
    assert set(decodefs.__all__) <= set(dir(decodefs))
    with pytest.raises(AttributeError):
        _ = decodefs.no_such_name  # type: ignore[attr-defined]


def test_the_architecture_doc_names_every_module() -> None:
    """docs/architecture.md's tables stay the map: every room of the package is in them."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    rooms = sorted(p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    assert [room for room in rooms if f"`{room}`" not in doc and room not in doc] == []
