"""``simulate/whatif.py`` on small traces built in code: which experiments ``simulate`` runs and in what order,
what ``grid`` tries, how ``recommend`` chooses, how ``settle_capacity`` searches (issue 35 item 3: each branch
and each returned field, so that a changed one fails a test)."""

from types import SimpleNamespace

import pytest
from builder import SnapBuilder
from test_simulate_gc_settle import gc_trace

import oomdoctor.simulate.whatif as whatif
from oomdoctor.errors import UsageError
from oomdoctor.simulate.capacity import Capacity, infer_capacity
from oomdoctor.simulate.config import DEFAULT, parse_config
from oomdoctor.simulate.replay import IMMEDIATE, RECORDED, prepare, replay
from oomdoctor.simulate.whatif import (
    INCOMPATIBILITIES,
    WhatIf,
    grid,
    recommend,
    run_many,
    settle_capacity,
    simulate,
    simulate_recorded,
    with_capacity,
)
from oomdoctor.trace.load import load

MiB = 1 << 20
UNLIMITED = Capacity(limit_bytes=None, kind="none", source="no-evidence")


def deferred_trace(tmp_path, **settings):
    """A 12 MiB block freed with a deferred free, so a second 12 MiB request needs a second segment (peak reserved
    24 MiB recorded, 12 MiB with immediate frees); both end freed. 11 events."""
    b = SnapBuilder()
    b.settings.update(settings)
    s1 = b.segment(12 * MiB)
    a = b.alloc(s1, 0, 12 * MiB)
    b.free(a, deferred=True)
    s2 = b.segment(12 * MiB)
    b.free(b.alloc(s2, 0, 12 * MiB))
    b.complete(a)
    b.free(b.alloc(s1, 0, 12 * MiB))
    return load(b.write(tmp_path / "deferred.pickle"))


def plain_trace(tmp_path, **settings):
    """One 12 MiB segment, a block in it allocated and freed (no deferred free, no fallback)."""
    b = SnapBuilder()
    b.settings.update(settings)
    s = b.segment(12 * MiB)
    b.free(b.alloc(s, 0, 12 * MiB))
    return load(b.write(tmp_path / "plain.pickle"))


def gc_fallback_trace(tmp_path):
    """Recorded under a fraction cap with ``garbage_collection_threshold:0.5``: 44 MiB (stream 1) and 12 MiB cached,
    the 44 freed before a new 50 MiB segment (a fallback: cap in [62, 112] MiB). See test_simulate_gc_settle.gc_trace:
    ``settle_capacity`` settles on 62 + 50 x 5 / 8 MiB, after 10 replays."""
    return load(gc_trace(tmp_path))


def experiments(sim):
    return [(r.config, r.deferred_frees) for r in sim.results]


# ---- simulate ------------------------------------------------------------------------------------------------

def test_simulate_runs_the_self_replay_then_each_config_with_and_without_immediate_frees(tmp_path):
    t = deferred_trace(tmp_path)
    es = parse_config("expandable_segments:True")
    sim = simulate(t, configs=["expandable_segments:True"], immediate_frees=True, capacity=UNLIMITED)
    assert experiments(sim) == [(DEFAULT, RECORDED), (DEFAULT, IMMEDIATE), (es, RECORDED), (es, IMMEDIATE)]
    assert [r.peak_reserved_bytes for r in sim.results] == [24 * MiB, 12 * MiB, 40 * MiB, 20 * MiB]  # 20 MiB pages
    assert sim.self_replay is sim.results[0] and sim.self_replay.matches_recorded is True
    assert (sim.num_events, sim.recorded_peak_reserved_bytes, sim.recorded_peak_allocated_bytes) == (
        11, 24 * MiB, 12 * MiB)
    assert (sim.recorded_oom_event, sim.has_deferred_frees, sim.capacity, sim.recorded_config) == (
        None, True, UNLIMITED, DEFAULT)
    assert (sim.recommendation, sim.search_wall_s, sim.notes, sim.warnings) == (None, None, [], [])
    assert sim.path == t.path and sim.rank == t.rank
    assert all(r.model is None and r.live_blocks is None for r in sim.results)  # stripped


