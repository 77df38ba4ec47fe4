"""Facts about the training state that ``oomdoctor run`` records with no code change.

At the end of the first :data:`FACT_STEPS` optimizer steps (a global hook,
``torch.optim.optimizer.register_optimizer_step_post_hook``, PyTorch >= 2.0), and again at every dump
(the end of a step window, the OOM, the exit), the recorder notes the storages that hold the
optimizer's parameters, their gradients and the optimizer's state on this rank's GPU, for every
optimizer the hook has seen. The accounting (:mod:`oomdoctor.analysis.accounting`) maps each storage to
the block that contains it at that moment, so those blocks are attributed from what the job held, not
from frames. The record of a dump (``"at": "dump"``) is noted right after ``_snapshot()`` returns and
describes the snapshot's final state: it holds whatever the ``max_entries`` ring buffer dropped, where
the step records of a long job lie before the trace's first event and cannot be placed.

Storages, not tensors: a parameter that is a view (FSDP1 ``use_orig_params``, DDP
``gradient_as_bucket_view``) is counted once, as the flat buffer it lives in. DTensors (FSDP2, TP) are
read through their local shard. Sidecar form (bytes, µs since the Unix epoch)::

    "tensors": [{"step": 1, "time_us": t,
                 "parameters": [[data_ptr, nbytes], ...],
                 "gradients": [[data_ptr, nbytes], ...],
                 "optimizer_state": [[data_ptr, nbytes], ...]}, ...,
                {"step": n, "time_us": t_dump, "at": "dump", ...}]

``oomdoctor preflight``'s sidecars add ``"workspaces": [[data_ptr, nbytes], ...]`` to each record: the cuBLAS
workspaces its tracer made (:func:`oomdoctor.preflight.snapshot.tensor_facts`).
"""

from __future__ import annotations

from typing import Any

FACT_STEPS = 2
"""Optimizer steps at whose end the storages are noted: the first creates the state lazily (Adam's
``exp_avg``/``exp_avg_sq``), the second shows it settled."""

KINDS = ("parameters", "gradients", "optimizer_state")


def _storage(t: Any, device: int) -> tuple[int, int] | None:
    """``(data_ptr, nbytes)`` of the storage under ``t`` when it lives on CUDA device ``device``."""
    local = getattr(t, "_local_tensor", None)  # DTensor (FSDP2, tensor parallel)
    if local is not None:
        t = local
    if not getattr(t, "is_cuda", False) or t.device.index != device:
        return None
    st = t.untyped_storage()
    n = int(st.nbytes())
    return (int(st.data_ptr()), n) if n > 0 else None


def optimizer_storages(optimizer: Any, device: int) -> dict[str, set[tuple[int, int]]]:
    """The storages of ``optimizer``'s parameters, their ``.grad`` and its ``state`` tensors on
    ``device``, each ``{(data_ptr, nbytes)}``. An object without ``param_groups`` gives empty sets."""
    out: dict[str, set[tuple[int, int]]] = {k: set() for k in KINDS}
    for group in getattr(optimizer, "param_groups", None) or ():
        for p in group.get("params", ()):
            s = _storage(p, device)
            if s is not None:
                out["parameters"].add(s)
            g = getattr(p, "grad", None)
            if g is not None and (s := _storage(g, device)) is not None:
                out["gradients"].add(s)
    for state in (getattr(optimizer, "state", None) or {}).values():
        if isinstance(state, dict):
            for v in state.values():
                if hasattr(v, "untyped_storage") and (s := _storage(v, device)) is not None:
                    out["optimizer_state"].add(s)
    return out


def fact_record(step: int, time_us: int, storages: dict[str, set[tuple[int, int]]]) -> dict[str, Any]:
    """The sidecar entry of one step (see the module doc); storages sorted by address."""
    return {"step": step, "time_us": time_us, **{k: sorted([a, n] for a, n in storages.get(k, ())) for k in KINDS}}
