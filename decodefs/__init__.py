"""decodefs: decoded, resized images served as .npy files from a verified flash cache.

The decode path is public so a live training pipeline can produce exactly the
bytes the mount serves::

    from decodefs import decode_image
    array = decode_image("/data/v1/images/abc.jpg", 224)   # == np.load(mount/v1/224/abc.npy)

and ``read_array`` reads a mounted array several times faster than np.load,
straight from the verified store when it can::

    from decodefs import read_array
    array = read_array("/mnt/decoded/v1/224/abc.npy")

Decode and the config load Pillow, so their names are imported at their first
use: a training process that only reads arrays (``decodefs.client``) never
loads Pillow.
"""

from typing import TYPE_CHECKING, Final

from . import reader as reader  # decodefs.reader.read_array_into, as documented
from .client import class_labels, failed_keys, list_keys, read_array
from .common.npy import npy_bytes, npy_file_size, npy_header
from .common.version import package_version

if TYPE_CHECKING:
    from .common.config import Config, ConfigError, VersionConfig, load_config
    from .common.decode import DecodeError, DecodeSettings, decode_image

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

_CONFIG_NAMES: Final = frozenset({"Config", "ConfigError", "VersionConfig", "load_config"})
_DECODE_NAMES: Final = frozenset({"DecodeError", "DecodeSettings", "decode_image"})


if not TYPE_CHECKING:  # mypy sees the imports above, and so catches a misspelled name

    def __getattr__(name: str) -> object:
        """The names of decode and the config, imported at their first use (PEP 562)."""
        if name in _CONFIG_NAMES:
            from .common import config

            value: object = getattr(config, name)
        elif name in _DECODE_NAMES:
            from .common import decode

            value = getattr(decode, name)
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value  # later uses are plain attributes of the module
        return value


def __dir__() -> list[str]:
    return sorted({*__all__, "reader", "sample", "torch"})