def test_simulate_without_configs_replays_the_recorded_settings_once(tmp_path):
    sim = simulate(deferred_trace(tmp_path), capacity=UNLIMITED)
    assert experiments(sim) == [(DEFAULT, RECORDED)]
    # the recorded config asked for again (recorded frees) is the self-replay, not a second replay
    again = simulate(deferred_trace(tmp_path), configs=[""], immediate_frees=True, capacity=UNLIMITED)
    assert experiments(again) == [(DEFAULT, RECORDED), (DEFAULT, IMMEDIATE), (DEFAULT, RECORDED), (DEFAULT, IMMEDIATE)]
    assert again.results[2] is again.results[0]
    assert again.results[1] is not again.results[3] and again.results[3].peak_reserved_bytes == 12 * MiB


def test_simulate_takes_its_capacity_from_the_trace_by_default(tmp_path):
    t = gc_fallback_trace(tmp_path)
    sim = simulate(t)
    assert sim.capacity == infer_capacity(t, t.primary)
    assert sim.self_replay.capacity == sim.capacity and sim.capacity.limit_bytes == 62 * MiB


def test_simulate_search_adds_the_grid_once_notes_and_recommends(tmp_path):
    t = deferred_trace(tmp_path)
    sim = simulate(t, configs=["max_split_size_mb:256"], search=True, capacity=UNLIMITED, workers=1)
    p = prepare(t)
    expected = [WhatIf(parse_config("max_split_size_mb:256"))]
    expected += [w for w in grid(p, UNLIMITED, True) if w not in expected]
    assert len(expected) == len(grid(p, UNLIMITED, True)) == 15  # the asked-for one is in the grid: not twice
    assert experiments(sim) == [(DEFAULT, RECORDED)] + [(w.config, w.deferred_frees) for w in expected]
    assert sim.notes == ["gc-not-tried"]  # deferred frees exist; the cap is no fraction
    assert isinstance(sim.search_wall_s, float) and sim.search_wall_s >= 0
    rec = sim.recommendation
    # immediate frees save the second segment; of those at 12 MiB, the recorded config changes the least
    assert (rec.result.config, rec.result.deferred_frees, rec.reason) == (DEFAULT, IMMEDIATE, "lowest-peak")
    assert rec.incompatibilities == INCOMPATIBILITIES["immediate"]


def test_simulate_search_notes_without_deferred_frees_and_under_a_fraction_cap(tmp_path):
    cap = Capacity(limit_bytes=64 * MiB, kind="fraction", source="given", certainty="given",
                   lower_bytes=64 * MiB, upper_bytes=64 * MiB, evidence="given")
    sim = simulate(plain_trace(tmp_path), search=True, capacity=cap, workers=1)
    assert sim.notes == ["no-deferred-frees"]
    assert len(sim.results) == 1 + 10  # 7 settings + 3 with GC thresholds, recorded frees only
    assert sim.recommendation.reason == "no-better-setting" and sim.recommendation.result is sim.results[0]
    assert simulate(plain_trace(tmp_path), search=True, capacity=UNLIMITED, workers=1).notes == [
        "no-deferred-frees", "gc-not-tried"]


def test_simulate_passes_the_preparation_warnings(tmp_path, monkeypatch):
    t = plain_trace(tmp_path)
    p = prepare(t)
    p.warnings.append("a warning of the preparation")
    sim = simulate(t, capacity=UNLIMITED, prepared=p)
    assert sim.warnings == ["a warning of the preparation"] and sim.warnings is not p.warnings


# ---- simulate_recorded, with_capacity ------------------------------------------------------------------------

def test_simulate_recorded_settles_a_fallback_cap_by_replay(tmp_path):
    sim = simulate_recorded(gc_fallback_trace(tmp_path))
    assert sim.capacity.limit_bytes == 62 * MiB + 50 * MiB * 5 // 8
    assert sim.capacity.source_values["settled_caps"] == 10 and sim.self_replay.matches_recorded is True


def test_simulate_recorded_given_cap_takes_the_gc_threshold_for_a_fraction(tmp_path):
    t = plain_trace(tmp_path, garbage_collection_threshold=0.6)
    sim = simulate_recorded(t, cap_bytes=8 * MiB)
    assert sim.capacity == Capacity(limit_bytes=8 * MiB, kind="fraction", source="given", certainty="given",
                                    lower_bytes=8 * MiB, upper_bytes=8 * MiB, evidence="given",
                                    source_values={"kind": "fraction"})
    assert sim.self_replay.oom is not None  # 12 MiB does not fit under 8
    assert simulate_recorded(plain_trace(tmp_path), cap_bytes=8 * MiB).capacity.kind == "device"
    assert simulate_recorded(t, cap_bytes=8 * MiB, cap_kind="device").capacity.kind == "device"


