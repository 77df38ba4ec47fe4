"""What the HTML ``diff`` draws: per pair of ranks, both runs' timelines on one axis, aligned at step starts,
and the difference tree of the bytes by call stack at each run's peak of reserved bytes.

**Alignment.** The x axis is the before run's: its event index, or seconds since its first event. The after
run is mapped onto it piecewise linearly so that each of its step starts falls on the before run's start of
the same step (steps are numbered as the job counts them, :class:`~oomdoctor.analysis.phases.Steps`); before
the first common step and after the last one it is only shifted. With no step in common, both start at 0.
The mapping is monotonic, so the order of each run's points is kept.

**Difference tree.** The blocks alive (allocated, or pending a deferred free) at each run's peak of reserved
bytes, the moment and blocks whose allocation sites ``diff`` compares (:mod:`oomdoctor.report.diff`), merged by
frame path (:func:`oomdoctor.views.flame.diff_tree`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..analysis.device import DeviceAnalysis
from .flame import DiffTree, FrameTable, alive_by_path, diff_tree
from .visual import Marker, markers, timeline_view

OVERLAY_POINTS = 1000
"""Buckets per run and series (each keeps its maximum, so peaks stay exact)."""
SERIES = ("allocated", "reserved")


@dataclass
class AxisTable:
    """Both runs on one x axis (``x`` ascending: events, or seconds): ``series[f"{run}_{name}"]`` for run
    ``before``/``after`` and each name of :data:`SERIES`, one value per x (bytes), None where that run has no
    point; ``marks`` are the peaks, OOMs and step starts of both runs, each ``{"x", "kind", "label", "run"}``."""

    x: list[float]
    series: dict[str, list[int | None]]
    marks: list[dict]


@dataclass
class PairView:
    """One pair of ranks: ``event`` and ``time`` are the two x axes (None when a run has no history);
    ``aligned_steps`` how many step starts were aligned (0: the runs start together); ``flame`` the difference
    tree, ``frames`` its frame labels, taken after event ``before_event`` / ``after_event`` (each run's peak of
    reserved bytes)."""

    rank: int
    before_path: str
    after_path: str
    aligned_steps: int
    event: AxisTable | None
    time: AxisTable | None
    flame: DiffTree
    frames: list[str]
    before_event: int
    after_event: int


@dataclass
class DiffVisual:
    """Everything the HTML diff draws, per pair of ranks of :class:`~oomdoctor.report.diff.Diff`, in its order."""

    pairs: list[PairView] = field(default_factory=list)


def warp(x: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """``x`` mapped piecewise linearly so that ``src[i]`` goes to ``dst[i]`` (both ascending), shifted by the
    first (last) pair before (after) them; ``x`` itself when there is no pair."""
    x = np.asarray(x, dtype=np.float64)
    if src.size == 0:
        return x
    y = np.interp(x, src, dst) if src.size > 1 else x - src[0] + dst[0]
    y = np.where(x < src[0], x - src[0] + dst[0], y)
    return np.where(x > src[-1], x - src[-1] + dst[-1], y)


def _anchors(b: DeviceAnalysis, a: DeviceAnalysis) -> tuple[np.ndarray, np.ndarray]:
    """Event indices of the starts of the steps both runs show, by the job's step number: ``(before, after)``,
    both strictly ascending."""
    sb, sa = b.steps, a.steps
    if sb is None or sa is None:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    nb = {sb.first + i: int(k) for i, k in enumerate(sb.starts.tolist())}
    na = {sa.first + i: int(k) for i, k in enumerate(sa.starts.tolist())}
    pairs, last = [], (-2, -2)
    for s in sorted(nb.keys() & na.keys()):
        if nb[s] > last[0] and na[s] > last[1]:
            pairs.append((nb[s], na[s]))
            last = pairs[-1]
    got = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    return got[:, 0], got[:, 1]


def _rel_time_us(a: DeviceAnalysis) -> np.ndarray:
    t = a.timeline.time_us
    return t - int(t[0])


def _axis(runs: list[tuple[str, DeviceAnalysis, np.ndarray]], mode: str) -> AxisTable:
    """Join the runs' timelines on one x axis. ``runs``: ``(name, analysis, anchors)``, the before run first;
    anchors are event indices of aligned step starts, the before run's at the same positions in both.
    ``mode``: ``event`` or ``time``."""
    before, dst = runs[0][1], runs[0][2]
    t_before = _rel_time_us(before)
    cols: dict[float, dict[str, int]] = {}
    marks = []
    for name, a, src in runs:
        t = _rel_time_us(a)

        def x_of(events: list[int]) -> list[float]:
            ev = np.maximum(np.asarray(events, np.int64), 0)
            if mode == "event":
                return np.round(warp(ev, src, dst), 3).tolist()
            return np.round(warp(t[ev], t[src], t_before[dst]) / 1e6, 6).tolist()

        view = timeline_view(a, OVERLAY_POINTS)
        assert view is not None  # runs with history: pair_view joins none other
        for i, x in enumerate(x_of(view.event)):
            row = cols.setdefault(x, {})
            for s in SERIES:
                key, v = f"{name}_{s}", getattr(view, s)[i]
                row[key] = max(row.get(key, v), v)
        ms: list[Marker] = markers(a)
        for m, x in zip(ms, x_of([m.event for m in ms])):
            marks.append({"x": x, "kind": m.kind, "label": f"{name}: {m.label}", "run": name})
    x = sorted(cols)
    keys = [f"{name}_{s}" for name, _a, _src in runs for s in SERIES]
    return AxisTable(x, {k: [cols[v].get(k) for v in x] for k in keys}, marks)


def pair_view(rank: int, b: DeviceAnalysis, a: DeviceAnalysis) -> PairView:
    """The :class:`PairView` of two analysed ranks."""
    src_b, src_a = _anchors(b, a)
    event = time = None
    if b.num_events and a.num_events:
        runs = [("before", b, src_b), ("after", a, src_a)]
        event, time = _axis(runs, "event"), _axis(runs, "time")
    frames = FrameTable()
    kb, ka = b.peak_reserved[1], a.peak_reserved[1]
    tree = diff_tree(alive_by_path(b, kb), alive_by_path(a, ka), frames)
    return PairView(rank, b.trace.path, a.trace.path, int(src_b.size), event, time, tree, frames.labels, kb, ka)


def build_diff_visual(diff, before: list[DeviceAnalysis], after: list[DeviceAnalysis]) -> DiffVisual:
    """The :class:`DiffVisual` of ``diff`` (a :class:`oomdoctor.report.diff.Diff`, a layer above: read through its
    ``ranks``' ``rank``, ``before_path`` and ``after_path``), made from the analyses it compared (matched by file)."""
    b_by = {x.trace.path: x for x in before}
    a_by = {x.trace.path: x for x in after}
    return DiffVisual([pair_view(r.rank, b_by[r.before_path], a_by[r.after_path]) for r in diff.ranks])
