"""Every code block of README.md and docs/*.md runs as pasted, against a sample mount.

The documentation's paths stand for a sample set up here: the same names
(`abc.jpg` among v1's originals; `cat/`, `dog/`, an empty `bird/` in pets), a
real mount, config and store, each documented path replaced by its stand-in.
`python` blocks run in a fresh interpreter, `sh` blocks in bash (`-e`, with
this environment's `decodefs` and `python` first on the PATH), `toml` blocks
go through load_config; `text` blocks are output and are not run. A block
that cannot run here is preceded by `<!-- not run: REASON -->`, and REASON
must be one of NOT_RUN: the set is small, and each says where else it is
checked. The quick start's demo runs too, on a 4-image corpus, and prints
what the README shows.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from decodefs.common.config import load_config, parse_config
from decodefs.common.protocol import STATUS_FILES
from decodefs.sample import make_sample_corpus, photo_like
from tests.helpers import decodefs, is_mounted, unmount_quietly

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LANGUAGES = ("python", "sh", "toml", "text")

# Why a block may be left out, each with where else it is checked.
NOT_RUN = {
    "installs software": "scripts/setup.sh installs the same on every CI run",
    "installs a system service": "tests/test_mount_service.py stages and verifies the units",
    "scripts/test.sh is the test suite itself": "CI runs it; the demo runs below",
    "the test suite and mutation runs themselves": "CI runs scripts/test.sh",
    "a benchmark": "minutes long, run by hand; its figures are in the document",
    "the reproducer of a fixed defect": "python -m scripts.reliability runs it (root, minutes)",
    "needs a Dask scheduler and an L2": "tests/test_mount_cluster.py runs both on loopback",
}
_FENCE = re.compile(r"^```(.*)$")
_NOT_RUN = re.compile(r"^<!-- not run: (.+) -->$")
_UNEXPECTED = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback")


@dataclass(frozen=True)
class Block:
    document: Path
    line: int  # of the opening fence
    language: str
    code: str
    not_run: str | None  # the marker's reason

    def __str__(self) -> str:
        return f"{self.document.relative_to(REPO)}:{self.line}"


def blocks(document: Path) -> Iterator[Block]:
    lines = document.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i] != "```":
            i += 1
        marker = _NOT_RUN.match(lines[start - 1]) if start else None
        code = "\n".join(lines[start + 1 : i]) + "\n"
        yield Block(document, start + 1, fence[1].strip(), code, marker[1] if marker else None)
        i += 1


ALL_BLOCKS = [block for document in DOCUMENTS for block in blocks(document)]
RUN = [b for b in ALL_BLOCKS if b.language != "text" and b.not_run is None]


def test_every_block_says_what_it_is_and_why_one_is_not_run() -> None:
    assert RUN, "no code block found"
    for block in ALL_BLOCKS:
        assert block.language in LANGUAGES, f"{block}: tag the block as one of {LANGUAGES}"
        if block.not_run is not None:
            assert block.language != "text", f"{block}: a text block is never run anyway"
            assert block.not_run.startswith(tuple(NOT_RUN)), (
                f"{block}: 'not run: {block.not_run}' is none of the reasons tests/test_docs.py "
                "knows: make the block run, or add a reason that says where else it is checked"
            )
    for document in DOCUMENTS:  # a marker that is not right above a fence marks nothing
        lines = document.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if _NOT_RUN.match(line):
                following = lines[number] if number < len(lines) else ""
                assert following.startswith("```"), f"{document}:{number}: marker before no block"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_link_between_the_documents_leads_somewhere() -> None:
    for document in DOCUMENTS:
        text = document.read_text()
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (document.parent / path).resolve() if path else document
            assert linked.exists(), f"{document.relative_to(REPO)}: {target} does not exist"
            if anchor and linked.suffix == ".md":
                assert anchor in anchors(linked), (
                    f"{document.relative_to(REPO)}: {target}: no such heading in {path}"
                )


# A documented tree's line for the status directory: "/.decodefs/   live status files: ...".
_STATUS_LINE = re.compile(r"\s*/?\.decodefs/\s+\S")


def test_every_documented_tree_names_the_status_files_the_mount_serves() -> None:
    lines = [
        (document.relative_to(REPO), line)
        for document in DOCUMENTS
        for line in document.read_text().splitlines()
        if _STATUS_LINE.match(line)
    ]
    assert lines, "no documented tree shows the status directory"
    for where, line in lines:
        named = set(re.findall(r"[\w.]+\.json|\bmetrics\b", line))
        assert named == set(STATUS_FILES), f"{where}: {line.strip()!r} is not {STATUS_FILES}"


def anchors(document: Path) -> set[str]:
    """The anchors a Markdown renderer makes of the document's headings (GitHub's rule)."""
    found = set()
    for line in document.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@dataclass(frozen=True)
class Sample:
    """The stand-ins for the documentation's paths, and a mount of them."""

    base: Path
    config: Path
    mountpoint: Path
    log: Path
    paths: dict[str, str]  # documented path -> its stand-in, longest first
    env: dict[str, str]

    def substitute(self, code: str) -> str:
        for documented, here in self.paths.items():
            code = code.replace(documented, here)
        return code

    def mount(self) -> None:
        if not is_mounted(self.mountpoint):
            self.mountpoint.mkdir(exist_ok=True)
            result = decodefs(
                "mount", self.mountpoint, "--config", self.config, "--log-file", self.log
            )
            assert result.returncode == 0, result.stderr

    def unmount(self) -> None:
        if is_mounted(self.mountpoint):
            assert decodefs("umount", self.mountpoint).returncode == 0


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sample]:
    base = tmp_path_factory.mktemp("docs")
    v1 = base / "v1-images"
    make_sample_corpus(v1, 3, 96, 72, seed=5)
    photo_like(np.random.default_rng(9), 80, 60).save(v1 / "abc.jpg")
    pets = base / "pets-train"
    for seed, key in enumerate(["cat/0001", "cat/0002", "dog/0001"]):
        (pets / key).parent.mkdir(parents=True, exist_ok=True)
        photo_like(np.random.default_rng(seed), 90, 70).save(pets / f"{key}.jpg")
    Image.open(pets / "dog/0001.jpg").save(pets / "dog/0002.png")
    (pets / "bird").mkdir()
    store = base / "store"
    config = base / "config.toml"
    config.write_text(
        f'store = "{store}"\n\n[versions.v1]\nsource = "{v1}"\n\n'
        f'[versions.pets]\nsource = "{pets}"\nlayout = "mirror"\n'
    )
    mountpoint = base / "decoded"
    (base / "cwd").mkdir()
    paths = {
        "/etc/decodefs/config.toml": str(config),
        "/mnt/flash/decodefs": str(store),
        "/mnt/decoded": str(mountpoint),
        "/data/photos/v1/images": str(v1),
        "/data/v1/images": str(v1),
        "/data/pets/train": str(pets),
        "/tmp/decodefs-sample": str(base / "made-samples"),
    }
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "XDG_STATE_HOME": str(base / "state"),  # a daemon's default log goes here, not in ~
        "DECODEFS_CONFIG": str(config),
    }
    made = Sample(base, config, mountpoint, base / "daemon.log", paths, env)
    try:
        yield made
    finally:
        made.unmount()
        unmount_quietly(mountpoint)
        logs = [made.log, *(base / "state").rglob("*.log")]
        problems = [
            f"{log}: {line}"
            for log in logs
            if log.exists()
            for line in log.read_text(errors="replace").splitlines()
            if _UNEXPECTED.search(line)
        ]
        assert not problems, "unexpected errors in daemon logs:\n" + "\n".join(problems)


