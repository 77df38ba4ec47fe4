"""A traced step as a memory snapshot and its sidecar, in the formats every oomdoctor command reads.

The snapshot is the dict ``torch.cuda.memory._dump_snapshot()`` pickles (``segments``, ``device_traces``,
``allocator_settings``, ``external_annotations``; ``shared/reference/snapshot_format_and_peers.md``), with
``segments`` empty: the tracer records requests only, the allocator model (:mod:`oomdoctor.simulate`) lays
them out. The sidecar (:mod:`oomdoctor.capture.metadata`) says the trace is a preflight one, the GPU assumed,
and what lives outside the caching allocator.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

from ..capture.files import FILE, sidecar_for, write_target
from ..capture.metadata import SIDECAR_FORMAT, place_markers

# the GPU table and the constants outside the allocator are the planner's, one definition each (plan/gpus.py,
# plan/terms.py, measured on H200, docs/plan.md)
from ..plan.gpus import GPUS as GPUS
from ..plan.terms import CUBLAS_WORKSPACE_BYTES
from ..plan.terms import CUDA_CONTEXT_BYTES as CUDA_CONTEXT_BYTES
from ..plan.terms import NCCL_FIRST_COMMUNICATOR_BYTES as NCCL_FIRST_COMMUNICATOR_BYTES
from .tracer import TraceRecord


def cublas_workspace_bytes(sm_major: int) -> int:
    """Bytes of one cuBLAS workspace: 32 MiB on sm90+ (Hopper, Blackwell:
    :data:`oomdoctor.plan.terms.CUBLAS_WORKSPACE_BYTES`), else 8.125 MiB (``CUDABlas.cpp``
    ``_getWorkspaceSizeFromEnv`` defaults: ``:4096:2:16:8``, 4096 KiB x 2 + 16 KiB x 8)."""
    return CUBLAS_WORKSPACE_BYTES if sm_major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def snapshot_dict(record: TraceRecord) -> dict[str, Any]:
    """The snapshot of a trace: its events as device 0's trace, no segments, the default allocator
    settings (``PYTORCH_CUDA_ALLOC_CONF`` unset)."""
    return {"segments": [], "device_traces": [list(record.events)],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                                   "garbage_collection_threshold": 0.0, "expandable_segments": False,
                                   "pinned_num_register_threads": 1, "release_lock_on_malloc": False,
                                   "pinned_use_host_register": False, "roundup_power2_divisions": {}},
            "external_annotations": []}


def tensor_facts(record: TraceRecord) -> list[dict[str, Any]]:
    """The sidecar's ``tensors`` records (:mod:`oomdoctor.capture.facts`): the tracer's notes of parameters, gradients
    and optimizer state, each with ``workspaces``: the kernel buffers the tracer made through the allocator before
    the note and keeps for good (cuBLAS's workspace of each thread, ``TraceRecord.extra_allocations``), as
    ``[[addr, bytes], ...]``. The accounting places them from these facts: the autograd engine's workspace has a
    weight's size when a weight is 32 MiB, and its lifetime alone reads as a gradient's (issue 52)."""
    born = {e["addr"]: e["time_us"] for e in record.events if e["action"] == "alloc"}
    kept = [(born[k["addr"]], k["addr"], k["bytes"]) for k in record.extra_allocations if k["addr"] in born]
    return [{**rec, "workspaces": sorted([a, n] for t, a, n in kept if t <= rec["time_us"])} for rec in record.tensors]


def sidecar(record: TraceRecord, *, gpu_name: str | None, gpu_total_bytes: int | None, torch_version: str,
            micro_batch: int | None, job: dict[str, Any]) -> dict[str, Any]:
    """The sidecar of a traced snapshot (:mod:`oomdoctor.capture.metadata` keys, plus ``preflight``)."""
    times = [e["time_us"] for e in record.events]
    return {
        "format": SIDECAR_FORMAT, "kind": "final", "rank": 0, "local_rank": 0, "world_size": 1,
        "host": None, "pid": os.getpid(), "torch_version": torch_version, "cuda_version": None,
        "nccl_version": None, "device": 0, "gpu_name": gpu_name, "gpu_total_memory_bytes": gpu_total_bytes,
        "memory_fraction": None, "memory_cap_bytes": None, "env": {},
        "recording": {"max_entries": None, "stacks": "python", "context": "alloc", "steps": None},
        "tensors": tensor_facts(record),
        **({"modules": record.modules} if record.modules else {}),
        "step_markers": place_markers(record.step_markers, times),
        "phase_markers": place_markers(record.phase_markers, times),
        "micro_batch": micro_batch, "oom": None,
        "framework": "preflight",
        "preflight": {
            "traced_by": "oomdoctor preflight (FakeTensorMode, fake CPU tensors with CUDA's autocast lists, "
                         "attention kernel and optimizer kernels)",
            "job": job,
            "outside_allocator_bytes": CUDA_CONTEXT_BYTES,
            "outside_allocator_source": "CUDA context + kernels of a training step: 737 MB measured on H200, "
                                        "CUDA 13.0, torch 2.11 (the constant oomdoctor plan uses)",
            "kernel_buffers": record.extra_allocations,
            "backward_allocations": record.backward_events,
            "backward_thread": "autograd engine (on CUDA); traced on the calling thread, frames cut at the "
                               "engine's entry",
            "streams": [0],
            "trace_wall_s": round(record.wall_s, 3),
            "invented_values": record.invented_values,
            "notes": record.notes,
        },
    }


def write(path: str | Path, snap: dict[str, Any], meta: dict[str, Any]) -> tuple[Path, Path | None]:
    """Write ``path`` (the pickle) and its sidecar beside it (``capture.files.sidecar_for``: ``x.pickle`` ->
    ``x.meta.json``) through the project's one output writer (:func:`oomdoctor.capture.files.write_target`:
    a temporary file renamed over the target, atomic; a link followed; a FIFO or device written as a
    stream, and then no sidecar, which has nowhere beside it to go). Returns both paths (the sidecar's None
    when not written).

    Raises:
        OutputError: ``path`` is a directory, its directory is missing, or it may not be written.
        OSError: the write failed (disk full); a previous file is left untouched."""
    p = str(path)
    if write_target(p, pickle.dumps(snap, protocol=4)) != FILE:
        return Path(p), None
    side = sidecar_for(p)
    write_target(side, sidecar_bytes(meta))
    return Path(p), Path(side)


def sidecar_bytes(meta: dict[str, Any]) -> bytes:
    """The sidecar ``meta`` as :func:`write` writes it beside the snapshot."""
    return json.dumps(meta, indent=1, default=str).encode("utf-8")
