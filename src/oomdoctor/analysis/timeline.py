"""Memory over the trace: requested, allocated, active and reserved bytes after every event.

Semantics follow the allocator's statistics (``CUDACachingAllocator.cpp``; ``caching_allocator_spec.md``
§2.4): *allocated* is the sum of block sizes of allocated blocks and drops at ``free_requested``;
*active* adds blocks whose free is pending on other streams and drops at ``free_completed``;
*reserved* is the sum of segment sizes (``segment_alloc``/``segment_map`` add, ``segment_free``/
``segment_unmap`` subtract). *requested* here is the unrounded request of allocated blocks, so that
``allocated - requested`` is the rounding waste.

Reserved bytes are exact: the value at the trace's start is the final segments' total minus the net
segment changes the trace records. Allocated bytes are exact for blocks present in the final segments
and the allocator's rounding of the request otherwise (a large block that swallowed an unsplit
remainder of up to 1 MiB is undercounted by that remainder).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..trace.model import SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, DeviceTrace
from .lifetimes import PENDING_AT_START, Lifetimes


@dataclass
class Timeline:
    """Bytes after each event (arrays of length ``num_events``) and before the first (``*_start``)."""

    requested: np.ndarray
    allocated: np.ndarray
    active: np.ndarray
    reserved: np.ndarray
    requested_start: int
    allocated_start: int
    active_start: int
    reserved_start: int
    time_us: np.ndarray

    @property
    def num_events(self) -> int:
        return int(self.reserved.shape[0])

    def _peak(self, arr: np.ndarray, start: int) -> tuple[int, int]:
        if arr.size == 0 or start > int(arr.max()):
            return start, -1
        i = int(np.argmax(arr))
        return int(arr[i]), i

    @property
    def peak_reserved(self) -> tuple[int, int]:
        """``(bytes, event index)``; index -1 when the peak is at the trace's start.

        Reserved memory peaks at a ``segment_alloc`` (or ``segment_map``), which the allocator records
        just before the allocation it made the segment for (``CUDACachingAllocator.cpp`` ``malloc``:
        ``alloc_block`` then the block's ``alloc`` trace entry). The peak's event is that allocation when
        it follows at the same reserved level, so that the state after it shows the new segment in use,
        not as a free segment."""
        b, i = self._peak(self.reserved, self.reserved_start)
        if 0 <= i < self.num_events - 1 and self.reserved[i + 1] == b and self.allocated[i + 1] > self.allocated[i]:
            i += 1
        return b, i

    @property
    def peak_allocated(self) -> tuple[int, int]:
        return self._peak(self.allocated, self.allocated_start)

    def at(self, k: int) -> dict[str, int]:
        """The four counters after event ``k`` (-1: at the start)."""
        if k < 0:
            return {"requested": self.requested_start, "allocated": self.allocated_start,
                    "active": self.active_start, "reserved": self.reserved_start}
        return {"requested": int(self.requested[k]), "allocated": int(self.allocated[k]),
                "active": int(self.active[k]), "reserved": int(self.reserved[k])}


def reserved_series(dt: DeviceTrace) -> tuple[int, np.ndarray]:
    """Reserved bytes before the first event and after each event (``segment_alloc``/``segment_map``
    add, ``segment_free``/``segment_unmap`` subtract; the start is the final segments minus all the
    changes). Pure."""
    action, size = dt.events["action"], dt.events["size"]
    d_res = np.zeros(dt.num_events, dtype=np.int64)
    grow = (action == SEGMENT_ALLOC) | (action == SEGMENT_MAP)
    shrink = (action == SEGMENT_FREE) | (action == SEGMENT_UNMAP)
    d_res[grow] = size[grow]
    d_res[shrink] = -size[shrink]
    start = dt.final_reserved_bytes - int(d_res.sum())
    return start, start + np.cumsum(d_res)


def timeline(dt: DeviceTrace, lt: Lifetimes) -> Timeline:
    """Build the :class:`Timeline` of one device from its events and block lifetimes. Pure."""
    n = dt.num_events
    d_req = np.zeros(n + 1, dtype=np.int64)  # slot n collects "never" (-1 -> index n)
    d_alloc = np.zeros(n + 1, dtype=np.int64)
    d_active = np.zeros(n + 1, dtype=np.int64)

    def at(ix: np.ndarray) -> np.ndarray:
        return np.where(ix >= 0, ix, n)

    pre = lt.alloc < 0
    pending_start = lt.start_state == PENDING_AT_START
    in_trace = ~pre
    # block leaves "allocated" at free_requested, or at free_completed if no request was recorded
    leave_alloc = np.where(lt.free_requested >= 0, lt.free_requested, lt.free_completed)
    np.add.at(d_alloc, at(lt.alloc[in_trace]), lt.size[in_trace])
    np.add.at(d_req, at(lt.alloc[in_trace]), lt.requested[in_trace])
    np.add.at(d_active, at(lt.alloc[in_trace]), lt.size[in_trace])
    was_alloc = ~pending_start
    np.subtract.at(d_alloc, at(leave_alloc[was_alloc]), lt.size[was_alloc])
    np.subtract.at(d_req, at(leave_alloc[was_alloc]), lt.requested[was_alloc])
    np.subtract.at(d_active, at(lt.free_completed), lt.size)

    alloc_start = int(lt.size[pre & ~pending_start].sum())
    req_start = int(lt.requested[pre & ~pending_start].sum())
    active_start = int(lt.size[pre].sum())

    reserved_start, reserved = reserved_series(dt)
    return Timeline(
        requested=req_start + np.cumsum(d_req[:n]),
        allocated=alloc_start + np.cumsum(d_alloc[:n]),
        active=active_start + np.cumsum(d_active[:n]),
        reserved=reserved,
        requested_start=req_start,
        allocated_start=alloc_start,
        active_start=active_start,
        reserved_start=reserved_start,
        time_us=dt.events["time_us"],
    )
