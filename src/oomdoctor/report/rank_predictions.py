"""The replays a rank's decision may ask for (stage 2 of :mod:`.pipeline`, made on demand): what fits in the
device's room (:func:`.fits.fits`, replayed once) and the trace replayed under the free allocator settings that undo
fragmentation (:func:`defragmenting_settings`). The verdict (:func:`.verdict.rank_verdict`) asks for them through
:meth:`RankPredictions.fits` and :meth:`RankPredictions.defragmented`, so a rank whose verdict needs neither never
replays."""

from __future__ import annotations

from ..analysis.device import DeviceAnalysis
from ..detectors.fragmentation import expandable_on, split_mb, under_memory_fraction
from .fits import Fits, Room, device_room, fits
from .margin import margin_inputs
from .predict import Prediction, Predictor, predictor


def defragmenting_setting(a: DeviceAnalysis) -> str:
    """The allocator setting that undoes fragmentation at ``a``'s OOM: ``expandable_segments:True``, or, where
    segments are expandable already, ``max_split_size_mb`` at half the failed request (as the fragmentation
    detector proposes it)."""
    return defragmenting_settings(a)[0]


def defragmenting_settings(a: DeviceAnalysis) -> list[str]:
    """The free allocator settings the verdict tries at ``a``'s OOM, in order, the first that gets the replay
    through the recorded steps with margin deciding (issue 49: "an allocator setting"): the
    fragmentation fix (:func:`defragmenting_setting`'s rule), ``max_split_size_mb`` at half the failed request, and,
    under a memory-fraction cap (the collector runs only there), ``garbage_collection_threshold:0.8``: the settings
    the fragmentation detector proposes (``detectors/fragmentation.py``)."""
    request = int(a.device.events["size"][int(a.oom_events[-1])]) if a.oom_events.size else 0
    split = f"max_split_size_mb:{split_mb(request)}"
    out = [split] if expandable_on(a) else ["expandable_segments:True", split]
    if under_memory_fraction(a):
        out.append("garbage_collection_threshold:0.8")
    return out


class RankPredictions:
    """One rank's replays, made when a decision asks: what fits in the device's room and the trace replayed with
    the fragmentation fix.

    Attributes:
        a: the rank's analysis.
        predictors: the replays' :class:`.predict.Predictor` by rank, shared with stage 2 (None: the trace cannot be
            replayed faithfully; a rank missing was never asked for).
        inputs: what the sidecar says that the margins need (the process's memory outside the allocator, the job's
            own peak reserved), passed to every replay's margin (issue 49).
        room: the device's room (:func:`.fits.device_room`).
        micro_batch: the per-device micro-batch (samples): the one given, else the sidecar's positive
            ``micro_batch``, else None.
    """

    def __init__(self, a: DeviceAnalysis, predictors: dict[int, Predictor | None], micro_batch: int | None):
        self.a, self.predictors = a, predictors
        self.inputs = margin_inputs(a)
        self.room: Room = device_room(a, outside_bytes=self.inputs["outside_bytes"])
        recorded = a.trace.meta.get("micro_batch")  # an integer, checked at load
        self.micro_batch = micro_batch or (recorded if isinstance(recorded, int) and recorded > 0 else None)
        self._fits: Fits | None = None

    def fits(self) -> Fits:
        """What fits (replays at most once)."""
        if self._fits is None:
            self._fits = fits(self.a, self.room, self.micro_batch, **self.inputs)
        return self._fits

    def defragmented(self) -> Prediction | None:
        """The replay under the first of :func:`defragmenting_settings` that gets through the recorded steps with
        margin (no OOM, not at the edge), else under the first of them; None when the trace cannot be replayed
        faithfully."""
        a = self.a
        if a.rank not in self.predictors:
            self.predictors[a.rank] = predictor(a, **self.inputs)
        p = self.predictors[a.rank]
        if p is None or not p.reproduces:
            return None
        tried: list[Prediction] = []
        for setting in defragmenting_settings(a):
            got = p.run({"config": setting})
            if got.get("oom") is None and not got.get("at_edge"):
                return got
            tried.append(got)
        return tried[0]

    def fits_made(self) -> Fits:
        """What fits if a decision asked for it, else the room alone (nothing replayed)."""
        return self._fits if self._fits is not None else Fits(self.room.bytes, self.room.source,
                                                              room_source_values=dict(self.room.values))
