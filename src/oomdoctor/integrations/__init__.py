"""oomdoctor where users train: one line added to a Trainer records, marks and diagnoses its memory.

- :class:`TrainerMemoryCallback` for Hugging Face ``transformers.Trainer``
  (``Trainer(..., callbacks=[TrainerMemoryCallback("memory/")])``), in :mod:`.huggingface`;
- :class:`LightningMemoryCallback` for PyTorch Lightning
  (``L.Trainer(callbacks=[LightningMemoryCallback("memory/")])``), in :mod:`.lightning`.

Both are built on :class:`~.session.MemorySession` (what they share: the recorder, step and phase
marks, the diagnosis). The framework is imported only when its callback is asked for: importing this
package needs neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .session import MemorySession

if TYPE_CHECKING:  # the lazy names, for the type checker (the frameworks are imported only when asked for)
    from .huggingface import TrainerMemoryCallback
    from .lightning import LightningMemoryCallback

_LAZY = {"TrainerMemoryCallback": "huggingface", "LightningMemoryCallback": "lightning"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LightningMemoryCallback", "MemorySession", "TrainerMemoryCallback"]
