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

Every optimizer (issue 54: a GAN's two, a teacher's none): each optimizer the hook sees gets its own records, at the
end of its own first :data:`FACT_STEPS` steps, whichever steps first, with ``"optimizer"`` (its index, in the
order first seen) and ``"class"`` (its class path); the dump's record merges them all (``"optimizers"``: how
many). A record holds only what lives on this rank's GPU.

Modules: at the end of the first optimizer step the recorder finds every ``torch.nn.Module`` that is no other
module's child (one pass over ``gc.get_objects()``, types only: no attribute of an object is read before its type
is known to be a module's), and notes each such root's parameters (``requires_grad`` or not) and registered
buffers, by walking the ``_modules`` / ``_parameters`` / ``_buffers`` dicts themselves (a subclass's
``named_parameters`` is never called). The roots are kept weakly and noted again at every dump. Sidecar form::

    "modules": [{"step": 1, "time_us": t, "at"?: "dump",
                 "roots": [{"class": "pkg.module.Class", "parts": [["encoder_k", "torch.nn...Sequential"], ...],
                            "parameters": [[data_ptr, nbytes, part], ...],   # requires_grad, with a .grad
                            "gradients": [[data_ptr, nbytes, part], ...],    # those .grad
                            "untouched": [[data_ptr, nbytes, part], ...],    # requires_grad, no .grad
                            "frozen": [[data_ptr, nbytes, part], ...],       # requires_grad=False
                            "buffers": [[data_ptr, nbytes, part], ...]}]}]  # register_buffer

A parameter that requires gradients but had none when noted is ``untouched``: an EMA copy made by ``deepcopy``
(never in a loss), or a trained one whose gradients were already cleared; the accounting counts it as a copy only
when no optimizer steps it and no record saw it with a gradient.

``part`` indexes ``parts`` (the root's direct children, by name and class path), -1 for the root's own. A storage
shared by two roots (a tied weight, a module in two containers) is listed under the first root that holds it.
"""

from __future__ import annotations

from typing import Any

FACT_STEPS = 2
"""Optimizer steps at whose end the storages are noted: the first creates the state lazily (Adam's
``exp_avg``/``exp_avg_sq``), the second shows it settled."""

KINDS = ("parameters", "gradients", "optimizer_state")
MODULE_KINDS = ("parameters", "gradients", "untouched", "frozen", "buffers")
"""The lists of a root module's record (see the module doc)."""


HOST = "cpu"
"""The ``device`` that stands for the host's own memory: the recorder's tests on a torch without CUDA note CPU tensors
(the recorder itself always passes a CUDA device index)."""


def _storage(t: Any, device: int | str) -> tuple[int, int] | None:
    """``(data_ptr, nbytes)`` of the storage under ``t`` when it lives on CUDA device ``device`` (an index), or on
    the host when ``device`` is :data:`HOST`."""
    local = getattr(t, "_local_tensor", None)  # DTensor (FSDP2, tensor parallel)
    if local is not None:
        t = local
    if device == HOST:
        if getattr(getattr(t, "device", None), "type", None) != "cpu" or not hasattr(t, "untyped_storage"):
            return None
    elif not getattr(t, "is_cuda", False) or t.device.index != device:
        return None
    st = t.untyped_storage()
    n = int(st.nbytes())
    return (int(st.data_ptr()), n) if n > 0 else None


def optimizer_storages(optimizer: Any, device: int | str) -> dict[str, set[tuple[int, int]]]:
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


def fact_record(step: int, time_us: int, storages: dict[str, set[tuple[int, int]]],
                **extra: Any) -> dict[str, Any]:
    """The sidecar entry of one step (see the module doc); storages sorted by address; ``extra`` keys (``optimizer``,
    ``class``, ``at``, ``optimizers``) after them."""
    return {"step": step, "time_us": time_us, **{k: sorted([a, n] for a, n in storages.get(k, ())) for k in KINDS},
            **extra}


def class_path(obj: Any) -> str:
    """``module.QualName`` of ``obj``'s type (``type()``: no attribute of ``obj`` is read)."""
    cls = type(obj)
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls.__name__)}"


def _children(module: Any) -> list[tuple[str, Any]]:
    """``(name, child)`` of a module's ``_modules`` dict (None entries dropped), read from the instance's own dict."""
    mods = vars(module).get("_modules") if hasattr(module, "__dict__") else None
    return [(str(k), v) for k, v in mods.items() if v is not None] if isinstance(mods, dict) else []


def _own(module: Any, key: str) -> list[Any]:
    d = vars(module).get(key) if hasattr(module, "__dict__") else None
    return [v for v in d.values() if v is not None] if isinstance(d, dict) else []


def module_roots(objects: Any, module_type: type) -> list[Any]:
    """The modules among ``objects`` (``gc.get_objects()``) that no other of them holds as a child, in the order
    found. Types are tested with ``issubclass(type(o), module_type)``: a proxy's ``__class__`` is never asked."""
    mods = [o for o in objects if issubclass(type(o), module_type)]
    child: set[int] = set()
    for m in mods:
        child.update(id(c) for _n, c in _children(m))
    return [m for m in mods if id(m) not in child]


def module_record(roots: list[Any], device: int | str, seen: set[tuple[int, int]] | None = None,
                  storage: Any = None) -> list[dict]:
    """The sidecar's ``roots`` (see the module doc) for ``roots``: each root's parameters (split by
    ``requires_grad``) and buffers on ``device``, each storage once (``seen``, shared across roots). Roots with
    nothing on ``device`` are left out. ``storage``: ``tensor -> (address, nbytes) | None``, where the addresses are
    not the tensors' own (preflight's fake GPU: its tracer's addresses); by default the storage's on ``device``."""
    seen = set() if seen is None else seen
    where = storage if storage is not None else (lambda t: _storage(t, device))
    out = []
    for root in roots:
        parts = _children(root)
        rec: dict[str, Any] = {"class": class_path(root), "parts": [[n, class_path(c)] for n, c in parts],
                               **{k: [] for k in MODULE_KINDS}}
        for part, top in [(-1, root)] + [(i, c) for i, (_n, c) in enumerate(parts)]:
            stack, visited = [top], set()
            while stack:
                m = stack.pop()
                if id(m) in visited:
                    continue
                visited.add(id(m))
                if part == -1 and m is not root:
                    continue  # the root's own tensors only; its children are walked as parts
                for p in _own(m, "_parameters"):
                    s = where(p)
                    if s is not None and s not in seen:
                        seen.add(s)
                        g = getattr(p, "grad", None) if getattr(p, "requires_grad", False) else None
                        gs = where(g) if g is not None else None
                        kind = ("parameters" if gs is not None else "untouched") if getattr(
                            p, "requires_grad", False) else "frozen"
                        rec[kind].append([*s, part])
                        if gs is not None and gs not in seen:
                            seen.add(gs)
                            rec["gradients"].append([*gs, part])
                for b in _own(m, "_buffers"):
                    s = where(b)
                    if s is not None and s not in seen:
                        seen.add(s)
                        rec["buffers"].append([*s, part])
                if part != -1:
                    stack.extend(c for _n, c in _children(m))
        if any(rec[k] for k in MODULE_KINDS):
            for k in MODULE_KINDS:
                rec[k].sort()
            out.append(rec)
    return out
