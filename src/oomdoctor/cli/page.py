"""The HTML page of a job read rank by rank: every rank's view up to 8 ranks; above, a first pass for every rank's
summary and heatmap row, then the views of the ranks the page shows (:func:`~oomdoctor.report.job.page_ranks`)."""

from __future__ import annotations

from ..detectors.materiality import Materiality
from ..report.job import PAGE_RANKS, Want, job_report, map_ranks, page_ranks
from ..views.moments import moments_per_rank
from ..views.visual import HEAT_READ, Visual, heatmap
from .inputs import read_job


def job_page(inputs: list[str], *, micro_batch: int | None = None, rule: Materiality = Materiality(),
             jobs: int | None, executor: str, scheduler: str | None, gpu_memory_bytes: int | None = None):
    """``(report, visual)`` of ``inputs`` for :func:`~oomdoctor.render.html.render_html`."""
    def want(n: int) -> Want:
        if n <= PAGE_RANKS:
            return Want(micro_batch, rule, view_moments=moments_per_rank(n), gpu_memory_bytes=gpu_memory_bytes)
        return Want(micro_batch, rule, heat_buckets=HEAT_READ, gpu_memory_bytes=gpu_memory_bytes)

    skipped: list = []
    results = read_job(inputs, want, jobs=jobs, executor=executor, scheduler=scheduler, skipped=skipped)
    report = job_report(results, skipped)
    if len(results) <= PAGE_RANKS:
        return report, Visual(ranks=[r.view for r in results])
    shown = set(page_ranks(report))
    tasks = [r.task for r in results if r.rank in shown]
    again = map_ranks(tasks, Want(micro_batch, rule, view_moments=moments_per_rank(len(tasks)),
                                  gpu_memory_bytes=gpu_memory_bytes), jobs=jobs,
                      executor=executor, scheduler=scheduler)
    rank_of = {r.task.path: r.rank for r in results}
    views = []
    for r in again:
        if r.view is not None:
            r.view.rank = rank_of[r.task.path]  # as the first pass numbered it
            views.append(r.view)
    rows: list[tuple[int, list[int], int]] = []
    for r in results:
        assert r.rank is not None  # gathered: every rank that loaded has one
        rows.append((r.rank, r.heat or [], r.duration_us))
    return report, Visual(ranks=views, heatmap=heatmap(rows))
