"""Fragmentation anatomy: where the reserved bytes are at one moment of the trace.

At any event ``k``::

    reserved = requested + rounding_waste + pending_free + free_in_used_segments + free_segments

*requested*: what live tensors asked for; *rounding waste*: block size minus request of allocated
blocks; *pending free*: blocks the user freed whose reuse waits on other streams' events
(``record_stream``); *free in used segments*: inactive bytes of segments that still hold an active
block, which ``empty_cache()`` cannot return and which only fit requests no larger than the gaps
("reserved but unallocated" in the OOM message, minus whole free segments); *free segments*: whole
inactive segments (releasable). Definitions: ``caching_allocator_spec.md`` §2.4, §6.4, §9.3;
``torch/cuda/_memory_viz.py`` ``segsum`` (internal vs external free).

The state at ``k`` is the final segments with the segment events after ``k`` undone, holding the blocks
that :mod:`.lifetimes` says are active after ``k``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..trace.model import (
    DEFAULT_POOL,
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    SEGMENT_MAP,
    SEGMENT_UNMAP,
    DeviceTrace,
    Segment,
)
from .lifetimes import Lifetimes
from .rounding import K_SMALL_BUFFER, K_SMALL_SIZE


@dataclass
class PoolAnatomy:
    """The anatomy of one (pool, segment type, stream) group. Bytes.

    The docstring under each field is its description in the JSON schema (``oomdoctor schema diagnose``); for the
    whole device (:class:`Anatomy`) the sums are over every group and the group's keys are the first group's."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    pool_id: tuple[int, int]
    """the memory pool: [0, 0] is the default pool, others are CUDA graph private pools (the whole device: the
    first group's)"""
    segment_type: str
    """'small' (blocks up to 1 MiB) or 'large' segments (the whole device: the first group's)"""
    stream: int
    """the CUDA stream the segments belong to (the whole device: the first group's)"""
    is_expandable: bool
    """segments are expandable (expandable_segments:True)"""
    segments: int = 0
    """segments in the group (the whole device: all)"""
    reserved_bytes: int = 0
    """reserved by the allocator in the group (the whole device: all), cudaMalloc'd segments (bytes)"""
    requested_bytes: int = 0
    """what the live tensors asked for (bytes)"""
    rounding_waste_bytes: int = 0
    """the allocator's rounding of live blocks: allocated = requested + rounding (bytes)"""
    pending_free_bytes: int = 0
    """blocks freed by Python but held for other streams, record_stream (bytes)"""
    free_in_used_segments_bytes: int = 0
    """free blocks inside segments that also hold live blocks (bytes)"""
    free_segments_bytes: int = 0
    """whole free segments: empty_cache() would return them (bytes)"""
    largest_free_block_bytes: int = 0
    """the largest free block (bytes)"""

    @property
    def allocated_bytes(self) -> int:
        """requested + rounding (bytes)"""
        return self.requested_bytes + self.rounding_waste_bytes

    @property
    def free_bytes(self) -> int:
        return self.free_in_used_segments_bytes + self.free_segments_bytes


@dataclass
class Anatomy(PoolAnatomy):
    """The whole device at event ``event_index`` (-1: trace start), with per-group detail in ``pools``.

    ``unattributed_bytes`` counts active blocks found in no live segment (0 on a consistent trace).
    """

    event_index: int = -1
    """the event after which the state is taken (-1: trace start)"""
    pools: list[PoolAnatomy] = field(default_factory=list[PoolAnatomy])
    """per (pool, segment type, stream) group"""
    unattributed_bytes: int = 0
    """active blocks found in no live segment: 0 on a consistent trace (bytes)"""

    def check(self) -> None:
        """Assert the identity ``reserved = requested + waste + pending + free in used + free whole``."""
        parts = (self.requested_bytes + self.rounding_waste_bytes + self.pending_free_bytes
                 + self.free_in_used_segments_bytes + self.free_segments_bytes)
        assert parts == self.reserved_bytes, (parts, self.reserved_bytes)
        assert sum(p.reserved_bytes for p in self.pools) == self.reserved_bytes

    def largest_free_block(self, stream: int, segment_type: str, pool_id: tuple[int, int] = DEFAULT_POOL) -> int:
        """Largest free block a request on ``stream`` from this pool could use (bytes)."""
        return max((p.largest_free_block_bytes for p in self.pools if p.stream == stream
                    and p.segment_type == segment_type and p.pool_id == pool_id), default=0)


@dataclass
class LiveSegment:
    """A segment (or a mapped range of an expandable segment) as it stood after some event: its address
    and size (bytes), stream, ``segment_type`` (``"small"``/``"large"``), pool and whether it is expandable."""

    address: int
    size: int
    stream: int
    segment_type: str
    pool_id: tuple[int, int]
    is_expandable: bool


