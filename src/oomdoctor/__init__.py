"""oomdoctor: find, explain and fix GPU memory problems in distributed PyTorch training.

Public API::

    trace = oomdoctor.load("rank0.pickle")             # one snapshot -> Trace
    traces = oomdoctor.load_ranks(["snapshots/"])      # files/directories -> one Trace per rank
    result = oomdoctor.diagnose("snapshots/")          # verdict, breakdown, findings (renders in Jupyter)
    result = oomdoctor.diff("before/", "after/")       # what a change did
    result = oomdoctor.replay("rank0.pickle", configs=["expandable_segments:True"])  # allocator what-ifs
    with oomdoctor.record("memory/", steps="2:4") as rec:  # record this rank's CUDA memory
        ...; rec.step()
    answer = oomdoctor.preflight(model_fn, step_fn, batch_fn, gpu="H100-80GB")  # before any GPU (torch)
"""

from __future__ import annotations

import os  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

from ._lazy import lazy_attributes  # noqa: E402
from ._version import __version__  # noqa: E402,F401
from .errors import OomdoctorError, SnapshotError, UnsafeSnapshotError  # noqa: E402

if TYPE_CHECKING:  # the lazy names, for the type checker (nothing is imported at run time)
    from .preflight._entry import CallablePackage
    from .trace import Trace, load, load_ranks

    preflight: CallablePackage  # the package, callable as oomdoctor.preflight.api.preflight

# numpy and the loader are imported on first use (PEP 562), so that `import oomdoctor` and the CLI's
# start-up stay light (`python -X importtime -m oomdoctor --help`).
_lazy_trace = lazy_attributes(__name__, {"Trace": "trace", "load": "trace", "load_ranks": "trace"})


def __getattr__(name: str) -> Any:
    if name == "preflight":  # the callable package (torch is imported only now)
        import importlib

        return importlib.import_module(".preflight", __name__)
    return _lazy_trace(name)


def _paths(paths) -> list:
    return [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)


def diagnose(paths, *, micro_batch=None, progress=None):
    """Load ``paths`` (a file or directory of per-rank snapshots, or a list of them) and diagnose them.

    Returns a :class:`~oomdoctor.notebook.Diagnosis`: ``.report`` (the
    :class:`~oomdoctor.report.model.Report`), ``.verdict``, ``.findings`` and ``.ranks`` with their texts
    rendered, ``.skipped`` (files of a directory that are not snapshots, skipped and named as the CLI does; those
    that claim a rank and could not be read are also the report's ``unread``: the report covers the other ranks),
    ``str()`` the terminal text, ``.to_json()``, ``.to_html()``; Jupyter shows the HTML report.
    ``micro_batch``: the recorded per-device micro-batch (samples), to say the largest that fits.

    Raises:
        SnapshotError: a file named in ``paths`` cannot be read as a snapshot, or a directory holds none that
            loads (the message names the file).
    """
    from .analysis.device import analyze
    from .notebook import Diagnosis
    from .report.job import unread
    from .report.pipeline import report_of
    from .trace import load_ranks
    from .views.visual import build_visual

    skipped: list = []
    analyses = [analyze(t) for t in load_ranks(_paths(paths), progress=progress, skipped=skipped)]
    report = report_of(analyses, micro_batch=micro_batch)
    report.unread = unread(skipped)
    return Diagnosis(report, build_visual(analyses), skipped)


def diff(before, after):
    """Compare two runs (each a file, a directory of per-rank snapshots, or a list): a
    :class:`~oomdoctor.notebook.Comparison` (``.diff``; Jupyter shows the HTML comparison).

    Raises:
        SnapshotError: an input cannot be read as a snapshot.
    """
    from .analysis.device import analyze
    from .notebook import Comparison
    from .report.diff import diff_runs
    from .report.pipeline import report_of
    from .trace import load_ranks
    from .views.overlay import build_diff_visual

    skipped: list = []
    b = [analyze(t) for t in load_ranks(_paths(before), skipped=skipped)]
    a = [analyze(t) for t in load_ranks(_paths(after), skipped=skipped)]
    d = diff_runs(b, a, report_of(b), report_of(a))
    return Comparison(d, build_diff_visual(d, b, a), skipped)


