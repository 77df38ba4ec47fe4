"""``oomdoctor preflight``: trace a training step on the CPU under fake tensors and predict its GPU memory."""

from __future__ import annotations

import click

from ..errors import UsageError, install_hint
from ..render.protocol import formats
from .output import FILE, OUTPUT, check_output, emit, write_bytes


@click.command("preflight", context_settings={"allow_interspersed_args": False})
@click.option("--hf-config", "hf_config", metavar="PATH",
              help="A Hugging Face config.json (or a directory holding one): a causal LM built with random weights.")
@click.option("--micro-batch", type=click.IntRange(min=1), help="Samples per forward pass (--hf-config).")
@click.option("--seq-len", type=click.IntRange(min=1), help="Tokens per sample (--hf-config).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True,
              help="Autocast dtype, as Trainer's bf16=True / fp16=True (fp32: no autocast).")
@click.option("--optimizer", type=click.Choice(["adamw", "adamw8bit", "sgd"]), default="adamw", show_default=True)
@click.option("--gradient-checkpointing", is_flag=True)
@click.option("--loop", type=click.Choice(["trainer", "accelerate"]), default="trainer", show_default=True,
              help="transformers.Trainer's step, or accelerate's README loop (no clipping, AdamW's defaults).")
@click.option("--grad-accum", type=click.IntRange(min=1), default=1, show_default=True,
              help="Micro-batches per optimizer step (gradient accumulation).")
@click.option("--steps", type=click.IntRange(min=1), default=2, show_default=True,
              help="Training steps traced (a script: its optimizer steps; it is stopped after the last).")
@click.option("--nproc-per-node", "nproc", type=click.IntRange(min=1), default=None, metavar="N",
              help="A script launched by torchrun on N GPUs (1 too: torchrun's variables set): rank 0 traced, in a "
                   "fake process group (every collective faked); NCCL's buffers counted outside the allocator.")
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True, metavar="R",
              help="With --nproc-per-node: the rank traced (RANK and LOCAL_RANK as torchrun sets them).")
@click.option("--ddp", "world_size", type=click.IntRange(min=1), default=1, metavar="WORLD_SIZE",
              help="DistributedDataParallel over this many GPUs (torchrun): one rank traced, with DDP's gradient "
                   "buckets and output clones; NCCL's buffers counted outside the allocator.")
@click.option("--gpu", metavar="NAME", help="H100-80GB, H200, A100-80GB, A100-40GB, B200 [default: H100-80GB].")
@click.option("--gpu-memory", metavar="SIZE", help="The GPU's total memory instead: 80GiB, 80GB, or bytes.")
@click.option("--no-search", is_flag=True, help="Do not look for the largest micro-batch (one trace only).")
@click.option("--format", "fmt", type=click.Choice(formats("preflight")), default="text", show_default=True,
              help="The answer's format.")
@click.option("--fail-on-oom", is_flag=True,
              help="Exit 1, with one line on standard error, when the job (at its own micro-batch) is predicted "
                   "to run out of memory: a gate for CI.")
@click.option("-o", "--output", "snapshot", type=OUTPUT,
              help="Write the traced snapshot here, laid out by the allocator model (its .meta.json beside a "
                   "regular file; replaced atomically; - for standard output with --report-output).")
@click.option("--report-output", "report", type=OUTPUT, metavar="PATH",
              help="Write the answer (--format) to this file instead of standard output (- for standard output).")
@click.argument("script", nargs=-1, type=click.UNPROCESSED, metavar="[-- python train.py ARGS...]")
def command(hf_config: str | None, micro_batch: int | None, seq_len: int | None, dtype: str, optimizer: str,
            gradient_checkpointing: bool, loop: str, grad_accum: int, steps: int, nproc: int | None, rank: int,
            world_size: int,
            gpu: str | None, gpu_memory: str | None, no_search: bool, fmt: str, fail_on_oom: bool,
            snapshot: str | None, report: str | None, script: tuple[str, ...]) -> int:
    """Trace a Hugging Face Trainer step (--hf-config), or your own script (-- python train.py ...), on the
    CPU (no GPU, no memory for tensors) and predict, for a GPU: peak allocated and reserved, OOM or not, the
    largest micro-batch that fits (--hf-config), what allocator settings do, and the breakdown. Needs torch
    (and transformers for --hf-config): pip install torch transformers."""
    _check_outputs(snapshot, report)
    if script:
        torchrun, nproc = nproc is not None, nproc or 1
        if rank >= nproc:
            raise UsageError(f"--rank {rank}: not a rank of --nproc-per-node {nproc} (0 to {nproc - 1})")
        a = _script(script, steps=steps, nproc=nproc, torchrun=torchrun, rank=rank, gpu=gpu, gpu_memory=gpu_memory,
                    snapshot=snapshot, hf_config=hf_config)
        emit(report, "preflight", fmt, a)
        return _gate(a, fail_on_oom)
    if not hf_config or not micro_batch or not seq_len:
        raise UsageError("preflight: give --hf-config with --micro-batch and --seq-len, or a script after --")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise UsageError(f"preflight needs torch and transformers ({e.name} is missing): "
                         f"{install_hint('preflight')}") from None
    from ..plan.terms import outside_allocator_bytes
    from ..preflight import hf_tracer
    from ..preflight.steps import HfJob, PreflightError
    from ..report.preflight import answer

    name, total, sm = _gpu(gpu, gpu_memory)
    job = HfJob(hf_config, micro_batch, seq_len, dtype, optimizer, gradient_checkpointing, steps,
                world_size=world_size, loop=loop, grad_accum=grad_accum)
    outside = outside_allocator_bytes(world_size)
    try:
        f = hf_tracer(job, gpu_name=name, gpu_total_bytes=total, sm_major=sm)
        a = answer(f, write=_write_snapshot, micro_batch=micro_batch, gpu_name=name, gpu_total_bytes=total,
                   outside_bytes=outside, outside_source=_outside_source(world_size),
                   snapshot_path=snapshot, search=not no_search, gpu_memory_given=bool(gpu_memory))
    except PreflightError as e:
        raise UsageError(str(e)) from None
    except OSError as e:  # writing -o failed (disk full): the previous file is left untouched
        raise UsageError(f"{snapshot}: cannot write ({e.strerror or e})") from None
    emit(report, "preflight", fmt, a)
    return _gate(a, fail_on_oom)


