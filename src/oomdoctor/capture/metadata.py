"""The sidecar written beside every snapshot (``<stem>.meta.json``).

A snapshot records neither the rank, the host, the versions, the GPU nor the memory cap
(``shared/reference/snapshot_format_and_peers.md`` §1.3: "Absent from every version"), so the
recorder writes them here. Keys (bytes, µs since the Unix epoch)::

    {"format": "oomdoctor.sidecar/1", "kind": "final" | "window" | "oom",
     "rank", "local_rank", "world_size", "host", "pid",
     "torch_version", "cuda_version", "nccl_version",
     "device", "gpu_name", "gpu_total_memory_bytes",
     "memory_fraction", "memory_cap_bytes",           # set_per_process_memory_fraction, else null
     "env": {PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF, TORCH_NCCL_*, NCCL_*, ...},
     "recording": {"max_entries", "stacks", "context", "steps"},
     "memory_stats": torch.cuda.memory_stats() at the dump,
     "device_free_bytes": cudaMemGetInfo's free bytes at the dump,   # + reserved = the allocator's room
     "device_counters": [{"device", "time_us", "allocated_bytes.all.peak", "reserved_bytes.all.peak",
                          "active_bytes.all.peak", "allocated_bytes.all.current", "reserved_bytes.all.current",
                          "num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
                          "device_free_bytes", "device_total_bytes", "gpu_total_memory_bytes"}],
                                  # per device recorded, read right after _snapshot() (see device_counters)
     "tensors": [{"step", "time_us", "parameters", "gradients", "optimizer_state",
                  "optimizer"?, "class"?, "at"?, "optimizers"?}],  # .facts: per optimizer and step, + each dump
     "modules": [{"step", "time_us", "at"?, "roots": [{"class", "parts", "parameters", "gradients", "untouched", "frozen",
                                                 "buffers"}]}],
                                  # .facts: every root module's parameters and buffers at the first step, + each dump
     "step_markers": [{"step", "time_us", "event_index"}],  # start of each step
     "phase_markers": [{"phase", "time_us", "event_index"}],  # from then on: train | optimizer | evaluation
     "micro_batch": null | samples per device per forward pass (set by the framework callbacks),
     "oom": null | {"device", "alloc_bytes", "device_limit_bytes", "device_free_bytes",
                    "message"?},  # PyTorch's OOM message, added when the job dies of it (Recorder.note_oom_message)
     "written_time_us"}

``trace.load`` merges these keys into ``Trace.meta``; the detectors read ``torch_version``,
``step_markers``, ``phase_markers`` (the phases analysis), ``memory_stats.num_alloc_retries`` and ``pp_rank``; the simulator reads
``memory_cap_bytes`` and ``gpu_total_memory_bytes``; ``oomdoctor.analysis.jobpeak`` reads ``device_counters``
(else ``memory_stats``): the job's own peaks, which a ring buffer may have dropped (issue 41). Every key
but ``format`` may be absent: older sidecars have no ``device_counters``.
"""

from __future__ import annotations

import os
import socket
import time
from bisect import bisect_left
from typing import Any, Mapping

SIDECAR_FORMAT = "oomdoctor.sidecar/1"
PHASES = ("train", "optimizer", "evaluation")
"""What a framework callback can say the job runs (``phase_markers``; :mod:`oomdoctor.integrations`)."""
ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
             "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS",
             "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
             "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
ENV_PREFIXES = ("TORCH_NCCL_", "NCCL_", "PYTORCH_CUDA_", "TORCH_CUDA_")


def env_subset(environ: Mapping[str, str]) -> dict[str, str]:
    """The allocator-, CUDA-, NCCL- and launcher-related variables of ``environ``, sorted by name."""
    return {k: environ[k] for k in sorted(environ) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}


def _int_env(environ: Mapping[str, str], name: str) -> int | None:
    try:
        return int(environ[name])
    except (KeyError, ValueError):
        return None


def rank_info(environ: Mapping[str, str], dist: Any = None) -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)``: from an initialised ``torch.distributed`` when given, else
    from the launcher's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``: torchrun, SLURM via
    ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``, Open MPI ``OMPI_COMM_WORLD_*``), else ``(0, 0, 1)``."""
    rank = local = world = None
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                rank, world = dist.get_rank(), dist.get_world_size()
        except Exception:  # noqa: BLE001 - a broken process group must not stop the recording
            rank = world = None
    for r, lr, w in (("RANK", "LOCAL_RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
                     ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE")):
        if _int_env(environ, r) is not None:
            rank = rank if rank is not None else _int_env(environ, r)
            local = _int_env(environ, lr)
            world = world if world is not None else _int_env(environ, w)
            break
    rank = 0 if rank is None else rank
    return rank, (local if local is not None else rank), (world if world is not None else 1)


def now_us() -> int:
    """Microseconds since the Unix epoch: the clock of the trace's ``time_us`` (PR #112266)."""
    return time.time_ns() // 1000