def replay(path, *, configs=(), immediate_frees=False, cap=None, search=False, workers=None):
    """``oomdoctor simulate`` as a function (named ``replay``: ``oomdoctor.simulate`` is the package of
    the allocator model). Replay one snapshot file through the allocator model under its recorded settings (checked
    against the recording) and under ``configs`` (``PYTORCH_CUDA_ALLOC_CONF`` strings): a
    :class:`~oomdoctor.notebook.Replay` (``.simulation``; Jupyter shows the table).

    Args:
        immediate_frees: also replay with deferred (``record_stream``) frees completed at once.
        cap: the memory limit, bytes (int) or a size such as ``"38.67GiB"`` (default: from the snapshot).
        search: also try a grid of settings and recommend one (``workers`` processes).

    Raises:
        SnapshotError: the file is not a snapshot; UsageError: it holds no allocation history, or ``cap``
        is not a size; ConfigError: an invalid config string.
    """
    from .notebook import Replay
    from .simulate.whatif import simulate_recorded
    from .trace import load
    from .units import parse_bytes

    cap_bytes = None if cap is None else cap if isinstance(cap, int) else parse_bytes(str(cap))
    return Replay(simulate_recorded(load(path), configs=list(configs), immediate_frees=immediate_frees,
                                    cap_bytes=cap_bytes, search=search, workers=workers))


def record(out_dir, *, steps=None, max_entries=None, stacks="python", free_stacks=False, on_oom=True,
           summarize=False, summary_timeout_s=120.0, print_summary=True, stack_steps="3/10"):
    """A :class:`~oomdoctor.capture.recorder.Recorder` of this process's CUDA memory, used as a context
    manager (or ``.start()`` / ``.stop()``); ``rec.step()`` marks the end of a training step (until it is
    first called, optimizer steps are counted).

    Per rank ``R`` it writes into ``out_dir``: ``rank{R}.pickle`` (or ``rank{R}_step{B}.pickle`` for a
    step window ``steps=(A, B)`` / ``"A:B"``, steps from 0) at the end, ``rank{R}_oom.pickle`` at an
    out-of-memory error (``on_oom``), each with a ``.meta.json`` sidecar, all written atomically. The
    pickles are the standard snapshot (they open in pytorch.org/memory_viz).

    Args:
        max_entries: the allocator's history ring buffer (events; default
            :data:`~oomdoctor.capture.recorder.DEFAULT_MAX_ENTRIES`).
        stacks: ``"python"`` (default, low overhead) or ``"all"`` (C++ frames too).
        free_stacks: also record a stack at every free (``context="all"``). Off by default: on torch 2.11
            it crashes non-reentrant activation checkpointing in backward (``SystemError: ... returned NULL
            without setting an exception``).
        stack_steps: which steps gather stacks: ``"3/10"`` (default), ``"all"`` or ``"K/N"`` (the first K steps, then
            every N-th; the others record every event without a stack, and the analysis matches their
            allocations against a stacked step), see :func:`~oomdoctor.capture.recorder.parse_stack_steps`.
        summarize: at the end, every rank analyses its own snapshot and rank 0 writes
            ``summary.json`` (``diagnose --format json``'s schema) and ``summary.txt``, and prints the
            report (``print_summary``); ranks silent after ``summary_timeout_s`` seconds are named.

    Without torch or CUDA, or with an ``out_dir`` that cannot be written: a warning, and the block runs
    unchanged. Nothing the recorder does at run time raises into the job (failures are logged once).

    Raises:
        CaptureError: bad arguments (``steps``, ``stacks``, ``max_entries``, ``stack_steps``).
    """
    from .capture.recorder import DEFAULT_MAX_ENTRIES, Recorder

    hook = None
    if summarize:
        import functools

        from .jobsummary import summarize_rank
        hook = functools.partial(summarize_rank, timeout_s=summary_timeout_s, print_report=print_summary)
    entries = DEFAULT_MAX_ENTRIES if max_entries is None else max_entries
    return Recorder(out_dir, steps=steps, max_entries=entries, stacks=stacks, free_stacks=free_stacks, on_oom=on_oom,
                    on_finish=hook, stack_steps=stack_steps)


def _preflight(model_fn, step_fn, batch_fn, **kwargs):
    """``oomdoctor.preflight(...)``: :func:`oomdoctor.preflight.api.preflight` (its arguments, return and errors)."""
    from .preflight.api import preflight

    return preflight(model_fn, step_fn, batch_fn, **kwargs)


__all__ = ["OomdoctorError", "SnapshotError", "Trace", "UnsafeSnapshotError", "__version__", "diagnose", "diff", "load",
           "load_ranks", "preflight", "record", "replay"]
