"""What-if: replay one trace under other allocator settings, search a grid, recommend one.

``simulate(trace, ...)`` always replays the recorded settings first (the self-replay, checked against
the recording), then each requested config, and with ``search=True`` a grid of the settings people are
told to try (:func:`grid`). The recommendation is the result with the lowest peak reserved that does not
OOM, ties going to the simpler change; it comes with what the setting is incompatible with.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

from ..analysis.timeline import timeline
from ..errors import UsageError
from ..ids import RECOMMENDATION_REASONS, SIMULATION_NOTES, RecommendationReason, SimulationNote
from ..trace.model import Trace
from .capacity import BOUNDED, GIVEN, Capacity, infer_capacity
from .config import AllocatorConfig, parse_config
from .replay import IMMEDIATE, RECORDED, Prepared, ReplayResult, Validation, prepare, replay

#: Above this many events x configs, ``--search`` fans out to worker processes.
PARALLEL_MIN_WORK = 200_000

#: What each setting does not mix with, shown next to a recommendation: ids, said (with their sources) by
#: ``oomdoctor.render.words.simulate``.
INCOMPATIBILITIES = {
    "expandable_segments": ["expandable-no-cuda-ipc", "expandable-no-nccl-user-buffers",
                            "expandable-nccl-graph-register", "expandable-ignores-max-split"],
    "max_split_size": ["max-split-unsplit-blocks", "max-split-at-least-20-mib"],
    "garbage_collection_threshold": ["gc-needs-fraction-cap"],
    "roundup_power2_divisions": ["roundup-wastes"],
    "immediate": ["immediate-is-a-code-change"],
}


@dataclass(frozen=True)
class WhatIf:
    """One experiment: allocator settings and how deferred frees complete."""

    config: AllocatorConfig
    deferred_frees: str = RECORDED


@dataclass
class Recommendation:
    """The chosen result, why (an id of :data:`RECOMMENDATION_REASONS`), and what its setting does not mix with
    (ids of :data:`INCOMPATIBILITIES`)."""

    result: ReplayResult
    reason: RecommendationReason
    incompatibilities: list[str]


@dataclass
class Simulation:
    """Everything ``oomdoctor simulate`` reports for one snapshot. Bytes; ``search_wall_s`` in seconds. ``notes``:
    ids of :data:`SIMULATION_NOTES`; ``warnings``: what the replay's preparation noticed (``Prepared.warnings``)."""

    path: str
    rank: int | None
    num_events: int
    recorded_config: AllocatorConfig
    recorded_peak_reserved_bytes: int
    recorded_peak_allocated_bytes: int
    recorded_oom_event: int | None
    has_deferred_frees: bool
    capacity: Capacity
    results: list[ReplayResult]
    recommendation: Recommendation | None = None
    search_wall_s: float | None = None
    notes: list[SimulationNote] = field(default_factory=list[SimulationNote])
    warnings: list[str] = field(default_factory=list[str])

    @property
    def self_replay(self) -> ReplayResult:
        return self.results[0]

    @property
    def reach(self) -> str:
        """How far every replay of it reaches (the ids of ``report/predict.py`` ``REACHES``): ``complete`` (the
        recording has no OOM; every event was replayed) or ``recorded`` (the recording ends at its OOM: a replay
        without OOM gets past that request, and what the job would have run after it was never recorded)."""
        return "complete" if self.recorded_oom_event is None else "recorded"


def grid(prepared: Prepared, capacity: Capacity, has_deferred: bool) -> list[WhatIf]:
    """The settings ``--search`` tries: expandable segments; max_split_size 128-1024 MiB; rounding
    divisions 4 and 8; with a fraction cap, GC thresholds 0.6/0.8 (alone and with max_split_size 512);
    each with recorded deferred frees and, when the trace has any, immediate ones."""
    base = prepared.recorded_config
    texts = ["expandable_segments:True"]
    texts += [f"max_split_size_mb:{m}" for m in (128, 256, 512, 1024)]
    texts += ["roundup_power2_divisions:4", "roundup_power2_divisions:8"]
    if capacity.kind == "fraction":
        texts += ["garbage_collection_threshold:0.6", "garbage_collection_threshold:0.8",
                  "max_split_size_mb:512,garbage_collection_threshold:0.8"]
    configs = [base] + [c for c in (parse_config(t) for t in texts) if c != base]
    modes = (RECORDED, IMMEDIATE) if has_deferred else (RECORDED,)
    return [WhatIf(c, m) for m in modes for c in configs if not (c == base and m == RECORDED)]