def _gate(a, fail_on_oom: bool) -> int:
    """``--fail-on-oom``: 1, with its one line on standard error, when ``a`` (a PreflightAnswer) ran out of memory."""
    if not (fail_on_oom and a.oom):
        return 0
    from ..render.gate import preflight_oom_line

    click.echo(preflight_oom_line(a), err=True)
    return 1


def _outside_source(world_size: int) -> str:
    """The id of what runs outside the caching allocator (``PreflightAnswer.outside_allocator_source``)."""
    return "cuda-context+nccl" if world_size > 1 else "cuda-context"


def _check_outputs(snapshot: str | None, report: str | None) -> None:
    """Refuse, before any trace, an ``-o`` or a ``--report-output`` that cannot be written to: what every command's
    ``-o`` refuses (:func:`oomdoctor.cli.output.check_output`: a directory, a name in a missing directory), and
    standard output for both the snapshot and the answer."""
    if snapshot == "-" and report in (None, "-"):
        raise UsageError("preflight -o -: the answer goes to standard output; give a file for the snapshot, or "
                         "--report-output FILE for the answer")
    check_output(snapshot)
    check_output(report)


def _write_snapshot(path: str, snap: dict, meta: dict) -> None:
    """Write a snapshot and, beside a regular file, its sidecar, through the one output helper (``-o``: a link
    followed, a FIFO or device written as a stream and then no sidecar, ``-`` standard output)."""
    from ..capture.files import sidecar_for
    from ..preflight.snapshot import sidecar_bytes

    if emit(path, "preflight snapshot", "pickle", snap).kind == FILE:
        write_bytes(sidecar_for(path), sidecar_bytes(meta))


def _gpu(gpu: str | None, gpu_memory: str | None) -> tuple[str | None, int, int]:
    """``(name, total bytes, compute capability major)`` of ``--gpu`` / ``--gpu-memory``
    (:func:`oomdoctor.plan.gpus.resolve_gpu`; the H100-80GB when neither is given)."""
    from ..plan.gpus import resolve_gpu

    return resolve_gpu(gpu, gpu_memory)


def _script(argv: tuple[str, ...], *, steps: int, nproc: int, torchrun: bool = False, rank: int = 0, gpu: str | None, gpu_memory: str | None,
            snapshot: str | None, hf_config: str | None) -> object:
    """``oomdoctor preflight -- python train.py ...``: the script traced (:mod:`oomdoctor.preflight.script`)."""
    import os

    if hf_config:
        raise UsageError("give --hf-config or a script after --, not both")
    args = list(argv)
    if args and os.path.basename(args[0]).startswith("python"):
        args = args[1:]
    if not args or (not args[0].endswith(".py") and args[0] != "-m"):
        raise UsageError(f"preflight -- {' '.join(argv)}: give a Python script (python train.py ARGS...) "
                         "or python -m MODULE")
    try:
        import torch
    except ImportError:
        raise UsageError(f"preflight needs torch: {install_hint('preflight')}") from None
    from ..plan.terms import outside_allocator_bytes
    from ..preflight.script import ScriptJob, trace_script
    from ..preflight.snapshot import (
        cublas_workspace_bytes,
        sidecar,
        snapshot_dict,
    )
    from ..preflight.steps import PreflightError
    from ..report.preflight import answer

    name, total, sm = _gpu(gpu, gpu_memory)
    job = ScriptJob(tuple(args), max_steps=steps, world_size=nproc, rank=rank, torchrun=torchrun)
    outside = outside_allocator_bytes(nproc)

    def f(n: int | None) -> tuple[dict, dict, object]:
        rec = trace_script(job, gpu_name=name or "GPU", gpu_total_bytes=total, sm_major=sm,
                           cublas_workspace_bytes=cublas_workspace_bytes(sm))
        meta = sidecar(rec, gpu_name=name, gpu_total_bytes=total, torch_version=torch.__version__, micro_batch=None,
                       job=job.as_dict())
        meta["world_size"] = nproc
        meta["rank"] = meta["local_rank"] = rank
        return snapshot_dict(rec), meta, rec

    try:
        a = answer(f, write=_write_snapshot, micro_batch=None, gpu_name=name, gpu_total_bytes=total,
                   outside_bytes=outside, outside_source=_outside_source(nproc), snapshot_path=snapshot,
                   search=False, gpu_memory_given=bool(gpu_memory))
    except PreflightError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"{snapshot}: cannot write ({e.strerror or e})") from None
    # a script's foreach step counters are made on the host, as on CUDA: not recorded, nothing left out
    a.not_traced = [k for k in a.not_traced if k != "cpu_resident_optimizer_steps"]
    return a
