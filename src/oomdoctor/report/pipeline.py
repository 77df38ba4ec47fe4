"""The one path a rank takes: load → analysis → predictions → decisions, each stage a function that calls only the
stages below it (and the layers below ``report``), never one above.

::

    summarize_rank(trace, context) -> RankOutcome           (pure: a trace in, the rank's summary out)
      1. analysis     analyse(trace)               DeviceAnalysis      (oomdoctor.analysis.device.analyze)
                      rank_facts(a)                RankSummary's facts (.build: peaks, breakdowns, holders, notes)
      2. predictions  predict(analyses)            Findings with their fixes' replayed predictions and applicable
                                                   versions (detectors, .predict); RankPredictions: what fits and
                                                   the defragmented replay, computed when a decision asks (replays
                                                   cost time)
      3. decisions    decide(analyses, findings)   materiality (ranks the findings), each rank's verdict and fits,
                                                   the job's verdict, the groups of alike ranks: a Report
    merge (.job, .merge)                           the ranks' outcomes into the job's Report, on every executor

:func:`report_of` runs stages 2 and 3 on the analyses of several ranks at once (the library's ``build_report``, the
notebook's ``diagnose``); the CLI runs :func:`summarize_rank` per rank (:mod:`.job`) and merges. Loading a file
(the ``load`` stage) is :func:`oomdoctor.trace.load.load`, done by the caller: :mod:`.job` turns a file's problem into
its result rather than an exception.

The order within stage 2 and 3 matters and is fixed here: detectors, then the simulator's predictions for their
fixes, then version applicability, then materiality (which ranks them), then per rank the breakdown, holders and fits,
then the verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._version import __version__
from ..analysis.device import DeviceAnalysis, analyze
from ..analysis.ranks import RankProfile
from ..detectors import materiality, rank_imbalance
from ..detectors.context import Context, applies, torch_version
from ..detectors.finding import Finding
from ..detectors.fragmentation import split_mb
from ..detectors.registry import run_all
from ..trace.model import Trace
from .build import breakdowns, holder_refs, summarize
from .fits import Fits, Room, device_room, fits
from .groups import with_groups
from .margin import margin_inputs
from .model import RankSummary, Report
from .predict import Prediction, Predictor, attach_predictions, predictor, replay_failure
from .verdict import job_verdict, rank_verdict, state_verdict, with_findings, with_tightest_rank

NO_HISTORY = ("Some snapshots hold no allocation history (recorded with enabled='state'): peaks are the final state "
              "only; record with torch.cuda.memory._record_memory_history(max_entries=100000).")


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


# -- 1. analysis ---------------------------------------------------------------------------------------------------

def analyse(trace: Trace) -> DeviceAnalysis:
    """Stage 1: the analysis of the trace's primary device (:func:`oomdoctor.analysis.device.analyze`)."""
    return analyze(trace)


def rank_facts(a: DeviceAnalysis) -> RankSummary:
    """Stage 1: the rank's facts (peaks, series, OOM, sites, notes), its breakdowns (at the OOM or the peak, and the
    others that matter) and the holders at the main one; verdict and fits are left for stage 3."""
    r = summarize(a)
    r.breakdown, r.breakdowns = breakdowns(a)
    if r.breakdown is not None:
        r.holders = holder_refs(a, r.breakdown.event_index)
    return r


# -- 2. predictions ------------------------------------------------------------------------------------------------

def predict(analyses: list[DeviceAnalysis], predictors: dict[int, Predictor | None]) -> list[Finding]:
    """Stage 2: the detectors' findings (:func:`oomdoctor.detectors.registry.run_all`), each fix with the replay's
    prediction (:func:`.predict.attach_predictions`, the predictors made kept in ``predictors`` by rank) and whether
    it applies to the rank's PyTorch version. Not yet ranked by materiality (stage 3)."""
    findings = run_all(Context(analyses))
    attach_predictions(findings, analyses, predictors)
    _versions(findings, analyses)
    return findings


def defragmenting_setting(a: DeviceAnalysis) -> str:
    """The allocator setting that undoes fragmentation at ``a``'s OOM: ``expandable_segments:True``, or, where
    segments are expandable already, ``max_split_size_mb`` at half the failed request (as the fragmentation
    detector proposes it)."""
    return defragmenting_settings(a)[0]


