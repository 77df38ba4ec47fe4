"""Training steps in a trace, to compare live memory from one step to the next.

Step boundaries come, in order of preference, from:

1. step markers in the sidecar (``meta["step_markers"]``: ``[{"step": i, "time_us": t}, ...]``,
   written by ``oomdoctor.record``);
2. ``external_annotations``: ``ProfilerStep#N`` scopes (present when ``torch.profiler`` runs), else
   the ends of ``Optimizer.step#...`` scopes (``record_function`` names, ``memory_snapshot.cpp``
   ``_initRecordAnnotations``);
3. the trace itself: a training step repeats the same code, so many allocation stacks occur exactly
   once per step. The most common occurrence count ``c >= 2`` among stacks whose occurrences are
   evenly spaced is the number of steps; the earliest such stack marks each step's start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..trace.model import ALLOC, DeviceTrace, Trace
from .lifetimes import Lifetimes

MIN_STACKS = 3
_PROFILER_STEP = re.compile(r"^ProfilerStep#\d+$")


@dataclass
class Steps:
    """``starts[i]`` is the event index where step i begins; ``source`` says how they were found
    (``"markers"``, ``"annotations"``, ``"detected"``); ``anchor_stack`` is the detected stack."""

    starts: np.ndarray
    source: str
    anchor_stack: int = -1

    def __len__(self) -> int:
        return int(self.starts.shape[0])


def find_steps(trace: Trace, dt: DeviceTrace) -> Steps | None:
    """The step starts of ``dt``, or None when fewer than two steps can be told apart."""
    t = dt.events["time_us"]
    markers = trace.meta.get("step_markers")
    if markers and dt.num_events:
        times = np.array(sorted(int(m["time_us"]) for m in markers), dtype=np.int64)
        starts = np.unique(np.searchsorted(t, times, side="left"))
        starts = starts[starts < dt.num_events]
        if starts.size >= 2:
            return Steps(starts, "markers")
    ann = _from_annotations(dt)
    if ann is not None:
        return ann
    return _detect(dt)


def _from_annotations(dt: DeviceTrace) -> Steps | None:
    if not dt.annotations or dt.num_events == 0:
        return None
    t = dt.events["time_us"]
    prof = sorted(a.time_us for a in dt.annotations if a.stage == "START" and _PROFILER_STEP.match(a.name))
    if len(prof) >= 2:
        return Steps(np.unique(np.searchsorted(t, np.array(prof), side="left")), "annotations")
    opt_end = sorted(a.time_us for a in dt.annotations if a.stage == "END" and a.name.startswith("Optimizer.step#"))
    if len(opt_end) >= 2:
        # each step starts right after the previous optimizer step; the first starts at the trace's start
        ends = np.searchsorted(t, np.array(opt_end), side="right")
        starts = np.unique(np.concatenate(([0], ends[:-1])))
        return Steps(starts[starts < dt.num_events], "annotations")
    return None


def _detect(dt: DeviceTrace) -> Steps | None:
    action, stack = dt.events["action"], dt.events["stack"]
    idx = np.flatnonzero((action == ALLOC) & (stack >= 0))
    if idx.size < 8:
        return None
    st = stack[idx]
    order = np.argsort(st, kind="stable")
    s_sorted = st[order]
    bounds = np.flatnonzero(np.diff(s_sorted)) + 1
    groups = np.split(order, bounds)
    regular: dict[int, list[np.ndarray]] = {}
    span = float(idx[-1] - idx[0]) or 1.0
    for g in groups:
        c = g.size
        if c < 2:
            continue
        pos = idx[g]
        gaps = np.diff(pos)
        if gaps.min() <= 0:
            continue
        # evenly spaced (steps may vary a little in length) and spread over the trace
        if gaps.std() <= 0.25 * gaps.mean() and (pos[-1] - pos[0]) >= 0.4 * span:
            regular.setdefault(c, []).append(pos)
    if not regular:
        return None
    # the count shared by the most stacks is the number of steps; a count shared by fewer than
    # MIN_STACKS stacks is more likely a layer loop than a training step
    c = max(regular, key=lambda k: (len(regular[k]), k))
    if len(regular[c]) < MIN_STACKS:
        return None
    anchor = min(regular[c], key=lambda p: p[0])
    return Steps(anchor.astype(np.int64), "detected", int(stack[anchor[0]]))


@dataclass
class StepGrowth:
    """Per step: allocated bytes at its start; and bytes allocated during it that are still allocated
    at the last step start (``retained``), with the block rows behind them."""

    steps: Steps
    allocated_at_start: np.ndarray
    retained: np.ndarray
    retained_rows: list[np.ndarray]


def step_growth(lt: Lifetimes, allocated: np.ndarray, steps: Steps) -> StepGrowth:
    """Memory from step i still allocated at the start of the last step (``allocated``: the
    timeline's allocated bytes per event)."""
    starts = steps.starts
    last = int(starts[-1])
    alloc_at = allocated[np.maximum(starts - 1, 0)]
    still = lt.allocated_mask(last - 1) if last > 0 else np.zeros(len(lt), bool)
    retained, rows = [], []
    for i in range(len(starts) - 1):
        lo, hi = int(starts[i]), int(starts[i + 1])
        r = np.flatnonzero(still & (lt.alloc >= lo) & (lt.alloc < hi))
        rows.append(r)
        retained.append(int(lt.size[r].sum()))
    return StepGrowth(steps, alloc_at.astype(np.int64), np.array(retained, dtype=np.int64), rows)
