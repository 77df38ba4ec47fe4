"""Block lifetimes: alloc -> free_requested -> free_completed for every block, truncation-aware.

The trace pairs events by address: ``alloc`` returns a block at ``addr``; ``free_requested`` is the
user's free; ``free_completed`` is when the block really returned to the pool, later than
``free_requested`` only when the block was used on another stream (``record_stream``) and the
allocator waited on CUDA events (``CUDACachingAllocator.cpp`` ``free``/``insert_events``/
``process_events``; ``shared/reference/caching_allocator_spec.md`` §8).

A trace may start after blocks were allocated (recording began late, or the ``max_entries`` ring
buffer dropped the oldest events). Those blocks are reconstructed from the evidence the trace and the
final segments give: a free with no alloc before it means the block existed at the start; an active
block of the final segments whose address never appears in the trace existed all along ("ghost"). A
ghost carries its allocation stack (the final segments keep it); a block whose alloc was dropped keeps
the stack of its free event in ``free_stack``, which is the allocation's stack when frees were recorded
without stacks of their own (``context="alloc"``: ``CUDACachingAllocator.cpp`` ``free`` records
``block->context_when_allocated``), and :func:`adopt_free_stacks` makes it the row's stack then.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

import numpy as np

from ..trace.model import ALLOC, FREE_COMPLETED, FREE_REQUESTED, Block, DeviceTrace, Trace
from .arrays import last_in_group, stable_argsort
from .rounding import divisions_table, round_size

IN_TRACE = 0
ALLOCATED_AT_START = 1
PENDING_AT_START = 2
#: Without a sidecar, frees are taken to carry no stacks of their own when at least SAME_STACK_FRACTION of at least
#: MIN_PAIRS blocks were freed with their allocation's stack (:func:`free_stacks`; docs/diagnose.md).
MIN_PAIRS = 20
SAME_STACK_FRACTION = 0.98


@dataclass
class Lifetimes:
    """One row per block instance, as parallel arrays (length ``n``).

    ``alloc``/``free_requested``/``free_completed`` are event indices, -1 when the event is not in
    the trace (before its start, or not yet happened at its end). ``size`` is the block size in bytes
    (exact where the block is in the final segments, else the allocator's rounding of ``requested``);
    ``start_state`` is :data:`IN_TRACE`, :data:`ALLOCATED_AT_START` or :data:`PENDING_AT_START`;
    ``free_stack`` is the stack of the free event of a block allocated before the trace (-1 elsewhere).
    """

    addr: np.ndarray
    requested: np.ndarray
    size: np.ndarray
    stream: np.ndarray
    stack: np.ndarray
    alloc: np.ndarray
    free_requested: np.ndarray
    free_completed: np.ndarray
    start_state: np.ndarray
    size_exact: np.ndarray
    unmatched_frees: int
    ghost_blocks: int
    truncated: bool
    """True when the trace shows blocks that existed before it started (late start or ring-buffer overflow):
    ``unmatched_frees`` or ``ghost_blocks``."""
    deferred: np.ndarray
    """Per row: its completion was deferred: ``free_completed`` is not right after ``free_requested`` (or the block
    was still pending at the end, or at the start)."""
    free_stack: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.addr.shape[0])

    @cached_property
    def _spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(born, alive_until, allocated_until)``, event indices per block: a block is alive after event ``k``
        when ``born <= k < alive_until`` and allocated when ``born <= k < allocated_until`` (int64 extremes
        stand for "never" and "always"). Made once: the breakdowns ask for tens of masks (62 on ``large``), and
        two comparisons per mask replace eleven array operations (docs/benchmarks.md)."""
        never, always = np.iinfo(np.int64).max, np.iinfo(np.int64).min
        alloc = self.alloc.astype(np.int64, copy=False)
        born = np.where((alloc >= 0) | (self.start_state != IN_TRACE), alloc, never)
        fc = self.free_completed.astype(np.int64, copy=False)
        alive_until = np.where(fc < 0, never, fc)
        fr = self.free_requested.astype(np.int64, copy=False)
        freed_at = np.where(fr >= 0, fr, np.where(self.start_state != PENDING_AT_START, never, always))
        return born, alive_until, np.minimum(alive_until, freed_at)

    def alive_mask(self, k: int) -> np.ndarray:
        """Blocks active (allocated or pending free) after event ``k`` (-1: before the first event): born by
        ``k`` (in the trace, or before it) and not yet returned to the pool."""
        born, alive_until, _ = self._spans
        return (born <= k) & (alive_until > k)

    def allocated_mask(self, k: int) -> np.ndarray:
        """Blocks allocated (not yet freed by the user) after event ``k``: alive, and neither freed by ``k`` nor
        pending a free at the start."""
        born, _, allocated_until = self._spans
        return (born <= k) & (allocated_until > k)



def lifetimes(trace: Trace, dt: DeviceTrace) -> Lifetimes:
    """Pair the alloc/free events of ``dt`` into block lifetimes and add the blocks that existed
    before the trace started. Pure; O(n log n) in the number of events."""
    action, addr = dt.events["action"], dt.events["addr"]
    mem = np.flatnonzero((action == ALLOC) | (action == FREE_REQUESTED) | (action == FREE_COMPLETED))
    order = mem[stable_argsort(addr[mem])]
    sa, sact = addr[order], action[order]
    m: int = order.shape[0]
    pos: np.ndarray = np.arange(m)
    new_group = np.ones(m, dtype=bool)
    if m:
        new_group[1:] = sa[1:] != sa[:-1]
    group_start: np.ndarray = np.maximum.accumulate(np.where(new_group, pos, 0)) if m else pos

    is_a, is_fr, is_fc = sact == ALLOC, sact == FREE_REQUESTED, sact == FREE_COMPLETED
    last_a = last_in_group(is_a, group_start)
    last_fr = last_in_group(is_fr, group_start)
    last_fc = last_in_group(is_fc, group_start)
    prev_fr = np.concatenate(([-1], last_fr[:-1])) if m else last_fr
    prev_fr = np.where(prev_fr >= group_start, prev_fr, -1)
    prev_fc = np.concatenate(([-1], last_fc[:-1])) if m else last_fc
    prev_fc = np.where(prev_fc >= group_start, prev_fc, -1)

    # free_requested -> its alloc (the last alloc of this address not already freed)
    fr_pos = np.flatnonzero(is_fr)
    fr_alloc = last_a[fr_pos]
    fr_ok = (fr_alloc >= 0) & (prev_fr[fr_pos] < fr_alloc)
    # free_completed -> its free_requested (since the last alloc), or its alloc when no request was recorded
    fc_pos = np.flatnonzero(is_fc)
    fc_fr = last_fr[fc_pos]
    fc_a = last_a[fc_pos]
    fc_fr_ok = (fc_fr >= 0) & (fc_fr > fc_a) & (prev_fc[fc_pos] < fc_fr)
    fc_a_ok = ~fc_fr_ok & (fc_a >= 0) & (prev_fc[fc_pos] < fc_a) & (last_fr[fc_pos] < fc_a)

    fr_of = np.full(m, -1, dtype=np.int64)  # alloc pos -> fr pos
    fr_of[fr_alloc[fr_ok]] = fr_pos[fr_ok]
    fc_of = np.full(m, -1, dtype=np.int64)  # alloc pos or fr pos -> fc pos
    fc_of[fc_fr[fc_fr_ok]] = fc_pos[fc_fr_ok]
    fc_of[fc_a[fc_a_ok]] = fc_pos[fc_a_ok]

    event_of = np.append(order, -1)  # sorted position -> event index; position -1 (none) -> -1

    # rows 1: allocs in the trace
    a_pos = np.flatnonzero(is_a)
    a_fr = fr_of[a_pos]
    a_fc = np.where(a_fr >= 0, fc_of[np.maximum(a_fr, 0)], fc_of[a_pos]) if a_pos.size else a_fr
    # rows 2: free_requested with no alloc before it -> allocated at the start
    u_fr = fr_pos[~fr_ok & (last_a[fr_pos] < 0)]
    u_fr_fc = fc_of[u_fr]
    # rows 3: free_completed with neither alloc nor request before it -> pending at the start
    u_fc = fc_pos[~fc_fr_ok & ~fc_a_ok & (fc_a < 0) & (fc_fr < 0)]

    ev_size, ev_stream, ev_stack = dt.events["size"], dt.events["stream"], dt.events["stack"]
    # row groups, one table each: a column per row, a row per field (addr, requested, stream, stack, alloc,
    # free_requested, free_completed, start_state, free_stack)
    groups: list[np.ndarray] = []

    ai = order[a_pos]  # rows 1
    groups.append(np.array((addr[ai], ev_size[ai], ev_stream[ai], ev_stack[ai], ai, event_of[a_fr], event_of[a_fc],
                            np.full(ai.size, IN_TRACE), np.full(ai.size, -1)), dtype=np.int64))
    ui = order[u_fr]  # rows 2
    groups.append(np.array((addr[ui], ev_size[ui], ev_stream[ui], np.full(ui.size, -1), np.full(ui.size, -1), ui,
                            event_of[u_fr_fc], np.full(ui.size, ALLOCATED_AT_START), ev_stack[ui]), dtype=np.int64))
    ci = order[u_fc]  # rows 3
    groups.append(np.array((addr[ci], ev_size[ci], ev_stream[ci], np.full(ci.size, -1), np.full(ci.size, -1),
                            np.full(ci.size, -1), ci, np.full(ci.size, PENDING_AT_START), ev_stack[ci]), dtype=np.int64))

    # rows 4: ghosts: active final blocks whose address never appears in the trace
    seen = set(sa[new_group].tolist())  # the distinct addresses: sa is sorted
    final_active: dict[int, Block] = {}
    ghosts: list[tuple[int, ...]] = []
    for seg, blk in dt.blocks:
        if blk.is_active:
            final_active[blk.address] = blk
            if blk.address not in seen:
                ghosts.append((blk.address, blk.requested_size, seg.stream, blk.stack, -1, -1, -1,
                               ALLOCATED_AT_START if blk.is_allocated else PENDING_AT_START, -1))
    if ghosts:
        groups.append(np.array(ghosts, dtype=np.int64).T)

    row_addr, req, stream, stack, alloc, fr, fc, state, free_stack = np.concatenate(groups, axis=1)
    stack, state, free_stack = stack.astype(np.int32), state.astype(np.int8), free_stack.astype(np.int32)
    size = round_size(req, divisions_table(trace.allocator_settings))
    exact = np.zeros(row_addr.shape[0], dtype=bool)
    # blocks still active at the end: their exact size (and frames) are in the final segments
    live_end = np.flatnonzero(fc < 0)
    for r in live_end.tolist():
        blk = final_active.get(int(row_addr[r]))
        if blk is not None:
            size[r] = blk.size
            exact[r] = True
            if stack[r] < 0:
                stack[r] = blk.stack
    return Lifetimes(addr=row_addr, requested=req, size=size, stream=stream, stack=stack,
                     alloc=alloc, free_requested=fr, free_completed=fc, start_state=state, size_exact=exact,
                     unmatched_frees=int(u_fr.size + u_fc.size), ghost_blocks=len(ghosts),
                     truncated=bool(u_fr.size or u_fc.size or ghosts),
                     deferred=((fr >= 0) & ((fc < 0) | (fc > fr + 1))) | (state == PENDING_AT_START),
                     free_stack=free_stack)


def free_stacks(trace: Trace, device: DeviceTrace, lt: Lifetimes) -> bool:
    """Whether frees carry their own stacks (recorded with ``context="all"``).

    Recorded with ``context="alloc"`` (oomdoctor's default since free stacks crash non-reentrant checkpointing) or
    ``"state"``, a free carries the stack of the allocation it frees, and a segment free the stack of the segment's
    allocation (``CUDACachingAllocator.cpp``: ``free`` and ``release_block`` pass ``context ? context :
    block->context_when_allocated``). The sidecar's ``recording.context`` says which; without a sidecar, frees whose
    stacks equal their allocation's for at least :data:`SAME_STACK_FRACTION` of at least :data:`MIN_PAIRS` blocks mean
    none were recorded (with free stacks, most frees happen on another line than the allocation).
    """
    rec = trace.meta.get("recording")
    if isinstance(rec, dict) and "context" in rec:
        return cast("dict[str, Any]", rec).get("context") == "all"  # the sidecar's JSON object
    both = (lt.alloc >= 0) & (lt.free_requested >= 0)
    if int(both.sum()) < MIN_PAIRS:
        return True
    stack = device.events["stack"]
    same = stack[lt.alloc[both]] == stack[lt.free_requested[both]]
    return float(same.mean()) < SAME_STACK_FRACTION


def adopt_free_stacks(lt: Lifetimes) -> int:
    """Give the blocks allocated before the trace, whose alloc was dropped, the stack of their free event
    (mutates ``lt``; call it only when frees carry the stack of their allocation, ``context="alloc"``).
    Returns how many rows got one."""
    if lt.free_stack is None:
        return 0
    take = (lt.stack < 0) & (lt.free_stack >= 0) & (lt.alloc < 0)
    lt.stack[take] = lt.free_stack[take]
    return int(take.sum())
