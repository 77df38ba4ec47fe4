"""Cutting a window out of a trace as a smaller, valid snapshot.

A snapshot is the allocator's state when it was dumped (``segments``) plus the events that led there
(``device_traces``); readers (pytorch.org/memory_viz's ``annotate_snapshot``/``simulate_memory``,
``shared/reference/snapshot_format_and_peers.md`` §1.10, and oomdoctor's own :mod:`.lifetimes`) walk
the events backwards from that state. So the slice of events ``[lo, hi)`` carries the state *after*
event ``hi - 1`` as its segments: the segments that exist then holding the blocks :mod:`.lifetimes` says
are active then, the gaps as inactive blocks (:func:`.fragmentation.segment_states`). Walking back from
it over the window's events gives the state at ``lo``: every block alive at the window's start lies in a
segment.

The output holds only plain data (dicts, lists, str, int, bool), the shape PyTorch 2.11 writes
(``torch/csrc/cuda/Module.cpp`` ``segmentInfoToDict``/``traceEntryToDict``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import UsageError
from ..trace.model import ACTION_NAMES, OOM, DeviceTrace, Trace
from ..units import format_duration_us
from .fragmentation import STATE_ALLOCATED, STATE_FREE, STATE_PENDING_FREE, segment_states
from .iterations import find_steps
from .lifetimes import Lifetimes

WINDOW_UNITS = ("event", "time", "step")


def said_time(us: float) -> str:
    """A time bound in the words it was likely given in: ``20 s``, ``500 ms``, ``350 µs`` (whole numbers of the
    largest unit that fits), else as :func:`~oomdoctor.units.format_duration_us` rounds it."""
    for scale, unit in ((1_000_000, "s"), (1000, "ms"), (1, "µs")):
        if us >= scale and us % scale == 0:
            return f"{int(us // scale)} {unit}"
    return format_duration_us(us)


@dataclass
class Window:
    """Events ``[start_event, end_event)`` of one device; times in µs since the trace's first event."""

    start_event: int
    end_event: int
    unit: str
    how: str

    @property
    def num_events(self) -> int:
        return self.end_event - self.start_event


def event_window(trace: Trace, dt: DeviceTrace, start: float | None, end: float | None, unit: str) -> Window:
    """Turn ``start``/``end`` in ``unit`` into event indices.

    ``event``: event indices, end exclusive. ``time``: µs since the first event, the window holding the
    events with ``start <= t < end``. ``step``: step numbers counted from 0 (from the sidecar's step
    markers, ``ProfilerStep#`` annotations, or detected iterations), end exclusive: ``--start 2 --end 4``
    is steps 2 and 3. A missing bound means the trace's start or end.

    Raises:
        UsageError: unknown unit, a trace without events, no steps found for ``step``, bounds out of
            range or an empty window.
    """
    n = dt.num_events
    if unit not in WINDOW_UNITS:
        raise UsageError(f"unknown window unit {unit!r}: one of {', '.join(WINDOW_UNITS)}")
    if start is not None and end is not None and end <= start:
        said: Callable[[float], str] = said_time if unit == "time" else (lambda x: f"{int(x)}")
        if end == start:
            raise UsageError(f"{trace.path}: the window --start {said(start)} to --end {said(end)} holds no event "
                             "(--end is exclusive)")
        raise UsageError(f"{trace.path}: the window is reversed: --start {said(start)} is after --end {said(end)}")
    if n == 0:
        raise UsageError(f"{trace.path}: no allocation history to slice (the snapshot holds the final state only)")
    how = ""
    if unit == "event":
        lo = 0 if start is None else int(start)
        hi = n if end is None else int(end)
        if lo < 0 or hi > n:
            raise UsageError(f"{trace.path}: event window {lo}:{hi} is outside the trace's 0:{n}")
    elif unit == "time":
        t = dt.events["time_us"] - int(dt.events["time_us"][0])
        lo = 0 if start is None else int(np.searchsorted(t, start, side="left"))
        hi = n if end is None else int(np.searchsorted(t, end, side="left"))
        if hi <= lo:
            window = (f"{said_time(start) if start is not None else 'the start'} to "
                      f"{said_time(end) if end is not None else 'the end'}")
            raise UsageError(f"{trace.path}: the window {window} holds no event: the trace's events span "
                             f"{format_duration_us(int(t[-1]))} from its first")
    else:
        steps = find_steps(trace, dt)
        if steps is None:
            raise UsageError(f"{trace.path}: no steps found (no step markers, no ProfilerStep annotations, no "
                             "repeating iteration): slice by --by event or --by time")
        bounds = steps.starts.tolist() + [n]
        count = len(steps)
        a = 0 if start is None else int(start)
        b = count if end is None else int(end)
        if not 0 <= a < b <= count:
            raise UsageError(f"{trace.path}: step window {a}:{b} is outside the {count} steps found (0:{count})")
        lo, hi = bounds[a], bounds[b]
        how = f"steps {a}..{b - 1} of {count} ({steps.source})"
    if hi <= lo:
        raise UsageError(f"{trace.path}: the window holds no event ({unit} {start}:{end} gives events {lo}:{hi})")
    return Window(lo, hi, unit, how or f"events {lo}:{hi}")


