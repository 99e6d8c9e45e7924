"""decodefs: decoded, resized images served as .npy files from a verified flash cache.

The decode path is public so a live training pipeline can produce exactly the
bytes the mount serves::

    from decodefs import decode_image
    array = decode_image("/data/v1/images/abc.jpg", 224)   # == np.load(mount/v1/224/abc.npy)

and ``read_array`` reads a mounted array several times faster than np.load,
straight from the verified store when it can::

    from decodefs import read_array
    array = read_array("/mnt/decoded/v1/224/abc.npy")

Every name is imported at its first use: a training process that only reads
arrays (``decodefs.client``) never loads Pillow, and the mount's holder
(``python -m decodefs.holder``) loads neither numpy nor Pillow.
"""

from typing import TYPE_CHECKING, Final

from .common.version import package_version

if TYPE_CHECKING:
    from . import reader as reader  # decodefs.reader.read_array_into, as documented
    from .client import class_labels, failed_keys, list_keys, read_array
    from .common.config import Config, ConfigError, VersionConfig, load_config
    from .common.decode import DecodeError, DecodeSettings, decode_image
    from .common.npy import npy_bytes, npy_file_size, npy_header

__version__ = package_version()

__all__ = [
    "Config",
    "ConfigError",
    "DecodeError",
    "DecodeSettings",
    "VersionConfig",
    "__version__",
    "class_labels",
    "decode_image",
    "failed_keys",
    "list_keys",
    "load_config",
    "npy_bytes",
    "npy_file_size",
    "npy_header",
    "read_array",
]

# Where each name lives: imported at its first use (PEP 562), then a plain attribute.
_HOMES: Final = {
    **dict.fromkeys(("Config", "ConfigError", "VersionConfig", "load_config"), "common.config"),
    **dict.fromkeys(("DecodeError", "DecodeSettings", "decode_image"), "common.decode"),
    **dict.fromkeys(("class_labels", "failed_keys", "list_keys", "read_array"), "client"),
    **dict.fromkeys(("npy_bytes", "npy_file_size", "npy_header"), "common.npy"),
}


if not TYPE_CHECKING:  # mypy sees the imports above, and so catches a misspelled name

    def __getattr__(name: str) -> object:
        """A public name, imported at its first use."""
        import importlib

        if name == "reader":
            value: object = importlib.import_module(".reader", __name__)
        elif name in _HOMES:
            value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value  # later uses are plain attributes of the module
        return value


def __dir__() -> list[str]:
    return sorted({*__all__, "reader", "sample", "torch"})
