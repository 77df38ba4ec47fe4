"""``oomdoctor tune``'s work that is not a decision: the traces (preflight's tracer and its replay, in worker
processes) and the real runs on the GPU (``oomdoctor fit``'s trials). The decisions are in
:mod:`oomdoctor.report.tune`.

- :func:`trace_point`: one configuration traced on the CPU under fake tensors (:mod:`oomdoctor.preflight`: the
  Trainer step of ``--hf-config``, or the script), written as a snapshot and replayed under every allocator
  setting by :func:`oomdoctor.report.preflight.replayed`, the replay ``oomdoctor preflight`` answers with; its
  facts as :class:`oomdoctor.report.tune.Traced`.
- :class:`Tracer`: a batch of traces, in ``jobs`` worker processes (fake tensors cost no memory; a trace is a
  CPU's work), or here one after another with ``jobs=1``.
- :func:`run_candidates`: the top candidates run for real, each under ``oomdoctor run``'s injection stopped after
  ``warmup + steps`` optimizer steps (:func:`oomdoctor.cli.trials.run_trial`), the steps after the warm-up timed
  by the injection (:data:`oomdoctor.capture.autorecord.STEP_TIMES_ENV`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..report.tune import (
    DEFAULT_ALLOCATOR,
    Candidate,
    Space,
    Traced,
    TracePoint,
    TuneTrial,
    checkpoint_every,
    cost_of,
    within_margin,
)

#: the memory of a replay without a limit (bytes): what a configuration that runs out would need
UNLIMITED_BYTES = 1 << 60
#: the optimizer steps a trace runs (as ``oomdoctor preflight``'s default: the second step is the first with the
#: optimizer's state alive)
TRACE_STEPS = 2


@dataclass(frozen=True)
class TraceJob:
    """What every trace of one search shares: the mode, the Hugging Face config and its sequence and dtype (hf),
    or the command with its placeholders (script); the GPU; what lives outside the allocator; the allocator
    settings replayed; the world size."""

    mode: str
    gpu_name: str | None
    gpu_total_bytes: int
    sm_major: int
    outside_bytes: int
    allocators: tuple[str, ...]
    world_size: int
    hf_config: str | None = None
    seq_len: int | None = None
    dtype: str = "bf16"
    command: tuple[str, ...] = ()
    accum_name: str | None = None


_CONFIGS: dict[str, Any] = {}


def hf_job(job: TraceJob, cfg: dict[str, Any]) -> Any:
    """The :class:`oomdoctor.preflight.steps.HfJob` of a configuration of the Trainer job."""
    from ..preflight.steps import HfJob

    ck = checkpoint_every(str(cfg.get("checkpointing", "none")))
    opt = str(cfg.get("optimizer", "fused"))
    return HfJob(job.hf_config or "", int(cfg["micro_batch"]), int(job.seq_len or 0), job.dtype,
                 opt if opt in ("adamw8bit", "sgd") else "adamw", ck > 0, TRACE_STEPS,
                 world_size=job.world_size if cfg.get("sharding") == "ddp" else 1,
                 grad_accum=int(cfg.get("grad_accum", 1)),
                 optimizer_impl=opt if opt not in ("adamw8bit", "sgd") else "fused", checkpoint_every=max(ck, 1))


def substitute(command: tuple[str, ...] | list[str], values: dict[str, Any]) -> list[str]:
    """The command with every ``{name}`` replaced by its value."""
    out = []
    for a in command:
        for k, v in values.items():
            a = a.replace("{" + k + "}", str(v))
        out.append(a)
    return out


LAUNCHERS = (["torchrun"], ["-m", "torch.distributed.run"])


def script_argv(command: list[str]) -> list[str]:
    """The script and its arguments, as preflight traces it: ``python train.py ...`` without ``python``;
    ``torchrun [options] train.py ...`` (or ``python -m torch.distributed.run``) from the script on (preflight
    traces rank 0 of ``--nproc-per-node`` in a fake process group)."""
    args = list(command)
    if args and os.path.basename(args[0]).startswith("python"):
        args = args[1:]
    if args and (os.path.basename(args[0]) == "torchrun" or args[:2] == LAUNCHERS[1]):
        i = next((k for k, a in enumerate(args) if a.endswith(".py")), None)
        if i is not None:
            args = args[i:]
    return args


def launcher_world_size(command: list[str]) -> int | None:
    """``--nproc_per_node`` (or ``--nproc-per-node``) of a ``torchrun`` command, None when not one or not given."""
    for i, a in enumerate(command):
        for name in ("--nproc_per_node", "--nproc-per-node"):
            if a == name and i + 1 < len(command) and command[i + 1].isdigit():
                return int(command[i + 1])
            if a.startswith(name + "=") and a.split("=", 1)[1].isdigit():
                return int(a.split("=", 1)[1])
        if a.endswith(".py"):
            break
    return None


def trace_point(job: TraceJob, point: TracePoint) -> Traced:
    """Trace one configuration, replay it under every allocator setting, and return its facts.

    Raises:
        oomdoctor.preflight.steps.PreflightError: the job cannot be traced (one line).
    """
    import torch

    from ..preflight.snapshot import cublas_workspace_bytes, sidecar, snapshot_dict
    from ..preflight.snapshot import write as write_snapshot
    from ..report.preflight import replayed, room

    t0 = time.perf_counter()
    cfg = point.config.as_dict()
    if job.mode == "hf":
        from ..preflight import hf_tracer
        from ..preflight.steps import load_config

        hj = hf_job(job, cfg)
        if job.hf_config not in _CONFIGS:
            _CONFIGS[job.hf_config or ""] = load_config(job.hf_config or "")
        f = hf_tracer(hj, gpu_name=job.gpu_name, gpu_total_bytes=job.gpu_total_bytes, sm_major=job.sm_major,
                      config=_CONFIGS[job.hf_config or ""])
        snap, meta, rec = f(None)
        micro_batches = hj.grad_accum
        ddp = hj.world_size > 1
    else:
        from ..preflight.script import ScriptJob, trace_script

        argv = script_argv(substitute(job.command, cfg))
        sj = ScriptJob(tuple(argv), max_steps=TRACE_STEPS, world_size=job.world_size)
        rec = trace_script(sj, gpu_name=job.gpu_name or "GPU", gpu_total_bytes=job.gpu_total_bytes,
                           sm_major=job.sm_major, cublas_workspace_bytes=cublas_workspace_bytes(job.sm_major))
        snap = snapshot_dict(rec)
        meta = sidecar(rec, gpu_name=job.gpu_name, gpu_total_bytes=job.gpu_total_bytes,
                       torch_version=torch.__version__, micro_batch=None, job=sj.as_dict())
        meta["world_size"] = job.world_size
        micro_batches = 0  # counted from the trace below
        ddp = False
    last = rec.tensors[-1] if rec.tensors else {}

    def kind(k: str) -> int:
        return int(sum(n for _, n in last.get(k, [])))

    params = kind("parameters")
    buckets = sum(int(x.get("bytes", 0)) for x in rec.extra_allocations if x.get("what") == "ddp_gradient_bucket")
    if ddp:
        buckets = params  # DDP's buckets hold every parameter's gradient once (preflight.steps.ddp_buckets)
    if not micro_batches:  # a script: the accumulation tune derives, as traced; else its own (one step's worth)
        micro_batches = int(cfg.get(job.accum_name, 1)) if job.accum_name else 1
    others = [a for a in job.allocators if a != DEFAULT_ALLOCATOR]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "trace.pickle")
        write_snapshot(path, snap, meta)
        r, _ = replayed(path, room(job.gpu_total_bytes, job.outside_bytes), point.micro_batch, rec.events,
                        rec.wall_s, configs=tuple(others))
        # the recorded (default) settings first, then each setting asked for, in order (simulate's results)
        names = (DEFAULT_ALLOCATOR, *others)
        settings = {name: (int(s["peak_reserved_bytes"]), int(s["peak_allocated_bytes"]), bool(s["oom"]))
                    for name, s in zip(names, r.settings)}
        if any(v[2] for v in settings.values()):  # what a setting that ran out would need: replayed with no limit
            u, _ = replayed(path, room(UNLIMITED_BYTES, 0), point.micro_batch, rec.events, rec.wall_s,
                            configs=tuple(others))
            for name, s in zip(names, u.settings):
                if settings[name][2]:
                    settings[name] = (int(s["peak_reserved_bytes"]), int(s["peak_allocated_bytes"]), True)
    cost = cost_of(rec.op_costs, rec.collectives, rec.step_markers, rec.phase_markers, micro_batches=micro_batches,
                   world_size=job.world_size, ddp_bucket_bytes=buckets)
    return Traced(point, settings, params, kind("gradients"), kind("optimizer_state"), cost,
                  time.perf_counter() - t0, len(rec.events))


def _init_worker() -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a trace is the CPU's work, on fake tensors
    _quiet()


def _quiet() -> None:
    """transformers' warnings about the config (and deprecations) once per trace are noise in tune's output."""
    import warnings

    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def _traced_or_error(job: TraceJob, point: TracePoint) -> Traced | str:
    from ..preflight.steps import PreflightError

    try:
        return trace_point(job, point)
    except PreflightError as e:
        return str(e)


class Tracer:
    """``tracer(points) -> list[Traced]``: a batch of traces, in ``jobs`` worker processes (spawned: torch in a
    forked child is not safe), each worker kept for the whole search; ``progress(done)`` after each trace.

    Raises:
        UsageError: a configuration cannot be traced (preflight's one line)."""

    def __init__(self, job: TraceJob, jobs: int, progress: Callable[[TracePoint], None] | None = None) -> None:
        self.job, self.jobs, self.progress = job, max(jobs, 1), progress
        self._pool: Any = None

    def __call__(self, points: list[TracePoint]) -> list[Traced]:
        from ..errors import UsageError

        if not points:
            return []
        if self.jobs == 1 or len(points) == 1 and self._pool is None:
            _quiet()
            out = []
            for p in points:
                r = _traced_or_error(self.job, p)
                if isinstance(r, str):
                    raise UsageError(r)
                out.append(r)
                if self.progress:
                    self.progress(p)
            return out
        if self._pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self._pool = ProcessPoolExecutor(max_workers=self.jobs, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker)
        futures = [self._pool.submit(_traced_or_error, self.job, p) for p in points]
        out = []
        from concurrent.futures import as_completed

        index = {f: i for i, f in enumerate(futures)}
        results: list[Any] = [None] * len(points)
        for f in as_completed(futures):
            try:
                results[index[f]] = f.result()
            except Exception as e:  # noqa: BLE001 - a worker that died (killed, out of host memory): one line
                raise UsageError(f"a trace's worker process failed ({type(e).__name__}: {e}); try fewer at once "
                                 "(-j)") from None
            if self.progress:
                self.progress(points[index[f]])
        for r in results:
            if isinstance(r, str):
                raise UsageError(r)
            out.append(r)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None


# ---------------------------------------------------------------------------------------------- real runs


def gpu_count() -> int:
    """GPUs PyTorch sees here (0 without torch or CUDA)."""
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no GPU is an answer
        return 0


def hf_command(cfg: dict[str, Any], *, hf_config: str, seq_len: int, dtype: str, world_size: int) -> list[str]:
    """The command that runs the Trainer job of ``cfg`` for real (:mod:`oomdoctor.integrations.tune_trainer`),
    under ``torchrun`` on several GPUs."""
    args = ["-m", "oomdoctor.integrations.tune_trainer", "--hf-config", os.path.abspath(hf_config),
            "--seq-len", str(seq_len), "--dtype", dtype, "--micro-batch", str(cfg["micro_batch"]),
            "--grad-accum", str(cfg.get("grad_accum", 1)), "--checkpointing", str(cfg.get("checkpointing", "none")),
            "--optimizer", str(cfg.get("optimizer", "fused"))]
    if world_size > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
                *args]
    return [sys.executable, *args]


