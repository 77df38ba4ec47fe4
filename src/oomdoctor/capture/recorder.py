"""Recording a rank's CUDA memory history: start, step windows, the OOM dump, the final dump.

Calls PyTorch's recording API (``shared/reference/snapshot_format_and_peers.md`` §1.1, §1.8):
``torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
max_entries=N)``, ``torch.cuda.memory._snapshot()`` (the dict ``_dump_snapshot`` pickles, so the
files open in pytorch.org/memory_viz), and ``torch._C._cuda_attach_out_of_memory_observer``, whose
callback runs after the ``oom`` trace entry and before the exception unwinds, so the dump holds the
state at the failure. Steps are counted by a global optimizer step hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``) until the user calls
:meth:`Recorder.step` themselves.

Overhead: the allocator gathers a Python stack per event (about 2 µs, PyTorch's docstring) and keeps at
most ``max_entries`` events in a ring buffer; ``stacks="all"`` (C++ frames too) costs more and has
hung the unwinder on generated code (torchtitan PR #2991), so it is not the default.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
from typing import Any, Callable

from .files import (
    CaptureError,
    atomic_write_bytes,
    atomic_write_json,
    ensure_writable,
    sidecar_for,
    snapshot_name,
)
from .metadata import SIDECAR_FORMAT, env_subset, host_info, now_us, place_markers, rank_info, torch_info

DEFAULT_MAX_ENTRIES = 100_000
STACKS = ("python", "all")

#: ``on_finish(recorder, snapshot_dict, meta)``: called once on every rank after the last dump
#: (the in-job summary plugs in here).
FinishHook = Callable[["Recorder", dict, dict], None]


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


class Recorder:
    """Records this process's CUDA memory history into ``out_dir`` (see :mod:`.files` for the names).

    Args:
        out_dir: created if missing; checked writable at once.
        steps: ``None`` (record everything; dump when stopped) or a window ``(A, B)`` / ``"A:B"``:
            record steps A..B (from 0) and dump ``rank{R}_step{B}.pickle`` when step B ends.
        max_entries: ring-buffer length (events) of the allocator's history.
        stacks: ``"python"`` or ``"all"`` (adds C++ frames).
        on_oom: dump ``rank{R}_oom.pickle`` from the out-of-memory observer. With a step window,
            history is then kept from the start (bounded by ``max_entries``) so that an OOM before the
            window still has it; it is cleared when the window opens.
        on_finish: called after the last dump (see :data:`FinishHook`).

    Raises:
        CaptureError: bad ``steps``/``stacks``/``max_entries``, or an unwritable ``out_dir``.
    """

    def __init__(self, out_dir: str, *, steps: Any = None, max_entries: int = DEFAULT_MAX_ENTRIES,
                 stacks: str = "python", on_oom: bool = True, on_finish: FinishHook | None = None) -> None:
        if stacks not in STACKS:
            raise CaptureError(f"stacks {stacks!r}: expected one of {', '.join(STACKS)}")
        if not isinstance(max_entries, int) or max_entries < 1:
            raise CaptureError(f"max_entries {max_entries!r}: expected a positive integer")
        self.window = parse_steps(steps)
        self.out_dir = ensure_writable(out_dir)
        self.max_entries = max_entries
        self.stacks = stacks
        self.on_oom = on_oom
        self.on_finish = on_finish
        self.step_count = 0
        self.markers: list[dict[str, int]] = []
        self.written: list[str] = []
        self.active = False          # recording has been started (CUDA present)
        self.recording = False       # history is being recorded now
        self.finished = False
        self.oom_dumped = False
        self.steps_since_oom = 0
        self.rank, self.local_rank, self.world_size = rank_info(os.environ)
        self.store: Any = None
        self._torch: Any = None
        self._lock = threading.RLock()
        self._hook_handle: Any = None
        self._first_optimizer: int | None = None
        self._manual_steps = False
        self._last_snapshot: tuple[dict, dict] | None = None  # kept for on_finish only

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> Recorder:
        """Begin recording (a warning and nothing else when torch or CUDA is missing)."""
        try:
            import torch
        except ImportError:
            warn("torch is not importable in this process: nothing is recorded")
            return self
        if not torch.cuda.is_available():
            warn(f"CUDA is not available in this process (pid {os.getpid()}): nothing is recorded")
            return self
        self._torch = torch
        self.active = True
        self._refresh_dist()
        self.markers.append({"step": 0, "time_us": now_us()})
        if self.window is None or self.on_oom or self.window[0] == 0:
            self._enable(clear=False)
        if self.on_oom:
            try:
                torch._C._cuda_attach_out_of_memory_observer(self._oom_observer)
            except Exception as e:  # noqa: BLE001 - private API missing: record without it
                warn(f"cannot attach the out-of-memory observer ({e}); OOMs will not be dumped")
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
            self._hook_handle = register_optimizer_step_post_hook(self._optimizer_hook)
        except Exception:  # noqa: BLE001 - very old torch: only manual steps
            self._hook_handle = None
        return self

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def step(self) -> None:
        """Mark the end of a training step. Calling it turns off counting by optimizer steps."""
        if not self._manual_steps:
            self._manual_steps = True
            self._remove_hook()
        self._advance()

    def stop(self) -> None:
        """Dump what is not dumped yet (the whole run, or an unfinished window), stop recording,
        detach the hooks and run ``on_finish``. Safe to call twice, and at interpreter exit."""
        with self._lock:
            if self.finished or not self.active:
                self.finished = True
                return
            self.finished = True
        self._remove_hook()
        self._refresh_dist()
        snap = meta = None
        window_done = self.window is not None and self.step_count > self.window[1]
        skip_final = self.oom_dumped and self.steps_since_oom == 0
        if not window_done and not skip_final and self.recording:
            name = snapshot_name(self.rank) if self.window is None else snapshot_name(self.rank, step=self.step_count)
            snap, meta = self._dump(name, "final" if self.window is None else "window")
        self._disable()
        if self.on_finish is not None:
            if snap is None:
                snap, meta = self._last_snapshot or (None, None)
            if snap is not None:
                try:
                    self.on_finish(self, snap, meta)
                except Exception as e:  # noqa: BLE001 - the summary must never fail the job
                    warn(f"in-job summary failed on rank {self.rank}: {type(e).__name__}: {e}")

    # ---- steps -----------------------------------------------------------------------------
    def _optimizer_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # several optimizers step once each per training step: count the first one seen
        if self._first_optimizer is None:
            self._first_optimizer = id(optimizer)
        if id(optimizer) == self._first_optimizer:
            self._advance()

    def _advance(self) -> None:
        if not self.active or self.finished:
            return
        self.step_count += 1
        if self.oom_dumped:
            self.steps_since_oom += 1
        self.markers.append({"step": self.step_count, "time_us": now_us()})
        if self.store is None:
            self._refresh_dist()
        if self.window is None:
            return
        a, b = self.window
        if self.step_count == a and a > 0:
            self._enable(clear=True)
        elif self.step_count == b + 1:
            self._dump(snapshot_name(self.rank, step=b), "window")
            self._disable()

    # ---- recording ----------------------------------------------------------------------------
    def _enable(self, clear: bool) -> None:
        mem = self._torch.cuda.memory
        kw: dict[str, Any] = {"context": "all", "stacks": self.stacks, "max_entries": self.max_entries}
        try:
            mem._record_memory_history("all", clear_history=clear, **kw)
        except TypeError:  # torch < 2.4: no clear_history
            mem._record_memory_history("all", **kw)
        self.recording = True

    def _disable(self) -> None:
        if self.recording:
            try:
                self._torch.cuda.memory._record_memory_history(None)
            except Exception as e:  # noqa: BLE001
                warn(f"could not stop recording: {e}")
            self.recording = False

    def _oom_observer(self, device: int, alloc: int, device_limit: int, device_free: int) -> None:
        # Runs inside the allocator's failing malloc: never raise (it would propagate into the allocator)
        try:
            with self._lock:
                if self.oom_dumped:
                    return
                self.oom_dumped = True
            oom = {"device": int(device), "alloc_bytes": int(alloc), "device_limit_bytes": int(device_limit),
                   "device_free_bytes": int(device_free)}
            self._dump(snapshot_name(self.rank, oom=True), "oom", oom=oom)
        except BaseException as e:  # noqa: BLE001
            warn(f"out-of-memory dump failed: {type(e).__name__}: {e}")

    def _refresh_dist(self) -> None:
        """Keep the process group's store once seen: scripts often destroy the group before exit."""
        try:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                self.rank, _, self.world_size = rank_info(os.environ, dist)
                self.store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001
            pass

    def metadata(self, snap: dict | None, kind: str, oom: dict | None = None) -> dict[str, Any]:
        """The sidecar of a dump (see :mod:`.metadata`)."""
        torch = self._torch
        device = torch.cuda.current_device()
        meta: dict[str, Any] = {"format": SIDECAR_FORMAT, "kind": kind, "rank": self.rank,
                                "local_rank": self.local_rank, "world_size": self.world_size, **host_info()}
        meta.update(torch_info(torch, device))
        meta["env"] = env_subset(os.environ)
        meta["recording"] = {"max_entries": self.max_entries, "stacks": self.stacks, "context": "all",
                             "steps": list(self.window) if self.window else None}
        try:
            meta["memory_stats"] = dict(torch.cuda.memory_stats(device))
        except Exception:  # noqa: BLE001
            meta["memory_stats"] = None
        times: list[int] = []
        if snap is not None:
            traces = snap.get("device_traces") or []
            if device < len(traces):
                times = [int(e.get("time_us", 0)) for e in traces[device]]
        meta["step_markers"] = place_markers(self.markers, times)
        meta["steps_completed"] = self.step_count
        meta["oom"] = oom
        if oom is not None and meta.get("memory_cap_bytes") is None and oom["device_limit_bytes"] < meta[
                "gpu_total_memory_bytes"]:
            # the observer's third argument is the fraction cap when one is set (CUDACachingAllocator.cpp)
            meta["memory_cap_bytes"] = oom["device_limit_bytes"]
        meta["written_time_us"] = now_us()
        return meta

    def _dump(self, name: str, kind: str, oom: dict | None = None) -> tuple[dict, dict] | tuple[None, None]:
        """Write ``name`` and its sidecar atomically; a failure warns and returns (None, None)."""
        path = os.path.join(self.out_dir, name)
        try:
            snap = self._torch.cuda.memory._snapshot()
            meta = self.metadata(snap, kind, oom)
            atomic_write_bytes(path, pickle.dumps(snap))
            atomic_write_json(sidecar_for(path), meta)
        except Exception as e:  # noqa: BLE001 - disk full, permissions: training goes on
            warn(f"could not write {path}: {type(e).__name__}: {e}; training goes on")
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


__all__ = ["DEFAULT_MAX_ENTRIES", "CaptureError", "Recorder", "parse_steps", "warn"]
