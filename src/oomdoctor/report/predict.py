"""Predictions for fixes: replay the trace with the fix applied (:mod:`..simulate`), and say how far the
replay reaches.

Only fixes whose detector says how to replay them (``Fix.what_if``) are simulated, on the rank with the
most bytes at stake, once per distinct experiment, so ``diagnose`` pays for a few replays of the
findings' own traces and nothing else. Each prediction is only as trustworthy as the self-replay of
the recorded settings, so that result travels with it (``self_replay_exact``), and as far as the events
replayed, which it says (``reach``, :data:`REACHES`):

- ``complete``: the recording has no OOM and was replayed to its end;
- ``recorded``: the recording ends at an OOM; only the recorded events were replayed (what comes after
  the OOM was never recorded, so "no OOM" then means only "gets past the recorded OOM");
- ``step-completed`` / ``step-ran-out``: the trace cut by its OOM was extended by the rest of its step
  as the previous step ran it (:mod:`..simulate.extend`), and that step completes, or runs out later.

Every prediction says two things, each with its own margin (:mod:`.margin`, issue 49):

- **the recorded steps**: the replay of the recorded events under the setting: no OOM (it gets past the recorded
  OOM and through every recorded step) or an OOM; its peak reserved (``peak_reserved_bytes``, what ``oomdoctor
  simulate`` prints for the same setting); where the room is known and the replay does not run out,
  ``spare_bytes`` (room - that peak) and ``at_edge`` (the spare room is inside ``margin_bytes``: the model's error
  on this trace plus the memory outside the allocator not already off the room; the claim may still run out and is
  never counted as a fix). This is what the verdict's cause rests on.
- **what the recorded steps do not cover** (``continuation``): the rest of a step cut by its OOM, replayed as the
  previous step ran it (``step-completed`` / ``step-ran-out``), or later steps and longer inputs (``later-steps``:
  not replayed). Always the condition that the claim holds for inputs up to the heaviest recorded step
  (``heaviest_step_peak_allocated_bytes``: the replay's peak allocated); a margin only where the job measured one
  (the spread of its reserved step peaks, :attr:`.margin.Margin.continuation_bytes`), with its own spare room and
  ``at_edge``. It never changes what the recorded steps say.

``outcome`` is the id of how the replay ended (:data:`OUTCOMES`); :mod:`oomdoctor.render.words.predict` says it.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, cast

from typing_extensions import (  # pydantic (the schema) reads typing_extensions' TypedDict
    NotRequired,
    TypedDict,
)

from ..analysis.device import DeviceAnalysis
from ..detectors.finding import Finding
from .fits import reproduces
from .margin import ContinuationParts, Margin, MarginParts, at_edge, margin, margin_inputs

# The replay (simulate/) is imported where a prediction is made: a report with nothing to predict does not
# pay for importing it (docs/benchmarks.md, start-up).
if TYPE_CHECKING:
    from ..simulate.config import AllocatorConfig
    from ..simulate.extend import Extension
    from ..simulate.replay import Prepared, ReplayResult

REACHES = ("complete", "recorded", "step-completed", "step-ran-out")


class PredictedOom(TypedDict):
    """the replay's OOM"""

    event_index: int
    """the event the replay ran out of memory at"""
    requested_bytes: int
    """the request that failed (bytes)"""


class PredictionExtension(TypedDict):
    """how the trace was extended"""

    previous_step_events: list[int]
    """[first, last] event of the previous step replayed again"""
    appended_events: int
    """events appended after the recording"""


CONTINUATIONS = ("later-steps", "step-completed", "step-ran-out")
"""What a prediction says of what the recorded steps do not cover (``continuation.outcome``): not replayed (a
condition: later steps, longer inputs), or the rest of the step cut by the OOM, replayed as the previous step ran
it, completes or runs out."""


class Continuation(TypedDict):
    """What the recorded steps do not cover: a second statement, with its own margin; it never changes the first."""

    outcome: str
    """'later-steps' (not replayed: a condition), 'step-completed' or 'step-ran-out' (the rest of the step cut by
    the OOM, replayed as the previous step ran it)"""
    heaviest_step_peak_allocated_bytes: int
    """the condition: the claim holds for steps whose tensors peak up to this, the heaviest recorded step's (the
    replay's peak allocated) (bytes)"""
    margin_bytes: int | None
    """the margin of what the recorded steps do not cover, where the job measured it: the spread of its reserved step
    peaks plus the job's peak reserved above the trace's; null: not measured (fewer than two complete steps), the
    condition alone (bytes)"""
    margin: ContinuationParts
    """its parts"""
    spare_bytes: NotRequired[int]
    """room left at the higher of the recorded events' peak and the extended step's (bytes)"""
    at_edge: NotRequired[bool | None]
    """spare_bytes is below margin_bytes; null where no margin was measured"""


