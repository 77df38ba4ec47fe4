"""``oomdoctor fit [options] -- COMMAND ... {mb} ...``: the largest micro-batch that runs, found with short real runs
guided by the replay of a recorded first run (:class:`oomdoctor.report.loop.FitSearch`). Exit code 0 with an
answer; 1 when even ``--low`` ran out of memory or the trial limit was reached; 2 when no CUDA device is visible
(unless ``--allow-no-gpu``), or a trial failed without an out-of-memory error or ended before its K-th optimizer
step (its log is named)."""

from __future__ import annotations

import os
import shutil
import time

import click

from ..errors import OomdoctorError, UsageError
from ..render.protocol import formats
from ..report.loop import FitOutcome, FitSearch, fit_guess
from ..trace.load import discover
from .output import OUTPUT, check_output, emit
from .run import CommandNotRunnable
from .trials import command_argv, require_gpu, run_trial

MB = "{mb}"


@click.command("fit", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--steps", type=click.IntRange(min=1), default=2, show_default=True,
              help="Optimizer steps each trial runs; every process then ends itself with exit code 0.")
@click.option("--low", type=click.IntRange(min=1), default=1, show_default=True, help="Smallest micro-batch searched.")
@click.option("--high", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Largest micro-batch searched.")
@click.option("--start", type=click.IntRange(min=1), default=None,
              help="Micro-batch of the first trial, run under recording; its replay guides the search "
                   "[default: --low].")
@click.option("--out", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Directory for the trials' snapshots and logs [default: ./oomdoctor-fit-<time>].")
@click.option("--no-record", is_flag=True, help="Record nothing: search by trials alone.")
@click.option("--trial-timeout", type=click.FloatRange(min=1), default=None,
              help="Seconds a trial may run before it is killed (counted as failed).")
@click.option("--max-trials", type=click.IntRange(min=1), default=40, show_default=True)
@click.option("--allow-no-gpu", is_flag=True,
              help="Run the trials even where no CUDA device is visible (a stand-in job, a dry run); without it, "
                   "fit refuses at once: such trials never run out of GPU memory.")
@click.option("--format", "fmt", type=click.Choice(formats("fit")), default="text", show_default=True)
@click.option("-o", "--output", type=OUTPUT, help="Write to this file (- for standard output).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def command(steps: int, low: int, high: int, start: int | None, out: str | None, no_record: bool,
            trial_timeout: float | None, max_trials: int, allow_no_gpu: bool, fmt: str, output: str | None,
            command: tuple[str, ...]) -> None:
    """Find the largest micro-batch that runs: short real runs of COMMAND, with {mb} in it replaced by the
    micro-batch. The first run is recorded; the replay of its snapshot says what fits (on the tightest rank), the
    next trial is there, then its neighbour, a short gallop and bisection; never more than three trials beyond the
    doubling search from --start, which is the search without a snapshot (--no-record).

    Example: oomdoctor fit --start 8 -- torchrun --nproc_per_node=2 train.py --batch-size {mb}
    """
    check_output(output)  # refused now, not after the trials
    argv = command_argv(command)
    if not any(MB in a for a in argv):
        raise UsageError("the command has no {mb}: write {mb} where the micro-batch goes, e.g. --batch-size {mb}")
    if low > high:
        raise UsageError(f"--low {low} is above --high {high}")
    require_gpu("fit", allow_no_gpu)
    start = min(max(start or low, low), high)
    out = os.path.abspath(out or f"oomdoctor-fit-{time.strftime('%Y%m%d-%H%M%S')}")
    made = not os.path.lexists(out)  # made for this search: what it does not need is removed at the end
    click.get_current_context().call_on_close(lambda: tidy_trials(out, made))
    t0 = time.monotonic()

    def trial(mb: int, record: bool):
        return run_trial([a.replace(MB, str(mb)) for a in argv], os.path.join(out, f"mb{mb}"), steps=steps,
                         record=record, micro_batch=mb, timeout_s=trial_timeout)

    try:
        first = trial(start, not no_record)
    except CommandNotRunnable:
        if made:  # nothing ran: the directory holds only an empty log
            shutil.rmtree(out, ignore_errors=True)
        raise
    trials = [first]
    guess, guide, snapshot, analysis_s = None, "none", False, 0.0
    if first.recorded and first.outcome in ("ran", "oom"):
        a0 = time.monotonic()
        guess, guide, snapshot = _guess(os.path.join(out, f"mb{start}"), start)
        analysis_s = time.monotonic() - a0
    search = FitSearch(low, high, start, guess, guide)
    error = _stopped_by(first)
    if error is None:
        search.record(start, first.outcome == "ran")
        while (mb := search.propose()) is not None:
            if len(trials) >= max_trials:
                error = "max-trials"
                break
            t = trial(mb, False)
            trials.append(t)
            if (error := _stopped_by(t)) is not None:
                break
            search.record(mb, t.outcome == "ran")
    result = FitOutcome(command=argv, steps=steps, low=low, high=high, start=start, snapshot=snapshot, guide=guide,
                        predicted_micro_batch=guess, largest_micro_batch=search.largest_ran,
                        smallest_oom_micro_batch=search.smallest_oom, trials=trials,
                        seconds=round(time.monotonic() - t0, 2), analysis_seconds=round(analysis_s, 2), error=error,
                        guess_contradicted=search.guess_contradicted)
    emit(output, "fit", fmt, result)
    if error in ("failed", "ended-early"):
        raise click.exceptions.Exit(2)
    if error is not None or search.largest_ran is None:
        raise click.exceptions.Exit(1)


def _stopped_by(t) -> str | None:
    """The search cannot go on after a trial that neither ran nor ran out of memory: its outcome, else None."""
    return t.outcome if t.outcome in ("failed", "ended-early") else None


def tidy_trials(out: str, made: bool) -> None:
    """After a search: remove the trials' directories that hold nothing (a trial recorded no snapshot: no GPU, or
    not recorded), and ``out`` itself when this search ``made`` it and nothing is left in it. The logs stay: the
    output names them."""
    try:
        names = os.listdir(out)
    except OSError:
        return
    for name in names:
        path = os.path.join(out, name)
        if name.startswith("mb") and os.path.isdir(path) and not os.path.islink(path):
            try:
                os.rmdir(path)  # only an empty one
            except OSError:
                pass
    if made:
        try:
            os.rmdir(out)
        except OSError:
            pass


def _guess(out_dir: str, micro_batch: int) -> tuple[int | None, str, bool]:
    """The replayed answer of the recorded trial: (micro-batch, guide, a snapshot was recorded)."""
    try:
        files = discover([out_dir])
    except OomdoctorError:
        return None, "none", False
    from ..report import build_report
    from .inputs import load_with_progress
    try:
        report = build_report(load_with_progress(files), micro_batch=micro_batch)
    except OomdoctorError as e:
        click.echo(f"oomdoctor: the recorded trial cannot be diagnosed ({e}): searching by trials alone", err=True)
        return None, "none", True
    guess, guide = fit_guess(report)
    return guess, guide, True
