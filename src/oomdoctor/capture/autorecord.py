"""Recording without code change: what ``oomdoctor run``'s injected ``sitecustomize`` sets up.

1. An import hook (a :data:`sys.meta_path` finder) lets the program import ``torch`` normally, then
   calls :func:`on_torch_imported`.
2. That queues :func:`start` with ``torch.cuda._lazy_call``: it runs when the process first
   initialises CUDA, before its first allocation (``torch/cuda/__init__.py`` ``_lazy_init`` runs the
   queued calls), and never in processes that do not use CUDA. A process that imports torch without
   CUDA being available gets one warning at exit and nothing else.
3. :func:`start` builds the :class:`~oomdoctor.capture.recorder.Recorder` from
   ``OOMDOCTOR_RUN_CONFIG`` (JSON: ``out``, ``steps``, ``max_entries``, ``stacks``, ``stack_steps``,
   ``free_stacks``, ``summarize``, ``summary_timeout_s``) and stops it at exit (``atexit``). ``"record": false``
   records nothing (``oomdoctor fit``'s later trials only need to stop).
4. With ``"stop_after_steps": K`` (``oomdoctor fit`` / ``verify``), the process ends itself with exit
   code 0 right after its K-th optimizer step (:func:`install_stop`), every rank at the same step. With
   ``"exits": DIR`` as well, a process that used CUDA or stepped an optimizer writes how it ended in ``DIR``
   (:mod:`.exits`: stopped or not, ``memory_stats()``'s ``num_ooms``), at the stop or at its exit.

No signal handler is installed. A Python-level ``SIGTERM`` handler runs only when the main thread is back
in the interpreter: a rank blocked in an NCCL collective (what ``torchrun`` tears down with ``SIGTERM``
when another rank fails) would then ignore the signal until the launcher's ``SIGKILL``, 30 s later.
Measured on 2 H200s (tests/gpu/test_capture_safety.py): the job exited 30 s late with such a handler.
So a rank stopped by a signal leaves no final dump; OOM dumps (written by the allocator's observer at the
failure) and step windows (``--steps``, written when the window ends) are unaffected.
"""

from __future__ import annotations

import atexit
import importlib.abc
import json
import os
import sys
from typing import Any, Callable

from .exits import exit_record, write_exit_record
from .recorder import ALL_STEPS, DEFAULT_MAX_ENTRIES, Recorder, warn

