"""Counter tracks and instants for trace viewers (Perfetto, chrome://tracing).

Per rank: allocated, active and reserved bytes (:mod:`oomdoctor.analysis.timeline`) at every moment one
of them changes. Events often share a microsecond (the snapshot's clock is µs), and a viewer draws one
value per timestamp: of each µs a counter keeps its maximum, its minimum and its last value, in the order
they happened, at ``t``, ``t + 0.25`` and ``t + 0.5`` µs (trace-event timestamps may be fractional), so
a peak allocated and freed within one µs stays visible. Instants mark OOMs, step starts and the peaks. Times are the snapshot's own
``time_us`` (µs on the host clock, as PyTorch records them), so tracks line up with other traces
recorded on the same host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..analysis.device import DeviceAnalysis
from .visual import markers

COUNTERS = ("allocated", "active", "reserved")


@dataclass
class Instant:
    name: str
    time_us: int
    args: dict[str, int | str] = field(default_factory=dict)


@dataclass
class Counter:
    """One counter's samples: ``time_us`` (shape ``(m,)``, float µs, increasing) and ``bytes`` (shape
    ``(m,)``, int); consecutive samples differ in value."""

    time_us: np.ndarray
    bytes: np.ndarray


@dataclass
class RankTracks:
    """One :class:`Counter` per name of :data:`COUNTERS`; no sample for a snapshot without history."""

    rank: int
    device: int
    path: str
    counters: dict[str, Counter]
    instants: list[Instant]


SUB_US = 0.25
"""Spacing (µs) of the extra samples within one microsecond."""


def extremes_per_us(times: np.ndarray, values: np.ndarray) -> Counter:
    """Reduce samples (``times`` int µs, non-decreasing; ``values`` bytes; both shape ``(n,)``) to at
    most three per µs: the maximum, the minimum and the last value, in the order they happened, at
    ``t``, ``t + SUB_US``, ``t + 2 * SUB_US``; then drop samples equal to the one before."""
    n = times.size
    if n == 0:
        return Counter(np.zeros(0), np.zeros(0, np.int64))
    first = np.ones(n, dtype=bool)
    first[1:] = times[1:] != times[:-1]
    starts = np.flatnonzero(first)
    group = np.cumsum(first) - 1
    idx = np.arange(n)
    ends = np.append(starts[1:], n) - 1
    imax = np.lexsort((idx, -values, group))[starts]
    imin = np.lexsort((idx, values, group))[starts]
    pick = np.sort(np.stack([imax, imin, ends], axis=1), axis=1)  # (groups, 3), in event order
    new = np.ones_like(pick, dtype=bool)
    new[:, 1:] = pick[:, 1:] != pick[:, :-1]
    slot = np.cumsum(new, axis=1) - 1
    chosen = pick[new]
    t = times[chosen].astype(np.float64) + slot[new] * SUB_US
    v = values[chosen]
    keep = np.ones(v.size, dtype=bool)
    keep[1:] = v[1:] != v[:-1]
    return Counter(t[keep], v[keep])


def rank_tracks(a: DeviceAnalysis) -> RankTracks:
    """The tracks of one analysed rank. The first sample is the state before the first event."""
    n = a.num_events
    if n == 0:
        return RankTracks(a.rank, a.device.device, a.trace.path,
                          {c: Counter(np.zeros(0), np.zeros(0, np.int64)) for c in COUNTERS}, [])
    tl = a.timeline
    t = tl.time_us.astype(np.int64)
    times = np.concatenate(([t[0]], t))
    counters = {c: extremes_per_us(times, np.concatenate(([getattr(tl, f"{c}_start")], getattr(tl, c))))
                for c in COUNTERS}
    t0 = int(t[0])
    instants = []
    for m in markers(a):
        args: dict[str, int | str] = {"event_index": m.event}
        if m.kind == "oom":
            args["requested_bytes"] = m.bytes
            args["device_free_bytes"] = int(a.device.events["device_free"][m.event])
        elif m.kind.startswith("peak"):
            args["bytes"] = m.bytes
        instants.append(Instant(m.label, t0 + m.time_us, args))
    return RankTracks(a.rank, a.device.device, a.trace.path, counters, instants)
