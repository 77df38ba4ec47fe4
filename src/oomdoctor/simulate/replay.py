"""Replay a recorded allocation trace through the allocator model, and compare with the recording.

The recorded ``alloc`` / ``free_requested`` / ``oom`` entries are the program's requests and drive the
model; ``segment_*`` entries are the allocator's answers and are what a replay is checked against
(``shared/reference/caching_allocator_spec.md`` §10). The exceptions, read off the recording:

- A run of ``segment_free``/``segment_unmap`` not made by a ``malloc`` fallback is a user
  ``torch.cuda.empty_cache()`` and is replayed as one (a fallback always ends in a new segment or an
  ``oom``; ``empty_cache`` frames settle the rest).
- A deferred free (``free_completed`` not right after its ``free_requested``: ``record_stream``) is
  replayed in one of two modes. ``recorded``: the block returns to the pool where the trace says,
  i.e. at the ``process_events`` of the next ``malloc``, or at the ``synchronize_and_free_events`` of
  a fallback when the recording shows the fallback's ``release_cached_blocks`` ran.
  ``immediate``: the block returns at ``free_requested``, which is what
  ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` (2.1-2.7) or PyTorch >= 2.8 (PR #148590) do for collectives.
- A recorded ``oom`` is replayed as the request it was (its ``size`` is already rounded). The first
  simulated OOM ends the replay.

State at the start: when the trace starts after memory was allocated (recording began late, or the
ring buffer dropped old entries), the replay under the recorded config starts from the segments and
blocks that existed then, rebuilt from the final snapshot and the trace (:mod:`..analysis.lifetimes`,
:func:`..analysis.fragmentation.live_segments`): addresses are exact, sizes are exact for blocks
alive at the end and else the allocator's rounding plus an unsplit remainder (``should_split``: a large
block keeps a remainder of at most 1 MiB). Under any other config the blocks alive at the start are
allocated afresh, in address order, so the what-if layout is that config's own.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np

from ..analysis.fragmentation import LiveSegment, live_segments
from ..analysis.lifetimes import ALLOCATED_AT_START, IN_TRACE, PENDING_AT_START, Lifetimes, lifetimes
from ..analysis.rounding import K_LARGE_BUFFER, K_SMALL_BUFFER, K_SMALL_SIZE, round_size
from ..analysis.timeline import reserved_series
from ..errors import OomdoctorError
from ..trace.load import gc_paused
from ..trace.model import (
    ALLOC,
    FREE_COMPLETED,
    FREE_REQUESTED,
    OOM,
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    SEGMENT_MAP,
    SEGMENT_UNMAP,
    DeviceTrace,
    Trace,
)
from .addresses import AddressSpace, RecordedAddresses
from .allocator import Block, CachingAllocator
from .capacity import Capacity, FallbackRule
from .config import AllocatorConfig, config_from_settings
from .pools import private_pools

RECORDED = "recorded"
IMMEDIATE = "immediate"

# replay operations, as (kind, event, stream, argument): (_MALLOC, event, stream, addr) is a malloc with nothing
# around it; (_MALLOC_RUN | _OOM, event, stream, (addr, process_events addrs, synced addrs, released, mark)) one
# after a run of segment / free_completed entries (mark: (first event, end event) of the run's entries its segment
# entries are aligned with, or None); (_FREE | _FREE_DEFERRED, event, 0, addr); (_EMPTY_CACHE, event, 0, mark);
# (_DONE, event, 0, addrs); (_EXTERNAL, event, 0, bytes)
_MALLOC, _OOM, _FREE, _FREE_DEFERRED, _EMPTY_CACHE, _DONE, _EXTERNAL, _MALLOC_RUN = range(8)
_SEG = (SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP)
_RELEASE = (SEGMENT_FREE, SEGMENT_UNMAP)
_NEW = (SEGMENT_ALLOC, SEGMENT_MAP)

#: The argument of a ``_MALLOC_RUN`` or ``_OOM`` op: (addr, process_events addrs, synced addrs, released, mark).
_RunArg = tuple[int, list[int] | None, list[int] | None, bool, tuple[int, int] | None]
#: An op's argument, by its kind (see the comment at ``_MALLOC``): an address (malloc, free), a run's
#: :data:`_RunArg`, an empty_cache()'s mark, a done's addresses, or an external's bytes.
OpArg = int | _RunArg | tuple[int, int] | list[int]
#: A block alive at the trace's start: (stream, addr, size, requested, state).
StartBlock = tuple[int, int, int, int, str]
#: A piece of a start segment for :meth:`.allocator.CachingAllocator.add_segment`: (ptr, size, state, requested).
_Piece = tuple[int, int, str, int]
#: A start segment for ``add_segment``: (segment, pieces, reservation (base, size, page) or None).
_StartSegment = tuple[LiveSegment, list[_Piece], tuple[int, int, int] | None]
#: A replay op as the loop reads it: (kind, event, stream, argument, rounded size, requested bytes).
_Op = tuple[int, int, int, Any, int, int]
_T = TypeVar("_T")


class SimulationError(OomdoctorError):
    """A trace or request the simulator cannot replay (e.g. the cudaMallocAsync backend)."""

    exit_code = 2


@dataclass(frozen=True)
class SimulatedOom:
    """The first simulated OOM: the trace event whose request failed, the rounded request and the
    segment size the allocator tried to get (bytes).

    The docstring under each field is its description in the JSON schema (``oomdoctor schema simulate``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    event_index: int
    """the event"""
    requested_bytes: int
    """the request (bytes)"""
    alloc_size_bytes: int
    """the rounded size (bytes)"""


@dataclass
class Validation:
    """How a replay under the recorded config compares with the recording, over the events replayed.

    ``segment_events_*``: count of ``segment_alloc/free/map/unmap`` entries; ``segment_events_differing``:
    positions where (action, address, size) differ, plus the difference in length;
    ``segment_events_unmatched``: the longer sequence's length minus the entries the two have in common
    in order (:func:`aligned_matches`), so one entry missing, added or changed counts one, where the
    positional count counts every entry after it (``unmatched <= differing``);
    ``reserved_events_differing``: events after which reserved bytes differ;
    ``max_reserved_difference_bytes``: the largest such difference; ``oom_event_index_recorded``: the
    recorded OOM (None if none), to compare with the result's ``oom``.

    The docstring under each field is its description in the JSON schema (``oomdoctor schema simulate``).
    """

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    segment_events_recorded: int
    """segment allocations and frees recorded"""
    segment_events_simulated: int
    """the same, simulated"""
    segment_events_differing: int
    """those that differ (0: the replay reproduces the recording)"""
    first_differing_event: int | None
    """the first that differs"""
    reserved_events_differing: int
    """events where reserved bytes differ"""
    max_reserved_difference_bytes: int
    """the largest difference of reserved bytes (bytes)"""
    oom_event_index_recorded: int | None
    """the recorded OOM"""
    oom_matches: bool
    """the replay runs out of memory where the recording did"""
    segment_events_unmatched: int = 0
    """those left unmatched once the two sequences are aligned (one missing, added or changed entry counts one;
    <= segment_events_differing)"""

    @property
    def segment_events_compared(self) -> int:
        """segment events compared: the longer of the two sequences (segment_events_differing <= this)"""
        return max(self.segment_events_recorded, self.segment_events_simulated)

    @property
    def exact(self) -> bool:
        return self.segment_events_differing == 0 and self.reserved_events_differing == 0 and self.oom_matches


@dataclass
class ReplayResult:
    """One replay. Bytes; ``elapsed_s`` is wall time of the replay loop alone."""

    config: AllocatorConfig
    deferred_frees: str
    capacity: Capacity
    initial_state: str  # "recorded" | "reallocated" | "empty"
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    end_reserved_bytes: int
    oom: SimulatedOom | None
    events_replayed: int
    num_events: int
    segment_events: int
    num_alloc_retries: int
    elapsed_s: float
    validation: Validation | None = None
    warnings: list[str] = field(default_factory=list[str])
    model: CachingAllocator | None = field(default=None, repr=False, compare=False)
    live_blocks: list[Block] | None = field(default=None, repr=False, compare=False)

    @property
    def matches_recorded(self) -> bool | None:
        return None if self.validation is None else self.validation.exact


@dataclass
class Prepared:
    """A trace turned into replay operations once, for any number of configs."""

    trace: Trace
    device: DeviceTrace
    lifetimes: Lifetimes
    recorded_config: AllocatorConfig
    op_kind: list[int]  # per op (event order): _MALLOC, _FREE, ... (see the comment at _MALLOC)
    op_event: list[int]  # per op: the trace event it replays
    op_stream: list[int]  # per op: the stream of a malloc (0 for the others)
    op_arg: list[OpArg]  # per op: the address of a malloc or free, else the tuple or value of its kind
    op_event_index: np.ndarray  # ``op_event`` as an int64 array (the replay reads ``requests`` through it)
    requests: np.ndarray  # requested bytes per event (alloc), rounded size (oom), 0 elsewhere
    rec_seg_pos: np.ndarray
    rec_seg: list[tuple[int, int, int]]
    start_blocks: list[StartBlock]  # (stream, addr, size, requested, state)
    start_segments: list[LiveSegment]  # live_segments at -1
    reserved_start: int
    recorded_oom: int | None
    max_address: int
    total_memory: int | None
    warnings: list[str]
    # (event, +/- bytes): private-pool segments
    external: list[tuple[int, int]] = field(default_factory=list[tuple[int, int]])
    external_start: int = 0  # bytes of private-pool segments alive at the trace's start


def prepare(trace: Trace, device: DeviceTrace | None = None, lt: Lifetimes | None = None) -> Prepared:
    """Classify the events of ``device`` (default: the trace's primary device) into replay operations.
    ``lt``: its lifetimes when already computed. Pure; O(events)."""
    with gc_paused():  # objects by the hundred thousand (ops, blocks) beside the trace's: issue 38
        return _prepare(trace, device, lt)


def _prepare(trace: Trace, device: DeviceTrace | None, lt: Lifetimes | None) -> Prepared:
    dt = device if device is not None else trace.primary
    lt = lt if lt is not None else lifetimes(trace, dt)
    recorded = config_from_settings(trace.allocator_settings)
    action = dt.events["action"]
    addr_np, size_np = dt.events["addr"], dt.events["size"]
    n = action.shape[0]
    start_segs = live_segments(dt, -1)
    pools = private_pools(trace, dt, start_segs)
    private = pools.private if pools is not None else np.zeros(n, dtype=bool)
    order = np.flatnonzero(~private)  # the default pools' events, which the model replays
    stack_np = dt.events["stack"]
    m = order.size

    # immediate frees: free_completed right after its free_requested
    fr_next_fc = np.zeros(n, dtype=bool)
    if n > 1:
        fr_next_fc[:-1] = (action[:-1] == FREE_REQUESTED) & (action[1:] == FREE_COMPLETED) & (addr_np[:-1] == addr_np[1:])
    fc_immediate = np.zeros(n, dtype=bool)
    fc_immediate[1:] = fr_next_fc[:-1]
    grouped = (np.isin(action, _SEG) | ((action == FREE_COMPLETED) & ~fc_immediate))[order]
    fr_deferred = ((action == FREE_REQUESTED) & ~fr_next_fc)[order]

    release_without_chain = recorded.max_split_size is None and recorded.garbage_collection_threshold == 0
    fallback = FallbackRule(trace, dt)  # could frees before a malloc be its fallback, or were they empty_cache()?
    empty_cache_stacks = fallback.empty_cache_stacks

    external = [(j, int(size_np[j]) if action[j] in _NEW else -int(size_np[j]))
                for j in np.flatnonzero(private & np.isin(action, _SEG)).tolist()]
    warnings: list[str] = []
    # The ops, as columns in event order (issue 38): kind, event, stream, and an argument (the address for a
    # malloc or a free; see the comment at _MALLOC for the others). The events outside runs of segment /
    # free_completed entries become ops at once with numpy (a run's next alloc/oom is the run's own op, so
    # it is left out here); the runs, and the private pools' segment entries, one by one. Each op has a sort
    # key: 2 x its event, or 2 x event - 1 for an empty_cache() / the completions of a run, which go before
    # the event they are keyed on and after every private-pool entry before it (as recorded).
    act_o = action[order]
    simple = np.isin(act_o, (ALLOC, OOM, FREE_REQUESTED)) & ~grouped
    if m > 1:
        simple[1:] &= ~(grouped[:-1] & ~grouped[1:] & np.isin(act_o[1:], (ALLOC, OOM)))
    sel = np.flatnonzero(simple)
    k_sel = act_o[sel]
    kinds = [np.where(k_sel == ALLOC, _MALLOC, np.where(k_sel == OOM, _OOM,
                                                         np.where(fr_deferred[sel], _FREE_DEFERRED, _FREE)))]
    events = [order[sel]]
    streams = [dt.events["stream"][order[sel]]]
    args: list[OpArg] = addr_np[order[sel]].tolist()
    for k in np.flatnonzero(k_sel == OOM).tolist():  # an oom outside a run: nothing to complete or release
        a0 = args[k]
        assert isinstance(a0, int)  # still its address: only this loop makes the tuple
        args[k] = (a0, None, None, False, None)
    keys = [2 * events[0]]
    x_kind: list[int] = []  # the runs' and the private pools' ops
    x_event: list[int] = []
    x_stream: list[int] = []
    x_key: list[int] = []
    for e, delta in external:
        x_kind.append(_EXTERNAL)
        x_event.append(e)
        x_stream.append(0)
        x_key.append(2 * e)
        args.append(delta)

    def emit(kind: int, event: int, st: int, arg: OpArg, key: int) -> None:
        x_kind.append(kind)
        x_event.append(event)
        x_stream.append(st)
        x_key.append(key)
        args.append(arg)

    gpos = np.flatnonzero(grouped)
    run_bounds: Iterable[tuple[int, int]]
    if gpos.size:
        brk = np.flatnonzero(np.diff(gpos) != 1) + 1
        ends = gpos[np.r_[brk - 1, gpos.size - 1]] + 1
        run_bounds = zip(gpos[np.r_[0, brk]].tolist(), ends.tolist())
    else:
        ends = gpos
        run_bounds = zip([], [])
    # the action, event, address and stream of the runs' positions and of the op after each run, by position (the
    # runs hold a few hundred of the events: lists of all of them cost 4 tolist() of every event, issue 38)
    at: list[int] = np.union1d(gpos, ends[ends < m]).tolist()
    act: dict[int, int] = dict(zip(at, act_o[at].tolist()))
    idx: dict[int, int] = dict(zip(at, order[at].tolist()))
    addr: dict[int, int] = dict(zip(at, addr_np[order[at]].tolist()))
    stream: dict[int, int] = dict(zip(at, dt.events["stream"][order[at]].tolist()))
    for q0, q1 in run_bounds:  # positions [q0, q1) are one run
        nxt = act[q1] if q1 < m else -1
        g0, g1 = idx[q0], (idx[q1] if q1 < m else n)
        run = range(q0, q1)
        releases = [k for k in run if act[k] in _RELEASE]
        news = [k for k in run if act[k] in _NEW]
        if nxt in (ALLOC, OOM):
            cut = q0
            if releases and not news and nxt == ALLOC:
                cut = releases[-1] + 1  # empty_cache, then a malloc served from the cache
            elif releases and int(stack_np[idx[releases[0]]]) in empty_cache_stacks:
                cut = max(k for k in releases if int(stack_np[idx[k]]) in empty_cache_stacks) + 1
            elif releases and not fallback(g0, g1):
                cut = releases[-1] + 1  # empty_cache without its frames, then a malloc
            if cut > q0:
                emit(_EMPTY_CACHE, g0, 0, (g0, idx[cut] if cut < m else n), 2 * g0 - 1)
            fcs = [k for k in range(cut, q1) if act[k] == FREE_COMPLETED]
            rel = [k for k in range(cut, q1) if act[k] in _RELEASE]
            if nxt == OOM or (rel and release_without_chain):
                sync, pe = fcs, []
            elif rel:
                pe = [k for k in fcs if k < rel[0]]
                sync = [k for k in fcs if k > rel[0]]
            else:
                pe, sync = fcs, []
            # releases read as this malloc's fallback: without a cap no fallback can happen, so a
            # replay without one runs them as the empty_cache() they then were
            emit(_OOM if nxt == OOM else _MALLOC_RUN, g1, stream[q1],
                 (addr[q1], [addr[k] for k in pe] or None, [addr[k] for k in sync] or None, bool(rel),
                  (idx[cut] if cut < m else n, g1)), 2 * g1)
            continue
        if releases:
            emit(_EMPTY_CACHE, g0, 0, (g0, g1), 2 * g0 - 1)
        fcs = [addr[k] for k in run if act[k] == FREE_COMPLETED]
        if fcs:
            emit(_DONE, g0, 0, fcs, 2 * g1 - 1)
    perm = np.argsort(np.concatenate(keys + [np.array(x_key, dtype=np.int64)]), kind="stable")
    op_kind = np.concatenate(kinds + [np.array(x_kind, dtype=np.int64)])[perm]
    op_event = np.concatenate(events + [np.array(x_event, dtype=np.int64)])[perm]
    op_stream = np.concatenate(streams + [np.array(x_stream, dtype=np.int64)])[perm].tolist()
    arr = np.empty(len(args), dtype=object)
    arr[:] = args
    op_arg = arr[perm].tolist()

    requests = np.where((action == ALLOC) | (action == OOM), size_np, 0)
    seg_pos = np.flatnonzero(np.isin(action, _SEG) & ~private)
    rec_seg = list(zip(action[seg_pos].tolist(), addr_np[seg_pos].tolist(), size_np[seg_pos].tolist()))
    ooms = np.flatnonzero(action == OOM)

    private_start = pools.start_segments if pools is not None else set[int]()
    default_start = [s for s in start_segs if s.address not in private_start]
    start_blocks, unplaced = _start_blocks(lt, start_segs, recorded)
    start_blocks = [b for b in start_blocks if not _inside(b[1], start_segs, private_start)]
    if unplaced:
        warnings.append(f"{unplaced} blocks alive at the trace's start lie in no segment of that time and were left "
                        "out of the replay's start state")
    if pools is not None:
        warnings.append(pools.warning())
    addresses = [s.address + s.total_size for s in dt.segments] + [s.address + s.size for s in start_segs]
    if seg_pos.size:
        addresses.append(int((addr_np[seg_pos] + size_np[seg_pos]).max()))
    total = trace.meta.get("gpu_total_memory_bytes")
    return Prepared(trace=trace, device=dt, lifetimes=lt, recorded_config=recorded, op_kind=op_kind.tolist(),
                    op_event=op_event.tolist(), op_stream=op_stream, op_arg=op_arg, op_event_index=op_event,
                    requests=requests,
                    rec_seg_pos=seg_pos, rec_seg=rec_seg, start_blocks=start_blocks, start_segments=default_start,
                    reserved_start=sum(s.size for s in start_segs),
                    recorded_oom=int(ooms[0]) if ooms.size else None,
                    max_address=max(addresses, default=0), total_memory=int(total) if isinstance(total, int) else None,
                    warnings=warnings, external=external,
                    external_start=sum(s.size for s in start_segs if s.address in private_start))


def _inside(a: int, segs: list[LiveSegment], chosen: set[int]) -> bool:
    """Whether address ``a`` lies in one of the segments of ``segs`` whose address is in ``chosen``."""
    return any(s.address <= a < s.address + s.size for s in segs if s.address in chosen)


def _start_blocks(lt: Lifetimes, segs: list[LiveSegment],
                  config: AllocatorConfig) -> tuple[list[StartBlock], int]:
    """Blocks alive at the trace's start: (stream, addr, size, requested, state), by address, and the
    count of those that lie in no live segment (left out).

    A block freed during the trace has no recorded size; it is the rounding of its request plus, in a
    large non-expandable segment, the gap to the next block when that gap is too small to have been
    split off (``should_split``: remainder > 1 MiB, or any remainder of an oversize block within
    ``max_non_split_rounding``)."""
    rows = np.flatnonzero(lt.start_state != IN_TRACE)
    if rows.size == 0:
        return [], 0
    table = np.asarray(config.roundup_power2_divisions, dtype=np.int64)
    sizes = np.where(lt.size_exact[rows], lt.size[rows], round_size(lt.requested[rows], table))
    # (addr, size, requested, stream, size exact, start state)
    items: list[tuple[int, int, int, int, bool, int]] = sorted(zip(
        lt.addr[rows].tolist(), sizes.tolist(), lt.requested[rows].tolist(), lt.stream[rows].tolist(),
        lt.size_exact[rows].tolist(), lt.start_state[rows].tolist()))
    starts = [s.address for s in segs]
    out: list[StartBlock] = []
    unplaced = 0
    for k, (a, sz, req, _st, exact, state) in enumerate(items):
        si = bisect_left(starts, a + 1) - 1
        if si < 0 or a >= segs[si].address + segs[si].size:
            unplaced += 1
            continue
        seg = segs[si]
        nxt = seg.address + seg.size
        if k + 1 < len(items) and items[k + 1][0] < nxt:
            nxt = items[k + 1][0]
        gap = nxt - (a + sz)
        if not exact and gap > 0 and seg.segment_type == "large" and not seg.is_expandable:
            mss = config.max_split_size
            if gap <= K_SMALL_SIZE or (mss is not None and sz >= mss and gap < config.max_non_split_rounding):
                sz += gap
        state_name = "allocated" if state == ALLOCATED_AT_START else "pending"
        out.append((seg.stream, a, min(sz, nxt - a), req, state_name))
    assert all(s in (ALLOCATED_AT_START, PENDING_AT_START) for *_, s in items)
    return out, unplaced


def _fresh_base(prepared: Prepared) -> int:
    step = 1 << 36
    return (prepared.max_address + step) // step * step


def _va_bytes(prepared: Prepared) -> int:
    """Size of an expandable reservation: 1.125 x the GPU's memory (``ExpandableSegment``), or 1 TiB
    when the GPU is not known (it only matters once a reservation fills up)."""
    total = prepared.total_memory
    return total + total // 8 if total else 1 << 40


def replay(prepared: Prepared, config: AllocatorConfig | None = None, *, deferred_frees: str = RECORDED,
           capacity: Capacity | None = None, validate: bool | None = None) -> ReplayResult:
    """Replay ``prepared`` under ``config`` (default: the recorded one).

    ``deferred_frees``: ``"recorded"`` or ``"immediate"`` (see the module doc). ``capacity``: the memory
    limit (default: none). ``validate`` (default: when the config and mode are the recorded ones)
    compares the simulated segment entries and reserved bytes with the recording.
    Raises :class:`SimulationError` for the ``cudaMallocAsync`` backend or an unknown mode.
    """
    with gc_paused():
        return _replay(prepared, config, deferred_frees, capacity, validate)


def _replay(prepared: Prepared, config: AllocatorConfig | None, deferred_frees: str, capacity: Capacity | None,
            validate: bool | None) -> ReplayResult:
    if deferred_frees not in (RECORDED, IMMEDIATE):
        raise SimulationError(f"unknown deferred-free mode {deferred_frees!r} (recorded or immediate)")
    config = config if config is not None else prepared.recorded_config
    if config.backend != "native":
        raise SimulationError("backend:cudaMallocAsync is CUDA's own pool allocator; only the native caching "
                              "allocator is modelled")
    capacity = capacity or Capacity(limit_bytes=None, kind="none", source="unlimited")
    fraction_limit = capacity.limit_bytes if capacity.kind == "fraction" else None
    device_limit = capacity.limit_bytes if capacity.kind == "device" else None
    if config.per_process_memory_fraction < 1.0:
        if not prepared.total_memory:
            raise SimulationError("per_process_memory_fraction needs the GPU's total memory, which this snapshot "
                                  "does not record: give the limit in bytes with --cap instead")
        frac = int(config.per_process_memory_fraction * prepared.total_memory)
        fraction_limit = frac if fraction_limit is None else min(fraction_limit, frac)
    same_config = config == prepared.recorded_config
    if validate is None:
        validate = same_config and deferred_frees == RECORDED
    va = _va_bytes(prepared)
    addresses = (RecordedAddresses(_fresh_base(prepared), va, prepared.rec_seg, prepared.start_segments) if same_config
                 else AddressSpace(_fresh_base(prepared), va))
    # a cap set during the run (Capacity.from_event): no fraction limit before its first event
    limit_from = capacity.from_event if capacity.kind == "fraction" and fraction_limit is not None else 0
    sim = CachingAllocator(config, fraction_limit=None if limit_from > 0 else fraction_limit, device_limit=device_limit,
                           addresses=addresses)
    uncapped = fraction_limit is None and device_limit is None
    warnings: list[str] = []
    # The blocks the program holds, and those whose free waits for an event (record_stream), by recorded address.
    # When a malloc's fallback (release_cached_blocks) completes every deferred free, ``pend`` is emptied too: the
    # model may merge those blocks away and reuse the objects for new blocks (CachingAllocator.spare), which an
    # address left in ``pend`` must not complete.
    live: dict[int, Block] = {}
    pend: dict[int, Block] = {}
    immediate = deferred_frees == IMMEDIATE
    table = np.asarray(config.roundup_power2_divisions, dtype=np.int64)
    # each op's request, read from ``requests`` now (simulate/scale.py replays a Prepared whose requests it scaled)
    op_requested = prepared.requests[prepared.op_event_index]
    op_sizes: list[int] = round_size(op_requested, table).tolist()

    sim.external(prepared.external_start)
    initial = _install_start(prepared, sim, same_config, immediate, live, pend, rounded_table=table)
    if initial == "reallocated":
        sim.segment_events.clear()
    reserved_at_start = sim.reserved
    if sim.oom_request is not None:
        warnings.append("the memory alive at the trace's start does not fit under this capacity")

    seg_marks: list[tuple[int, int, int, int]] = []  # (group start, group end event, sim seg from, to)
    oom: SimulatedOom | None = None
    missing = 0
    t0 = time.perf_counter()
    malloc, free, complete = sim.malloc, sim.free, sim.complete
    free_now = sim.free_block  # free() without an event, one call fewer
    seg_events = sim.segment_events
    last_event = prepared.device.num_events - 1
    requested: list[int] = op_requested.tolist()
    # an op's argument is the shape its kind says (see the comment at _MALLOC), which a checker cannot follow
    op_args = cast("list[Any]", prepared.op_arg)
    ops: Iterator[_Op] = zip(prepared.op_kind, prepared.op_event, prepared.op_stream, op_args, op_sizes, requested)
    if limit_from > 0:
        assert fraction_limit is not None  # limit_from is set only under a fraction limit
        ops = _limit_from(ops, limit_from, sim, fraction_limit)
    for kind, j, st, a, size, req in ops:
        if kind == _MALLOC:  # the common case, alone
            n0 = len(seg_events)
            b = malloc(size, req, st)
            if pend and not sim.pending:  # the malloc's fallback completed every deferred free
                pend.clear()
            if len(seg_events) != n0:
                seg_marks.append((j, j, n0, len(seg_events)))
            if b is None:
                assert sim.oom_request is not None  # malloc returned no block: it says what it could not get
                req, alloc_size = sim.oom_request
                oom = SimulatedOom(j, req, alloc_size)
                last_event = j
                break
            live[a] = b
        elif kind == _FREE:
            b = live.pop(a, None)
            if b is None:
                missing += 1
            else:
                free_now(b)
        elif kind == _MALLOC_RUN or kind == _OOM:
            a, pe, sync, released, mark = a
            n0 = len(seg_events)
            if released and uncapped:
                pend.clear()
                sim.empty_cache()
            if pe is not None and not immediate:
                for fa in pe:
                    b = pend.pop(fa, None)
                    if b is not None:
                        complete(b)
            syncing = None
            if sync is not None and not immediate:
                syncing = [b for fa in sync if (b := pend.pop(fa, None)) is not None]
            b = malloc(size, size if kind == _OOM else req, st)
            if pend and not sim.pending:
                pend.clear()
            if syncing:
                for sb in syncing:
                    complete(sb)  # done by now if the fallback did not already sync
            if mark is not None or len(seg_events) != n0:
                seg_marks.append((j if mark is None else mark[0], j, n0, len(seg_events)))
            if b is None:
                assert sim.oom_request is not None  # malloc returned no block: it says what it could not get
                req, alloc_size = sim.oom_request
                oom = SimulatedOom(j, req, alloc_size)
                last_event = j
                break
            if kind == _OOM:
                free(b)  # the program never got this block: the recorded run raised here
            else:
                live[a] = b
        elif kind == _FREE_DEFERRED:
            b = live.pop(a, None)
            if b is None:
                missing += 1
            elif immediate:
                free(b)
            else:
                free(b, True)
                pend[a] = b
        elif kind == _EMPTY_CACHE:
            n0 = len(seg_events)
            pend.clear()  # synchronize_and_free_events completes every pending free
            sim.empty_cache()
            seg_marks.append((a[0], a[1] - 1, n0, len(seg_events)))
        elif kind == _EXTERNAL:
            sim.external(a)
        else:  # _DONE
            if not immediate:
                for fa in a:
                    b = pend.pop(fa, None)
                    if b is not None:
                        complete(b)
    elapsed = time.perf_counter() - t0
    if missing:
        warnings.append(f"{missing} frees of blocks the replay does not hold (the trace's start could not be "
                        "rebuilt exactly) were skipped")
    result = ReplayResult(
        config=config, deferred_frees=deferred_frees, capacity=capacity, initial_state=initial,
        peak_reserved_bytes=sim.peak_reserved, peak_allocated_bytes=sim.peak_allocated,
        end_reserved_bytes=sim.reserved, oom=oom, events_replayed=last_event + 1,
        num_events=prepared.device.num_events, segment_events=len(seg_events),
        num_alloc_retries=sim.num_alloc_retries, elapsed_s=elapsed, warnings=warnings)
    if validate:
        result.validation = _validate(prepared, sim, seg_marks, last_event, oom, reserved_at_start)
    result.model = sim  # the final state, for invariant checks (dropped by what-if batches)
    result.live_blocks = list(live.values())
    return result


def _limit_from(ops: Iterator[_Op], event: int, sim: CachingAllocator, limit: int) -> Iterator[_Op]:
    """The replay's operations, setting ``sim``'s fraction limit before the first at or after ``event`` (a cap set
    during the run, :func:`.capacity.limit_from_event`); the peaks start again there: before the cap nothing was
    held to it, so what a claim compares with the cap is the peak under it."""
    for op in ops:
        if op[1] >= event:
            sim.set_fraction_limit(limit)
            sim.peak_reserved = sim.peak_allocated = 0
            yield op
            # after the cap's first event (an empty_cache() that brought reserved under it, or a malloc)
            sim.peak_reserved, sim.peak_allocated = (max(sim.peak_reserved, sim.reserved),
                                                     max(sim.peak_allocated, sim.allocated))
            yield from ops
            return
        yield op


def _install_start(prepared: Prepared, sim: CachingAllocator, same_config: bool, immediate: bool,
                   live: dict[int, Block], pend: dict[int, Block], rounded_table: np.ndarray) -> str:
    """Put the memory alive at the trace's start into ``sim``; returns how."""
    if not prepared.start_segments:
        return "empty"
    if same_config:
        by_seg = _pieces(prepared)
        for seg, pieces, reservation in by_seg:
            active = sim.add_segment(pieces, seg.stream, seg.segment_type == "small", reservation)
            for ptr, b in active.items():
                if b.allocated:
                    live[ptr] = b
                elif immediate:
                    b.event_count = 0
                    del sim.pending[id(b)]
                    sim.free_block(b)
                else:
                    pend[ptr] = b
        return "recorded"
    blocks = sorted(prepared.start_blocks, key=lambda x: (x[0], x[1]))
    if blocks:
        sizes = round_size(np.array([x[3] for x in blocks], dtype=np.int64), rounded_table).tolist()
        for (st, ptr, _size, req, state), sz in zip(blocks, sizes):
            b = sim.malloc(sz, req, st)
            if pend and not sim.pending:
                pend.clear()
            if b is None:
                break
            if state == "allocated":
                live[ptr] = b
            elif immediate:
                sim.free(b)
            else:
                sim.free(b, True)
                pend[ptr] = b
    return "reallocated"


def _pieces(prepared: Prepared) -> list[_StartSegment]:
    """The start segments as ``(segment, pieces, reservation)`` for :meth:`CachingAllocator.add_segment`.
    Expandable ranges of one (pool, stream) become one reservation with unmapped holes between them."""
    blocks = prepared.start_blocks
    addrs = [b[1] for b in blocks]
    out: list[_StartSegment] = []
    plain = [s for s in prepared.start_segments if not s.is_expandable]
    for seg in plain:
        out.append((seg, _fill(seg.address, seg.address + seg.size, blocks, addrs), None))
    groups: dict[tuple[str, int], list[LiveSegment]] = {}
    for seg in prepared.start_segments:
        if seg.is_expandable:
            groups.setdefault((seg.segment_type, seg.stream), []).append(seg)
    va = _va_bytes(prepared)
    for (stype, _stream), segs in groups.items():
        segs.sort(key=lambda s: s.address)
        page = K_SMALL_BUFFER if stype == "small" else K_LARGE_BUFFER
        base = segs[0].address
        size = (va + page - 1) // page * page
        size = max(size, (segs[-1].address + segs[-1].size - base + page - 1) // page * page)
        pieces: list[_Piece] = []
        cursor = base
        for s in segs:
            if s.address > cursor:
                pieces.append((cursor, s.address - cursor, "unmapped", 0))
            pieces.extend(_fill(s.address, s.address + s.size, blocks, addrs))
            cursor = s.address + s.size
        if base + size > cursor:
            pieces.append((cursor, base + size - cursor, "unmapped", 0))
        out.append((segs[0], pieces, (base, size, page)))
    return out


def _fill(lo: int, hi: int, blocks: list[StartBlock], addrs: list[int]) -> list[_Piece]:
    """Pieces covering ``[lo, hi)``: the start blocks inside it and free gaps between them."""
    pieces: list[_Piece] = []
    cursor = lo
    k = bisect_left(addrs, lo)
    while k < len(blocks) and blocks[k][1] < hi:
        _st, a, sz, req, state = blocks[k]
        if a > cursor:
            pieces.append((cursor, a - cursor, "free", 0))
        pieces.append((a, sz, state, req))
        cursor = a + sz
        k += 1
    if hi > cursor:
        pieces.append((cursor, hi - cursor, "free", 0))
    return pieces


def _validate(prepared: Prepared, sim: CachingAllocator, seg_marks: list[tuple[int, int, int, int]],
              last_event: int, oom: SimulatedOom | None, sim_start: int) -> Validation:
    """Compare the simulated segment entries and reserved bytes with the recording, up to
    ``last_event`` (the end, or the simulated OOM)."""
    rec_pos = prepared.rec_seg_pos
    n_rec = int(np.searchsorted(rec_pos, last_event, side="right"))
    rec = prepared.rec_seg[:n_rec]
    sims = sim.segment_events
    differing = sum(1 for x, y in zip(rec, sims) if x != y) + abs(len(rec) - len(sims))
    unmatched = max(len(rec), len(sims)) - aligned_matches(rec, sims) if differing else 0
    first = None
    for k, (x, y) in enumerate(zip(rec, sims)):
        if x != y:
            first = int(rec_pos[k])
            break
    if first is None and len(rec) != len(sims):
        k = min(len(rec), len(sims))
        first = int(rec_pos[k]) if k < len(rec) else last_event

    # reserved after every event: recorded from its segment entries; simulated from the model's,
    # each placed at the matching recorded entry of the same malloc (or at the malloc itself)
    n = last_event + 1
    sign = {SEGMENT_ALLOC: 1, SEGMENT_MAP: 1, SEGMENT_FREE: -1, SEGMENT_UNMAP: -1}
    sim_delta = np.zeros(n, dtype=np.int64)
    for g0, end, s0, s1 in seg_marks:
        lo = int(np.searchsorted(rec_pos, g0, side="left"))
        hi = int(np.searchsorted(rec_pos, end, side="left"))
        slots = rec_pos[lo:hi].tolist()
        for m, (act, _a, s) in enumerate(sims[s0:s1]):
            p = slots[m] if m < len(slots) else end
            if p < n:
                sim_delta[p] += sign[act] * s
    for p, delta in prepared.external:  # private pools, replayed as recorded
        if p < n:
            sim_delta[p] += delta
    diff = reserved_series(prepared.device)[1][:n] - (sim_start + np.cumsum(sim_delta))
    nz = np.flatnonzero(diff)
    rec_oom = prepared.recorded_oom
    oom_matches = (oom is None and (rec_oom is None or rec_oom > last_event)) or (
        oom is not None and rec_oom == oom.event_index)
    return Validation(
        segment_events_recorded=len(rec), segment_events_simulated=len(sims), segment_events_differing=differing,
        first_differing_event=first, reserved_events_differing=int(nz.size),
        max_reserved_difference_bytes=int(np.abs(diff).max()) if n else 0,
        oom_event_index_recorded=rec_oom, oom_matches=oom_matches, segment_events_unmatched=unmatched)


def aligned_matches(a: Sequence[_T], b: Sequence[_T]) -> int:
    """How many entries ``a`` and ``b`` have in common in the same order: the common prefix and suffix,
    plus the matching blocks ``difflib.SequenceMatcher`` finds between what is left (a longest common
    subsequence where the two differ in few places; never more than the true one). Pure; about
    O(n) for sequences that differ in a few entries."""
    import difflib

    n = min(len(a), len(b))
    head = 0
    while head < n and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < n - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    mid_a, mid_b = a[head:len(a) - tail], b[head:len(b) - tail]
    if not mid_a or not mid_b:
        return head + tail
    sm = difflib.SequenceMatcher(None, mid_a, mid_b, autojunk=False)
    return head + tail + sum(m.size for m in sm.get_matching_blocks())