def test_simulate_recorded_passes_its_arguments_on(tmp_path):
    t = deferred_trace(tmp_path)
    sim = simulate_recorded(t, configs=["expandable_segments:True"], immediate_frees=True, search=True, workers=1)
    es = parse_config("expandable_segments:True")
    assert experiments(sim)[:4] == [(DEFAULT, RECORDED), (DEFAULT, IMMEDIATE), (es, RECORDED), (es, IMMEDIATE)]
    assert sim.recommendation is not None and sim.search_wall_s is not None
    assert sim.capacity == infer_capacity(t, t.primary)  # no fallback: unlimited, nothing to settle


def test_simulate_recorded_refuses_a_trace_without_history(tmp_path):
    b = SnapBuilder()
    s = b.segment(12 * MiB)
    b.alloc(s, 0, 12 * MiB, record=False)
    t = load(b.write(tmp_path / "state.pickle", drop_first=len(b.events)))
    assert not t.has_history
    with pytest.raises(UsageError, match="no allocation history"):
        simulate_recorded(t)


@pytest.mark.parametrize(("inferred", "kind", "recorded", "expected"), [
    ("none", None, None, "device"),
    ("none", None, DEFAULT, "device"),
    ("none", None, parse_config("garbage_collection_threshold:0.6"), "fraction"),  # GC acts only under a fraction
    ("fraction", None, None, "fraction"),  # a recorded fraction cap stays one
    ("device", None, parse_config("garbage_collection_threshold:0.6"), "device"),
    ("fraction", "device", None, "device"),  # the kind asked for wins
    ("none", "fraction", DEFAULT, "fraction"),
])
def test_with_capacity(inferred, kind, recorded, expected):
    c = with_capacity(Capacity(limit_bytes=5 * MiB, kind=inferred, source="x", certainty="bounded",
                               lower_bytes=1, upper_bytes=9, evidence="oom", source_values={"event": 3}), 7 * MiB, kind, recorded)
    assert c == Capacity(limit_bytes=7 * MiB, kind=expected, source="given", certainty="given",
                         lower_bytes=7 * MiB, upper_bytes=7 * MiB, evidence="given",
                         source_values={"kind": expected})


# ---- grid ----------------------------------------------------------------------------------------------------

GRID = ["expandable_segments:True", "max_split_size_mb:128", "max_split_size_mb:256", "max_split_size_mb:512",
        "max_split_size_mb:1024", "roundup_power2_divisions:4", "roundup_power2_divisions:8"]
GRID_GC = ["garbage_collection_threshold:0.6", "garbage_collection_threshold:0.8",
           "max_split_size_mb:512,garbage_collection_threshold:0.8"]


def test_grid_without_deferred_frees_and_without_a_fraction_cap(tmp_path):
    p = prepare(plain_trace(tmp_path))
    for cap in (UNLIMITED, Capacity(limit_bytes=64 * MiB, kind="device", source="given")):
        assert grid(p, cap, False) == [WhatIf(parse_config(x), RECORDED) for x in GRID]


def test_grid_under_a_fraction_cap_with_deferred_frees(tmp_path):
    p = prepare(plain_trace(tmp_path))
    cfgs = [parse_config(x) for x in GRID + GRID_GC]
    g = grid(p, Capacity(limit_bytes=64 * MiB, kind="fraction", source="given"), True)
    assert g == [WhatIf(c, RECORDED) for c in cfgs] + [WhatIf(DEFAULT, IMMEDIATE)] + [WhatIf(c, IMMEDIATE)
                                                                                      for c in cfgs]
    assert parse_config("max_split_size_mb:1024").max_split_size == 1024 * MiB


def test_grid_leaves_out_the_recorded_setting(tmp_path):
    p = prepare(plain_trace(tmp_path, max_split_size=256 * MiB))
    assert p.recorded_config == parse_config("max_split_size_mb:256")
    g = grid(p, UNLIMITED, True)
    assert WhatIf(p.recorded_config, RECORDED) not in g and g[len(GRID) - 1] == WhatIf(p.recorded_config, IMMEDIATE)
    assert len(g) == 2 * len(GRID) - 1


