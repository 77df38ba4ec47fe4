"""Preflight: trace a training step on a CPU under fake tensors, as the CUDA caching allocator would see it,
and write it as a memory snapshot every command reads (issue 42; ``docs/preflight.md``).

Imports torch (the ``preflight`` extra); sits at the capture layer: it writes snapshots, the
answers (replay, breakdown, largest micro-batch) come from :mod:`oomdoctor.report.preflight`.

- :mod:`.tracer`: the allocation tracer and CUDA's behaviour applied over fake CPU tensors;
- :mod:`.steps`: the steps traced (any ``nn.Module``; Hugging Face Trainer's);
- :mod:`.snapshot`: the snapshot and sidecar, the GPU table and what runs outside the allocator.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from ._entry import CallablePackage

sys.modules[__name__].__class__ = CallablePackage  # oomdoctor.preflight(model_fn, step_fn, batch_fn, gpu=...)


def hf_tracer(job: Any, *, gpu_name: str | None, gpu_total_bytes: int, sm_major: int = 9,
              config: Any = None) -> Callable[[int | None], tuple[dict, dict, Any]]:
    """``f(n)``: trace ``job`` (a :class:`.steps.HfJob`) at micro-batch ``n`` (None: the job's) and return
    ``(snapshot dict, sidecar dict, TraceRecord)``. Raises :class:`.steps.PreflightError` for a config
    that cannot be read."""
    import dataclasses

    import torch

    from ..plan.gpus import gpu_sms
    from .snapshot import cublas_workspace_bytes, sidecar, snapshot_dict
    from .steps import load_config, trace_hf
    from .target import target_gpu

    cfg = config if config is not None else load_config(job.config)

    def f(n: int | None) -> tuple[dict, dict, Any]:
        j = job if n is None else dataclasses.replace(job, micro_batch=n)
        with target_gpu(sm_major, sms=gpu_sms(gpu_name)):
            rec = trace_hf(j, config=cfg, cublas_workspace_bytes=cublas_workspace_bytes(sm_major))
        meta = sidecar(rec, gpu_name=gpu_name, gpu_total_bytes=gpu_total_bytes, torch_version=torch.__version__,
                       micro_batch=j.micro_batch, job=j.as_dict())
        meta["world_size"] = j.world_size
        return snapshot_dict(rec), meta, rec

    return f


def module_tracer(model_fn: Callable, step_fn: Callable, batch_fn: Callable, *, optimizer_fn: Callable | None = None,
                  steps: int = 2, gpu_name: str | None, gpu_total_bytes: int, sm_major: int = 9
                  ) -> Callable[[int | None], tuple[dict, dict, Any]]:
    """As :func:`hf_tracer` for any module (:func:`.steps.trace_module`): ``batch_fn(n)`` builds a
    micro-batch of ``n`` samples, or ``batch_fn()`` when ``n`` is None."""
    import torch

    from ..plan.gpus import gpu_sms
    from .snapshot import cublas_workspace_bytes, sidecar, snapshot_dict
    from .steps import trace_module  # pyright: ignore[reportAssignmentType] (Python binds .steps on the package, not the local steps)
    from .target import target_gpu

    def f(n: int | None) -> tuple[dict, dict, Any]:
        with target_gpu(sm_major, sms=gpu_sms(gpu_name)):
            rec = trace_module(model_fn, step_fn, (lambda: batch_fn(n)) if n is not None else batch_fn,
                               optimizer_fn=optimizer_fn, steps=steps,
                               cublas_workspace_bytes=cublas_workspace_bytes(sm_major))
        meta = sidecar(rec, gpu_name=gpu_name, gpu_total_bytes=gpu_total_bytes, torch_version=torch.__version__,
                       micro_batch=n, job={"model_fn": getattr(model_fn, "__qualname__", str(model_fn)),
                                           "steps": steps})
        return snapshot_dict(rec), meta, rec

    return f