def live_segments(dt: DeviceTrace, k: int) -> list[LiveSegment]:
    """Segments (or mapped ranges of expandable segments) that exist after event ``k``, by address."""
    segs: dict[int, LiveSegment] = {s.address: LiveSegment(s.address, s.total_size, s.stream, s.segment_type, s.pool_id,
                                             s.is_expandable) for s in dt.segments}
    action = dt.events["action"]
    later = np.flatnonzero((action[k + 1:] >= SEGMENT_ALLOC) & (action[k + 1:] <= SEGMENT_UNMAP)) + k + 1
    expandable: list[tuple[int, int, int]] = [(s.address, s.end, s.stream) for s in dt.segments if s.is_expandable]
    exp_final = [s for s in dt.segments if s.is_expandable]
    addr, size, stream = dt.events["addr"], dt.events["size"], dt.events["stream"]
    for j in later[::-1].tolist():  # undo, newest first
        a, s, st, act = int(addr[j]), int(size[j]), int(stream[j]), int(action[j])
        if act == SEGMENT_ALLOC:
            segs.pop(a, None)
        elif act == SEGMENT_FREE:
            segs[a] = LiveSegment(a, s, st, "small" if s == K_SMALL_BUFFER else "large", DEFAULT_POOL, False)
        elif act == SEGMENT_MAP:
            expandable = _interval_remove(expandable, a, a + s, st)
        else:
            expandable = _interval_add(expandable, a, a + s, st)
    out = [v for v in segs.values() if not v.is_expandable]
    for lo, hi, st in expandable:
        meta = _owning_expandable(exp_final, lo, st)
        out.append(LiveSegment(lo, hi - lo, st, meta.segment_type if meta else "large",
                        meta.pool_id if meta else DEFAULT_POOL, True))
    return sorted(out, key=lambda s: s.address)


def _owning_expandable(final: list[Segment], lo: int, stream: int) -> Segment | None:
    """The final expandable range of ``stream`` whose virtual-address reservation most likely holds
    ``lo``: the nearest one starting at or below it (a reservation is one contiguous VA range per pool
    and stream, ``ExpandableSegment``), else the nearest above. None when the stream has none."""
    mine = [s for s in final if s.stream == stream]
    below = [s for s in mine if s.address <= lo]
    if below:
        return max(below, key=lambda s: s.address)
    return min(mine, key=lambda s: s.address) if mine else None


def _interval_remove(ivs: list[tuple[int, int, int]], lo: int, hi: int, st: int) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for a, b, s in ivs:
        if s != st or b <= lo or a >= hi:
            out.append((a, b, s))
            continue
        if a < lo:
            out.append((a, lo, s))
        if b > hi:
            out.append((hi, b, s))
    return out


def _interval_add(ivs: list[tuple[int, int, int]], lo: int, hi: int, st: int) -> list[tuple[int, int, int]]:
    merged = sorted(ivs + [(lo, hi, st)])
    out: list[tuple[int, int, int]] = []
    for a, b, s in merged:
        if out and out[-1][2] == s and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b), s)
        else:
            out.append((a, b, s))
    return out


