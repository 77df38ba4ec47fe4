"""What the HTML report draws, computed here so that the page only lays it out.

Per rank: the memory timeline downsampled for drawing (each bucket keeps its maximum, so every peak is
exact), the peak / OOM / step markers, the fragmentation anatomy and the segment map at the peak and at
the OOM, the top allocation sites at the peak with their stacks and lifetimes, and the flame graphs of live
memory at a bounded set of moments (:mod:`oomdoctor.views.flame`). Bytes are ints,
times are µs. Definitions of the counters: :mod:`oomdoctor.analysis.timeline`; of the anatomy:
:mod:`oomdoctor.analysis.fragmentation`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..analysis.device import DeviceAnalysis
from ..analysis.fragmentation import Anatomy, LiveSegment, segment_states
from ..analysis.lifetimes import IN_TRACE
from ..analysis.sites import site_index, site_label, stack_text
from .flame import FlameView, flame_view
from .moments import RANK_MOMENTS, moments_per_rank, page_moments

TIMELINE_POINTS = 2000
"""Buckets per drawn series. More than a screen is wide; the page draws in well under a second."""
MAP_BLOCKS = 12_000
"""At most this many blocks are drawn in one segment map; further segments are listed as left out."""
TOP_SITES = 15
STACK_FRAMES = 40


@dataclass
class TimelineView:
    """The timeline in ``len(event)`` buckets. ``event[i]`` is the first event of bucket i, ``time_us[i]``
    its time relative to the trace's first event; the four counters are the bucket's maximum after
    any of its events (bytes). ``events_per_bucket`` is 1 when nothing was downsampled."""

    event: list[int]
    time_us: list[int]
    requested: list[int]
    allocated: list[int]
    active: list[int]
    reserved: list[int]
    events_per_bucket: int
    start_time_us: int


@dataclass
class Marker:
    """A moment: ``kind`` is ``peak_reserved``, ``peak_allocated``, ``oom`` or ``step``; ``event`` the
    event index (-1: before the first), ``time_us`` relative to the first event, ``bytes`` what it is
    about (the request for an OOM)."""

    kind: str
    event: int
    time_us: int
    bytes: int
    label: str = ""


@dataclass
class SegmentView(LiveSegment):
    """One segment at a moment (the :class:`~oomdoctor.analysis.fragmentation.LiveSegment`'s fields, then its
    blocks); ``blocks`` are ``[offset, size, state]`` covering it exactly, in address order, ``state`` one of
    ``allocated``, ``pending_free``, ``free`` (bytes)."""

    blocks: list[list]


@dataclass
class MomentView:
    """The allocator state after event ``event``: its anatomy (the identity of
    :class:`~oomdoctor.analysis.fragmentation.Anatomy` holds) and its segment map."""

    name: str
    event: int
    anatomy: Anatomy
    segments: list[SegmentView]
    segments_left_out: int = 0


@dataclass
class SiteView:
    """Bytes one allocation site holds at the peak; lifetimes (µs) are the median and maximum over its
    blocks from allocation to the user's free, or to the trace's end when still allocated
    (``from_start`` counts blocks allocated before recording began, whose lifetime is a lower bound)."""

    label: str
    bytes: int
    count: int
    median_lifetime_us: int
    max_lifetime_us: int
    from_start: int
    stack: list[str] = field(default_factory=list)


@dataclass
class RankView:
    rank: int
    path: str
    device: int
    timeline: TimelineView | None
    markers: list[Marker]
    moments: list[MomentView]
    sites: list[SiteView]
    flame: FlameView | None = None


@dataclass
class Heatmap:
    """Allocated memory of many ranks over time: ``values[i][j]`` is rank ``ranks[i]``'s maximum allocated bytes in
    the ``j``-th of ``columns`` equal spans of ``duration_us`` (µs since each rank's first event), as a fraction of
    ``max_bytes`` in 0..255."""

    ranks: list[int]
    columns: int
    duration_us: int
    max_bytes: int
    values: list[list[int]]


HEAT_COLUMNS = 160
"""Columns of the heatmap (a rank's own time is read in :data:`HEAT_READ` buckets, then put on the common axis)."""
HEAT_READ = 640


def heatmap(rows: list[tuple[int, list[int], int]], columns: int = HEAT_COLUMNS) -> Heatmap:
    """The heatmap of ``rows`` ``(rank, allocated bytes in equal spans of its own duration, duration µs)``, put on
    one time axis: the longest duration."""
    dur = max((d for _r, _v, d in rows), default=0)
    top = max((max(v) for _r, v, _d in rows if v), default=0)
    values = []
    for _rank, v, d in rows:
        out = np.zeros(columns, dtype=np.int64)
        if v:
            src = np.asarray(v, dtype=np.int64)
            # span k of the rank covers [k, k+1) * d / len(v) µs; on the common axis its column is that time
            col = np.minimum((np.arange(src.size) * max(d, 1) * columns) // (src.size * max(dur, 1)), columns - 1) \
                if dur else np.zeros(src.size, dtype=np.int64)
            np.maximum.at(out, col, src)
            last = np.maximum.accumulate(np.where(out > 0, np.arange(columns), 0))
            end = int(col.max())
            out[: end + 1] = out[last[: end + 1]]  # columns between two spans keep the value before them
        values.append([int(x) for x in (out * 255 // max(top, 1))])
    return Heatmap([r for r, _v, _d in rows], columns, dur, top, values)


@dataclass
class Visual:
    """Everything the HTML report draws beyond the :class:`~oomdoctor.report.model.Report`: ``ranks`` the views
    of the ranks the page shows (every rank up to 8; above, the odd ranks and one of each group), ``heatmap``
    every rank's allocated memory over time (above 8 ranks)."""

    ranks: list[RankView]
    timeline_points: int = TIMELINE_POINTS
    heatmap: Heatmap | None = None


def _bucket_max(values: np.ndarray, edges: np.ndarray) -> list[int]:
    return np.maximum.reduceat(values, edges).astype(np.int64).tolist()


def timeline_view(a: DeviceAnalysis, points: int = TIMELINE_POINTS) -> TimelineView | None:
    """The downsampled timeline of one rank; None without history. Each series' maximum equals the
    exact peak of the undownsampled series (asserted)."""
    n = a.num_events
    if n == 0:
        return None
    tl = a.timeline
    per = max(1, -(-n // points))
    edges = np.arange(0, n, per, dtype=np.int64)
    t = tl.time_us
    t0 = int(t[0])
    view = TimelineView(event=edges.tolist(), time_us=(t[edges] - t0).astype(np.int64).tolist(),
                        requested=_bucket_max(tl.requested, edges), allocated=_bucket_max(tl.allocated, edges),
                        active=_bucket_max(tl.active, edges), reserved=_bucket_max(tl.reserved, edges),
                        events_per_bucket=per, start_time_us=t0)
    assert max(view.reserved) == int(tl.reserved.max()) and max(view.allocated) == int(tl.allocated.max())
    return view


def markers(a: DeviceAnalysis) -> list[Marker]:
    """Peaks, OOMs and step starts of one rank, in event order."""
    t = a.timeline.time_us if a.num_events else np.zeros(0, np.int64)
    t0 = int(t[0]) if t.size else 0

    def rel(k: int) -> int:
        return int(t[k]) - t0 if k >= 0 and t.size else 0

    out = []
    pr, pr_k = a.peak_reserved
    pa, pa_k = a.peak_allocated
    out.append(Marker("peak_reserved", pr_k, rel(pr_k), pr, "peak reserved"))
    out.append(Marker("peak_allocated", pa_k, rel(pa_k), pa, "peak allocated"))
    sizes = a.device.events["size"]
    for k in a.oom_events.tolist():
        out.append(Marker("oom", k, rel(k), int(sizes[k]), "OOM"))
    steps = a.steps if a.num_events else None
    if steps is not None:
        for i, k in enumerate(steps.starts.tolist()):
            out.append(Marker("step", k, rel(k), 0, f"step {i}"))
    return sorted(out, key=lambda m: (m.event, m.kind))


def segment_map(a: DeviceAnalysis, k: int, max_blocks: int = MAP_BLOCKS) -> tuple[list[SegmentView], int]:
    """The segments after event ``k`` with their blocks and free gaps; returns ``(segments, left_out)``
    where ``left_out`` counts segments not drawn once ``max_blocks`` blocks were laid out (the
    largest segments are kept). Sizes in each segment add up to its size (asserted)."""
    views = []
    for st in segment_states(a.device, a.lifetimes, k):
        s = st.segment
        blocks = [[addr - s.address, size, state] for addr, size, state, _ in st.blocks]
        views.append(SegmentView(s.address, s.size, s.stream, s.segment_type, s.pool_id, s.is_expandable, blocks))
    kept = sorted(views, key=lambda v: -v.size)
    total, keep = 0, []
    for v in kept:
        if keep and total + len(v.blocks) > max_blocks:
            break
        keep.append(v)
        total += len(v.blocks)
    left_out = len(views) - len(keep)
    return sorted(keep, key=lambda v: v.address), left_out


def site_views(a: DeviceAnalysis, k: int, limit: int = TOP_SITES) -> list[SiteView]:
    """The sites holding the most allocated bytes after event ``k``, with stacks and lifetimes."""
    lt, n = a.lifetimes, a.num_events
    rows = np.flatnonzero(lt.allocated_mask(k))
    if rows.size == 0:
        return []
    t = a.timeline.time_us if n else np.zeros(1, np.int64)
    idx = site_index(a.trace)
    site = idx.sites_of(lt.stack[rows], lt.start_state[rows] != IN_TRACE)  # as group_sites
    born = np.where(lt.alloc[rows] >= 0, t[np.maximum(lt.alloc[rows], 0)], t[0])
    gone = np.where(lt.free_requested[rows] >= 0, t[np.maximum(lt.free_requested[rows], 0)], t[-1])
    life = (gone - born).astype(np.int64)
    size = lt.size[rows]
    out = []
    for s in a.sites_at(k)[:limit]:
        m = site == s.frame
        stack = stack_text(a.trace, s.stack)[:STACK_FRAMES]
        out.append(SiteView(site_label(a.trace, s.frame), s.bytes, s.count, int(np.median(life[m])),
                            int(life[m].max()), int((lt.alloc[rows][m] < 0).sum()), stack))
        assert int(size[m].sum()) == s.bytes
    return out


def rank_view(a: DeviceAnalysis, flame_moments: int = RANK_MOMENTS[1]) -> RankView:
    """The :class:`RankView` of one analysed rank: moments at the peak reserved and at the last OOM, and the
    flame graphs of live memory at up to ``flame_moments`` moments (:func:`~oomdoctor.views.flame.flame_view`)."""
    moments = []
    pr_k = a.peak_reserved[1]
    wanted = [("peak reserved", pr_k)]
    if a.oom_events.size:
        wanted.append(("OOM", int(a.oom_events[-1])))
    for name, k in wanted:
        segs, left = segment_map(a, k)
        moments.append(MomentView(name, k, a.anatomy_at(k), segs, left))
    return RankView(rank=a.rank, path=a.trace.path, device=a.device.device, timeline=timeline_view(a),
                    markers=markers(a), moments=moments, sites=site_views(a, a.peak_allocated[1]),
                    flame=flame_view(a, page_moments(a, flame_moments)))


def build_visual(analyses: list[DeviceAnalysis]) -> Visual:
    """The visual part of the report for analyses already made (one per rank)."""
    per_rank = moments_per_rank(len(analyses))
    return Visual(ranks=[rank_view(a, per_rank) for a in analyses])
