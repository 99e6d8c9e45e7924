"""Config: defaults, and every mistake named by its key before anything mounts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from decodefs.common import config as config_module
from decodefs.common.config import ConfigError, load_config, parse_byte_size, parse_config


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "originals").mkdir(exist_ok=True)
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


MINIMAL = """
store = "/mnt/flash/decodefs"
[versions.v1]
source = "originals"
"""


def test_minimal_config_gets_documented_defaults(tmp_path: Path) -> None:
    config = load_config(str(write(tmp_path, MINIMAL)))  # a str, as a user passes it
    assert config == load_config(tmp_path / "config.toml")
    assert config.store == Path("/mnt/flash/decodefs")
    assert config.min_size == 8 and config.max_size == 4096
    assert config.decode_workers == (os.cpu_count() or 1)
    assert config.io_workers == 8
    assert config.memory_cache_bytes == 512 << 20
    assert config.max_pixels == 89_478_485
    assert config.error_cache_seconds == 10.0
    assert config.log_level == "info"
    v1 = config.versions["v1"]
    assert v1.source == tmp_path / "originals"  # relative to the config file
    assert v1.sizes == (224,)
    assert v1.decode.resample == "bilinear" and v1.decode.fit == "stretch"
    assert not v1.decode.exif_transpose and not v1.decode.draft
    assert v1.extensions == {"jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff"}
    assert v1.duplicates == "error"


def test_full_config(tmp_path: Path) -> None:
    config = load_config(
        write(
            tmp_path,
            """
