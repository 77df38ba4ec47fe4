"""The words of a simulation (:class:`oomdoctor.simulate.whatif.Simulation`): why a setting is recommended
(``RECOMMENDATION_REASONS``), what it does not mix with (``INCOMPATIBILITIES``, each with its source), what a
search says of itself (``SIMULATION_NOTES``) and how far its replays reach (``REACH``, ``NO_OOM``), what was recorded and
how the self-replay compares with it, and the recommendation's lines. The JSON writes these words where the ids are,
as it always has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...ids import RECOMMENDATION_REASONS, SIMULATION_NOTES, RecommendationReason
from ..format import count, format_bytes
from .table import Words, table, text

if TYPE_CHECKING:
    from ...simulate.replay import ReplayResult, Validation
    from ...simulate.whatif import Simulation

REASONS = table("recommendation reason", RECOMMENDATION_REASONS, {
    "no-better-setting": Words(text="no setting tried does better than the recorded one"),
    "recorded-runs-out": Words(text=("the recorded settings run out of memory; this is the lowest peak "
                                     "reserved without an OOM")),
    "lowest-peak": Words(text="lowest peak reserved without an OOM"),
})
"""Why a search recommends its setting (:data:`oomdoctor.ids.RECOMMENDATION_REASONS`)."""


def reason(id_: RecommendationReason) -> str:
    """Why a search recommends its setting, in words. Raises KeyError for an unknown id."""
    return text(REASONS, id_)


INCOMPATIBILITIES = {
    "expandable-no-cuda-ipc": ("tensors in expandable segments cannot be shared with other processes through CUDA IPC "
                               "(torch.multiprocessing; pytorch/pytorch issue #130330)"),
    "expandable-no-nccl-user-buffers": ("NCCL user-buffer registration (e.g. Megatron --use-nccl-ub) does not support "
                                        "them (NVIDIA/nccl#1584)"),
    "expandable-nccl-graph-register": "with CUDA graphs and NCCL, set NCCL_GRAPH_REGISTER=0 (pytorch/pytorch issue #158029)",
    "expandable-ignores-max-split": ("max_split_size_mb no longer limits splitting once expandable segments are on "
                                     "(CUDACachingAllocator.cpp should_split)"),
    "max-split-unsplit-blocks": ("blocks at least max_split_size are never split and serve only requests within "
                                 "max_non_split_rounding_mb (20 MiB) of their size: large free blocks can sit unused "
                                 "(CUDACachingAllocator.cpp get_free_block)"),
    "max-split-at-least-20-mib": "values below 20 MiB are rejected (>= 20 since 2.9, > 20 before)",
    "gc-needs-fraction-cap": ("acts only when a memory fraction is set (torch.cuda.set_per_process_memory_fraction or "
                              "per_process_memory_fraction), and frees cached segments the next steps may cudaMalloc "
                              "again (CUDACachingAllocator.cpp garbage_collect_cached_blocks)"),
    "roundup-wastes": ("rounds every request up to a 1/N step of its power of two: live tensors waste up to 1/N of "
                       "their size (CUDACachingAllocator.cpp round_size)"),
    "immediate-is-a-code-change": ("a code or version change, not a setting: TORCH_NCCL_AVOID_RECORD_STREAMS=1 on "
                                   "PyTorch 2.1-2.7 (PR #89880/#97053) or PyTorch >= 2.8 (PR #148590) stop collectives "
                                   "from record_stream-ing their tensors; point-to-point isend/irecv still "
                                   "record_stream in every version (ProcessGroupNCCL.cpp pointToPoint)"),
}

#: how far a simulation's replays reach (``Simulation.reach``), said under its table after "replayed: "
REACH = {
    "complete": "every recorded event (the recording has no OOM)",
    "recorded": ("up to the recorded OOM (event {event}), where the recording ends; 'past it': a setting gets past "
                 "that request, and what the job would have run after it was never recorded (oomdoctor diagnose "
                 "replays the rest of the step as the previous step ran it)"),
}

#: the OOM column of a replay without OOM, by its reach
NO_OOM = {"complete": "none", "recorded": "past it"}

NOTES = table("simulation note", SIMULATION_NOTES, {
    "no-deferred-frees": Words(text=("the trace has no deferred frees, so immediate-free replays were not "
                                     "needed")),
    "gc-not-tried": Words(text=("garbage_collection_threshold was not tried: it acts only under a memory "
                                "fraction cap")),
})
"""What a search says of itself (:data:`oomdoctor.ids.SIMULATION_NOTES`)."""


def notes(sim: Simulation) -> list[str]:
    """What the simulation notes, in words: its own notes, then the replay's warnings (already words)."""
    return [text(NOTES, n) for n in sim.notes] + list(sim.warnings)


def _setting(r: ReplayResult) -> str:
    return str(r.config) + (" with frees not deferred" if r.deferred_frees == "immediate" else "")


