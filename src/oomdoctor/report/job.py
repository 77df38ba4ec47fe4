"""A job's ranks, analysed independently and merged: one pure function per rank, run by an executor.

``diagnose``, ``report``, ``diff`` and ``export`` read a job rank by rank: :func:`rank_result` loads one snapshot
file and takes it down the per-rank pipeline (:func:`oomdoctor.report.pipeline.summarize_rank`: analysis, predictions,
decisions) to its summary (the report of that rank alone, its :class:`~oomdoctor.analysis.ranks.RankProfile` for the
cross-rank comparison, and what the command draws) and drops the trace. Only these summaries cross process boundaries; :func:`job_report` merges them as the in-job summary does
(:func:`~oomdoctor.report.merge.merge_reports`), so the parent never holds a trace and ``--jobs 1`` runs the very same
functions one after another.

Executors (:func:`map_ranks`): ``process`` (a pool of ``jobs`` processes on this machine, the default) and ``dask``
(Dask distributed: a running scheduler, for example one dask-jobqueue started under Slurm, or a ``LocalCluster``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence, TypeVar, cast

from ..analysis.ranks import RankProfile
from ..detectors.materiality import Materiality
from ..errors import SnapshotError, UsageError, install_hint
from ..trace.load import (
    Skipped,
    claimed_rank,
    discover,
    load,
    lost_rank,
    none_loads,
    refuse_unranked,
)
from .merge import merge_reports
from .model import Report, Unread
from .pairing import pair_by_rank

if TYPE_CHECKING:
    from distributed import Client

    from ..analysis.device import DeviceAnalysis
    from ..trace.model import Trace

EXECUTORS = ("process", "dask")
DASK_MISSING = f"--executor dask needs Dask distributed: {install_hint('dask')}"

_T = TypeVar("_T")  # what an executor maps over: a task, or a pair of them
_R = TypeVar("_R")  # what it returns for each


@dataclass(frozen=True)
class RankTask:
    """One rank to read: its file, the rank to give it when the file does not say (``None``: the file must say, or
    it is rank 0 of a one-file job), and whether the file was named by the user (then it must load; a file found
    in a directory that does not load is skipped and named)."""

    path: str
    fallback_rank: int | None
    named: bool


@dataclass(frozen=True)
class Want:
    """What each rank's summary holds besides its report and profile.

    Attributes:
        micro_batch: the recorded per-device micro-batch (samples), to say the largest that fits.
        rule: the materiality rule.
        view_moments: the moments of the HTML flame graph per rank (0: no view).
        tracks: Perfetto counter tracks.
        heat_buckets: allocated bytes over the rank's own time in this many buckets, each its maximum (0: none).
        gpu_memory_bytes: the GPU's total memory (bytes), given by the user for a snapshot that does not say it
            (no sidecar, no OOM): what fits is then replayed in it (:func:`oomdoctor.report.fits.device_room`).
    """

    micro_batch: int | None = None
    rule: Materiality = field(default_factory=Materiality)
    view_moments: int = 0
    tracks: bool = False
    heat_buckets: int = 0
    gpu_memory_bytes: int | None = None


@dataclass
class RankResult:
    """One rank's summary, or the problem that kept its file from loading (``error``)."""

    task: RankTask
    rank: int | None = None
    report: Report | None = None
    profile: RankProfile | None = None
    view: Any = None
    tracks: Any = None
    heat: list[int] | None = None
    duration_us: int = 0
    error: str | None = None


def plan_tasks(paths: Iterable[str | os.PathLike[str]], skipped: list[Skipped]) -> list[RankTask]:
    """The files of ``paths`` (directories expanded as :func:`~oomdoctor.trace.load.discover` does, skipping
    what is not a snapshot into ``skipped``) with the rank each gets when its file does not say: after the
    highest rank the sidecars and file names give, in path order (as :func:`~oomdoctor.trace.load.load_ranks`).

    Raises:
        SnapshotError: a path does not exist, or a directory holds no snapshot file.
    """
    paths = [os.fspath(p) for p in paths]
    files = discover(paths, skipped)
    named = {p for p in paths if not os.path.isdir(p)}
    hints = [claimed_rank(f) for f in files]
    nxt = max((h for h in hints if h is not None), default=-1) + 1
    tasks: list[RankTask] = []
    for f, h in zip(files, hints):
        fallback = None
        if h is None and len(files) > 1:
            fallback, nxt = nxt, nxt + 1
        tasks.append(RankTask(f, fallback, f in named))
    return tasks