def anatomy(dt: DeviceTrace, lt: Lifetimes, k: int) -> Anatomy:
    """Where the reserved bytes are after event ``k`` (``k = num_events - 1``: the final state;
    ``-1``: the trace's start). Pure; cost O(blocks + segments)."""
    segs = live_segments(dt, k)
    starts = np.array([s.address for s in segs], dtype=np.int64)
    ends = np.array([s.address + s.size for s in segs], dtype=np.int64)
    nseg = len(segs)

    alive = lt.alive_mask(k)
    allocated = lt.allocated_mask(k)
    order = np.flatnonzero(alive)
    order = order[np.argsort(lt.addr[order], kind="stable")]
    b_addr, b_size = lt.addr[order], lt.size[order]
    b_alloc = allocated[order]
    b_req = np.where(b_alloc, lt.requested[order], 0)
    b_waste = np.where(b_alloc, b_size - lt.requested[order], 0)
    b_pend = np.where(b_alloc, 0, b_size)
    si = np.searchsorted(starts, b_addr, side="right") - 1 if segs else np.full(b_addr.shape, -1)
    inside = (si >= 0) & (b_addr + b_size <= np.where(si >= 0, ends[np.maximum(si, 0)], 0)) if segs else si >= 0
    result = Anatomy(pool_id=DEFAULT_POOL, segment_type="all", stream=-1, is_expandable=False, event_index=k)
    result.unattributed_bytes = int(b_size[~inside].sum())
    si, b_addr, b_size = si[inside], b_addr[inside], b_size[inside]
    b_req, b_waste, b_pend = b_req[inside], b_waste[inside], b_pend[inside]

    occ = np.bincount(si, weights=b_size, minlength=nseg).astype(np.int64) if nseg else np.zeros(0, np.int64)
    cnt = np.bincount(si, minlength=nseg) if nseg else np.zeros(0, np.int64)
    req = np.bincount(si, weights=b_req, minlength=nseg).astype(np.int64) if nseg else occ
    waste = np.bincount(si, weights=b_waste, minlength=nseg).astype(np.int64) if nseg else occ
    pend = np.bincount(si, weights=b_pend, minlength=nseg).astype(np.int64) if nseg else occ
    # the largest free gap of each segment (blocks sorted by address): before its first block, between two, after
    # its last; a segment without blocks is one free block
    largest = (ends - starts).astype(np.int64)
    if b_addr.size:
        b_end = b_addr + b_size
        first = np.ones(b_addr.shape[0], dtype=bool)
        first[1:] = si[1:] != si[:-1]
        prev_end = np.empty_like(b_end)
        prev_end[1:] = b_end[:-1]
        prev_end[first] = starts[si[first]]
        last = np.ones(b_addr.shape[0], dtype=bool)
        last[:-1] = si[1:] != si[:-1]
        tail = np.zeros(nseg, dtype=np.int64)
        tail[si[last]] = ends[si[last]] - b_end[last]
        head_max = np.zeros(nseg, dtype=np.int64)
        np.maximum.at(head_max, si, b_addr - prev_end)
        has = np.zeros(nseg, dtype=bool)
        has[si] = True
        largest = np.where(has, np.maximum(head_max, tail), largest)

    groups: dict[tuple[tuple[int, int], str, int, bool], PoolAnatomy] = {}
    for i, s in enumerate(segs):
        key = (s.pool_id, s.segment_type, s.stream, s.is_expandable)
        g = groups.get(key)
        if g is None:
            g = groups[key] = PoolAnatomy(s.pool_id, s.segment_type, s.stream, s.is_expandable)
        free = s.size - int(occ[i])
        g.segments += 1
        g.reserved_bytes += s.size
        g.requested_bytes += int(req[i])
        g.rounding_waste_bytes += int(waste[i])
        g.pending_free_bytes += int(pend[i])
        if cnt[i] == 0:
            g.free_segments_bytes += free
        else:
            g.free_in_used_segments_bytes += free
        g.largest_free_block_bytes = max(g.largest_free_block_bytes, int(largest[i]))
    result.pools = sorted(groups.values(), key=lambda g: -g.reserved_bytes)
    for f in ("segments", "reserved_bytes", "requested_bytes", "rounding_waste_bytes", "pending_free_bytes",
              "free_in_used_segments_bytes", "free_segments_bytes"):
        setattr(result, f, sum(getattr(g, f) for g in result.pools))
    result.largest_free_block_bytes = max((g.largest_free_block_bytes for g in result.pools), default=0)
    return result


def request_pool(rounded_size: int) -> str:
    """``small`` for rounded requests up to 1 MiB (``kSmallSize``), else ``large`` (``get_pool``)."""
    return "small" if rounded_size <= K_SMALL_SIZE else "large"


STATE_ALLOCATED = "allocated"
STATE_PENDING_FREE = "pending_free"
STATE_FREE = "free"


@dataclass
class SegmentState:
    """A segment after some event with its blocks, free gaps included: ``blocks`` are
    ``(address, size, state, row)`` in address order, covering the segment exactly; ``state`` is
    :data:`STATE_ALLOCATED`, :data:`STATE_PENDING_FREE` or :data:`STATE_FREE`; ``row`` indexes the
    :class:`~.lifetimes.Lifetimes` (-1 for a gap). Bytes."""

    segment: LiveSegment
    blocks: list[tuple[int, int, str, int]]


def segment_states(dt: DeviceTrace, lt: Lifetimes, k: int) -> list[SegmentState]:
    """Every segment after event ``k`` with the blocks :mod:`.lifetimes` says are active then. A block
    that does not fit where the walk stands (an inconsistent trace) is left out, as :func:`anatomy`
    counts it unattributed. Sizes in each segment add up to its size (asserted)."""
    segs = live_segments(dt, k)
    alive = np.flatnonzero(lt.alive_mask(k))
    allocated = lt.allocated_mask(k)
    alive = alive[np.argsort(lt.addr[alive], kind="stable")]
    starts = np.array([s.address for s in segs], dtype=np.int64)
    si = np.searchsorted(starts, lt.addr[alive], side="right") - 1 if segs else np.zeros(0, np.int64)
    out: list[SegmentState] = []
    for i, s in enumerate(segs):
        pos, end = s.address, s.address + s.size
        blocks: list[tuple[int, int, str, int]] = []
        for r in alive[si == i].tolist():
            addr, size = int(lt.addr[r]), int(lt.size[r])
            if addr < pos or addr + size > end:
                continue
            if addr > pos:
                blocks.append((pos, addr - pos, STATE_FREE, -1))
            blocks.append((addr, size, STATE_ALLOCATED if allocated[r] else STATE_PENDING_FREE, r))
            pos = addr + size
        if pos < end:
            blocks.append((pos, end - pos, STATE_FREE, -1))
        assert sum(b[1] for b in blocks) == s.size
        out.append(SegmentState(s, blocks))
    return out
