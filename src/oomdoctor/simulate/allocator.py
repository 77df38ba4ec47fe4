"""A model of PyTorch's CUDA caching allocator (``DeviceCachingAllocator``), one device, default pools.

Every rule below is ``c10/cuda/CUDACachingAllocator.cpp`` as of PyTorch 2.9-2.11 (the 2026 main copy
labelled V-C in ``shared/reference/caching_allocator_spec.md``); functions keep PyTorch's names so the
two can be read side by side:

- ``malloc``: ``process_events``, then ``get_free_block`` (best fit by (stream, size, address), the
  expandable "size it can grow to" walk, the two oversize rules), then on a miss the fallback chain:
  ``garbage_collect_cached_blocks`` (only with a fraction cap and a threshold), ``alloc_block``,
  ``release_available_cached_blocks`` + ``alloc_block``, ``release_cached_blocks`` + ``alloc_block``
  (the retry), else OOM. After ``release_cached_blocks`` the pool is not searched again (issue #189504).
  ``should_split`` and the split keep the front part (spec §4-§6).
- ``free``: immediate ``free_block`` (merge with free neighbours of the same mapped state, back to the
  pool, GC age reset), or deferred (``record_stream``: the block stays *active pending free* until
  its event completes; spec §8).
- Expandable segments: one virtual-address reservation per (pool, stream), mapped in pages of 2 MiB
  (small) / 20 MiB (large); ``find_expandable_block``, ``map_block``, ``unmap_block`` and
  ``release_expandable_segment`` (spec §7). GC and ``release_available_cached_blocks`` skip
  expandable blocks (PR #134338).
- Capacity: ``fraction_limit`` is ``allowed_memory_maximum`` (``set_per_process_memory_fraction``):
  checked with the segment size *before* the driver call, and it enables GC; ``device_limit`` is what
  ``cudaMalloc``/``cuMemCreate`` can get (total minus other users).

CUDA-graph private pools are not simulated: their segments enter as ``external`` reserved bytes,
as recorded (:mod:`.pools`). Not modelled either: capture itself, IPC, ``cudaMallocAsync``, free-memory callbacks
(``trigger_free_memory_callbacks`` is taken as ``false``, as upstream has no registered callback
that frees device memory outside IPC).

The model emits the trace entries a real allocator would record for segments
(``segment_alloc``/``segment_free``/``segment_map``/``segment_unmap``) into ``segment_events`` as
``(action, address, size)`` tuples, so a replay can be compared with a recording event by event.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from ..analysis.rounding import (
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    allocation_size,
)
from ..trace.model import SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP
from .addresses import AddressSpace
from .config import AllocatorConfig

# kSmallBuffer (2 MiB) and kLargeBuffer (20 MiB) are also the small and large expandable page sizes.
KEY_SHIFT = 64  # free-list key: size << 64 | address; addresses are unsigned 64-bit (trace/build.py refuses others)


class Block:
    """``Block``: ``ptr``/``size`` in bytes, ``requested`` (the unrounded request), address-adjacent
    ``prev``/``next`` in the same segment, ``event_count`` > 0 while a deferred free is pending,
    ``mapped`` False only for the unmapped parts of an expandable segment; ``key`` its free-list key
    (``size << KEY_SHIFT | ptr``), set while it is in a pool's free list (and stale after)."""

    __slots__ = ("ptr", "size", "requested", "stream", "pool", "prev", "next", "allocated", "event_count",
                 "mapped", "segment", "gc_base", "key")

    def __init__(self, ptr: int, size: int, stream: int, pool: BlockPool, segment: ExpandableSegment | None = None,
                 mapped: bool = True) -> None:
        self.ptr = ptr
        self.size = size
        self.requested = 0
        self.stream = stream
        self.pool = pool
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.event_count = 0
        self.mapped = mapped
        self.segment = segment
        self.gc_base = 0
        self.key = 0

    def __repr__(self) -> str:
        state = "alloc" if self.allocated else ("pending" if self.event_count else ("free" if self.mapped else "unmapped"))
        return f"Block({self.ptr:#x}, {self.size}, {state})"


