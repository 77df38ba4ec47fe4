"""Chrome trace-event JSON (the "JSON Object Format" of Google's *Trace Event Format* document,
https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU), which ui.perfetto.dev
and chrome://tracing open.

One process per rank (``pid`` = :data:`PID_BASE` + rank, named ``oomdoctor rank R (cuda:D)`` by a
``process_name`` metadata event), one counter track per name (``ph: "C"``, ``args: {"bytes": n}``), and
process-scoped instants (``ph: "i"``, ``s: "p"``) for OOMs, step starts and peaks. ``ts`` is in µs, fractional
where one µs holds several samples (its maximum, minimum and last value: :mod:`oomdoctor.views.tracks`).
"""

from __future__ import annotations

import json
from typing import Any

from .._version import __version__
from ..views.tracks import COUNTERS, RankTracks

PID_BASE = 1_000_000
"""Far from real process ids, so the tracks never merge with a profiler trace's processes."""


def trace_events(tracks: list[RankTracks]) -> dict[str, Any]:
    """The trace as a JSON-ready dict."""
    events: list[dict[str, Any]] = []
    for r in tracks:
        pid = PID_BASE + r.rank
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": f"oomdoctor rank {r.rank} (cuda:{r.device})"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": r.rank}})
        for c in COUNTERS:
            name = f"CUDA {c} bytes"
            k = r.counters[c]
            events.extend({"name": name, "ph": "C", "ts": int(ts) if ts.is_integer() else ts, "pid": pid, "tid": 0,
                           "args": {"bytes": v}} for ts, v in zip(k.time_us.tolist(), k.bytes.tolist()))
        for i in r.instants:
            events.append({"name": i.name, "cat": "oomdoctor", "ph": "i", "s": "p", "ts": i.time_us, "pid": pid,
                           "tid": 0, "args": dict(i.args)})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": f"oomdoctor {__version__}",
                          "inputs": ", ".join(r.path for r in tracks)}}


def render_perfetto(tracks: list[RankTracks]) -> str:
    return json.dumps(trace_events(tracks), separators=(",", ":")) + "\n"