_worker_prepared: Prepared | None = None


def _worker(args: tuple[WhatIf, Capacity]) -> ReplayResult:
    w, capacity = args
    assert _worker_prepared is not None  # set by run_many before the pool forks its workers
    return _strip(replay(_worker_prepared, w.config, deferred_frees=w.deferred_frees, capacity=capacity))


def _strip(r: ReplayResult) -> ReplayResult:
    """Drop the model's final state (large; not needed once the numbers are out)."""
    r.model = None
    r.live_blocks = None
    return r


def run_many(prepared: Prepared, whatifs: list[WhatIf], capacity: Capacity, workers: int | None = None) -> list[ReplayResult]:
    """Replay every what-if, in worker processes (forked, sharing ``prepared``) when the work is large
    enough to pay for them; results in the order given."""
    global _worker_prepared
    workers = workers if workers is not None else (os.cpu_count() or 1)
    work = prepared.device.num_events * len(whatifs)
    if workers <= 1 or len(whatifs) <= 1 or work < PARALLEL_MIN_WORK:
        return [_strip(replay(prepared, w.config, deferred_frees=w.deferred_frees, capacity=capacity)) for w in whatifs]
    import multiprocessing  # only for a pool: one config (plain ``simulate``) imports neither
    from concurrent.futures import ProcessPoolExecutor

    if "fork" not in multiprocessing.get_all_start_methods():
        return [_strip(replay(prepared, w.config, deferred_frees=w.deferred_frees, capacity=capacity)) for w in whatifs]
    _worker_prepared = prepared
    try:
        with ProcessPoolExecutor(max_workers=min(workers, len(whatifs)),
                                 mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(_worker, [(w, capacity) for w in whatifs]))
    finally:
        _worker_prepared = None


def _complexity(r: ReplayResult, base: AllocatorConfig) -> int:
    changed = sum(1 for f in ("expandable_segments", "max_split_size", "roundup_power2_divisions",
                              "garbage_collection_threshold", "max_non_split_rounding")
                  if getattr(r.config, f) != getattr(base, f))
    return changed + (1 if r.deferred_frees == IMMEDIATE else 0)


def recommend(results: list[ReplayResult], base: AllocatorConfig) -> Recommendation | None:
    """The result with the lowest peak reserved among those that do not OOM (ties: fewest changes)."""
    ok = [r for r in results if r.oom is None]
    if not ok:
        return None
    best = min(ok, key=lambda r: (r.peak_reserved_bytes, _complexity(r, base)))
    recorded = results[0]
    if best is recorded or (best.peak_reserved_bytes >= recorded.peak_reserved_bytes and recorded.oom is None):
        return Recommendation(recorded, "no-better-setting", [])
    notes: list[str] = []
    for f in ("expandable_segments", "max_split_size", "garbage_collection_threshold", "roundup_power2_divisions"):
        if getattr(best.config, f) != getattr(base, f) and getattr(best.config, f):
            notes += INCOMPATIBILITIES[f]
    if best.deferred_frees == IMMEDIATE:
        notes += INCOMPATIBILITIES["immediate"]
    return Recommendation(best, "recorded-runs-out" if recorded.oom is not None else "lowest-peak", notes)


