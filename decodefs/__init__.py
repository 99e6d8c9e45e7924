"""decodefs: decoded, resized images served as .npy files from a verified flash cache.

The decode path is public so a live training pipeline can produce exactly the
bytes the mount serves::

    from decodefs import decode_image
    array = decode_image("/data/v1/images/abc.jpg", 224)   # == np.load(mount/v1/224/abc.npy)

and ``read_array`` reads a mounted array several times faster than np.load,
straight from the verified store when it can::

    from decodefs import read_array
    array = read_array("/mnt/decoded/v1/224/abc.npy")
"""

from .client import class_labels, list_keys, read_array
from .common.config import Config, ConfigError, VersionConfig, load_config
from .common.decode import (
    DecodeError,
    DecodeSettings,
    decode_image,
    npy_bytes,
    npy_file_size,
    npy_header,
)
from .common.version import package_version

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
    "list_keys",
    "load_config",
    "npy_bytes",
    "npy_file_size",
    "npy_header",
    "read_array",
]
