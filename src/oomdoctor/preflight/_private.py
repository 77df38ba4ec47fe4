"""The private PyTorch APIs preflight relies on, looked up behind one check each: a torch without one stops
preflight with one line naming it and the torch version (:class:`PreflightError`), never an ``AttributeError``
deep in a trace.

Each entry says why preflight needs it. Tested with torch 2.11 (the lent GPUs) to 2.13 (CI); the oldest torch
with all of them is 2.6 (``torch.accelerator``'s stream query, ``register_optimizer_step_post_hook``).
"""

from __future__ import annotations

import importlib
from typing import Any

TESTED = "2.11 to 2.13"
MIN_TORCH = (2, 6)

#: dotted name -> why preflight needs it
PRIVATE = {
    "torch._C.StorageBase._expired": "whether a traced storage died, per live storage per op (the builtin under "
                                     "StorageWeakRef.expired)",
    "torch._C._current_autograd_node": "whether an op runs inside backward (the autograd engine's thread on CUDA)",
    "torch.optim.optimizer._get_foreach_kernels_supported_devices": "the optimizer's device lists, extended so "
                                                                   "foreach and fused kernels are picked as on CUDA",
    "torch.optim.optimizer._get_fused_kernels_supported_devices": "the optimizer's device lists (fused kernels)",
    "torch.optim.optimizer._foreach_supported_types": "the optimizer's tensor types for foreach kernels",
    "torch.utils._foreach_utils._get_foreach_kernels_supported_devices": "the foreach utilities' device lists",
    "torch.utils._foreach_utils._get_fused_kernels_supported_devices": "the foreach utilities' device lists",
    "torch.autograd.graph._engine_run_backward": "the autograd engine's entry, where backward's allocations are "
                                                 "the GPU's",
    "torch.utils.checkpoint._checkpoint_without_reentrant_generator": "non-reentrant checkpointing's recomputation, "
                                                                      "where CUDA's policies are entered again",
    "torch.testing._internal.distributed.fake_pg.FakeStore": "the fake process group a torchrun script joins "
                                                             "(--nproc-per-node)",
    "torch._C._functions.AccumulateGrad": "the autograd node that accumulates a leaf's .grad, told apart from the "
                                          "engine's accumulation of a node's input gradients",
    "torch._C._swap_tensor_impl": "a parameter moved to the GPU kept as the same object when swap_tensors refuses "
                                  "it for a reference an old graph holds (weight_norm's computed weight)",
}


class PreflightError(ValueError):
    """A job preflight cannot trace (bad config file, unsupported option, a torch without what it needs): one
    line, naming the input."""


def _version() -> tuple[int, int]:
    import torch

    try:
        major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    except ValueError:
        return MIN_TORCH
    return major, minor


def require(name: str) -> Any:
    """The object at the dotted ``name`` (a key of :data:`PRIVATE`).

    Raises:
        PreflightError: torch is older than :data:`MIN_TORCH`, or has no ``name``: one line naming both."""
    import torch

    if _version() < MIN_TORCH:
        raise PreflightError(f"preflight needs torch >= {'.'.join(map(str, MIN_TORCH))} (this is torch "
                             f"{torch.__version__}; tested with torch {TESTED})")
    parts = name.split(".")
    obj: Any = None
    for i in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        rest = parts[i:]
        break
    else:  # pragma: no cover - "torch" itself always imports here
        rest = parts
    try:
        for p in rest:
            obj = getattr(obj, p)
    except AttributeError:
        raise PreflightError(f"preflight needs {name} ({PRIVATE.get(name, 'a private torch API')}), which torch "
                             f"{torch.__version__} does not have (tested with torch {TESTED})") from None
    return obj