def rank_result(task: RankTask, want: Want) -> RankResult:
    """Load, analyse and summarise one rank; the trace is dropped on return. Never raises for a file that does
    not load: the result carries the problem (``error``), and the caller decides (:func:`gather`)."""
    from ..analysis.device import analyze
    from .pipeline import RankContext, summarize_analysis

    try:
        trace = load(task.path)
    except SnapshotError as e:
        return RankResult(task, error=e.problem)
    if trace.rank is None:
        if task.fallback_rank is None:
            trace.meta["rank"], trace.meta["rank_assumed"] = 0, True
        else:
            trace.meta["rank"] = task.fallback_rank
            trace.warnings.append(f"rank not found in the file name or a sidecar: numbered {task.fallback_rank} "
                                  "by path order")
    if want.gpu_memory_bytes is not None and not isinstance(trace.meta.get("gpu_total_memory_bytes"), int):
        trace.meta["gpu_total_memory_bytes"] = want.gpu_memory_bytes  # the sidecar's fact, given by the user
        trace.meta["gpu_total_memory_given"] = True
    a = analyze(trace)
    got = summarize_analysis(a, RankContext(want.micro_batch, want.rule))
    out = RankResult(task, rank=got.rank, report=got.report, profile=got.profile)
    if want.view_moments:
        from ..views.visual import rank_view

        out.view = rank_view(a, want.view_moments)
    if want.tracks:
        from ..views.tracks import rank_tracks

        out.tracks = rank_tracks(a)
    if want.heat_buckets:
        out.heat, out.duration_us = heat_row(a, want.heat_buckets)
    return out


