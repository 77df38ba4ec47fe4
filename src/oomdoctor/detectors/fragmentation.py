"""``fragmentation``: reserved memory the allocator cannot use for the request at hand (AP-06).

Two signatures (``shared/reference/antipatterns.md`` AP-06; ``caching_allocator_spec.md`` §5-6):

* an ``oom`` entry whose request (rounded, as the allocator records it) is larger than every free
  block of its pool and stream while the reserved-but-unallocated bytes would cover it: the memory
  is there, in pieces;
* without an OOM: at the peak of reserved memory, free bytes stranded inside segments that still hold
  live blocks (``empty_cache()`` cannot return them) are at least 1 GiB and a quarter of reserved.

Fixes in order: ``expandable_segments:True`` (PR #96995, 2.1+; incompatible with CUDA IPC of its
tensors, issue #130330; with NCCL user-buffer registration, NVIDIA/nccl#1584; CUDA graphs + NCCL need
``NCCL_GRAPH_REGISTER=0``, issue #158029); then ``max_split_size_mb``; then
``garbage_collection_threshold`` (only with a memory fraction set). The variable is
``PYTORCH_ALLOC_CONF`` from 2.9 (``PYTORCH_CUDA_ALLOC_CONF`` still read as an alias).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..analysis.device import DeviceAnalysis
from ..analysis.fragmentation import request_pool
from ..analysis.phases import role_index
from ..analysis.rounding import allocation_size, round_size
from ..units import GiB, MiB
from .context import Context, TorchVersion
from .finding import Evidence, Finding, Fix

ID = "fragmentation"
MIN_STRANDED_BYTES = 1 * GiB
MIN_STRANDED_FRACTION = 0.25


@dataclass(frozen=True, kw_only=True)
class FragmentationOomEvidence(Evidence):
    """The evidence of a ``fragmentation`` finding at an OOM (variant ``oom``): the allocator's state at the failure."""

    FINDING: ClassVar[str] = ID
    VARIANTS: ClassVar[tuple[str, ...]] = ("oom",)

    oom_event: int
    """the event index of the last OOM"""
    requested_bytes: int
    """the failed request, rounded as the allocator rounds it (bytes)"""
    cuda_malloc_bytes: int
    """the segment the allocator asked cudaMalloc for, for that request (bytes)"""
    reserved_bytes: int
    """reserved at the OOM (bytes)"""
    allocated_bytes: int
    """allocated at the OOM (bytes)"""
    reserved_unallocated_bytes: int
    """reserved but not allocated at the OOM: what is there, in pieces (bytes)"""
    largest_free_block_bytes: int
    """the largest free block of the request's pool and stream (bytes)"""
    largest_free_block_any_stream_bytes: int
    """the largest free block of any pool and stream (bytes)"""
    free_in_used_segments_bytes: int
    """free bytes inside segments that still hold live blocks (bytes)"""
    free_segments_bytes: int
    """bytes of segments with no live block (bytes)"""
    pending_free_bytes: int
    """blocks freed but awaiting work on another stream (bytes)"""
    device_free_bytes: int
    """the device's free memory the OOM entry records (bytes)"""
    pool: str
    """the request's pool: 'small' or 'large'"""
    stream: int
    """the request's stream (0: the default stream; else a raw cudaStream_t)"""
    segments: int
    """live segments at the OOM"""
    expandable_segments: bool
    """whether the allocator ran with expandable segments"""


@dataclass(frozen=True, kw_only=True)
class FragmentationStrandedEvidence(Evidence):
    """The evidence of a ``fragmentation`` finding without an OOM (variant ``stranded``): the state at the peak of
    reserved memory."""

    FINDING: ClassVar[str] = ID
    VARIANTS: ClassVar[tuple[str, ...]] = ("stranded",)

    peak_reserved_bytes: int
    """the rank's peak reserved (bytes)"""
    allocated_at_peak_bytes: int
    """allocated at that peak (bytes)"""
    free_in_used_segments_bytes: int
    """free bytes stranded inside segments that still hold live blocks, at the peak (bytes)"""
    free_segments_bytes: int
    """bytes of segments with no live block, at the peak (bytes)"""
    largest_free_block_bytes: int
    """the largest free block, at the peak (bytes)"""
    segments: int
    """live segments at the peak"""


