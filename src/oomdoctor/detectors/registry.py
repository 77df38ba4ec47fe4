"""The detectors, in one explicit list. Each module has ``ID``, ``detect(ctx) -> list[Finding]`` and ``EVIDENCE``, the
classes of its findings' evidence (:class:`~oomdoctor.detectors.finding.Evidence`, one per kind)."""

from __future__ import annotations

from types import ModuleType

from . import (
    allgather_list,
    cache_flush,
    deferred_free,
    fragmentation,
    kept_exception,
    memory_growth,
    output_accumulation,
    pipeline_output_cache,
    rank_imbalance,
    small_long_lived,
)
from .context import Context
from .finding import Evidence, Finding
from .materiality import rank_key

DETECTORS: tuple[ModuleType, ...] = (
    deferred_free,
    fragmentation,
    pipeline_output_cache,
    output_accumulation,
    memory_growth,
    kept_exception,
    allgather_list,
    rank_imbalance,
    small_long_lived,
    cache_flush,
)


EVIDENCE: dict[tuple[str, str], type[Evidence]] = {
    (cls.FINDING, variant): cls for det in DETECTORS for cls in det.EVIDENCE for variant in cls.VARIANTS}
"""``(finding id, variant)`` -> the class of that finding kind's evidence, for every detector."""


def evidence_class(finding_id: str, variant: str) -> type[Evidence]:
    """The class of the evidence of a finding ``finding_id`` with ``variant``; :class:`Evidence` itself (no field but
    the materiality rule's) for an id no detector has.

    Raises:
        KeyError: a detector's id with a variant it does not write."""
    if not any(fid == finding_id for fid, _ in EVIDENCE):
        return Evidence
    return EVIDENCE[(finding_id, variant)]


def run_all(ctx: Context) -> list[Finding]:
    """Every detector's findings, with the same id on several ranks merged into one finding."""
    return merge_findings([f for det in DETECTORS for f in det.detect(ctx)])


def merge_findings(findings: list[Finding]) -> list[Finding]:
    """One finding per id (per rank for ``rank-imbalance``): the one with the most bytes at stake is
    kept, with the ranks and per-rank bytes of all; ranked as the materiality rule ranks them (severity,
    then bytes, largest first)."""
    merged: dict[str, Finding] = {}
    for f in findings:
        key = f.id if f.id != "rank-imbalance" else f"{f.id}:{f.ranks[0]}"
        cur = merged.get(key)
        if cur is None:
            merged[key] = f
            continue
        per_rank = {**cur.per_rank_bytes, **f.per_rank_bytes}
        keep = f if f.bytes > cur.bytes else cur
        keep.ranks = sorted(set(cur.ranks) | set(f.ranks))
        keep.per_rank_bytes = per_rank
        merged[key] = keep
    return sorted(merged.values(), key=rank_key)
