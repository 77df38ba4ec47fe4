"""How much memory the replay may use: the cap that made (or would make) the recorded run fail.

Two kinds of limit exist in PyTorch (``shared/reference/caching_allocator_spec.md`` §6.2, §10.3):

- ``fraction``: ``allowed_memory_maximum`` from ``torch.cuda.set_per_process_memory_fraction`` (or
  ``per_process_memory_fraction`` in the config, 2.9+): ``static_cast<size_t>(fraction * total)`` with
  ``total`` from ``cudaMemGetInfo`` (``CUDACachingAllocator.cpp`` ``setMemoryFraction``; on the H100 and
  H200 this equals ``total_memory`` of the device properties, measured in ``docs/simulate.md``).
  ``alloc_block`` refuses, before any driver call, a segment that would take reserved bytes above it,
  and it enables the garbage collector.
- ``device``: what ``cudaMalloc``/``cuMemCreate`` can get: the GPU's memory minus the CUDA context,
  NCCL buffers and other processes.

Inference (:func:`infer_capacity`), the first rule that applies, each with its certainty:

1. ``exact``: the sidecar's ``memory_cap_bytes`` (``oomdoctor.record`` reads the fraction at the dump);
2. ``exact``: the sidecar's ``memory_fraction`` (< 1) times its ``gpu_total_memory_bytes``;
   either holds from the event after the last one whose recorded reserved bytes are above it
   (:func:`limit_from_event`: a cap set during the run; ``from_event``);
3. a recorded ``oom`` entry: its ``device_free`` (``cudaMemGetInfo`` at the failure) plus the reserved
   bytes then is the device limit (``exact``) when the device could not hold the segment; when it
   could, a fraction cap refused it, which lies between the peak reserved before the OOM and the
   reserved bytes at the OOM plus the segment size (``bounded``; the lower end is taken: a
   recommendation that fits it fits the real cap);
4. ``bounded``: the allocator's fallbacks in the trace. ``malloc`` frees cached segments only after a
   miss when ``alloc_block`` failed (``release_available_cached_blocks``, ``release_cached_blocks``)
   or when garbage collection ran (reserved above ``threshold * cap``), so a run of ``segment_free``/
   ``segment_unmap`` that ends in a new segment or an OOM, made by no ``empty_cache()`` frame, bounds
   the cap from above: ``cap < reserved + segment size`` (or ``< reserved / threshold`` with a GC
   threshold); every segment the run got bounds it from below (``cap >= peak reserved``). The lower
   end is taken; :func:`..whatif.settle_gc_capacity` narrows it further by replay when a GC threshold
   makes the exact value matter. A sidecar's ``memory_stats.num_alloc_retries`` > 0 (the last retry,
   ``release_cached_blocks``) is quoted as corroboration;
5. ``none``: unlimited.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..analysis.rounding import allocation_size, round_size
from ..analysis.timeline import reserved_series
from ..ids import CAPACITY_SOURCES, CapacitySource
from ..trace.model import (
    ALLOC,
    FREE_COMPLETED,
    OOM,
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    SEGMENT_MAP,
    SEGMENT_UNMAP,
    DeviceTrace,
    Trace,
)
from ..units import parse_bytes as parse_bytes  # noqa: F401 - re-exported (the CLI reads sizes here)
from .config import config_from_settings

EXACT, BOUNDED, GIVEN, NONE = "exact", "bounded", "given", "none"
#: An upper bound this close to the GPU's memory is read as the device's own limit, not a fraction.
DEVICE_LIMIT_SHARE = 0.95


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """A memory limit in bytes (None: unlimited), its ``kind`` (``fraction``, ``device`` or ``none``),
    which evidence set it (``source``: an id of :data:`SOURCES`, its numbers in ``source_values``; said in
    words by ``oomdoctor.render.words.capacity``), and how sure it is: ``certainty`` is
    ``exact``, ``bounded`` (the true cap lies in ``[lower_bytes, upper_bytes]``, either may be None),
    ``given`` (``--cap``) or ``none``; ``evidence`` names the rule of the module doc that set it.

    The docstring under each field is its description in the JSON schema (``oomdoctor schema simulate``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    limit_bytes: int | None
    """the memory the replay may use (bytes)"""
    kind: str
    """'device' (cudaMalloc fails past it), 'fraction' (the allocator's own limit) or 'none' (unlimited)"""
    source: CapacitySource
    """where it comes from, in words (the dataclass holds an id, simulate/capacity.py SOURCES; its words:
    render/words/capacity.py)"""
    certainty: str = NONE
    """exact, bounded, given or none"""
    lower_bytes: int | None = None
    """lower bound (bytes)"""
    upper_bytes: int | None = None
    """upper bound (bytes)"""
    evidence: str = ""
    """the rule that set it: 'sidecar', 'oom', 'fallbacks', 'given' or ''"""
    source_values: dict[str, Any] = field(default_factory=dict[str, Any])
    """the numbers its source is said with (bytes, counts, event indices; a fraction), by source"""
    from_event: int = 0
    """the first event the limit holds at (0: the whole trace): a fraction cap the recording's reserved bytes were
    above was set later in the run (simulate/capacity.py limit_from_event); the replay's peaks are taken from it"""


SOURCES = CAPACITY_SOURCES
"""Where a capacity comes from (``Capacity.source``; :data:`oomdoctor.ids.CAPACITY_SOURCES`); what each means, with
the keys of its ``source_values``: :data:`oomdoctor.render.words.capacity.SOURCES`."""


def infer_capacity(trace: Trace, device: DeviceTrace) -> Capacity:
    """The limit a replay of ``device`` (a device of ``trace``) should use by default (rules in the
    module doc). Pure; O(events)."""
    cap, source, values = sidecar_cap(trace.meta)
    if cap is not None and source is not None:
        return Capacity(limit_bytes=cap, kind="fraction", source=source, certainty=EXACT, lower_bytes=cap,
                        upper_bytes=cap, evidence="sidecar", source_values=values,
                        from_event=limit_from_event(device, cap))
    act = device.events["action"]
    ooms = np.flatnonzero(act == OOM)
    if ooms.size:
        return _from_oom(device, int(ooms[0]))
    return _from_fallbacks(trace, device)


def limit_from_event(device: DeviceTrace, limit: int) -> int:
    """The first event a memory-fraction cap the run was recorded under can have held at: the event after the last
    one whose recorded reserved bytes are above it (0 when none is). ``alloc_block`` refuses any segment that would
    take reserved bytes above the cap (``CUDACachingAllocator.cpp``, ``set_fraction``), so reserved bytes above it
    mean it was not set yet: the sidecar reads the fraction at the dump, and a job may set it after its first steps
    (issue 49: a variable-length fine-tune ran two uncapped steps to size its cap, and a replay capped from its
    first event freed a cached segment the job kept: 24 of 101 segment events differed, a model error of 2.93 GiB).
    Pure; O(events)."""
    _start, reserved = reserved_series(device)
    over = np.flatnonzero(reserved > limit)
    return int(over[-1]) + 1 if over.size else 0


def sidecar_cap(meta: dict[str, Any]) -> tuple[int | None, CapacitySource | None, dict[str, Any]]:
    """The memory-fraction cap a sidecar states (rules 1 and 2 of the module doc), bytes, its source id
    (:data:`SOURCES`) and values; ``(None, None, {})`` when it states none."""
    cap = meta.get("memory_cap_bytes")
    if isinstance(cap, int) and cap > 0:
        return cap, "sidecar-memory-cap", {}
    frac, total = meta.get("memory_fraction"), meta.get("gpu_total_memory_bytes")
    if isinstance(frac, (int, float)) and 0 < frac < 1 and isinstance(total, int) and total > 0:
        # static_cast<size_t>(fraction * device_total)
        return int(frac * total), "sidecar-memory-fraction", {"fraction": frac, "gpu_total_memory_bytes": total}
    return None, None, {}


def _from_oom(device: DeviceTrace, o: int) -> Capacity:
    reserved_start, reserved = reserved_series(device)
    at_oom = int(reserved[o])
    device_free = int(device.events["device_free"][o])
    if device_free < 0:
        device_free = int(device.events["addr"][o])
    request = int(device.events["size"][o])
    seg = allocation_size(request)
    if device_free < seg:
        cap = at_oom + device_free
        return Capacity(limit_bytes=cap, kind="device", source="oom-device", certainty=EXACT, lower_bytes=cap,
                        upper_bytes=cap, evidence="oom",
                        source_values={"event": o, "device_free_bytes": device_free, "reserved_bytes": at_oom})
    lower = int(max(reserved[:o].max() if o else reserved_start, reserved_start))
    upper = at_oom + seg - 1
    return Capacity(limit_bytes=lower, kind="fraction", source="oom-fraction-cap", certainty=BOUNDED,
                    lower_bytes=lower, upper_bytes=upper, evidence="oom",
                    source_values={"event": o, "device_free_bytes": device_free})


def fallback_bounds(trace: Trace, device: DeviceTrace) -> tuple[int | None, int, int]:
    """``(upper, lower, runs)`` read off the allocator's fallbacks (rule 4 of the module doc): the
    least upper bound on the cap (None: no fallback recorded), the peak reserved (a lower bound) and
    the number of fallback runs seen. Pure; O(events)."""
    act = device.events["action"]
    rule = FallbackRule(trace, device)
    releases = np.flatnonzero((act == SEGMENT_FREE) | (act == SEGMENT_UNMAP))
    if releases.size == 0:
        return None, rule.peak, 0
    thr = config_from_settings(trace.allocator_settings).garbage_collection_threshold
    grouped = np.isin(act, (SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, FREE_COMPLETED))
    stack = device.events["stack"]
    n = act.shape[0]
    upper: int | None = None
    runs = 0
    seen_end = -1
    for k in releases.tolist():
        if k <= seen_end:
            continue
        g0 = k
        while g0 > 0 and grouped[g0 - 1]:
            g0 -= 1
        g1 = k
        while g1 < n and grouped[g1]:
            g1 += 1
        seen_end = g1
        if g1 >= n or act[g1] not in (ALLOC, OOM):
            continue  # a user's empty_cache() (or the end of the trace)
        run = act[g0:g1]
        news_after = np.flatnonzero((run == SEGMENT_ALLOC) | (run == SEGMENT_MAP))
        rel = np.flatnonzero((run == SEGMENT_FREE) | (run == SEGMENT_UNMAP))
        if act[g1] == ALLOC and (news_after.size == 0 or news_after.max() < rel.min()):
            continue  # released, then served from the cache: empty_cache() and a malloc
        if any(int(s) in rule.empty_cache_stacks for s in stack[g0:g1][rel].tolist()):
            continue
        if not rule(g0, g1):
            continue  # a user's empty_cache() whose frames were not recorded
        before = rule.reserved_before(g0)
        bound = before + rule.segment_size(g1) - 1
        if thr > 0:
            bound = max(bound, int(before / thr))
        upper = bound if upper is None else min(upper, bound)
        runs += 1
    return upper, rule.peak, runs


class FallbackRule:
    """Whether the cached segments freed in events ``[g0, g1)`` of ``device`` can be the fallback of the
    ``malloc`` at event ``g1`` (``rule(g0, g1)``) rather than a user's ``empty_cache()``. PyTorch 2.11
    records a freed segment with the stack of its allocation, not of the ``empty_cache`` call, so frames
    (``empty_cache_stacks``: the stack ids holding an ``empty_cache`` frame) rarely tell. A fallback needs
    ``alloc_block`` to have failed or GC to have run:

    - the run reached its peak reserved bytes (``peak``), so the cap is at least that: ``alloc_block`` can
      fail only if ``reserved before + segment size > peak``, GC can run only if
      ``reserved before > gc_threshold * peak``;
    - a sidecar that says no fraction was set (``memory_fraction`` 1) leaves only the device's own
      limit: frees far below the GPU's memory (under :data:`DEVICE_LIMIT_SHARE`) are no fallback,
      and GC never runs;
    - a sidecar whose ``memory_stats.num_alloc_retries`` is 0 rules out ``release_cached_blocks``, so
      without ``max_split_size`` and GC nothing is a fallback.
    """

    def __init__(self, trace: Trace, device: DeviceTrace) -> None:
        config = config_from_settings(trace.allocator_settings)
        meta = trace.meta
        self.device = device
        self.reserved_start, self.reserved = reserved_series(device)
        self.peak = int(max(self.reserved_start, int(self.reserved.max()) if self.reserved.size else 0))
        self.table = np.asarray(config.roundup_power2_divisions, dtype=np.int64)
        self.empty_cache_stacks = {sid for sid, frames in enumerate(trace.stacks.stacks)
                                   if any(trace.stacks.frames[f][2] == "empty_cache" for f in frames)}
        frac, total = meta.get("memory_fraction"), meta.get("gpu_total_memory_bytes")
        no_fraction = isinstance(frac, (int, float)) and frac >= 1
        self.gc = 0.0 if no_fraction else config.garbage_collection_threshold
        self.device_floor = int(DEVICE_LIMIT_SHARE * total) if no_fraction and isinstance(total, int) else None
        stats: dict[str, Any] = meta.get("memory_stats") or {}
        retries = stats.get("num_alloc_retries")
        self.never = retries == 0 and config.max_split_size is None and self.gc == 0

    def reserved_before(self, g0: int) -> int:
        """Reserved bytes just before event ``g0``."""
        return int(self.reserved[g0 - 1]) if g0 > 0 else self.reserved_start

    def segment_size(self, j: int) -> int:
        """The segment the request at event ``j`` needs (``round_size``, then ``get_allocation_size``; an
        ``oom`` entry's size is already rounded)."""
        size = int(self.device.events["size"][j])
        if self.device.events["action"][j] != OOM:
            size = int(round_size(np.array([size], dtype=np.int64), self.table)[0])
        return allocation_size(size)

    def __call__(self, g0: int, g1: int) -> bool:
        if self.never:
            return False
        before, need = self.reserved_before(g0), self.segment_size(g1)
        if self.device_floor is not None and before + need <= self.device_floor:
            return False
        return before + need > self.peak or (self.gc > 0 and before > self.gc * self.peak)


def _from_fallbacks(trace: Trace, device: DeviceTrace) -> Capacity:
    upper, lower, runs = fallback_bounds(trace, device)
    stats: dict[str, Any] = trace.meta.get("memory_stats") or {}
    retries = stats.get("num_alloc_retries")
    if upper is None:
        return Capacity(limit_bytes=None, kind="none", source="no-evidence")
    if upper < lower:
        return Capacity(limit_bytes=None, kind="none", source="fallbacks-disagree",
                        source_values={"runs": runs, "upper_bytes": upper, "peak_reserved_bytes": lower})
    total = trace.meta.get("gpu_total_memory_bytes")
    kind = "device" if isinstance(total, int) and upper >= DEVICE_LIMIT_SHARE * total else "fraction"
    also = {"alloc_retries": retries} if isinstance(retries, int) and retries > 0 else {}
    return Capacity(limit_bytes=lower, kind=kind, source="fallbacks", certainty=BOUNDED, lower_bytes=lower,
                    upper_bytes=upper, evidence="fallbacks", source_values={"runs": runs, **also})