def heat_row(a: DeviceAnalysis, buckets: int) -> tuple[list[int], int]:
    """Allocated bytes over the rank's time since its first event in ``buckets`` equal spans, each the maximum
    after any event in it (a span without event repeats the value before it); and the duration (µs)."""
    import numpy as np

    if a.num_events == 0:
        return [a.peak_allocated[0]] * buckets, 0
    t = a.timeline.time_us.astype(np.int64)
    t = t - t[0]
    dur = int(t[-1])
    col = np.minimum((t * buckets) // max(dur, 1), buckets - 1) if dur else np.zeros(t.size, np.int64)
    out = np.full(buckets, -1, dtype=np.int64)
    np.maximum.at(out, col, a.timeline.allocated.astype(np.int64))
    last = int(a.timeline.allocated_start)
    for i in range(buckets):
        if out[i] < 0:
            out[i] = last
        else:
            last = int(a.timeline.allocated[np.flatnonzero(col == i)[-1]])
    return [int(v) for v in out], dur


@dataclass
class PairResult:
    """One rank of a comparison: both runs' summaries, the rank's :class:`~oomdoctor.report.diff.RankDiff`, and
    what the HTML comparison draws of it (``view``)."""

    before: RankResult
    after: RankResult
    diff: Any = None
    view: Any = None


def pair_result(tasks: tuple[RankTask, RankTask], want: Want) -> PairResult:
    """Load, analyse and compare one rank of two runs; the traces are dropped on return."""
    from ..analysis.device import analyze
    from .diff import rank_diff
    from .pipeline import RankContext, summarize_analysis

    out: list[Trace | None] = []
    errors: list[str | None] = []
    for task in tasks:
        try:
            out.append(load(task.path))
            errors.append(None)
        except SnapshotError as e:
            out.append(None)
            errors.append(e.problem)
    if any(errors):
        return PairResult(RankResult(tasks[0], error=errors[0]), RankResult(tasks[1], error=errors[1]))
    analyses: list[DeviceAnalysis] = []
    for task, trace in zip(tasks, out):
        assert trace is not None  # loaded: a file that did not returned above
        if trace.rank is None:
            trace.meta["rank"] = task.fallback_rank if task.fallback_rank is not None else 0
        analyses.append(analyze(trace))
    b, a = analyses
    res = [RankResult(t, rank=got.rank, report=got.report, profile=got.profile)
           for t, got in zip(tasks, (summarize_analysis(x, RankContext(rule=want.rule)) for x in analyses))]
    got = PairResult(res[0], res[1], diff=rank_diff(b, a))
    if want.view_moments:
        from ..views.overlay import pair_view

        got.view = pair_view(b.rank, b, a)
    return got


def pair_tasks(before: list[RankTask], after: list[RankTask]) -> tuple[list[tuple[RankTask, RankTask]], list[str]]:
    """Pair the two runs' files by rank (as the sidecars and file names give it); with one file a side, those two.
    Also the notes on ranks found in one run only."""
    def rank(t: RankTask) -> int:
        h = claimed_rank(t.path)
        return h if h is not None else (t.fallback_rank or 0)

    return pair_by_rank(before, after, rank, lambda t: t.path)


def map_pairs(pairs: Sequence[tuple[RankTask, RankTask]], want: Want, *, jobs: int | None = None,
              executor: str = "process", scheduler: str | None = None) -> list[PairResult]:
    """:func:`pair_result` of every pair, as :func:`map_ranks` runs ranks."""
    return _map(pair_result, pairs, want, jobs=jobs, executor=executor, scheduler=scheduler)


def default_jobs() -> int:
    """All the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def map_ranks(tasks: Sequence[RankTask], want: Want, *, jobs: int | None = None, executor: str = "process",
              scheduler: str | None = None) -> list[RankResult]:
    """:func:`rank_result` of every task, in task order.

    ``process``: with one task or ``jobs`` 1, in this process; else a pool of ``min(jobs, tasks)`` processes
    (``jobs`` default: :func:`default_jobs`). ``dask``: on the Dask distributed cluster at ``scheduler``, or a
    ``LocalCluster`` of this machine's cores when None.

    Raises:
        UsageError: an unknown executor, or ``dask`` without Dask distributed installed (:data:`DASK_MISSING`).
    """
    return _map(rank_result, tasks, want, jobs=jobs, executor=executor, scheduler=scheduler)


def _map(fn: Callable[[_T, Want], _R], items: Sequence[_T], want: Want, *, jobs: int | None, executor: str,
         scheduler: str | None) -> list[_R]:
    if executor == "dask":
        return _map_dask(fn, items, want, scheduler)
    if executor != "process":
        raise UsageError(f"unknown executor {executor!r}: one of {', '.join(EXECUTORS)}")
    if scheduler is not None:
        raise UsageError("--scheduler applies to --executor dask only")
    n = min(jobs or default_jobs(), len(items))
    memo: dict[Any, Any] = {}
    if n <= 1:
        return [share(fn(t, want), memo) for t in items]
    import multiprocessing  # a pool's modules only where there is a pool (start-up: docs/benchmarks.md)
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
        return [share(r, memo) for r in pool.map(fn, items, [want] * len(items), chunksize=1)]


def _gather_shared(futures: list[Any]) -> list[Any]:
    """The futures' results in order, each :func:`share`-d as it arrives (not all held unshared at once)."""
    # distributed's Futures: Future.result's timeout is unannotated, so a typed Future is partly unknown to pyright
    memo: dict[Any, Any] = {}
    out: list[Any] = []
    for f in futures:
        out.append(share(f.result(), memo))
        f.release()
    return out


def share(obj: Any, memo: dict[Any, Any], seen: set[int] | None = None) -> Any:
    """``obj`` with every string and tuple equal to one already in ``memo`` replaced by that one, in place
    (lists, dicts and dataclass fields are updated, so identities hold). Each rank's summary arrives with its
    own copies of the job's file names, frames and labels; shared, 512 ranks hold one copy of each instead of
    512 (the parent's memory grows with the ranks' differences, not their count). Returns ``obj``, or its
    shared equal for a string or tuple."""
    seen = set[int]() if seen is None else seen
    t = type(cast(object, obj))  # type() of an Any is partly unknown to pyright
    if t is str or t is tuple:
        if t is tuple:
            obj = tuple(share(v, memo, seen) for v in obj)
        try:
            return memo.setdefault(obj, obj)
        except TypeError:  # a tuple holding a list
            return obj
    if t is list or t is dict or hasattr(obj, "__dataclass_fields__"):
        if id(obj) in seen:
            return obj
        seen.add(id(obj))
    if t is list:
        obj[:] = [share(v, memo, seen) for v in obj]
    elif t is dict:
        items = [(share(k, memo, seen), share(v, memo, seen)) for k, v in obj.items()]
        obj.clear()
        obj.update(items)
    elif hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type):
        for name in obj.__dataclass_fields__:
            if hasattr(obj, name):
                object.__setattr__(obj, name, share(getattr(obj, name), memo, seen))
    return obj


def _map_dask(fn: Callable[[_T, Want], _R], items: Sequence[_T], want: Want, scheduler: str | None) -> list[_R]:
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise UsageError(DASK_MISSING) from None
    if scheduler is None:
        # distributed annotates dashboard_address as str; None is its documented "no dashboard"
        # (its __enter__, unannotated, returns the cluster itself: entered as it is)
        cluster = LocalCluster(n_workers=default_jobs(), threads_per_worker=1, processes=True,
                               dashboard_address=None)  # pyright: ignore[reportArgumentType]
        with cluster, Client(cluster) as client:
            return _gather_shared(_client_map(client, fn, items, want))
    try:
        client = Client(scheduler, timeout="30s")
    except (OSError, TimeoutError) as e:
        raise UsageError(f"--scheduler {scheduler}: cannot reach the Dask scheduler ({e})") from None
    with client:
        return _gather_shared(_client_map(client, fn, items, want))


