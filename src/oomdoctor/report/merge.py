"""One report for a whole job from the reports each rank built of its own snapshot (in-job summary).

Every detector except ``rank-imbalance`` looks at one rank at a time, so a rank's own report holds
its findings; they are merged across ranks the way ``diagnose`` merges them
(:func:`~oomdoctor.detectors.registry.merge_findings`). ``rank-imbalance`` compares ranks: it runs
here on the gathered :class:`~oomdoctor.analysis.ranks.RankProfile`\\ s. The result has the same
shape as a report built from all the snapshots in one process.
"""

from __future__ import annotations

from typing import Sequence

from ..analysis.ranks import RankProfile
from ..detectors import rank_imbalance
from ..detectors.context import applies, version_from_text
from ..detectors.materiality import Materiality, apply
from ..detectors.registry import merge_findings
from ..units import span
from .groups import with_groups
from .model import Report
from .verdict import job_verdict, oom_with_findings, with_findings


def merge_reports(reports: list[Report], profiles: list[RankProfile], *, missing_ranks: Sequence[int] = (),
                  world_size: int | None = None, waited_s: float | None = None, in_job: bool = True) -> Report:
    """Merge per-rank reports (any order) into one, sorted by rank.

    Args:
        reports: one report per rank that answered, each of one rank.
        profiles: the same ranks' profiles (for ``rank-imbalance``).
        missing_ranks: ranks that sent nothing (died, or slower than the wait); named in the notes.
        world_size: the job's size, recorded in ``extra``.
        waited_s: how long rank 0 waited for the others (seconds).
        in_job: the in-job summary (``extra`` says so); False for the ranks of a job read from files
            (:mod:`oomdoctor.report.job`).
    """
    ranks = sorted((r for rep in reports for r in rep.ranks), key=lambda r: r.rank)
    rule = Materiality(**reports[0].materiality) if reports and reports[0].materiality else Materiality()
    versions = {r.rank: version_from_text(r.torch_version) for r in ranks}
    cross = rank_imbalance.detect_profiles(sorted(profiles, key=lambda p: p.rank))
    for f in cross:  # as report_of fills Fix.applies from the version of the finding's rank
        v = next((versions[r] for r in f.ranks if r in versions), None)
        for fx in f.fixes:
            if fx.applies is None and v is not None:
                fx.applies = applies(fx.versions, v)
    findings = apply(merge_findings([f for rep in reports for f in rep.findings] + cross),
                     {p.rank: p.peak_reserved_bytes for p in profiles}, rule)
    notes: list[str] = []
    for rep in reports:
        notes.extend(n for n in rep.notes if n not in notes)
    if missing_ranks:
        wait = f" within {waited_s:.0f} s" if waited_s is not None else ""
        notes.append(f"No result from rank{'s' if len(missing_ranks) > 1 else ''} {span(sorted(missing_ranks))}{wait} "
                     "(the process died or was still "
                     "busy): this summary covers the other ranks only.")
    version = reports[0].oomdoctor_version if reports else ""
    extra = {"in_job_summary": True, "world_size": world_size, "missing_ranks": sorted(missing_ranks)} if in_job else {}
    oom_ranks = {r.rank for r in ranks if r.oom is not None}
    for r in ranks:  # the cross-rank findings were not there when each rank judged itself
        if r.verdict is not None:
            r.verdict = oom_with_findings(r.verdict, findings) if r.oom is not None else with_findings(r.verdict,
                                                                                                      findings)
    return with_groups(Report(ranks=ranks, findings=findings, inputs=[p for rep in reports for p in rep.inputs],
                              oomdoctor_version=version, notes=notes, extra=extra,
                              verdict=job_verdict([r.verdict for r in ranks if r.verdict is not None], oom_ranks),
                              materiality=reports[0].materiality if reports else {}))