def defragmenting_settings(a: DeviceAnalysis) -> list[str]:
    """The free allocator settings the verdict tries at ``a``'s OOM, in order, the first that gets the replay
    through the recorded steps with margin deciding (issue 49: "an allocator setting"): the
    fragmentation fix (:func:`defragmenting_setting`'s rule), ``max_split_size_mb`` at half the failed request, and,
    under a memory-fraction cap (the collector runs only there), ``garbage_collection_threshold:0.8``: the settings
    the fragmentation detector proposes (``detectors/fragmentation.py``)."""
    request = int(a.device.events["size"][int(a.oom_events[-1])]) if a.oom_events.size else 0
    split = f"max_split_size_mb:{split_mb(request)}"
    expandable = (a.trace.allocator_settings.get("expandable_segments")
                  or any(s.is_expandable for s in a.device.segments))
    out = [split] if expandable else ["expandable_segments:True", split]
    meta = a.trace.meta
    capped = meta.get("memory_cap_bytes") is not None or (
        isinstance(meta.get("memory_fraction"), (int, float)) and meta["memory_fraction"] < 1)
    if not capped and a.oom_events.size:
        from ..simulate.capacity import infer_capacity

        capped = infer_capacity(a.trace, a.device).kind == "fraction"
    if capped:
        out.append("garbage_collection_threshold:0.8")
    return out


def _versions(findings: list[Finding], analyses: list[DeviceAnalysis]) -> None:
    """Fill ``Fix.applies`` where the detector left it open, from the version of the finding's ranks."""
    by_rank = {a.rank: a for a in analyses}
    for f in findings:
        a = next((by_rank[r] for r in f.ranks if r in by_rank), None)
        if a is None:
            continue
        v = torch_version(a)
        for fx in f.fixes:
            if fx.applies is None:
                fx.applies = applies(fx.versions, v)


def _recorded_micro_batch(a: DeviceAnalysis) -> int | None:
    """The sidecar's ``micro_batch`` (an integer, checked at load), when positive."""
    mb = a.trace.meta.get("micro_batch")
    return mb if isinstance(mb, int) and mb > 0 else None


class RankPredictions:
    """Stage 2, per rank, made when a decision asks: what fits in the device's room (:func:`.fits.fits`, replayed
    once) and the trace replayed with the fragmentation fix (:func:`defragmenting_setting`)."""

    def __init__(self, a: DeviceAnalysis, predictors: dict[int, Predictor | None], micro_batch: int | None):
        self.a, self.predictors = a, predictors
        #: what the sidecar says that the margins need (the process's memory outside the allocator, the job's own
        #: peak reserved): passed to every replay's margin (issue 49)
        self.inputs = margin_inputs(a)
        self.room: Room = device_room(a, outside_bytes=self.inputs["outside_bytes"])
        self.micro_batch = micro_batch or _recorded_micro_batch(a)
        self._fits: Fits | None = None

    def fits(self) -> Fits:
        """What fits (replays at most once)."""
        if self._fits is None:
            self._fits = fits(self.a, self.room, self.micro_batch, **self.inputs)
        return self._fits

    def defragmented(self) -> Prediction | None:
        """The replay under the first of :func:`defragmenting_settings` that gets through the recorded steps with
        margin (no OOM, not at the edge), else under the first of them; None when the trace cannot be replayed
        faithfully."""
        a = self.a
        if a.rank not in self.predictors:
            self.predictors[a.rank] = predictor(a, **self.inputs)
        p = self.predictors[a.rank]
        if p is None or not p.reproduces:
            return None
        tried: list[Prediction] = []
        for setting in defragmenting_settings(a):
            got = p.run({"config": setting})
            if got.get("oom") is None and not got.get("at_edge"):
                return got
            tried.append(got)
        return tried[0]

    def fits_made(self) -> Fits:
        """What fits if a decision asked for it, else the room alone (nothing replayed)."""
        return self._fits if self._fits is not None else Fits(self.room.bytes, self.room.source,
                                                                      room_source_values=dict(self.room.values))


