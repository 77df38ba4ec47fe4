"""The GPUs the planner, preflight and tune know by name: one table.

Each entry: the bytes ``torch.cuda.get_device_properties().total_memory`` reports (``nvidia-smi``'s MiB for the
H100 and A100s; the H200's as torch read it on the H200s of ``shared/snapshots``), the SM major version (for cuBLAS's
workspace size, ``CUDABlas.cpp`` ``_getWorkspaceSize``), dense bf16 FLOP/s and NVLink bytes/s per GPU one way (the
vendors' data sheets; the planner's cost model, docs/plan.md), and the SM count (NVIDIA's H100, A100 and Blackwell
whitepapers: 132 on the H100 SXM5 and the H200, 108 on the A100, 148 on the B200).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from ..units import parse_bytes

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Gpu:
    """One GPU model."""

    name: str
    """as the user writes it (``H100-80GB``; matched case-insensitively)"""
    total_bytes: int
    """the device's total memory as CUDA reports it (bytes)"""
    sm_major: int
    """compute capability major version"""
    bf16_flops: float
    """dense bf16 FLOP/s"""
    nvlink_bytes_per_s: float
    """NVLink bandwidth per GPU, one way (bytes/s)"""
    sms: int
    """streaming multiprocessors (``multiProcessorCount``; how CUDA's reductions split their input,
    ``oomdoctor.preflight.reduce``)"""


GPUS: dict[str, Gpu] = {g.name: g for g in (
    Gpu(name="H100-80GB", total_bytes=81559 * MiB, sm_major=9, bf16_flops=989e12, nvlink_bytes_per_s=450e9, sms=132),
    Gpu(name="H200", total_bytes=int(139.8 * 2**30), sm_major=9, bf16_flops=989e12, nvlink_bytes_per_s=450e9, sms=132),
    Gpu(name="A100-80GB", total_bytes=81920 * MiB, sm_major=8, bf16_flops=312e12, nvlink_bytes_per_s=300e9, sms=108),
    Gpu(name="A100-40GB", total_bytes=40960 * MiB, sm_major=8, bf16_flops=312e12, nvlink_bytes_per_s=300e9, sms=108),
    Gpu(name="B200", total_bytes=180 * 10**9, sm_major=10, bf16_flops=2250e12, nvlink_bytes_per_s=900e9, sms=148),
)}


def gpu_by_name(name: str) -> Gpu:
    """The GPU called ``name`` (case-insensitive). Raises KeyError for an unknown name."""
    for g in GPUS.values():
        if g.name.lower() == name.lower():
            return g
    raise KeyError(name)


def resolve_gpu(gpu: str | int | None, memory: str | None = None, *, default: str = "H100-80GB",
                gpu_flag: str = "--gpu", memory_flag: str = "--gpu-memory") -> tuple[str | None, int, int]:
    """``(name, total bytes, SM major)`` of a GPU given by name (``gpu``, case-insensitive, :data:`GPUS`), by size
    (``memory``: ``80GiB``, ``80GB`` or bytes; or ``gpu`` as bytes, or as a size where it is no known name), or
    ``default`` when neither is given. A GPU given by size has no name and is taken as a Hopper (SM 9).

    Raises:
        UsageError: both given, or a name that is neither a known GPU nor a size (``gpu_flag`` and ``memory_flag``
            are how the one-line message names them).
    """
    if gpu is not None and memory is not None:
        raise UsageError(f"give {gpu_flag} or {memory_flag}, not both")
    if isinstance(gpu, int):
        return None, gpu, 9
    if memory is not None:
        try:
            return None, parse_bytes(memory), 9
        except Exception:  # noqa: BLE001 - any parse failure is the user's input
            raise UsageError(f"{memory_flag} {memory!r}: not a size (80GiB, 80GB or bytes)") from None
    name = default if gpu is None else gpu
    try:
        g = gpu_by_name(name)
    except KeyError:
        try:
            return None, parse_bytes(name), 9
        except Exception:  # noqa: BLE001 - any parse failure is the user's input
            raise UsageError(f"{gpu_flag} {name!r}: neither a known GPU (one of {', '.join(GPUS)}) nor a size "
                             f"(or give {memory_flag})") from None
    return g.name, g.total_bytes, g.sm_major


def gpu_sms(name: str | None) -> int | None:
    """The SM count of the GPU called ``name``, or None for no name or an unknown one."""
    if not name:
        return None
    try:
        return gpu_by_name(name).sms
    except KeyError:
        return None


def sms_of_major(sm_major: int) -> int:
    """The SM count of the first GPU in :data:`GPUS` of compute capability ``sm_major`` (its SXM part: 108 for sm80,
    132 for sm90, 148 for sm100), for a GPU known by size only; an H100's for a major the table lacks."""
    return next((g.sms for g in GPUS.values() if g.sm_major == sm_major), GPUS["H100-80GB"].sms)
