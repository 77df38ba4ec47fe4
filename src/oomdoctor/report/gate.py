"""The CI gate of ``diagnose`` and ``report`` (``--fail-on LEVEL``): does the report fail the job?

``LEVEL`` is a severity (``low`` < ``medium`` < ``high`` < ``critical``: a finding at or above it fails) or
``unhealthy`` (any verdict but ``healthy`` fails: an OOM of any cause, or growth, deferred frees or an imbalance
that decides a rank's verdict without one). Severities are the ones the report shows, after the materiality
rule (:mod:`oomdoctor.detectors.materiality`).
"""

from __future__ import annotations

from .model import Report

SEVERITY_ORDER = ("low", "medium", "high", "critical")
LEVELS = SEVERITY_ORDER + ("unhealthy",)


def gate(report: Report, level: str) -> str | None:
    """Why ``report`` fails at ``level`` (one line), or None when it passes.

    Raises:
        ValueError: ``level`` is not one of :data:`LEVELS`.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown --fail-on level {level!r}: one of {', '.join(LEVELS)}")
    if level == "unhealthy":
        v = report.verdict
        if v is None or v.kind == "healthy":
            return None
        return f"the verdict is {v.kind} (rank{'s' if len(v.ranks) > 1 else ''} {', '.join(str(r) for r in v.ranks)})"
    floor = SEVERITY_ORDER.index(level)
    hit = [f for f in report.findings if f.severity in SEVERITY_ORDER and SEVERITY_ORDER.index(f.severity) >= floor]
    if not hit:
        return None
    listed = ", ".join(f"{f.id} {f.severity.upper()}" for f in hit[:4]) + (", ..." if len(hit) > 4 else "")
    return f"{len(hit)} finding{'s' if len(hit) > 1 else ''} at or above {level}: {listed}"