# ---- run_many, _worker ---------------------------------------------------------------------------------------

def test_run_many_replays_each_with_its_frees_and_the_capacity(tmp_path):
    p = prepare(deferred_trace(tmp_path))
    cap = Capacity(limit_bytes=20 * MiB, kind="fraction", source="given")
    ws = [WhatIf(DEFAULT, RECORDED), WhatIf(DEFAULT, IMMEDIATE)]
    rs = run_many(p, ws, cap, workers=1)
    # under 20 MiB the second 12 MiB segment does not fit: the allocator's retry completes the deferred free
    assert [(r.deferred_frees, r.capacity, r.oom is None, r.peak_reserved_bytes) for r in rs] == [
        (RECORDED, cap, True, 12 * MiB), (IMMEDIATE, cap, True, 12 * MiB)]
    assert [r.oom is None for r in run_many(p, ws, Capacity(limit_bytes=8 * MiB, kind="fraction",
                                                            source="given"), workers=1)] == [
        False, False]
    assert all(r.model is None and r.live_blocks is None for r in rs)
    free = run_many(p, ws, UNLIMITED)  # 11 events x 2: far below PARALLEL_MIN_WORK, replayed here
    assert [(r.oom, r.peak_reserved_bytes) for r in free] == [(None, 24 * MiB), (None, 12 * MiB)]
    assert run_many(p, [], cap) == []


def test_run_many_in_worker_processes_gives_the_same_results_in_order(tmp_path, monkeypatch):
    p = prepare(deferred_trace(tmp_path))
    cap = Capacity(limit_bytes=20 * MiB, kind="fraction", source="given")
    ws = [WhatIf(DEFAULT, RECORDED), WhatIf(DEFAULT, IMMEDIATE), WhatIf(parse_config("expandable_segments:True"))]
    serial = run_many(p, ws, cap, workers=1)
    monkeypatch.setattr(whatif, "PARALLEL_MIN_WORK", 2 * p.device.num_events)  # 3 x 11 events: in workers
    forked = run_many(p, ws, cap, workers=2)
    key = [(r.config, r.deferred_frees, r.capacity, r.oom is None, r.peak_reserved_bytes, r.segment_events)
           for r in serial]
    assert [(r.config, r.deferred_frees, r.capacity, r.oom is None, r.peak_reserved_bytes, r.segment_events)
            for r in forked] == key
    assert whatif._worker_prepared is None


def test_run_many_without_fork_replays_here(tmp_path, monkeypatch):
    import multiprocessing

    p = prepare(deferred_trace(tmp_path))
    monkeypatch.setattr(whatif, "PARALLEL_MIN_WORK", 0)
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    ws = [WhatIf(DEFAULT, RECORDED), WhatIf(DEFAULT, IMMEDIATE)]
    rs = run_many(p, ws, UNLIMITED, workers=2)
    assert [(r.deferred_frees, r.capacity, r.peak_reserved_bytes, r.model) for r in rs] == [
        (RECORDED, UNLIMITED, 24 * MiB, None), (IMMEDIATE, UNLIMITED, 12 * MiB, None)]
    cap = Capacity(limit_bytes=20 * MiB, kind="fraction", source="given")
    assert [(r.capacity, r.peak_reserved_bytes) for r in run_many(p, ws, cap, workers=2)] == [
        (cap, 12 * MiB), (cap, 12 * MiB)]
    assert whatif._worker_prepared is None


def test_worker_replays_the_prepared_trace_of_the_process(tmp_path, monkeypatch):
    p = prepare(deferred_trace(tmp_path))
    monkeypatch.setattr(whatif, "_worker_prepared", p)
    cap = Capacity(limit_bytes=20 * MiB, kind="fraction", source="given")
    r = whatif._worker((WhatIf(DEFAULT, RECORDED), cap))
    assert (r.deferred_frees, r.capacity, r.oom, r.peak_reserved_bytes, r.model, r.live_blocks) == (
        RECORDED, cap, None, 12 * MiB, None, None)  # unlimited, the pending free would take a second segment
    assert whatif._worker((WhatIf(DEFAULT, RECORDED), UNLIMITED)).peak_reserved_bytes == 24 * MiB
    r = whatif._worker((WhatIf(DEFAULT, IMMEDIATE), cap))
    assert (r.deferred_frees, r.oom, r.peak_reserved_bytes) == (IMMEDIATE, None, 12 * MiB)
    assert r.events_replayed == replay(p, deferred_frees=IMMEDIATE, capacity=cap).events_replayed