EVIDENCE: tuple[type[Evidence], ...] = (FragmentationOomEvidence, FragmentationStrandedEvidence)
"""The evidence classes of this detector's findings."""


def detect_rank(a: DeviceAnalysis, ctx: Context) -> Finding | None:
    v = ctx.versions[a.rank]
    expandable = expandable_on(a)
    if a.oom_events.size:
        k = int(a.oom_events[-1])
        ev = a.device.events
        request = int(round_size(ev["size"][k:k + 1])[0])
        stream = int(ev["stream"][k])
        an = a.anatomy_at(k)
        pool = request_pool(request)
        largest = an.largest_free_block(stream, pool)
        unallocated = an.reserved_bytes - an.allocated_bytes
        if request <= largest or unallocated < request:
            return None
        evidence = FragmentationOomEvidence(
            oom_event=k,
            requested_bytes=request,
            cuda_malloc_bytes=allocation_size(request),
            reserved_bytes=an.reserved_bytes,
            allocated_bytes=an.allocated_bytes,
            reserved_unallocated_bytes=unallocated,
            largest_free_block_bytes=largest,
            largest_free_block_any_stream_bytes=an.largest_free_block_bytes,
            free_in_used_segments_bytes=an.free_in_used_segments_bytes,
            free_segments_bytes=an.free_segments_bytes,
            pending_free_bytes=an.pending_free_bytes,
            device_free_bytes=int(ev["device_free"][k]),
            pool=pool,
            stream=stream,
            segments=an.segments,
            expandable_segments=expandable,
        )
        return Finding(ID, "critical", [a.rank], unallocated, evidence, [],
                       _fixes(v, expandable, request, under_memory_fraction(a), shapes_vary(a)),
                       per_rank_bytes={a.rank: unallocated}, variant="oom")
    if a.num_events == 0 or expandable:
        return None
    reserved, k = a.peak_reserved
    an = a.anatomy_at(max(k, 0))
    stranded = an.free_in_used_segments_bytes
    if stranded < max(MIN_STRANDED_BYTES, MIN_STRANDED_FRACTION * reserved):
        return None
    evidence = FragmentationStrandedEvidence(
        peak_reserved_bytes=reserved,
        allocated_at_peak_bytes=an.allocated_bytes,
        free_in_used_segments_bytes=stranded,
        free_segments_bytes=an.free_segments_bytes,
        largest_free_block_bytes=an.largest_free_block_bytes,
        segments=an.segments,
    )
    return Finding(ID, "high", [a.rank], stranded, evidence, [], _fixes(v, False, 0, under_memory_fraction(a), shapes_vary(a)),
                   per_rank_bytes={a.rank: stranded}, variant="stranded")


def expandable_on(a: DeviceAnalysis) -> bool:
    """Whether the allocator ran with expandable segments: the recorded setting, or an expandable segment in the final
    state."""
    return bool(a.trace.allocator_settings.get("expandable_segments")) or any(
        s.is_expandable for s in a.device.segments)


def under_memory_fraction(a: DeviceAnalysis) -> bool:
    """Whether the process ran under a memory fraction (``torch.cuda.set_per_process_memory_fraction``, the only place
    ``garbage_collection_threshold``'s collector runs): the sidecar's fraction below 1, its bytes known or not, else a
    limit the replay infers as a fraction (:func:`oomdoctor.simulate.capacity.infer_capacity`: the sidecar's cap in
    bytes, an OOM below the device's memory, or the fallback rules). The fragmentation fixes and the verdict's
    defragmenting settings (:func:`oomdoctor.report.rank_predictions.defragmenting_settings`) both read it."""
    fraction = a.trace.meta.get("memory_fraction")
    if isinstance(fraction, (int, float)) and fraction < 1:  # infer_capacity sizes it only with the GPU's total
        return True
    from ..simulate.capacity import infer_capacity  # the replay's package: only for a fragmentation finding

    return infer_capacity(a.trace, a.device).kind == "fraction"


