"""The words of how each part of a prediction's margin was read (:data:`oomdoctor.report.margin.SOURCES`)."""

from __future__ import annotations

SOURCES = {
    "self-replay-difference": "the self-replay's largest reserved difference from the recording",
    "self-replay-exact": "the self-replay reproduces the reserved bytes",
    "fraction-cap": "a memory-fraction cap: the allocator's own limit, which memory outside it does not count against",
    "outside-growth": ("what the memory outside the allocator grew by after the room was read from the device, at "
                       "most, on the corpus, before the job's first optimizer step ended (92 MiB)"),
    "outside-growth-after-a-step": ("what the memory outside the allocator grew by after the room was read from the "
                                    "device, at most, on the corpus, once a step had run (2 MiB)"),
    "planner-constants": ("the most the memory outside the allocator measured above the planner's constants (CUDA "
                          "context, NCCL) the room was estimated with"),
    "gpu-size-unknown": "unknown: the GPU's total memory is not recorded",
    "reserved-step-spread": "max - min of the peak reserved over the complete steps",
    "fewer-than-two-steps": "fewer than two complete steps: no step-to-step spread measured",
    "job-peak-above-trace": "the job's own peak reserved (PyTorch's counters) above the trace's",
    "job-peak-in-trace": "the job's own peak reserved (PyTorch's counters) is the trace's",
    "job-peak-unknown": "no counters: the job's own peak reserved is not known",
}


def source(id_: str) -> str:
    """How a part of the margin was read, in words. Raises KeyError for an unknown id."""
    return SOURCES[id_]
