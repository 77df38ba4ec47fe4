"""Recording a rank's CUDA memory history: start, step windows, the OOM dump, the final dump.

Calls PyTorch's recording API (``shared/reference/snapshot_format_and_peers.md`` §1.1, §1.8):
``torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
max_entries=N)``, ``torch.cuda.memory._snapshot()`` (the dict ``_dump_snapshot`` pickles, so the
files open in pytorch.org/memory_viz), and ``torch._C._cuda_attach_out_of_memory_observer``, whose
callback runs after the ``oom`` trace entry and before the exception unwinds, so the dump holds the
state at the failure. It dumps at the first OOM only (a job that catches its OOMs in a loop would dump at each);
a later one with no step after it (a retry that ran out again, the OOM the job dies of) is dumped over it when
recording stops (issue 49: a retry inside the ``except`` block, whose kept exception held the first attempt, was
recorded at the first attempt's OOM only). Steps are counted by a global optimizer step hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``) until the user calls
:meth:`Recorder.step` themselves.

Safety: recording must never change what the job does.

- ``context="alloc"`` by default: every event is recorded, but only allocations carry a stack; a free
  carries the stack of the allocation it frees (``CUDACachingAllocator.cpp``: ``free`` and
  ``release_block`` pass ``context ? context : block->context_when_allocated``). Gathering a Python
  stack at each free (``context="all"``) makes non-reentrant activation checkpointing crash in
  backward on torch 2.11 (``SystemError: ... returned NULL without setting an exception``), see
  ``docs/checkpoint_crash.md``; it is opt-in (``free_stacks=True``) with a warning.
- Every hook the recorder installs (the optimizer step hook, the OOM observer, ``step()``, the dumps,
  ``stop()``) catches its own failures: each kind is logged once on stderr and counted, and the job
  goes on exactly as it would have. Only bad arguments to the constructor raise.

Overhead: the allocator gathers a Python stack per allocation (about 2 µs, PyTorch's docstring) and keeps
at most ``max_entries`` events in a ring buffer; ``stacks="all"`` (C++ frames too) costs more and has
hung the unwinder on generated code (torchtitan PR #2991), so it is not the default.

Stacked steps (``stack_steps``): stacks can be gathered only in some steps (the first ``K``, which hold the
set-up, the optimizer state's creation and the first peak, then every ``N``-th), every event still being
recorded in the others, without a stack (``context=None``). The switch calls ``_record_memory_history``
again with ``clear_history=False``: ``recordHistory`` (``CUDACachingAllocator.cpp``) then only stores the new
context level and keeps the ring buffer (it clears it when disabled or asked to). Each switch is noted in
the sidecar's ``stack_markers`` (step, whether stacks are on from then, ``time_us``, ``event_index``), so
that the analysis knows which events were recorded without a stack and can match them against a stacked
step (:mod:`oomdoctor.analysis.stackmatch`).
"""

from __future__ import annotations

import functools
import gc
import os
import pickle
import sys
import threading
import time
import weakref
from typing import Any, Callable

from .facts import FACT_STEPS, class_path, fact_record, module_record, module_roots, optimizer_storages
from .files import (
    CaptureError,
    atomic_write_bytes,
    atomic_write_json,
    ensure_writable,
    sidecar_for,
    sidecar_json_bytes,
    snapshot_name,
)
from .metadata import (
    PHASES,
    SIDECAR_FORMAT,
    device_counters,
    env_subset,
    host_info,
    now_us,
    place_markers,
    rank_info,
    recorded_devices,
    torch_info,
)

DEFAULT_MAX_ENTRIES = 100_000
STACKS = ("python", "all", "none")
#: stacks at every step (the recorder's behaviour before stacked steps existed)
ALL_STEPS = "all"
#: the default ``stack_steps``: stacks in the first 3 steps (step 0 holds the set-up) and every 10th step; the
#: steps between record every event without a stack. Measured on the device (docs/capture.md, round 5): on a
#: Hugging Face Trainer DDP job ``all`` cost +8.79% median step time and ``3/10`` +2.53%, with the same holders
#: and top sites, label for label and byte for byte.
DEFAULT_STACK_STEPS = "3/10"
FREE_STACKS_WARNING = (
    "recording a stack at every free (context='all'): on torch 2.11 this makes non-reentrant activation "
    "checkpointing (torch.utils.checkpoint use_reentrant=False: Hugging Face gradient_checkpointing, "
    "Lightning and torchtitan AC) crash in backward with 'SystemError: ... returned NULL without setting an "
    "exception' (measured on H100 and H200). Turn free stacks off unless you need them.")