@pytest.mark.parametrize("block", RUN, ids=str)
def test_the_block_runs_as_pasted(block: Block, sample: Sample) -> None:
    code = sample.substitute(block.code)
    if block.language == "toml":
        raw = tomllib.loads(code)
        if "store" in raw:
            load_config_text(sample.base, code)
        else:  # a version's table alone, as the docs show one
            parse_config({"store": str(sample.base / "store"), **raw}, sample.base)
        return
    if block.language == "sh" and re.search(r"^decodefs mount ", code, re.MULTILINE):
        sample.unmount()  # the block mounts it itself
    else:
        sample.mount()
    command = [sys.executable, "-c", code] if block.language == "python" else ["bash", "-e", "-o"]
    if block.language == "sh":
        command += ["pipefail", "-c", code]
    result = subprocess.run(
        command,
        cwd=sample.base / "cwd",
        env=sample.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, (
        f"{block} failed (exit {result.returncode}):\n{code}\nstdout:\n{result.stdout}\n"
        f"stderr:\n{result.stderr}"
    )


def load_config_text(base: Path, text: str) -> None:
    path = base / "block.toml"
    path.write_text(text)
    load_config(str(path))


def test_the_quick_start_demo_prints_what_the_readme_shows(tmp_path: Path) -> None:
    venv = REPO / ".venv"
    if Path(sys.prefix).resolve() != venv.resolve() or not (venv / ".decodefs-installed").exists():
        pytest.skip("the demo installs into the clone's .venv; these tests run elsewhere")
    env = {k: v for k, v in os.environ.items() if k != "DECODEFS_DEMO_DIR"}
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "demo.sh")],
        env={**env, "TMPDIR": str(tmp_path), "DEMO_COUNT": "4"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    work = tmp_path / "decodefs-demo"
    assert not is_mounted(work / "mnt")
    assert not work.exists(), "the demo left its directory behind"
    shown = next(b for b in ALL_BLOCKS if b.language == "text" and "epoch 1, np.load" in b.code)
    printed = result.stdout.splitlines()
    for line in shown.code.replace("/tmp/decodefs-demo", str(work)).splitlines():
        pattern = loose(line)
        assert any(re.fullmatch(pattern, p) for p in printed), (
            f"the README shows {line!r}; the demo printed:\n{result.stdout}"
        )
    assert "max |mount - live decode| over 4 arrays: 0" in printed


_FIGURE = re.compile(r"([0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}|\d[\d,]*(?:\.\d+)?)")


def loose(line: str) -> str:
    """A pattern for ``line`` as another run prints it: the README's figures are one
    run's, so any number (or uuid) stands for any other, and spaces for any padding."""
    pattern = []
    for i, part in enumerate(_FIGURE.split(line)):
        if i % 2:
            pattern.append(r"[0-9a-f-]{36}" if len(part) == 36 else r"[\d,.]+")
        else:
            pattern.append(r"\s*".join(re.escape(word) for word in part.split(" ")))
    return "".join(pattern)
