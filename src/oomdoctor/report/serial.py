"""A :class:`Report` (and rank profiles) as plain JSON data and back, losslessly.

This is the wire format of the in-job summary: each rank sends its own report and profile as JSON
(never pickle: nothing received is executed). Unlike ``render.json`` it keeps finding texts as
templates, so that a merged report renders exactly like one built in a single process.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import dacite

from ..analysis.ranks import RankProfile, SiteBytes
from ..detectors.finding import Evidence, FindingTitle, SiteRef
from ..detectors.registry import evidence_class
from .model import Report

_CONFIG = dacite.Config(cast=[tuple], strict=True)
_EVIDENCE_CONFIG = dacite.Config(cast=[tuple], strict=True, type_hooks={
    dict[int, int]: lambda d: {int(k): v for k, v in d.items()}})  # rank keys, str after a JSON round trip


def report_to_plain(report: Report) -> dict[str, Any]:
    return asdict(report)


def report_from_plain(data: dict[str, Any]) -> Report:
    """Inverse of :func:`report_to_plain` (also after a JSON round trip, which turns int keys into str).

    Raises:
        ValueError: ``data`` does not have the shape of a report.
    """
    data = json.loads(json.dumps(data, default=list))  # one canonical shape: tuples -> lists, str keys
    evidence: list[dict[str, Any]] = []
    for f in data.get("findings", []):
        per_rank: dict[str, Any] = f.get("per_rank_bytes") or {}
        f["per_rank_bytes"] = {int(k): v for k, v in per_rank.items()}
        evidence.append(f.pop("evidence", None) or {})  # typed below, by the finding's kind
    try:
        report = dacite.from_dict(Report, data, config=_CONFIG)
        for f, ev in zip(report.findings, evidence):
            f.evidence = _evidence(evidence_class(f.id, f.variant), ev)
        for v in [report.verdict, *(r.verdict for r in report.ranks)]:
            if v is not None and isinstance(v.evidence.get("title"), list):  # a FindingTitle, a list in JSON
                v.evidence["title"] = FindingTitle(*v.evidence["title"])
        return report
    except (dacite.DaciteError, TypeError, KeyError) as e:
        raise ValueError(f"not an oomdoctor report: {e}") from None


def _evidence(cls: type[Evidence], data: dict[str, Any]) -> Evidence:
    """The evidence of class ``cls`` from its plain data (``asdict``'s, after a JSON round trip)."""
    return dacite.from_dict(cls, data, config=_EVIDENCE_CONFIG)


def profile_to_plain(p: RankProfile) -> dict[str, Any]:
    return asdict(p)


def profile_from_plain(data: dict[str, Any]) -> RankProfile:
    """Inverse of :func:`profile_to_plain`; each site's ``ref`` becomes a :class:`SiteRef` again.

    Raises:
        ValueError: ``data`` does not have the shape of a profile.
    """
    try:
        p = dacite.from_dict(RankProfile, data, config=dacite.Config(cast=[tuple]))
        for sites in (p.sites_at_peak, p.sites_at_end):
            for k, s in list(sites.items()):
                sites[k] = SiteBytes(s.bytes, s.count, dacite.from_dict(SiteRef, s.ref) if s.ref else None)
    except (dacite.DaciteError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"not an oomdoctor rank profile: {e}") from None
    return p
