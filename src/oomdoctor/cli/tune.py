"""``oomdoctor tune``: the fastest configuration that fits, its memory predicted by preflight's traces on the CPU,
its throughput by a cost model, and on a GPU measured by short real runs of the top candidates. The decisions are
in :mod:`oomdoctor.report.tune`, the traces and runs in :mod:`.tune_exec`, the words in :mod:`oomdoctor.render.tune`.
Exit code 0 with an answer; 1 when nothing fits; 2 for bad input."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import click

from ..errors import UsageError, install_hint
from ..ids import TuneNote
from ..render.protocol import formats
from ..report.tune import (
    ALLOCATORS,
    MAX_TRACES,
    OPTIMIZER_CHANGES,
    OPTIMIZER_KERNELS,
    TuneError,
    parse_knob,
    powers_of_two,
)
from .output import OUTPUT, check_output, emit


def _list(text: str | None) -> list[str]:
    return [] if text is None else [x.strip() for x in text.split(",")]


def _micro_batches(text: str | None, per_gpu: int) -> list[int]:
    """``--micro-batch``: ``A..B`` (powers of two and B), a list, or by default every power of two up to the
    per-GPU batch."""
    if text is None:
        return powers_of_two(1, max(per_gpu, 1))
    k = parse_knob(f"micro_batch={text}")
    try:
        return [int(v) for v in k.values]
    except ValueError:
        raise TuneError(f"--micro-batch {text!r}: integers, or A..B") from None


@click.command("tune", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--hf-config", "hf_config", metavar="PATH",
              help="A Hugging Face config.json: the Trainer job preflight traces (a causal LM, random weights).")
@click.option("--seq-len", type=click.IntRange(min=1), help="Tokens per sample (--hf-config).")
@click.option("--global-batch", type=click.IntRange(min=1),
              help="Samples per optimizer step over all GPUs, kept: micro-batch x accumulation x GPUs.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True)
@click.option("--gpu", metavar="NAME", help="H100-80GB, H200, A100-80GB, A100-40GB, B200 [default: H100-80GB].")
@click.option("--gpu-memory", metavar="SIZE", help="The GPU's total memory instead: 80GiB, 80GB, or bytes.")
@click.option("--nproc-per-node", "nproc", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
              help="GPUs (torchrun --nproc_per_node): DDP for --hf-config; a script's world size.")
@click.option("--micro-batch", "micro_batch", metavar="LIST",
              help="Micro-batches searched: A..B (powers of two, and B) or 1,2,3 [default: 1..global batch / GPUs].")
@click.option("--checkpointing", default="none,full,every-2", show_default=True, metavar="LIST",
              help="Activation checkpointing: none, full, every-K (every K-th decoder layer).")
@click.option("--optimizer", default=None, metavar="LIST",
              help="AdamW's kernels: fused, foreach, for-loop (the same mathematics) [default: all three]; "
                   "adamw8bit, sgd with --allow-optimizer-change.")
@click.option("--allow-optimizer-change", is_flag=True,
              help="Also search optimizers whose mathematics differ (8-bit AdamW states, SGD).")
@click.option("--allocator", default=",".join(ALLOCATORS), show_default=True, metavar="LIST",
              help="PYTORCH_ALLOC_CONF settings searched ('defaults': none); every trace replays under each.")
@click.option("--knob", "knobs", multiple=True, metavar="NAME=VALUES",
              help="A script's knob, filling {NAME} in the command: NAME=1..512 (powers of two) or NAME=a,b,c. "
                   "Repeat for each.")
@click.option("--batch-knob", default=None, metavar="NAME",
              help="The knob that is the micro-batch [default: mb, when there is one].")
@click.option("--top", "top_k", type=click.IntRange(min=0), default=3, show_default=True,
              help="Candidates run for real on the GPU (the fastest predicted that fit; 0: none).")
@click.option("--steps", type=click.IntRange(min=1), default=5, show_default=True,
              help="Optimizer steps timed in each run, after the warm-up.")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True,
              help="Optimizer steps each run takes before the timed ones.")
@click.option("--no-run", is_flag=True, help="Do not run on the GPU: rank by the cost model only.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None,
              help="Traces at once, each in its own process [default: the CPUs, at most 8].")
@click.option("--max-traces", type=click.IntRange(min=0), default=MAX_TRACES, show_default=True,
              help="Traces after each memory class's first two.")
@click.option("--out", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Directory for the runs' logs [default: ./oomdoctor-tune-<time>].")
@click.option("--trial-timeout", type=click.FloatRange(min=1), default=None,
              help="Seconds a run may take before it is killed (counted as failed).")
@click.option("--format", "fmt", type=click.Choice(formats("tune")), default="text", show_default=True)
@click.option("-o", "--output", type=OUTPUT, help="Write to this file (- for standard output).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[-- python train.py ... {mb} ...]")
def command(hf_config: str | None, seq_len: int | None, global_batch: int | None, dtype: str, gpu: str | None,
            gpu_memory: str | None, nproc: int, micro_batch: str | None, checkpointing: str, optimizer: str | None,
            allow_optimizer_change: bool, allocator: str, knobs: tuple[str, ...], batch_knob: str | None,
            top_k: int, steps: int, warmup: int, no_run: bool, jobs: int | None, max_traces: int, out: str | None,
            trial_timeout: float | None, fmt: str, output: str | None, command: tuple[str, ...]) -> None:
    """Find the fastest configuration that fits: micro-batch x gradient accumulation (keeping the global batch),
    activation checkpointing, AdamW's kernels and allocator settings for a Trainer job (--hf-config), or the knobs
    of a script. Memory comes from preflight's traces on the CPU; on a GPU the top candidates run for real and the
    measured fastest is the answer.

    \b
    Examples:
      oomdoctor tune --hf-config config.json --seq-len 1024 --global-batch 64 \\
          --gpu H100-80GB
      oomdoctor tune --knob mb=1..512 --knob ac=none,full -- \\
          python train.py --bs {mb} --checkpointing {ac}
    """
    try:
        return _tune(**locals())
    except TuneError as e:
        raise UsageError(str(e)) from None


def _tune(hf_config: str | None, seq_len: int | None, global_batch: int | None, dtype: str, gpu: str | None,
          gpu_memory: str | None, nproc: int, micro_batch: str | None, checkpointing: str, optimizer: str | None,
          allow_optimizer_change: bool, allocator: str, knobs: tuple[str, ...], batch_knob: str | None, top_k: int,
          steps: int, warmup: int, no_run: bool, jobs: int | None, max_traces: int, out: str | None,
          trial_timeout: float | None, fmt: str, output: str | None, command: tuple[str, ...]) -> None:
    check_output(output)  # refused now, not after the trials
    from ..report.preflight import room
    from ..report.tune import candidates, check_budget, gpu_spec, hf_space, script_space, tune
    from .preflight import _gpu
    from .tune_exec import (
        TraceJob,
        Tracer,
        gpu_count,
        hf_command,
        run_candidates,
        space_parameter_bytes,
        substitute,
    )

    argv = list(command[1:] if command and command[0] == "--" else command)
    parsed = [parse_knob(k) for k in knobs]
    if hf_config and argv:
        raise UsageError("give --hf-config or a command after --, not both")
    if not hf_config and not argv:
        raise UsageError("tune: give --hf-config with --seq-len and --global-batch, or a command after -- with "
                         "--knob NAME=VALUES for each {NAME} in it")
    if hf_config and (seq_len is None or global_batch is None):
        raise UsageError("tune --hf-config: give --seq-len and --global-batch")
    if hf_config and parsed:
        raise UsageError("--knob fills a script's command; --hf-config takes --micro-batch, --checkpointing, "
                         "--optimizer, --allocator")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UsageError(f"tune traces with torch: {install_hint('preflight')}") from None
    name, total, sm = _gpu(gpu, gpu_memory)
    from ..plan.terms import outside_allocator_bytes

    outside = outside_allocator_bytes(nproc)
    room_bytes = int(room(total, outside).limit_bytes or 0)
    allocs = _list(allocator)
    notes: list[TuneNote] = []
    if hf_config:
        if not os.path.exists(hf_config):
            raise UsageError(f"{hf_config}: no such file")
        opts = _list(optimizer) if optimizer is not None else \
            list(OPTIMIZER_KERNELS) + (list(OPTIMIZER_CHANGES) if allow_optimizer_change else [])
        mbs = _micro_batches(micro_batch, (global_batch or 1) // nproc)
        space = hf_space(micro_batches=mbs, checkpointing=_list(checkpointing), optimizers=opts, world_size=nproc,
                         global_batch=int(global_batch or 0), allocators=allocs,
                         allow_optimizer_change=allow_optimizer_change)
        configs, dropped = candidates(space)
        from ..preflight.steps import PreflightError

        try:
            params = space_parameter_bytes(hf_config)
        except PreflightError as e:
            raise UsageError(str(e)) from None
        check_budget(room_bytes, params, f"--hf-config {hf_config}")
        job = TraceJob("hf", name, total, sm, outside, space.allocators, nproc, hf_config=hf_config,
                       seq_len=seq_len, dtype=dtype)
        job_facts: dict[str, Any] = {"hf_config": hf_config, "seq_len": seq_len, "dtype": dtype, "loop": "trainer"}
        if nproc > 1:
            notes.append("fsdp2-needs-a-script")

        def command_of(cfg: dict[str, Any]) -> list[str]:
            return hf_command(cfg, hf_config=hf_config or "", seq_len=int(seq_len or 0), dtype=dtype,
                              world_size=nproc)
    else:
        from .tune_exec import launcher_world_size

        launched = launcher_world_size(argv)
        if launched is not None and nproc == 1:
            nproc = launched
            outside = outside_allocator_bytes(nproc)
            room_bytes = int(room(total, outside).limit_bytes or 0)
        elif launched is not None and launched != nproc:
            raise UsageError(f"--nproc-per-node {nproc} but the command launches {launched} processes")
        bk = batch_knob if batch_knob is not None else ("mb" if any(k.name == "mb" for k in parsed) else None)
        if not parsed:
            raise UsageError("tune -- COMMAND: give --knob NAME=VALUES for each {NAME} in the command")
        space = script_space(parsed, argv, world_size=nproc, global_batch=global_batch, batch_knob=bk,
                             allocators=allocs)
        configs, dropped = candidates(space)
        job = TraceJob("script", name, total, sm, outside, space.allocators, nproc, command=tuple(argv),
                       accum_name=space.accum_axis)
        job_facts = {"command": argv}

        def command_of(cfg: dict[str, Any]) -> list[str]:
            return substitute(argv, cfg)
    if nproc > 1:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            notes.append("deepspeed-not-installed")
    run = not no_run and top_k > 0 and gpu_count() >= nproc
    if no_run or top_k == 0:
        notes.append("not-run")
    elif not run:
        notes.append("no-gpu")
    out_dir = os.path.abspath(out or f"oomdoctor-tune-{time.strftime('%Y%m%d-%H%M%S')}")
    workers = jobs or max(1, min(os.cpu_count() or 1, 8))
    with _Bar() as bar:
        tracer = Tracer(job, workers, progress=lambda p: bar.advance("tracing on the CPU"))

        def trace_many(points: list) -> list:
            bar.grow(len(points), "tracing on the CPU")
            return tracer(points)

        def run_trials(chosen: list) -> list:
            tracer.close()  # the traces are done: their workers leave the CPUs to the runs
            bar.grow(len(chosen), "running on the GPU")
            return run_candidates(chosen, command_of, out_dir, steps=steps, warmup=warmup, timeout_s=trial_timeout,
                                  progress=lambda c: bar.advance("running on the GPU"))

        try:
            result = tune(space, configs, trace_many, run_trials=run_trials if run else None, job=job_facts,
                          dropped=dropped, gpu_name=name, gpu_total_bytes=total, room_bytes=room_bytes,
                          spec=gpu_spec(name, dtype), top_k=max(top_k, 1), max_traces=max_traces, notes=notes,
                          what=hf_config or " ".join(argv))
        finally:
            tracer.close()
    emit(output, "tune", fmt, result)
    if result.best is None:
        raise click.exceptions.Exit(1)


class _Bar:
    """A progress bar on a terminal's standard error (rich), for a search of unknown length: its total grows with
    each batch of traces or runs; nothing when standard error is not a terminal."""

    def __init__(self) -> None:
        self._p: Any = None
        self._task: Any = None
        self._total = 0

    def __enter__(self) -> "_Bar":
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self._p.__enter__()
            self._task = self._p.add_task("tracing on the CPU", total=0)
        return self

    def grow(self, n: int, what: str) -> None:
        self._total += n
        if self._p is not None:
            self._p.update(self._task, total=self._total, description=what)

    def advance(self, what: str) -> None:
        if self._p is not None:
            self._p.update(self._task, advance=1, description=what)

    def __exit__(self, *exc: Any) -> None:
        if self._p is not None:
            self._p.__exit__(*exc)
