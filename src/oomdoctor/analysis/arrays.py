"""Array helpers the analyses share.

:func:`distinct` and :func:`distinct_columns` give what ``np.unique(a)`` and ``np.unique(a, axis=1)`` give for
integer arrays, by sorting. NumPy 2.x's ``np.unique`` without ``return_index``/``return_inverse``/``return_counts``
asks ``np.ma.is_masked`` first, which imports ``numpy.ma`` (about 30 ms of a diagnosis's start-up,
``numpy/lib/_arraysetops_impl.py``: ``_unique1d``); these never do (docs/benchmarks.md).
"""

from __future__ import annotations

import numpy as np


def distinct(a: np.ndarray) -> np.ndarray:
    """The sorted distinct values of the integer array ``a`` (flattened), as ``np.unique(a)``."""
    s = np.sort(np.asarray(a).ravel())
    if s.size < 2:
        return s
    keep = np.empty(s.size, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def distinct_columns(a: np.ndarray) -> np.ndarray:
    """The distinct columns of the 2-D integer array ``a``, sorted by the first row, then the next, as
    ``np.unique(a, axis=1)``. Shape ``(a.shape[0], k)``."""
    a = np.asarray(a)
    if a.shape[1] < 2:
        return a.copy()
    s = a[:, np.lexsort(a[::-1])]
    keep = np.empty(s.shape[1], dtype=bool)
    keep[0] = True
    np.any(s[:, 1:] != s[:, :-1], axis=0, out=keep[1:])
    return s[:, keep]


def stable_argsort(a: np.ndarray) -> np.ndarray:
    """``np.argsort(a, kind="stable")`` of the 1-D integer array ``a`` (int64 indices). Where the span of the values
    and the positions fit one 64-bit word together (value less the minimum in the high bits, position in the low:
    every key distinct, so any sort is stable), the keys are sorted with NumPy's default sort, which is SIMD-
    accelerated for 64-bit integers; else the stable sort. 17-25 ms against 47-99 ms on the 270,887 addresses
    of ``large``'s memory events (under load; docs/benchmarks.md)."""
    a = np.asarray(a)
    n = a.shape[0]
    if n < 2:
        return np.arange(n, dtype=np.int64)
    lo, hi = int(a.min()), int(a.max())
    bits = (n - 1).bit_length()
    if a.dtype.kind not in "iu" or a.dtype == np.uint64 or (hi - lo).bit_length() + bits > 64:
        return np.argsort(a, kind="stable").astype(np.int64, copy=False)
    key = (a.astype(np.int64) - lo).astype(np.uint64) << np.uint64(bits)
    key |= np.arange(n, dtype=np.uint64)
    key.sort()
    return (key & np.uint64((1 << bits) - 1)).astype(np.int64)


def last_in_group(mask: np.ndarray, group_start: np.ndarray) -> np.ndarray:
    """For each position p of a sorted array cut into groups of consecutive positions (``group_start[p]``: the first
    position of p's group), the last position q <= p of its group where ``mask[q]``, else -1."""
    n: int = mask.shape[0]
    pos = np.arange(n)
    last = np.maximum.accumulate(np.where(mask, pos, -1)) if mask.size else pos
    return np.where(last >= group_start, last, -1)