class ExpandableSegment:
    """One virtual-address reservation of ``size`` bytes from ``base``, mapped in ``page``-byte pages."""

    __slots__ = ("base", "size", "page", "stream")

    def __init__(self, base: int, size: int, page: int, stream: int) -> None:
        self.base, self.size, self.page, self.stream = base, size, page, stream


class BlockPool:
    """``BlockPool``: the free blocks of one pool, per stream, sorted by (size, address) as
    ``BlockComparatorSize`` does (the stream is compared first, so a search never leaves its stream),
    plus the unmapped blocks of expandable segments sorted by address (``BlockComparatorAddress``)."""

    __slots__ = ("is_small", "lists", "by_key", "unmapped", "gc_calls")

    def __init__(self, is_small: bool) -> None:
        self.is_small = is_small
        self.lists: dict[int, list[int]] = {}
        self.by_key: dict[int, Block] = {}
        self.unmapped: dict[int, list[tuple[int, Block]]] = {}
        self.gc_calls = 0  # get_free_blocks_call_count, the GC clock

    def insert(self, b: Block) -> None:
        """``insert_into_blocks``: also resets the block's GC age."""
        b.key = key = (b.size << KEY_SHIFT) | b.ptr
        lst = self.lists.get(b.stream)
        if lst is None:
            lst = self.lists[b.stream] = []
        insort(lst, key)
        self.by_key[key] = b
        b.gc_base = self.gc_calls

    def remove(self, b: Block) -> None:
        key = b.key
        lst = self.lists[b.stream]
        del lst[bisect_left(lst, key)]
        del self.by_key[key]

    def insert_unmapped(self, b: Block) -> None:
        lst = self.unmapped.setdefault(b.stream, [])
        insort(lst, (b.ptr, b))

    def remove_unmapped(self, b: Block) -> None:
        lst = self.unmapped[b.stream]
        del lst[bisect_left(lst, (b.ptr,))]

    def free_blocks(self) -> list[Block]:
        """The free blocks in ``BlockComparatorSize`` order (stream, size, address)."""
        return [self.by_key[k] for s in sorted(self.lists) for k in self.lists[s]]


