"""A PyTorch Lightning callback: ``L.Trainer(callbacks=[LightningMemoryCallback("memory/")])``.

Importing this module imports Lightning (``lightning.pytorch``, else the standalone
``pytorch_lightning``: the callback subclasses that package's ``Callback``, which its ``Trainer`` checks).

Hooks used (``lightning/pytorch/callbacks/callback.py``, ``lightning/pytorch/loops``):

- ``setup``: recording starts (the strategy has set the device; the model is not on it yet);
- ``on_train_batch_start`` / ``on_train_batch_end``: the job trains; a step ends when
  ``trainer.global_step`` (optimizer updates, whatever ``accumulate_grad_batches`` is) has moved;
  the first batch gives the micro-batch;
- ``on_before_optimizer_step``: the optimizer steps (after backward, before clipping);
- ``on_validation_start`` / ``on_validation_end``, ``on_test_*``, ``on_predict_*``: evaluation;
- ``on_exception``: after an out-of-memory error, the failing rank prints its diagnosis before
  the exception propagates;
- ``teardown``: dump, stop and print the diagnosis on rank 0 (once, after the first stage that ends).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # one class for the type checker (the test extra installs lightning)
    from lightning.pytorch import Callback
else:
    try:
        from lightning.pytorch import Callback
    except ImportError:  # the standalone package
        from pytorch_lightning import Callback

from .session import SessionCallback, batch_size, guarded


class LightningMemoryCallback(SessionCallback, Callback):
    """Records the Lightning Trainer's CUDA memory into ``out_dir`` and prints the diagnosis.

    Arguments and errors: :class:`~.session.SessionCallback`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._global_step: int | None = None

    @guarded
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.session.begin()

    @guarded
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._global_step is None:
            self._global_step = int(trainer.global_step)
            self.session.set_micro_batch(batch_size(batch))
        self.session.phase("train")

    @guarded
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.session.phase("optimizer")

    @guarded
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.session.phase("train")
        step = int(trainer.global_step)
        if self._global_step is not None and step > self._global_step:
            self._global_step = step
            self.session.step()

    def _evaluating(self, *_: Any) -> None:
        self.session.phase("evaluation")

    def _training(self, *_: Any) -> None:
        self.session.phase("train")  # a standalone evaluation simply ends on an unused mark

    on_validation_start = guarded(_evaluating)
    on_test_start = guarded(_evaluating)
    on_predict_start = guarded(_evaluating)
    on_validation_end = guarded(_training)
    on_test_end = guarded(_training)
    on_predict_end = guarded(_training)

    @guarded
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.session.tell_oom()

    @guarded
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.session.end()
