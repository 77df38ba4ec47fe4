"""One rank's analyses, computed once and shared by the detectors and the report."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, cast

import numpy as np

from ..trace.model import OOM, DeviceTrace, Trace
from .accounting import Accounting, Breakdown, account, breakdown
from .fragmentation import Anatomy, anatomy
from .lifetimes import Lifetimes, adopt_free_stacks, lifetimes
from .phases import Phases, Steps, find_phases
from .sites import Site, sites_at
from .timeline import Timeline, timeline

MIN_PAIRS = 20
SAME_STACK_FRACTION = 0.98


@dataclass
class DeviceAnalysis:
    """The analyses of one device of one trace. Properties are computed on first access."""

    trace: Trace
    device: DeviceTrace
    lifetimes: Lifetimes
    timeline: Timeline
    _anatomies: dict[int, Anatomy] = field(default_factory=dict[int, Anatomy], repr=False)

    @property
    def rank(self) -> int:
        return self.trace.rank if self.trace.rank is not None else 0

    @property
    def num_events(self) -> int:
        return self.device.num_events

    @cached_property
    def phases(self) -> Phases:
        """Phase of every event, forward passes and optimizer steps (:mod:`.phases`)."""
        return find_phases(self.trace, self.device)

    @property
    def steps(self) -> Steps | None:
        return self.phases.steps

    @cached_property
    def accounting(self) -> Accounting:
        """The category of every block (:mod:`.accounting`)."""
        return account(self.trace, self.device, self.lifetimes, self.phases, self.free_stacks)

    def allocated_at(self, k: int) -> int:
        """Allocated bytes after event ``k`` (-1: at the start)."""
        if self.num_events == 0:
            return self.peak_allocated[0]
        return int(self.timeline.allocated[k]) if k >= 0 else self.timeline.allocated_start

    def breakdown_at(self, k: int, at: str) -> Breakdown:
        """Allocated bytes after event ``k`` by category; they add up to :meth:`allocated_at` (asserted)."""
        return breakdown(self.accounting, self.lifetimes, self.phases, k, at, self.allocated_at(k))

    @cached_property
    def free_stacks(self) -> bool:
        """Whether frees carry their own stacks (recorded with ``context="all"``).

        Recorded with ``context="alloc"`` (oomdoctor's default since free stacks crash non-reentrant
        checkpointing) or ``"state"``, a free carries the stack of the allocation it frees, and a segment
        free the stack of the segment's allocation (``CUDACachingAllocator.cpp``: ``free`` and
        ``release_block`` pass ``context ? context : block->context_when_allocated``). The sidecar's
        ``recording.context`` says which; without a sidecar, frees whose stacks equal their allocation's
        for at least :data:`SAME_STACK_FRACTION` of at least :data:`MIN_PAIRS` blocks mean none were recorded
        (with free stacks, most frees happen on another line than the allocation).
        """
        rec = self.trace.meta.get("recording")
        if isinstance(rec, dict) and "context" in rec:
            return cast("dict[str, Any]", rec).get("context") == "all"  # the sidecar's JSON object
        lt = self.lifetimes
        both = (lt.alloc >= 0) & (lt.free_requested >= 0)
        if int(both.sum()) < MIN_PAIRS:
            return True
        stack = self.device.events["stack"]
        same = stack[lt.alloc[both]] == stack[lt.free_requested[both]]
        return float(same.mean()) < SAME_STACK_FRACTION

    @cached_property
    def oom_events(self) -> np.ndarray:
        """Event indices of ``oom`` entries."""
        return np.flatnonzero(self.device.events["action"] == OOM)

    @property
    def peak_reserved(self) -> tuple[int, int]:
        """``(bytes, event)``: without history, the final reserved bytes at event -1."""
        if self.num_events == 0:
            return self.device.final_reserved_bytes, -1
        return self.timeline.peak_reserved

    @property
    def peak_allocated(self) -> tuple[int, int]:
        if self.num_events == 0:
            return sum(b.size for _, b in self.device.blocks() if b.is_allocated), -1
        return self.timeline.peak_allocated

    @property
    def end_allocated(self) -> int:
        """Allocated bytes after the last event (the final state without history)."""
        return int(self.timeline.allocated[-1]) if self.num_events else self.peak_allocated[0]

    def anatomy_at(self, k: int) -> Anatomy:
        """Fragmentation anatomy after event ``k`` (cached)."""
        got = self._anatomies.get(k)
        if got is None:
            got = self._anatomies[k] = anatomy(self.device, self.lifetimes, k)
        return got

    @property
    def end_index(self) -> int:
        return self.num_events - 1

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
    """Analyse one device of ``trace`` (its primary device by default). Blocks whose allocation the
    trace lost (a wrapped ring buffer) take their free event's stack when frees carry their
    allocation's (:attr:`DeviceAnalysis.free_stacks` false)."""
    dt = device if device is not None else trace.primary
    lt = lifetimes(trace, dt)
    a = DeviceAnalysis(trace, dt, lt, timeline(dt, lt))
    if lt.unmatched_frees and not a.free_stacks:
        adopt_free_stacks(lt)
    return a