CONFIG_ENV = "OOMDOCTOR_RUN_CONFIG"
_recorder: Recorder | None = None
_make_recorder: Callable[..., Recorder] | None = None


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of ``torch`` to run a callback after it executes."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            real_exec(module)
            on_torch_imported(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install_import_hook(make_recorder: Callable[..., Recorder] | None = None) -> None:
    """Start recording when the program imports torch (now, if it has). ``make_recorder``: what builds the
    recorder from ``record()``'s arguments (the injected ``sitecustomize`` passes :func:`oomdoctor.record`,
    which wires the in-job summary); without it, a plain :class:`Recorder` with no summary."""
    global _make_recorder
    if make_recorder is not None:
        _make_recorder = make_recorder
    if "torch" in sys.modules:
        on_torch_imported(sys.modules["torch"])
    elif not any(isinstance(f, _TorchImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchImportHook())


def on_torch_imported(torch: Any) -> None:
    """Queue :func:`start` for CUDA's initialisation. CUDA is not probed here: querying devices in a
    process that later forks CUDA-using children would break them (``torch.cuda`` docs on fork)."""
    try:
        cfg = config()
    except ValueError:
        cfg = {}
    if cfg.get("stop_after_steps"):
        try:
            install_stop(torch, int(cfg["stop_after_steps"]), exits=cfg.get("exits"))
        except Exception as e:  # noqa: BLE001
            warn(f"the stop after {cfg['stop_after_steps']} steps not set up in pid {os.getpid()}: "
                 f"{type(e).__name__}: {e}")
    if cfg.get("record") is False:
        return
    try:
        torch.cuda._lazy_call(_start_guarded)
        atexit.register(_report_unused, torch)
    except Exception as e:  # noqa: BLE001
        warn(f"recording not set up in pid {os.getpid()}: {type(e).__name__}: {e}")


#: the line a process prints on stderr when it stops itself (``oomdoctor fit`` / ``verify`` read it)
STOP_LINE = "oomdoctor: stopped after {steps} optimizer steps (pid {pid}, rank {rank}): exit 0"
_stop_installed = False
#: the stop's state: optimizer steps counted, K, the exit records' directory, a record written
_stop: dict[str, Any] = {"counted": 0, "asked": 0, "exits": None, "written": False}


def install_stop(torch: Any, steps: int, exits: str | None = None) -> None:
    """End this process with exit code 0 right after its ``steps``-th optimizer step.

    Steps are counted as the recorder counts them: the first optimizer that steps is the one counted
    (by a global post hook, ``torch.optim.optimizer.register_optimizer_step_post_hook``, PyTorch >= 2.0),
    once per step, so several optimizers stepping once each per training step count one step. PyTorch
    runs an optimizer's own post hooks first, then the global ones in the order they were registered
    (``torch/optim/optimizer.py``, ``profile_hook_step``: ``chain(self._optimizer_step_post_hooks.values(),
    _global_optimizer_post_hooks.values())``). This hook is registered when torch is imported, before the
    recorder's (registered when CUDA initialises), so at the ``steps``-th step it lets the recorder count
    that step first (:meth:`Recorder.optimizer_step_ended`: the step's end marker is in the dump), then stops.

    At the K-th step: wait for the GPU (``torch.cuda.synchronize``), then, in a distributed job, a
    barrier, so that no rank leaves while a peer still runs a collective of that step: every rank of a
    data-parallel (DDP, FSDP, DeepSpeed, accelerate) job steps its optimizer at the same step, after that
    step's collectives; then dump the recording (:meth:`Recorder.stop`), write the exit record (``exits``:
    :mod:`.exits`, ``"stopped": true``), flush, and ``os._exit(0)`` (``atexit`` handlers and the process
    group's teardown are skipped: they can hang once a peer is gone).
    The training loop's code after that ``optimizer.step()`` call never runs.
    Accelerate's ``AcceleratedOptimizer`` calls the wrapped optimizer's ``step`` only at a gradient
    accumulation boundary, so steps are optimizer steps there too; a step skipped by a ``GradScaler``
    (inf/NaN gradients) is not counted, as PyTorch never calls ``step``.

    ``exits``: also write an exit record at interpreter exit when the stop never fired, if this process
    initialised CUDA or stepped an optimizer (a job that caught its OOM and returned, or ended early).
    """
    global _stop_installed
    if _stop_installed or steps < 1:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook
    first: list[int] = []  # id() of the first optimizer that stepped
    _stop.update(counted=0, asked=int(steps), exits=exits, written=False)

    timing = _StepTiming.from_env(torch, steps)

    def count(optimizer: Any, args: Any, kwargs: Any) -> None:
        if not first:
            first.append(id(optimizer))
        if id(optimizer) != first[0]:
            return
        _stop["counted"] += 1
        if timing is not None:
            timing.step(_stop["counted"])
        if _stop["counted"] >= steps:
            if _recorder is not None:
                _recorder.optimizer_step_ended(optimizer, args, kwargs, after=handle.id)
            _stop_now(torch, _stop["counted"], timing)

    handle = register_optimizer_step_post_hook(count)
    if exits:
        atexit.register(_exit_unstopped, torch)
    _stop_installed = True


#: ``oomdoctor tune``'s trials: the file (one per rank, ``{rank}`` in it) where a process stopped after K steps
#: writes how long its steps after the warm-up took, and how many steps are warm-up
STEP_TIMES_ENV = "OOMDOCTOR_STEP_TIMES"
WARMUP_STEPS_ENV = "OOMDOCTOR_WARMUP_STEPS"


class _StepTiming:
    """The wall time of optimizer steps ``warmup + 1 .. steps`` of a process that stops after ``steps``
    (:func:`install_stop`): the GPU is waited for (``torch.cuda.synchronize``) once at the end of step ``warmup``
    and once at the stop, so the steps in between run as they always do. Written as JSON (``rank``, ``warmup``,
    ``steps_timed``, ``seconds``, ``step_ends_s``: each step's end on the host, unsynchronised, from the first;
    ``max_memory_reserved_bytes`` and ``max_memory_allocated_bytes``, PyTorch's peaks, where CUDA was used)."""

    def __init__(self, torch: Any, path: str, warmup: int, steps: int) -> None:
        self.torch, self.path, self.warmup, self.steps = torch, path, min(max(warmup, 0), steps - 1), steps
        self.t0: float | None = None
        self.ends: list[float] = []

    @classmethod
    def from_env(cls, torch: Any, steps: int) -> "_StepTiming | None":
        path = os.environ.get(STEP_TIMES_ENV)
        if not path:
            return None
        try:
            warmup = int(os.environ.get(WARMUP_STEPS_ENV, "1"))
        except ValueError:
            warmup = 1
        return cls(torch, path, warmup, steps)

    def _now(self, sync: bool) -> float:
        import time

        if sync and self.torch.cuda.is_initialized():
            self.torch.cuda.synchronize()
        return time.perf_counter()

    def step(self, n: int) -> None:
        self.ends.append(self._now(False))
        if n == self.warmup:
            self.t0 = self._now(True)

    def write(self, rank: str) -> None:
        t1 = self._now(True)
        t0 = self.t0 if self.t0 is not None else (self.ends[0] if self.ends else t1)
        body = {"rank": int(rank) if rank.isdigit() else rank, "warmup": self.warmup,
                "steps_timed": self.steps - self.warmup, "seconds": t1 - t0,
                "step_ends_s": [e - self.ends[0] for e in self.ends] if self.ends else []}
        if self.torch.cuda.is_initialized():
            body["max_memory_reserved_bytes"] = int(self.torch.cuda.max_memory_reserved())
            body["max_memory_allocated_bytes"] = int(self.torch.cuda.max_memory_allocated())
        with open(self.path.replace("{rank}", str(rank)), "w", encoding="utf-8") as f:
            json.dump(body, f)


def _stop_now(torch: Any, steps: int, timing: _StepTiming | None = None) -> None:
    rank = os.environ.get("RANK", "0")
    try:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        if timing is not None:
            timing.write(rank)  # before the barrier: this rank's own steps
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            rank = str(dist.get_rank())
            dist.barrier()
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - stop anyway
        warn(f"before stopping: {type(e).__name__}: {e}")
    if _recorder is not None:
        _recorder.stop()
    _write_exit(torch, stopped=True, rank=rank)
    try:
        print(STOP_LINE.format(steps=steps, pid=os.getpid(), rank=rank), file=sys.stderr, flush=True)
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    os._exit(0)


def _exit_unstopped(torch: Any) -> None:
    """At interpreter exit without the stop: the exit record of a process that used CUDA or stepped."""
    if _stop["written"]:
        return
    try:
        cuda = bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001
        cuda = False
    if cuda or _stop["counted"]:
        _write_exit(torch, stopped=False, rank=os.environ.get("RANK", "0"))


def _write_exit(torch: Any, *, stopped: bool, rank: str) -> None:
    """The exit record (:mod:`.exits`) of this process, when the run asked for them; never raises."""
    if not _stop["exits"]:
        return
    try:
        cuda = bool(torch.cuda.is_initialized())
        stats = None
        if cuda:
            try:
                stats = dict(torch.cuda.memory_stats())
            except Exception:  # noqa: BLE001
                stats = None
        try:
            r = int(rank)
        except ValueError:
            r = 0
        write_exit_record(_stop["exits"], exit_record(stopped=stopped, steps=_stop["counted"],
                                                      steps_asked=_stop["asked"], rank=r, pid=os.getpid(),
                                                      cuda=cuda, memory_stats=stats))
        _stop["written"] = True
    except Exception as e:  # noqa: BLE001 - the job goes on; the trial is then read from its exit code
        warn(f"the exit record not written in pid {os.getpid()}: {type(e).__name__}: {e}")


def _report_unused(torch: Any) -> None:
    """At exit of a process that imported torch but never started recording: say why, if CUDA is
    missing (a process that simply did not use CUDA, like the launcher, stays silent)."""
    if _recorder is not None:
        return
    try:
        if not torch.cuda.is_available():
            warn(f"CUDA is not available in this process (pid {os.getpid()}): nothing was recorded")
    except Exception:  # noqa: BLE001
        pass


def _start_guarded() -> None:
    try:
        start()
    except Exception as e:  # noqa: BLE001 - never break the program's CUDA initialisation
        warn(f"recording not started in pid {os.getpid()}: {type(e).__name__}: {e}")


def config() -> dict[str, Any]:
    """The run's settings from ``OOMDOCTOR_RUN_CONFIG``.

    Raises:
        ValueError: the variable is not a JSON object with ``out``.
    """
    cfg = json.loads(os.environ.get(CONFIG_ENV, ""))
    if not isinstance(cfg, dict) or not isinstance(cfg.get("out"), str):
        raise ValueError(f"{CONFIG_ENV} must be a JSON object with 'out'")
    return cfg


def start() -> Recorder | None:
    """Start this process's recorder (once)."""
    global _recorder
    if _recorder is not None:
        return _recorder
    cfg = config()
    make = _make_recorder or _plain_recorder
    rec = make(cfg["out"], steps=cfg.get("steps"), max_entries=int(cfg.get("max_entries", DEFAULT_MAX_ENTRIES)),
               stacks=cfg.get("stacks", "python"), free_stacks=bool(cfg.get("free_stacks")),
               stack_steps=cfg.get("stack_steps", ALL_STEPS),
               summarize=bool(cfg.get("summarize")), summary_timeout_s=float(cfg.get("summary_timeout_s", 120.0)),
               print_summary=bool(cfg.get("print_summary", False)))
    rec.start()
    _recorder = rec
    atexit.register(rec.stop)
    return rec


def _plain_recorder(out: str, *, summarize: bool = False, summary_timeout_s: float = 120.0,
                    print_summary: bool = False, **kw: Any) -> Recorder:
    """A :class:`Recorder` without the in-job summary (which needs the analyses, above this package)."""
    if summarize:
        warn("the in-job summary needs oomdoctor.record (install_import_hook(make_recorder=...)): not written")
    return Recorder(out, **kw)