store = "cache"
sizes = [224, 128]
min_size = 16
max_size = 1024
decode_workers = 3
io_workers = 4
memory_cache_bytes = "1.5G"
max_pixels = 50000000
error_cache_seconds = 2.5
log_level = "debug"
[versions.v1]
source = "originals"
[versions."v2.1-crop"]
source = "originals"
sizes = [512]
resample = "bicubic"
fit = "crop"
exif_transpose = true
draft = true
extensions = [".JPG", "png"]
duplicates = "skip"
""",
        )
    )
    assert config.store == tmp_path / "cache"
    assert config.versions["v1"].sizes == (128, 224)
    assert config.memory_cache_bytes == int(1.5 * 2**30)
    v2 = config.versions["v2.1-crop"]
    assert v2.sizes == (512,)
    assert (v2.decode.resample, v2.decode.fit, v2.decode.exif_transpose, v2.decode.draft) == (
        "bicubic",
        "crop",
        True,
        True,
    )
    assert v2.extensions == {"jpg", "png"}
    assert v2.duplicates == "skip"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[versions.v1]\nsource='originals'", "store: missing"),
        ("store='s'", "versions: missing"),
        ("store='s'\nstroe_x=1\n[versions.v1]\nsource='originals'", "stroe_x: unknown key"),
        (
            "store='s'\nsize=[224]\n[versions.v1]\nsource='originals'",
            "size: unknown key (did you mean 'sizes'?)",
        ),
        (
            "store='s'\n[versions.v1]\nsourse='originals'",
            "versions.v1.sourse: unknown key (did you mean 'source'?)",
        ),
        ("store='s'\n[versions.v1]\nsizes=[224]", "versions.v1.source: missing"),
        ("store='s'\n[versions.v1]\nsource='nowhere'", "versions.v1.source: "),
        ("store='s'\n[versions.'.hidden']\nsource='originals'", "versions..hidden: a version name"),
        ("store='s'\n[versions.'a/b']\nsource='originals'", "versions.a/b: a version name"),
        (
            "store='s'\n[versions.v1]\nsource='originals'\nsizes=[224, 7]",
            "versions.v1.sizes[1]: 7 is outside",
        ),
        (
            "store='s'\n[versions.v1]\nsource='originals'\nsizes=['224']",
            "versions.v1.sizes[0]: expected an integer",
        ),
        ("store='s'\nsizes=224\n[versions.v1]\nsource='originals'", "sizes: expected a list"),
        (
            "store='s'\nmin_size=300\nmax_size=200\n[versions.v1]\nsource='originals'",
            "min_size: 300 is larger",
        ),
        (
            "store='s'\nmax_size=9000\n[versions.v1]\nsource='originals'",
            "max_size: 9000 is outside",
        ),
        (
            "store='s'\ndecode_workers=0\n[versions.v1]\nsource='originals'",
            "decode_workers: 0 is outside",
        ),
        (
            "store='s'\ndecode_workers=true\n[versions.v1]\nsource='originals'",
            "decode_workers: expected an integer",
        ),
        (
            "store='s'\nmemory_cache_bytes='lots'\n[versions.v1]\nsource='originals'",
            "memory_cache_bytes: 'lots'",
        ),
        (
            "store='s'\nerror_cache_seconds=-1\n[versions.v1]\nsource='originals'",
            "error_cache_seconds: expected",
        ),
        ("store='s'\nerror_cache_seconds=inf\n[versions.v1]\nsource='originals'", "expected"),
        ("store='s'\nerror_cache_seconds=nan\n[versions.v1]\nsource='originals'", "expected"),
        ("store='s'\nmax_pixels=200000000\n[versions.v1]\nsource='originals'", "max_pixels: 2"),
        (
            "store='s'\nlog_level='loud'\n[versions.v1]\nsource='originals'",
            "log_level: 'loud' is not one of",
        ),
        (
            "store='s'\n[versions.v1]\nsource='originals'\nresample='cubic'",
            "versions.v1.resample: 'cubic'",
        ),
        ("store='s'\n[versions.v1]\nsource='originals'\nfit='zoom'", "versions.v1.fit: 'zoom'"),
        (
            "store='s'\n[versions.v1]\nsource='originals'\ndraft='yes'",
            "versions.v1.draft: expected true or false",
        ),
        (
            "store='s'\n[versions.v1]\nsource='originals'\nextensions=[]",
            "versions.v1.extensions: expected",
        ),
        (
            "store='s'\n[versions.v1]\nsource='originals'\nduplicates='first'",
            "versions.v1.duplicates: 'first'",
        ),
        ("store=3\n[versions.v1]\nsource='originals'", "store: expected a path"),
        ("store='s'\n[versions]\nv1='originals'", "versions.v1: expected a table"),
        ("store = \n", "not valid TOML"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert message in str(info.value)
    assert str(tmp_path / "config.toml") in str(info.value)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.toml")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (1234, 1234),
        ("512M", 512 << 20),
        ("60G", 60 << 30),
        ("1.5TiB", int(1.5 * 2**40)),
        ("10k", 10240),
        ("7", 7),
    ],
)
def test_byte_sizes(value: object, expected: int) -> None:
    assert parse_byte_size(value) == expected


@pytest.mark.parametrize("value", ["12X", "", "-5M", -1, True, 1.5, "M"])
def test_bad_byte_sizes(value: object) -> None:
    with pytest.raises(ValueError):
        parse_byte_size(value)


def test_cli_reports_a_bad_config_in_one_line_and_mounts_nothing(tmp_path: Path) -> None:
    config = write(tmp_path, "store='s'\n[versions.v1]\nsource='originals'\nsizes=[0224]\n")
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    for extra in ([], ["--foreground"]):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "decodefs",
                "mount",
                str(mountpoint),
                "--config",
                str(config),
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1
        assert result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("decodefs: error: ")
        assert "Traceback" not in result.stderr
        assert not os.path.ismount(mountpoint)
    # TOML itself rejects a leading zero; a valid integer out of bounds names the key:
    config.write_text("store='s'\n[versions.v1]\nsource='originals'\nsizes=[5000]\n")
    result = subprocess.run(
        [sys.executable, "-m", "decodefs", "mount", str(mountpoint), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "versions.v1.sizes[0]: 5000 is outside min_size..max_size (8..4096)" in result.stderr


def test_every_mistake_is_reported_not_just_the_first(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory\n")
    text = (
        f"store = '{tmp_path / 'file' / 'store'}'\n"
        "sizse = [224]\n"
        "min_size = 300\nmax_size = 200\n"
        "[versions.v1]\nsource = 'originals'\nfit = 'zoom'\nsizes = [224, 'big', 224]\n"
        "[versions.v2]\nsourse = 'originals'\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    where = f"{tmp_path / 'config.toml'}: "
    assert info.value.problems == (
        where + "sizse: unknown key (did you mean 'sizes'?)",
        where + f"store: {tmp_path / 'file' / 'store'} can never be a directory: "
        f"{tmp_path / 'file'} is a regular file",
        where + "min_size: 300 is larger than max_size (200)",
        where + "versions.v1.sizes[1]: expected an integer, got 'big'",
        where + "versions.v1.fit: 'zoom' is not one of 'stretch', 'crop', 'pad'",
        where + "versions.v2.sourse: unknown key (did you mean 'source'?)",
        where + "versions.v2.source: missing (the directory of original images)",
    )
    assert str(info.value) == "\n".join(info.value.problems)


@pytest.mark.parametrize("store", ["file/store", "file/a/b", "file", "/dev/null/store"])
def test_a_store_below_a_file_is_a_config_error(tmp_path: Path, store: str) -> None:
    (tmp_path / "file").write_text("not a directory\n")
    with pytest.raises(ConfigError, match=r"store: .* can never be a directory: .* is (a|not)"):
        load_config(write(tmp_path, f"store = '{store}'\n[versions.v1]\nsource = 'originals'\n"))


def test_a_store_that_is_missing_or_read_only_is_no_config_error(tmp_path: Path) -> None:
    (tmp_path / "ro").mkdir(mode=0o555)
    for store in ["absent/store", "ro/store", "ro"]:
        config = load_config(
            write(tmp_path, f"store = '{store}'\n[versions.v1]\nsource = 'originals'\n")
        )
        assert config.store == tmp_path / store


def test_a_config_that_never_sets_decode_workers_loads_on_a_machine_of_many_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default follows the cores, but a config may set at most 256: the default
    # must stay within what a user may set, or a config without the key is refused.
    monkeypatch.setattr(os, "cpu_count", lambda: 384)
    config = load_config(write(tmp_path, MINIMAL))
    assert config.decode_workers == 256
    with pytest.raises(ConfigError, match=r"decode_workers: 384 is outside 1\.\.256"):
        load_config(write(tmp_path, "decode_workers = 384\n" + MINIMAL))


def test_the_example_service_config_loads_and_lets_the_originals_decide(tmp_path: Path) -> None:
    """systemd/config.example.toml, through the real loader: valid once its paths exist,
    access left to its default (who may read an original may read its array), its
    comments true."""
    text = (Path(__file__).parents[1] / "systemd" / "config.example.toml").read_text()
    example = tomllib.loads(text)
    example["store"] = str(tmp_path / "store")
    (tmp_path / "originals").mkdir()
    example["versions"]["v1"]["source"] = str(tmp_path / "originals")
    config = parse_config(example, base_dir=tmp_path)
    assert "access" not in example and "allow_other" not in example
    assert config.access == ("originals" if os.geteuid() == 0 else "owner")
    assert re.search(r'^#\s*access = "everyone"', text, re.MULTILINE)  # shown, not set
    assert "when idle" not in text  # the warm runs at nice 19, not only when idle
    assert "nice 19" in text


def test_the_configuration_docs_list_every_key_with_the_dataclasses_default() -> None:
    """docs/configuration.md's two tables against the defaults defined once in config.py:
    every key, nothing else, each literal default equal to the dataclass's."""
    docs = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    tables: list[dict[str, str]] = []
    for line in docs.splitlines():
        if line.startswith("| key | default |"):
            tables.append({})
        match = re.fullmatch(r"\| `(\w+)` \| ([^|]+) \|.*", line)
        if match and tables:
            tables[-1][match[1]] = match[2].strip()
    top, version = tables
    assert set(top) | {"versions"} == set(config_module._TOP_KEYS)  # [versions.<name>]: below
    assert set(version) == set(config_module._VERSION_KEYS)
    defaults = {**config_module.Config(store=Path(), versions={}).as_dict()}
    defaults.update({f"l2_{k}": v for k, v in config_module.L2Config(url="").as_dict().items()})
    defaults["l2"] = config_module.Config(store=Path(), versions={}).l2
    defaults["sizes"] = list(config_module.VersionConfig("v", Path()).sizes)
    version_defaults = config_module.VersionConfig("v", Path()).as_dict()
    # Defaults that are no literal: what the docs say instead, and what the dataclass holds.
    spoken = {
        "required": "",
        "none": None,
        "none (no limit)": None,
        "AWS": None,
        "boto3's default, else `us-east-1`": None,
        "top-level `sizes`": [224],
    }
    for table, values in ((top, defaults), (version, version_defaults)):
        for key, documented in table.items():
            if key in ("store", "source"):
                assert documented == "required", key
                continue
            if key == "decode_workers":
                assert documented == "number of cores (at most 256)"
                continue
            if key == "access":
                assert documented == '`"originals"` as root, else `"owner"`'
                assert values[key] == ("originals" if os.geteuid() == 0 else "owner")
                continue
            if key == "allow_other":  # no field: the old name of two access values
                assert documented == "unset"
                continue
            if documented in spoken:
                assert values[key] == spoken[documented], key
                continue
            literal = tomllib.loads(f"value = {documented.strip('`')}")["value"]
            if isinstance(literal, str) and key.endswith("_bytes"):
                literal = parse_byte_size(literal)
            if key == "extensions":
                literal = sorted(literal)
            assert literal == values[key], (key, documented, values[key])