#: ``on_finish(recorder, snapshot_dict, meta)``: called once on every rank after the last dump
#: (the in-job summary plugs in here); what it returns is ignored.
FinishHook = Callable[["Recorder", dict, dict], object]


def warn(msg: str) -> None:
    """One line on stderr, prefixed; recording problems never raise into the training job."""
    try:
        print(f"oomdoctor: {msg}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - stderr closed
        pass


def parse_steps(steps: Any) -> tuple[int, int] | None:
    """``None``, ``(A, B)``, ``"A:B"`` or ``"S"`` -> ``(A, B)``, steps counted from 0, both included.

    Raises:
        CaptureError: not a window of non-negative integers with ``A <= B``.
    """
    if steps is None:
        return None
    try:
        if isinstance(steps, str):
            parts = steps.split(":")
            if len(parts) == 1:
                a = b = int(parts[0])
            elif len(parts) == 2:
                a, b = int(parts[0]), int(parts[1])
            else:
                raise ValueError
        else:
            a, b = (int(x) for x in steps)
    except (TypeError, ValueError):
        raise CaptureError(f"steps {steps!r}: expected a window 'A:B' of step numbers (from 0), e.g. '2:4'") from None
    if a < 0 or b < a:
        raise CaptureError(f"steps {steps!r}: expected 0 <= A <= B")
    return a, b


def parse_stack_steps(spec: Any) -> tuple[int, int] | None:
    """``None`` or ``"all"`` (stacks in every step), ``"K"`` (the first K steps), ``"K/N"`` (the first K
    steps, then every step whose number is a multiple of N), or a pair ``(K, N)`` -> ``(K, N)`` (``N`` 0:
    none after the first K); ``None`` for every step. Steps are counted from 0; step 0 includes the set-up.

    Raises:
        CaptureError: not one of these forms, ``K < 1`` or ``N < 0``.
    """
    if spec is None or spec == ALL_STEPS:
        return None
    try:
        if isinstance(spec, str):
            parts = spec.split("/")
            if len(parts) not in (1, 2):
                raise ValueError
            k, n = int(parts[0]), int(parts[1]) if len(parts) == 2 else 0
        else:
            k, n = (int(x) for x in spec)
    except (TypeError, ValueError):
        raise CaptureError(f"stack steps {spec!r}: expected 'all', 'K' (the first K steps) or 'K/N' (the first K, "
                           "then every N-th), e.g. '3/10'") from None
    if k < 1 or n < 0:
        raise CaptureError(f"stack steps {spec!r}: expected K >= 1 and N >= 0")
    return k, n


def stacked_step(plan: tuple[int, int] | None, step: int) -> bool:
    """Whether ``step`` (from 0) records stacks under ``plan`` (:func:`parse_stack_steps`)."""
    if plan is None:
        return True
    first, every = plan
    return step < first or (every > 0 and step % every == 0)


def _guarded(site: str) -> Callable:
    """Run a recorder method so that nothing it raises reaches the job: an ``Exception`` is logged once per
    ``site`` (then only counted, see :attr:`Recorder.failures`) and the method returns None."""

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def run(self: Recorder, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the job must never see the recorder fail
                self._failed(site, e)
                return None

        return run

    return wrap


class Recorder:
    """Records this process's CUDA memory history into ``out_dir`` (see :mod:`.files` for the names).

    Args:
        out_dir: created if missing; checked writable at once.
        steps: ``None`` (record everything; dump when stopped) or a window ``(A, B)`` / ``"A:B"``:
            record steps A..B (from 0) and dump ``rank{R}_step{B}.pickle`` when step B ends.
        max_entries: ring-buffer length (events) of the allocator's history.
        stacks: ``"python"``, ``"all"`` (adds C++ frames) or ``"none"`` (every event, no stack at all:
            ``context=None``, the lowest overhead; allocation sites cannot be named).
        free_stacks: also gather a stack at every free (``context="all"``). Off by default: it crashes
            non-reentrant activation checkpointing on torch 2.11 (``docs/checkpoint_crash.md``); a
            warning says so when it is on.
        on_oom: dump ``rank{R}_oom.pickle`` from the out-of-memory observer. With a step window,
            history is then kept from the start (bounded by ``max_entries``) so that an OOM before the
            window still has it; it is cleared when the window opens.
        on_finish: called after the last dump (see :data:`FinishHook`).
        manual_steps: steps are marked only by :meth:`step` (the framework callbacks of
            :mod:`oomdoctor.integrations` call it at each training step's end); optimizer steps are not
            counted, but their parameters, gradients and state are still noted (:mod:`.facts`).
        stack_steps: which steps gather stacks (:func:`parse_stack_steps`): ``"3/10"`` (default), ``"all"`` or
            ``"K/N"``; the other steps record every event without a stack. When the first K steps end, N
            is lowered if needed so that the ring buffer holds two stacked steps (:meth:`_fit_every`).
            Ignored with ``stacks="none"`` and on a torch without ``clear_history`` (< 2.4), where
            switching would clear the history.

    An ``out_dir`` that cannot be created or written is not an error: a warning says so and nothing is
    recorded (a training job must not die for its memory recorder).

    Raises:
        CaptureError: bad ``steps``/``stacks``/``max_entries``.
    """

    def __init__(self, out_dir: str, *, steps: Any = None, max_entries: int = DEFAULT_MAX_ENTRIES,
                 stacks: str = "python", free_stacks: bool = False, on_oom: bool = True,
                 on_finish: FinishHook | None = None, manual_steps: bool = False,
                 stack_steps: Any = DEFAULT_STACK_STEPS) -> None:
        if stacks not in STACKS:
            raise CaptureError(f"stacks {stacks!r}: expected one of {', '.join(STACKS)}")
        if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 1:
            raise CaptureError(f"max_entries {max_entries!r}: expected a positive integer")
        self.window = parse_steps(steps)
        self.stack_plan = None if stacks == "none" else parse_stack_steps(stack_steps)
        #: whether the allocator gathers stacks now (for ``stacks != "none"``)
        self._stacks_on = True
        #: ``{"asked": [K, N], "events_per_step": n}``: the fit of N to the ring buffer (:meth:`_fit_every`)
        self.stack_fit: dict[str, Any] | None = None
        #: ``[{"step": s, "stacks": bool, "time_us": t}]``: from ``t`` on, stacks are (not) gathered
        self.stack_marks: list[dict[str, Any]] = []
        #: ``{site: count}`` of failures caught inside the recorder (each site warned about once).
        self.failures: dict[str, int] = {}
        try:
            self.out_dir: str | None = ensure_writable(out_dir)
        except CaptureError as e:
            self.out_dir = None
            warn(f"{e}: nothing will be recorded; training goes on")
        self.max_entries = max_entries
        self.stacks = stacks
        self.context: str | None = None if stacks == "none" else "all" if free_stacks else "alloc"
        self.on_oom = on_oom
        self.on_finish = on_finish
        self.step_count = 0
        self.markers: list[dict[str, int]] = []
        #: ``[{"phase": name, "time_us": t}]``: from ``t`` on, the job said it runs ``name`` (:meth:`mark_phase`)
        self.phase_marks: list[dict[str, Any]] = []
        self.written: list[str] = []
        self.active = False          # recording has been started (CUDA present)
        self.recording = False       # history is being recorded now
        self.finished = False
        self.oom_dumped = False
        self.steps_since_oom = 0
        #: the observer's numbers of the last OOM after the one dumped (None: none): a job that caught its OOM and
        #: ran out again with no step between (a retry) dies of this one, dumped at the stop (:meth:`stop`)
        self.later_oom: dict[str, int] | None = None
        self.rank, self.local_rank, self.world_size = rank_info(os.environ)
        self.store: Any = None
        self._torch: Any = None
        self._lock = threading.RLock()
        self._hook_handle: Any = None
        self._first_optimizer: int | None = None
        self._manual_steps = manual_steps
        #: storages of parameters, gradients and optimizer state at the end of each optimizer's first steps
        #: (``.facts``), one record per optimizer and step
        self.tensor_facts: list[dict[str, Any]] = []
        #: per optimizer (by its index, in the order first seen): how many step records it has
        self._fact_counts: list[int] = []
        self._opt_index: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._opt_index_by_id: dict[int, int] = {}  # optimizers that take no weak reference
        #: the modules' parameters and buffers at the end of the first optimizer step (``.facts``), and the roots
        #: found then, held weakly, noted again at every dump
        self.module_facts: list[dict[str, Any]] = []
        self._roots: list[weakref.ref] = []
        self._modules_noted = False
        #: where facts are noted: this process's CUDA device (None: ``torch.cuda.current_device()`` at the time);
        #: the recorder's tests on a CPU build of torch set :data:`.facts.HOST`
        self.fact_device: int | str | None = None
        #: every optimizer the step hook has seen (weakly: the recorder keeps none alive), whose storages
        #: are noted again at each dump, so that a dump says what the job holds whatever the ring buffer kept
        self._optimizers: weakref.WeakSet = weakref.WeakSet()
        self._last_snapshot: tuple[dict, dict] | None = None  # kept for on_finish only
        #: the per-device micro-batch (samples), when the caller knows it (a framework callback):
        #: written to the sidecar so that the report says the largest micro-batch that fits
        self.micro_batch: int | None = None

    def _failed(self, site: str, exc: BaseException, where: str = "") -> None:
        """Count a failure caught at ``site``; warn the first time that site fails (``where``: a path)."""
        n = self.failures.get(site, 0) + 1
        self.failures[site] = n
        if n == 1:
            at = f" {where}" if where else ""
            warn(f"rank {self.rank}: {site}{at} failed ({type(exc).__name__}: {str(exc)[:300]}); training goes on "
                 "(further failures here are counted, not printed)")

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> Recorder:
        """Begin recording (a warning and nothing else when torch or CUDA is missing, or the output
        directory is unusable). Never raises."""
        self._start()
        return self

    @_guarded("starting the recording")
    def _start(self) -> None:
        if self.out_dir is None:
            return
        try:
            import torch
        except ImportError:
            warn("torch is not importable in this process: nothing is recorded")
            return
        if not torch.cuda.is_available():
            warn(f"CUDA is not available in this process (pid {os.getpid()}): nothing is recorded")
            return
        self._torch = torch
        self.active = True
        if self.context == "all":
            warn(FREE_STACKS_WARNING)
        self._refresh_dist()
        self.markers.append({"step": 0, "time_us": now_us()})
        if self.window is None or self.on_oom or self.window[0] == 0:
            self._enable(clear=False)
        if self.on_oom:
            try:
                # a private API of torch, not in its stubs (missing: caught below)
                torch._C._cuda_attach_out_of_memory_observer(self._oom_observer)  # pyright: ignore[reportAttributeAccessIssue]
            except Exception as e:  # noqa: BLE001 - private API missing: record without it
                warn(f"cannot attach the out-of-memory observer ({e}); OOMs will not be dumped")
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
            self._hook_handle = register_optimizer_step_post_hook(self._optimizer_hook)
        except Exception:  # noqa: BLE001 - very old torch: only manual steps
            self._hook_handle = None

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if len(exc) > 1 and isinstance(exc[1], BaseException):
            self.note_oom_message(exc[1])
        self.stop()

    @_guarded("noting the out-of-memory message")
    def note_oom_message(self, exc: BaseException | None) -> None:
        """Add the message of ``exc``, when it is the CUDA out-of-memory error this recorder dumped at, to the OOM
        sidecar (``oom.message``: the observer runs before PyTorch builds the message; its "this process has X
        memory in use" gives the memory outside the allocator, :mod:`oomdoctor.trace.oommessage`). Never raises."""
        if exc is None or not self.oom_dumped or not (type(exc).__name__ == "OutOfMemoryError"
                                                       or "CUDA out of memory" in str(exc)):
            return
        import json

        path = sidecar_for(os.path.join(self.out_dir or ".", snapshot_name(self.rank, oom=True)))
        with open(path) as f:
            meta = json.load(f)
        if isinstance(meta.get("oom"), dict) and "message" not in meta["oom"]:
            meta["oom"]["message"] = str(exc)[:4000]
            atomic_write_json(path, meta)

    @_guarded("step()")
    def step(self) -> None:
        """Mark the end of a training step. Calling it turns off counting by optimizer steps (their
        tensors are still noted). Never raises."""
        self._manual_steps = True
        self._advance()

    @_guarded("mark_phase()")
    def mark_phase(self, phase: str) -> None:
        """Say that from now on the job runs ``phase`` (one of :data:`.metadata.PHASES`: ``train``,
        ``optimizer``, ``evaluation``); written to the sidecar's ``phase_markers``. Never raises."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r}: expected one of {', '.join(PHASES)}")
        if self.active and not self.finished and (not self.phase_marks or self.phase_marks[-1]["phase"] != phase):
            self.phase_marks.append({"phase": phase, "time_us": now_us()})

    @_guarded("writing a snapshot")
    def dump_now(self, name: str, kind: str = "final") -> str | None:
        """Write the snapshot as it is now to ``out_dir/name`` (and its sidecar); return its path, or
        None when nothing is recorded or the write failed (logged). Never raises."""
        if not self.active or not self.recording or "/" in name or "\\" in name:
            return None
        snap, _meta = self._dump(name, kind)
        return None if snap is None else self.written[-1]

    @_guarded("stopping the recording")
    def stop(self, dump: bool = True) -> None:
        """Dump what is not dumped yet (the whole run, or an unfinished window; not with
        ``dump=False``), stop recording, detach the hooks and run ``on_finish``. Safe to call twice,
        and at interpreter exit; never raises."""
        with self._lock:
            if self.finished or not self.active:
                self.finished = True
                return
            self.finished = True
        skip_final = self.oom_dumped and self.steps_since_oom == 0
        # an OOM after the one dumped and no step since (a retry inside the except block that ran out again): the
        # job dies of that one, which the dump at the first did not see; its message is the later one's
        later = skip_final and self.later_oom is not None and dump and self.recording
        if not later:
            self.note_oom_message(getattr(sys, "last_value", None))  # at exit after an uncaught OOM
        self._remove_hook()
        self._refresh_dist()
        snap = meta = None
        window_done = self.window is not None and self.step_count > self.window[1]
        if later:
            snap, meta = self._dump(snapshot_name(self.rank, oom=True), "oom", oom=self.later_oom)
            self.note_oom_message(getattr(sys, "last_value", None))
        elif dump and not window_done and not skip_final and self.recording:
            name = snapshot_name(self.rank) if self.window is None else snapshot_name(self.rank, step=self.step_count)
            snap, meta = self._dump(name, "final" if self.window is None else "window")
        self._disable()
        if self.on_finish is not None:
            if snap is None:
                snap, meta = self._last_snapshot or (None, None)
            if snap is not None and meta is not None:  # the one is None where the other is
                try:
                    self.on_finish(self, snap, meta)
                except Exception as e:  # noqa: BLE001 - the summary must never fail the job
                    self._failed("the in-job summary", e)
        if self.failures:
            warn(f"rank {self.rank}: recording problems caught (the job was not affected): "
                 + ", ".join(f"{site} x{n}" for site, n in self.failures.items()))

    # ---- steps -----------------------------------------------------------------------------
    @_guarded("the stop's step count")
    def optimizer_step_ended(self, optimizer: Any, args: Any, kwargs: Any, after: int) -> None:
        """Count this optimizer step now, when the recorder's own step hook would run later in this step: it
        runs after the global post hook whose handle id is ``after`` when it was registered after it (handle
        ids grow: ``torch.utils.hooks.RemovableHandle``), and the caller (the injected stop) ends the process
        before it does. A recorder whose hook already ran, or has none, is left as it is."""
        handle = self._hook_handle
        if handle is not None and getattr(handle, "id", -1) > after:
            self._optimizer_hook(optimizer, args, kwargs)

    @_guarded("the optimizer step hook")
    def _optimizer_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # several optimizers step once each per training step: count the first one seen
        if self._first_optimizer is None:
            self._first_optimizer = id(optimizer)
        first = id(optimizer) == self._first_optimizer
        try:
            self._optimizers.add(optimizer)
        except TypeError:  # an optimizer object that takes no weak reference: noted at its steps only
            pass
        self._note_tensors(optimizer)
        if not self._modules_noted and getattr(optimizer, "param_groups", None) is not None:
            self._modules_noted = True  # once, whether it works or not: a scan is never repeated step after step
            self._note_modules()
        if first and not self._manual_steps:
            self._advance()

    def _device(self) -> int | str:
        return self.fact_device if self.fact_device is not None else self._torch.cuda.current_device()

    def _index_of(self, optimizer: Any) -> int:
        """The optimizer's index, in the order the hook first saw each (a new one gets the next)."""
        try:
            got = self._opt_index.get(optimizer)
        except TypeError:  # no weak reference (or unhashable): by id, for as long as the process runs
            got = self._opt_index_by_id.get(id(optimizer))
        if got is not None:
            return got
        got = len(self._fact_counts)
        self._fact_counts.append(0)
        try:
            self._opt_index[optimizer] = got
        except TypeError:
            self._opt_index_by_id[id(optimizer)] = got
        return got

    @_guarded("noting the optimizer's tensors")
    def _note_tensors(self, optimizer: Any) -> None:
        """At the end of each optimizer's first :data:`~.facts.FACT_STEPS` steps (and its first ones inside a ``steps``
        window), whichever optimizer steps first:
        the storages of its parameters, their gradients and its state, one record per optimizer and step (noted at
        that optimizer's own step end, so that the accounting places them at their own time)."""
        if not self.active or self._torch is None or getattr(optimizer, "param_groups", None) is None:
            return
        i = self._index_of(optimizer)
        if self._fact_counts[i] >= FACT_STEPS:
            return
        when = now_us()
        found = optimizer_storages(optimizer, self._device())
        self._fact_counts[i] += 1
        self.tensor_facts.append({"step": self.step_count, "time_us": when, "storages": found, "optimizer": i,
                                  "class": class_path(optimizer)})

    @_guarded("noting the modules")
    def _note_modules(self) -> None:
        """Once, at the end of the first optimizer step: every root module's parameters and buffers on this device
        (:func:`.facts.module_roots` over ``gc.get_objects()``; the roots are then kept weakly for the dumps)."""
        module_type = getattr(getattr(self._torch, "nn", None), "Module", None)
        if not self.active or not isinstance(module_type, type):
            return
        when = now_us()
        t0 = time.perf_counter()
        objects = gc.get_objects()
        try:
            roots = module_roots(objects, module_type)
        finally:
            del objects
        roots_rec = module_record(roots, self._device())
        self._roots = []
        for r in roots:
            try:
                self._roots.append(weakref.ref(r))
            except TypeError:
                pass
        self.module_facts.append({"step": self.step_count, "time_us": when, "roots": roots_rec,
                                  "scan_s": round(time.perf_counter() - t0, 4)})

    def _advance(self) -> None:
        if not self.active or self.finished:
            return
        self.step_count += 1
        if self.oom_dumped:
            self.steps_since_oom += 1
        self.markers.append({"step": self.step_count, "time_us": now_us()})
        if self.store is None:
            self._refresh_dist()
        if self.window is not None:
            a, b = self.window
            if self.step_count == a and a > 0:
                self._enable(clear=True)
                # the records of the first steps lie before the window, which the accounting cannot place: each
                # optimizer's first FACT_STEPS steps inside it are noted as well
                self._fact_counts = [0] * len(self._fact_counts)
            elif self.step_count == b + 1:
                self._dump(snapshot_name(self.rank, step=b), "window")
                self._disable()
        if self.recording and self.stack_plan is not None:
            if self.step_count == self.stack_plan[0] and self.stack_fit is None:
                self._fit_every()
            self._switch_stacks(stacked_step(self.stack_plan, self.step_count))

    # ---- recording ----------------------------------------------------------------------------
    def _history_kwargs(self, stacks_on: bool) -> dict[str, Any]:
        return {"context": self.context if stacks_on else None,
                "stacks": "python" if self.stacks == "none" else self.stacks, "max_entries": self.max_entries}

    def _enable(self, clear: bool) -> None:
        mem = self._torch.cuda.memory
        on = self.context is not None and stacked_step(self.stack_plan, self.step_count)
        try:
            mem._record_memory_history("all", clear_history=clear, **self._history_kwargs(on))
        except TypeError:  # torch < 2.4: no clear_history, and a second call would clear: stacks at every step
            self.stack_plan = None
            on = self.context is not None
            mem._record_memory_history("all", **self._history_kwargs(on))
        self.recording = True
        if self.stack_plan is not None:
            self._stacks_on = on
            self.stack_marks.append({"step": self.step_count, "stacks": on, "time_us": now_us()})

    def _fit_every(self) -> None:
        """Once, when the first K steps end: count the events of the last step (one ``_snapshot()``) and make
        stacked steps frequent enough that the ring buffer still holds two of them
        (``N <= max_entries / (2 * events per step)``); without one, stack-less steps cannot be matched. A
        failure leaves N as asked (logged)."""
        assert self.stack_plan is not None  # called when the plan's first K steps end
        self.stack_fit = {"asked": list(self.stack_plan), "events_per_step": None}
        first, every = self.stack_plan
        if every == 0 or len(self.markers) < 2:
            return
        try:
            snap = self._torch.cuda.memory._snapshot()
            traces = snap.get("device_traces") or []
            device = self._torch.cuda.current_device()
            t0 = int(self.markers[-2]["time_us"])
            n = sum(1 for e in (traces[device] if device < len(traces) else []) if int(e.get("time_us", 0)) >= t0)
            del snap, traces
        except Exception as e:  # noqa: BLE001 - the job goes on with N as asked
            self._failed("counting the events of a step", e)
            return
        self.stack_fit["events_per_step"] = n
        if n > 0:
            fit = max(1, self.max_entries // (2 * n))
            if fit < every:
                self.stack_plan = (first, fit)

    def _switch_stacks(self, on: bool) -> None:
        """Gather stacks from now on (or stop), keeping the history (``clear_history=False``)."""
        if on == self._stacks_on:
            return
        self._torch.cuda.memory._record_memory_history("all", clear_history=False, **self._history_kwargs(on))
        self._stacks_on = on
        self.stack_marks.append({"step": self.step_count, "stacks": on, "time_us": now_us()})

    def _disable(self) -> None:
        if self.recording:
            self.recording = False
            try:
                self._torch.cuda.memory._record_memory_history(None)
            except Exception as e:  # noqa: BLE001
                self._failed("stopping the allocator's history", e)

    def _oom_observer(self, device: int, alloc: int, device_limit: int, device_free: int) -> None:
        # Runs inside the allocator's failing malloc: never raise (it would propagate into the allocator)
        try:
            oom = {"device": int(device), "alloc_bytes": int(alloc), "device_limit_bytes": int(device_limit),
                   "device_free_bytes": int(device_free)}
            with self._lock:
                if self.finished:  # observers cannot be detached: a stopped one is inert
                    return
                if self.oom_dumped:  # dumped once (a job catching OOMs in a loop would dump at each): noted only
                    self.later_oom, self.steps_since_oom = oom, 0
                    return
                self.oom_dumped = True
            self._dump(snapshot_name(self.rank, oom=True), "oom", oom=oom)
        except BaseException as e:  # noqa: BLE001 - nothing may unwind into the allocator
            self._failed("the out-of-memory dump", e)

    def _refresh_dist(self) -> None:
        """Keep the process group's store once seen: scripts often destroy the group before exit."""
        try:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                self.rank, _, self.world_size = rank_info(os.environ, dist)
                self.store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001
            pass

    def _dump_facts(self) -> dict[str, Any] | None:
        """The storages of every optimizer seen so far, noted now (right after ``_snapshot()``, before
        anything else runs on this thread): a record with ``"at": "dump"`` that the accounting maps onto the
        snapshot's final state (:mod:`.facts`). None when no optimizer was seen or noting failed."""
        optimizers = list(self._optimizers)
        if not optimizers:
            return None
        try:
            device = self._device()
            merged: dict[str, set[tuple[int, int]]] = {}
            for opt in optimizers:
                for kind, items in optimizer_storages(opt, device).items():
                    merged.setdefault(kind, set()).update(items)
            return fact_record(self.step_count, now_us(), merged, at="dump", optimizers=len(optimizers))
        except Exception as e:  # noqa: BLE001 - an optimizer mid-update: the dump goes on without facts
            self._failed("noting the optimizer's tensors at a dump", e)
            return None

    def _dump_modules(self) -> dict[str, Any] | None:
        """The roots found at the first optimizer step, noted again now (right after ``_snapshot()``): a record with
        ``"at": "dump"`` for the snapshot's final state. None before the first step, or when none is left."""
        roots = [r for r in (ref() for ref in self._roots) if r is not None]
        if not roots:
            return None
        try:
            return {"step": self.step_count, "time_us": now_us(), "at": "dump",
                    "roots": module_record(roots, self._device())}
        except Exception as e:  # noqa: BLE001 - a module mid-change: the dump goes on without it
            self._failed("noting the modules at a dump", e)
            return None

    def _counters(self, snap: dict | None) -> list[dict[str, Any]] | None:
        """PyTorch's counters of every device ``snap`` recorded (:func:`.metadata.device_counters`), read
        right after ``_snapshot()``; None when even the device list cannot be read (never raises)."""
        try:
            devices = recorded_devices(snap, self._torch.cuda.current_device())
            return device_counters(self._torch, devices)
        except Exception as e:  # noqa: BLE001 - the dump goes on without them
            self._failed("reading the allocator's counters", e)
            return None

    def metadata(self, snap: dict | None, kind: str, oom: dict | None = None,
                 dump_facts: dict[str, Any] | None = None,
                 counters: list[dict[str, Any]] | None = None,
                 dump_modules: dict[str, Any] | None = None) -> dict[str, Any]:
        """The sidecar of a dump (see :mod:`.metadata`); ``dump_facts`` / ``dump_modules``: :meth:`_dump_facts` /
        :meth:`_dump_modules` of this dump; ``counters``: :meth:`_counters` of this dump (read here when not
        given)."""
        torch = self._torch
        device = torch.cuda.current_device()
        meta: dict[str, Any] = {"format": SIDECAR_FORMAT, "kind": kind, "rank": self.rank,
                                "local_rank": self.local_rank, "world_size": self.world_size, **host_info()}
        meta.update(torch_info(torch, device))
        meta["env"] = env_subset(os.environ)
        meta["recording"] = {"max_entries": self.max_entries, "stacks": self.stacks, "context": self.context,
                             "steps": list(self.window) if self.window else None,
                             "stack_steps": None if self.stack_plan is None else list(self.stack_plan),
                             "stack_steps_fit": self.stack_fit}
        try:
            meta["memory_stats"] = dict(torch.cuda.memory_stats(device))
        except Exception:  # noqa: BLE001
            meta["memory_stats"] = None
        try:  # cudaMemGetInfo: with reserved bytes, the most the allocator could hold now
            free, total = torch.cuda.mem_get_info(device)
            meta["device_free_bytes"] = int(free)
        except Exception:  # noqa: BLE001
            meta["device_free_bytes"] = None
        meta["device_counters"] = counters if counters is not None else self._counters(snap)
        meta["tensors"] = [fact_record(f["step"], f["time_us"], f["storages"], optimizer=f["optimizer"],
                                       **{"class": f["class"]}) for f in self.tensor_facts]
        if dump_facts is not None:
            meta["tensors"].append(dump_facts)
        meta["modules"] = [*self.module_facts, *([dump_modules] if dump_modules is not None else [])]
        times: list[int] = []
        if snap is not None:
            traces = snap.get("device_traces") or []
            if device < len(traces):
                times = [int(e.get("time_us", 0)) for e in traces[device]]
        meta["step_markers"] = place_markers(self.markers, times)
        meta["phase_markers"] = place_markers(self.phase_marks, times)
        if self.stack_plan is not None:
            meta["stack_markers"] = place_markers(self.stack_marks, times)
        meta["steps_completed"] = self.step_count
        meta["micro_batch"] = self.micro_batch
        meta["oom"] = oom
        if oom is not None and meta.get("memory_cap_bytes") is None and oom["device_limit_bytes"] < (meta[
                "gpu_total_memory_bytes"] or 0):
            # the observer's third argument is the fraction cap when one is set (CUDACachingAllocator.cpp)
            meta["memory_cap_bytes"] = oom["device_limit_bytes"]
        meta["written_time_us"] = now_us()
        return meta

    def _dump(self, name: str, kind: str, oom: dict | None = None) -> tuple[dict, dict] | tuple[None, None]:
        """Write ``name`` and its sidecar atomically; a failure is logged (once per run) and returns
        (None, None). The sidecar's ``dump`` says how long the snapshot and the write took (seconds)."""
        path = os.path.join(self.out_dir or ".", name)
        try:
            t0 = time.perf_counter()
            snap = self._torch.cuda.memory._snapshot()
            counters = self._counters(snap)  # the job's own peaks, at the state the snapshot holds
            facts = self._dump_facts()
            modules = self._dump_modules()
            t1 = time.perf_counter()
            atomic_write_bytes(path, pickle.dumps(snap))
            t2 = time.perf_counter()
            meta = self.metadata(snap, kind, oom, facts, counters, modules)
            meta["dump"] = {"snapshot_s": round(t1 - t0, 4), "pickle_and_write_s": round(t2 - t1, 4)}
            atomic_write_bytes(sidecar_for(path), sidecar_json_bytes(meta))
        except Exception as e:  # noqa: BLE001 - disk full, permissions: training goes on
            self._failed("writing a snapshot", e, where=path)
            return None, None
        self.written.append(path)
        if self.on_finish is not None:
            self._last_snapshot = (snap, meta)
        return snap, meta

    def _remove_hook(self) -> None:
        if self._hook_handle is not None:
            try:
                self._hook_handle.remove()
            except Exception:  # noqa: BLE001
                pass
            self._hook_handle = None


__all__ = ["ALL_STEPS", "DEFAULT_MAX_ENTRIES", "DEFAULT_STACK_STEPS", "FREE_STACKS_WARNING", "CaptureError",
           "Recorder", "parse_stack_steps", "parse_steps", "stacked_step", "warn"]
