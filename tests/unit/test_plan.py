"""oomdoctor plan: terms against the paper's formulas, schedules, the Megatron goldens, search, CLI."""

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from oomdoctor.cli.main import main
from oomdoctor.plan import terms
from oomdoctor.plan.estimate import estimate
from oomdoctor.plan.schedule import bubble_fraction, in_flight_chunks
from oomdoctor.plan.search import search
from oomdoctor.plan.specs import (
    PRESETS,
    Hardware,
    ModelSpec,
    ParallelPlan,
    PlanError,
    TrainingSpec,
    from_hf_config,
)
from oomdoctor.plan.validate import validate_csv

SHARED = Path(os.environ.get("OOMDOCTOR_SHARED", Path(__file__).resolve().parents[2].parent / "shared"))
GOLDEN = SHARED / "megatron_ci" / "golden_memory_train.csv"
needs_golden = pytest.mark.skipif(not GOLDEN.is_file(), reason=f"Megatron-LM's CI goldens not found at {GOLDEN} "
                                                             "(set OOMDOCTOR_SHARED)")
GPT = ModelSpec("gpt", 24, 1024, 4096, 16, 16, 50257, tied_embeddings=True, gated_mlp=False, bias=True,
                norm="layernorm")


def test_layer_activations_are_korthikanti_table_2():
    """GPT block (4h GeLU MLP, dropout, unfused attention): the rows of Table 2 of arXiv:2205.05198."""
    s, b, h, a = 2048, 4, 1024, 16
    train = TrainingSpec(seq_len=s, global_batch=8, micro_batch=b, flash_attention=False, dropout=True)
    sbh = s * b * h
    none = terms.layer_activation_bytes(GPT, train, ParallelPlan(), "none")
    assert none == sbh * 34 + 5 * a * s * s * b  # sbh(34 + 5as/h)
    tp = ParallelPlan(tp=4, dp=1)
    assert terms.layer_activation_bytes(GPT, train, tp, "none") == sbh * 10 + (sbh * 24 + 5 * a * s * s * b) // 4
    sp = replace(tp, sequence_parallel=True)
    assert terms.layer_activation_bytes(GPT, train, sp, "selective") == sbh * 34 // 4
    assert terms.layer_activation_bytes(GPT, train, sp, "full") == 2 * sbh // 4


def test_model_states_follow_the_megatron_and_zero_tables():
    train = TrainingSpec(seq_len=1024, global_batch=8)
    n = 1_000_000
    full = terms.model_state_bytes(n, train, ParallelPlan(dp=8, dp_sharding="none"))
    assert sum(full.values()) == 18 * n  # bf16 params, fp32 grads: 18 B
    dist = terms.model_state_bytes(n, train, ParallelPlan(dp=8, dp_sharding="zero1"))
    assert sum(dist.values()) == 6 * n + 12 * n // 8  # 6 + 12/d
    fsdp = terms.model_state_bytes(n, train, ParallelPlan(dp=8, dp_sharding="fsdp"))
    assert sum(fsdp.values()) == 16 * n // 8  # 16/d
    fp16 = replace(train, grad_bytes=2, master_bytes=8)
    assert sum(terms.model_state_bytes(n, fp16, ParallelPlan(dp=8, dp_sharding="none")).values()) == 20 * n


