"""``oomdoctor tune``'s rules on ids and bytes (:mod:`oomdoctor.report.tune`), with traces made in code: the space, the
bracketing of each memory class, the fits rule and its margin, the cost model, the ranking and the answer."""

from __future__ import annotations

import pytest

from oomdoctor.report import tune as T
from oomdoctor.report.preflight import margin_bytes

GiB = 1 << 30
ROOM = 80 * GiB


# ------------------------------------------------------------------------------------------------ the space


def test_a_knob_range_is_the_powers_of_two_and_its_end():
    assert T.parse_knob("mb=1..512").values == tuple(str(2**i) for i in range(10))
    assert T.parse_knob("mb=3..12").values == ("3", "4", "8", "12")
    assert T.parse_knob("mb=6..6").values == ("6",)
    assert T.parse_knob("ac=none, full,none").values == ("none", "full")


@pytest.mark.parametrize("text", ["mb=", "mb", "=1,2", "mb=1,,2", "mb=8..2", "mb=0..4", "1x=2"])
def test_a_knob_without_values_or_name_is_refused(text):
    with pytest.raises(T.TuneError):
        T.parse_knob(text)


def test_checkpointing_ids():
    assert [T.parse_checkpointing(x) for x in ("none", "full", "1", "2", "every-3")] == \
        ["none", "full", "full", "every-2", "every-3"]
    assert [T.checkpoint_every(x) for x in ("none", "full", "every-4")] == [0, 1, 4]
    with pytest.raises(T.TuneError):
        T.parse_checkpointing("every-1x")


def _hf(mbs=(1, 2, 4, 8, 16), world=1, gb=16, ck=("none", "full"), opt=("fused",), allocs=T.ALLOCATORS):
    return T.hf_space(micro_batches=mbs, checkpointing=ck, optimizers=opt, world_size=world, global_batch=gb,
                      allocators=allocs)


def test_the_global_batch_is_kept_and_what_does_not_divide_it_is_dropped():
    space = _hf(mbs=(1, 2, 3, 4, 8, 16, 32), gb=32, world=2)
    configs, dropped = T.candidates(space)
    assert dropped == [3, 32]  # 3 does not divide 16 a GPU; 32 a GPU is above it
    for c in configs:
        assert c.get("micro_batch") * c.get("grad_accum") * 2 == 32
    assert {c.get("sharding") for c in configs} == {"ddp"}
    # every configuration under every allocator setting
    assert len(configs) == 5 * 2 * 1 * len(T.ALLOCATORS)


def test_a_global_batch_no_micro_batch_divides_is_an_error():
    with pytest.raises(T.TuneError, match="no micro-batch among 3, 5 divides it"):
        T.candidates(_hf(mbs=(3, 5), gb=16))


def test_an_optimizer_change_needs_to_be_allowed():
    with pytest.raises(T.TuneError, match="allow-optimizer-change"):
        _hf(opt=("fused", "adamw8bit"))
    s = T.hf_space(micro_batches=(1,), checkpointing=("none",), optimizers=("fused", "sgd"), world_size=1,
                   global_batch=1, allow_optimizer_change=True)
    assert dict(s.axes)["optimizer"] == ("fused", "sgd")
    with pytest.raises(T.TuneError):
        _hf(opt=("adagrad",))


