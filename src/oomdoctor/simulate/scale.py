"""What fits: replay a trace with the micro-batch's tensors scaled, under a memory limit.

The tensors of a micro-batch (activations, their temporaries and gradients, kept outputs: the rows the
accounting marks ``batch_scaled``) grow linearly with the number of samples at a fixed sequence
length; parameters, gradients, optimizer state and collective buffers do not. Scaling those requests
by ``s`` and replaying the trace through the allocator model under the device's limit says whether
``s`` times the recorded micro-batch fits, fragmentation included (the requests keep their order, so
the caching allocator splits, caches and frees as the real run would). :func:`largest_scale` searches
the largest ``s`` that replays without an OOM, assuming more memory never hurts (monotone).

Caveats, stated where results are shown: sizes that do not grow with the batch inside those tensors
are scaled too (small next to them); a trace cut by an OOM lacks the rest of its step, so the replay
keeps ``margin_bytes`` free for what the step would still have added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .capacity import Capacity
from .config import AllocatorConfig
from .replay import Prepared, ReplayResult, replay


@dataclass
class ScaleResult:
    """The largest scale that fits (None: not even ``lo``), and every replay tried: ``(scale, peak
    reserved bytes, fits)``."""

    scale: float | None
    tried: list[tuple[float, int, bool]]


def scaled(prepared: Prepared, scale_events: np.ndarray, s: float) -> Prepared:
    """``prepared`` with the requests of events ``scale_events`` (bool, shape ``(num_events,)``) scaled
    by ``s`` (rounded up to whole bytes)."""
    req = prepared.requests
    new = np.where(scale_events & (req > 0), np.ceil(req * s).astype(np.int64), req)
    return replace(prepared, requests=new)


def fits_at(prepared: Prepared, scale_events: np.ndarray, s: float, capacity: Capacity,
            config: AllocatorConfig | None = None, margin_bytes: int = 0) -> ReplayResult:
    """Replay at scale ``s`` under ``capacity`` less ``margin_bytes``."""
    cap = capacity
    if margin_bytes and capacity.limit_bytes is not None:
        cap = Capacity(limit_bytes=capacity.limit_bytes - margin_bytes, kind=capacity.kind,
                       source=capacity.source, source_values=capacity.source_values,
                       from_event=capacity.from_event)
    return replay(scaled(prepared, scale_events, s), config, capacity=cap, validate=False)


SEARCH_MAX = 4.0
"""The largest scale of the micro-batch :func:`largest_scale` replays by default. What fits
(``report/fits.py``) passes its own top instead: the room less the margin filled with the growing blocks
alone, so that a run far from the edge answers a number (issue 35)."""


def largest_scale(prepared: Prepared, scale_events: np.ndarray, capacity: Capacity, *,
                  config: AllocatorConfig | None = None, margin_bytes: int = 0, lo: float = 0.05,
                  hi: float = SEARCH_MAX, tolerance: float = 0.01, unit: float | None = None,
                  guess: tuple[float, float] | None = None) -> ScaleResult:
    """The largest scale in ``[lo, hi]`` whose replay does not OOM (bisection to ``tolerance``).

    ``unit``: when given (``1 / micro_batch``), only multiples of it are tried, so the answer is a whole
    micro-batch. ``guess``: a bracket ``(below, above)`` expected to hold the answer; it is checked
    (and widened to ``[lo, hi]`` where wrong) before bisecting, which saves replays.
    Raises nothing beyond :func:`.replay.replay`'s errors.
    """
    tried: list[tuple[float, int, bool]] = []
    seen: dict[float, bool] = {}

    def ok(s: float) -> bool:
        if s not in seen:
            r = fits_at(prepared, scale_events, s, capacity, config, margin_bytes)
            tried.append((s, r.peak_reserved_bytes, r.oom is None))
            seen[s] = r.oom is None
        return seen[s]

    def snap(s: float) -> float:
        return max(unit, math.floor(s / unit + 1e-9) * unit) if unit else s

    lo, hi = snap(lo), snap(hi)
    if guess is not None:
        below, above = snap(min(max(guess[0], lo), hi)), snap(min(max(guess[1], lo), hi))
        if ok(below):
            lo = below
            if above > lo:
                if ok(above):
                    lo = above
                else:
                    hi = above
        else:
            hi = below
    if not ok(lo):
        return ScaleResult(None, tried)
    if ok(hi):
        return ScaleResult(hi, tried)
    step = unit if unit else tolerance
    while hi - lo > step * 1.000001:
        mid = snap((lo + hi) / 2) if unit else (lo + hi) / 2
        if mid <= lo:
            mid = lo + step
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return ScaleResult(lo, tried)
