"""The JSON documents whose shape is not one dataclass of the core's: dataclasses whose ``asdict`` is the JSON,
built from the core's results. :mod:`.json` writes them; :mod:`.schema` generates their JSON Schemas from them (the
docstring under each field is its description). Bytes in ``*_bytes``, seconds in ``*_s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from typing_extensions import (  # pydantic (the schema) reads typing_extensions' TypedDict
    NotRequired,
    TypedDict,
)

from ..report.diff import FindingChange, RankDiff
from ..report.groups import RankGroups
from ..report.model import RankSummary, Unread
from ..simulate.capacity import Capacity
from ..simulate.replay import SimulatedOom, Validation
from .words import simulate as sim_words

if TYPE_CHECKING:  # annotations only
    from ..simulate.replay import ReplayResult
    from ..simulate.whatif import Simulation

_DOC = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

# ------------------------------------------------------------------------------------------ diagnose


class Materiality(TypedDict):
    """the rule: findings under max(fraction x peak reserved, min_bytes) are LOW"""

    fraction: float
    """of peak reserved"""
    min_bytes: int
    """floor (bytes)"""


class InJobSummary(TypedDict):
    """the in-job summary's (oomdoctor run --summarize: report/merge.py)"""

    in_job_summary: bool
    """written by the job's ranks (oomdoctor run --summarize)"""
    world_size: int | None
    """the job's ranks"""
    missing_ranks: list[int]
    """ranks that sent nothing"""


class DiagnoseDoc(TypedDict):
    """the diagnosis of a job's snapshots: ``diagnose --format json`` (render/json.py ``report_dict``) after
    ``schema_version`` and ``oomdoctor_version``"""

    verdict: Any
    """the job's verdict: its worst rank's (ranks that ran out of memory first)"""
    inputs: list[str]
    """the snapshot files read"""
    unread: list[Unread]
    """the files that claim a rank (by their sidecar or their name) and could not be read: cut off, corrupt, or
    refused because unpickling them would run code; the report covers the other ranks only, and every --fail-on
    level fails (empty: every rank found was read)"""
    ranks: list[RankSummary]
    """every rank, by rank"""
    findings: list[Any]
    """ranked: severity, then bytes at stake"""
    notes: list[str]
    """about the whole job"""
    materiality: Materiality
    """the rule: findings under max(fraction x peak reserved, min_bytes) are LOW"""
    groups: NotRequired[RankGroups]
    """the ranks grouped like a job"""
    extra: NotRequired[InJobSummary]
    """the in-job summary's"""


# ---------------------------------------------------------------------------------------------- diff


class DiffDoc(TypedDict):
    """what a change did to memory: ``diff --format json`` (render/json.py ``diff_dict``) after ``schema_version``
    and ``oomdoctor_version``"""

    before: list[str]
    """the before inputs"""
    after: list[str]
    """the after inputs"""
    peak_reserved_saved_bytes: int
    """summed over the ranks: before minus after (bytes)"""
    ranks: list[RankDiff]
    """per rank"""
    findings: list[FindingChange]
    """resolved, new, changed, unchanged"""
    notes: list[str]
    """notes"""


for _shape in (Materiality, InJobSummary, DiagnoseDoc, DiffDoc):
    _shape.__pydantic_config__ = _DOC  # type: ignore[attr-defined]

# ------------------------------------------------------------------------------------------ simulate


@dataclass
class RecordedDoc:
    """what was recorded"""

    __pydantic_config__ = _DOC

    config: str
    """the recorded allocator settings"""
    peak_reserved_bytes: int
    """recorded peak reserved (bytes)"""
    peak_allocated_bytes: int
    """recorded peak allocated (bytes)"""
    oom_event_index: int | None
    """the recorded OOM"""