def simulate(trace: Trace, *, configs: list[str] | None = None, immediate_frees: bool = False,
             capacity: Capacity | None = None, search: bool = False, workers: int | None = None,
             prepared: Prepared | None = None) -> Simulation:
    """Replay ``trace`` (its primary device) under its recorded settings and the ones asked for.

    ``configs``: ``PYTORCH_CUDA_ALLOC_CONF`` strings (each a full setting, as the environment variable
    would hold it); ``immediate_frees``: also replay each with deferred frees completed at
    ``free_requested``; ``capacity``: the memory limit (default: :func:`infer_capacity`); ``search``:
    also the :func:`grid`, and recommend.
    Raises :class:`~.config.ConfigError` for an invalid config string and
    :class:`~.replay.SimulationError` for what the model cannot replay.
    """
    parsed = [parse_config(c) for c in (configs or [])]
    prepared = prepared or prepare(trace)
    dt = prepared.device
    lt = prepared.lifetimes
    tl = timeline(dt, lt)
    capacity = capacity or infer_capacity(trace, dt)
    has_deferred = bool(lt.deferred.any())
    self_replay = replay(prepared, capacity=capacity)
    whatifs: list[WhatIf] = []
    if immediate_frees:
        whatifs.append(WhatIf(prepared.recorded_config, IMMEDIATE))
    for c in parsed:
        whatifs.append(WhatIf(c, RECORDED))
        if immediate_frees:
            whatifs.append(WhatIf(c, IMMEDIATE))
    notes: list[SimulationNote] = []
    search_wall = None
    if search:
        for w in grid(prepared, capacity, has_deferred):
            if w not in whatifs:
                whatifs.append(w)
        if not has_deferred:
            notes.append("no-deferred-frees")
        if capacity.kind != "fraction":
            notes.append("gc-not-tried")
    t0 = time.perf_counter()
    # a configuration asked for that is the recorded one, with recorded frees, is the self-replay: not replayed again
    recorded = WhatIf(prepared.recorded_config, RECORDED)
    done = iter(run_many(prepared, [w for w in whatifs if w != recorded], capacity, workers))
    results = [_strip(self_replay)]
    results += [self_replay if w == recorded else next(done) for w in whatifs]
    if search:
        search_wall = time.perf_counter() - t0
    peak_r, _ = tl.peak_reserved
    peak_a, _ = tl.peak_allocated
    sim = Simulation(path=trace.path, rank=trace.rank, num_events=dt.num_events,
                     recorded_config=prepared.recorded_config, recorded_peak_reserved_bytes=int(peak_r),
                     recorded_peak_allocated_bytes=int(peak_a), recorded_oom_event=prepared.recorded_oom,
                     has_deferred_frees=has_deferred, capacity=capacity, results=results,
                     search_wall_s=search_wall, notes=notes, warnings=list(prepared.warnings))
    if search:
        sim.recommendation = recommend(results, prepared.recorded_config)
    return sim


def simulate_recorded(trace: Trace, *, configs: list[str] | None = None, immediate_frees: bool = False,
                      cap_bytes: int | None = None, cap_kind: str | None = None, search: bool = False,
                      workers: int | None = None) -> Simulation:
    """:func:`simulate` under the limit the trace shows (:func:`infer_capacity`), or ``cap_bytes``
    (of ``cap_kind``, see :func:`with_capacity`): what ``oomdoctor simulate`` and ``oomdoctor.replay`` run.

    Raises:
        UsageError: the trace holds no allocation history; and :func:`simulate`'s errors.
    """
    if not trace.has_history:
        raise UsageError(f"{trace.path}: the snapshot holds no allocation history (recorded with "
                         "enabled='state'), so there is nothing to replay")
    prepared = prepare(trace)
    capacity = infer_capacity(trace, prepared.device)
    if cap_bytes is not None:
        capacity = with_capacity(capacity, cap_bytes, cap_kind, prepared.recorded_config)
    else:
        capacity = settle_capacity(prepared, capacity)
    return simulate(trace, configs=configs, immediate_frees=immediate_frees, capacity=capacity, search=search,
                    workers=workers, prepared=prepared)


def with_capacity(capacity: Capacity, limit: int, kind: str | None = None,
                  recorded: AllocatorConfig | None = None) -> Capacity:
    """``capacity`` with its limit replaced by a user-given one. The kind is ``kind`` when given, else
    the inferred one (a recorded fraction cap stays one), else ``fraction`` when the ``recorded``
    settings have a garbage-collection threshold (it acts only under a fraction cap, so the run had
    one), else ``device``."""
    if kind is None:
        gc = recorded is not None and recorded.garbage_collection_threshold > 0
        kind = capacity.kind if capacity.kind != "none" else ("fraction" if gc else "device")
    return Capacity(limit_bytes=limit, kind=kind, source="given", certainty=GIVEN, lower_bytes=limit,
                    upper_bytes=limit, evidence="given", source_values={"kind": kind})


