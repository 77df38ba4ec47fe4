"""The JSON outputs of ``diagnose``, ``simulate`` and ``diff``. Their shapes, every field with its unit, are
the schemas of :mod:`.schema` (``oomdoctor schema COMMAND``, ``docs/json.md``), which the tests validate real
outputs against; every output carries ``schema_version``."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .._version import SCHEMA_VERSION, __version__
from ..detectors.finding import FindingTitle
from .words import capacity as capacity_words
from .words import fits as fits_words
from .words import predict as predict_words
from .words import verdict as words
from .words.findings import fix_text, resolve_title, summary, title

if TYPE_CHECKING:  # annotations only: rendering imports no analysis code
    from ..analysis.fragmentation import Anatomy
    from ..detectors.finding import Finding
    from ..report.diff import Diff
    from ..report.model import Report
    from ..simulate.whatif import Simulation


def anatomy_dict(an: Anatomy | None) -> dict[str, Any] | None:
    """An anatomy's fields plus its derived ``allocated_bytes`` (requested + rounding waste)."""
    if an is None:
        return None
    return asdict(an) | {"allocated_bytes": an.allocated_bytes}


def verdict_dict(v) -> dict[str, Any] | None:
    """A verdict with its summary and actions in words (:mod:`.words.verdict`), then its ``reasons`` and ``to_do``
    (the ids they are said from)."""
    if v is None:
        return None
    d = asdict(v)
    # asdict's copies of the values, the finding's title (a FindingTitle, which asdict would flatten) and what fits
    # in words (the same words the summary is filled from)
    ev = words.said_evidence({**d["evidence"], **{k: x for k, x in v.evidence.items() if isinstance(x, FindingTitle)}})
    if "fix_outcome" in ev:  # the fix's prediction: its outcome's words where the id is, as the JSON has them
        ev["fix_outcome"] = predict_words.outcome_template(words.fix_prediction(v.evidence))
    if "defragmented_outcome_template" in ev:
        ev["defragmented_outcome_template"] = words.fix_outcome_template(v.evidence)
    to_do = [{"id": a.id, "framework": a.framework, "fix": a.fix.id if a.fix is not None else None} for a in v.to_do]
    return {"kind": d["kind"], "summary": words.summary(v), "bytes": d["bytes"], "ranks": d["ranks"],
            "headroom_bytes": d["headroom_bytes"], "finding": d["finding"], "evidence": ev,
            "actions": words.actions(v), "assumptions": words.assumptions(v), "reasons": d["reasons"], "to_do": to_do}


def report_dict(report: Report) -> dict[str, Any]:
    """The ``diagnose --format json`` contract of ``report``. A notebook ``Diagnosis`` (``oomdoctor.diagnose``) is
    read through its ``report``: its own verdicts and fits are already in words."""
    report = getattr(report, "report", report)
    ranks = []
    for r in report.ranks:
        d = asdict(r)
        del d["anatomy_at_peak"]  # re-added last, where the JSON contract has always had it
        d["anatomy_at_peak"] = anatomy_dict(r.anatomy_at_peak)
        d["verdict"] = verdict_dict(r.verdict)
        d["fits"] = fits_words.fits_dict(r.fits)  # its notes and assumptions in words, in place
        ranks.append(d)
    findings = []
    for f in report.findings:
        d = finding_dict(f)
        for fx, pred in [(x, x.get("prediction")) for x in d["fixes"]] + [(d, d.get("prediction"))]:
            if pred and "outcome" in pred:
                fx["prediction"] = {**pred, "outcome": predict_words.outcome(pred)}
        findings.append(d)
    out = {"schema_version": SCHEMA_VERSION, "oomdoctor_version": report.oomdoctor_version,
           "verdict": verdict_dict(report.verdict),
           "inputs": report.inputs, "unread": [asdict(u) for u in report.unread], "ranks": ranks,
           "findings": findings, "notes": report.notes, "materiality": report.materiality}
    if report.groups is not None:
        out["groups"] = asdict(report.groups)
    if report.extra:  # the in-job summary: {"in_job_summary", "world_size", "missing_ranks"}
        out["extra"] = report.extra
    return out


_FIX_KEYS = ("versions", "source", "kind", "setting", "applies", "what_if", "prediction", "measured")
"""A fix's keys in the JSON contract after its ``text``."""