def test_access_defaults_to_the_originals_as_root_and_allow_other_is_its_old_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    default = load_config(write(tmp_path, MINIMAL))
    assert default.access == ("originals" if os.geteuid() == 0 else "owner")
    assert default.allow_other == (os.geteuid() == 0)  # the mount option
    for value in ("originals", "owner", "everyone"):
        config = load_config(write(tmp_path, f'access = "{value}"\n' + MINIMAL))
        assert config.access == value and config.allow_other == (value != "owner")
        assert config.as_dict()["access"] == value and "allow_other" not in config.as_dict()
    for old, new in (("true", "everyone"), ("false", "owner")):
        caplog.clear()
        assert load_config(write(tmp_path, f"allow_other = {old}\n" + MINIMAL)).access == new
        assert f"allow_other = {old} is deprecated: it means access = '{new}'" in caplog.text
        agreed = f'allow_other = {old}\naccess = "{new}"\n'
        assert load_config(write(tmp_path, agreed + MINIMAL)).access == new


def test_access_mistakes_name_the_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, 'allow_other = true\naccess = "originals"\n' + MINIMAL))
    assert str(caught.value).endswith(
        "allow_other = true and access = 'originals' disagree: allow_other is the old name "
        "of access = 'everyone'; keep access alone"
    )
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"access: 'root' is not one of 'originals', 'owner', "):
        load_config(write(tmp_path, 'access = "root"\n' + MINIMAL))
    with pytest.raises(ConfigError, match=r"allow_other: expected true or false, got 'yes'"):
        load_config(write(tmp_path, 'allow_other = "yes"\n' + MINIMAL))
