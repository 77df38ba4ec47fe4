"""``oomdoctor.preflight(model_fn, step_fn, batch_fn, gpu=...)``, the package called as a function: trace, replay
through the allocator model (:func:`oomdoctor.report.preflight.answer`), answer.

Preflight is a layer of its own above the report (pyproject.toml, ``[tool.importlinter]``): this module reads the
report's answer, and nothing of the core imports preflight.
"""

from __future__ import annotations


def preflight(model_fn, step_fn, batch_fn, *, gpu="H100-80GB", micro_batch=None, optimizer_fn=None, steps=2,
               snapshot=None, search=True):
    """``oomdoctor.preflight(model_fn, step_fn, batch_fn, gpu=...)``: trace ``steps`` training steps of any
    ``nn.Module`` on the CPU under fake tensors (no GPU, no memory for tensors) and predict its memory on
    ``gpu``. Needs torch (``pip install torch``; from a checkout of oomdoctor, ``pip install '.[preflight]'``).

    Args:
        model_fn: ``() -> nn.Module``, built on the CPU (it runs under ``FakeTensorMode``).
        step_fn: ``(model, optimizer, batch) -> None``: forward, backward, ``optimizer.step()``, ``zero_grad``.
        batch_fn: ``(n) -> batch`` of ``n`` samples when ``micro_batch`` is given, else ``() -> batch``.
        gpu: a name (``H100-80GB``, ``H200``, ``A100-80GB``, ``A100-40GB``, ``B200``), or its total memory
            in bytes (int) or as a size (``"80GiB"``).
        micro_batch: the samples per step, to search the largest that fits (``search``).
        optimizer_fn: ``(model) -> optimizer`` (default ``torch.optim.AdamW``, foreach as on CUDA).
        snapshot: write the traced snapshot (and its ``.meta.json``) here.

    Returns:
        :class:`~oomdoctor.report.preflight.PreflightAnswer` (bytes): ``peak_allocated_bytes``,
        ``peak_reserved_bytes``, ``oom``, ``largest_micro_batch``, ``breakdown``, ``settings``.

    Raises:
        UsageError: an unknown GPU name or size.
    """
    from ..plan.gpus import resolve_gpu
    from ..report.preflight import answer
    from . import module_tracer
    from .snapshot import CUDA_CONTEXT_BYTES
    from .snapshot import write as write_snapshot

    name, total, sm = resolve_gpu(gpu, gpu_flag="gpu=", memory_flag="gpu=")
    f = module_tracer(model_fn, step_fn, batch_fn, optimizer_fn=optimizer_fn, steps=steps, gpu_name=name,
                      gpu_total_bytes=total, sm_major=sm)
    return answer(f, write=write_snapshot, micro_batch=micro_batch, gpu_name=name, gpu_total_bytes=total, outside_bytes=CUDA_CONTEXT_BYTES,
                  outside_source="cuda-context",
                  snapshot_path=None if snapshot is None else str(snapshot), search=search and micro_batch is not None)
