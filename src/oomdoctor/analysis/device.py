"""One rank's analyses, computed once and shared by the detectors and the report."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..ids import BreakdownPoint
from ..trace.model import OOM, DeviceTrace, Trace
from .accounting import Accounting, Breakdown, account, breakdown
from .fragmentation import Anatomy, anatomy
from .jobpeak import JobPeak, job_peak
from .lifetimes import Lifetimes, adopt_free_stacks, free_stacks, lifetimes
from .phases import Phases, Steps, find_phases
from .sites import Site, sites_at
from .timeline import Timeline, timeline


@dataclass
class DeviceAnalysis:
    """The analyses of one device of one trace, all made by :func:`analyze` before anything reads them (the
    pipeline's stage 1): the detectors and the report read fields, and call back only for a moment of their own
    choosing (:meth:`allocated_at`, :meth:`breakdown_at`, :meth:`anatomy_at`, :meth:`sites_at`,
    :meth:`deferred_held`).

    Attributes:
        trace, device: what was analysed (``device``: one of ``trace.devices``).
        lifetimes, timeline: every block's events (:mod:`.lifetimes`); allocated and reserved bytes after each event
            (:mod:`.timeline`).
        free_stacks: whether frees carry their own stacks (:func:`.lifetimes.free_stacks`).
        phases: the phase of every event, forward passes and optimizer steps (:mod:`.phases`); ``steps`` its steps.
        accounting: the category of every block (:mod:`.accounting`).
        oom_events: event indices of ``oom`` entries, shape ``(n_ooms,)``.
        rank: the trace's rank (0 when unknown); ``num_events``, ``end_index``: the device's event count and last
            index (-1 without history).
        peak_reserved, peak_allocated: ``(bytes, event)``; without history, the final state's at event -1.
        end_allocated: allocated bytes after the last event (the final state's without history).
        job_peak: the job's own peaks beside the window's, and where they come from (:mod:`.jobpeak`).
    """

    trace: Trace
    device: DeviceTrace
    lifetimes: Lifetimes
    timeline: Timeline
    free_stacks: bool
    phases: Phases
    steps: Steps | None
    accounting: Accounting
    oom_events: np.ndarray
    rank: int
    num_events: int
    end_index: int
    peak_reserved: tuple[int, int]
    peak_allocated: tuple[int, int]
    end_allocated: int
    job_peak: JobPeak
    _anatomies: dict[int, Anatomy] = field(default_factory=dict[int, Anatomy], repr=False)

    def allocated_at(self, k: int) -> int:
        """Allocated bytes after event ``k`` (-1: at the start)."""
        if self.num_events == 0:
            return self.peak_allocated[0]
        return int(self.timeline.allocated[k]) if k >= 0 else self.timeline.allocated_start

    def breakdown_at(self, k: int, at: BreakdownPoint) -> Breakdown:
        """Allocated bytes after event ``k`` by category; they add up to :meth:`allocated_at` (asserted)."""
        return breakdown(self.accounting, self.lifetimes, self.phases, k, at, self.allocated_at(k))

    def anatomy_at(self, k: int) -> Anatomy:
        """Fragmentation anatomy after event ``k`` (cached)."""
        got = self._anatomies.get(k)
        if got is None:
            got = self._anatomies[k] = anatomy(self.device, self.lifetimes, k)
        return got

    def sites_at(self, k: int) -> list[Site]:
        return sites_at(self.trace, self.lifetimes, k)

    def deferred_held(self) -> np.ndarray:
        """Bytes held by deferred frees (``free_requested`` waiting on other streams) after each event."""
        lt, n = self.lifetimes, self.num_events
        d = np.flatnonzero(lt.deferred)
        delta = np.zeros(n + 1, dtype=np.int64)
        start = np.where(lt.free_requested[d] >= 0, lt.free_requested[d], 0)
        end = np.where(lt.free_completed[d] >= 0, lt.free_completed[d], n)
        np.add.at(delta, start, lt.size[d])
        np.subtract.at(delta, end, lt.size[d])
        return np.cumsum(delta[:n])


def analyze(trace: Trace, device: DeviceTrace | None = None) -> DeviceAnalysis:
    """Analyse one device of ``trace`` (its primary device by default), in order: lifetimes, timeline, whether frees
    carry stacks, phases, accounting, the window's peaks and the job's (:func:`.jobpeak.job_peak`). Blocks whose allocation the trace lost (a wrapped ring buffer) take their free
    event's stack when frees carry their allocation's (:func:`.lifetimes.free_stacks` false), before the phases and the
    accounting read the stacks."""
    dt = device if device is not None else trace.primary
    lt = lifetimes(trace, dt)
    tl = timeline(dt, lt)
    frees = free_stacks(trace, dt, lt)
    if lt.unmatched_frees and not frees:
        adopt_free_stacks(lt)
    phases = find_phases(trace, dt)
    n = dt.num_events
    if n == 0:
        peak_allocated = sum(b.size for _, b in dt.blocks if b.is_allocated), -1
        peak_reserved, end_allocated = (dt.final_reserved_bytes, -1), peak_allocated[0]
    else:
        peak_allocated, peak_reserved, end_allocated = tl.peak_allocated, tl.peak_reserved, int(tl.allocated[-1])
    return DeviceAnalysis(trace, dt, lt, tl, frees, phases, phases.steps, account(trace, dt, lt, phases, frees),
                          np.flatnonzero(dt.events["action"] == OOM), trace.rank if trace.rank is not None else 0,
                          n, n - 1, peak_reserved, peak_allocated, end_allocated,
                          job_peak(trace.meta, dt.device, lt, tl, n, (peak_allocated[0], peak_reserved[0])))