# ---- recommend -----------------------------------------------------------------------------------------------

def result(peak, config=DEFAULT, frees=RECORDED, oom=False):
    return SimpleNamespace(peak_reserved_bytes=peak, config=config, deferred_frees=frees, oom=object() if oom else None)


def test_recommend_none_when_every_result_runs_out():
    assert recommend([result(10, oom=True), result(5, oom=True)], DEFAULT) is None


def test_recommend_keeps_the_recorded_setting_when_nothing_is_lower():
    rec = result(10)
    r = recommend([rec, result(10, parse_config("expandable_segments:True")), result(11, frees=IMMEDIATE)], DEFAULT)
    assert (r.result, r.reason, r.incompatibilities) == (rec, "no-better-setting", [])


def test_recommend_the_lowest_peak_and_what_it_does_not_mix_with():
    es = parse_config("expandable_segments:True")
    best = result(8, es)
    r = recommend([result(10), result(9, frees=IMMEDIATE), best, result(8, oom=True)], DEFAULT)
    assert (r.result, r.reason, r.incompatibilities) == (best, "lowest-peak", INCOMPATIBILITIES["expandable_segments"])


def test_recommend_when_the_recorded_setting_runs_out():
    other = result(12, parse_config("roundup_power2_divisions:4"))
    r = recommend([result(10, oom=True), other], DEFAULT)
    assert (r.result, r.reason, r.incompatibilities) == (other, "recorded-runs-out",
                                                         INCOMPATIBILITIES["roundup_power2_divisions"])


def test_recommend_immediate_frees_are_a_code_change():
    best = result(6, frees=IMMEDIATE)
    r = recommend([result(10), best], DEFAULT)
    assert (r.result, r.incompatibilities) == (best, ["immediate-is-a-code-change"])
    mss_gc = parse_config("max_split_size_mb:512,garbage_collection_threshold:0.8")
    best = result(6, mss_gc, IMMEDIATE)
    assert recommend([result(10), best], DEFAULT).incompatibilities == (
        INCOMPATIBILITIES["max_split_size"] + INCOMPATIBILITIES["garbage_collection_threshold"]
        + INCOMPATIBILITIES["immediate"])


def test_recommend_ties_go_to_the_fewest_changes():
    two = result(8, parse_config("expandable_segments:True,roundup_power2_divisions:4"))
    one = result(8, parse_config("roundup_power2_divisions:4"))
    imm = result(8, parse_config("roundup_power2_divisions:4"), IMMEDIATE)
    for order in ([two, imm, one], [one, two, imm], [imm, one, two]):
        assert recommend([result(10)] + order, DEFAULT).result is one
    # a setting turned off (the recorded one had it on) changes the config but has nothing to warn of
    base = parse_config("expandable_segments:True")
    off = result(5, DEFAULT)
    r = recommend([result(10, base), off], base)
    assert (r.result, r.incompatibilities) == (off, [])


@pytest.mark.parametrize(("text", "frees", "changes"), [
    ("", RECORDED, 0), ("", IMMEDIATE, 1), ("expandable_segments:True", RECORDED, 1),
    ("max_split_size_mb:256,roundup_power2_divisions:4", IMMEDIATE, 3),
    ("garbage_collection_threshold:0.6", RECORDED, 1),
])
def test_complexity_counts_the_changed_settings(text, frees, changes):
    assert whatif._complexity(result(1, parse_config(text), frees), DEFAULT) == changes
    # against itself, only the frees count
    assert whatif._complexity(result(1, parse_config(text), frees), parse_config(text)) == (frees == IMMEDIATE)


def test_complexity_counts_max_non_split_rounding():
    from dataclasses import replace
    changed = replace(DEFAULT, max_non_split_rounding=DEFAULT.max_non_split_rounding * 2)
    assert whatif._complexity(result(1, changed), DEFAULT) == 1


# ---- settle_capacity (the search, over a scored replay stand-in) ---------------------------------------------

