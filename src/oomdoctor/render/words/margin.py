"""The words of how each part of a prediction's margin was read (:data:`oomdoctor.ids.MARGIN_SOURCES`)."""

from __future__ import annotations

from ...ids import MARGIN_SOURCES, MarginSource
from .table import Words, table, text

SOURCES = table("margin source", MARGIN_SOURCES, {
    "self-replay-difference": Words(text="the self-replay's largest reserved difference from the recording"),
    "self-replay-exact": Words(text="the self-replay reproduces the reserved bytes"),
    "fraction-cap": Words(text=("a memory-fraction cap: the allocator's own limit, which memory outside it "
                                "does not count against")),
    "outside-growth": Words(text=("what the memory outside the allocator grew by after the room was read from"
                                  " the device, at most, on the corpus, before the job's first optimizer step"
                                  " ended (92 MiB)")),
    "outside-growth-after-a-step": Words(text=("what the memory outside the allocator grew by after the room "
                                               "was read from the device, at most, on the corpus, once a step"
                                               " had run (2 MiB)")),
    "planner-constants": Words(text=("the most the memory outside the allocator measured above the planner's "
                                     "constants (CUDA context, NCCL) the room was estimated with")),
    "gpu-size-unknown": Words(text="unknown: the GPU's total memory is not recorded"),
    "reserved-step-spread": Words(text="max - min of the peak reserved over the complete steps"),
    "fewer-than-two-steps": Words(text="fewer than two complete steps: no step-to-step spread measured"),
    "job-peak-above-trace": Words(text="the job's own peak reserved (PyTorch's counters) above the trace's"),
    "job-peak-in-trace": Words(text="the job's own peak reserved (PyTorch's counters) is the trace's"),
    "job-peak-unknown": Words(text="no counters: the job's own peak reserved is not known"),
})
"""How each part of a margin was read (:data:`oomdoctor.ids.MARGIN_SOURCES`), in words that say it whole."""


def source(id_: MarginSource) -> str:
    """How a part of the margin was read, in words. Raises KeyError for an unknown id."""
    return text(SOURCES, id_)
