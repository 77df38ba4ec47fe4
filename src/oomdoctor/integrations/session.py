"""What the framework callbacks share: one :class:`~oomdoctor.capture.recorder.Recorder`, the step and
phase marks, and the one-paragraph diagnosis printed at the end of training or after an OOM.

The recording starts when the process initialises CUDA (``torch.cuda._lazy_call``, as ``oomdoctor
run`` does; ``torch/cuda/__init__.py`` ``_lazy_init`` runs the queued calls before the first
allocation), so the model's parameters are in the trace; when CUDA is already initialised, at once;
at the latest when the framework says training begins.

The diagnosis:

- at the end of training, every rank analyses its own snapshot and rank 0 merges them, writes
  ``summary.json`` / ``summary.txt`` into the output directory and prints the paragraph
  (:func:`oomdoctor.jobsummary.summarize_rank`, :func:`oomdoctor.render.text.render_paragraph`);
- after an out-of-memory error, the rank that failed reads its ``rank{R}_oom.pickle`` (written by the
  allocator's OOM observer at the failure) and prints the paragraph: in the framework's exception
  hook where it has one (Lightning ``on_exception``, and again at exit, below the traceback, when the
  error ends the program), else at the next callback event (a retry with a smaller batch, e.g.
  Trainer's ``auto_find_batch_size``) or at interpreter exit, after the traceback.

Nothing here raises into the training job: a failure is logged once on stderr and counted.
"""

from __future__ import annotations

import atexit
import functools
import sys
from typing import Any, Callable

from ..capture.recorder import DEFAULT_MAX_ENTRIES, Recorder


