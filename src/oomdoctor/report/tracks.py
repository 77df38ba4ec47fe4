"""Counter tracks and instants for trace viewers (Perfetto, chrome://tracing).

Per rank: allocated, active and reserved bytes (:mod:`oomdoctor.analysis.timeline`) at every moment one
of them changes, keeping the last value when several events share a microsecond (a viewer draws one
value per timestamp); instants for OOMs, step starts and the peaks. Times are the snapshot's own
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
class RankTracks:
    """``time_us`` (shape ``(m,)``, µs, non-decreasing) and one array of bytes per name of
    :data:`COUNTERS`, each of shape ``(m,)``; ``m`` is 0 for a snapshot without history."""

    rank: int
    device: int
    path: str
    time_us: np.ndarray
    counters: dict[str, np.ndarray]
    instants: list[Instant]


def rank_tracks(a: DeviceAnalysis) -> RankTracks:
    """The tracks of one analysed rank. The first sample is the state before the first event."""
    n = a.num_events
    if n == 0:
        return RankTracks(a.rank, a.device.device, a.trace.path, np.zeros(0, np.int64),
                          {c: np.zeros(0, np.int64) for c in COUNTERS}, [])
    tl = a.timeline
    t = tl.time_us.astype(np.int64)
    vals = {c: np.concatenate(([getattr(tl, f"{c}_start")], getattr(tl, c))) for c in COUNTERS}
    times = np.concatenate(([t[0]], t))
    # the last sample of each timestamp ...
    last_of_time = np.ones(times.size, dtype=bool)
    last_of_time[:-1] = times[1:] != times[:-1]
    keep = np.flatnonzero(last_of_time)
    # ... where some counter changed
    changed = np.ones(keep.size, dtype=bool)
    changed[1:] = np.zeros(keep.size - 1, dtype=bool)
    for c in COUNTERS:
        v = vals[c][keep]
        changed[1:] |= v[1:] != v[:-1]
    keep = keep[changed]
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
    return RankTracks(a.rank, a.device.device, a.trace.path, times[keep],
                      {c: vals[c][keep] for c in COUNTERS}, instants)
