"""The words of a rank's peaks: the job's own beside the window's (issue 41), where the job's peaks were read
(``RankSummary.peak_source``) and whether the recorded window missed them, and what the reserved bytes were at the
peak (:class:`oomdoctor.analysis.fragmentation.Anatomy`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..format import format_bytes

if TYPE_CHECKING:  # annotations only
    from ...analysis.fragmentation import Anatomy

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


def anatomy(an: Anatomy) -> str:
    """What the reserved bytes were at the peak, its non-empty parts added up (``requested 7.49 GiB + rounding
    1.20 MiB + free in used segments 96.00 MiB``), ``nothing reserved`` where every part is empty."""
    parts = [("requested", an.requested_bytes), ("rounding", an.rounding_waste_bytes),
             ("pending free", an.pending_free_bytes), ("free in used segments", an.free_in_used_segments_bytes),
             ("free segments", an.free_segments_bytes)]
    return " + ".join(f"{name} {format_bytes(b)}" for name, b in parts if b > 0) or "nothing reserved"
