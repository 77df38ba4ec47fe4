"""The words of where a limit comes from: a replay's capacity (:class:`oomdoctor.simulate.capacity.Capacity`,
its ``source`` an id of :data:`oomdoctor.ids.CAPACITY_SOURCES`) and what fits' room
(:class:`oomdoctor.report.fits.Room`, an id of :data:`oomdoctor.ids.ROOM_SOURCES`), said with their numbers.

``count`` writes byte counts: ``str`` for the JSON (the raw integers it has always had), a binary-unit formatter
for the terminal (:func:`oomdoctor.render.format.format_bytes`)."""

from __future__ import annotations

from typing import Any, Callable

from ...ids import CAPACITY_SOURCES, RoomSource
from ...ids import ROOM_SOURCES as ROOM_SOURCE_IDS
from ..format import format_bytes
from .table import Words, table, text

Count = Callable[[int], str]


def sidecar_cap(source: str, values: dict[str, Any]) -> str:
    """A cap the sidecar states (rules 1 and 2 of :mod:`oomdoctor.simulate.capacity`)."""
    if source == "sidecar-memory-cap":
        return "the memory cap in the sidecar (memory_cap_bytes)"
    return (f"memory_fraction {values['fraction']:.6g} x gpu_total_memory_bytes {values['gpu_total_memory_bytes']} "
            "(sidecar)")


def _bound(count: Count, b: int | None) -> str:
    """A bounded cap's bound; ``str(None)`` where the capacity carries none (a cap lowered by a margin keeps its
    source, not its bounds: :func:`oomdoctor.simulate.scale.fits_at`)."""
    return count(b) if b is not None else str(b)


def capacity_source(source: str, values: dict[str, Any], lower: int | None, upper: int | None,
                    count: Count = str) -> str:
    """Where a replay's limit comes from, in words. Raises KeyError for an id that is not a source."""
    v = values
    if source in ("sidecar-memory-cap", "sidecar-memory-fraction"):
        return sidecar_cap(source, v)
    if source == "oom-device":
        return (f"the OOM at event {v['event']}: {count(v['device_free_bytes'])} bytes free on the device + "
                f"{count(v['reserved_bytes'])} reserved")
    if source == "oom-fraction-cap":
        return (f"the OOM at event {v['event']} came from a memory-fraction cap (the device still had "
                f"{count(v['device_free_bytes'])} bytes free): the cap lies in [{_bound(count, lower)}, {_bound(count, upper)}] bytes; "
                "the lower end is used")
    if source == "fallbacks":
        also = f"; the sidecar counts {v['alloc_retries']} alloc retries" if "alloc_retries" in v else ""
        said = (f"{v['runs']} allocator fallbacks in the trace (cached segments freed before a new segment): the cap "
                f"lies in [{_bound(count, lower)}, {_bound(count, upper)}] bytes{also}")
        if "settled_cap" not in v:
            return said + "; the lower end is used"
        verdict = ("reproduces the recording" if v["settled_exact"]
                   else f"comes closest ({v['settled_unmatched']} segment events unmatched)")
        return said + f"; of {v['settled_caps']} caps replayed, {count(v['settled_cap'])} {verdict}"
    if source == "fallbacks-disagree":
        return (f"unlimited: the {v['runs']} allocator fallbacks in the trace do not agree on a cap (upper bound "
                f"{count(v['upper_bytes'])} below the peak reserved {count(v['peak_reserved_bytes'])})")
    if source == "fallbacks-unreproduced":
        return (f"unlimited: {v['runs']} allocator fallbacks in the trace (cached segments freed before a new segment) "
                "read as a cap do not reproduce the recording, which replays without one (the frees were "
                "empty_cache() calls)")
    if source == "no-evidence":
        return "unlimited (no OOM and no allocator fallback recorded, no cap in the metadata)"
    if source == "unlimited":
        return "unlimited"
    if source == "given":
        return f"given with --cap ({v['kind']} limit)"
    if source == "device-room":
        return room_source(v["room_source"], v)
    raise KeyError(source)


def said(cap: Any, count: Count = str) -> str:
    """A :class:`~oomdoctor.simulate.capacity.Capacity`'s source in words, and from which event it holds where the
    run set it after its first events (``from_event``)."""
    words = capacity_source(cap.source, cap.source_values, cap.lower_bytes, cap.upper_bytes, count)
    start = getattr(cap, "from_event", 0)
    if start:
        words += (f", from event {start} on (reserved bytes were above it before: it was set during the run; the "
                  "replay's peaks are taken from there)")
    return words


