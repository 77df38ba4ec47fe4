"""oomdoctor: find, explain and fix GPU memory problems in distributed PyTorch training.

Public API::

    trace = oomdoctor.load("rank0.pickle")             # one snapshot -> Trace
    traces = oomdoctor.load_ranks(["snapshots/"])      # files/directories -> one Trace per rank
    report = oomdoctor.diagnose(["snapshots/"])        # analyses + findings
    with oomdoctor.record("memory/", steps="2:4") as rec:  # record this rank's CUDA memory
        ...; rec.step()
"""

from __future__ import annotations

__version__ = "0.1.0"

from .capture.recorder import DEFAULT_MAX_ENTRIES  # noqa: E402
from .errors import OomdoctorError, SnapshotError, UnsafeSnapshotError  # noqa: E402
from .trace import Trace, load, load_ranks  # noqa: E402


def diagnose(paths, *, progress=None):
    """Load ``paths`` (files or directories of per-rank snapshots) and return the :class:`~oomdoctor.report.Report`.

    Raises:
        SnapshotError: an input cannot be read as a snapshot (the message names the file).
    """
    from .report import build_report

    return build_report(load_ranks(paths, progress=progress))


def record(out_dir, *, steps=None, max_entries=DEFAULT_MAX_ENTRIES, stacks="python", free_stacks=False, on_oom=True,
           summarize=False, summary_timeout_s=120.0, print_summary=True):
    """A :class:`~oomdoctor.capture.recorder.Recorder` of this process's CUDA memory, used as a context
    manager (or ``.start()`` / ``.stop()``); ``rec.step()`` marks the end of a training step (until it is
    first called, optimizer steps are counted).

    Per rank ``R`` it writes into ``out_dir``: ``rank{R}.pickle`` (or ``rank{R}_step{B}.pickle`` for a
    step window ``steps=(A, B)`` / ``"A:B"``, steps from 0) at the end, ``rank{R}_oom.pickle`` at an
    out-of-memory error (``on_oom``), each with a ``.meta.json`` sidecar, all written atomically. The
    pickles are the standard snapshot (they open in pytorch.org/memory_viz).

    Args:
        max_entries: the allocator's history ring buffer (events).
        stacks: ``"python"`` (default, low overhead) or ``"all"`` (C++ frames too).
        free_stacks: also record a stack at every free (``context="all"``). Off by default: on torch 2.11
            it crashes non-reentrant activation checkpointing in backward (``docs/checkpoint_crash.md``).
        summarize: at the end, every rank analyses its own snapshot and rank 0 writes
            ``summary.json`` (``diagnose --format json``'s schema) and ``summary.txt``, and prints the
            report (``print_summary``); ranks silent after ``summary_timeout_s`` seconds are named.

    Without torch or CUDA, or with an ``out_dir`` that cannot be written: a warning, and the block runs
    unchanged. Nothing the recorder does at run time raises into the job (failures are logged once).

    Raises:
        CaptureError: bad arguments (``steps``, ``stacks``, ``max_entries``).
    """
    from .capture.recorder import Recorder

    hook = None
    if summarize:
        import functools

        from .jobsummary import summarize_rank
        hook = functools.partial(summarize_rank, timeout_s=summary_timeout_s, print_report=print_summary)
    return Recorder(out_dir, steps=steps, max_entries=max_entries, stacks=stacks, free_stacks=free_stacks, on_oom=on_oom,
                    on_finish=hook)


__all__ = ["OomdoctorError", "SnapshotError", "Trace", "UnsafeSnapshotError", "__version__", "diagnose", "load", "record",
           "load_ranks"]