def place_markers(markers: list[dict[str, int]], times_us: list[int]) -> list[dict[str, int]]:
    """Each step marker with ``event_index``: the first trace entry at or after its time (entries
    are in time order), ``len(times_us)`` when none follows; markers before the first entry get 0.

    Args:
        markers: ``[{"step": i, "time_us": t}, ...]``.
        times_us: the ``time_us`` of the device trace's entries, in order.
    """
    return [{**m, "event_index": bisect_left(times_us, int(m["time_us"]))} for m in markers]


def host_info() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def torch_info(torch: Any, device: int) -> dict[str, Any]:
    """Versions, GPU and memory cap, read from a live ``torch`` (called only where CUDA is available)."""
    info: dict[str, Any] = {"torch_version": str(torch.__version__), "cuda_version": torch.version.cuda,
                            "device": device}
    try:
        v = torch.cuda.nccl.version()
        info["nccl_version"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - NCCL absent from this build
        info["nccl_version"] = None
    try:
        props = torch.cuda.get_device_properties(device)
        info["gpu_name"], total = str(props.name), int(props.total_memory)
    except Exception:  # noqa: BLE001 - the snapshot is still worth writing without the GPU's name and size
        info["gpu_name"], total = None, None
    info["gpu_total_memory_bytes"] = total
    fraction = None
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None:
        try:
            fraction = float(getter(device))
        except Exception:  # noqa: BLE001
            fraction = None
    info["memory_fraction"] = fraction
    # CUDACachingAllocator.cpp setMemoryFraction: allowed_memory_maximum = fraction * device_total
    info["memory_cap_bytes"] = (int(fraction * total) if fraction is not None and fraction < 1 and total is not None
                                else None)
    return info


COUNTER_KEYS = ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "active_bytes.all.peak",
                "allocated_bytes.all.current", "reserved_bytes.all.current",
                "num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")
"""The ``torch.cuda.memory_stats()`` counters noted per device at every dump (``c10/cuda/CUDACachingAllocator.cpp``
``DeviceStats``: bytes, or counts since the process started; ``*.peak`` since the last
``reset_peak_memory_stats``)."""


def recorded_devices(snap: Any, current: int) -> list[int]:
    """The devices a snapshot holds anything for (a non-empty ``device_traces[i]`` or a segment on it), and
    ``current``; sorted. Only these are asked for counters: ``cudaMemGetInfo`` on a device the process never
    used would create a CUDA context there (hundreds of MiB the job did not ask for)."""
    devs = {int(current)}
    if isinstance(snap, dict):
        for i, tr in enumerate(snap.get("device_traces") or []):
            if tr:
                devs.add(i)
        for s in snap.get("segments") or []:
            d = s.get("device") if isinstance(s, dict) else None
            if isinstance(d, int) and not isinstance(d, bool):
                devs.add(d)
    return sorted(devs)


def device_counters(torch: Any, devices: list[int]) -> list[dict[str, Any]]:
    """PyTorch's own counters of each device in ``devices``, now: :data:`COUNTER_KEYS` from
    ``torch.cuda.memory_stats(d)`` (bytes / counts), ``device_free_bytes`` and ``device_total_bytes`` from
    ``torch.cuda.mem_get_info(d)`` (``cudaMemGetInfo``: bytes), ``gpu_total_memory_bytes`` from
    ``get_device_properties(d).total_memory`` and ``time_us`` (µs since the epoch, the trace's clock). A value
    that cannot be read is None (each call is guarded); never raises. Reading them allocates nothing on the
    device (``memory_stats`` reads the allocator's ``DeviceStats`` under its lock)."""
    out: list[dict[str, Any]] = []
    for d in devices:
        rec: dict[str, Any] = {"device": int(d), "time_us": now_us()}
        try:
            stats = torch.cuda.memory_stats(d)
        except Exception:  # noqa: BLE001 - a broken device or an old torch: record what can be read
            stats = None
        for k in COUNTER_KEYS:
            v = stats.get(k) if isinstance(stats, dict) else None
            rec[k] = int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
        try:
            free, total = torch.cuda.mem_get_info(d)
            rec["device_free_bytes"], rec["device_total_bytes"] = int(free), int(total)
        except Exception:  # noqa: BLE001
            rec["device_free_bytes"] = rec["device_total_bytes"] = None
        try:
            rec["gpu_total_memory_bytes"] = int(torch.cuda.get_device_properties(d).total_memory)
        except Exception:  # noqa: BLE001
            rec["gpu_total_memory_bytes"] = None
        out.append(rec)
    return out