#: The smallest ``max_split_size_mb`` every PyTorch version accepts (> 20 up to 2.8, >= 20 from 2.9).
MIN_SPLIT_MB = 21


def split_mb(request: int) -> int:
    """The ``max_split_size_mb`` proposed for a failed request of ``request`` bytes: half of it, within
    [21, 1024] MiB (blocks that large are then never split, so the request finds a whole one); 512 without one.
    The floor is 21 because PyTorch up to 2.8 refuses 20 at start-up ("max_split_size_mb too small, must be > 20",
    ``CUDAAllocatorConfig::parseMaxSplitSize``); 2.9 accepts ``>= 20``, so 21 holds for every version."""
    return max(MIN_SPLIT_MB, min(1024, (request // MiB) // 2)) if request else 512


def shapes_vary(a: DeviceAnalysis) -> bool:
    """Whether the job's shapes vary from pass to pass: a stack of model code allocates sizes in one forward
    pass and sizes in the next that neither contain the other (sequence lengths that change with the batch).
    With static shapes every pass makes the same sizes at the same stacks, and a pass cut short by an OOM a
    subset of them. False with fewer than two passes."""
    lt, ph = a.lifetimes, a.phases
    rows = np.flatnonzero((lt.alloc >= 0) & (lt.stack >= 0))
    if rows.size == 0 or ph.pass_starts.size < 2:
        return False
    ri = role_index(a.trace)
    rows = rows[ri.lookup(ri.model, lt.stack[rows])]
    bpass = ph.pass_of(lt.alloc[rows])
    sizes: dict[int, dict[int, set[int]]] = {}
    for st, size, p in zip(lt.stack[rows].tolist(), lt.requested[rows].tolist(), bpass.tolist()):
        if p >= 0:
            sizes.setdefault(st, {}).setdefault(p, set()).add(size)
    for by_pass in sizes.values():
        order = sorted(by_pass)
        for p, q in zip(order, order[1:]):
            x, y = by_pass[p], by_pass[q]
            if not x <= y and not y <= x:
                return True
    return False


def _fixes(v: TorchVersion, expandable_on: bool, request: int, capped: bool, varies: bool = False) -> list[Fix]:
    env = "PYTORCH_ALLOC_CONF" if v.at_least((2, 9)) else "PYTORCH_CUDA_ALLOC_CONF"
    split = split_mb(request)
    fixes: list[Fix] = []
    if not expandable_on:
        fixes.append(Fix(
            "expandable-segments", versions=">=2.1", source="pytorch/pytorch PR #96995; pytorch.org/docs/stable/notes/cuda.html"
                   "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf",
            kind="env", setting=f"{env}=expandable_segments:True", applies=v.at_least((2, 1)),
            what_if={"config": "expandable_segments:True"}))
    fixes.append(Fix(
        "max-split-size", versions=">=1.10", source="pytorch.org/docs/stable/notes/cuda.html; CUDACachingAllocator.cpp get_free_block/should_split",
        kind="env", setting=f"{env}=max_split_size_mb:{split}",
        what_if={"config": f"max_split_size_mb:{split}"}))
    if capped:  # the collector only runs under a memory fraction (CUDACachingAllocator.cpp malloc)
        fixes.append(Fix(
            "garbage-collection-threshold", versions=">=1.12", source="CUDACachingAllocator.cpp garbage_collect_cached_blocks", kind="env",
            setting=f"{env}=garbage_collection_threshold:0.8", what_if={"config": "garbage_collection_threshold:0.8"}))
    if varies:  # only a job whose shapes change from pass to pass (shapes_vary)
        fixes.append(Fix(
            "vary-shapes-less", versions="all", source="PyTorch CUDA semantics notes, 'Optimizing memory usage with "
                                   "PYTORCH_CUDA_ALLOC_CONF' (pytorch.org/docs/stable/notes/cuda.html)", kind="code"))
    return fixes


def detect(ctx: Context) -> list[Finding]:
    return [f for a in ctx.analyses if (f := detect_rank(a, ctx)) is not None]