class CachingAllocator:
    """The allocator model. ``malloc(size, requested, stream)`` takes the already-rounded size and
    returns a :class:`Block` or None on OOM (``oom_request`` then holds ``(size, alloc_size)``);
    ``free(block, deferred)``; ``complete(block)`` marks a deferred free's event done;
    ``empty_cache()``. Counters in bytes: ``reserved`` (``total_allocated_memory``), ``allocated``
    (sum of allocated block sizes), ``requested``, their peaks, and ``active`` (allocated + pending free, summed
    when read).

    A :class:`Block` merged into a neighbour by ``free_block`` is kept in ``spare`` and reused as the front part of
    a later split (issue 38: one Block object made and one freed per split and merge cost about 5% of a replay):
    a reference to a free block is not valid once it may have been merged.
    """

    def __init__(self, config: AllocatorConfig, *, fraction_limit: int | None = None, device_limit: int | None = None,
                 addresses: AddressSpace | None = None) -> None:
        if config.backend != "native":
            raise ValueError("backend:cudaMallocAsync is a different allocator; only the native one is modelled")
        self.config = config
        self.small = BlockPool(True)
        self.large = BlockPool(False)
        self.fraction_limit = fraction_limit
        self.device_limit = device_limit
        self.addresses = addresses or AddressSpace(1 << 44, 1 << 40)
        self.expandable = config.expandable_segments
        self.mss = config.max_split_size  # None: unlimited
        self.nsr = config.max_non_split_rounding
        self.gc_active = fraction_limit is not None and config.garbage_collection_threshold > 0
        self.reserved = 0
        self.external_reserved = 0  # private pools' segments, replayed as recorded (see external())
        self.allocated = 0
        self.requested = 0
        self.peak_reserved = 0
        self.peak_allocated = 0
        self.num_alloc_retries = 0
        self.pending: dict[int, Block] = {}  # id -> block: deferred frees not yet completed, in free order
        self.done: list[Block] = []  # deferred frees whose events completed, for the next process_events
        self.segment_events: list[tuple[int, int, int]] = []
        self.oom_request: tuple[int, int] | None = None
        self.spare: list[Block] = []  # blocks merged away (free, mapped, no event), for reuse by the next split

    def set_fraction_limit(self, limit: int | None) -> None:
        """``setMemoryFraction`` during the run (``torch.cuda.set_per_process_memory_fraction`` after the first
        allocations): the limit from now on, and the garbage collector, which only runs under one, with it."""
        self.fraction_limit = limit
        self.gc_active = limit is not None and self.config.garbage_collection_threshold > 0

    @property
    def active(self) -> int:
        """Bytes of the active blocks: allocated, or freed with an event pending (``active_bytes``)."""
        return self.allocated + sum(b.size for b in self.pending.values())

    # ---- allocation -------------------------------------------------------------------------------

    def malloc(self, size: int, requested: int, stream: int) -> Block | None:
        """``DeviceCachingAllocator::malloc`` for a request already rounded by ``round_size``.

        The replay calls this once per ``alloc`` event, so the common case is written out here
        (issue 38: per-event Python work): ``get_free_block``'s best fit when the candidate is not in an
        expandable segment and no ``max_split_size`` is set (the oversize rules and the expandable walk
        stay in :meth:`get_free_block`), and ``insert_into_blocks`` of the split's remainder."""
        if self.done:
            self.process_events()
        pool = self.small if size <= K_SMALL_SIZE else self.large
        if self.gc_active:
            pool.gc_calls += 1
        lst = pool.lists.get(stream)
        b = None
        if lst:
            i = bisect_left(lst, size << KEY_SHIFT)
            try:
                b = pool.by_key.pop(lst[i])
            except IndexError:  # no free block this large on the stream
                pass
            else:
                if b.segment is None and self.mss is None:
                    del lst[i]
                else:  # back in place for the expandable walk and the oversize rules
                    pool.by_key[lst[i]] = b
                    b = self._best_fit(pool, lst, i, b, size)
        if b is None:
            alloc_size = allocation_size(size)
            if self.gc_active:
                self.garbage_collect_cached_blocks()
            b = self.alloc_block(pool, size, alloc_size, stream, False)
            if b is None and self.release_available_cached_blocks(pool, size, stream):
                b = self.alloc_block(pool, size, alloc_size, stream, False)
            if b is None:
                self.release_cached_blocks()
                b = self.alloc_block(pool, size, alloc_size, stream, True)
            if b is None:
                self.oom_request = (size, alloc_size)
                return None
        remaining = b.size - size
        if (remaining >= K_MIN_BLOCK_SIZE) if (pool.is_small or self.expandable) else (
                remaining > K_SMALL_SIZE and (self.mss is None or size < self.mss)):
            ptr = b.ptr
            spare = self.spare
            if spare:  # the front part is allocated: a merged-away Block reused (mapped, no event, not allocated)
                front = spare.pop()
                front.ptr = ptr
                front.size = size
                front.stream = stream
                front.pool = pool
                front.segment = b.segment
            else:
                front = Block(ptr, size, stream, pool, b.segment)
            prev = b.prev
            front.prev = prev
            front.next = b
            if prev is not None:
                prev.next = front
            b.prev = front
            ptr += size
            b.ptr = ptr
            b.size = remaining
            # pool.insert(b), written out
            b.key = key = (remaining << KEY_SHIFT) | ptr
            lst = pool.lists.get(b.stream)
            if lst is None:
                lst = pool.lists[b.stream] = []
            insort(lst, key)
            pool.by_key[key] = b
            b.gc_base = pool.gc_calls
            b = front
        else:
            size = b.size
        b.allocated = True
        b.requested = requested
        allocated = self.allocated + size
        self.allocated = allocated
        self.requested += requested
        if allocated > self.peak_allocated:
            self.peak_allocated = allocated
        return b

    def get_free_block(self, pool: BlockPool, size: int, stream: int) -> Block | None:
        """``get_free_block``: smallest free block >= ``size`` on ``stream`` (lowest address among
        equal sizes), then the oversize rules on that one candidate only."""
        if self.gc_active:
            pool.gc_calls += 1
        lst = pool.lists.get(stream)
        if not lst:
            return None
        i = bisect_left(lst, size << KEY_SHIFT)
        if i == len(lst):
            return None
        return self._best_fit(pool, lst, i, pool.by_key[lst[i]], size)

    def _best_fit(self, pool: BlockPool, lst: list[int], i: int, b: Block, size: int) -> Block | None:
        """The rest of :meth:`get_free_block` from the smallest candidate ``b`` = ``lst[i]`` (>= ``size``):
        the expandable walk, the oversize rules; removes the block it returns from the pool."""
        n = len(lst)
        by_key = pool.by_key
        if b.segment is not None:
            if self.expandable:
                # best fit by the size a block can grow to: a free block followed by unmapped pages
                nx = b.next
                grow = b.size + (nx.size if nx is not None and not nx.mapped else 0)
                j = i + 1
                while j < n:
                    c = by_key[lst[j]]
                    nx = c.next
                    cg = c.size + (nx.size if nx is not None and not nx.mapped else 0)
                    if cg >= grow or b.segment is None:
                        break
                    b, grow, i = c, cg, j
                    j += 1
            else:  # expandable segments turned off after some were made: skip them
                while i < n and by_key[lst[i]].segment is not None:
                    i += 1
                if i == n:
                    return None
                b = by_key[lst[i]]
        mss = self.mss
        if mss is not None:
            if size < mss and b.size >= mss:
                return None
            if size >= mss and b.size >= size + self.nsr:
                return None
        key = lst[i]
        del lst[i]
        del by_key[key]
        return b

    def alloc_block(self, pool: BlockPool, size: int, alloc_size: int, stream: int, retry: bool) -> Block | None:
        """``alloc_block``: the fraction check (with the segment size, even for expandable segments),
        then ``cudaMalloc(alloc_size)`` or ``try_allocate_expandable_block(size)``."""
        if retry:
            self.num_alloc_retries += 1
        if self.fraction_limit is not None and self.reserved + alloc_size > self.fraction_limit:
            return None
        if self.expandable:
            return self.try_allocate_expandable_block(pool, size, stream)
        if self.device_limit is not None and self.reserved + alloc_size > self.device_limit:
            return None
        ptr = self.addresses.segment(alloc_size, stream)
        if ptr is None:  # no address space left for it: cudaMalloc fails
            return None
        b = Block(ptr, alloc_size, stream, pool)
        self._grow(SEGMENT_ALLOC, ptr, alloc_size)
        return b

    def external(self, delta: int) -> None:
        """Reserved bytes outside the modelled pools change by ``delta`` (a CUDA-graph private pool's
        segment, replayed as recorded): they count against the cap and in ``reserved``."""
        self.external_reserved += delta
        self.reserved += delta
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def _grow(self, action: int, ptr: int, size: int) -> None:
        self.reserved += size
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        self.segment_events.append((action, ptr, size))

    def _shrink(self, action: int, ptr: int, size: int) -> None:
        self.reserved -= size
        self.segment_events.append((action, ptr, size))

    # ---- freeing ----------------------------------------------------------------------------------

    def free(self, b: Block, deferred: bool = False) -> None:
        """``free``: the user's free. ``deferred``: the block was used on another stream
        (``record_stream``), so it waits for its event (``insert_events``) instead of ``free_block``
        (which ends the allocation itself: the replay calls it directly for a free without an event)."""
        if deferred:
            b.allocated = False
            self.allocated -= b.size
            b.event_count = 1
            self.pending[id(b)] = b
        else:
            self.free_block(b)

    def complete(self, b: Block) -> None:
        """The event of a deferred free completed: the next ``process_events`` returns the block."""
        if b.event_count:
            self.done.append(b)

    def process_events(self) -> None:
        """``process_events`` (start of every ``malloc``): blocks whose events completed go back."""
        done, self.done = self.done, []
        for b in done:
            if b.event_count:
                b.event_count = 0
                del self.pending[id(b)]
                self.free_block(b)

    def synchronize_and_free_events(self) -> None:
        """``synchronize_and_free_events``: every pending free completes now."""
        pending, self.pending = self.pending, {}
        self.done = []
        for b in pending.values():
            b.event_count = 0
            self.free_block(b)

    def free_block(self, b: Block) -> None:
        """``free_block``: merge with free neighbours of the same mapped state, return to the pool.

        Called once per ``free_requested`` event of a replay (for a block still allocated, it is :meth:`free`
        without an event: the allocation ends here), so ``try_merge_blocks`` of two mapped blocks and
        ``insert_into_blocks`` are written out here (issue 38); :meth:`_merge` does the rest."""
        size = b.size
        if b.allocated:
            b.allocated = False
            self.allocated -= size
        self.requested -= b.requested
        pool = b.pool
        mapped = b.mapped
        lst = pool.lists.get(b.stream)  # a neighbour's list too: a segment's blocks share its stream
        src = b.prev
        if src is not None and not src.allocated and not src.event_count:
            if mapped and src.mapped:
                assert lst is not None  # src is free and mapped: its key is in its stream's list
                key = src.key
                del lst[bisect_left(lst, key)]
                del pool.by_key[key]
                b.ptr = src.ptr
                p = b.prev = src.prev
                if p is not None:
                    p.next = b
                size += src.size
                b.size = size
                self.spare.append(src)
            elif src.mapped == mapped:
                self._merge(b, src, pool)
                size = b.size
        src = b.next
        if src is not None and not src.allocated and not src.event_count:
            if mapped and src.mapped:
                assert lst is not None  # src is free and mapped: its key is in its stream's list
                key = src.key
                del lst[bisect_left(lst, key)]
                del pool.by_key[key]
                nx = b.next = src.next
                if nx is not None:
                    nx.prev = b
                size += src.size
                b.size = size
                self.spare.append(src)
            elif src.mapped == mapped:
                self._merge(b, src, pool)
                size = b.size
        # pool.insert(b), written out
        b.key = key = (size << KEY_SHIFT) | b.ptr
        if lst is None:
            lst = pool.lists[b.stream] = []
        insort(lst, key)
        pool.by_key[key] = b
        b.gc_base = pool.gc_calls

    @staticmethod
    def _merge(dst: Block, src: Block | None, pool: BlockPool) -> int:
        """``try_merge_blocks``: absorb ``src`` into ``dst`` when it is free and of the same mapped state."""
        if src is None or src.allocated or src.event_count or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # ---- releasing cached memory ------------------------------------------------------------------

    def release_block(self, b: Block) -> None:
        """``release_block``: ``cudaFree`` of a whole free segment."""
        b.pool.remove(b)
        self.addresses.release(b.ptr)
        self._shrink(SEGMENT_FREE, b.ptr, b.size)

    def release_available_cached_blocks(self, pool: BlockPool, size: int, stream: int) -> bool:
        """``release_available_cached_blocks`` (only with ``max_split_size``): free the smallest
        oversize block >= max(size, max_split_size), else oversize blocks from the largest down until
        that much is freed; frees are not undone when it returns False."""
        mss = self.mss
        if mss is None:
            return False
        key_size = max(size, mss)
        lst = pool.lists.get(stream, [])
        i = bisect_left(lst, key_size << KEY_SHIFT)
        if i < len(lst) and pool.by_key[lst[i]].segment is None:
            self.release_block(pool.by_key[lst[i]])
            return True
        released = 0
        j = i - 1
        while released < key_size and j >= 0:
            b = pool.by_key[lst[j]]
            if b.size < mss:
                break
            if b.segment is None:
                released += b.size
                self.release_block(b)
            j -= 1
        return released >= key_size

    def release_cached_blocks(self) -> None:
        """``release_cached_blocks`` (``empty_cache()`` and the last fallback of ``malloc``)."""
        self.synchronize_and_free_events()
        self.release_blocks(self.large)
        self.release_blocks(self.small)

    empty_cache = release_cached_blocks

    def release_blocks(self, pool: BlockPool) -> None:
        """``release_blocks``: ``cudaFree`` every whole free segment, unmap the free pages of
        expandable segments, in (stream, size, address) order."""
        to_unmap: list[Block] = []
        for b in pool.free_blocks():
            if b.segment is not None:
                to_unmap.append(b)
            elif b.prev is None and b.next is None:
                self.release_block(b)
        for b in to_unmap:
            self.unmap_block(b)
            if b.prev is None and b.next is None and not b.mapped:
                pool.remove_unmapped(b)  # release_expandable_segment

    def garbage_collect_cached_blocks(self) -> None:
        """``garbage_collect_cached_blocks``: above ``threshold * allowed_memory_maximum`` reserved,
        free whole free large segments at least as old as the average (age: ``get_free_block`` calls
        on the pool since the block was last inserted), pass after pass, until the excess is freed."""
        assert self.fraction_limit is not None  # gc_active: the collector runs only under a limit
        threshold = int(self.config.garbage_collection_threshold * self.fraction_limit)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        pool = self.large
        clock = pool.gc_calls
        candidates = [b for b in pool.free_blocks() if b.prev is None and b.next is None]
        count = len(candidates)
        if count == 0:
            return
        total_age = float(sum(clock - b.gc_base for b in candidates))
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            threshold_age = total_age / count
            freed = False
            for b in pool.free_blocks():
                if b.prev is None and b.next is None and b.segment is None and clock - b.gc_base >= threshold_age:
                    freed = True
                    reclaimed += b.size
                    total_age -= clock - b.gc_base
                    count -= 1
                    self.release_block(b)

    # ---- expandable segments ----------------------------------------------------------------------

    def try_allocate_expandable_block(self, pool: BlockPool, size: int, stream: int) -> Block | None:
        """``try_allocate_expandable_block``: map pages at the lowest address with room for ``size``."""
        c = self.find_expandable_block(pool, size, stream)
        if c is None:  # no address space left for a new reservation
            return None
        if not c.mapped and not self.map_block(c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = c.next
            if nxt is None:  # the reservation ends first (ExpandableSegment's max_handles): no room
                return None
            if not self.map_block(nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        pool.remove(c)
        return c

    def find_expandable_block(self, pool: BlockPool, size: int, stream: int) -> Block | None:
        """``find_expandable_block``: the first unmapped range (with the free block before it) that,
        with the free blocks after it, holds ``size``; else a new reservation (None when the address
        space has no room for one)."""
        for _, c in list(pool.unmapped.get(stream, ())):
            p = c.prev
            if p is not None and not p.allocated and not p.event_count:
                c = p
            room, x = 0, c
            while room < size and x is not None and not x.allocated and not x.event_count:
                room += x.size
                x = x.next
            if room >= size:
                return c
        page = K_SMALL_BUFFER if pool.is_small else K_LARGE_BUFFER
        base, va = self.addresses.reservation(page, pool.is_small, stream)
        if base is None:
            return None
        seg = ExpandableSegment(base, va, page, stream)
        c = Block(base, va, stream, pool, seg, mapped=False)
        pool.insert_unmapped(c)
        return c

    def map_block(self, b: Block, size: int) -> bool:
        """``map_block``: map the pages covering ``[b.ptr, b.ptr + size)`` of unmapped ``b``."""
        seg = b.segment
        assert seg is not None  # only an expandable segment's blocks are unmapped
        page = seg.page
        end = seg.base + (b.ptr + size - seg.base + page - 1) // page * page
        mapped = end - b.ptr
        if self.device_limit is not None and self.reserved + mapped > self.device_limit:
            return False
        pool = b.pool
        pool.remove_unmapped(b)
        b.mapped = True
        if mapped < b.size:
            rest = Block(b.ptr + mapped, b.size - mapped, b.stream, pool, seg, mapped=False)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            pool.insert_unmapped(rest)
            b.size = mapped
        ptr = b.ptr
        self._merge(b, b.prev, pool)
        self._merge(b, b.next, pool)
        pool.insert(b)
        self._grow(SEGMENT_MAP, ptr, mapped)
        return True

    def unmap_block(self, b: Block) -> None:
        """``unmap_block``: unmap the whole pages inside free block ``b``, keeping mapped slivers."""
        seg = b.segment
        assert seg is not None  # called on an expandable segment's free blocks
        page = seg.page
        lo = seg.base + (b.ptr - seg.base + page - 1) // page * page
        hi = seg.base + (b.ptr + b.size - seg.base) // page * page
        if lo >= hi:
            return
        pool = b.pool
        pool.remove(b)
        if lo > b.ptr:
            before = Block(b.ptr, lo - b.ptr, b.stream, pool, seg)
            before.prev, before.next = b.prev, b
            if b.prev is not None:
                b.prev.next = before
            b.prev = before
            pool.insert(before)
        end = b.ptr + b.size
        if end > hi:
            after = Block(hi, end - hi, b.stream, pool, seg)
            after.prev, after.next = b, b.next
            if b.next is not None:
                b.next.prev = after
            b.next = after
            pool.insert(after)
        b.ptr, b.size, b.mapped = lo, hi - lo, False
        self._merge(b, b.prev, pool)
        self._merge(b, b.next, pool)
        pool.insert_unmapped(b)
        self._shrink(SEGMENT_UNMAP, lo, hi - lo)

    # ---- state at the start of a replay -----------------------------------------------------------

    def add_segment(self, pieces: list[tuple[int, int, str, int]], stream: int, is_small: bool,
                    reservation: tuple[int, int, int] | None = None) -> dict[int, Block]:
        """Install a segment that existed before the replay starts. ``pieces`` cover it in address
        order as ``(ptr, size, state, requested)`` with state ``allocated``/``pending``/``free``/
        ``unmapped``; ``reservation`` is ``(base, size, page)`` for an expandable segment. Returns the
        active blocks by address. Counts the mapped bytes as reserved (no trace entry)."""
        pool = self.small if is_small else self.large
        seg = ExpandableSegment(reservation[0], reservation[1], reservation[2], stream) if reservation else None
        prev: Block | None = None
        active: dict[int, Block] = {}
        for ptr, size, state, requested in pieces:
            b = Block(ptr, size, stream, pool, seg, mapped=state != "unmapped")
            b.prev = prev
            if prev is not None:
                prev.next = b
            prev = b
            if state == "free":
                pool.insert(b)
            elif state == "unmapped":
                pool.insert_unmapped(b)
            else:
                b.requested = requested
                self.requested += requested
                if state == "allocated":
                    b.allocated = True
                    self.allocated += size
                else:
                    b.event_count = 1
                    self.pending[id(b)] = b
                active[ptr] = b
            if state != "unmapped":
                self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return active

    def check(self, live: list[Block]) -> None:
        """Assert the model's invariants, given the blocks the caller holds (``live``, allocated):
        every segment is an address-contiguous chain, the free lists hold exactly the free mapped
        blocks, and ``reserved``/``allocated``/``active`` equal the sums over blocks."""
        pools = (self.small, self.large)
        heads = [b for pool in pools for b in pool.by_key.values()]
        heads += [b for pool in pools for lst in pool.unmapped.values() for _, b in lst]
        heads += list(self.pending.values()) + list(live)
        seen: set[int] = set()
        reserved = allocated = active = free = 0
        for b in heads:
            while b.prev is not None:
                b = b.prev
            if id(b) in seen:
                continue
            while b is not None:
                seen.add(id(b))
                if b.next is not None:
                    assert b.next.prev is b and b.ptr + b.size == b.next.ptr, (b, b.next)
                if b.mapped:
                    reserved += b.size
                    if b.allocated:
                        allocated += b.size
                    if b.allocated or b.event_count:
                        active += b.size
                    else:
                        free += 1
                        assert b.key == (b.size << KEY_SHIFT) | b.ptr and b.pool.by_key.get(b.key) is b, b
                b = b.next
        assert free == sum(len(pool.by_key) for pool in pools), "free list holds blocks outside any segment"
        reserved += self.external_reserved
        assert (reserved, allocated, active) == (self.reserved, self.allocated, self.active), (
            (reserved, allocated, active), (self.reserved, self.allocated, self.active))
