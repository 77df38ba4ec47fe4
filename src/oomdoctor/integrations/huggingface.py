"""A Hugging Face ``transformers.Trainer`` callback: ``Trainer(..., callbacks=[TrainerMemoryCallback("memory/")])``.

Importing this module imports ``transformers`` (the callback subclasses its ``TrainerCallback``);
``from oomdoctor.integrations import TrainerMemoryCallback`` does so only when asked.

Events used (``transformers/trainer_callback.py``, ``Trainer._inner_training_loop``):

- ``on_step_begin`` / ``on_optimizer_step``: the job trains (forward, backward, the scheduler, ``zero_grad``);
- ``on_pre_optimizer_step``: the optimizer steps (after gradient clipping);
- ``on_step_end``: a step (``state.global_step``: one optimizer update, whatever
  ``gradient_accumulation_steps`` is) ended; when ``control.should_evaluate`` is set (by
  ``DefaultFlowCallback``, which runs before user callbacks) the evaluation loop runs next, until ``on_evaluate``;
- ``on_epoch_end`` with ``control.should_evaluate``: an epoch-end evaluation runs next;
- ``on_train_end``: dump, stop, and print the diagnosis on rank 0.

The Trainer has no exception event: after an out-of-memory error the failing rank prints its diagnosis
at the next event or when the interpreter exits (:class:`~.session.MemorySession`).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..capture.recorder import DEFAULT_MAX_ENTRIES
from .session import MemorySession, guarded


class TrainerMemoryCallback(TrainerCallback):
    """Records the Trainer's CUDA memory into ``out_dir`` and prints the diagnosis.

    Args:
        out_dir: output directory (see :class:`~.session.MemorySession`).
        steps: ``None`` or a window ``"A:B"`` of training steps (optimizer updates, from 0).
        max_entries, stacks, diagnose, summary_timeout_s: as :class:`~.session.MemorySession`.

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

    @guarded
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.tell_oom()  # a retry after an OOM (auto_find_batch_size)
        self.session.set_micro_batch(getattr(args, "per_device_train_batch_size", None))
        self.session.begin()
        self.session.phase("train")

    @guarded
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.phase("train")

    @guarded
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.phase("optimizer")

    @guarded
    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.phase("train")

    @guarded
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.step()
        if getattr(control, "should_evaluate", False):
            self.session.phase("evaluation")

    @guarded
    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(control, "should_evaluate", False):
            self.session.phase("evaluation")

    @guarded
    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.phase("train")

    @guarded
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.end()
