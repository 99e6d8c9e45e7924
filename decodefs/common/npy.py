"""The ``.npy`` layout of a decoded array: its header, its file size, its bytes, the check.

Every array decodefs serves or stores is what ``numpy.save`` writes for a
C-contiguous uint8 ``(size, size, 3)`` array; its size is known without
decoding. Imports numpy alone: the client reads and checks arrays with this
room without loading Pillow, and nothing here knows how pixels are made.
"""

from __future__ import annotations

import functools
import io
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = ["HEADER_BOUND", "npy_bytes", "npy_file_size", "npy_header", "npy_layout_problem"]

HEADER_BOUND: Final = 4096  # the most bytes a .npy header of ours takes


@functools.cache
def npy_header(size: int) -> bytes:
    """The exact header ``numpy.save`` writes for a uint8 (size, size, 3) array."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer,
        {
            "descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)),
            "fortran_order": False,
            "shape": (size, size, 3),
        },
    )
    return buffer.getvalue()


@functools.cache
def npy_file_size(size: int) -> int:
    """Length of the .npy file for a (size, size, 3) uint8 array, without decoding."""
    return len(npy_header(size)) + size * size * 3


def npy_layout_problem(head: bytes | bytearray | memoryview, length: int, size: int) -> str | None:
    """Why a file of ``length`` bytes starting with ``head`` is not the .npy file of
    a (size, size, 3) uint8 array, or None. ``head`` may be the whole file."""
    header = npy_header(size)
    if length != npy_file_size(size) or bytes(head[: len(header)]) != header:
        return "payload is not the expected .npy layout"
    return None


def npy_bytes(array: npt.NDArray[np.uint8]) -> bytes:
    """Exactly what ``numpy.save`` writes for a decoded (size, size, 3) array."""
    size = array.shape[0]
    if array.shape != (size, size, 3) or array.dtype != np.uint8:
        raise ValueError(f"expected uint8 (size, size, 3), got {array.dtype}{array.shape}")
    return npy_header(size) + np.ascontiguousarray(array).tobytes()
