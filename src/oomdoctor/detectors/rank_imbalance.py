"""``rank-imbalance``: one rank's peak well above the others' (AP-11).

With several ranks, a rank whose peak allocated memory is at least 10% and 256 MiB above the median of
the other ranks *that run the same code* is reported with the allocation sites that hold more on it than on the others, at its
peak and at the end of the trace (rank 0 keeping debug tensors, metrics, full state dicts...).

Pipeline stages run different layers (the last one the LM head), so their memory differs by design:
ranks whose stacks show ``torch.distributed.pipelining`` are compared only with ranks of the same
stage, known from the sidecar (``pp_rank``/``pipeline_stage``); without it they are not compared.
"""

from __future__ import annotations

import numpy as np

from ..analysis.device import DeviceAnalysis
from ..analysis.ranks import RankProfile, SiteBytes, site_deltas, site_key, sites_held
from ..units import MiB
from .common import MAX_SITES, site_refs, stacks_matching
from .context import Context
from .finding import Finding, Fix

ID = "rank-imbalance"
MIN_RATIO = 1.10
MIN_BYTES = 256 * MiB


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
        evidence = {
            "rank": p.rank,
            "peak_allocated_bytes": p.peak_allocated_bytes,
            "others_median_peak_allocated_bytes": med,
            "excess_bytes": excess,
            "peak_reserved_bytes": p.peak_reserved_bytes,
            "end_allocated_bytes": p.end_allocated_bytes,
            "others_median_end_allocated_bytes": end_others,
            "ranks_compared": len(pk),
            "per_rank_peak_allocated_bytes": {q.rank: q.peak_allocated_bytes for q in pk},
            "extra_at_end": [{"site": d.ref.label, "bytes": d.bytes, "others_bytes": d.others_median_bytes,
                              "blocks": d.count} for d in at_end[:5]],
        }
        top = (at_end or at_peak)
        if top:
            evidence["top_site_extra_bytes"] = top[0].delta_bytes
            evidence["top_site_blocks"] = top[0].count
            evidence["top_site"] = top[0].ref.label
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