def settle(monkeypatch, scores, *, gc=0.0, lower=100, upper=200, events=10, max_events=None):
    """Run settle_capacity over a replay whose validation of cap ``c`` (None: unlimited) is ``scores(c)``:
    ``(unmatched, reserved_differing)``, exact when both are 0. Returns (capacity, the caps replayed in order)."""
    calls = []

    def fake_replay(prepared, *, capacity, validate):
        assert validate is True
        calls.append(capacity.limit_bytes)
        if capacity.limit_bytes is None:
            assert (capacity.kind, capacity.source) == ("none", "unlimited")
        else:
            assert capacity.kind == "fraction" and capacity.upper_bytes == upper
        u, d = scores(capacity.limit_bytes)
        return SimpleNamespace(validation=SimpleNamespace(segment_events_unmatched=u, reserved_events_differing=d,
                                                          exact=u == 0 and d == 0))

    monkeypatch.setattr(whatif, "replay", fake_replay)
    if max_events is not None:
        monkeypatch.setattr(whatif, "SETTLE_MAX_EVENTS", max_events)
    prepared = SimpleNamespace(recorded_config=parse_config(f"garbage_collection_threshold:{gc}") if gc else DEFAULT,
                               device=SimpleNamespace(num_events=events))
    cap = Capacity(limit_bytes=lower, kind="fraction", source="fallbacks", certainty="bounded",
                   lower_bytes=lower, upper_bytes=upper, evidence="fallbacks", source_values={"runs": 2})
    return settle_capacity(prepared, cap), calls, cap


def test_settle_keeps_an_exact_lower_bound(monkeypatch):
    c, calls, cap = settle(monkeypatch, lambda c: (0, 0))
    assert c is cap and calls == [100]


def test_settle_without_gc_keeps_the_lower_bound_when_no_cap_is_worse(monkeypatch):
    c, calls, cap = settle(monkeypatch, lambda c: (1, 4) if c is not None else (2, 0))
    assert calls == [100, None]  # no GC threshold: no caps in between
    assert c == Capacity(limit_bytes=100, kind="fraction", source="fallbacks", certainty="bounded", lower_bytes=100, upper_bytes=200, evidence="fallbacks", source_values={
        "runs": 2, "settled_caps": 2, "settled_cap": 100, "settled_exact": False, "settled_unmatched": 1})


def test_settle_without_gc_reads_frees_no_cap_explains_better_as_unlimited(monkeypatch):
    c, calls, _ = settle(monkeypatch, lambda c: (1, 4) if c is not None else (1, 3))
    assert calls == [100, None]
    assert c == Capacity(limit_bytes=None, kind="none", source="fallbacks-unreproduced", certainty="bounded",
                         lower_bytes=100, upper_bytes=None, evidence="fallbacks", source_values={"runs": 2})


def test_settle_ties_go_to_the_lowest_cap(monkeypatch):
    # no cap scores -1, below every cap: on a tie the frees are read as an empty_cache()
    c, calls, _ = settle(monkeypatch, lambda c: (1, 4))
    assert calls == [100, None] and c.source == "fallbacks-unreproduced"
    c, calls, _ = settle(monkeypatch, lambda c: (1, 4), gc=0.5)
    assert len(calls) == 10 and c.source == "fallbacks-unreproduced"
    # among caps, the lowest: all caps tie, better than none
    c, calls, _ = settle(monkeypatch, lambda c: (1, 4) if c is not None else (1, 5), gc=0.5)
    assert c.limit_bytes == 100 and c.source_values["settled_caps"] == len(calls)


