"""``oomdoctor.preflight(model_fn, step_fn, batch_fn, gpu=...)``: the package is callable.

The package's class is :class:`CallablePackage`, whose ``__call__`` hands to the root API
(:func:`oomdoctor._preflight`), which traces, replays and answers. An entry point, like the sitecustomize
``oomdoctor run`` injects: it is the one module of this package that reaches the top layer, at call time
(``tests/unit/test_layers.py`` ``ENTRY_POINTS``).
"""

from __future__ import annotations

import types
from typing import Any


class CallablePackage(types.ModuleType):
    """The ``oomdoctor.preflight`` package, callable as :func:`oomdoctor._preflight`."""

    def __call__(self, model_fn: Any, step_fn: Any, batch_fn: Any, **kwargs: Any) -> Any:
        from .. import _preflight

        return _preflight(model_fn, step_fn, batch_fn, **kwargs)
