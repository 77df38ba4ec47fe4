"""Materiality: one rule deciding which findings deserve the user's attention.

Bytes at stake mean one thing in every finding: the memory its fix gives back at the moment that matters
(the peak, or the OOM), never more than the peak reserved of the ranks it concerns (capped here, the claim
kept in ``evidence.claimed_bytes``); a cost in time (cache flushes) is no bytes at stake. A finding whose
bytes at stake are under ``max(fraction x peak reserved, min_bytes)`` (the peak of the
ranks it concerns; defaults :data:`DEFAULT_FRACTION` = 1% and :data:`DEFAULT_MIN_BYTES` = 64 MiB,
``oomdoctor diagnose --material-fraction/--material-bytes``) is kept but shown as LOW. A finding whose
own simulation (``Finding.prediction``, the allocator model replaying its fix, :mod:`oomdoctor.report.predict`)
saves less than it claims claims only what the simulation saves: the bytes at stake become the
simulated saving of peak reserved (replays without an OOM, of a trace whose self-replay is exact).
Detectors report what they see; this rule, applied once to every finding before the findings are
ranked (:func:`apply`), decides what is material.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..units import MiB
from .finding import Finding

DEFAULT_FRACTION = 0.01
DEFAULT_MIN_BYTES = 64 * MiB
_RANK = {"critical": 0, "high": 1, "medium": 2, "low": 3, "info": 4}


@dataclass(frozen=True)
class Materiality:
    """The rule's parameters: a fraction of peak reserved and a floor in bytes."""

    fraction: float = DEFAULT_FRACTION
    min_bytes: int = DEFAULT_MIN_BYTES

    def threshold(self, peak_reserved_bytes: int) -> int:
        return int(max(self.fraction * peak_reserved_bytes, self.min_bytes))


def simulated_saving(f: Finding) -> int | None:
    """Peak reserved bytes the finding's own simulated fix saves, when the replay can say (no OOM on
    either side, exact self-replay); None otherwise."""
    p = f.prediction
    if not p or p.get("oom") is not None or p.get("recorded_oom_event_index") is not None:
        return None
    if not p.get("self_replay_exact"):
        return None
    return max(int(p["recorded_peak_reserved_bytes"]) - int(p["peak_reserved_bytes"]), 0)


def apply(findings: list[Finding], peak_reserved: dict[int, int], rule: Materiality = Materiality()) -> list[Finding]:
    """Apply the rule to ``findings`` (mutated) and return them ranked: severity, then bytes at stake.

    ``peak_reserved``: rank -> peak reserved bytes of that rank."""
    for f in findings:
        # bytes at stake are what the fix gives back at the peak or the OOM: never more than the rank had
        peaks = {r: peak_reserved[r] for r in f.ranks if r in peak_reserved}
        if peaks and f.bytes > max(peaks.values()):
            f.evidence = replace(f.evidence, claimed_bytes=f.bytes)
            f.bytes = max(peaks.values())
        f.per_rank_bytes = {r: min(b, peaks.get(r, b)) for r, b in f.per_rank_bytes.items()}
        saved = simulated_saving(f)
        if saved is not None and saved < f.bytes:
            f.evidence = replace(f.evidence, claimed_bytes=f.bytes, simulated_saving_bytes=saved)
            f.bytes = saved
            f.per_rank_bytes = {r: min(b, saved) for r, b in f.per_rank_bytes.items()}
        peak = max((peak_reserved.get(r, 0) for r in f.ranks), default=0)
        limit = rule.threshold(peak)
        if f.bytes < limit and _RANK.get(f.severity, 4) < _RANK["low"]:
            f.evidence = replace(f.evidence, materiality_threshold_bytes=limit, severity_before_materiality=f.severity)
            f.severity = "low"
    ranked = sorted(findings, key=rank_key)
    link_related(ranked)
    return ranked


def link_related(findings: list[Finding]) -> None:
    """Fill each finding's ``related`` (mutated): the ids, in rank order, of the other findings that share a rank and
    an allocation site (``SiteRef.label``) with it, so one bug seen by several detectors reads as one."""
    for f in findings:
        labels = {s.label for s in f.sites}
        f.related = list(dict.fromkeys(
            g.id for g in findings
            if g is not f and g.id != f.id and set(g.ranks) & set(f.ranks) and labels & {s.label for s in g.sites}))


def rank_key(f: Finding) -> tuple[int, int]:
    """The order findings are shown in: severity, then bytes at stake, largest first."""
    return _RANK.get(f.severity, 4), -f.bytes