def test_settle_with_gc_tries_caps_over_the_bounds_and_narrows(monkeypatch):
    # exact only at 190: round 1 tries 100, 112, ..., 200 (the best, 187, scores 1 like all: the lowest wins?
    # no: scores fall towards 190), round 2 the window around the best
    def scores(c):
        return (2, 0) if c is None else (0 if c == 190 else 1, abs(c - 190))
    c, calls, _ = settle(monkeypatch, scores, gc=0.5)
    round1 = [100 + 100 * k // 8 for k in range(9)]
    assert calls[:2] == [100, None] and calls[2:10] == round1[1:]  # k = 0 is the lower bound, replayed already
    assert 190 in calls and c.limit_bytes == 190 and c.source_values["settled_exact"] is True
    assert c.source_values["settled_caps"] == len(set(calls)) == len(calls)
    assert c.source_values["settled_unmatched"] == 0


def test_settle_with_gc_stops_when_no_cap_is_best(monkeypatch):
    c, calls, _ = settle(monkeypatch, lambda c: (1, 1) if c is None else (1, 2), gc=0.5)
    assert calls == [100, None] + [100 + 100 * k // 8 for k in range(1, 9)]  # one round, then no cap wins
    assert c == Capacity(limit_bytes=None, kind="none", source="fallbacks-unreproduced", certainty="bounded",
                         lower_bytes=100, upper_bytes=None, evidence="fallbacks", source_values={"runs": 2})


def test_settle_with_gc_stops_at_its_event_budget(monkeypatch):
    def scores(c):
        return (2, 0) if c is None else (1, abs(c - 190))
    # 2 replays of 10 events = 20: at the budget, not over it, so round 1 runs
    c, calls, _ = settle(monkeypatch, scores, gc=0.5, events=10, max_events=20)
    assert len(calls) == 10 and c.source_values["settled_caps"] == 10
    c, calls, _ = settle(monkeypatch, scores, gc=0.5, events=10, max_events=19)
    assert calls == [100, None] and c.source_values == {"runs": 2, "settled_caps": 2, "settled_cap": 100,
                                                        "settled_exact": False, "settled_unmatched": 1}


def test_settle_with_gc_runs_at_most_its_rounds(monkeypatch):
    def scores(c):  # never exact; best ever closer to 150.5
        return (2, 0) if c is None else (1, abs(2 * c - 301))
    c, calls, _ = settle(monkeypatch, scores, gc=0.5, lower=100, upper=2100)
    assert len(calls) <= 2 + whatif.GC_ROUNDS * whatif.GC_CANDIDATES
    assert len(calls) > 2 + (whatif.GC_ROUNDS - 1) * (whatif.GC_CANDIDATES - 2)
    best = min((x for x in calls if x is not None), key=lambda x: abs(2 * x - 301))
    assert c.limit_bytes == best and c.source_values["settled_caps"] == len(calls)


def test_settle_leaves_other_evidence_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(whatif, "replay", lambda *a, **k: calls.append(1))
    for cap in (UNLIMITED, Capacity(limit_bytes=5, kind="device", source="oom-device", certainty="exact",
                                    lower_bytes=5, upper_bytes=5, evidence="oom")):
        assert settle_capacity(None, cap) is cap
    assert calls == []


def full_oom_trace(tmp_path):
    """A 12 MiB block fills a 12 MiB device; a 4 MiB request then runs out of memory (the trace ends at its OOM, as a
    dump at the failure does)."""
    b = SnapBuilder()
    b.alloc(b.segment(12 * MiB), 0, 12 * MiB)
    b.oom(4 * MiB, device_free=0)
    return load(b.write(tmp_path / "full.pickle"))


def test_every_replay_says_how_far_it_reaches(tmp_path):
    """Issue 52: simulate said "none" in its OOM column for a setting that gets past the recorded OOM, without saying
    that the replay ends there. A recording that ends at its OOM is replayed up to it (reach 'recorded'); one
    without is replayed to its end ('complete'): in the JSON per result, and in the text (the real case, a setting
    that gets past it: tests/integration/test_simulate_real.py)."""
    from oomdoctor.render.json import simulation_dict
    from oomdoctor.render.text import render_simulation_text_plain

    sim = simulate(full_oom_trace(tmp_path), configs=["expandable_segments:True"])
    assert sim.reach == "recorded" and all(r.oom is not None for r in sim.results)
    assert [r["reach"] for r in simulation_dict(sim)["results"]] == ["recorded", "recorded"]
    text = render_simulation_text_plain(sim, width=200)
    assert "at 2" in text and "none" not in text
    assert ("replayed: up to the recorded OOM (event 2), where the recording ends; 'past it': a setting gets past "
            "that request, and what the job would have run after it was never recorded") in text
    plain = simulate(plain_trace(tmp_path), configs=["expandable_segments:True"])
    assert plain.reach == "complete" and [r["reach"] for r in simulation_dict(plain)["results"]] == ["complete"] * 2
    text = render_simulation_text_plain(plain, width=200)
    assert "none" in text and "past it" not in text
    assert "replayed: every recorded event (the recording has no OOM)" in text
