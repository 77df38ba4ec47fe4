"""The JSON contract other tools and our checks rely on::

    {"ranks": [{"rank", "path", "peak_allocated_bytes", "peak_reserved_bytes",
                "oom": null | {"requested_bytes", ...}, ...}],
     "findings": [{"id", "severity", "title", "ranks", "bytes", "evidence",
                   "fixes": [{"text", ...}], ...}]}
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from ..report.model import Report
from .format import fill


def report_dict(report: Report) -> dict[str, Any]:
    ranks = []
    for r in report.ranks:
        d = asdict(r)
        an = d.pop("anatomy_at_peak")
        if an is not None:
            an["allocated_bytes"] = r.anatomy_at_peak.allocated_bytes
        d["anatomy_at_peak"] = an
        ranks.append(d)
    findings = []
    for f in report.findings:
        d = asdict(f)
        d["summary"] = fill(f.summary, f.evidence)
        d["title"] = fill(f.title, f.evidence)
        d["per_rank_bytes"] = {str(k): v for k, v in f.per_rank_bytes.items()}
        findings.append(d)
    return {"oomdoctor_version": report.oomdoctor_version, "inputs": report.inputs, "ranks": ranks,
            "findings": findings, "notes": report.notes}


def render_json(report: Report) -> str:
    return json.dumps(report_dict(report), indent=2, default=_default) + "\n"


def _default(o: Any) -> Any:
    if isinstance(o, tuple):
        return list(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
