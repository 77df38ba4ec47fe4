"""The words of a job's inputs and of its CI gate: how many ranks were read, the files that were skipped or could
not be read, and why ``--fail-on`` fails or passes (:class:`oomdoctor.report.gate.Gate`). The decisions are made in
``report/gate.py`` and ``report/job.py``; every sentence is here."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterable

from ..format import count, format_bytes, span

if TYPE_CHECKING:
    from ...report.gate import Gate
    from ...report.model import Report, Unread
    from ...trace.load import Skipped


def ranks_read(read: list[int], unread: list[Unread]) -> str:
    """``2 ranks read``; with rank files that could not be read, ``1 of 2 ranks read`` (of the ranks read and those
    the unread files claim); where every rank an unread file claims was read from another file, ``2 ranks read, 1
    rank file not``."""
    if not unread:
        return f"{count(len(read), 'rank')} read"
    claimed = set(read) | {u.rank for u in unread}
    if len(claimed) == len(read):
        return f"{count(len(read), 'rank')} read, {count(len(unread), 'rank file')} not"
    return f"{len(read)} of {len(claimed)} ranks read"


def unread_one(u: Unread) -> str:
    """``rank0.pickle (rank 0): is not a valid pickle (...)``."""
    return f"{os.path.basename(u.path)} (rank {u.rank}): {u.reason}"


def unread_line(unread: list[Unread]) -> str:
    """One line naming the rank files that could not be read, and what that does to the report."""
    ranks = span(sorted({u.rank for u in unread}))
    return (f"rank{'s' if len(unread) > 1 else ''} {ranks} could not be read, so this report covers the other ranks "
            f"only: " + "; ".join(unread_one(u) for u in unread))


def skipped_line(skipped: Iterable[Skipped], most: int = 6) -> str:
    """``skipped 3 files (not snapshots, or unreadable): metrics.json (why); train.log; ckpt (a directory)``: the files
    of a directory that claim no rank and were not read."""
    skipped = list(skipped)

    def one(s: Skipped) -> str:
        return os.path.basename(s.path) + (f" ({s.reason})" if s.reason else "")

    shown = "; ".join(one(s) for s in skipped[:most])
    more = f"; and {len(skipped) - most} more" if len(skipped) > most else ""
    return f"skipped {count(len(skipped), 'file')} (not snapshots, or unreadable): {shown}{more}"


def why_failed(g: Gate) -> str:
    """Why the gate fails, one line (``g.failed``)."""
    parts = []
    if g.unread:
        parts.append(f"{ranks_read(g.ranks_read, g.unread)}: " + "; ".join(unread_one(u) for u in g.unread))
    if g.verdict is not None:
        kind, ranks = g.verdict
        parts.append(f"the verdict is {kind} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})")
    if g.findings:
        listed = ", ".join(f"{i} {sev.upper()}" for i, sev in g.findings[:4]) + (", ..." if len(g.findings) > 4 else "")
        parts.append(f"{count(len(g.findings), 'finding')} at or above {g.floor}: {listed}")
    return "; ".join(parts)


def passed_note(g: Gate) -> str | None:
    """Where ``unhealthy`` passes a finding at HIGH or above (the verdict is healthy): which, and the level that
    fails on it; None otherwise."""
    if g.failed or not g.passed_findings:
        return None
    listed = ", ".join(f"{i} {sev.upper()}" for i, sev in g.passed_findings[:4])
    high = "high" if all(sev != "critical" for _i, sev in g.passed_findings) else "critical"
    return (f"passes: the verdict is healthy, and {count(len(g.passed_findings), 'finding')} ({listed}) "
            f"decide{'s' if len(g.passed_findings) == 1 else ''} no verdict; --fail-on {high} (or both levels) fails "
            "on findings")


def headline_findings(report: Report) -> str | None:
    """Under a healthy verdict, the findings at HIGH or above that decide no verdict, by id (``1 HIGH finding:
    pipeline-output-cache``), so the first line does not read as all clear; None otherwise (a new user missed one
    80 lines down)."""
    v = report.verdict
    if v is None or v.kind != "healthy":
        return None
    ids = list(dict.fromkeys(f.id for f in report.findings if f.severity in ("high", "critical")))
    if not ids:
        return None
    n = sum(1 for f in report.findings if f.severity in ("high", "critical"))
    worst = "CRITICAL" if any(f.severity == "critical" for f in report.findings) else "HIGH"
    return f"{count(n, worst + ' finding')}: {', '.join(ids[:3])}{', ...' if len(ids) > 3 else ''}"


def headline_ranks(report: Report) -> str:
    """The headline's count of ranks: :func:`ranks_read` of ``report``."""
    return ranks_read([r.rank for r in report.ranks], report.unread)


def preflight_oom(a: Any) -> str:
    """Why ``preflight --fail-on-oom`` fails (``a``: a :class:`oomdoctor.report.preflight.PreflightAnswer` whose
    replay ran out of memory): the request that did not fit and the room, on the GPU named."""
    gpu = a.gpu_name or "the GPU"
    req = f"a request of {format_bytes(a.oom_request_bytes)}" if a.oom_request_bytes else "a request"
    return (f"the traced job runs out of memory on {gpu}: {req} did not fit in the allocator's room of "
            f"{format_bytes(a.room_bytes)}")
