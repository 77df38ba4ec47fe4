"""``oomdoctor diff BEFORE AFTER``: what a change did to memory."""

from __future__ import annotations

import os

import click

from ..errors import SnapshotError
from ..render.protocol import formats
from ..report.diff import diff_of
from ..report.job import Want, gather, job_report, map_pairs, pair_tasks, plan_tasks
from ..trace import Skipped
from ..trace.load import lost_rank
from ..views.overlay import DiffVisual
from .inputs import parallel_options, say_skipped
from .output import OUTPUT, emit


@click.command("diff")
@click.argument("before", type=click.Path(path_type=str))
@click.argument("after", type=click.Path(path_type=str))
@click.option("--format", "fmt", type=click.Choice(formats("diff")), default="text", show_default=True)
@click.option("-o", "--output", type=OUTPUT,
              help="Write to this file instead of standard output.")
@parallel_options
def command(before: str, after: str, fmt: str, output: str | None, jobs: int | None, executor: str,
            scheduler: str | None) -> None:
    """Compare two runs (snapshot files, or directories with one file per rank): peaks, fragmentation,
    findings resolved / new / changed, and the allocation sites that grew or shrank."""
    diff, views = read_diff(before, after, html=fmt == "html", jobs=jobs, executor=executor, scheduler=scheduler)
    emit(output, "diff", fmt, diff, visual=DiffVisual(views) if fmt == "html" else None)


def read_diff(before: str, after: str, *, html: bool, jobs: int | None, executor: str, scheduler: str | None):
    """The comparison of two runs read rank pair by rank pair in parallel, and the pairs' views (``html``)."""
    skipped: list = []
    b_tasks, a_tasks = plan_tasks([before], skipped), plan_tasks([after], skipped)
    pairs, notes = pair_tasks(b_tasks, a_tasks)
    got = map_pairs(pairs, Want(view_moments=1 if html else 0), jobs=jobs, executor=executor, scheduler=scheduler)
    bad = [p for p in got if p.diff is None]
    for p in bad:
        for side, r, other in (("after", p.before, p.after), ("before", p.after, p.before)):
            if r.error is None:
                continue
            if r.task.named:
                raise SnapshotError(r.task.path, r.error)
            skipped.append(Skipped(r.task.path, r.error, lost_rank(r.task.path)))
            if other.error is None:  # as a rank found in one run only
                notes.append(f"{os.path.basename(other.task.path)} is only in the {side} run "
                             f"({other.task.path}): its pair {os.path.basename(r.task.path)} does not load")
    got = sorted((p for p in got if p.diff is not None), key=lambda p: p.before.rank)
    if not got:
        raise SnapshotError(before, f"no rank of it could be paired with a rank of {after} that loads")
    say_skipped(skipped)
    b_res, a_res = gather([p.before for p in got], []), gather([p.after for p in got], [])
    diff = diff_of([p.diff for p in got], notes, [p.before.task.path for p in got], [p.after.task.path for p in got],
                   job_report(b_res), job_report(a_res))
    return diff, [p.view for p in got if p.view is not None]