def guarded(method: Callable) -> Callable:
    """A callback method that never raises into the job: a failure is counted by the session's
    recorder and warned about once per method (:meth:`~oomdoctor.capture.recorder.Recorder._failed`)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the job must never see the callback fail
            getattr(self, "session", self).recorder._failed(f"{type(self).__name__}.{method.__name__}", e)
            return None

    return run


class MemorySession:
    """A recording driven by a training framework's callbacks.

    Args:
        out_dir: where the snapshots (``rank{R}.pickle``, ``rank{R}_step{B}.pickle``,
            ``rank{R}_oom.pickle``), their sidecars and the summary go; created if missing.
        steps: ``None`` (the whole run) or a window ``"A:B"`` / ``(A, B)`` of training steps
            (optimizer updates, counted from 0, both included): recorded, then dumped when step B ends.
        max_entries: the allocator's history ring buffer (events).
        stacks: ``"python"`` (default), ``"all"`` or ``"none"`` (see :class:`~oomdoctor.capture.recorder.Recorder`).
        diagnose: print the one-paragraph diagnosis at the end and after an OOM.
        summary_timeout_s: how long rank 0 waits for the other ranks' reports at the end (seconds).

    Raises:
        CaptureError: bad ``steps``, ``stacks`` or ``max_entries`` (the only errors; at run time nothing raises).
    """

    def __init__(self, out_dir: str, *, steps: Any = None, max_entries: int = DEFAULT_MAX_ENTRIES,
                 stacks: str = "python", diagnose: bool = True, summary_timeout_s: float = 120.0) -> None:
        self.diagnose = diagnose
        self.summary_timeout_s = summary_timeout_s
        self.recorder = Recorder(out_dir, steps=steps, max_entries=max_entries, stacks=stacks, on_oom=True,
                                 on_finish=self._summarize, manual_steps=True)
        #: the merged report of the end of training (rank 0), or the OOM report of this rank
        self.report: Any = None
        self.paragraph: str | None = None
        self.started = False
        self.ended = False
        self._oom_told = False
        self._arm()

    @guarded
    def _arm(self) -> None:
        """Start at CUDA's initialisation when torch is already imported (see the module doc)."""
        torch = sys.modules.get("torch")
        if torch is None:
            return
        if torch.cuda.is_initialized():
            self.begin()
        else:
            torch.cuda._lazy_call(self.begin)

    @guarded
    def begin(self) -> None:
        """Start recording (once; later calls do nothing)."""
        if self.started:
            return
        self.started = True
        self.recorder.start()
        atexit.register(self._at_exit)

    @guarded
    def step(self) -> None:
        """A training step (optimizer update) ended."""
        self.tell_oom()
        self.recorder.step()

    @guarded
    def phase(self, name: str) -> None:
        """From now on the job runs ``name``: ``train``, ``optimizer`` or ``evaluation``."""
        self.recorder.mark_phase(name)

    def set_micro_batch(self, samples: Any) -> None:
        """The per-device micro-batch (samples per forward pass), for the report's "what fits"."""
        if isinstance(samples, int) and not isinstance(samples, bool) and samples > 0:
            self.recorder.micro_batch = samples

    @guarded
    def end(self) -> None:
        """Training ended: dump what is left, stop recording, summarize (once)."""
        if self.ended:
            return
        self.ended = True
        self.tell_oom()
        self.recorder.stop()

    def _summarize(self, recorder: Recorder, snapshot: dict, meta: dict) -> None:
        from ..jobsummary import summarize_rank
        from ..render.text import render_paragraph

        report = summarize_rank(recorder, snapshot, meta, timeout_s=self.summary_timeout_s, print_report=False)
        if report is not None:
            self.report, self.paragraph = report, render_paragraph(report, snapshot=recorder.out_dir)
            if self.diagnose:
                print(self.paragraph, flush=True)

    @guarded
    def tell_oom(self) -> None:
        """After an OOM dump of this rank: diagnose it and print the paragraph (once)."""
        rec = self.recorder
        if self._oom_told or not rec.oom_dumped:
            return
        self._oom_told = True
        path = next((p for p in rec.written if p.endswith("_oom.pickle")), None)
        if path is None:
            return
        from .. import load
        from ..render.text import render_paragraph
        from ..report.pipeline import build_report

        self.report = build_report([load(path)])
        self.paragraph = render_paragraph(self.report, snapshot=path)
        if self.diagnose:
            print(self.paragraph, file=sys.stderr, flush=True)

    def _at_exit(self) -> None:
        """At exit: diagnose an OOM not told yet; when one was told earlier (Lightning's
        ``on_exception``) and the process dies of it, say it again below the traceback."""
        try:
            if self._oom_told and self.paragraph and self.diagnose and _dying_of_oom():
                print(self.paragraph, file=sys.stderr, flush=True)
            else:
                self.tell_oom()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def _dying_of_oom() -> bool:
    """Did an uncaught out-of-memory error end the program? (``sys.last_value``: set when the
    interpreter prints an uncaught exception, before ``atexit`` handlers run)."""
    exc = getattr(sys, "last_value", None)
    return exc is not None and (type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc))


class SessionCallback:
    """What the framework callbacks share: a :class:`MemorySession` made from their arguments, and
    ``report``. Mixed in before the framework's callback class.

    Args:
        out_dir: output directory (see :class:`MemorySession`).
        steps: ``None`` or a window ``"A:B"`` of training steps (optimizer updates, from 0).
        max_entries, stacks, diagnose, summary_timeout_s: as :class:`MemorySession`.

    Raises:
        CaptureError: bad ``steps``, ``stacks`` or ``max_entries``.
    """

    def __init__(self, out_dir: str = "oomdoctor-memory", *, steps: Any = None,
                 max_entries: int = DEFAULT_MAX_ENTRIES, stacks: str = "python", diagnose: bool = True,
                 summary_timeout_s: float = 120.0) -> None:
        self.session = MemorySession(out_dir, steps=steps, max_entries=max_entries, stacks=stacks,
                                     diagnose=diagnose, summary_timeout_s=summary_timeout_s)

    @property
    def report(self) -> Any:
        """The last diagnosis (:class:`~oomdoctor.report.model.Report`), or None."""
        return self.session.report


def batch_size(batch: Any) -> int | None:
    """Samples in a batch: the first dimension of its first tensor (a tensor, or one inside a
    mapping, list or tuple, as data loaders collate them); None when there is none."""
    todo = [batch]
    while todo:
        x = todo.pop(0)
        shape = getattr(x, "shape", None)
        if shape is not None and len(shape) >= 1:
            return int(shape[0])
        if isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return None
