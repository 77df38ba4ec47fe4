"""The ids the core decides, one ``Literal`` type per kind (issue 53): the type checker knows every id a verdict, a
what-fits answer, a capacity, a margin, a simulation or a tune outcome may hold, so a misspelt id or a sentence
passed where an id belongs is an error before any test runs.

The core holds ids and numbers only. What each id means and how it is said are the renderers': one table per kind
in :mod:`oomdoctor.render.words` (:class:`oomdoctor.render.words.table.Words`: description, words, old names),
checked against these tuples when it is imported. Each tuple is ``typing.get_args`` of its ``Literal``, in the order
the ids are documented (and, for a verdict's reasons, made).

Nothing here is imported from elsewhere in the package: this module sits in the lowest layer, beside
:mod:`oomdoctor.units`, so that the words can import the ids without the analyses behind them.
"""

from __future__ import annotations

from typing import Literal, get_args

# ------------------------------------------------------------------ a verdict (oomdoctor.report.verdict)

VerdictKind = Literal["capacity", "fragmentation", "deferred-free", "growth", "kept-exception", "imbalance",
                      "healthy", "empty"]
VERDICT_KINDS: tuple[VerdictKind, ...] = get_args(VerdictKind)
"""What a rank's verdict answers (:attr:`oomdoctor.report.verdict.Verdict.kind`)."""

VerdictReason = Literal[
    # healthy, with history
    "room-known", "room-unknown", "reserved-window-missed", "allocated-window-missed", "reserved-job-peak",
    "allocated-job-peak", "peaks-before-window-unknown", "at-edge", "kv-cache-named", "material-findings",
    # healthy or empty, without history
    "final-state-only", "nothing-recorded",
    # without an OOM, a finding decides
    "finding-decides",
    # at an OOM
    "kept-across-micro-batches", "rank-excess", "live-tensors-exceed-room", "pipeline-in-flight",
    "held-by-exception", "oom-in-optimizer-step", "pending-frees", "not-in-one-piece", "fraction-cap",
    "cap-lower-end", "free-split", "graph-pools", "fix-simulated", "fragmentation-hit-first",
    "continuation-runs-out", "runs-out-without-it", "at-edge-without-it", "kv-generation-at-capacity",
    "kv-fits-with-fix",
    # what fits (oomdoctor.report.verdict._fit_reason)
    "fit-micro-batch", "fit-batch-scale", "fit-lower-bound", "fit-estimate", "fit-not-said",
]
VERDICT_REASONS: tuple[VerdictReason, ...] = get_args(VerdictReason)
"""The wording choices a verdict's summary makes (:attr:`oomdoctor.report.verdict.Verdict.reasons`), in the order
they are made."""

VerdictAction = Literal["pipeline-schedule", "optimizer-memory", "kv-cache-smaller", "micro-batch-at-most",
                        "micro-batch-scale", "activation-checkpointing", "shard-optimizer", "framework-activations",
                        "alloc-conf-not-simulated", "alloc-conf-simulated", "alloc-conf-not-enough", "finding-fix",
                        "logits"]
VERDICT_ACTIONS: tuple[VerdictAction, ...] = get_args(VerdictAction)
"""What a verdict says to do (:attr:`oomdoctor.report.verdict.Action.id`); the numbers are in its evidence."""

# ------------------------------------------------------------------ what fits (oomdoctor.report.fits)

FitsNote = Literal[
    "no-history", "room-unknown", "nothing-grows", "cut-in-inference", "generate-estimate",
    "generate-not-replayed", "first-forward-estimate", "cut-in-first-forward", "pipeline-warm-up",
    "optimizer-state-assumed", "gradients-assumed", "replay-failed", "private-pools", "not-reproduced",
    "peaks-before-window-unknown", "held-to-job-peak",
]
FITS_NOTES: tuple[FitsNote, ...] = get_args(FitsNote)
"""Why an answer of what fits is missing, or how it was bounded (:attr:`oomdoctor.report.fits.Fits.notes`), in the
order they are added."""

FitsAssumption = Literal[
    "loss-copies", "parameters-trained", "optimizer-state-seen", "optimizer-state-adam",
    "backward-mirrors-forward", "unseen-fragmentation", "generate-settings-kept", "generate-peak-grows",
]
FITS_ASSUMPTIONS: tuple[FitsAssumption, ...] = get_args(FitsAssumption)
"""What an estimate of what fits assumes (:attr:`oomdoctor.report.fits.Fits.assumptions`)."""

RoomSource = Literal["sidecar-cap", "oom-fraction-cap", "oom-device", "sidecar-free", "gpu-total",
                     "gpu-total-less-outside", "none"]
ROOM_SOURCES: tuple[RoomSource, ...] = get_args(RoomSource)
"""Where what fits' room comes from (:attr:`oomdoctor.report.fits.Room.source`), the first rule that applies
(:func:`oomdoctor.report.fits.device_room`)."""

