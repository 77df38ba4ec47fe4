"""The words of a rank's peaks beside the job's own (issue 41): where the job's peaks were read
(``RankSummary.peak_source``) and whether the recorded window missed them."""

from __future__ import annotations

from ..format import format_bytes

BEFORE_WINDOW_UNKNOWN = ("peaks before the recorded window are not known: the trace starts after the job's first "
                         "allocation and no sidecar holds PyTorch's counters; the sidecars of oomdoctor run hold them")
"""Said under the timeline where ``peak_source`` is ``unknown-before-window``."""


def job_peak(peak_source: str | None, job: int | None, missed: bool, material: bool) -> str:
    """After a window's peak: the job's own where it is above (issue 41), said as a miss where the gap is material
    (issue 52); empty where the window holds the job's peak or the job's is not known."""
    if not missed or job is None:
        return ""
    src = "the sidecar" if peak_source == "sidecar" else "a memory_stats file"
    return (f" in the recorded window; the job's peak {format_bytes(job)} (PyTorch's counters, {src})"
            + (": the window missed it" if material else ""))