def test_script_knobs_must_match_the_placeholders():
    cmd = ["python", "train.py", "--bs", "{mb}", "--ac", "{ac}"]
    mb, ac = T.parse_knob("mb=1..4"), T.parse_knob("ac=none,full")
    s = T.script_space([mb, ac], cmd, world_size=1, global_batch=None, batch_knob="mb")
    assert s.batch_axis == "mb" and s.accum_axis is None and dict(s.axes)["mb"] == (1, 2, 4)
    with pytest.raises(T.TuneError, match="has no {lr}"):
        T.script_space([mb, ac, T.parse_knob("lr=1,2")], cmd, world_size=1, global_batch=None, batch_knob="mb")
    with pytest.raises(T.TuneError, match=r"\{ac\} has no --knob"):
        T.script_space([mb], cmd, world_size=1, global_batch=None, batch_knob="mb")
    with pytest.raises(T.TuneError, match="given twice"):
        T.script_space([mb, mb, ac], cmd, world_size=1, global_batch=None, batch_knob="mb")
    with pytest.raises(T.TuneError, match="integers"):
        T.script_space([T.parse_knob("mb=a,b"), ac], cmd, world_size=1, global_batch=None, batch_knob="mb")
    ga_cmd = cmd + ["--ga", "{ga}"]
    with pytest.raises(T.TuneError, match="give --global-batch"):
        T.script_space([mb, ac], ga_cmd, world_size=1, global_batch=None, batch_knob="mb")
    s = T.script_space([mb, ac], ga_cmd, world_size=2, global_batch=8, batch_knob="mb")
    configs, dropped = T.candidates(s)
    assert s.accum_axis == "ga" and dropped == []
    assert sorted({(c.get("mb"), c.get("ga")) for c in configs}) == [(1, 4), (2, 2), (4, 1)]


def test_the_memory_class_drops_the_micro_batch_and_allocator_and_counts_accumulation_as_1_or_2():
    space = _hf(mbs=(1, 2, 4, 8, 16), gb=16)
    configs, _ = T.candidates(space)
    keys = {T.class_key(space, c) for c in configs}
    # (none, full) x (ga = 1 at mb 16, ga >= 2 below)
    assert len(keys) == 4
    assert {dict(k)["grad_accum"] for k in keys} == {1, 2}


def test_parameters_above_the_room_are_refused():
    T.check_budget(ROOM, ROOM, "job")
    with pytest.raises(T.TuneError, match="the parameters alone take 80.00 GiB"):
        T.check_budget(ROOM - 1, ROOM, "job")
    with pytest.raises(T.TuneError, match=r"take 2.00 MiB \(2097152 bytes\) of a GPU, more than the 1.00 MiB"):
        T.check_budget(1 << 20, 2 << 20, "job")
    with pytest.raises(T.TuneError):
        T.check_budget(ROOM - 1, ROOM, "job")


# ------------------------------------------------------------------------------------------------ memory