# -- 3. decisions --------------------------------------------------------------------------------------------------

def decide_rank(a: DeviceAnalysis, r: RankSummary, findings: list[Finding], pred: RankPredictions) -> RankSummary:
    """Stage 3, per rank: the verdict (:func:`.verdict.rank_verdict`, or the final state's without history) and the
    fits it asked for; with a micro-batch known, what fits is sized (except for growth, where the micro-batch is not
    the cause). Fills and returns ``r``."""
    if r.breakdown is not None:
        r.verdict = rank_verdict(a, findings, pred.room, r.breakdown, r.holders, pred.fits, pred.defragmented)
    else:
        r.verdict = with_findings(state_verdict(a, pred.room), findings)
    if pred.micro_batch and a.num_events and r.verdict.kind != "growth":
        pred.fits()
    r.fits = pred.fits_made()
    if a.rank in pred.predictors and pred.predictors[a.rank] is None:  # a replay was asked for and failed: say why
        why = replay_failure(a, **pred.inputs)
        if why:
            r.warnings.append(f"no prediction or fix is replayed for this rank: {why}")
    return r


def decide(analyses: list[DeviceAnalysis], findings: list[Finding], predictors: dict[int, Predictor | None], *,
           micro_batch: int | None, rule: materiality.Materiality) -> Report:
    """Stage 3: materiality ranks the findings, then each rank's facts (stage 1) get their verdict and fits, then the
    job's verdict (the worst rank's, with the tightest rank's fit) and the groups of alike ranks."""
    findings = materiality.apply(findings, {a.rank: a.peak_reserved[0] for a in analyses}, rule)
    notes = [NO_HISTORY] if any(not a.trace.has_history for a in analyses) else []
    ranks = [decide_rank(a, rank_facts(a), findings, RankPredictions(a, predictors, micro_batch)) for a in analyses]
    oom_ranks = {a.rank for a in analyses if a.oom_events.size}
    return with_groups(Report(ranks=ranks, findings=findings, inputs=[a.trace.path for a in analyses],
                              oomdoctor_version=__version__, notes=notes,
                              verdict=with_tightest_rank(job_verdict([r.verdict for r in ranks if r.verdict is not None],
                                                                     oom_ranks), {r.rank: r.fits for r in ranks}),
                              materiality={"fraction": rule.fraction, "min_bytes": rule.min_bytes}))


# -- the path ------------------------------------------------------------------------------------------------------

def report_of(analyses: list[DeviceAnalysis], *, micro_batch: int | None = None,
              rule: materiality.Materiality = materiality.Materiality()) -> Report:
    """The report of analyses already made (one per rank): stage 2 then stage 3. ``micro_batch``: the per-device
    micro-batch of the recorded run, to say the largest that fits (default: the sidecar's ``micro_batch``, which
    the framework callbacks write); ``rule``: the materiality rule."""
    predictors: dict[int, Predictor | None] = {}
    findings = predict(analyses, predictors)
    return decide(analyses, findings, predictors, micro_batch=micro_batch, rule=rule)


def summarize_analysis(a: DeviceAnalysis, context: RankContext = RankContext()) -> RankOutcome:
    """:func:`summarize_rank` from stage 1's analysis (callers that also draw views of it)."""
    return RankOutcome(a.rank, report_of([a], micro_batch=context.micro_batch, rule=context.rule),
                       rank_imbalance.profile(a))


def summarize_rank(trace: Trace, context: RankContext = RankContext()) -> RankOutcome:
    """One rank's trace to its summary: analysis → predictions → decisions. The same trace and context give the
    same outcome; the outcomes of a job's ranks merge with :func:`oomdoctor.report.job.job_report` /
    :func:`oomdoctor.report.merge.merge_reports`."""
    return summarize_analysis(analyse(trace), context)


def build_report(traces: list[Trace], *, micro_batch: int | None = None,
                 rule: materiality.Materiality = materiality.Materiality()) -> Report:
    """Analyse every trace (its primary device), run the detectors, and assemble the report (the ranks judged
    together: :func:`report_of`)."""
    return report_of([analyse(t) for t in traces], micro_batch=micro_batch, rule=rule)
