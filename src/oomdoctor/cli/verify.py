"""``oomdoctor verify [options] -- COMMAND ...``: rerun the job with each setting and check the replay's claim for
it (:func:`oomdoctor.report.loop.judge`: confirmed only with the measured peak inside the claim's band,
:func:`oomdoctor.report.loop.band`). Exit code 1 when a rerun refutes a claim; 2 when no CUDA device is visible
(unless ``--allow-no-gpu``), or a rerun failed without an out-of-memory error or ended before its K-th optimizer
step; else 0."""

from __future__ import annotations

import os
import time

import click

from ..errors import OomdoctorError, UsageError
from ..render.protocol import formats
from ..report.loop import (
    SettingError,
    VerifyOutcome,
    apply_setting,
    parse_setting,
    predict,
    proposed_settings,
    verified,
)
from ..trace.load import discover
from .output import OUTPUT, check_output, emit
from .trials import command_argv, require_gpu, run_trial


@click.command("verify", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Optimizer steps of the first run; the reruns stop at the end of the step where it ran out of memory, "
                   "if it did.")
@click.option("--setting", "settings", multiple=True, metavar="CONF",
              help="A setting to verify: NAME=value (TORCH_NCCL_AVOID_RECORD_STREAMS=1) or an allocator option "
                   "(expandable_segments:True); repeatable [default: those the diagnosis proposes].")
@click.option("--out", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Directory for the runs' snapshots and logs [default: ./oomdoctor-verify-<time>].")
@click.option("--trial-timeout", type=click.FloatRange(min=1), default=None,
              help="Seconds a run may take before it is killed (counted as failed).")
@click.option("--allow-no-gpu", is_flag=True,
              help="Run even where no CUDA device is visible (a stand-in job, a dry run); without it, verify refuses "
                   "at once: such reruns never run out of GPU memory.")
@click.option("--format", "fmt", type=click.Choice(formats("verify")), default="text", show_default=True)
@click.option("-o", "--output", type=OUTPUT, help="Write to this file (- for standard output).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def command(steps: int, settings: tuple[str, ...], out: str | None, trial_timeout: float | None, allow_no_gpu: bool,
            fmt: str, output: str | None, command: tuple[str, ...]) -> None:
    """Run COMMAND under recording for a few optimizer steps, then rerun it with each setting (those given, or
    those the diagnosis of the first run proposes) and say, per setting, the predicted and the measured peak
    reserved, whether it ran out of memory, and whether the prediction is confirmed or refuted.

    Example: oomdoctor verify --setting expandable_segments:True -- python train.py
    """
    check_output(output)  # refused now, not after the trials
    argv = command_argv(command)
    try:
        given = [parse_setting(s) for s in settings]
    except SettingError as e:
        raise UsageError(str(e)) from None
    require_gpu("verify", allow_no_gpu)
    out = os.path.abspath(out or f"oomdoctor-verify-{time.strftime('%Y%m%d-%H%M%S')}")
    t0 = time.monotonic()
    base_dir = os.path.join(out, "baseline")
    baseline = run_trial(argv, base_dir, steps=steps, record=True, timeout_s=trial_timeout, label="baseline")
    analyses, report = _diagnose(base_dir)
    if given:
        chosen, source = given, "given"
    elif report is None:
        raise UsageError("no snapshot was recorded (no GPU, or the job ended before using CUDA) and no --setting "
                         "given: nothing to verify")
    else:
        chosen, source = [parse_setting(s) for s in proposed_settings(report)], "diagnosis"
    # a claim past a recorded OOM covers the job up to the end of that step: the reruns stop there too
    rerun_steps = _steps_to_pass_oom(analyses) or steps
    predictors: dict = {}
    rows = []
    for i, setting in enumerate(chosen):
        claim = predict(analyses, setting, predictors) if analyses else None
        env = apply_setting(dict(os.environ), setting)
        changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
        trial = run_trial(argv, os.path.join(out, f"setting{i}"), steps=rerun_steps, record=True, env=env,
                          timeout_s=trial_timeout, label=setting.text)
        rows.append(verified(setting, claim, trial, changed))
    result = VerifyOutcome(command=argv, steps=steps, rerun_steps=rerun_steps, snapshot=report is not None,
                           source=source, baseline=baseline, settings=rows, seconds=round(time.monotonic() - t0, 2))
    emit(output, "verify", fmt, result)
    if result.refuted:
        raise click.exceptions.Exit(1)
    if result.failed:
        raise click.exceptions.Exit(2)


def _diagnose(out_dir: str):
    """(analyses, report) of the baseline's snapshots, or ([], None) without any."""
    try:
        files = discover([out_dir])
    except OomdoctorError:
        return [], None
    from ..analysis.device import analyze
    from ..report.pipeline import report_of
    from .inputs import load_with_progress
    try:
        analyses = [analyze(t) for t in load_with_progress(files)]
        return analyses, report_of(analyses)
    except OomdoctorError as e:
        click.echo(f"oomdoctor: the baseline cannot be diagnosed ({e}): no claims to check", err=True)
        return [], None


def _steps_to_pass_oom(analyses) -> int:
    """Optimizer steps a rerun needs to finish the step where the baseline ran out of memory: the steps the
    recorder counted before the OOM (the sidecar's ``steps_completed``) plus one; 0 without an OOM."""
    need = 0
    for a in analyses:
        if a.oom_events.size:
            done = a.trace.meta.get("steps_completed")
            if not isinstance(done, int):
                done = len(a.steps) - 1 if a.steps is not None else 0
            need = max(need, done + 1)
    return need
