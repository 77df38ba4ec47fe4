"""The words of how each part of a prediction's margin was read (:data:`oomdoctor.report.margin.SOURCES`)."""

from __future__ import annotations

SOURCES = {
    "fewer-than-two-steps": "fewer than two complete steps: no step-to-step variation to read",
    "steps-spread": "max - min of the peak allocated and reserved over the complete steps (the larger)",
    "steps-rise": "largest rise of the peak reserved between consecutive complete steps",
    "self-replay-difference": "the self-replay's largest reserved difference from the recording",
    "self-replay-exact": "the self-replay reproduces the reserved bytes",
    "fraction-cap": "a memory-fraction cap: the allocator's own limit, below what lives outside it",
    "given": "given: the process's memory in use less the allocator's reserved bytes",
    "oom-message": ("the OOM message: this process's memory in use less what PyTorch reserved (allocated plus "
                    "reserved but unallocated)"),
    "gpu-size-unknown": "unknown: the GPU's total memory is not recorded",
    "device-free-at-oom": "the GPU's total memory less the free bytes and reserved bytes at the OOM",
    "device-free-at-dump": "the GPU's total memory less the free and reserved bytes at the dump",
    "cuda-context": "the planner's constants: the CUDA context",
    "cuda-context-and-nccl": "the planner's constants: the CUDA context and NCCL's first communicator",
    "job-peak-above-trace": "the job's own peak reserved (memory_stats) above the trace's",
}


def source(id_: str) -> str:
    """How a part of the margin was read, in words. Raises KeyError for an unknown id."""
    return SOURCES[id_]