#: How many caps in the inferred range :func:`settle_capacity` replays under a GC threshold.
GC_CANDIDATES = 9
#: Rounds of narrowing around the best cap (each replays up to GC_CANDIDATES caps).
GC_ROUNDS = 3
#: The GC search stops once its replays have covered this many events in all (about 30 s).
SETTLE_MAX_EVENTS = 20_000_000


def settle_capacity(prepared: Prepared, capacity: Capacity) -> Capacity:
    """Check a cap read off the trace's fallbacks (:mod:`.capacity` rule 4: only bounded) by replay.

    Frees before a new segment may also be a user's ``empty_cache()`` the trace cannot tell apart, and
    under a garbage-collection threshold the exact value matters (GC runs above ``threshold * cap``).
    So: replay the lower bound; unless that reproduces the recording, replay without a cap and, with a
    GC threshold, :data:`GC_CANDIDATES` caps spread over the bounds, narrowing around the best
    (:data:`GC_ROUNDS` rounds, while the replays stay under :data:`SETTLE_MAX_EVENTS` events in all); keep the
    one whose self-replay matches best (fewest segment events unmatched once the two sequences are aligned,
    :attr:`~.replay.Validation.segment_events_unmatched`, so a cap that misses one GC free scores one and
    not every event after it; then fewest events with reserved bytes differing; ties to the lowest cap).
    Other capacities are returned unchanged."""
    if capacity.evidence != "fallbacks":
        return capacity
    # cap -> (segment events unmatched, reserved events differing, cap (-1: none), validation): lowest first
    scored: dict[int | None, tuple[int, int, int, Validation]] = {}

    def score(cap: int | None) -> tuple[int, int, int, Validation]:
        if cap not in scored:
            c = replace(capacity, limit_bytes=cap) if cap is not None else Capacity(limit_bytes=None,
                                                                                    kind="none",
                                                                                    source="unlimited")
            v = replay(prepared, capacity=c, validate=True).validation
            assert v is not None  # validate=True
            scored[cap] = (v.segment_events_unmatched, v.reserved_events_differing, -1 if cap is None else cap, v)
        return scored[cap]

    best = score(capacity.lower_bytes)
    if not best[3].exact:
        best = min(best, score(None), key=lambda x: x[:3])
        lo, hi = capacity.lower_bytes, capacity.upper_bytes
        for _ in range(GC_ROUNDS if prepared.recorded_config.garbage_collection_threshold > 0 else 0):
            if best[3].exact or len(scored) * prepared.device.num_events > SETTLE_MAX_EVENTS:
                break
            assert lo is not None and hi is not None  # evidence "fallbacks": both bounds read off the trace
            for k in range(GC_CANDIDATES):
                best = min(best, score(lo + (hi - lo) * k // (GC_CANDIDATES - 1)), key=lambda x: x[:3])
            if best[2] < 0:
                break
            tried = sorted(c for c in scored if c is not None)
            i = tried.index(best[2])
            lo, hi = tried[max(i - 1, 0)], tried[min(i + 1, len(tried) - 1)]
    unmatched, _, cap, v = best
    if cap < 0:
        return Capacity(limit_bytes=None, kind="none", source="fallbacks-unreproduced", certainty=BOUNDED,
                        lower_bytes=capacity.lower_bytes, upper_bytes=None, evidence="fallbacks",
                        source_values={"runs": capacity.source_values.get("runs")})
    if cap == capacity.lower_bytes and len(scored) == 1:
        return capacity
    return replace(capacity, limit_bytes=cap, source_values={
        **capacity.source_values, "settled_caps": len(scored), "settled_cap": cap, "settled_exact": bool(v.exact),
        "settled_unmatched": unmatched})


__all__ = ["INCOMPATIBILITIES", "RECOMMENDATION_REASONS", "SIMULATION_NOTES", "Recommendation", "Simulation",
           "WhatIf", "grid", "recommend", "run_many", "simulate", "simulate_recorded", "with_capacity"]
