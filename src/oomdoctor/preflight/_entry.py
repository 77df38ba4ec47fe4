"""``oomdoctor.preflight(model_fn, step_fn, batch_fn, gpu=...)``: the package is callable.

The package's class is :class:`CallablePackage`, whose ``__call__`` hands to
:func:`oomdoctor.preflight.api.preflight`, which traces, replays and answers: an import within the package, at call time (torch is imported only then).
"""

from __future__ import annotations

import types
from typing import Any


class CallablePackage(types.ModuleType):
    """The ``oomdoctor.preflight`` package, callable as :func:`oomdoctor.preflight.api.preflight`."""

    def __call__(self, model_fn: Any, step_fn: Any, batch_fn: Any, **kwargs: Any) -> Any:
        from .api import preflight

        return preflight(model_fn, step_fn, batch_fn, **kwargs)
