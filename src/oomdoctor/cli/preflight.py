"""``oomdoctor preflight``: trace a training step on the CPU under fake tensors and predict its GPU memory."""

from __future__ import annotations

import click

from ..errors import UsageError
from ..units import parse_bytes
from .inputs import write_output


@click.command("preflight")
@click.option("--hf-config", "hf_config", metavar="PATH", required=True,
              help="A Hugging Face config.json (or a directory holding one): a causal LM built with random weights.")
@click.option("--micro-batch", type=click.IntRange(min=1), required=True, help="Samples per forward pass.")
@click.option("--seq-len", type=click.IntRange(min=1), required=True, help="Tokens per sample.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True,
              help="Autocast dtype, as Trainer's bf16=True / fp16=True (fp32: no autocast).")
@click.option("--optimizer", type=click.Choice(["adamw", "adamw8bit", "sgd"]), default="adamw", show_default=True)
@click.option("--gradient-checkpointing", is_flag=True)
@click.option("--loop", type=click.Choice(["trainer", "accelerate"]), default="trainer", show_default=True,
              help="transformers.Trainer's step, or accelerate's README loop (no clipping, AdamW's defaults).")
@click.option("--grad-accum", type=click.IntRange(min=1), default=1, show_default=True,
              help="Micro-batches per optimizer step (gradient accumulation).")
@click.option("--steps", type=click.IntRange(min=1), default=2, show_default=True, help="Training steps traced.")
@click.option("--ddp", "world_size", type=click.IntRange(min=1), default=1, metavar="WORLD_SIZE",
              help="DistributedDataParallel over this many GPUs (torchrun): one rank traced, with DDP's gradient "
                   "buckets and output clones; NCCL's buffers counted outside the allocator.")
@click.option("--gpu", metavar="NAME", help="H100-80GB, H200, A100-80GB, A100-40GB, B200 [default: H100-80GB].")
@click.option("--gpu-memory", metavar="SIZE", help="The GPU's total memory instead: 80GiB, 80GB, or bytes.")
@click.option("--no-search", is_flag=True, help="Do not look for the largest micro-batch (one trace only).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("-o", "--output", "snapshot", type=click.Path(dir_okay=False, path_type=str),
              help="Write the traced snapshot here (and its .meta.json beside it).")
def command(hf_config: str, micro_batch: int, seq_len: int, dtype: str, optimizer: str, gradient_checkpointing: bool,
            loop: str, grad_accum: int, steps: int, world_size: int, gpu: str | None, gpu_memory: str | None, no_search: bool, fmt: str,
            snapshot: str | None) -> None:
    """Trace a Hugging Face Trainer step on the CPU (no GPU, no memory for tensors) and predict, for a GPU:
    peak allocated and reserved, OOM or not, the largest micro-batch that fits, what allocator settings do,
    and the breakdown. Needs torch and transformers (pip install 'oomdoctor[preflight]')."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise UsageError(f"preflight needs torch and transformers ({e.name} is missing): "
                         "pip install 'oomdoctor[preflight]'") from None
    from ..preflight import hf_tracer
    from ..preflight.snapshot import CUDA_CONTEXT_BYTES, GPUS, NCCL_FIRST_COMMUNICATOR_BYTES
    from ..preflight.snapshot import gpu_memory as gpu_by_name
    from ..preflight.snapshot import write as write_snapshot
    from ..preflight.steps import HfJob, PreflightError
    from ..render.preflight import render_preflight_json, render_preflight_text
    from ..report.preflight import answer

    if gpu and gpu_memory:
        raise UsageError("give --gpu or --gpu-memory, not both")
    name = gpu or ("H100-80GB" if not gpu_memory else None)
    sm = 9
    if gpu_memory:
        try:
            total = parse_bytes(gpu_memory)
        except Exception:  # noqa: BLE001 - any parse failure is the user's input
            raise UsageError(f"--gpu-memory {gpu_memory!r}: not a size (80GiB, 80GB or bytes)") from None
    else:
        try:
            total = gpu_by_name(name)
        except KeyError:
            raise UsageError(f"--gpu {name!r}: unknown; one of {', '.join(GPUS)} (or give --gpu-memory)") from None
        sm = next(v[1] for k, v in GPUS.items() if k.lower() == name.lower())
    job = HfJob(hf_config, micro_batch, seq_len, dtype, optimizer, gradient_checkpointing, steps,
                world_size=world_size, loop=loop, grad_accum=grad_accum)
    outside = CUDA_CONTEXT_BYTES + (NCCL_FIRST_COMMUNICATOR_BYTES if world_size > 1 else 0)
    source = ("CUDA context and kernels, 737 MB measured on H200, CUDA 13.0, torch 2.11"
              + ("; NCCL's world communicator, 883 MB measured (same run)" if world_size > 1 else ""))
    try:
        f = hf_tracer(job, gpu_name=name, gpu_total_bytes=total, sm_major=sm)
        a = answer(f, write=write_snapshot, micro_batch=micro_batch, gpu_name=name, gpu_total_bytes=total,
                   outside_bytes=outside, outside_source=source,
                   snapshot_path=snapshot, search=not no_search)
    except PreflightError as e:
        raise UsageError(str(e)) from None
    write_output(None, render_preflight_json(a) if fmt == "json" else render_preflight_text(a))