class Prediction(TypedDict):
    """A fix's prediction as :meth:`Predictor.run` returns it and the JSON writes it (the renderer fills in
    ``outcome``). The docstring under each key is its description in the JSON schema (``oomdoctor schema
    diagnose``); the keys marked NotRequired are written only where the module doc says."""

    rank: int
    """the rank replayed"""
    config: str
    """the allocator setting replayed (PYTORCH_ALLOC_CONF text; '' for the defaults)"""
    deferred_frees: str
    """'recorded' (frees held for other streams as recorded) or 'immediate'"""
    recorded_deferred_frees: bool
    """the recording has frees deferred by record_stream: a 'recorded' replay holds each as long as this run did
    (another run's may wait longer or shorter)"""
    peak_reserved_bytes: int
    """the replay's peak reserved over the recorded events (bytes)"""
    peak_allocated_bytes: int
    """the replay's peak allocated over the recorded events (bytes)"""
    recorded_peak_reserved_bytes: int
    """the recording's peak reserved (bytes)"""
    oom: PredictedOom | None
    """the replay's OOM"""
    recorded_oom_event_index: int | None
    """the recording's OOM event"""
    capacity_bytes: int | None
    """the memory the replay may use, from the snapshot's OOM, sidecar or settings (bytes)"""
    capacity_kind: str
    """'device' (what the GPU had) or 'fraction' (set_per_process_memory_fraction)"""
    self_replay_exact: bool
    """the replay of the recorded settings reproduced the recording's segments"""
    margin_bytes: int
    """the margin of the claim about the recorded steps (report/margin.py): the model's error on this trace plus the
    memory outside the allocator not already off the room (bytes)"""
    margin: MarginParts
    """the margin's parts"""
    reach: str
    """how far the replay reaches: 'complete' (no OOM recorded, replayed to the end), 'recorded' (only the recorded
    events, cut by the OOM), 'step-completed' / 'step-ran-out' (extended by the rest of the step as the previous
    step ran it)"""
    outcome: str
    """the sentence a user reads, filled in"""
    continuation: Continuation
    """what the recorded steps do not cover: a second statement with its own margin"""
    spare_bytes: NotRequired[int]
    """capacity left at the recorded events' peak reserved (bytes)"""
    at_edge: NotRequired[bool]
    """spare_bytes is below margin_bytes: at the edge, the claim may still run out and is never counted as a fix"""
    extended_peak_reserved_bytes: NotRequired[int]
    """peak reserved of the replay extended by the rest of the step (bytes)"""
    extension: NotRequired[PredictionExtension]
    """how the trace was extended"""
    extended_oom_requested_bytes: NotRequired[int]
    """the request the extended replay ran out of memory on (bytes)"""


for _shape in (PredictedOom, PredictionExtension, Continuation, Prediction):
    _shape.__pydantic_config__ = {"use_attribute_docstrings": True}  # type: ignore[attr-defined]


def _on_top(base: AllocatorConfig, text: str) -> AllocatorConfig:
    """``base`` with the options ``text`` sets (the fix changes one setting, keeps the others)."""
    from ..simulate.config import DEFAULT, AllocatorConfig, parse_config

    parsed = parse_config(text)
    changes = {f.name: getattr(parsed, f.name) for f in fields(AllocatorConfig)
               if f.compare and getattr(parsed, f.name) != getattr(DEFAULT, f.name)}
    return replace(base, **changes)


