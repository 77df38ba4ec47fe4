"""The CI gate of ``diagnose`` and ``report`` (``--fail-on LEVEL``, repeatable): does the report fail the job?

A ``LEVEL`` is a severity (``low`` < ``medium`` < ``high`` < ``critical``: a finding at or above it fails) or
``unhealthy`` (any verdict but ``healthy`` fails: an OOM of any cause, or growth, deferred frees or an imbalance
that decides a rank's verdict without one). Severities are the ones the report shows, after the materiality
rule (:mod:`oomdoctor.detectors.materiality`). Several levels fail when any of them does: ``--fail-on unhealthy
--fail-on high`` fails on a verdict that is not healthy and on a HIGH finding under a healthy one.

Whatever the levels, a report whose ranks were not all read fails: a file that claims a rank and could not be read
(cut off, corrupt, or a pickle that would run code: :attr:`~oomdoctor.report.model.Report.unread`) leaves the
verdict about the other ranks only, and the rank that crashed is the one most likely to leave a cut-off dump.

The severity question (issue 52): a finding at HIGH or above under a ``healthy`` verdict (the last pipeline stage
caching every micro-batch's outputs, in a job that ran) passes ``unhealthy``, which is about the verdict only. The
gate says so: :attr:`Gate.passed_findings` lists such findings when ``unhealthy`` passes without a severity level,
and the CLI names them and the level that fails on them. The decision is data (ids, severities, ranks); its words
are in :mod:`oomdoctor.render.words.gate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .model import Report, Unread

SEVERITY_ORDER = ("low", "medium", "high", "critical")
LEVELS = SEVERITY_ORDER + ("unhealthy",)
NOTED_SEVERITY = "high"
"""Findings at or above this severity are named when ``unhealthy`` passes them (:attr:`Gate.passed_findings`)."""


@dataclass(frozen=True)
class Gate:
    """The gate's decision on one report at ``levels``.

    Attributes:
        levels: the levels asked, in order.
        unread: the rank files that could not be read (any of them fails the gate).
        ranks_read: the ranks the report covers.
        verdict: ``(kind, ranks)`` of a verdict that fails ``unhealthy``; None when it passes or was not asked.
        findings: ``(id, severity)`` of the findings at or above the lowest severity level asked, most severe first.
        floor: that lowest severity level (None: no severity level asked).
        passed_findings: ``(id, severity)`` of findings at or above :data:`NOTED_SEVERITY` that passed because only
            ``unhealthy`` was asked and the verdict is healthy: what ``--fail-on high`` would fail on.
    """

    levels: tuple[str, ...]
    unread: list[Unread] = field(default_factory=list[Unread])
    ranks_read: list[int] = field(default_factory=list[int])
    verdict: tuple[str, list[int]] | None = None
    findings: list[tuple[str, str]] = field(default_factory=list[tuple[str, str]])
    floor: str | None = None
    passed_findings: list[tuple[str, str]] = field(default_factory=list[tuple[str, str]])

    @property
    def failed(self) -> bool:
        return bool(self.unread or self.verdict or self.findings)


def _at_or_above(report: Report, level: str) -> list[tuple[str, str]]:
    floor = SEVERITY_ORDER.index(level)
    return [(f.id, f.severity) for f in report.findings
            if f.severity in SEVERITY_ORDER and SEVERITY_ORDER.index(f.severity) >= floor]


def gate(report: Report, levels: str | tuple[str, ...] | list[str]) -> Gate:
    """The gate's decision on ``report`` at ``levels`` (one level, or several: it fails when any does).

    Raises:
        ValueError: a level is not one of :data:`LEVELS`, or none is given.
    """
    levels = (levels,) if isinstance(levels, str) else tuple(levels)
    if not levels:
        raise ValueError(f"no --fail-on level: one of {', '.join(LEVELS)}")
    for level in levels:
        if level not in LEVELS:
            raise ValueError(f"unknown --fail-on level {level!r}: one of {', '.join(LEVELS)}")
    verdict = None
    if "unhealthy" in levels:
        v = report.verdict
        if v is not None and v.kind != "healthy":
            verdict = (v.kind, list(v.ranks))
    severities = [lvl for lvl in levels if lvl in SEVERITY_ORDER]
    floor = min(severities, key=SEVERITY_ORDER.index) if severities else None
    findings = _at_or_above(report, floor) if floor else []
    passed = _at_or_above(report, NOTED_SEVERITY) if floor is None and verdict is None else []
    return Gate(levels, list(report.unread), [r.rank for r in report.ranks], verdict, findings, floor, passed)
