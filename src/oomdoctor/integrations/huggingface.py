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

from .session import SessionCallback, guarded


class TrainerMemoryCallback(SessionCallback, TrainerCallback):
    """Records the Trainer's CUDA memory into ``out_dir`` and prints the diagnosis.

    Arguments and errors: :class:`~.session.SessionCallback`.
    """

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