def finding_dict(f: Finding) -> dict[str, Any]:
    """A finding as the JSON contract has it: its title, summary and each fix's text in words
    (:mod:`.words.findings`), in the contract's order of keys."""
    d = asdict(f)
    fixes = [{"text": fix_text(fx), **{k: fd[k] for k in _FIX_KEYS}} for fx, fd in zip(f.fixes, d["fixes"])]
    return {"id": f.id, "severity": f.severity, "title": title(f), "ranks": d["ranks"], "bytes": f.bytes,
            "summary": summary(f), "evidence": f.evidence.as_dict(), "sites": d["sites"], "fixes": fixes,
            "prediction": d["prediction"], "per_rank_bytes": {str(k): v for k, v in f.per_rank_bytes.items()},
            "related": d["related"]}


def render_json(report: Report) -> str:
    return json.dumps(report_dict(report), indent=2, default=json_default) + "\n"


def json_default(o: Any) -> Any:
    """``json.dumps``'s ``default`` for reports: tuples as lists, numpy scalars as numbers."""
    if isinstance(o, tuple):
        return list(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def simulation_dict(sim: Simulation) -> dict[str, Any]:
    """The ``oomdoctor simulate --format json`` contract (:class:`.documents.SimulationDoc`, with the derived
    ``validation.segment_events_compared``)::

        {"recorded": {"config", "peak_reserved_bytes", "peak_allocated_bytes", "oom_event_index"},
         "capacity": {"limit_bytes", "kind", "source", "certainty", "lower_bytes", "upper_bytes", "evidence"},
         "results": [{"config", "deferred_frees": "recorded"|"immediate", "peak_reserved_bytes",
                      "peak_allocated_bytes", "end_reserved_bytes",
                      "oom": null | {"event_index", "requested_bytes", "alloc_size_bytes"},
                      "matches_recorded": bool|null, "validation": null | {...}, ...}],
         "recommendation": null | {"config", "deferred_frees", "peak_reserved_bytes", "reason",
                                   "incompatibilities"}}

    ``config`` is the ``PYTORCH_CUDA_ALLOC_CONF`` string ("" for the defaults). ``results[0]`` is the
    replay of the recorded settings, checked against the recording.
    """
    from .documents import SimulationDoc  # the replay's classes: only a simulation imports them

    doc = asdict(SimulationDoc.of(sim))
    doc["capacity"]["source"] = capacity_words.said(sim.capacity)  # its id in words, as the JSON has always had
    for r, d in zip(sim.results, doc["results"]):
        if r.validation is not None:
            d["validation"]["segment_events_compared"] = r.validation.segment_events_compared
    return {"schema_version": SCHEMA_VERSION, "oomdoctor_version": __version__, **doc}


def render_simulation_json(sim: Simulation) -> str:
    return json.dumps(simulation_dict(sim), indent=2, default=json_default) + "\n"


def diff_dict(diff: Diff) -> dict[str, Any]:
    """The ``oomdoctor diff --format json`` contract::

        {"before": [paths], "after": [paths], "peak_reserved_saved_bytes",
         "ranks": [{"rank", "before_path", "after_path", "before_peak_reserved_bytes",
                    "after_peak_reserved_bytes", "peak_reserved_saved_bytes", "before_peak_allocated_bytes",
                    "after_peak_allocated_bytes", "peak_allocated_saved_bytes", "before_oom", "after_oom",
                    "before_anatomy", "after_anatomy",
                    "sites": [{"label", "before_bytes", "after_bytes", "saved_bytes", "delta_bytes", ...}]}],
         "findings": [{"id", "status": "resolved"|"new"|"changed"|"unchanged", "title", "before_bytes",
                       "after_bytes", "before_ranks", "after_ranks", "peak_reserved_saved_bytes", "same_bytes_as"}],
         "notes": [...]}

    Saved bytes are before minus after (negative: the after run needs more); ``delta_bytes``, after minus before,
    stays for readers of schema 1.3.
    """
    ranks = []
    for r in diff.ranks:
        d = asdict(r)
        d["peak_reserved_saved_bytes"] = r.peak_reserved_saved_bytes
        d["peak_allocated_saved_bytes"] = r.peak_allocated_saved_bytes
        d["before_anatomy"] = anatomy_dict(r.before_anatomy)
        d["after_anatomy"] = anatomy_dict(r.after_anatomy)
        for s, sd in zip(r.sites, d["sites"]):
            sd["saved_bytes"] = s.saved_bytes
            sd["delta_bytes"] = s.delta_bytes
        ranks.append(d)
    return {"schema_version": SCHEMA_VERSION, "oomdoctor_version": __version__, "before": diff.before_inputs,
            "after": diff.after_inputs,
            "peak_reserved_saved_bytes": diff.peak_reserved_saved_bytes, "ranks": ranks,
            "findings": [{**asdict(f), "title": resolve_title(f.title)} for f in diff.findings], "notes": diff.notes}


def render_diff_json(diff: Diff) -> str:
    return json.dumps(diff_dict(diff), indent=2, default=json_default) + "\n"
