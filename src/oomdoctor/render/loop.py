"""``oomdoctor fit`` and ``oomdoctor verify`` as text and JSON (the JSON shapes: :func:`.schema.fit_schema`,
:func:`.schema.verify_schema`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .._version import SCHEMA_VERSION, __version__
from .format import count, format_bytes, wrap_lines

if TYPE_CHECKING:
    from ..report.loop import FitOutcome, Trial, Verified, VerifyOutcome

_GUIDE = {
    "replayed": "the replay of the recorded run says {p} fits",
    "lower-bound": "the replay of the recorded run says at least {p} fits",
    "estimate": "the recorded run ended in its first forward pass; estimated from it: {p}",
}
_WHY = {
    "agrees": "confirmed",
    "oom-not-predicted": "refuted: predicted to run, it ran out of memory",
    "ran-but-oom-predicted": "refuted: predicted to run out of memory, it ran",
    "peak-above-margin": "refuted: the measured peak is above the prediction and its margin",
    "peak-below-margin": "refuted: the measured peak is below the prediction less its margin",
    "no-prediction": "no claim to check (nothing replayed for it)",
    "failed": "the rerun failed without an out-of-memory error",
    "ended-early": "the rerun ended (exit code 0) before its optimizer steps: nothing to judge",
}


def _doc(d: dict[str, Any]) -> str:
    return json.dumps({"schema_version": SCHEMA_VERSION, "oomdoctor_version": __version__, **d}, indent=2) + "\n"


def fit_json(fit: FitOutcome) -> str:
    d = asdict(fit)
    d["trial_count"] = fit.trial_count
    return _doc(d)


def verify_json(v: VerifyOutcome) -> str:
    d = asdict(v)
    d["refuted"] = v.refuted
    return _doc(d)


def _trial_line(t: Trial) -> str:
    what = {"ran": "ran", "oom": "out of memory", "failed": f"failed (exit code {t.exit_code})",
            "ended-early": "ended before its optimizer steps (exit code 0)"}[t.outcome]
    extra = " (recorded)" if t.recorded else ""
    if t.timed_out:
        extra += " (timed out)"
    return f"{what}{extra}, {t.seconds:.1f} s"


def fit_text(fit: FitOutcome, width: int = 80) -> str:
    """``oomdoctor fit``'s answer as text wrapped at ``width`` columns: the largest micro-batch that runs, the trials
    and what guided them."""
    out = []
    if fit.error is None and fit.largest_micro_batch is not None:
        above = f"; {fit.smallest_oom_micro_batch} ran out of memory" if fit.smallest_oom_micro_batch else \
            " (the top of the range searched)" if fit.largest_micro_batch == fit.high else ""
        out.append(f"Largest micro-batch that runs: {fit.largest_micro_batch}{above}.")
    elif fit.error is None:
        out.append(f"No micro-batch from {fit.low} runs: {fit.low} ran out of memory.")
    else:  # the search stopped short: what ran is a lower bound, not the answer
        out.append("No answer: " + {"failed": "a trial failed without an out-of-memory error (see its log below)",
                                     "ended-early": f"a trial exited 0 before its {fit.steps} optimizer steps (see its "
                                                    "log below): the job has fewer steps, no torch.optim optimizer, "
                                                    "or it returned after an error",
                                     "max-trials": "the search reached its trial limit"}.get(fit.error, fit.error)
                   + (f"; the largest that ran: {fit.largest_micro_batch}" if fit.largest_micro_batch else "") + ".")
    out.append(f"{count(len(fit.trials), 'trial')} of {count(fit.steps, 'optimizer step')}, {fit.seconds:.1f} s in all "
               f"({fit.analysis_seconds:.1f} s of analysis).")
    if fit.guide in _GUIDE and fit.guess_contradicted:
        ran = fit.trials[0].outcome == "ran" if fit.trials else False
        out.append("Not guided: " + _GUIDE[fit.guide].format(p=fit.predicted_micro_batch) + f", but the recorded run at "
                   f"{fit.start} {'ran' if ran else 'ran out of memory'}: the search was the doubling search from there.")
    elif fit.guide in _GUIDE:
        out.append("Guided: " + _GUIDE[fit.guide].format(p=fit.predicted_micro_batch) + "; the search began there.")
    elif fit.trials and not fit.trials[0].recorded:
        out.append("Searched by trials alone: recording was off (--no-record).")
    elif fit.snapshot:
        out.append("Searched by trials alone: the recorded run gave no replayed answer.")
    else:
        out.append("Searched by trials alone: no snapshot was recorded (no GPU, or the job ended before using CUDA).")
    out.append("")
    out.append("  micro-batch  outcome")
    for t in fit.trials:
        out.append(f"  {t.micro_batch:>11}  {_trial_line(t)}")
        if t.outcome in ("failed", "ended-early"):
            out.append(f"               output: {t.log}")
    return wrap_lines("\n".join(out), width) + "\n"


def _peak(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _predicted(v: Verified) -> str:
    if v.predicted_oom is None:
        return "no claim"
    if v.predicted_oom:
        return "out of memory"
    peak = ("at least " if v.predicted_peak_is_lower_bound else "") + _peak(v.predicted_peak_reserved_bytes)
    if v.band_low_bytes is None:
        return f"runs, peak {peak} (no margin: the peak is not judged)"
    if v.band_high_bytes is None:
        return f"runs, peak {peak} ± {_peak(v.margin_bytes)}: confirmed from {_peak(v.band_low_bytes)} up"
    return (f"runs, peak {peak} ± {_peak(v.margin_bytes)}: confirmed between {_peak(v.band_low_bytes)} and "
            f"{_peak(v.band_high_bytes)}")


def verify_text(v: VerifyOutcome, width: int = 80) -> str:
    """``oomdoctor verify``'s answer as text wrapped at ``width`` columns: the baseline, each setting's predicted and
    measured peak, and how many claims were confirmed."""
    b = v.baseline
    measured = (f"measured peak reserved {_peak(b.measured_peak_reserved_bytes)}" if b.measured_peak_reserved_bytes
                is not None else "no peak measured (no process used CUDA)")
    out = [f"Baseline (settings as they are): {_trial_line(b)}, {measured}."]
    if not v.snapshot:
        out.append("No snapshot was recorded (no GPU, or the job ended before using CUDA): the settings were rerun "
                   "without a prediction to check.")
    src = "given" if v.source == "given" else "proposed by the diagnosis of the baseline"
    if not v.settings:
        out.append("The diagnosis proposes no setting with a replayed prediction: nothing to verify.")
        return wrap_lines("\n".join(out), width) + "\n"
    out.append(f"Settings {src}, each rerun for {v.rerun_steps} optimizer steps:")
    out.append("")
    for s in v.settings:
        measured = "out of memory" if s.oom else "failed" if s.why == "failed" else \
            "ended before its optimizer steps" if s.why == "ended-early" else \
            f"ran, peak {_peak(s.measured_peak_reserved_bytes)}"
        out.append(f"  {s.config}")
        out.append(f"    predicted: {_predicted(s)}")
        out.append(f"    measured:  {measured} ({s.trial.seconds:.1f} s)")
        out.append(f"    {_WHY[s.why]}")
        if s.why in ("failed", "ended-early"):
            out.append(f"    output: {s.trial.log}")
    out.append("")
    n = len(v.settings)
    out.append(f"{sum(1 for s in v.settings if s.confirmed)} of {count(n, 'claim')} confirmed, {v.refuted} refuted; "
               f"{v.seconds:.1f} s in all.")
    return wrap_lines("\n".join(out), width) + "\n"
