"""The :class:`Report`: everything a renderer shows, already computed, sorted and trimmed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from typing_extensions import TypedDict  # pydantic (the schema) reads a TypedDict from typing_extensions only

from ..analysis.accounting import Breakdown
from ..analysis.fragmentation import Anatomy
from ..detectors.finding import Finding, SiteRef
from ..ids import BreakdownCategory
from .fits import Fits
from .verdict import Verdict


@dataclass
class OomInfo:
    """An ``oom`` entry of the trace: the rounded request, CUDA's free bytes then, and the state.

    The docstring under each field is its description in the JSON schema (``oomdoctor schema diagnose``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    event_index: int
    """the OOM event"""
    requested_bytes: int
    """the request that failed (bytes)"""
    cuda_malloc_bytes: int
    """the rounded size the allocator tried to cudaMalloc (bytes)"""
    device_free_bytes: int
    """what CUDA said was free on the device then (bytes)"""
    reserved_bytes: int
    """reserved then (bytes)"""
    allocated_bytes: int
    """allocated then (bytes)"""
    largest_free_block_bytes: int
    """the largest cached free block then (bytes)"""
    stream: int
    """the request's CUDA stream"""


class StackMatchStep(TypedDict):
    """a stack-less step"""

    step: int
    """the step recorded without stacks (from 0)"""
    from_step: int | None
    """the stacked step it was matched against"""
    allocations: int
    """its allocations in the trace"""
    matched: int
    """those that took a stack"""
    unmatched: int
    """those after the first difference (no site)"""


class StackMatches(TypedDict):
    """Steps recorded without stacks (``--stack-steps``) and what was matched, as a rank's JSON writes them
    (:func:`oomdoctor.trace.stackmatch.match_stackless_steps`, the analysed device's)."""

    matched: int
    """allocations of stack-less steps that took a stacked step's stack"""
    unmatched: int
    """allocations of stack-less steps that matched none (no site)"""
    steps: list[StackMatchStep]
    """the steps recorded without stacks"""


for _shape in (StackMatchStep, StackMatches):
    _shape.__pydantic_config__ = {"use_attribute_docstrings": True}  # type: ignore[attr-defined]


@dataclass
class HolderRef(SiteRef):
    """A holder of memory at the breakdown's event: a site and one category of what it holds, with the
    phase most of those bytes were allocated in (:mod:`oomdoctor.analysis.holders`)."""

    category: BreakdownCategory = "unknown"
    """what the blocks are (accounting category)"""
    phase: str = ""
    """the phase most of the bytes were allocated in"""
    matched_bytes: int = 0
    """of those bytes, the blocks whose stack was matched from a stacked step (--stack-steps), not recorded
    (bytes)"""


@dataclass
class RankSummary:
    """One rank (one device of one snapshot file). Bytes; event indices (-1: trace start).

    The docstring under each field is its description in the JSON schema (``oomdoctor schema diagnose``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    rank: int
    """the rank"""
    path: str
    """the snapshot file"""
    device: int
    """the CUDA device index analysed"""
    events: int
    """trace events"""
    has_history: bool
    """the snapshot has an allocation history (not state only)"""
    duration_us: int
    """from the first to the last event (µs)"""
    peak_allocated_bytes: int
    """peak allocated over the trace (bytes)"""
    peak_allocated_event: int
    """its event"""
    peak_reserved_bytes: int
    """peak reserved over the trace (bytes)"""
    peak_reserved_event: int
    """its event"""
    end_allocated_bytes: int
    """allocated at the end (bytes)"""
    end_reserved_bytes: int
    """reserved at the end (bytes)"""
    oom: OomInfo | None
    """the last OOM of the rank"""
    anatomy_at_peak: Anatomy | None
    """the state after the peak of reserved memory: reserved = requested + rounding + pending frees + free in used
    segments + free segments"""
    top_sites: list[SiteRef]
    """the largest allocation sites at the peak allocated"""
    series: dict[str, list[int]]
    """reserved, allocated and active bytes over the trace, downsampled to at most 48 points, each its bucket's
    maximum"""
    steps: int | None
    """training steps seen"""
    step_source: str | None
    """what the steps were found from"""
    truncated: bool
    """the ring buffer wrapped: the trace starts mid-job"""
    unmatched_frees: int
    """frees of blocks allocated before the trace"""
    ghost_blocks: int
    """blocks alive at the end that no event explains"""
    torch_version: str
    """PyTorch's version, or its lower bound read off the snapshot's fields"""
    allocator_conf: str
    """PYTORCH_CUDA_ALLOC_CONF as recorded"""
    warnings: list[str] = field(default_factory=list[str])
    """what the snapshot cannot tell"""
    trace_kind: str = ""
    """what the trace holds, in words"""
    verdict: Verdict | None = None
    """this rank's verdict"""
    breakdown: Breakdown | None = None
    """what holds the memory at the OOM, else at the peak allocated"""
    breakdowns: list[Breakdown] = field(default_factory=list[Breakdown])
    """the same at the peaks and every step point"""
    holders: list[HolderRef] = field(default_factory=list[HolderRef])
    """the largest holders at the breakdown's event"""
    fits: Fits | None = None
    """what fits on this rank's GPU"""
    frameworks: list[str] = field(default_factory=list[str])
    """frameworks seen in the stacks (transformers, accelerate, DeepSpeed, ...)"""
    #: the job's own peaks (:mod:`oomdoctor.analysis.jobpeak`): PyTorch's counters, which a ring buffer cannot
    #: drop; None when not known (``peak_source`` "unknown-before-window")
    job_peak_allocated_bytes: int | None = None
    """the job's own peak allocated: torch.cuda.memory_stats() allocated_bytes.all.peak at the dump (sidecar or
    memory_stats file), or the trace's when it saw the job from its first allocation; at least
    peak_allocated_bytes; null when not known (peak_source unknown-before-window) (bytes)"""
    job_peak_reserved_bytes: int | None = None
    """the same for reserved_bytes.all.peak (bytes)"""
    peak_source: str = "trace"
    """where the job's peaks come from: the sidecar's counters, a memory_stats JSON beside the snapshot, the trace
    itself (it starts with nothing allocated), or not known (the trace starts mid-job and nothing holds the
    counters)"""
    #: the job's peak allocated / reserved is above the recorded window's: the window missed it
    allocated_peak_missed: bool = False
    """the job's peak allocated is above the recorded window's by more than 2 MiB: the ring buffer dropped it"""
    reserved_peak_missed: bool = False
    """the same for the peak reserved"""
    allocated_peak_missed_material: bool = False
    """allocated_peak_missed by a gap worth saying: at least 1% of the job's peak and 64 MiB, the materiality rule's
    defaults (below, the job's peak is said beside the window's, not as a miss)"""
    reserved_peak_missed_material: bool = False
    """the same for the peak reserved"""
    #: the allocator's own ``num_alloc_retries`` / ``num_ooms`` (since the process started); None without counters
    alloc_retries: int | None = None
    """the allocator's own num_alloc_retries (cudaMalloc failed, cache freed, retried; an OOM counts one too),
    since the process started (count)"""
    alloc_ooms: int | None = None
    """the allocator's own num_ooms since the process started (count)"""
    alloc_retries_source: str = "unknown"
    """where alloc_retries comes from"""
    #: steps recorded without stacks (``--stack-steps``) and what was matched, from
    #: :func:`oomdoctor.trace.stackmatch.match_stackless_steps`; None when every step was recorded with stacks
    stack_matches: StackMatches | None = None
    """steps recorded without stacks (--stack-steps) and what was matched; null when every step carried stacks"""


@dataclass
class Unread:
    """A rank's snapshot file that could not be read: it claims a rank (by its sidecar or its name) and is cut off,
    corrupt, or refused because unpickling it would run code (:class:`oomdoctor.trace.load.Skipped`). The job's
    result is incomplete without it, and every ``--fail-on`` level fails (:mod:`oomdoctor.report.gate`).

    The docstring under each field is its description in the JSON schema (``oomdoctor schema diagnose``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    path: str
    """the file"""
    rank: int
    """the rank it claims (its sidecar's, else the one in its name)"""
    reason: str
    """why it could not be read"""


@dataclass
class Report:
    """Everything about a job's ranks; ``verdict`` is the job's (its worst rank's), ``materiality``
    the rule's parameters (``fraction``, ``min_bytes``); ``unread`` the rank files that could not be read (the
    report covers the other ranks only)."""

    ranks: list[RankSummary]
    findings: list[Finding]
    inputs: list[str]
    oomdoctor_version: str
    notes: list[str] = field(default_factory=list[str])
    extra: dict[str, Any] = field(default_factory=dict[str, Any])
    verdict: Verdict | None = None
    materiality: dict[str, Any] = field(default_factory=dict[str, Any])
    groups: Any = None
    """:class:`~oomdoctor.report.groups.RankGroups`: alike ranks collapsed, the odd ones first."""
    unread: list[Unread] = field(default_factory=list[Unread])
