"""Which events of a trace belong to CUDA-graph private pools, which the allocator model leaves out.

A private pool (``PrivatePool``: ``torch.cuda.graph`` capture, ``torch.compile(mode="reduce-overhead")``
cudagraph trees, ``torch.cuda.MemPool``) has its own segments and free lists; its blocks never serve
the default pools and garbage collection never touches it (``caching_allocator_spec.md`` §2.3). The
model replays the default pools; a private pool is replayed *as recorded*: its segments come and go
where the trace says (they count against the cap and in reserved bytes) and its allocations are not
simulated.

Which segment belongs to which pool, first that applies:

1. the trace entry's ``pool_id`` (PyTorch >= 2.13 records it);
2. a segment still alive at the end: the final snapshot's ``segment_pool_id``;
3. a segment freed within the trace: the pool most final segments on its stream belong to (capture
   runs on a dedicated stream: ``torch.cuda.graph``'s ``capture_stream``, cudagraph trees' own stream).

Allocations and frees belong to the pool of the segment holding their address at that time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..analysis.fragmentation import LiveSegment
from ..trace.model import (
    ALLOC,
    DEFAULT_POOL,
    FREE_COMPLETED,
    FREE_REQUESTED,
    SEGMENT_ALLOC,
    SEGMENT_MAP,
    SEGMENT_UNMAP,
    DeviceTrace,
    Trace,
)


@dataclass
class PoolSummary:
    """One private pool: segments seen, the most bytes it reserved at once, events that touch it."""

    pool_id: tuple[int, int]
    segments: int = 0
    peak_reserved_bytes: int = 0
    events: int = 0


@dataclass
class PrivatePools:
    """``private``: bool per event, the events of private pools (allocations, frees, segment
    entries); ``start_segments``: addresses of segments alive at the trace's start that are private;
    ``pools``: a summary per private pool."""

    private: np.ndarray
    start_segments: set[int] = field(default_factory=set[int])
    pools: dict[tuple[int, int], PoolSummary] = field(default_factory=dict[tuple[int, int], PoolSummary])

    def warning(self) -> str:
        parts = [f"{p.pool_id} ({p.segments} segments, up to {p.peak_reserved_bytes} bytes reserved, {p.events} events)"
                 for p in self.pools.values()]
        return ("CUDA-graph private pool" + ("s " if len(parts) > 1 else " ") + ", ".join(parts) + " replayed as "
                "recorded, not simulated: private pools are outside the allocator model (their segments count "
                "against the cap as recorded); the default pools are replayed")


def private_pools(trace: Trace, dt: DeviceTrace, start_segments: list[LiveSegment]) -> PrivatePools | None:
    """Classify the events of ``dt`` (module doc); None when nothing points to a private pool.
    ``start_segments``: the segments alive at the trace's start (``live_segments(dt, -1)``)."""
    act, addr, size, stream = dt.events["action"], dt.events["addr"], dt.events["size"], dt.events["stream"]
    pool_col = dt.events.get("pool")
    recorded_pools = pool_col is not None and bool((pool_col >= 0).any())
    final = {s.address: s.pool_id for s in dt.segments}
    if not recorded_pools and all(p == DEFAULT_POOL for p in final.values()):
        return None
    by_stream: dict[int, Counter[tuple[int, int]]] = {}
    for s in dt.segments:
        by_stream.setdefault(s.stream, Counter())[s.pool_id] += 1
    stream_pool = {st: c.most_common(1)[0][0] for st, c in by_stream.items()}

    def pool_of(j: int, a: int, st: int, alive_at_end: bool) -> tuple[int, int]:
        if recorded_pools and pool_col is not None and j >= 0 and pool_col[j] >= 0:
            return trace.pools[int(pool_col[j])]  # a (device, id) tuple
        if alive_at_end and a in final:
            return final[a]
        return stream_pool.get(st, DEFAULT_POOL)

    n: int = act.shape[0]
    seg_pos = np.flatnonzero((act >= SEGMENT_ALLOC) & (act <= SEGMENT_UNMAP)).tolist()
    last_alloc: dict[int, int] = {}
    for j in seg_pos:
        if act[j] in (SEGMENT_ALLOC, SEGMENT_MAP):
            last_alloc[int(addr[j])] = j
        elif int(addr[j]) in last_alloc:
            del last_alloc[int(addr[j])]
    live: dict[int, tuple[int, int, tuple[int, int]]] = {}  # address -> (start event, size, pool)
    out = PrivatePools(np.zeros(n, dtype=bool))
    for s in start_segments:
        p = pool_of(-1, s.address, s.stream, s.address in final and s.address not in last_alloc)
        if s.pool_id != DEFAULT_POOL:
            p = s.pool_id
        live[s.address] = (-1, s.size, p)
        if p != DEFAULT_POOL:
            out.start_segments.add(s.address)
    intervals: list[tuple[int, int, int, int, tuple[int, int]]] = []  # (from, to, lo, hi, pool)
    reserved: Counter[tuple[int, int]] = Counter()
    for _j0, sz, p in live.values():
        if p != DEFAULT_POOL:
            reserved[p] += sz
            summary = out.pools.setdefault(p, PoolSummary(p))
            summary.segments += 1
            summary.peak_reserved_bytes = reserved[p]
    for j in seg_pos:
        a, sz, st, k = int(addr[j]), int(size[j]), int(stream[j]), int(act[j])
        if k in (SEGMENT_ALLOC, SEGMENT_MAP):
            p = pool_of(j, a, st, last_alloc.get(a) == j)
            live[a] = (j, sz, p)
            if p != DEFAULT_POOL:
                reserved[p] += sz
                summary = out.pools.setdefault(p, PoolSummary(p))
                summary.segments += 1
                summary.events += 1
                summary.peak_reserved_bytes = max(summary.peak_reserved_bytes, reserved[p])
                out.private[j] = True
        else:
            j0, sz0, p = live.pop(a, (-1, sz, pool_of(j, a, st, False)))
            if p != DEFAULT_POOL:
                reserved[p] -= sz
                out.private[j] = True
                out.pools.setdefault(p, PoolSummary(p)).events += 1
                intervals.append((j0, j, a, a + sz0, p))
    for a, (j0, sz, p) in live.items():
        if p != DEFAULT_POOL:
            intervals.append((j0, n, a, a + sz, p))
    if not intervals:
        return None
    blocks = np.flatnonzero(np.isin(act, (ALLOC, FREE_REQUESTED, FREE_COMPLETED)))
    b_addr = addr[blocks]
    for j0, j1, lo, hi, p in intervals:
        lo_i, hi_i = np.searchsorted(blocks, [j0 + 1, j1])
        inside = (b_addr[lo_i:hi_i] >= lo) & (b_addr[lo_i:hi_i] < hi)
        out.private[blocks[lo_i:hi_i][inside]] = True
        out.pools[p].events += int(inside.sum())
    return out
