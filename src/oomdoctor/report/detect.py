"""Stage 2 of :mod:`.pipeline`, the predictions: the detectors' findings (:func:`oomdoctor.detectors.registry.run_all`),
each fix with the replay's prediction (:func:`.predict.attach_predictions`) and whether it applies to the rank's
PyTorch version (:func:`oomdoctor.detectors.context.fill_applies`). Not yet ranked by materiality (stage 3)."""

from __future__ import annotations

from ..analysis.device import DeviceAnalysis
from ..detectors.context import Context, fill_applies
from ..detectors.finding import Finding
from ..detectors.registry import run_all
from .predict import Predictor, attach_predictions


def detect(analyses: list[DeviceAnalysis], predictors: dict[int, Predictor | None]) -> list[Finding]:
    """The findings of ``analyses`` (one per rank), each fix predicted and its versions filled. The predictors made
    are kept in ``predictors`` by rank, for stage 3's replays (:mod:`.rank_predictions`)."""
    ctx = Context(analyses)
    findings = run_all(ctx)
    attach_predictions(findings, analyses, predictors)
    fill_applies(findings, ctx)
    return findings
