"""The :class:`Report`: everything a renderer shows, already computed, sorted and trimmed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..analysis.accounting import Breakdown
from ..analysis.fragmentation import Anatomy
from ..detectors.finding import Finding, SiteRef
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


@dataclass
class HolderRef(SiteRef):
    """A holder of memory at the breakdown's event: a site and one category of what it holds, with the
    phase most of those bytes were allocated in (:mod:`oomdoctor.analysis.holders`)."""

    category: str = ""
    phase: str = ""
    #: bytes whose stack was matched from a stacked step (``--stack-steps``), not recorded
    matched_bytes: int = 0


@dataclass
class RankSummary:
    """One rank (one device of one snapshot file). Bytes; event indices (-1: trace start)."""

    rank: int
    path: str
    device: int
    events: int
    has_history: bool
    duration_us: int
    peak_allocated_bytes: int
    peak_allocated_event: int
    peak_reserved_bytes: int
    peak_reserved_event: int
    end_allocated_bytes: int
    end_reserved_bytes: int
    oom: OomInfo | None
    anatomy_at_peak: Anatomy | None
    top_sites: list[SiteRef]
    series: dict[str, list[int]]
    steps: int | None
    step_source: str | None
    truncated: bool
    unmatched_frees: int
    ghost_blocks: int
    torch_version: str
    allocator_conf: str
    warnings: list[str] = field(default_factory=list)
    trace_kind: str = ""
    verdict: Verdict | None = None
    breakdown: Breakdown | None = None
    breakdowns: list[Breakdown] = field(default_factory=list)
    holders: list[HolderRef] = field(default_factory=list)
    fits: Fits | None = None
    frameworks: list[str] = field(default_factory=list)
    #: the job's own peaks (:mod:`oomdoctor.analysis.jobpeak`): PyTorch's counters, which a ring buffer cannot
    #: drop; None when not known (``peak_source`` "unknown-before-window")
    job_peak_allocated_bytes: int | None = None
    job_peak_reserved_bytes: int | None = None
    peak_source: str = "trace"
    #: the job's peak allocated / reserved is above the recorded window's: the window missed it
    allocated_peak_missed: bool = False
    reserved_peak_missed: bool = False
    #: the allocator's own ``num_alloc_retries`` / ``num_ooms`` (since the process started); None without counters
    alloc_retries: int | None = None
    alloc_ooms: int | None = None
    alloc_retries_source: str = "unknown"
    #: steps recorded without stacks (``--stack-steps``) and what was matched, from
    #: :func:`oomdoctor.trace.stackmatch.match_stackless_steps`; None when every step was recorded with stacks
    stack_matches: dict[str, Any] | None = None


@dataclass
class Report:
    """Everything about a job's ranks; ``verdict`` is the job's (its worst rank's), ``materiality``
    the rule's parameters (``fraction``, ``min_bytes``)."""

    ranks: list[RankSummary]
    findings: list[Finding]
    inputs: list[str]
    oomdoctor_version: str
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    verdict: Verdict | None = None
    materiality: dict[str, Any] = field(default_factory=dict)
    groups: Any = None
    """:class:`~oomdoctor.report.groups.RankGroups`: alike ranks collapsed, the odd ones first."""