def test_in_flight_micro_batches_per_schedule():
    assert [in_flight_chunks("1f1b", 4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight_chunks("gpipe", 4, r, 8) for r in range(4)] == [8] * 4
    # interleaved: Megatron test gpt3_7b_tp1_pp4 (p=4, v=8, M=4): the last rank holds 29 chunk-micro-batches
    assert in_flight_chunks("interleaved", 4, 3, 4, 8) == 29
    assert in_flight_chunks("interleaved", 4, 0, 4, 8) == 32  # capped at M * v
    assert in_flight_chunks("interleaved", 8, 0, 64, 4) == 3 * 8 + 14 + 1
    assert bubble_fraction("1f1b", 4, 16) == 3 / 16 and bubble_fraction("interleaved", 4, 16, 5) == 3 / 80
    with pytest.raises(ValueError):
        in_flight_chunks("1f1b", 4, 4, 8)


def test_invalid_plans_show_the_arithmetic():
    m, t = PRESETS["llama3-70b"], TrainingSpec(seq_len=4096, global_batch=32)
    with pytest.raises(PlanError, match=r"tp\(8\) \* pp\(4\) \* dp\(2\) \* cp\(1\) = 64 != gpus\(32\)"):
        estimate(m, t, ParallelPlan(tp=8, pp=4, dp=2), Hardware("h", 80 * 10**9, 32))
    with pytest.raises(PlanError, match=r"num_layers\(80\) % \(pp\(3\) \* vpp\(1\)\) = 2"):
        estimate(m, t, ParallelPlan(pp=3, dp=1))
    with pytest.raises(PlanError, match=r"global batch 32 is not a multiple of micro_batch\(1\) \* dp\(3\) = 3"):
        estimate(m, t, ParallelPlan(dp=3))
    with pytest.raises(PlanError, match="sequence_parallel needs tp > 1"):
        estimate(m, t, ParallelPlan(dp=1, sequence_parallel=True))
    with pytest.raises(PlanError, match="no support for Pipeline parallelism with CPU offloading"):
        estimate(m, t, ParallelPlan(pp=2, dp=1, cpu_offload_optimizer=True))


@needs_golden
def test_megatron_7b_memory_tests_within_4_percent():
    v = validate_csv(GOLDEN)
    seven = [r for r in v.gpt_rows if "gpt3_7b" in r.test_dir]
    assert len(seven) == 6
    for r in seven:
        assert r.relative_error < 0.04, (r.golden_file, r.measured_bytes, r.predicted_bytes)
    h100 = {r.test_dir.rsplit("/", 1)[-1]: r for r in seven if r.golden_file.endswith("dgx_h100.json")}
    assert h100["gpt3_7b_tp1_pp4_memory_speed"].predicted_bytes == 60_042_936_320  # measured 60.72e9
    assert h100["gpt3_7b_tp4_pp1_memory_speed"].predicted_bytes == 56_288_641_024  # measured 57.14e9


@needs_golden
def test_megatron_goldens_summary():
    v = validate_csv(GOLDEN)
    assert len(v.gpt_rows) == 260
    assert v.coverage == pytest.approx(250 / 260)
    assert v.median_error < 0.10
    assert all(r.predicted_bytes is None for r in v.rows if "/gpt/" not in r.test_dir)
    # the p90 target (25%) is missed: recorded in docs/plan.md; this keeps the number honest
    assert 0.30 < v.p90_error < 0.45
    # refused rows are counted by class and kept out of the statistics: the two GRPO throughput tests (an
    # inference engine holds their memory) and 8 rows whose layers do not split evenly over the stages
    assert v.refused() == {"uneven pipeline stages (num_layers not divisible by pp x vpp)": 8,
                           "reinforcement learning (GRPO)": 2}
    # rows identical in every configuration column measure up to ~26% apart: no estimator from these
    # columns can get every row closer than that
    assert v.floor_median < 0.02 and 0.2 < v.floor_p90 < 0.3


@needs_golden
def test_blank_and_nonsense_csv_fields_get_a_reason_per_row(tmp_path):
    """A blank global-batch-size (Megatron's release tests) was a TypeError in plan/specs.py: it is
    Megatron's default, micro-batch x data-parallel size; blank or non-numeric sizes refuse the row."""
    import csv
    with open(GOLDEN, newline="") as f:
        rows = list(csv.DictReader(f))
    base = next(r for r in rows if r["test_dir"].endswith("gpt3_7b_tp4_pp1_memory_speed"))
    variants = [dict(base, **{"global-batch-size": ""}), dict(base, **{"seq-length": ""}),
                dict(base, **{"micro-batch-size": "abc"}), dict(base, **{"hidden-size": "nan"}),
                dict(base, test_dir=base["test_dir"].replace("gpt3_7b", "gpt_grpo_7b"))]
    out = tmp_path / "rows.csv"
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(variants)
    v = validate_csv(out)
    derived = v.rows[0]
    assert derived.predicted_bytes is not None and derived.reason == ""
    assert [r.reason for r in v.rows[1:]] == [
        "missing seq-length", "micro-batch-size is not a number: 'abc'",
        "hidden-size is not a whole number in [0, 2147483648]: 'nan'",
        "reinforcement learning (GRPO): the memory holds an inference engine, not covered"]


def test_each_stage_adds_up_and_pipelining_outputs_grow_the_last_stage():
    m = replace(PRESETS["llama3-8b"], num_layers=16)
    base = ParallelPlan(pp=2, dp=2, dp_sharding="fsdp", recompute="full", framework="torch")
    last = []
    for mbs in (2, 4, 8, 16):
        t = TrainingSpec(seq_len=4096, global_batch=2 * mbs)
        cached = estimate(m, t, replace(base, return_outputs=True), pad_vocab=False)
        flat = estimate(m, t, base, pad_vocab=False)
        for s in cached.stages + flat.stages:
            s.check()
        assert cached.stages[0].allocated_bytes == flat.stages[0].allocated_bytes  # stage 0 unaffected
        assert flat.stages[1].allocated_bytes == estimate(m, TrainingSpec(seq_len=4096, global_batch=4), base,
                                                          pad_vocab=False).stages[1].allocated_bytes
        last.append(cached.stages[1].terms["cached_outputs"])
    logits = 4096 * 128256 * 2  # one micro-batch's bf16 logits
    assert last == [logits * (n - 1) for n in (2, 4, 8, 16)]


LLAMA_1B = ModelSpec("llama3.2-1b-untied", 16, 2048, 8192, 32, 8, 128256)  # benchmarks/measure_plan_gpu.py


def test_eager_layer_activations_are_the_tensors_autograd_saves():
    """torchtitan's Llama block in eager mode: 16sbh + 8sbf (+ 4asb) without TP, which is what the fsdp4
    snapshot holds per layer; with TP + SP the projections keep the all-gathered input whole."""
    s, b, h, f, a = 4096, 2, 2048, 8192, 32
    train = TrainingSpec(seq_len=s, global_batch=8, micro_batch=b)
    sbh, sbf = s * b * h, s * b * f
    torch_plan = ParallelPlan(dp=4, dp_sharding="fsdp", framework="torch")
    eager = terms.layer_activation_bytes(LLAMA_1B, train, torch_plan, "none")
    assert eager == 16 * sbh + 8 * sbf + 4 * a * s * b
    # probe on H200: one block saved 895,557,648 bytes besides its input (2sbh, the previous layer's output),
    # including its bf16 weights, the complex64 RoPE table (s x 32) and two fp32 RMSNorm rstd (s x b)
    weights, freqs, rstd = 2 * sum(terms.layer_params(LLAMA_1B, 1)), s * 32 * 8, 2 * s * b * 4
    assert 0 <= 895_557_648 + 2 * sbh - (eager + weights + freqs + rstd) < 64
    megatron = terms.layer_activation_bytes(LLAMA_1B, train, replace(torch_plan, framework="megatron"), "none")
    assert megatron == 13 * sbh + 6 * sbf + 4 * a * s * b  # fused: GQA K/V at g/a, no separate SiLU output
    tp = replace(torch_plan, tp=2, dp=2, sequence_parallel=True)
    assert terms.layer_activation_bytes(LLAMA_1B, train, tp, "none") == 2 * sbh + 4 * sbh + (
        8 * sbh + 8 * sbf + 4 * a * s * b) // 2
    assert terms.layer_activation_bytes(LLAMA_1B, train, tp, "full") == 2 * sbh // 2


def test_torch_loss_bytes_per_logit_and_gpipe_held_losses():
    train = TrainingSpec(seq_len=4096, global_batch=16, micro_batch=1)
    n = 4096 * 128256
    t = ParallelPlan(dp=2, dp_sharding="fsdp", framework="torch")
    assert terms.logits_loss_bytes(LLAMA_1B, train, t, 128256) == 12 * n  # probe: 12.000 B/logit
    assert terms.logits_loss_bytes(LLAMA_1B, train, replace(t, tp=2), 128256) == 16 * n // 2  # loss_parallel
    pp = replace(t, pp=2)
    assert terms.logits_loss_bytes(LLAMA_1B, train, pp, 128256) == 14 * n  # + the stage output
    assert terms.logits_loss_bytes(LLAMA_1B, train, replace(t, framework="megatron"), 128256) == 6 * n
    assert terms.held_losses_bytes(train, pp, 128256, 8) == 0  # 1F1B: backward right after the loss
    gpipe = replace(pp, schedule="gpipe")
    assert terms.held_losses_bytes(train, gpipe, 128256, 8) == 6 * n * 7
    assert terms.held_losses_bytes(train, replace(gpipe, return_outputs=True), 128256, 8) == 4 * n * 7


def test_torch_gradients_meet_activations_only_under_accumulation():
    torch_fsdp = ParallelPlan(dp=4, dp_sharding="fsdp", framework="torch")
    assert not terms.gradients_persist(torch_fsdp, 1)
    assert terms.gradients_persist(torch_fsdp, 4)
    assert not terms.gradients_persist(replace(torch_fsdp, pp=2, dp=2), 8)  # FSDP2 under PP: unsharded grads
    assert terms.gradients_persist(replace(torch_fsdp, framework="megatron"), 1)  # contiguous grad buffers
    train = TrainingSpec(seq_len=4096, global_batch=8, micro_batch=2)
    st = estimate(LLAMA_1B, train, torch_fsdp).stages[0]
    st.check()
    assert st.peak_phase == "activations" and not st.gradients_persist
    t = st.terms
    assert st.breakdown["model_states"] == t["weights"] + t["optimizer_state"]  # no gradients at the loss
    assert st.allocated_bytes == (t["weights"] + t["optimizer_state"] + t["workspace"] + t["fsdp_gather_buffers"]
                                  + t["activations"] + t["embedding_inputs"] + t["logits_and_loss"])


def test_predictions_match_the_h200_measurements(monkeypatch):
    """docs/plan_gpu.json: max_allocated and max_reserved measured on 4 H200s (benchmarks/measure_plan_gpu.py),
    against today's estimate: allocated within 8% on every rank, reserved within 10% off GPipe's last stage."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("measure_plan_gpu", root / "benchmarks" / "measure_plan_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    records = json.loads((root / "docs" / "plan_gpu.json").read_text())["records"]
    assert len(records) == 32 and {r["gpu_name"] for r in records} == {"NVIDIA H200"}
    for row in bench.compare(records)["rows"]:
        assert abs(row["allocated_error"]) < 0.08, row["config"]
        if row["config"] != "pp2-fsdp2-gpipe" or row["stage"] == 0:
            assert abs(row["reserved_error"]) < 0.10, row["config"]


def test_seed_002_ordering():
    m = PRESETS["llama3-70b"]
    t = TrainingSpec(seq_len=4096, global_batch=32, grad_bytes=2, fp8=True)
    hw = Hardware("h100-80gb", 81559 * 2**20, 32)
    base = ParallelPlan(schedule="interleaved", sequence_parallel=True)
    plans = [replace(base, tp=4, pp=4, vpp=5, dp=2), replace(base, tp=4, pp=8, vpp=5, dp=1),
             replace(base, tp=8, pp=4, vpp=5, dp=1)]
    r = search(m, t, hw, base, plans=plans)
    labels = [" ".join(c.plan.label().split()[:3]) for c in r.candidates]
    assert labels == ["TP4 PP4 VPP5", "TP4 PP8 VPP5", "TP8 PP4 VPP5"]
    assert all(c.fits == "yes" for c in r.candidates)
    assert r.candidates[1].relative_throughput < 1.0 and r.candidates[2].relative_throughput < 0.9
    # last-rank allocated against the seed's measured 58.8 / 53.2 / 50.2 GB
    got = [c.estimate.last.allocated_bytes / 1e9 for c in r.candidates]
    for g, want in zip(got, (58.8, 53.2, 50.2)):
        assert abs(g - want) / want < 0.10


def test_search_marks_plans_saved_by_expandable_segments():
    m = PRESETS["llama3-8b"]
    t = TrainingSpec(seq_len=8192, global_batch=16, micro_batch=2)
    plan = ParallelPlan(dp=8, dp_sharding="fsdp", framework="torch")
    e = estimate(m, t, plan)
    p = e.peak
    # capacity between the expandable and the default reserved estimates
    cap = p.device_bytes - p.terms["fragmentation"] // 2
    r = search(m, t, Hardware("x", cap, 8), plan, plans=[plan])
    assert r.candidates[0].fits == "with expandable_segments"
    assert any("fragmentation margin" in w for w in r.candidates[0].why)


def test_hf_config(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256,
           "tie_word_embeddings": False}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = from_hf_config(p)
    assert replace(m, name="llama3-8b") == PRESETS["llama3-8b"]
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 768, "n_head": 12, "n_layer": 12,
                                "vocab_size": 50257, "n_positions": 1024}))
    assert replace(from_hf_config(gpt2), name="gpt2") == replace(PRESETS["gpt2"], ffn_hidden_size=3072)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hidden_size": 10}))
    with pytest.raises(PlanError, match="missing num_attention_heads / n_head"):
        from_hf_config(bad)


@needs_golden
def test_cli_validate_json(capsys):
    assert main(["plan", "validate", str(GOLDEN), "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["rows"]) == 404
    assert set(d["rows"][0]) == {"test_dir", "golden_file", "predicted_bytes", "measured_bytes", "refused"}
    assert d["summary"]["gpt_rows"] == 260 and d["summary"]["covered"] == 250
    assert sum(r["predicted_bytes"] is None for r in d["rows"]) == 404 - 250
    assert d["summary"]["refused"]["reinforcement learning (GRPO)"] == 2


def test_cli_search_and_estimate(capsys):
    args = ["--model", "llama3-70b", "--gpus", "32", "--seq", "4096", "--gbs", "32", "--grad-dtype", "bf16", "--fp8"]
    assert main(["plan", "search", *args, "--plan", "tp4,pp4,vpp5", "--plan", "tp8,pp4,vpp5", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [c["label"].split()[0] for c in d["candidates"]] == ["TP4", "TP8"]
    assert main(["plan", "estimate", *args, "--tp", "4", "--pp", "8", "--vpp", "5"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "TP4 PP8 VPP5 DP1 SP" in out


@pytest.mark.parametrize("args, message", [
    (["plan", "estimate", "--model", "llama3-70b", "--gpus", "32", "--tp", "8", "--pp", "8"],
     "tp(8) * pp(8) * cp(1) = 64 does not divide gpus(32)"),
    (["plan", "estimate", "--model", "nope", "--gpus", "8"], "unknown model 'nope'"),
    (["plan", "estimate", "--model", "llama3-70b", "--gpus", "6", "--pp", "3", "--gbs", "24"],
     "num_layers(80) % (pp(3) * vpp(1)) = 2"),
    (["plan", "search", "--model", "llama3-8b", "--gpus", "8", "--plan", "tp3x"], "bad --plan 'tp3x'"),
    (["plan", "validate", "{tmp}/missing.csv"], "missing.csv: cannot read"),
    (["plan", "validate", "{tmp}/bad.csv"], "missing column(s)"),
    (["plan", "validate", "{tmp}/random.bin"], "random.bin: not a UTF-8 text CSV"),
    (["plan", "estimate", "--model", "{tmp}/random.bin", "--gpus", "8"], "random.bin: not valid JSON"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, args, message):
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    (tmp_path / "random.bin").write_bytes(bytes([0x8D, 0x40, 0x9E, 0x77, 0xFF, 0x00]) * 100)
    assert main([a.format(tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