class Predictor:
    """Replays of one rank's trace under other settings, with the reach of each (see the module doc).
    Raises :class:`SimulationError` when the trace cannot be replayed. ``outside_bytes`` and
    ``job_peak_reserved_bytes``: what a sidecar says of the memory outside the allocator and of the job's own
    peak reserved, for the margin (:func:`.margin.margin`)."""

    def __init__(self, analysis: DeviceAnalysis, *, outside_bytes: int | None = None,
                 job_peak_reserved_bytes: int | None = None) -> None:
        from ..simulate.capacity import infer_capacity
        from ..simulate.extend import extend_by_previous_step
        from ..simulate.replay import SimulationError, prepare, replay

        self.analysis = analysis
        self.prepared: Prepared = prepare(analysis.trace, analysis.device, analysis.lifetimes)
        if self.prepared.external or self.prepared.external_start:
            # simulate/pools.py: private pools are replayed as recorded; how they would grow or shrink under
            # other settings is not modelled, so no setting's effect is claimed
            raise SimulationError("CUDA graph private pools hold part of this run's memory; they are replayed as "
                                  "recorded, so the effect of other settings is not predicted")
        self.capacity = infer_capacity(analysis.trace, analysis.device)
        self.self_replay = replay(self.prepared, capacity=self.capacity)
        v = self.self_replay.validation
        self.margin: Margin = margin(analysis, model_error_bytes=v.max_reserved_difference_bytes if v else 0,
                                     outside_bytes=outside_bytes, job_peak_reserved_bytes=job_peak_reserved_bytes)
        self.extension: Extension | None = None
        self.extended: Prepared | None = None
        steps = analysis.steps
        if self.prepared.recorded_oom is not None and steps is not None:
            self.extension = extend_by_previous_step(analysis.device, steps.starts)
            if self.extension is not None:
                self.extended = prepare(analysis.trace, self.extension.device)
        self.cache: dict[tuple[AllocatorConfig, str], Prediction] = {}

    @property
    def reproduces(self) -> bool:
        """Does the replay of the recorded settings do what the recording did (the same OOM, or none, and
        the same segments or reserved bytes when there is none: :func:`.fits.reproduces`)? A prediction is
        only as good as that."""
        return reproduces(self.self_replay.validation, self.prepared.recorded_oom is not None)

    def _config(self, what_if: dict[str, str]) -> AllocatorConfig:
        config = self.prepared.recorded_config
        return _on_top(config, what_if["config"]) if what_if.get("config") else config

    def run(self, what_if: dict[str, str]) -> Prediction:
        """The prediction of ``what_if`` (``{"config": PYTORCH_ALLOC_CONF text, "deferred_frees": mode}``)."""
        config = self._config(what_if)
        from ..simulate.replay import RECORDED

        mode = what_if.get("deferred_frees", RECORDED)
        key = (config, mode)
        if key not in self.cache:
            self.cache[key] = self._predict(config, mode)
        return self.cache[key]

    def _predict(self, config: AllocatorConfig, mode: str) -> Prediction:
        from ..simulate.replay import replay

        r: ReplayResult = replay(self.prepared, config, deferred_frees=mode, capacity=self.capacity)
        peak, _ = self.analysis.peak_reserved
        recorded_oom = self.prepared.recorded_oom
        m = self.margin
        exact = self.self_replay.matches_recorded
        assert exact is not None  # the self-replay validates: the recorded settings and deferred frees
        # a Prediction once continuation, reach and outcome are set below (in the JSON's key order)
        out = cast(Prediction, {
            "rank": self.analysis.rank,
            "config": config.to_string(),
            "deferred_frees": mode,
            "recorded_deferred_frees": bool(self.analysis.lifetimes.deferred.any()),
            "peak_reserved_bytes": r.peak_reserved_bytes,
            "peak_allocated_bytes": r.peak_allocated_bytes,
            "recorded_peak_reserved_bytes": int(peak),
            "oom": None if r.oom is None else {"event_index": r.oom.event_index,
                                                 "requested_bytes": r.oom.requested_bytes},
            "recorded_oom_event_index": recorded_oom,
            "capacity_bytes": self.capacity.limit_bytes,
            "capacity_kind": self.capacity.kind,
            "self_replay_exact": exact,
            "margin_bytes": m.bytes,
            "margin": m.parts(),
        })
        limit = self.capacity.limit_bytes
        cont: Continuation = {"outcome": "later-steps", "heaviest_step_peak_allocated_bytes": r.peak_allocated_bytes,
                              "margin_bytes": m.continuation_bytes, "margin": m.continuation_parts()}
        out["continuation"] = cont
        if recorded_oom is None:
            out["reach"] = "complete"
            out["outcome"] = "oom" if r.oom is not None else "no-oom"
        elif r.oom is not None:
            out["reach"], out["outcome"] = "recorded", "still-oom"
        elif self.extended is None:
            out["reach"], out["outcome"] = "recorded", "past-recorded-oom"
        else:
            e = replay(self.extended, config, deferred_frees=mode, capacity=self.capacity)
            ext = self.extension
            assert ext is not None  # self.extended is its replay
            out["extended_peak_reserved_bytes"] = e.peak_reserved_bytes
            out["extension"] = {"previous_step_events": list(ext.previous_step), "appended_events": ext.appended}
            if e.oom is None:
                out["reach"] = out["outcome"] = cont["outcome"] = "step-completed"
                cont["heaviest_step_peak_allocated_bytes"] = max(r.peak_allocated_bytes, e.peak_allocated_bytes)
            else:
                out["reach"] = out["outcome"] = cont["outcome"] = "step-ran-out"
                out["extended_oom_requested_bytes"] = e.oom.requested_bytes
        if r.oom is not None:
            return out
        _edge(out, limit, r.peak_reserved_bytes, m.bytes)
        if cont["outcome"] != "step-ran-out" and limit is not None:
            top = max(r.peak_reserved_bytes, out.get("extended_peak_reserved_bytes", 0))
            cont["spare_bytes"] = max(limit - top, 0)
            cont["at_edge"] = at_edge(limit - top, cont["margin_bytes"])
        return out