def _client_map(client: Client, fn: Callable[[_T, Want], _R], items: Sequence[_T], want: Want) -> list[Any]:
    """``client.map`` of ``fn`` over ``items`` with ``want``, each task run once (not cached as pure)."""
    # distributed annotates map's iterables as a bare Collection: its type is partly unknown to pyright, its result not
    client_map = cast("Callable[..., list[Any]]", client.map)  # pyright: ignore[reportUnknownMemberType]
    return client_map(fn, list(items), want=want, pure=False)


def gather(results: list[RankResult], skipped: list[Skipped]) -> list[RankResult]:
    """The results that loaded, by rank. A file the user named that does not load is an error; one found in a
    directory goes to ``skipped`` with its problem and the rank it claims (:func:`~oomdoctor.trace.load.lost_rank`:
    a rank lost, :func:`unread`), unless no file of that directory loads.

    Raises:
        SnapshotError: as above, two files claim the same rank, or a directory holds several that load and give
            no rank (:func:`~oomdoctor.trace.load.refuse_unranked`).
    """
    ok: list[RankResult] = []
    bad: list[RankResult] = []
    for r in results:
        if r.error is None:
            ok.append(r)
        elif r.task.named:
            raise SnapshotError(r.task.path, r.error)
        else:
            bad.append(r)
    if bad:
        skipped.extend(sorted((Skipped(r.task.path, r.error or "", lost_rank(r.task.path)) for r in bad),
                              key=lambda s: s.path))
        dirs = {os.path.dirname(r.task.path) for r in bad}
        for d in sorted(dirs):
            if not any(os.path.dirname(r.task.path) == d for r in ok):  # what discover skipped, and these
                raise none_loads(d, sorted((s for s in skipped if os.path.dirname(s.path) == d), key=lambda s: s.path))
    # among the files that loaded (a directory's other files, named like snapshots, may not): those that gave no
    # rank got a fallback one (plan_tasks)
    refuse_unranked([r.task.path for r in ok], [None if r.task.fallback_rank is not None else r.rank for r in ok],
                    {r.task.path for r in ok if r.task.named})
    seen: dict[int, str] = {}
    for r in ok:
        rank = _loaded_rank(r)
        if rank in seen:
            raise SnapshotError(r.task.path, f"claims rank {rank}, like {seen[rank]}: pass the files of one run "
                                             "at a time (a directory may hold several runs)")
        seen[rank] = r.task.path
    return sorted(ok, key=_loaded_rank)


def _loaded_rank(r: RankResult) -> int:
    """The rank of a result that loaded (:func:`rank_result` sets it whenever there is no error)."""
    assert r.rank is not None
    return r.rank


def read_ranks(paths: Iterable[str | os.PathLike[str]], want: Want, *, jobs: int | None = None,
               executor: str = "process", scheduler: str | None = None,
               skipped: list[Skipped] | None = None) -> list[RankResult]:
    """:func:`plan_tasks`, :func:`map_ranks`, :func:`gather`: every rank's summary, by rank.

    Raises:
        SnapshotError: see :func:`plan_tasks` and :func:`gather`.
        UsageError: see :func:`map_ranks`.
    """
    skipped = skipped if skipped is not None else []
    tasks = plan_tasks(paths, skipped)
    return gather(map_ranks(tasks, want, jobs=jobs, executor=executor, scheduler=scheduler), skipped)


PAGE_RANKS = 8
"""The most ranks whose sections an HTML page shows; above, the odd ranks and one rank of each group."""


def page_ranks(report: Report, limit: int = PAGE_RANKS) -> list[int]:
    """The ranks a page shows in full: all of them up to ``limit``; else the first rank of each group, the odd
    groups first (:mod:`oomdoctor.report.groups`), at most ``limit``."""
    if len(report.ranks) <= limit or report.groups is None:
        return [r.rank for r in report.ranks]
    return sorted(g.ranks[0] for g in report.groups.groups[:limit])


def unread(skipped: Iterable[Skipped]) -> list[Unread]:
    """The rank files among ``skipped`` that could not be read (those that claim a rank: :class:`~oomdoctor.trace.
    load.Skipped`), by path: the ranks a job's result is missing."""
    return sorted((Unread(s.path, s.rank, s.reason) for s in skipped if s.rank is not None), key=lambda u: u.path)


def job_report(results: list[RankResult], skipped: Iterable[Skipped] = ()) -> Report:
    """The job's report from its ranks' summaries: the same shape as one built from all the traces at once. The rank
    files of ``skipped`` that could not be read are its ``unread`` (:func:`unread`)."""
    reports: list[Report] = []
    profiles: list[RankProfile] = []
    for r in results:
        assert r.report is not None and r.profile is not None  # gathered: ranks that loaded (gather), no errors
        reports.append(r.report)
        profiles.append(r.profile)
    report = merge_reports(reports, profiles, in_job=False)
    report.unread = unread(skipped)
    return report