def env_of(cfg: dict[str, Any]) -> dict[str, str]:
    """The environment of a run: the allocator setting in ``PYTORCH_ALLOC_CONF`` (and its older name), added to
    what the job already has (:func:`oomdoctor.report.loop.apply_setting`)."""
    env = dict(os.environ)
    alloc = cfg.get("allocator", DEFAULT_ALLOCATOR)
    if alloc and alloc != DEFAULT_ALLOCATOR:
        from ..report.loop import apply_setting, parse_setting

        env = apply_setting(env, parse_setting(alloc))
        for v in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):  # torch < 2.9 reads only the older name
            if v in env:
                env["PYTORCH_ALLOC_CONF"] = env["PYTORCH_CUDA_ALLOC_CONF"] = env[v]
                break
    return env


def run_candidates(chosen: list[Candidate], command_of: Callable[[dict[str, Any]], list[str]], out_dir: str, *,
                   steps: int, warmup: int, timeout_s: float | None,
                   progress: Callable[[Candidate], None] | None = None) -> list[TuneTrial]:
    """Run each candidate for real: ``warmup + steps`` optimizer steps, the last ``steps`` timed."""
    from ..capture.autorecord import STEP_TIMES_ENV, WARMUP_STEPS_ENV
    from .trials import run_trial

    trials = []
    for i, c in enumerate(chosen):
        d = os.path.join(out_dir, f"trial{i + 1}")
        env = env_of(c.config)
        times = os.path.abspath(d) + ".steps.rank{rank}.json"
        env[STEP_TIMES_ENV] = times
        env[WARMUP_STEPS_ENV] = str(warmup)
        label = " ".join(f"{k}={v}" for k, v in c.config.items())
        t = run_trial(command_of(c.config), d, steps=warmup + steps, record=False, env=env, timeout_s=timeout_s,
                      label=label)
        timing = _read_json(times.replace("{rank}", "0"))
        # to the microsecond, as the JSON says it: samples/s is computed from the seconds written (a K-step window of
        # 15 ms rounded to 0.1 ms made them disagree by 0.3%)
        timed = round(float(timing["seconds"]), 6) if timing and timing.get("seconds") else None
        n = int(timing.get("steps_timed", steps)) if timing else steps
        sps = c.samples_per_step * n / timed if timed and t.outcome == "ran" else None
        peak = timing.get("max_memory_reserved_bytes") if timing else None
        peak = int(peak) if isinstance(peak, int) else None
        trials.append(TuneTrial(config=dict(c.config), outcome=t.outcome, seconds=t.seconds, steps_timed=n,
                            timed_seconds=timed,
                            measured_samples_per_s=round(sps, 3) if sps else None,
                            measured_peak_reserved_bytes=peak,
                            predicted_peak_reserved_bytes=c.predicted_peak_reserved_bytes,
                            unpredicted_oom=t.outcome == "oom" and c.fits, log=t.log,
                            within_margin=within_margin(peak, c.predicted_peak_reserved_bytes, c.margin_bytes)))
        if progress:
            progress(c)
    return trials


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def space_parameter_bytes(hf_config: str) -> int:
    """fp32 bytes of the model's parameters (Trainer keeps them in fp32 under bf16 autocast): the model built on
    the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..preflight.steps import load_config

    cfg = load_config(hf_config)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    seen: dict[int, int] = {}
    for p in m.parameters():
        seen[id(p)] = p.numel()
    return 4 * sum(seen.values())


def space_of_script(space: Space) -> bool:
    return space.mode == "script"
