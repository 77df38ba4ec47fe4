"""The one path a rank takes: load → analysis → predictions → decisions, each stage a function of its own module,
called once, in order, by the functions here, which call nothing of their own in between.

::

    summarize_rank(trace, context) -> RankOutcome           (pure: a trace in, the rank's summary out)
      1. analysis     analyze(trace)               DeviceAnalysis      (oomdoctor.analysis.device: lifetimes,
                                                   timeline, phases, accounting, peaks; all made here)
      2. predictions  detect(analyses)             Findings with their fixes' replayed predictions and applicable
                                                   versions (.detect: the detectors, .predict);
                                                   .rank_predictions.RankPredictions: what fits and the defragmented
                                                   replay, made when a decision asks (replays cost time)
      3. decisions    decide(analyses, findings)   materiality (ranks the findings), each rank's facts (.build),
                                                   verdict and fits, the job's verdict, the groups of alike ranks: a
                                                   Report (.decide)
    merge (.job, .merge)                           the ranks' outcomes into the job's Report, on every executor

:func:`report_of` runs stages 2 and 3 on the analyses of several ranks at once (the library's ``build_report``, the
notebook's ``diagnose``); the CLI runs :func:`summarize_rank` per rank (:mod:`.job`) and merges. Loading a file
(the ``load`` stage) is :func:`oomdoctor.trace.load.load`, done by the caller: :mod:`.job` turns a file's problem into
its result rather than an exception.

The order within stage 2 and 3 matters and is fixed in their modules: detectors, then the simulator's predictions for
their fixes, then version applicability, then materiality (which ranks them), then per rank the breakdown, holders and
fits, then the verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..analysis.device import DeviceAnalysis, analyze
from ..analysis.ranks import RankProfile
from ..detectors import materiality, rank_imbalance
from ..trace.model import Trace
from .decide import decide
from .detect import detect
from .model import Report
from .predict import Predictor


@dataclass(frozen=True)
class RankContext:
    """What a rank's summary depends on besides its trace.

    Attributes:
        micro_batch: the per-device micro-batch of the recorded run (samples), to say the largest that fits
            (default: the sidecar's ``micro_batch``, which the framework callbacks write).
        rule: the materiality rule.
    """

    micro_batch: int | None = None
    rule: materiality.Materiality = field(default_factory=materiality.Materiality)


@dataclass
class RankOutcome:
    """One rank's summary, all a merge needs: its report (one :class:`~oomdoctor.report.model.RankSummary`, its
    findings, verdict and fits) and its :class:`~oomdoctor.analysis.ranks.RankProfile` (for ``rank-imbalance``,
    which compares ranks)."""

    rank: int
    report: Report
    profile: RankProfile


# -- the path ------------------------------------------------------------------------------------------------------

def report_of(analyses: list[DeviceAnalysis], *, micro_batch: int | None = None,
              rule: materiality.Materiality = materiality.Materiality()) -> Report:
    """The report of analyses already made (one per rank): stage 2 then stage 3. ``micro_batch``: the per-device
    micro-batch of the recorded run, to say the largest that fits (default: the sidecar's ``micro_batch``, which
    the framework callbacks write); ``rule``: the materiality rule."""
    predictors: dict[int, Predictor | None] = {}
    return decide(analyses, detect(analyses, predictors), predictors, micro_batch=micro_batch, rule=rule)


def summarize_analysis(a: DeviceAnalysis, context: RankContext = RankContext()) -> RankOutcome:
    """:func:`summarize_rank` from stage 1's analysis (callers that also draw views of it): stages 2 and 3 on this
    rank alone (:func:`report_of`), and its profile for ``rank-imbalance``."""
    return RankOutcome(a.rank, report_of([a], micro_batch=context.micro_batch, rule=context.rule),
                       rank_imbalance.profile(a))


def summarize_rank(trace: Trace, context: RankContext = RankContext()) -> RankOutcome:
    """One rank's trace to its summary: analysis → predictions → decisions (:func:`summarize_analysis` on
    :func:`oomdoctor.analysis.device.analyze`). The same trace and context give the same outcome; the outcomes of a
    job's ranks merge with :func:`oomdoctor.report.job.job_report` / :func:`oomdoctor.report.merge.merge_reports`."""
    return summarize_analysis(analyze(trace), context)


def build_report(traces: list[Trace], *, micro_batch: int | None = None,
                 rule: materiality.Materiality = materiality.Materiality()) -> Report:
    """Analyse every trace (its primary device), run the detectors, and assemble the report (the ranks judged
    together: :func:`report_of`)."""
    return report_of([analyze(t) for t in traces], micro_batch=micro_batch, rule=rule)
