"""The words of what ``oomdoctor tune`` says of its search (:attr:`oomdoctor.report.tune.TuneOutcome.notes`)."""

from __future__ import annotations

from ...ids import TUNE_NOTES, TuneNote
from .table import Words, table, text

NOTES = table("tune note", TUNE_NOTES, {
    "accumulation-traced-at-2": Words(text=("gradient accumulation above 2 is traced at 2: later "
                                            "micro-batches of a step allocate what the second does (gradients"
                                            " alive, as after the first)")),
    "trace-budget-reached": Words(text=("the trace budget (--max-traces) ran out: some micro-batches are "
                                        "interpolated between traced ones and are not recommended")),
    "no-gpu": Words(text="no GPU here: the ranking is the cost model's prediction (measured: false)"),
    "not-run": Words(text=("nothing run on the GPU (--no-run, --top 0): the ranking is the cost model's "
                           "prediction (measured: false)")),
    "deepspeed-not-installed": Words(text=("DeepSpeed's ZeRO stages are not searched: deepspeed is not "
                                           "installed")),
    "fsdp2-needs-a-script": Words(text=("FSDP2 (full shard, hybrid) is searched through a script (--knob) "
                                        "with fully_shard in it; --hf-config traces Trainer's DDP")),
    "interpolated-not-run": Words(text=("a top candidate known only by interpolation was not run (its trace "
                                        "was not made)")),
    "samples-are-steps": Words(text="no micro-batch knob: throughput is in optimizer steps per second"),
    "top-not-measured": Words(text="no trial ran to its timed steps: the answer is the prediction"),
    "measured-peak-over-margin": Words(text=("a run reserved more than its predicted peak plus the margin: "
                                             "its configuration is answered with the measured peak, and not "
                                             "at all where that plus the margin leaves the room")),
})
"""What a tune outcome says of itself (:data:`oomdoctor.ids.TUNE_NOTES`), in words that say it whole."""


def note(id_: TuneNote) -> str:
    """A tune note in words. Raises KeyError for an unknown id."""
    return text(NOTES, id_)