OUTCOMES = ("oom", "no-oom", "still-oom", "past-recorded-oom", "step-completed", "step-ran-out")
"""A prediction's ``outcome``: the replay of a trace without OOM runs out (``oom``) or not (``no-oom``); of a trace
with one, it runs out again (``still-oom``), gets past it with no complete step before it to replay the rest of
the step from (``past-recorded-oom``), or gets past it and the rest of the step, replayed as the previous step ran
it, completes (``step-completed``) or runs out (``step-ran-out``): every outcome but ``oom`` and ``still-oom`` gets
through the recorded steps. Its words: :mod:`oomdoctor.render.words.predict`."""


def _edge(out: Prediction, limit: int | None, peak: int, margin_bytes: int) -> Prediction:
    """``out`` with the recorded steps' ``spare_bytes`` (room - ``peak``, 0 at least) and ``at_edge`` (the spare room
    is inside the margin); unchanged when the room is unknown."""
    if limit is None:
        return out
    out["spare_bytes"] = max(limit - peak, 0)
    out["at_edge"] = bool(at_edge(limit - peak, margin_bytes))
    return out


def predictor(analysis: DeviceAnalysis, *, outside_bytes: int | None = None,
              job_peak_reserved_bytes: int | None = None) -> Predictor | None:
    """A :class:`Predictor` for ``analysis`` (with its keyword arguments, :func:`.margin.margin_inputs`), or None
    when its trace has no history or cannot be replayed."""
    if not analysis.trace.has_history or analysis.num_events == 0:
        return None
    from ..simulate.replay import SimulationError

    try:
        return Predictor(analysis, outside_bytes=outside_bytes, job_peak_reserved_bytes=job_peak_reserved_bytes)
    except SimulationError:
        return None


def replay_failure(analysis: DeviceAnalysis, *, outside_bytes: int | None = None,
                   job_peak_reserved_bytes: int | None = None) -> str | None:
    """Why the allocator model cannot replay ``analysis``'s trace (the ``SimulationError``'s message: CUDA graphs'
    private pools, ``backend:cudaMallocAsync``, a memory fraction without the GPU's total), else None: a trace it
    replays, or one without history (nothing to replay). Replays again: ask only where :func:`predictor` gave None."""
    if not analysis.trace.has_history or analysis.num_events == 0:
        return None
    from ..simulate.replay import SimulationError

    try:
        Predictor(analysis, outside_bytes=outside_bytes, job_peak_reserved_bytes=job_peak_reserved_bytes)
    except SimulationError as e:
        return str(e)
    return None


def attach_predictions(findings: list[Finding], analyses: list[DeviceAnalysis],
                       predictors: dict[int, Predictor | None] | None = None) -> None:
    """Fill ``Fix.prediction`` for every fix with a ``what_if`` and ``Finding.prediction`` with the first
    one. Mutates ``findings``. A trace the simulator cannot replay leaves its predictions empty.
    ``predictors``: rank -> :class:`Predictor`, made on demand and kept (the verdict asks them too)."""
    by_rank = {a.rank: a for a in analyses}
    predictors = predictors if predictors is not None else {}
    for f in findings:
        wanted = [fx for fx in f.fixes if fx.what_if]
        if not wanted:
            continue
        if not f.ranks:
            continue
        rank = max(f.ranks, key=lambda r: f.per_rank_bytes.get(r, 0))
        a = by_rank.get(rank)
        if a is None:
            continue
        if rank not in predictors:
            predictors[rank] = predictor(a, **margin_inputs(a))
        p = predictors[rank]
        if p is None:
            continue
        for fx in wanted:
            assert fx.what_if is not None  # wanted: the fixes with one
            fx.prediction = cast("dict[str, Any]", p.run(fx.what_if))  # the JSON's dict (Fix is below report)
        f.prediction = wanted[0].prediction
