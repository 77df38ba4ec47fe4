"""The job's own peak, next to the recorded window's (issue 41).

A trace recorded with a ring buffer (``_record_memory_history(max_entries=N)``, the default of
``oomdoctor run``) keeps only the last ``N`` events; the job's peak can fall before them (an inference
job's prefill before a long decode). PyTorch keeps its counters for the whole process
(``c10/cuda/CUDACachingAllocator.cpp`` ``DeviceStats``: ``allocated_bytes.all.peak``,
``reserved_bytes.all.peak``, ``num_alloc_retries``, ``num_ooms``; peaks since the last
``torch.cuda.reset_peak_memory_stats``), and the recorder notes them at every dump (sidecar
``device_counters``, else ``memory_stats``: :mod:`oomdoctor.capture.metadata`); a framework may write them
as a ``memory_stats`` JSON beside the snapshot (:func:`oomdoctor.trace.load.memory_stats_path`).

:func:`job_peak` says, per rank, the job's peaks and where they come from (:data:`PEAK_SOURCES`):

- ``"sidecar"`` / ``"memory_stats_file"``: the counters; the job's peak is the larger of the counter and the
  window's (a counter reset by the job, as the pytest plugin does at each test, can be below the window's);
- ``"trace"``: no counters, and the trace starts with nothing allocated or reserved and no block that
  predates it (:attr:`~oomdoctor.analysis.lifetimes.Lifetimes.truncated`): it saw the job from its first
  allocation, so its peak is the job's;
- ``"unknown-before-window"``: no counters, and the trace starts after the job's first allocation (blocks
  alive at its start, frees of blocks it never saw: a late start or a wrapped ring buffer): peaks before
  the window are not known.

The window *missed* a peak when the job's is above the window's by more than the trace can undercount it (issue 49,
derived, then measured on the corpus's 53 ranks whose trace saw the whole job, with counters:
``benchmarks/margin_terms.py``): the peak reserved by anything (reserved bytes are exact, ``timeline.py``: the 53
differences are all 0); the peak allocated by more than :func:`allocated_undercount_bound`: a large block whose
size the trace infers from its request (not in the final segments) may have swallowed an unsplit remainder of up to
``kSmallSize`` (1 MiB, ``CUDACachingAllocator.cpp`` ``should_split``), so the bound is 1 MiB per such block alive at
once, at most over the trace (the measured undercounts, 0 to 25.5 MiB, are within it on all 53; a fixed 2 MiB said
"the window missed it" on 41 of them).
A miss is *material*, and said as one, from :data:`MISS_SAID_BYTES` (the materiality rule's defaults).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from ..units import MiB
from .lifetimes import Lifetimes
from .timeline import Timeline

PEAK_SOURCES = ("sidecar", "memory_stats_file", "trace", "unknown-before-window")
RESERVED_MISS_TOLERANCE_BYTES = 0
"""The job's peak reserved above the window's by more than this: the window missed it (reserved bytes are exact)."""
REMAINDER_BYTES = MiB
"""``kSmallSize``: a large block is not split when less than this would be left, so a block the trace sizes from its
request may hold up to this much more (``CUDACachingAllocator.cpp`` ``should_split``)."""
MISS_SAID_FRACTION = 0.01
MISS_SAID_BYTES = 64 * MiB
"""The job's peak above the window's by at least ``max(MISS_SAID_FRACTION x the job's peak, MISS_SAID_BYTES)``: a
miss worth saying (issue 52: "the window missed it" for 13.89 vs 13.91 GiB). The materiality rule's defaults
(:mod:`oomdoctor.detectors.materiality`: a finding under them is LOW): below them the job's peak changes no answer the
report gives (its headroom, at the edge or not, what fits) by what the report calls material, and it is said beside
the window's, not as a miss. The job's peak is still the one judged (:attr:`JobPeak.peak_reserved_bytes`)."""


@dataclass(frozen=True)
class JobPeak:
    """One rank's peaks: the recorded window's, the job's (None when not known) and ``source``
    (:data:`PEAK_SOURCES`). Bytes; counts. ``alloc_retries`` / ``alloc_ooms``: the allocator's own
    ``num_alloc_retries`` / ``num_ooms`` (since the process started), None without counters."""

    window_peak_allocated_bytes: int
    window_peak_reserved_bytes: int
    job_peak_allocated_bytes: int | None
    job_peak_reserved_bytes: int | None
    source: str
    alloc_retries: int | None = None
    alloc_ooms: int | None = None
    counters_time_us: int | None = None
    #: where the counters come from ("sidecar", "memory_stats_file"), None without counters
    counters_source: str | None = None
    #: how much the trace may undercount its own peak allocated (:func:`allocated_undercount_bound`)
    allocated_tolerance_bytes: int = 0

    allocated_missed: bool = field(init=False)
    """The job's peak allocated is above the window's by more than the trace can undercount: the window missed it."""
    reserved_missed: bool = field(init=False)
    """The job's peak reserved is above the window's: the window missed it."""
    missed: bool = field(init=False)
    """Either."""
    allocated_missed_material: bool = field(init=False)
    """The window missed the job's peak allocated by a gap worth saying (:data:`MISS_SAID_BYTES`)."""
    reserved_missed_material: bool = field(init=False)
    """The same for the peak reserved."""
    peak_reserved_bytes: int = field(init=False)
    """The peak reserved to judge the job by: the job's when known, else the window's."""
    peak_allocated_bytes: int = field(init=False)
    """The peak allocated to judge the job by: the job's when known, else the window's."""

    def __post_init__(self) -> None:
        """The judgements above, made once from the peaks (set through ``object.__setattr__``: the class is frozen)."""
        ja, wa = self.job_peak_allocated_bytes, self.window_peak_allocated_bytes
        jr, wr = self.job_peak_reserved_bytes, self.window_peak_reserved_bytes
        allocated = ja is not None and ja - wa > self.allocated_tolerance_bytes
        reserved = jr is not None and jr - wr > RESERVED_MISS_TOLERANCE_BYTES
        judged = {"allocated_missed": allocated, "reserved_missed": reserved, "missed": allocated or reserved,
                  "allocated_missed_material": allocated and _material(ja, wa),
                  "reserved_missed_material": reserved and _material(jr, wr),
                  "peak_reserved_bytes": max(jr or 0, wr), "peak_allocated_bytes": max(ja or 0, wa)}
        for name, value in judged.items():
            object.__setattr__(self, name, value)


def _material(job: int | None, window: int) -> bool:
    return job is not None and job - window >= max(MISS_SAID_FRACTION * job, MISS_SAID_BYTES)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def counters(meta: dict[str, Any], device: int) -> tuple[dict[str, Any] | None, str | None]:
    """The counters of ``device`` in sidecar metadata (shapes checked at load) and their source: the
    ``device_counters`` record of that device, else ``memory_stats`` (the recorder's current device, or the
    file's ``device``, when that is ``device`` or not said), keyed as :data:`~oomdoctor.capture.metadata.COUNTER_KEYS`.
    ``(None, None)`` when there are none."""
    src = "memory_stats_file" if meta.get("memory_stats_file") and not meta.get("sidecar") else "sidecar"
    records: list[dict[str, Any]] = meta.get("device_counters") or []
    for c in records:
        if c.get("device") == device:
            return c, src
    stats = meta.get("memory_stats")
    if isinstance(stats, dict) and stats and meta.get("device") in (None, device):
        return cast("dict[str, Any]", stats), src  # the sidecar's JSON object
    return None, None


def starts_mid_job(lt: Lifetimes, tl: Timeline) -> bool:
    """Does the trace start after the job's first allocation? Bytes allocated or reserved before its first
    event (``tl``), or blocks that predate it (``lt``: frees without their alloc, blocks never seen allocated)."""
    return bool(lt.truncated or tl.allocated_start > 0 or tl.reserved_start > 0)


def allocated_undercount_bound(lt: Lifetimes, num_events: int) -> int:
    """How much the trace's peak allocated may be below the allocator's own (bytes): :data:`REMAINDER_BYTES` per
    large block whose size is inferred from its request (``Lifetimes.size_exact`` False), the most of them alive at
    once over the trace's ``num_events`` events. 0 without history."""
    n = num_events
    rows = np.flatnonzero(~lt.size_exact & (lt.size > REMAINDER_BYTES))
    if n == 0 or rows.size == 0:
        return 0
    d = np.zeros(n + 1, dtype=np.int64)
    alloc, freed = lt.alloc[rows], lt.free_requested[rows]
    np.add.at(d, np.where(alloc >= 0, alloc, 0), 1)
    np.add.at(d, np.where(freed >= 0, freed, n), -1)
    return REMAINDER_BYTES * int(np.cumsum(d)[:n].max())


def job_peak(meta: dict[str, Any], device: int, lt: Lifetimes, tl: Timeline, num_events: int,
             window_peaks: tuple[int, int]) -> JobPeak:
    """See the module doc. ``meta``: the trace's metadata (its sidecar's counters); ``device``: the device's index;
    ``window_peaks``: the recorded window's ``(peak allocated, peak reserved)`` bytes. Pure; made once per device by
    :func:`oomdoctor.analysis.device.analyze` (``DeviceAnalysis.job_peak``)."""
    wa, wr = window_peaks
    c, src = counters(meta, device)
    if c is not None and src is not None:
        pa, pr = _int(c.get("allocated_bytes.all.peak")), _int(c.get("reserved_bytes.all.peak"))
        retries, ooms = _int(c.get("num_alloc_retries")), _int(c.get("num_ooms"))
        if pa is not None or pr is not None:
            return JobPeak(wa, wr, max(pa, wa) if pa is not None else None, max(pr, wr) if pr is not None else None,
                           src, retries, ooms, _int(c.get("time_us")), src,
                           allocated_undercount_bound(lt, num_events) if pa is not None else 0)
        if retries is not None or ooms is not None:  # counters without the peaks: judged as without counters
            p = JobPeak(wa, wr, None, None, "", retries, ooms, _int(c.get("time_us")), src)
            return _without_counters(starts_mid_job(lt, tl) or num_events == 0, p)
    return _without_counters(starts_mid_job(lt, tl) or num_events == 0, JobPeak(wa, wr, None, None, ""))


def _without_counters(unknown: bool, p: JobPeak) -> JobPeak:
    known = not unknown
    wa, wr = p.window_peak_allocated_bytes, p.window_peak_reserved_bytes
    return JobPeak(wa, wr, wa if known else None, wr if known else None, "trace" if known else "unknown-before-window",
                   p.alloc_retries, p.alloc_ooms, p.counters_time_us, p.counters_source)
