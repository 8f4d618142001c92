"""Portable bytes for the float arrays of the model state: little-endian IEEE 754 float64, every bit
kept (NaN payloads, signed zeros, subnormals) on any machine and either database. The shape is
not stored: the reader knows it and checks the length. Like all of `store/`, it never reaches
`coordinator/`. Test: `tests/integration/test_store.py`.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from slurm_cdgpc.store.engine import StoreError

FloatArray = NDArray[np.float64]
_PORTABLE = np.dtype("<f8")


def encode_f64(array: FloatArray) -> bytes:
    return np.ascontiguousarray(array, dtype=_PORTABLE).tobytes()


def decode_f64(data: bytes, shape: tuple[int, ...], what: str) -> FloatArray:
    expected = math.prod(shape) * _PORTABLE.itemsize
    if len(data) != expected:
        raise StoreError(f"{what}: corrupt array: {len(data)} bytes, expected {expected}")
    return np.frombuffer(data, dtype=_PORTABLE).astype(np.float64).reshape(shape)


def vector_length(data: bytes, what: str) -> int:
    """k for a stored (k,) vector."""
    if len(data) % _PORTABLE.itemsize:
        raise StoreError(f"{what}: corrupt array: {len(data)} bytes is not a whole float64 count")
    return len(data) // _PORTABLE.itemsize