def _frames(trace: Trace, stack: int) -> list[dict[str, Any]]:
    return [{"filename": f, "line": line, "name": name} for f, line, name in trace.stacks.stack_frames(stack)]


def _state_segments(trace: Trace, dt: DeviceTrace, lt: Lifetimes, k: int) -> list[dict[str, Any]]:
    """The segments after event ``k`` as snapshot dicts, blocks and gaps covering each exactly."""
    final_stack = {s.address: s.stack for s in dt.segments}
    state_names = {STATE_ALLOCATED: "active_allocated", STATE_PENDING_FREE: "active_pending_free",
                   STATE_FREE: "inactive"}
    out: list[dict[str, Any]] = []
    for st in segment_states(dt, lt, k):
        s = st.segment
        blocks: list[dict[str, Any]] = [{"address": addr, "size": size, "requested_size": int(lt.requested[r]) if r >= 0 else 0,
                   "state": state_names[state], "frames": _frames(trace, int(lt.stack[r])) if r >= 0 else []}
                  for addr, size, state, r in st.blocks]
        alloc = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        active = sum(b["size"] for b in blocks if b["state"] != "inactive")
        out.append({"device": dt.device, "address": s.address, "total_size": s.size, "allocated_size": alloc,
                    "active_size": active, "requested_size": sum(b["requested_size"] for b in blocks),
                    "stream": s.stream, "segment_type": s.segment_type, "segment_pool_id": tuple(s.pool_id),
                    "is_expandable": s.is_expandable, "frames": _frames(trace, final_stack.get(s.address, -1)),
                    "blocks": blocks})
    return out


def _entries(trace: Trace, dt: DeviceTrace, lo: int, hi: int) -> list[dict[str, Any]]:
    ev = dt.events
    cols: dict[str, list[int]] = {name: ev[name][lo:hi].tolist() for name in ev}
    frames_of: dict[int, list[dict[str, Any]]] = {}
    out: list[dict[str, Any]] = []
    for j in range(hi - lo):
        st = cols["stack"][j]
        if st not in frames_of:
            frames_of[st] = _frames(trace, st)
        e: dict[str, Any] = {"action": ACTION_NAMES[cols["action"][j]], "addr": cols["addr"][j],
                             "size": cols["size"][j], "stream": cols["stream"][j], "time_us": cols["time_us"][j],
                             "frames": frames_of[st]}
        if cols["action"][j] == OOM:
            e["device_free"] = cols["device_free"][j]
        if cols["user_metadata"][j] >= 0:
            e["user_metadata"] = trace.strings[cols["user_metadata"][j]]
        if cols["compile_context"][j] >= 0:
            e["compile_context"] = trace.strings[cols["compile_context"][j]]
        if cols["pool"][j] >= 0:
            e["pool_id"] = tuple(trace.pools[cols["pool"][j]])
        out.append(e)
    return out


def slice_snapshot(trace: Trace, dt: DeviceTrace, lt: Lifetimes, window: Window) -> dict[str, Any]:
    """The snapshot dict of ``window`` (see the module docstring). ``lt`` are ``dt``'s lifetimes.
    Pure; the caller pickles it."""
    lo, hi = window.start_event, window.end_event
    traces: list[list[dict[str, Any]]] = [[] for _ in range(max(trace.devices) + 1)]
    traces[dt.device] = _entries(trace, dt, lo, hi)
    t = dt.events["time_us"]
    t_lo, t_hi = int(t[lo]), int(t[hi - 1])
    annotations = [{"device": dt.device, "name": a.name, "stage": a.stage, "time_us": a.time_us}
                   for a in dt.annotations if t_lo <= a.time_us <= t_hi]
    settings = dict(trace.allocator_settings)
    return {"segments": _state_segments(trace, dt, lt, hi - 1), "device_traces": traces,
            "allocator_settings": settings, "external_annotations": annotations}


def slice_metadata(trace: Trace, dt: DeviceTrace, window: Window) -> dict[str, Any]:
    """Sidecar metadata for the slice: the source's (rank, versions, environment...) with the step
    markers that fall inside the window, and where the slice came from."""
    # the counters are the whole job's at its dump, not the slice's (its peaks would read as "missed by the window")
    skip = {"format", "snapshot_keys", "trace_entry_keys", "sidecar", "memory_stats", "oom", "device_counters",
            "memory_stats_file", "device_free_bytes"}
    meta = {k: v for k, v in trace.meta.items() if k not in skip}
    t = dt.events["time_us"]
    t_lo, t_hi = int(t[window.start_event]), int(t[window.end_event - 1])
    if isinstance(meta.get("step_markers"), list):
        meta["step_markers"] = [m for m in meta["step_markers"] if t_lo <= int(m["time_us"]) <= t_hi]
    # steps recorded without stacks (--stack-steps): the slice's entries carry the stacks matched here as
    # frames; its event indices differ, so the slice is matched again when loaded (every switch up to its
    # end is kept: a step's state is that of the last switch at or before it)
    meta.pop("stack_matches", None)
    if isinstance(meta.get("stack_markers"), list):
        meta["stack_markers"] = [m for m in meta["stack_markers"] if int(m["time_us"]) <= t_hi]
    meta["sliced_from"] = {"path": trace.path, "device": dt.device, "start_event": window.start_event,
                           "end_event": window.end_event, "window": window.how}
    return meta
