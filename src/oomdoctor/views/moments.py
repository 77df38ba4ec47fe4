"""Moments of a trace at which live memory is shown by call stack (the folded export, the report's flame graph).

A moment is the allocator's state *after* an event, as everywhere in oomdoctor; event -1 is the state before the
first event, and for a snapshot without history its final state. ``time_us`` counts µs from the trace's first event.

:func:`moment_at` resolves what a user names (``peak``, ``oom``, an event index, a time); :func:`page_moments` picks
the bounded set of moments the HTML report precomputes, so that a click on the timeline finds one near it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..analysis.device import DeviceAnalysis
from ..errors import UsageError
from ..units import parse_duration_us

PAGE_MOMENTS = 256
"""Moments the HTML report precomputes over all its ranks (:func:`moments_per_rank`): the peaks, the OOMs, step
starts, and for the rest the event of most allocated bytes in each of equal windows of events."""
RANK_MOMENTS = (16, 128)
"""The fewest and the most moments of one rank."""
MAX_OOMS = 4
"""OOM moments kept (the last ones), so that a trace of many caught OOMs leaves room for the rest."""


@dataclass
class Moment:
    """``kind``: ``peak_allocated``, ``peak_reserved``, ``oom``, ``step``, ``window`` (the event of most allocated
    bytes in a window of events), ``event`` or ``time`` (named by the user); ``name`` says it for people."""

    kind: str
    event: int
    name: str
    time_us: int = 0


def _time_us(a: DeviceAnalysis, k: int) -> int:
    t = a.device.events["time_us"]
    return int(t[k] - t[0]) if k >= 0 and t.size else 0


def moment_at(a: DeviceAnalysis, at: str = "peak") -> Moment:
    """The moment ``at`` names: ``peak`` (the peak of allocated bytes), ``oom`` (the last OOM), an event index
    (``12345``), or a time since the trace's first event with its unit (``350us``, ``20ms``, ``1.5s``: the state
    after the last event at or before it).

    Raises:
        UsageError: ``at`` is none of these, names an event or a time outside the trace, ``oom`` on a trace
            without one, or anything but ``peak`` on a snapshot without history; the message names the file.
    """
    path, n = a.trace.path, a.num_events
    text = at.strip().lower()
    if text == "peak":
        k = a.peak_allocated[1]
        return Moment("peak_allocated", k, "peak allocated" if n else "final state (no history)", _time_us(a, k))
    if n == 0:
        raise UsageError(f"{path}: no allocation history (a final state only): only --at peak applies")
    if text == "oom":
        if not a.oom_events.size:
            raise UsageError(f"{path}: no OOM in this trace: use --at peak, an event index or a time")
        k = int(a.oom_events[-1])
        return Moment("oom", k, "OOM", _time_us(a, k))
    if re.fullmatch(r"\d+", text):
        k = int(text)
        if k >= n:
            raise UsageError(f"{path}: event {k} is outside the trace's 0..{n - 1}")
        return Moment("event", k, f"event {k:,}", _time_us(a, k))
    us = parse_duration_us(text, unit_required=True)
    if us is None:
        raise UsageError(f"{path}: bad --at {at!r}: peak, oom, an event index (12345) or a time (350us, 20ms, 1.5s)")
    t = a.device.events["time_us"] - int(a.device.events["time_us"][0])
    if us > int(t[-1]):
        raise UsageError(f"{path}: {at} is after the trace's last event ({int(t[-1]):,} µs after the first)")
    k = int(np.searchsorted(t, us, side="right")) - 1
    return Moment("time", k, f"{at.strip()} (event {k:,})", _time_us(a, k))


def moments_per_rank(ranks: int) -> int:
    """How many moments each of ``ranks`` ranks gets: :data:`PAGE_MOMENTS` shared, within :data:`RANK_MOMENTS`."""
    lo, hi = RANK_MOMENTS
    return max(lo, min(hi, PAGE_MOMENTS // max(ranks, 1)))


def page_moments(a: DeviceAnalysis, budget: int = RANK_MOMENTS[1]) -> list[Moment]:
    """Up to ``budget`` moments of one rank, by event: the last :data:`MAX_OOMS` OOMs, the peaks of allocated and
    reserved bytes, step starts (evenly thinned to half the budget), then for the rest the event of most
    allocated bytes in each of equal windows of events. One moment per event: its kind is the first of these, in
    this order, and its name joins theirs (``OOM · peak allocated``)."""
    n = a.num_events
    if n == 0:
        return [moment_at(a, "peak")]
    pa, pr = a.peak_allocated[1], a.peak_reserved[1]
    wanted = [Moment("oom", k, "OOM") for k in a.oom_events[-MAX_OOMS:].tolist()]
    wanted += [Moment("peak_allocated", pa, "peak allocated"), Moment("peak_reserved", pr, "peak reserved")]
    steps = a.steps.starts.tolist() if a.steps is not None else []
    keep = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), budget // 2)).round().astype(int)) if steps else []
    wanted += [Moment("step", steps[i], f"step {i} start") for i in keep]
    windows = max(budget - len(wanted), 0)
    if windows:
        edges = np.linspace(0, n, windows + 1).round().astype(np.int64)
        alloc = a.timeline.allocated
        for lo, hi in zip(edges[:-1].tolist(), edges[1:].tolist()):
            if hi > lo:
                k = lo + int(np.argmax(alloc[lo:hi]))
                wanted.append(Moment("window", k, f"most allocated in events {lo:,}-{hi - 1:,}"))
    seen: dict[int, Moment] = {}
    for m in wanted:  # by priority: the first kind of an event stays, the names of the others join it
        got = seen.setdefault(m.event, m)
        if got is not m and m.kind != "window":
            got.name = f"{got.name} · {m.name}"
    out = sorted(seen.values(), key=lambda m: m.event)[:budget]
    for m in out:
        m.time_us = _time_us(a, m.event)
    return out
