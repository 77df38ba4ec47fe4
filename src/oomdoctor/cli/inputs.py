"""Reading inputs for the subcommands (outputs: :mod:`.output`)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import click
from rich.console import Console

from ..render.gate import skipped_files_line, unread_ranks_line
from ..trace import Skipped, Trace, load_ranks

if TYPE_CHECKING:
    from ..analysis.device import DeviceAnalysis

_PROGRESS_MIN_BYTES = 1 << 20


def load_with_progress(inputs: list[str], *, replay_only: bool = False) -> list[Trace]:
    """Load with a progress display on a terminal when the input is large: bytes read, then a spinner
    while the file is decoded and turned into columns. Files of a directory that are not snapshots are
    skipped and named on one line of standard error (when nothing loads, the error says so instead).
    ``replay_only``: the columns the allocator replay reads (:func:`oomdoctor.trace.load.load`)."""
    skipped: list[Skipped] = []
    traces = _load(inputs, skipped, replay_only)
    say_skipped(skipped)
    return traces


def say_skipped(skipped: list[Skipped]) -> None:
    """On standard error: one line naming the files that are not snapshots, one naming the rank files that could not
    be read (:mod:`oomdoctor.render.gate`)."""
    from ..report.job import unread

    other = [s for s in skipped if s.rank is None]
    if other:
        click.echo(skipped_files_line(other), err=True)
    lost = unread(skipped)
    if lost:
        click.echo(unread_ranks_line(lost), err=True)


def _load(inputs: list[str], skipped: list[Skipped], replay_only: bool = False) -> list[Trace]:
    total = sum(os.path.getsize(p) for p in inputs if os.path.isfile(p))
    if total < _PROGRESS_MIN_BYTES or not sys.stderr.isatty():
        return load_ranks(inputs, skipped=skipped, replay_only=replay_only)
    from rich.progress import BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn  # only for a bar

    console = Console(stderr=True)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), DownloadColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("loading", total=None)

        def progress(done: int, file_total: int) -> None:
            what = "reading" if done < file_total else "decoding and indexing"
            bar.update(task, description=f"{what} snapshot", completed=done, total=file_total)

        return load_ranks(inputs, progress=progress, skipped=skipped, replay_only=replay_only)


def parallel_options(f):
    """``--jobs/-j``, ``--executor``, ``--scheduler``: how the ranks are read (:mod:`oomdoctor.report.job`)."""
    f = click.option("--scheduler", metavar="ADDRESS", default=None,
                     help="--executor dask: the address of a running Dask scheduler (tcp://host:8786), for example "
                          "one that dask-jobqueue started under Slurm; without it, a LocalCluster of this "
                          "machine's cores.")(f)
    f = click.option("--executor", type=click.Choice(["process", "dask"]), default="process", show_default=True,
                     help="Where the per-rank work runs: processes of this machine, or Dask distributed "
                          "(pip install distributed).")(f)
    f = click.option("-j", "--jobs", type=click.IntRange(min=1), default=None,
                     help="Ranks read in parallel (default: all cores; 1: one after another). Each process "
                          "loads one rank, analyses it and keeps only its summary.")(f)
    return f


def read_job(inputs: list[str], want_for, *, jobs: int | None, executor: str, scheduler: str | None,
             skipped: list[Skipped] | None = None):
    """The ranks of ``inputs`` read in parallel, each reduced to its summary (:func:`~oomdoctor.report.job.
    read_ranks`); ``want_for(n)`` says what each summary holds for a job of ``n`` files. Files of a directory
    that are not snapshots are skipped and named on one line of standard error, and the rank files that could not
    be read on another (:func:`say_skipped`); both are appended to ``skipped`` when given (for
    :func:`~oomdoctor.report.job.job_report`, whose ``unread`` they make)."""
    from ..report.job import gather, map_ranks, plan_tasks

    skipped = [] if skipped is None else skipped
    tasks = plan_tasks(inputs, skipped)
    results = gather(map_ranks(tasks, want_for(len(tasks)), jobs=jobs, executor=executor, scheduler=scheduler),
                     skipped)
    say_skipped(skipped)
    return results


def analyze_inputs(inputs: list[str]) -> list[DeviceAnalysis]:
    """Load snapshot files or directories (one file per rank) and analyse each rank's primary device."""
    from ..analysis.device import analyze

    return [analyze(t) for t in load_with_progress(inputs)]
