"""The caching allocator's size rounding, vectorised.

Source: ``c10/cuda/CUDACachingAllocator.cpp`` ``DeviceCachingAllocator::round_size`` and
``roundup_power2_next_division``; the divisions table lookup is
``CUDAAllocatorConfig::roundup_power2_divisions`` (``c10/core/AllocatorConfig.cpp`` in 2.9+).
See ``shared/reference/caching_allocator_spec.md`` §1.2-1.3.
"""

from __future__ import annotations

from typing import Any, Mapping, cast

import numpy as np

K_MIN_BLOCK_SIZE = 512  # kMinBlockSize
K_SMALL_SIZE = 1 << 20  # kSmallSize: rounded sizes <= 1 MiB go to the small pool
K_SMALL_BUFFER = 2 << 20  # kSmallBuffer: small-pool segment size
K_LARGE_BUFFER = 20 << 20  # kLargeBuffer
K_MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
K_ROUND_LARGE = 2 << 20  # kRoundLarge
N_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals
MAX_DIVISIONS = 1 << 30  # larger division counts than this are ignored (a request has fewer 512-byte steps)


def divisions_table(settings: Mapping[str, Any] | None) -> np.ndarray:
    """The 16-entry ``roundup_power2_divisions`` table from a snapshot's ``allocator_settings``
    (keys ``'1'``, ``'2'``, ... ``'32768'``: interval starts in MiB). All zeros when absent; entries that are
    not integers in [0, :data:`MAX_DIVISIONS`] are ignored."""
    table = np.zeros(N_INTERVALS, dtype=np.int64)
    raw = (settings or {}).get("roundup_power2_divisions")
    if isinstance(raw, Mapping):
        entries = cast("Mapping[Any, Any]", raw)  # the snapshot's keys and values, of any type until read below
        for key, value in entries.items():
            try:
                idx = int(np.log2(int(key)))
                v = int(value)
            except (TypeError, ValueError, OverflowError):
                continue
            if 0 <= v <= MAX_DIVISIONS:
                table[min(max(idx, 0), N_INTERVALS - 1)] = v
    elif isinstance(raw, int) and 0 < raw <= MAX_DIVISIONS:
        table[:] = raw
    return table


def round_size(sizes: np.ndarray, table: np.ndarray | None = None) -> np.ndarray:
    """Block sizes (bytes) the allocator gives to requests of ``sizes`` bytes (int64 array).

    ``size < 512`` -> 512; with ``d = table[clamp(floor(log2(size)) - 20, 0, 15)]`` and
    ``d > 1 and size > 512 * d`` -> the next 1/d step of the enclosing power of two; else the next
    multiple of 512.
    """
    s = np.asarray(sizes, dtype=np.int64)
    out = ((s + (K_MIN_BLOCK_SIZE - 1)) // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE
    out = np.maximum(out, K_MIN_BLOCK_SIZE)
    if table is None or not np.any(table > 1) or s.size == 0:
        return out
    pos = np.maximum(s, 1)
    log2 = np.floor(np.log2(pos.astype(np.float64))).astype(np.int64)
    # float log2 can be off by one right at powers of two: fix with integer checks
    log2 = np.where((np.left_shift(np.int64(1), log2 + 1) <= pos), log2 + 1, log2)
    log2 = np.where((np.left_shift(np.int64(1), log2) > pos), log2 - 1, log2)
    d = table[np.clip(log2 - 20, 0, N_INTERVALS - 1)]
    use = (d > 1) & (s > K_MIN_BLOCK_SIZE * d)
    if not np.any(use):
        return out
    floor = np.left_shift(np.int64(1), log2)
    step = np.where(use, floor // np.maximum(d, 1), 1)
    r = s & ~(step - 1)
    pow2 = (s & (s - 1)) == 0
    nxt = np.where(pow2 | (r == s), s, r + step)
    return np.where(use, nxt, out)


def allocation_size(rounded: int) -> int:
    """Size of the segment ``cudaMalloc``-ed for a request of ``rounded`` bytes
    (``get_allocation_size``): 2 MiB for small requests, 20 MiB below 10 MiB, else a 2 MiB multiple."""
    if rounded <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if rounded < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return ((rounded + K_ROUND_LARGE - 1) // K_ROUND_LARGE) * K_ROUND_LARGE
