"""``rank-imbalance``: one rank's peak well above the others' (AP-11).

With several ranks, a rank whose peak allocated memory is at least 10% and 256 MiB above the median of
the other ranks *that run the same code* is reported with the allocation sites that hold more on it than on the others, at its
peak and at the end of the trace (rank 0 keeping debug tensors, metrics, full state dicts...).

Pipeline stages run different layers (the last one the LM head), so their memory differs by design:
ranks whose stacks show ``torch.distributed.pipelining`` are compared only with ranks of the same
stage, known from the sidecar (``pp_rank``/``pipeline_stage``); without it they are not compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..analysis.device import DeviceAnalysis
from ..analysis.ranks import RankProfile, SiteBytes, site_deltas, site_key, sites_held
from ..units import MiB
from .common import MAX_SITES, site_refs, stacks_matching
from .context import Context
from .finding import Evidence, Finding, Fix, absent

ID = "rank-imbalance"
MIN_RATIO = 1.10
MIN_BYTES = 256 * MiB


@dataclass(frozen=True, kw_only=True)
class ExtraSite:
    """An allocation site holding more on this rank than on the others at the end of the trace."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    site: str
    """file:line function of the allocation site"""
    bytes: int
    """held by the site on this rank (bytes)"""
    others_bytes: int
    """held by the site on the other ranks, the median (bytes)"""
    blocks: int
    """the site's live blocks on this rank"""


@dataclass(frozen=True, kw_only=True)
class RankImbalanceEvidence(Evidence):
    """The evidence of a ``rank-imbalance`` finding (every variant): one rank against the other ranks of its group."""

    FINDING: ClassVar[str] = ID
    VARIANTS: ClassVar[tuple[str, ...]] = ("", "held-at-end", "most-different")

    rank: int
    """the rank above the others"""
    peak_allocated_bytes: int
    """its peak allocated (bytes)"""
    others_median_peak_allocated_bytes: int
    """the other ranks' peak allocated, the median (bytes)"""
    excess_bytes: int
    """its peak allocated above that median (bytes)"""
    peak_reserved_bytes: int
    """its peak reserved (bytes)"""
    end_allocated_bytes: int
    """allocated at the end of its trace (bytes)"""
    others_median_end_allocated_bytes: int
    """the other ranks' allocated at the end, the median (bytes)"""
    ranks_compared: int
    """the ranks of its group, itself included"""
    per_rank_peak_allocated_bytes: dict[int, int]
    """peak allocated per rank of the group (keys: rank numbers; bytes)"""
    extra_at_end: list[ExtraSite]
    """the sites holding at least 16 MiB more on this rank at the end, largest first (five at most)"""
    top_site_extra_bytes: int | None = absent()
    """what the site that differs most holds more on this rank (bytes; absent when no site differs by 16 MiB)"""
    top_site_blocks: int | None = absent()
    """that site's live blocks on this rank (absent with it)"""
    top_site: str | None = absent()
    """that site, file:line function (absent when no site differs by 16 MiB)"""


EVIDENCE: tuple[type[Evidence], ...] = (RankImbalanceEvidence,)
"""The evidence classes of this detector's findings."""


def _group(a: DeviceAnalysis) -> object:
    meta = a.trace.meta
    stage = meta.get("pp_rank", meta.get("pipeline_stage"))
    if stage is not None:
        return f"stage {stage}"
    if stacks_matching(a.trace, "torch/distributed/pipelining/").any():
        return f"pipeline rank {a.rank}"  # stage unknown: compare with nobody
    return "all"


def profile(a: DeviceAnalysis) -> RankProfile:
    """The rank's peaks and its sites (with their :class:`SiteRef`) at its peak and at its end."""
    def sites(at: str) -> dict[str, SiteBytes]:
        held = sites_held(a, at)
        refs = site_refs(a, held, limit=len(held))
        return {site_key(a, s): SiteBytes(s.bytes, s.count, r) for s, r in zip(held, refs)}

    return RankProfile(a.rank, a.peak_allocated[0], a.peak_reserved[0], a.end_allocated, _group(a),
                       sites("peak"), sites("end"))


def detect(ctx: Context) -> list[Finding]:
    """The findings over the ranks of ``ctx``. One rank alone has nobody to be compared with (a group needs two): no
    finding, and no profile made (``diagnose`` makes each rank's profile once, for the comparison of the job's ranks
    after they are merged: :mod:`oomdoctor.report.merge`)."""
    if len(ctx.analyses) < 2:
        return []
    return detect_profiles([profile(a) for a in ctx.analyses])


def detect_profiles(profiles: list[RankProfile]) -> list[Finding]:
    """The findings over ranks given as profiles (from one process, or gathered from a whole job)."""
    groups: dict[object, list[RankProfile]] = {}
    for p in profiles:
        groups.setdefault(p.group, []).append(p)
    out: list[Finding] = []
    for members in groups.values():
        if len(members) >= 2:
            out.extend(_detect_group(members))
    return out


def _detect_group(pk: list[RankProfile]) -> list[Finding]:
    out: list[Finding] = []
    for i, p in enumerate(pk):
        others = [q.peak_allocated_bytes for j, q in enumerate(pk) if j != i]
        med = int(np.median(others))
        excess = p.peak_allocated_bytes - med
        if p.peak_allocated_bytes < MIN_RATIO * med or excess < MIN_BYTES:
            continue
        at_peak = [d for d in site_deltas(pk, i, "peak") if d.delta_bytes >= 16 * MiB]
        at_end = [d for d in site_deltas(pk, i, "end") if d.delta_bytes >= 16 * MiB]
        end_others = int(np.median([q.end_allocated_bytes for j, q in enumerate(pk) if j != i]))
        top = (at_end or at_peak)
        evidence = RankImbalanceEvidence(
            rank=p.rank,
            peak_allocated_bytes=p.peak_allocated_bytes,
            others_median_peak_allocated_bytes=med,
            excess_bytes=excess,
            peak_reserved_bytes=p.peak_reserved_bytes,
            end_allocated_bytes=p.end_allocated_bytes,
            others_median_end_allocated_bytes=end_others,
            ranks_compared=len(pk),
            per_rank_peak_allocated_bytes={q.rank: q.peak_allocated_bytes for q in pk},
            extra_at_end=[ExtraSite(site=d.ref.label, bytes=d.bytes, others_bytes=d.others_median_bytes, blocks=d.count)
                          for d in at_end[:5]],
            top_site_extra_bytes=top[0].delta_bytes if top else None,
            top_site_blocks=top[0].count if top else None,
            top_site=top[0].ref.label if top else None,
        )
        # the wording of the site that differs most: still held at the end on this rank only, or at the peak
        variant = ("held-at-end" if at_end else "most-different") if top else ""
        fixes = [
            Fix("per-rank-extras-off-gpu", versions="all", source="PyTorch FAQ 'Don't accumulate history across your training loop' (pytorch.org/docs/stable/notes/faq.html)", kind="code"),
            Fix("sharded-checkpoint", versions=">=2.2", source="torch/distributed/checkpoint/state_dict.py StateDictOptions", kind="code"),
        ]
        refs = [d.ref for d in (at_end or at_peak)][:MAX_SITES]
        out.append(Finding(ID, "high" if excess >= 0.2 * med else "medium", [p.rank], excess, evidence, refs, fixes,
                           per_rank_bytes={p.rank: excess}, variant=variant))
    return out