@dataclass
class ReplayDoc:
    """one replay"""

    __pydantic_config__ = _DOC

    config: str
    """PYTORCH_CUDA_ALLOC_CONF ('' for the defaults)"""
    deferred_frees: str
    """'recorded' or 'immediate'"""
    peak_reserved_bytes: int
    """peak reserved (bytes)"""
    peak_allocated_bytes: int
    """peak allocated (bytes)"""
    end_reserved_bytes: int
    """reserved at the end (bytes)"""
    oom: SimulatedOom | None
    """the replay's OOM"""
    matches_recorded: bool | None
    """for the recorded settings: the replay reproduces the recording"""
    validation: Validation | None
    """the replay of the recorded settings against the recording"""
    initial_state: str
    """recorded, reallocated or empty"""
    events_replayed: int
    """events replayed"""
    num_alloc_retries: int
    """allocations that freed cache and retried"""
    segment_events: int
    """segment allocations and frees in the replay"""
    warnings: list[str]
    """warnings"""
    reach: str
    """how far the replay reaches: 'complete' (no OOM recorded, every event replayed) or 'recorded' (the recording
    ends at its OOM: without an OOM here the setting gets past that request; what would have run after it was never
    recorded)"""

    @classmethod
    def of(cls, r: ReplayResult, reach: str) -> ReplayDoc:
        return cls(config=r.config.to_string(), deferred_frees=r.deferred_frees,
                   peak_reserved_bytes=r.peak_reserved_bytes, peak_allocated_bytes=r.peak_allocated_bytes,
                   end_reserved_bytes=r.end_reserved_bytes, oom=r.oom, matches_recorded=r.matches_recorded,
                   validation=r.validation, initial_state=r.initial_state, events_replayed=r.events_replayed,
                   num_alloc_retries=r.num_alloc_retries, segment_events=r.segment_events, warnings=r.warnings,
                   reach=reach)


@dataclass
class RecommendationDoc:
    """the setting --search recommends"""

    __pydantic_config__ = _DOC

    config: str
    """the setting"""
    deferred_frees: str
    """recorded or immediate"""
    peak_reserved_bytes: int
    """its peak reserved (bytes)"""
    reason: str
    """why"""
    incompatibilities: list[str]
    """what it does not combine with"""


@dataclass
class SimulationDoc:
    """allocator replays of one snapshot: ``oomdoctor simulate --format json`` after ``schema_version`` and
    ``oomdoctor_version``; ``results[0]`` replays the recorded settings, checked against the recording"""

    __pydantic_config__ = _DOC

    path: str
    """the snapshot"""
    rank: int | None
    """its rank"""
    num_events: int
    """trace events"""
    recorded: RecordedDoc
    """what was recorded"""
    capacity: Capacity
    """the capacity"""
    has_deferred_frees: bool
    """frees held for other streams were recorded"""
    results: list[ReplayDoc]
    """results[0] replays the recorded settings and is checked against the recording"""
    recommendation: RecommendationDoc | None
    """the setting --search recommends"""
    search_wall_s: float | None
    """seconds the search took"""
    notes: list[str]
    """notes"""

    @classmethod
    def of(cls, sim: Simulation) -> SimulationDoc:
        rec = sim.recommendation
        return cls(
            path=sim.path, rank=sim.rank, num_events=sim.num_events,
            recorded=RecordedDoc(sim.recorded_config.to_string(), sim.recorded_peak_reserved_bytes,
                                 sim.recorded_peak_allocated_bytes, sim.recorded_oom_event),
            capacity=sim.capacity, has_deferred_frees=sim.has_deferred_frees,
            results=[ReplayDoc.of(r, sim.reach) for r in sim.results],
            recommendation=None if rec is None else RecommendationDoc(
                rec.result.config.to_string(), rec.result.deferred_frees, rec.result.peak_reserved_bytes,
                sim_words.reason(rec.reason), [sim_words.INCOMPATIBILITIES[i] for i in rec.incompatibilities]),
            search_wall_s=sim.search_wall_s, notes=sim_words.notes(sim))