def _cost(mb: int, per_sample_flops=10**12, per_sample_bytes=10**9, kernels=100, opt_bytes=10**9):
    return T.Cost(1, [per_sample_flops * mb // kernels] * kernels, [per_sample_bytes * mb // kernels] * kernels,
                  [0] * 10, [opt_bytes // 10] * 10)


def _fake_tracer(space, base=20 * GiB, per_sample=GiB, expandable_saves=0, calls=None, kernels=100):
    """A trace_many whose memory is linear in the micro-batch: base + per_sample x mb (checkpointing 'full'
    holds a quarter of it), OOM past the room; expandable segments save ``expandable_saves`` bytes."""
    def one(p: T.TracePoint) -> T.Traced:
        cfg = p.config.as_dict()
        slope = per_sample // 4 if cfg.get("checkpointing") == "full" else per_sample
        r = base + slope * p.micro_batch
        settings = {}
        for a in space.allocators:
            ra = r - (expandable_saves if a == "expandable_segments:True" else 0)
            settings[a] = (ra, ra - GiB, ra > ROOM)
        return T.Traced(p, settings, 4 * GiB, 4 * GiB, 8 * GiB, _cost(p.micro_batch, kernels=kernels), 1.0)

    def many(points):
        if calls is not None:
            calls.append(sorted((dict(p.key).get("checkpointing"), p.micro_batch) for p in points))
        return [one(p) for p in points]

    return many


def test_the_search_traces_the_bracket_and_the_edge_not_every_point():
    space = _hf(mbs=tuple(range(1, 65)), gb=64, ck=("none", "full"), allocs=("defaults",))
    configs, dropped = T.candidates(space)
    calls: list = []
    ranked, st = T.search(space, configs, _fake_tracer(space, calls=calls), room_bytes=ROOM,
                          spec=T.gpu_spec("H100-80GB"))
    margin = margin_bytes(ROOM)
    traced = {(dict(k)["checkpointing"], m) for k, m in st.traced}
    assert len(traced) < len(configs) / 2
    # 'none' fits up to (ROOM - margin - 20 GiB) / 1 GiB samples: the edge is traced on both sides
    edge = max(m for m in (1, 2, 4, 8, 16, 32, 64) if 20 * GiB + m * GiB + margin <= ROOM)
    above = min(m for m in (1, 2, 4, 8, 16, 32, 64) if m > edge)
    assert ("none", edge) in traced and ("none", above) in traced
    for c in ranked:
        truth = 20 * GiB + (GiB // 4 if c.config["checkpointing"] == "full" else GiB) * c.config["micro_batch"]
        assert c.fits == (truth + margin <= ROOM), c.config
        if c.memory_basis == "traced":
            assert c.predicted_peak_reserved_bytes == truth
    # the first round traces each class's smallest and largest micro-batch, all at once
    assert len(calls[0]) == 6  # (none, full) x (ga 2: 1 and 32; ga 1: 64)


def test_only_traced_candidates_that_fit_are_recommended():
    space = _hf(mbs=(1, 2, 4, 8, 16, 32, 64), gb=64, ck=("none",), allocs=("defaults",))
    configs, _ = T.candidates(space)
    ranked, st = T.search(space, configs, _fake_tracer(space), room_bytes=ROOM, spec=T.gpu_spec("H200"), top_k=3)
    for c in T.top(space, ranked, 3):
        assert c.memory_basis == "traced" and c.fits
        assert c.predicted_peak_reserved_bytes + c.margin_bytes <= c.room_bytes
    for c in ranked:
        if not c.fits:
            assert c.predicted_rank == 0


def test_an_interpolated_point_is_the_line_between_its_traced_neighbours():
    space = _hf(mbs=(1, 2, 4, 8), gb=8, ck=("none",), allocs=("defaults",))
    configs, _ = T.candidates(space)
    key = T.class_key(space, next(c for c in configs if c.get("micro_batch") == 2))
    cost = _cost(1)

    def tr(mb, r):
        return T.Traced(T.TracePoint(key, mb, configs[0]), {"defaults": (r, r, False)}, 0, 0, 0, cost, 0.0)

    traced = {(key, 1): tr(1, 10 * GiB), (key, 4): tr(4, 16 * GiB)}
    c2 = next(c for c in configs if c.get("micro_batch") == 2)
    m = T.memory_of(space, c2, traced, ROOM, margin_bytes(ROOM))
    assert m.basis == "interpolated" and m.between == (1, 4) and m.peak_reserved_bytes == 12 * GiB and m.fits


def test_monotone_fits_an_untraced_point_below_a_fitting_trace_fits_and_above_a_failing_one_does_not():
    space = _hf(mbs=(1, 2, 4, 8), gb=8, ck=("none",), allocs=("defaults",))
    configs, _ = T.candidates(space)
    c2 = next(c for c in configs if c.get("micro_batch") == 2)
    key = T.class_key(space, c2)
    margin = margin_bytes(ROOM)

    def tr(mb, r, oom=False):
        return T.Traced(T.TracePoint(key, mb, c2), {"defaults": (r, r, oom)}, 0, 0, 0, _cost(1), 0.0)

    # the line would say 2 does not fit (its midpoint is over), but 4 was traced and fits: so does 2
    traced = {(key, 1): tr(1, ROOM - margin), (key, 4): tr(4, ROOM - margin)}
    assert T.memory_of(space, c2, traced, ROOM, margin).fits
    # 1 ran out of memory in its replay: 2 cannot fit
    traced = {(key, 1): tr(1, ROOM, oom=True), (key, 4): tr(4, 2 * ROOM, oom=True)}
    assert not T.memory_of(space, c2, traced, ROOM, margin).fits


def test_the_margin_is_preflights():
    space = _hf(mbs=(1,), gb=1, ck=("none",), allocs=("defaults",))
    configs, _ = T.candidates(space)
    key = T.class_key(space, configs[0])
    margin = margin_bytes(ROOM)
    for peak, fits in ((ROOM - margin, True), (ROOM - margin + 1, False)):
        traced = {(key, 1): T.Traced(T.TracePoint(key, 1, configs[0]), {"defaults": (peak, peak, False)}, 0, 0, 0,
                                     _cost(1), 0.0)}
        ranked = T.evaluate(space, configs, traced, ROOM, margin, T.gpu_spec("H200"))
        assert ranked[0].fits is fits and ranked[0].margin_bytes == margin == int(ROOM * 0.035)


def test_an_allocator_setting_that_makes_a_micro_batch_fit_is_found():
    space = _hf(mbs=(1, 2, 4, 8, 16, 32, 64), gb=64, ck=("none",),
                allocs=("defaults", "expandable_segments:True"))
    configs, _ = T.candidates(space)
    # defaults: 20 GiB + 1 GiB a sample; expandable segments save 8 GiB: the edge moves up. 5,000 kernels a
    # micro-batch: the host's time counts, so fewer, larger micro-batches are faster
    ranked, st = T.search(space, configs, _fake_tracer(space, expandable_saves=8 * GiB, kernels=5000),
                          room_bytes=ROOM, spec=T.gpu_spec("H200"))
    fits = {(c.config["micro_batch"], c.config["allocator"]): c.fits for c in ranked}
    assert fits[(32, "defaults")] is True and fits[(64, "defaults")] is False  # 84 GiB + margin > 80 GiB
    assert fits[(64, "expandable_segments:True")] is True  # 76 GiB + margin fits
    first, second = T.top(space, ranked, 2)
    assert first.config["micro_batch"] == 64 and first.config["allocator"] == "expandable_segments:True"
    # the same configuration under both settings runs as fast: the setting left unchanged comes first
    assert second.config["micro_batch"] == 32 and second.config["allocator"] == "defaults"


def test_the_trace_budget_stops_the_search_and_says_so():
    space = _hf(mbs=tuple(range(1, 129)), gb=128, ck=("none",), allocs=("defaults",))
    configs, _ = T.candidates(space)
    ranked, st = T.search(space, configs, _fake_tracer(space), room_bytes=ROOM, spec=T.gpu_spec("H200"),
                          max_traces=0)
    assert "trace-budget-reached" in st.notes
    assert len(st.traced) == 3  # the bracket only: ga >= 2 at 1 and 64, ga 1 at 128


# ------------------------------------------------------------------------------------------------ the cost


def test_a_kernel_takes_its_roofline_time():
    spec = T.GpuSpec("X", 1e12, 1e12, 1e11)
    # compute-bound, memory-bound, and a kernel below the floor
    c = T.Cost(1, [int(7e9), 0, 1], [0, int(8e8), 1], [], [])
    st = T.step_of_cost(c, 1, spec)
    assert st.micro_batch_device_s == pytest.approx(0.01 + 0.001 + T.KERNEL_FLOOR_S)
    assert st.micro_batch_host_s == pytest.approx(3 * T.HOST_OP_S)
    assert st.total_s == pytest.approx(st.micro_batch_device_s + T.KERNEL_FLOOR_S * 0 + st.optimizer_s
                                       + T.STEP_OVERHEAD_S)


def test_a_small_micro_batch_is_bound_by_the_host():
    spec = T.gpu_spec("H200")
    c = T.Cost(1, [10] * 1000, [10] * 1000, [], [])
    st = T.step_of_cost(c, 4, spec)
    assert st.micro_batch_s == st.micro_batch_host_s == pytest.approx(1000 * T.HOST_OP_S)
    assert st.total_s == pytest.approx(4 * 1000 * T.HOST_OP_S + T.STEP_OVERHEAD_S)


def test_collective_bytes_follow_the_ring():
    assert T.collective_factor("_allgather_base_", 4) == pytest.approx(0.75)
    assert T.collective_factor("_reduce_scatter_base_", 4) == pytest.approx(0.75)
    assert T.collective_factor("allreduce_", 4) == pytest.approx(1.5)
    assert T.collective_factor("allreduce_", 1) == 0
    c = T.cost_of([(5, 100, 10), (15, 0, 10)], [(6, "_allgather_base_", 1000)], [{"step": 0, "time_us": 0}],
                  [{"phase": "train", "time_us": 0}, {"phase": "optimizer", "time_us": 10}], micro_batches=1,
                  world_size=2, ddp_bucket_bytes=400)
    assert c.train_flops == [100] and c.optimizer_bytes == [10]
    assert c.train_collective_bytes == 500 and c.ddp_allreduce_bytes == 400


def test_the_cost_is_the_last_step_and_per_micro_batch():
    ops = [(1, 1, 1), (11, 2, 2), (12, 3, 3), (21, 4, 4)]
    steps = [{"step": 0, "time_us": 0}, {"step": 1, "time_us": 10}]
    phases = [{"phase": "train", "time_us": 0}, {"phase": "train", "time_us": 10}, {"phase": "optimizer",
                                                                                     "time_us": 20}]
    c = T.cost_of(ops, [], steps, phases, micro_batches=2, world_size=1)
    assert c.train_flops == [2, 3] and c.optimizer_flops == [4] and c.micro_batches == 2


# ------------------------------------------------------------------------------------------- the answer


def _ranked():
    space = _hf(mbs=(1, 2, 4, 8, 16, 32, 64), gb=64, ck=("none", "full"), allocs=("defaults",))
    configs, _ = T.candidates(space)
    ranked, st = T.search(space, configs, _fake_tracer(space), room_bytes=ROOM, spec=T.gpu_spec("H200"), top_k=3)
    return space, ranked, st


def _trial(c, sps, outcome="ran", peak=None):
    return T.TuneTrial(config=dict(c.config), outcome=outcome, seconds=10.0, steps_timed=5, timed_seconds=1.0,
                       measured_samples_per_s=sps, measured_peak_reserved_bytes=peak,
                       predicted_peak_reserved_bytes=c.predicted_peak_reserved_bytes,
                       unpredicted_oom=outcome == "oom" and c.fits, log="x.log",
                       within_margin=T.within_margin(peak, c.predicted_peak_reserved_bytes, c.margin_bytes))


def test_the_answer_is_the_measured_best_not_the_predicted():
    space, ranked, _ = _ranked()
    first, second = T.top(space, ranked, 2)
    trials = [_trial(first, 100.0), _trial(second, 120.0)]
    T.attach_trials(ranked, trials)
    best, measured = T.choose(space, ranked, trials, 2)
    assert measured and best.config == second.config and best.measured_samples_per_s == 120.0


def test_the_prediction_held_when_the_measured_peak_is_within_the_margin():
    assert T.within_margin(105, 100, 5) is True and T.within_margin(106, 100, 5) is False
    assert T.within_margin(None, 100, 5) is None and T.within_margin(10, 100, 0) is True


def test_a_measured_best_whose_peak_plus_the_margin_leaves_the_room_is_not_the_answer():
    """The answer rests on the larger of the predicted and the measured peak: the fastest run reserved more than
    its prediction, and that plus the margin is above the room; the next run is the answer."""
    space, ranked, _ = _ranked()
    first, second = T.top(space, ranked, 2)
    spare = first.room_bytes - first.margin_bytes  # the most a peak may be, the margin kept free
    trials = [_trial(first, 150.0, peak=spare + 1), _trial(second, 120.0, peak=second.predicted_peak_reserved_bytes)]
    assert trials[0].within_margin is False and trials[1].within_margin is True
    best, measured = T.choose(space, ranked, trials, 2)
    assert measured and best.config == second.config
    assert T.answer_peak(first, trials[0]) == spare + 1
    assert T.answer_peak(second, trials[1]) == second.predicted_peak_reserved_bytes
    # at the edge exactly it is still the answer
    trials[0] = _trial(first, 150.0, peak=spare)
    assert T.choose(space, ranked, trials, 2)[0].config == first.config


def test_a_configuration_a_run_refuted_is_never_the_predicted_answer():
    """No run reached its timed steps: the answer falls back to the prediction, but never to a configuration that
    ran out of memory on the GPU, nor to one whose measured peak plus the margin left the room."""
    space, ranked, _ = _ranked()
    first, second, third = T.top(space, ranked, 3)
    trials = [_trial(first, None, outcome="oom")]
    best, measured = T.choose(space, ranked, trials, 3)
    assert not measured and best.config == second.config
    over = _trial(second, None, peak=second.room_bytes)  # ran, no timing, and reserved the whole room
    over.outcome = "ran"
    best, measured = T.choose(space, ranked, [trials[0], over], 3)
    assert not measured and best.config == third.config


def test_the_outcome_says_which_runs_reserved_more_than_predicted_plus_the_margin():
    space = _hf(mbs=(1, 2, 4, 8), gb=8, ck=("none", "full"), allocs=("defaults",))
    configs, dropped = T.candidates(space)

    def run(chosen):
        return [_trial(c, 100.0 - i, peak=c.predicted_peak_reserved_bytes + (c.margin_bytes + 1 if i == 0 else 0))
                for i, c in enumerate(chosen)]

    out = T.tune(space, configs, _fake_tracer(space), run_trials=run, job={}, dropped=dropped, gpu_name="H200",
                 gpu_total_bytes=ROOM, room_bytes=ROOM, spec=T.gpu_spec("H200"), top_k=2)
    assert "measured-peak-over-margin" in out.notes
    assert [t.within_margin for t in out.trials] == [False, True]
    # the first run's measured peak is what the answer would rest on; within the room here, so it stays the answer
    assert out.best.config == out.trials[0].config and out.measured
    assert out.best_peak_reserved_bytes == out.trials[0].measured_peak_reserved_bytes
    from oomdoctor.render.tune import render_tune_text
    text = render_tune_text(out)
    assert "1 trial(s) reserved more than predicted plus the margin" in text
    assert "measured, " in text.split("best:")[1].splitlines()[0]


def test_without_trials_the_answer_is_the_predicted_best_and_not_measured():
    space, ranked, _ = _ranked()
    best, measured = T.choose(space, ranked, [], 3)
    assert not measured and best is T.recommendable(ranked)[0] and best.memory_basis == "traced"


def test_the_outcome_says_measured_false_without_a_gpu():
    space = _hf(mbs=(1, 2, 4), gb=4, ck=("none",), allocs=("defaults",))
    configs, dropped = T.candidates(space)
    out = T.tune(space, configs, _fake_tracer(space), run_trials=None, job={}, dropped=dropped, gpu_name="H200",
                 gpu_total_bytes=ROOM, room_bytes=ROOM, spec=T.gpu_spec("H200"))
    assert out.measured is False and "no-gpu" in out.notes and out.trials == [] and out.best is not None
    assert out.margin_bytes == margin_bytes(ROOM)


def test_the_trials_run_the_top_k_once_per_configuration():
    space = _hf(mbs=(1, 2, 4, 8), gb=8, ck=("none", "full"))
    configs, dropped = T.candidates(space)
    ran: list = []

    def run(chosen):
        ran.extend(chosen)
        return [_trial(c, c.predicted_samples_per_s * 0.9) for c in chosen]

    out = T.tune(space, configs, _fake_tracer(space), run_trials=run, job={}, dropped=dropped, gpu_name="H200",
                 gpu_total_bytes=ROOM, room_bytes=ROOM, spec=T.gpu_spec("H200"), top_k=3)
    assert len(ran) == 3 and len({tuple((k, v) for k, v in c.config.items() if k != "allocator")
                                   for c in ran}) == 3
    assert all(c.memory_basis == "traced" and c.fits for c in ran)
    assert out.measured and out.gpu_seconds == 30.0 and out.best.config == ran[0].config


def test_an_oom_in_a_trial_predicted_to_fit_is_flagged():
    space, ranked, _ = _ranked()
    c = T.top(space, ranked, 1)[0]
    assert _trial(c, None, "oom").unpredicted_oom


def test_nothing_fits_says_how_many_gpus_would_with_numbers():
    space = _hf(mbs=(1, 2), gb=2, ck=("none",), allocs=("defaults",))
    configs, dropped = T.candidates(space)
    # model state 96 GiB (params 24, grads 24, AdamW 48) and 10 GiB of the rest: 106 GiB on an 80 GiB room
    def many(points):
        return [T.Traced(p, {"defaults": (106 * GiB, 100 * GiB, True)}, 24 * GiB, 24 * GiB, 48 * GiB,
                         _cost(p.micro_batch), 1.0) for p in points]
    out = T.tune(space, configs, many, run_trials=None, job={}, dropped=dropped, gpu_name="H100-80GB",
                 gpu_total_bytes=ROOM, room_bytes=ROOM, spec=T.gpu_spec("H100-80GB"))
    assert out.best is None and not any(c.fits for c in out.candidates)
    s = {x.id: x for x in out.nothing_fits}
    margin = margin_bytes(ROOM)
    need = -(-96 * GiB // (ROOM - margin - 10 * GiB))  # ceil: model state over what the rest leaves
    assert s["more-gpus"].gpus == need == 2
    assert s["more-gpus"].per_gpu_bytes == 48 * GiB + 10 * GiB + margin <= ROOM
    assert s["activation-checkpointing"].per_gpu_bytes == 106 * GiB + margin
    assert s["adamw8bit"].per_gpu_bytes == 106 * GiB - 36 * GiB + margin  # 8 of 2 bytes a parameter kept


def test_nothing_fits_counts_the_whole_model_where_a_scripts_sharded_class_holds_a_share():
    """A script on 2 GPUs with shard=ddp,full: DDP's rank holds the whole model state (96 GiB), FSDP's half; the
    smallest peak is FSDP's (48 GiB of state + 40 of the rest = 88 on an 80 GiB room). What would fit is counted from
    the whole state: 3 GPUs (32 + 40 + the margin), not the 2 the space already has and that do not fit."""
    space = T.script_space([T.parse_knob("mb=1"), T.parse_knob("shard=ddp,full")],
                           ["train.py", "--bs", "{mb}", "--shard", "{shard}"], world_size=2, global_batch=None,
                           batch_knob="mb", allocators=("defaults",))
    configs, dropped = T.candidates(space)

    def many(points):
        out = []
        for p in points:
            full = p.config.get("shard") == "full"
            state = 48 * GiB if full else 96 * GiB
            peak = state + 40 * GiB
            out.append(T.Traced(p, {"defaults": (peak, peak, True)}, state // 4, state // 4, state // 2,
                                _cost(p.micro_batch), 1.0))
        return out
    out = T.tune(space, configs, many, run_trials=None, job={}, dropped=dropped, gpu_name="H100-80GB",
                 gpu_total_bytes=ROOM, room_bytes=ROOM, spec=T.gpu_spec("H100-80GB"))
    assert out.best is None
    s = {x.id: x for x in out.nothing_fits}
    margin = margin_bytes(ROOM)
    assert s["more-gpus"].model_state_bytes == 96 * GiB and s["more-gpus"].other_bytes == 40 * GiB
    assert s["more-gpus"].gpus == -(-96 * GiB // (ROOM - margin - 40 * GiB)) == 3
    assert s["more-gpus"].per_gpu_bytes == 32 * GiB + 40 * GiB + margin <= ROOM