# ------------------------------------------------------------------ a replay's limit (oomdoctor.simulate.capacity)

CapacitySource = Literal["sidecar-memory-cap", "sidecar-memory-fraction", "oom-device", "oom-fraction-cap",
                         "fallbacks", "fallbacks-disagree", "fallbacks-unreproduced", "no-evidence", "unlimited",
                         "given", "device-room"]
CAPACITY_SOURCES: tuple[CapacitySource, ...] = get_args(CapacitySource)
"""Where a replay's limit comes from (:attr:`oomdoctor.simulate.capacity.Capacity.source`): the rules of
:mod:`oomdoctor.simulate.capacity`, a limit asked for, or what fits' room."""

# ------------------------------------------------------------------ a search of settings (oomdoctor.simulate.whatif)

RecommendationReason = Literal["no-better-setting", "recorded-runs-out", "lowest-peak"]
RECOMMENDATION_REASONS: tuple[RecommendationReason, ...] = get_args(RecommendationReason)
"""Why a search recommends its setting (:attr:`oomdoctor.simulate.whatif.Recommendation.reason`)."""

SimulationNote = Literal["no-deferred-frees", "gc-not-tried"]
SIMULATION_NOTES: tuple[SimulationNote, ...] = get_args(SimulationNote)
"""What a search says of itself (:attr:`oomdoctor.simulate.whatif.Simulation.notes`)."""

# ------------------------------------------------------------------ a prediction's margin (oomdoctor.report.margin)

MarginSource = Literal["self-replay-difference", "self-replay-exact", "fraction-cap", "outside-growth",
                       "outside-growth-after-a-step", "planner-constants", "gpu-size-unknown",
                       "reserved-step-spread", "fewer-than-two-steps", "job-peak-above-trace", "job-peak-in-trace",
                       "job-peak-unknown"]
MARGIN_SOURCES: tuple[MarginSource, ...] = get_args(MarginSource)
"""How a part of a prediction's margin was read (:attr:`oomdoctor.report.margin.Margin.sources`)."""

# ------------------------------------------------------------------ what holds a rank's memory (oomdoctor.analysis.accounting)

BreakdownCategory = Literal["parameters", "gradients", "optimizer_state", "activations", "temporaries",
                            "communication", "outputs", "kv_cache", "workspaces", "weight_copy", "buffers", "unknown"]
"""What blocks are (a block's category, a holder's), in the order of the accounting's category indices
(:data:`oomdoctor.analysis.accounting.CATEGORIES`); with the rounding, the lines of a breakdown (its words: one table,
:data:`BREAKDOWN_LINES`')."""

BreakdownLine = Literal[BreakdownCategory, "rounding"]
BREAKDOWN_LINES: tuple[BreakdownLine, ...] = get_args(BreakdownLine)
"""The lines of a breakdown (:attr:`oomdoctor.analysis.accounting.Breakdown.categories`): the categories, then the
allocator's rounding of their requests."""

BreakdownPoint = Literal["oom", "peak_allocated", "peak_reserved", "optimizer_start", "backward_end"]
BREAKDOWN_POINTS: tuple[BreakdownPoint, ...] = get_args(BreakdownPoint)
"""The event a breakdown is taken at (:attr:`oomdoctor.analysis.accounting.Breakdown.at`)."""

PhaseSource = Literal["markers", "annotations", "autograd engine thread", "frames", "inferred"]
PHASE_SOURCES: tuple[PhaseSource, ...] = get_args(PhaseSource)
"""What set an event's phase, strongest first (:data:`oomdoctor.analysis.phases.SOURCE_NAMES`,
:attr:`oomdoctor.analysis.accounting.Breakdown.phase_source`)."""

UnknownWhy = Literal["before_trace_no_stack", "before_trace", "in_trace", "frozen_or_buffer", "copy_or_buffer"]
UNKNOWN_WHYS: tuple[UnknownWhy, ...] = get_args(UnknownWhy)
"""Why bytes of the ``unknown`` category are not placed (:attr:`oomdoctor.analysis.accounting.Breakdown.unknown_why`,
:data:`oomdoctor.analysis.accounting.UNKNOWN_WHY`), in the order of the accounting's indices."""

# ------------------------------------------------------------------ oomdoctor tune (oomdoctor.report.tune)

TuneNote = Literal["accumulation-traced-at-2", "trace-budget-reached", "no-gpu", "not-run", "deepspeed-not-installed",
                   "fsdp2-needs-a-script", "interpolated-not-run", "samples-are-steps", "top-not-measured",
                   "measured-peak-over-margin"]
TUNE_NOTES: tuple[TuneNote, ...] = get_args(TuneNote)
"""What a tune outcome says of itself (:attr:`oomdoctor.report.tune.TuneOutcome.notes`)."""