def limit(cap: Any, oom_event: int | None = None) -> str:
    """The limit a replay ran under (:class:`oomdoctor.simulate.capacity.Capacity`), in words and binary units:
    what set it and, for a bounded cap, its bounds."""
    if cap.limit_bytes is None:
        return said(cap, count=format_bytes)
    size = format_bytes(cap.limit_bytes)
    bounds = (f"the lower end of a cap between {format_bytes(cap.lower_bytes)} and {format_bytes(cap.upper_bytes)}"
              if cap.lower_bytes is not None and cap.upper_bytes is not None and cap.lower_bytes != cap.upper_bytes
              else "")
    at = f", event {oom_event}" if oom_event is not None else ""
    if cap.evidence == "sidecar":
        return f"{size}, the memory-fraction cap the sidecar states"
    if cap.evidence == "given":
        return f"{size}, given with --cap as a {cap.kind} limit"
    if cap.evidence == "oom" and cap.kind == "device":
        return f"{size}, the device's memory at the OOM{at}: its free bytes then plus the reserved bytes"
    if cap.evidence == "oom":
        return (f"{size}, {bounds}: a memory-fraction cap, since the device still had memory free at the "
                f"OOM{at}")
    if cap.evidence == "fallbacks":
        return (f"{size}, {bounds}, read from the allocator's fallbacks: cached segments freed before a new "
                "segment")
    return f"{size}, a {cap.kind} limit"


def room_source(source: RoomSource, values: dict[str, Any]) -> str:
    """Where what fits' room comes from, in words. Raises KeyError for an id that is not a source."""
    if source == "sidecar-cap":
        return f"set_per_process_memory_fraction: {sidecar_cap(values['capacity_source'], values)}"
    if source == "gpu-total":
        given = " (given with --gpu-memory)" if values.get("given") else ""
        nccl = " and NCCL's buffers" if values.get("nccl") else ""
        return f"the GPU's total memory{given} less the CUDA context{nccl} (planner constants)"
    if source == "gpu-total-less-outside":
        given = " (given with --gpu-memory)" if values.get("given") else ""
        return f"the GPU's total memory{given} less the process's memory outside the allocator (sidecar)"
    return text(ROOM_SOURCES, source)


ROOM_SOURCES = table("room source", ROOM_SOURCE_IDS, {
    "sidecar-cap": Words(description=("a memory-fraction cap the sidecar states (capacity_source: its id in "
                                      "oomdoctor.ids.CAPACITY_SOURCES, with fraction, "
                                      "gpu_total_memory_bytes)")),
    "oom-fraction-cap": Words(description=("a fraction cap read off the OOM (the device still had the segment"
                                           " free): its lower end"),
                              text=("a memory-fraction cap: the device still had memory free at the OOM; the "
                                    "cap's lower end, the peak reserved before it")),
    "oom-device": Words(description=("the OOM: reserved bytes then plus the device's free bytes "
                                     "(cudaMemGetInfo)"),
                        text="the OOM: reserved bytes then plus the device's free bytes (cudaMemGetInfo)"),
    "sidecar-free": Words(description="the sidecar: free device bytes at the dump plus reserved bytes then",
                          text="the sidecar: free device bytes at the dump plus reserved bytes then"),
    "gpu-total": Words(description=("the GPU's total memory less the CUDA context and, with world_size > 1, "
                                    "NCCL's buffers (given: --gpu-memory; nccl: NCCL's buffers taken off)")),
    "gpu-total-less-outside": Words(description=("the GPU's total memory less the process's memory outside "
                                                 "the allocator the sidecar gives (given: --gpu-memory; "
                                                 "outside_bytes)")),
    "none": Words(description="no OOM and no sidecar with the GPU's memory",
                  text="unknown: no OOM and no sidecar with the GPU's memory"),
})
"""Where what fits' room comes from (:data:`oomdoctor.ids.ROOM_SOURCES`): what each means, and the words of those
:func:`room_source` does not compose from their values."""

SOURCES = table("capacity source", CAPACITY_SOURCES, {
    "sidecar-memory-cap": Words(description="rule 1: the sidecar's memory_cap_bytes"),
    "sidecar-memory-fraction": Words(description=("rule 2: memory_fraction x gpu_total_memory_bytes "
                                                  "(fraction, gpu_total_memory_bytes)")),
    "oom-device": Words(description="rule 3, the device: the OOM's event, device_free_bytes, reserved_bytes"),
    "oom-fraction-cap": Words(description=("rule 3, a fraction cap: the OOM's event, device_free_bytes "
                                           "(lower_bytes, upper_bytes)")),
    "fallbacks": Words(description=("rule 4: runs (fallback runs), alloc_retries (sidecar, > 0 or absent); "
                                    "settled_caps, settled_cap, settled_exact, settled_unmatched once "
                                    "settle_capacity replayed caps")),
    "fallbacks-disagree": Words(description="rule 4, unlimited: runs, upper_bytes below peak_reserved_bytes"),
    "fallbacks-unreproduced": Words(description=("rule 4, unlimited: the runs' cap does not reproduce the "
                                                 "recording, which replays without one (runs)")),
    "no-evidence": Words(description="rule 5: no OOM, no fallback, no cap in the metadata"),
    "unlimited": Words(description="no limit (a replay asked for none)"),
    "given": Words(description="--cap (kind)"),
    "device-room": Words(description=("what fits: the device's room (oomdoctor.report.fits.Room; room_source,"
                                      " with its values)")),
})
"""Where a replay's limit comes from (:data:`oomdoctor.ids.CAPACITY_SOURCES`), with the keys of its ``source_values``;
:func:`capacity_source` says it with them."""
