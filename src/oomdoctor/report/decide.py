"""Stage 3 of :mod:`.pipeline`, the decisions: materiality ranks the findings, then each rank's facts (stage 1's
analysis read by :func:`.build.rank_facts`) get their verdict (:func:`.verdict.rank_verdict`) and what fits, then the
job's verdict (the worst rank's, with the tightest rank's fit) and the groups of alike ranks: a :class:`.model.Report`.
"""

from __future__ import annotations

from .._version import __version__
from ..analysis.device import DeviceAnalysis
from ..detectors import materiality
from ..detectors.finding import Finding
from .build import rank_facts
from .groups import with_groups
from .model import RankSummary, Report
from .predict import Predictor, replay_failure
from .rank_predictions import RankPredictions
from .verdict import job_verdict, rank_verdict, state_verdict, with_findings, with_tightest_rank

NO_HISTORY = ("Some snapshots hold no allocation history (recorded with enabled='state'): peaks are the final state "
              "only; record with torch.cuda.memory._record_memory_history(max_entries=100000).")


def decide(analyses: list[DeviceAnalysis], findings: list[Finding], predictors: dict[int, Predictor | None], *,
           micro_batch: int | None, rule: materiality.Materiality) -> Report:
    """The report of ``analyses`` (one per rank) and their ``findings`` (stage 2's, with the replays' ``predictors``
    by rank): the findings ranked by materiality (:func:`oomdoctor.detectors.materiality.apply`), then per rank its
    facts, its verdict (:func:`.verdict.rank_verdict`, or the final state's without history) and the fits the
    verdict asked for (with a micro-batch known, what fits is sized, except for growth, where the micro-batch is not
    the cause; a replay asked for that failed says why in the rank's warnings), then the job's verdict and groups."""
    findings = materiality.apply(findings, {a.rank: a.peak_reserved[0] for a in analyses}, rule)
    ranks: list[RankSummary] = []
    for a in analyses:
        r, pred = rank_facts(a), RankPredictions(a, predictors, micro_batch)
        if r.breakdown is not None:
            r.verdict = rank_verdict(a, findings, pred.room, r.breakdown, r.holders, pred.fits, pred.defragmented)
        else:
            r.verdict = with_findings(state_verdict(a, pred.room), findings)
        if pred.micro_batch and a.num_events and r.verdict.kind != "growth":
            pred.fits()
        r.fits = pred.fits_made()
        if a.rank in predictors and predictors[a.rank] is None:  # a replay was asked for and failed: say why
            why = replay_failure(a, **pred.inputs)
            if why:
                r.warnings.append(f"no prediction or fix is replayed for this rank: {why}")
        ranks.append(r)
    verdicts = [r.verdict for r in ranks if r.verdict is not None]
    verdict = with_tightest_rank(job_verdict(verdicts, {a.rank for a in analyses if a.oom_events.size}),
                                 {r.rank: r.fits for r in ranks})
    return with_groups(Report(ranks=ranks, findings=findings, inputs=[a.trace.path for a in analyses],
                              oomdoctor_version=__version__,
                              notes=[NO_HISTORY] if any(not a.trace.has_history for a in analyses) else [],
                              verdict=verdict, materiality={"fraction": rule.fraction, "min_bytes": rule.min_bytes}))
