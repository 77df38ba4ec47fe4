"""Where the allocator model's new segments go (:class:`~.allocator.CachingAllocator` asks its address source for
each ``cudaMalloc`` and each expandable reservation): fresh addresses (:class:`AddressSpace`), or, for a replay of the
recorded config, the recorded ones (:class:`RecordedAddresses`), so that the replay's segments sit where the job's
did and its fragmentation is the job's (``docs/simulate.md``)."""

from __future__ import annotations

from bisect import bisect_left, insort

from ..analysis.fragmentation import LiveSegment
from ..analysis.rounding import K_SMALL_BUFFER
from ..trace.model import SEGMENT_ALLOC, SEGMENT_MAP

ADDRESS_END = 1 << 64  # the end of the address space the model hands segments out of
#: How many recorded ``segment_alloc`` entries past the last one followed a new segment of the replay may
#: skip to find one of its size (the replay made fewer segments than the recording, or other sizes).
ADDRESS_LOOKAHEAD = 16


class AddressSpace:
    """Where new segments go: ``segment(size, stream)`` returns a ``cudaMalloc`` address and
    ``reservation(page, is_small, stream)`` the base and size of a new expandable reservation.
    This default hands out fresh, 2 MiB-aligned addresses from ``base`` upwards; a replay of a
    recording uses :class:`RecordedAddresses`, which reuses the recorded addresses."""

    def __init__(self, base: int, va_bytes: int) -> None:
        self.next = base
        self.va_bytes = va_bytes

    def _take(self, size: int) -> int | None:
        """The next free address for ``size`` bytes, or None when the 64-bit address space has no room
        left: ``cudaMalloc`` then fails, as it does for a request larger than the device."""
        end = self.next + (size + K_SMALL_BUFFER - 1) // K_SMALL_BUFFER * K_SMALL_BUFFER
        if end > ADDRESS_END:
            return None
        ptr, self.next = self.next, end
        return ptr

    def segment(self, size: int, stream: int) -> int | None:
        return self._take(size)

    def release(self, ptr: int) -> None:
        """The segment at ``ptr`` was freed (``cudaFree``); fresh addresses are never reused, so nothing to do."""

    def reservation(self, page: int, is_small: bool, stream: int) -> tuple[int | None, int]:
        size = (self.va_bytes + page - 1) // page * page
        return self._take(size), size


class RecordedAddresses(AddressSpace):
    """Addresses for a replay of the recorded config: each new segment gets the address of the next
    recorded ``segment_alloc`` of its size (within :data:`ADDRESS_LOOKAHEAD` entries of the last one
    followed), unless a live segment of the replay still covers that address; then, and for a segment the
    recording did not make, a fresh address. After either, later segments follow the recording again."""

    def __init__(self, base: int, va_bytes: int, rec_seg: list[tuple[int, int, int]],
                 start_segments: list[LiveSegment]) -> None:
        super().__init__(base, va_bytes)
        self.recorded = [(a, s) for act, a, s in rec_seg if act == SEGMENT_ALLOC]
        self.n = 0  # the next recorded segment_alloc to follow
        self.refused = 0  # recorded addresses refused because a live segment of the replay covered them
        # the live segments (start -> size) of the replay's recorded or fresh addresses, the start segments
        # among them: a recorded address is handed out only where none of them is
        self.live: dict[int, int] = {}
        self.live_starts: list[int] = []
        for seg in sorted(start_segments, key=lambda x: x.address):
            if not self._overlaps(seg.address, seg.size):  # an expandable one's mapped range stays held
                self._hold(seg.address, seg.size)
        # Expandable reservations: find_expandable_block maps a new reservation from its base, and
        # later maps fill holes or extend the mapped range upwards, so a segment_map beyond the mapped
        # extent of every reservation below it starts a new one at its address.
        extent = {s.address: s.address + s.size for s in start_segments if s.is_expandable}
        self.bases: list[int] = []
        for act, a, size in rec_seg:
            if act != SEGMENT_MAP:
                continue
            owner = max((b for b, end in extent.items() if b <= a <= end), default=None)
            if owner is None:
                self.bases.append(a)
                owner = a
            extent[owner] = max(extent.get(owner, a), a + size)
        self.rn = 0

    def reservation(self, page: int, is_small: bool, stream: int) -> tuple[int | None, int]:
        if self.rn < len(self.bases):
            self.rn += 1
            return self.bases[self.rn - 1], (self.va_bytes + page - 1) // page * page
        return super().reservation(page, is_small, stream)

    def segment(self, size: int, stream: int) -> int | None:
        recorded = self.recorded
        for k in range(self.n, min(self.n + ADDRESS_LOOKAHEAD, len(recorded))):
            a, s = recorded[k]
            if s != size:
                continue
            self.n = k + 1
            if not self._overlaps(a, size):
                self._hold(a, size)
                return a
            # a live segment of the replay is there (a recording whose segments overlap, or a replay that
            # kept a segment the job freed): this one goes elsewhere, the next ones follow the recording
            self.refused += 1
            break
        ptr = self._take(size)
        if ptr is not None:
            self._hold(ptr, size)
        return ptr

    def _overlaps(self, a: int, size: int) -> bool:
        """Whether ``[a, a + size)`` meets a live segment; live segments are disjoint, so only the last one
        starting below ``a + size`` can."""
        i = bisect_left(self.live_starts, a + size) - 1
        return i >= 0 and self.live_starts[i] + self.live[self.live_starts[i]] > a

    def _hold(self, a: int, size: int) -> None:
        insort(self.live_starts, a)
        self.live[a] = size

    def release(self, ptr: int) -> None:
        if self.live.pop(ptr, None) is not None:
            del self.live_starts[bisect_left(self.live_starts, ptr)]