def headline(sim: Simulation) -> str:
    """The first line of ``oomdoctor simulate``: how the recorded run replays (or, under a limit the recording did not
    have, where its settings run out of memory), then the answer of the settings tried (the recommendation; how many
    get past a recorded OOM; else the lowest peak reserved). The file is named on the
    next line, so that a long path never pushes the answer off the first one."""
    v = sim.self_replay.validation
    how = "is replayed" if v is None else "replays exactly" if v.exact else "replays approximately"
    seen = (f"OOM at event {sim.recorded_oom_event}" if sim.recorded_oom_event is not None
            else f"peak reserved {format_bytes(sim.recorded_peak_reserved_bytes)}")
    out = f"oomdoctor simulate: the recorded run {how} ({seen})"
    own, limit = sim.self_replay.oom, sim.capacity.limit_bytes
    capped = False
    if own is not None and limit is not None and sim.recorded_oom_event is None:
        # a limit below what the recording needed (--cap): its own settings run out first, which is the answer
        capped = True
        out = (f"oomdoctor simulate: under {format_bytes(limit)} the recorded settings run out of memory at event "
               f"{own.event_index} (recorded: {seen}, no OOM)")
    tried = sim.results[1:]
    rec = sim.recommendation
    if rec is not None:
        out += (f"; recommended: {_setting(rec.result)}, peak reserved {format_bytes(rec.result.peak_reserved_bytes)}"
                + (", past the recorded OOM" if sim.recorded_oom_event is not None else ""))
    elif tried and sim.recorded_oom_event is not None:
        past = sum(1 for r in tried if r.oom is None)
        out += f"; {past} of {count(len(tried), 'setting')} tried get{'s' if past == 1 else ''} past the recorded OOM"
    elif tried and capped:
        under = sum(1 for r in tried if r.oom is None)
        out += f"; {under} of {count(len(tried), 'setting')} tried run{'s' if under == 1 else ''} without an OOM under it"
    elif len(tried) == 1:
        out += f"; with {_setting(tried[0])}: peak reserved {format_bytes(tried[0].peak_reserved_bytes)}"
    elif tried:
        best = min(tried, key=lambda r: r.peak_reserved_bytes)
        out += (f"; the lowest of the {len(tried)} settings tried: peak reserved "
                f"{format_bytes(best.peak_reserved_bytes)} with {_setting(best)}")
    return out


def file_line(sim: Simulation) -> str:
    """The snapshot replayed, and its rank where it has one."""
    return sim.path + (f" (rank {sim.rank})" if sim.rank is not None else "")


def recorded(sim: Simulation) -> str:
    """What the recording holds: its events, its settings, its peaks and where it ran out of memory."""
    oom = f", OOM at event {sim.recorded_oom_event}" if sim.recorded_oom_event is not None else ""
    return (f"recorded: {sim.num_events} events, settings {sim.recorded_config}, peak reserved "
            f"{format_bytes(sim.recorded_peak_reserved_bytes)}, peak allocated "
            f"{format_bytes(sim.recorded_peak_allocated_bytes)}{oom}")


#: how a table's replays free what the job record_stream-ed (``ReplayResult.deferred_frees``), said above it
FREES = {
    "recorded": "frees as recorded (held for other streams where the job record_stream-ed)",
    "immediate": "frees made immediate (no record_stream)",
}

#: a replay that ran out of memory, in the OOM column: the event
OOM_AT = "at {event}"

#: a replay under the recorded settings against the recording, in the check column (``matches_recorded``)
MATCHES = {True: "exact", False: "differs", None: ""}


def self_replay(v: Validation) -> str:
    """How the replay under the recorded settings compares with the recording: the segment events and reserved bytes
    that differ, and whether the recorded OOM (or its absence) is reproduced."""
    return (f"self-replay: {v.segment_events_differing} of {v.segment_events_compared} segment events differ "
            f"({v.segment_events_recorded} recorded, {v.segment_events_simulated} simulated); reserved bytes differ "
            f"after {v.reserved_events_differing} "
            f"events (largest difference {format_bytes(v.max_reserved_difference_bytes)}); "
            + (("recorded OOM " + ("reproduced" if v.oom_matches else "not reproduced"))
               if v.oom_event_index_recorded is not None else
               ("no OOM, as recorded" if v.oom_matches else "an OOM the recording does not have")))


def warning_lead(r: ReplayResult) -> str:
    """The lead of a replay's warning: the setting and how its frees were replayed."""
    return f"note on {r.config}, {r.deferred_frees} frees: "


@dataclass(frozen=True)
class Recommended:
    """A search's recommendation in the words the terminal says it with, one attribute a part (each its own style
    there)."""

    setting: str
    """The setting recommended."""
    frees: str
    """How its frees are replayed, where not as recorded; empty otherwise."""
    outcome: str
    """What it reaches and why it is the one: ``: peak reserved 30.00 GiB, no OOM. Lowest peak reserved...``."""
    replays: str | None
    """How many replays the search ran, and in how long; None where no search timed them."""
    before: list[str]
    """What it does not mix with, one each (:data:`INCOMPATIBILITIES`): to know before setting it."""


def recommended(sim: Simulation) -> Recommended | None:
    """The recommendation of ``sim`` in words; None where it has none (:data:`NONE_AVOIDS` after a search)."""
    rec = sim.recommendation
    if rec is None:
        return None
    why = reason(rec.reason)
    return Recommended(
        setting=f"{rec.result.config}",
        frees=" with collectives' frees not deferred (no record_stream)" if rec.result.deferred_frees == "immediate"
        else "",
        outcome=(f": peak reserved {format_bytes(rec.result.peak_reserved_bytes)}, "
                 f"{'gets past the recorded OOM' if sim.reach == 'recorded' else 'no OOM'}. "
                 f"{why[:1].upper()}{why[1:]}."),
        replays=f"{len(sim.results)} replays in {sim.search_wall_s:.2f} s" if sim.search_wall_s is not None else None,
        before=[INCOMPATIBILITIES[i] for i in rec.incompatibilities])


NONE_AVOIDS = "No setting tried avoids the OOM under this capacity."
"""Said after a search that recommends nothing."""
