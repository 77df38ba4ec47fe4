"""``oomdoctor tune`` end to end on the CPU: a tiny GPT-2 Trainer job and a tiny script, traced for real. Every
traced candidate's peak is ``oomdoctor preflight``'s for the same configuration; bad input is one line and exit 2;
the runs' timing works on a CPU job (the GPU's runs are the device script's, benchmarks/device/round14_tune.sh)."""

from __future__ import annotations

import json
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from oomdoctor.cli.main import main  # noqa: E402
from oomdoctor.render.schema import schema  # noqa: E402

TRAIN_PY = """
import argparse, torch, torch.nn as nn
from torch.utils.checkpoint import checkpoint
p = argparse.ArgumentParser(); p.add_argument("--bs", type=int); p.add_argument("--ck", default="none")
p.add_argument("--ga", type=int, default=1); p.add_argument("--steps", type=int, default=1000)
a = p.parse_args()
dev = "cuda" if torch.cuda.is_available() else "cpu"
blocks = nn.ModuleList([nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)]).to(dev)
opt = torch.optim.AdamW(blocks.parameters())
for step in range(a.steps):
    for _ in range(a.ga):
        x = torch.randn(a.bs, 16, 64, device=dev)
        for b in blocks:
            x = checkpoint(b, x, use_reentrant=False) if a.ck == "full" else b(x)
        (x.float().pow(2).mean() / a.ga).backward()
    opt.step(); opt.zero_grad()
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tune")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    cfg.to_json_file(str(d / "config.json"))
    # model state (fp32 weights, gradients, AdamW's two moments: 16 bytes a parameter) well above the rest
    wide = transformers.GPT2Config(n_layer=2, n_embd=512, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0,
                                   eos_token_id=0)
    (d / "wide").mkdir()
    wide.to_json_file(str(d / "wide" / "config.json"))
    (d / "train.py").write_text(TRAIN_PY)
    return d


def _json(capsys, argv: list[str], rc: int = 0) -> dict:
    got = main(argv)
    out = capsys.readouterr()
    assert got == rc, out.err
    return json.loads(out.out)


def _one_line_exit_2(capsys, argv: list[str], words: str) -> None:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def hf_tune(tiny):
    """tune on the tiny GPT-2: micro-batch 2 (accumulation 4) and 4 (accumulation 2) and 8, none/full."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["tune", "--hf-config", str(tiny / "config.json"), "--seq-len", "32", "--global-batch", "8",
                   "--micro-batch", "2,4,8", "--checkpointing", "none,full", "--optimizer", "fused",
                   "--gpu", "H100-80GB", "-j", "1", "--no-run", "--format", "json"])
    assert rc == 0
    return json.loads(buf.getvalue())


def _preflight(capsys, tiny, mb: int, ga: int, ck: bool) -> dict:
    argv = ["preflight", "--hf-config", str(tiny / "config.json"), "--seq-len", "32", "--micro-batch", str(mb),
            "--grad-accum", str(ga), "--gpu", "H100-80GB", "--no-search", "--format", "json"]
    return _json(capsys, argv + (["--gradient-checkpointing"] if ck else []))


def test_every_traced_candidates_peak_is_preflights(hf_tune, tiny, capsys):
    traced = [c for c in hf_tune["candidates"] if c["memory_basis"] == "traced"]
    assert traced and len(hf_tune["traces"]) < len(hf_tune["candidates"])
    names = {"defaults": "(defaults)", "expandable_segments:True": "expandable_segments:True",
             "max_split_size_mb:512": "max_split_size_mb:512"}
    seen = {}
    for c in traced:
        cfg = c["config"]
        key = (cfg["micro_batch"], min(cfg["grad_accum"], 2), cfg["checkpointing"] == "full")
        if key not in seen:
            seen[key] = _preflight(capsys, tiny, *key)
        pf = seen[key]
        s = next(x for x in pf["settings"] if x["config"] == names[cfg["allocator"]])
        assert c["predicted_peak_reserved_bytes"] == s["peak_reserved_bytes"], cfg
        assert c["predicted_peak_allocated_bytes"] == s["peak_allocated_bytes"], cfg
        assert c["room_bytes"] == pf["room_bytes"] and c["oom"] == s["oom"]
    assert len(seen) >= 4


def test_accumulation_beyond_2_allocates_what_2_does(hf_tune, tiny, capsys):
    """The rule behind tracing accumulation at 2 (note accumulation-traced-at-2), checked by preflight itself."""
    two = _preflight(capsys, tiny, 2, 2, False)
    four = _preflight(capsys, tiny, 2, 4, False)
    assert two["peak_reserved_bytes"] == four["peak_reserved_bytes"]
    assert two["peak_allocated_bytes"] == four["peak_allocated_bytes"]
    assert "accumulation-traced-at-2" in hf_tune["notes"]


def test_the_answer_without_a_gpu_is_predicted_traced_and_fits(hf_tune):
    best = hf_tune["best"]
    assert hf_tune["measured"] is False and "not-run" in hf_tune["notes"] and hf_tune["trials"] == []
    assert best["memory_basis"] == "traced" and best["fits"] and best["predicted_rank"] == 1
    assert best["predicted_peak_reserved_bytes"] + best["margin_bytes"] <= best["room_bytes"]
    assert best["measured_samples_per_s"] is None and best["predicted_samples_per_s"] > 0
    assert hf_tune["best_as_written"][0].startswith("TrainingArguments(per_device_train_batch_size=")
    for c in hf_tune["candidates"]:
        for k in ("config", "predicted_peak_reserved_bytes", "margin_bytes", "fits", "predicted_samples_per_s",
                  "measured_samples_per_s"):
            assert k in c
        assert c["config"]["micro_batch"] * c["config"]["grad_accum"] == 8


def test_checkpointing_recomputes_in_the_traced_flops(hf_tune):
    by = {(t["config"]["micro_batch"], t["config"]["checkpointing"]): t["cost"] for t in hf_tune["traces"]}
    none, full = by[(4, "none")], by[(4, "full")]
    # the recomputed forward of every layer is in the checkpointed step's kernels
    assert full["train_flops"] > none["train_flops"] and full["train_kernels"] > none["train_kernels"]
    assert full["optimizer_flops"] == none["optimizer_flops"]
    # FLOPs grow with the samples: micro-batch 8 once (accumulation 1) is micro-batch 4 twice (traced at 2)
    eight = by[(8, "none")]
    assert (eight["micro_batches"], none["micro_batches"]) == (1, 2)
    assert eight["train_flops"] == none["train_flops"] > 0


FUSED_PY = """
import torch
model = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.AdamW(model.parameters(), fused=True)
for step in range(10):
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""


def test_an_optimizer_step_that_allocates_nothing_is_the_optimizers_cost(tmp_path):
    """Fused AdamW's second step allocates nothing (its state exists): its kernel is the optimizer phase's, not the
    micro-batch's (before, a marker sat one tick after the clock and such ops fell in the phase before)."""
    from oomdoctor.preflight.script import ScriptJob, trace_script
    from oomdoctor.report.tune import cost_of

    (tmp_path / "fused.py").write_text(FUSED_PY)
    rec = trace_script(ScriptJob((str(tmp_path / "fused.py"),), max_steps=2), gpu_name="H200",
                       gpu_total_bytes=80 << 30)
    c = cost_of(rec.op_costs, rec.collectives, rec.step_markers, rec.phase_markers, micro_batches=1, world_size=1)
    params = 64 * 64 + 64
    # the fused step reads and writes parameters, gradients and both moments (fp32), and the step counts
    assert len(c.optimizer_flops) >= 1 and max(c.optimizer_bytes) >= 4 * 4 * params
    assert all(b < 4 * 4 * params for b in c.train_bytes)


def test_the_json_validates_against_schema_tune(hf_tune, capsys):
    jsonschema = pytest.importorskip("jsonschema")
    v = jsonschema.Draft202012Validator(schema("tune"))
    assert list(v.iter_errors(hf_tune)) == []
    assert _json(capsys, ["schema", "tune"]) == schema("tune")


def test_the_text_shows_the_table_and_the_winner_as_written(tiny, capsys):
    rc = main(["tune", "--hf-config", str(tiny / "config.json"), "--seq-len", "32", "--global-batch", "4",
               "--micro-batch", "2,4", "--checkpointing", "full", "--optimizer", "fused",
               "--allocator", "defaults", "-j", "1", "--no-run"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "peak reserved + margin" in out and "predicted/s" in out and "measured/s" in out
    assert "as you write it:" in out and "gradient_checkpointing=True" in out
    assert "measured: false" in out


def test_a_script_with_knobs(tiny, capsys):
    script = str(tiny / "train.py")
    d = _json(capsys, ["tune", "--knob", "mb=1..4", "--knob", "ck=none,full", "--global-batch", "4",
                       "--allocator", "defaults,expandable_segments:True", "-j", "1", "--no-run", "--format",
                       "json", "--", sys.executable, script, "--bs", "{mb}", "--ck", "{ck}", "--ga", "{ga}"])
    assert d["space"]["batch_axis"] == "mb" and d["space"]["accum_axis"] == "ga"
    assert {(c["config"]["mb"], c["config"]["ga"]) for c in d["candidates"]} == {(1, 4), (2, 2), (4, 1)}
    best = d["best"]
    assert best["memory_basis"] == "traced"
    # the winner's command, its knobs filled
    assert d["best_as_written"][-1].endswith(f"--bs {best['config']['mb']} --ck {best['config']['ck']} "
                                             f"--ga {best['config']['ga']}")
    # a traced point's peak is preflight's of the same command
    c = next(c for c in d["candidates"] if c["memory_basis"] == "traced" and c["config"]["allocator"] == "defaults")
    cfg = c["config"]
    pf = _json(capsys, ["preflight", "--gpu", "H100-80GB", "--format", "json", "--", sys.executable, script,
                        "--bs", str(cfg["mb"]), "--ck", cfg["ck"], "--ga", str(min(cfg["ga"], 2))])
    assert c["predicted_peak_reserved_bytes"] == pf["peak_reserved_bytes"]


def test_samples_per_second_are_the_timed_seconds_said(tmp_path, monkeypatch):
    """The trial's samples/s is its samples over the seconds its JSON says (issue 52: one number, said the same): a
    3-step window of 15.3544 ms gave 781.55 samples/s beside timed_seconds 0.0154 (779.22 from it)."""
    from pathlib import Path
    from types import SimpleNamespace

    import oomdoctor.cli.trials as trials
    from oomdoctor.capture.autorecord import STEP_TIMES_ENV
    from oomdoctor.cli.tune_exec import run_candidates
    from oomdoctor.report.tune import Candidate

    def run_trial(command, d, *, env, **_):  # the job's stop writes its K steps' seconds where the env says
        Path(env[STEP_TIMES_ENV].replace("{rank}", "0")).write_text(json.dumps({"seconds": 0.0153544,
                                                                                 "steps_timed": 3}))
        return SimpleNamespace(outcome="ran", seconds=1.0, log=str(tmp_path / "log"))

    monkeypatch.setattr(trials, "run_trial", run_trial)
    c = Candidate(config={"mb": 4}, predicted_peak_reserved_bytes=1, predicted_peak_allocated_bytes=1, margin_bytes=0,
                  room_bytes=2, fits=True, oom=False, memory_basis="traced", interpolated_between=None,
                  predicted_step_s=0.1, predicted_samples_per_s=40.0, measured_samples_per_s=None, samples_per_step=4,
                  step={}, predicted_rank=0)
    [t] = run_candidates([c], lambda cfg: ["job"], str(tmp_path), steps=3, warmup=2, timeout_s=None)
    assert (t.timed_seconds, t.measured_samples_per_s) == (0.015354, round(4 * 3 / 0.015354, 3))


def test_the_runs_are_timed_after_the_warm_up(tiny, tmp_path):
    """``fit``'s machinery, on the CPU: the job stops itself after warm-up + K optimizer steps and writes how long
    the K took; samples/s follow."""
    from oomdoctor.cli.tune_exec import run_candidates, substitute
    from oomdoctor.report.tune import Candidate

    c = Candidate(config={"mb": 4, "ck": "none", "allocator": "expandable_segments:True"},
                  predicted_peak_reserved_bytes=1, predicted_peak_allocated_bytes=1, margin_bytes=0, room_bytes=2,
                  fits=True, oom=False, memory_basis="traced", interpolated_between=None, predicted_step_s=0.1,
                  predicted_samples_per_s=40.0, measured_samples_per_s=None, samples_per_step=4, step={},
                  predicted_rank=1)
    cmd = [sys.executable, str(tiny / "train.py"), "--bs", "{mb}", "--ck", "{ck}"]
    [t] = run_candidates([c], lambda cfg: substitute(cmd, cfg), str(tmp_path), steps=3, warmup=2, timeout_s=120)
    assert t.outcome == "ran" and t.steps_timed == 3 and t.timed_seconds and t.timed_seconds > 0
    assert t.measured_samples_per_s == pytest.approx(4 * 3 / t.timed_seconds, rel=1e-3)
    timing = json.loads((tmp_path / "trial1.steps.rank0.json").read_text())
    assert timing["warmup"] == 2 and len(timing["step_ends_s"]) == 5
    # the allocator setting went into the job's environment
    from oomdoctor.cli.tune_exec import env_of

    env = env_of(c.config)
    assert env["PYTORCH_ALLOC_CONF"].endswith("expandable_segments:True")


# ---------------------------------------------------------------------------------------------- bad input


def test_a_knob_with_no_values(tiny, capsys):
    _one_line_exit_2(capsys, ["tune", "--knob", "mb=", "--", sys.executable, str(tiny / "train.py"), "--bs",
                              "{mb}"], "no values")


def test_a_global_batch_the_micro_batches_cannot_divide(tiny, capsys):
    _one_line_exit_2(capsys, ["tune", "--hf-config", str(tiny / "config.json"), "--seq-len", "32", "--global-batch",
                              "7", "--micro-batch", "2,4", "--no-run"], "no micro-batch among 2, 4 divides it")
    _one_line_exit_2(capsys, ["tune", "--knob", "mb=2,4", "--global-batch", "7", "--", sys.executable,
                              str(tiny / "train.py"), "--bs", "{mb}", "--ga", "{ga}"], "no micro-batch among 2, 4")


def test_a_budget_smaller_than_the_parameters(tiny, capsys):
    # 740 MB of a 740.3 MB GPU live outside the allocator: 0.3 MB left, and the parameters take 0.55 MB (fp32)
    _one_line_exit_2(capsys, ["tune", "--hf-config", str(tiny / "config.json"), "--seq-len", "32",
                              "--global-batch", "2", "--gpu-memory", "740.3MB", "--no-run"],
                     "the parameters alone take")


def test_a_script_whose_parameters_alone_exceed_the_budget(tiny, capsys):
    """A script's parameters are known from its first traces (no model to build on the meta device): 740 MB of a
    740.3 MB GPU live outside the allocator, and the script's 3 blocks hold 0.4 MB of fp32 parameters."""
    _one_line_exit_2(capsys, ["tune", "--knob", "mb=2,4", "--gpu-memory", "740.3MB", "-j", "1", "--no-run", "--",
                              sys.executable, str(tiny / "train.py"), "--bs", "{mb}"], "the parameters alone take")


def test_gpu_and_gpu_memory_together_is_bad_input(tiny, capsys):
    _one_line_exit_2(capsys, ["tune", "--hf-config", str(tiny / "config.json"), "--seq-len", "32", "--global-batch",
                              "2", "--gpu", "H200", "--gpu-memory", "80GiB", "--no-run"], "not both")


def test_the_progress_bar_counts_every_trace(tiny, capsys, monkeypatch):
    """On a terminal the bar's total grows with each batch of traces and advances once a trace: as many as the
    search made (the JSON's traces)."""
    import oomdoctor.cli.tune as C

    calls = {"grow": 0, "advance": 0, "entered": 0}

    class Counting(C._Bar):
        def __enter__(self):
            calls["entered"] += 1
            return super().__enter__()

        def grow(self, n, what):
            calls["grow"] += n
            super().grow(n, what)

        def advance(self, what):
            calls["advance"] += 1
            super().advance(what)

    monkeypatch.setattr(C, "_Bar", Counting)
    d = _json(capsys, ["tune", "--knob", "mb=2,4", "--knob", "ck=none,full", "--allocator", "defaults", "-j", "1",
                       "--no-run", "--format", "json", "--", sys.executable, str(tiny / "train.py"), "--bs", "{mb}",
                       "--ck", "{ck}"])
    assert calls["entered"] == 1 and calls["grow"] == calls["advance"] == len(d["traces"]) == 4


def test_the_bar_draws_only_on_a_terminal(monkeypatch, capsys):
    import oomdoctor.cli.tune as C

    with C._Bar() as bar:  # standard error captured: not a terminal, nothing drawn
        bar.grow(2, "tracing on the CPU")
        bar.advance("tracing on the CPU")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    with C._Bar() as bar:
        bar.grow(2, "tracing on the CPU")
        bar.advance("tracing on the CPU")
        assert bar._p is not None and bar._p.tasks[0].total == 2 and bar._p.tasks[0].completed == 1


def test_other_bad_input(tiny, capsys):
    script = str(tiny / "train.py")
    _one_line_exit_2(capsys, ["tune", "--knob", "mb=1,2", "--knob", "lr=1,2", "--", sys.executable, script,
                              "--bs", "{mb}"], "the command has no {lr}")
    _one_line_exit_2(capsys, ["tune", "--knob", "mb=1,2", "--", sys.executable, script, "--bs", "{mb}",
                              "--ck", "{ck}"], "{ck} has no --knob")
    _one_line_exit_2(capsys, ["tune", "--hf-config", str(tiny / "config.json"), "--seq-len", "32"],
                     "give --seq-len and --global-batch")
    _one_line_exit_2(capsys, ["tune", "--hf-config", str(tiny / "config.json"), "--seq-len", "32",
                              "--global-batch", "2", "--optimizer", "sgd"], "--allow-optimizer-change")
    _one_line_exit_2(capsys, ["tune"], "give --hf-config")


def test_nothing_fits_says_what_would_with_numbers(tiny, capsys):
    argv = ["tune", "--hf-config", str(tiny / "wide" / "config.json"), "--seq-len", "32", "--global-batch", "2",
            "--micro-batch", "1,2", "--checkpointing", "none", "--optimizer", "fused", "--allocator", "defaults",
            "-j", "1", "--no-run"]
    # the room 40 MB above what the parameters take (~6.8M parameters, 27 MB in fp32): a step needs their 4
    # copies (108 MB) and cuBLAS's workspaces (64 MiB)
    rc = main(argv + ["--gpu-memory", "880MB", "--format", "json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 1 and d["best"] is None and not any(c["fits"] for c in d["candidates"])
    s = {x["id"]: x for x in d["nothing_fits"]}
    assert "more-gpus" in s and s["more-gpus"]["gpus"] >= 2
    assert s["more-gpus"]["per_gpu_bytes"] <= d["room_bytes"]
    state, other = s["more-gpus"]["model_state_bytes"], s["more-gpus"]["other_bytes"]
    assert s["more-gpus"]["per_gpu_bytes"] == -(-state // s["more-gpus"]["gpus"]) + other + d["margin_bytes"]
    rc = main(argv + ["--gpu-memory", "880MB"])
    out = capsys.readouterr().out
    assert rc == 1 and "nothing in the space fits" in out and "GPUs with FSDP2 full shard: about" in out


def test_the_trainer_job_runs_the_configuration_as_trainer_takes_it(tiny, tmp_path):
    """The --hf-config job's runner (oomdoctor.integrations.tune_trainer) trains with transformers.Trainer until the
    injection stops it: here on the CPU in fp32, every-2 checkpointing, fused AdamW, accumulation 2."""
    from oomdoctor.cli.tune_exec import hf_command, run_candidates
    from oomdoctor.report.tune import Candidate

    cfg = {"micro_batch": 2, "grad_accum": 2, "checkpointing": "every-2", "optimizer": "fused", "sharding": "none",
           "allocator": "defaults"}
    c = Candidate(config=cfg, predicted_peak_reserved_bytes=1, predicted_peak_allocated_bytes=1, margin_bytes=0,
                  room_bytes=2, fits=True, oom=False, memory_basis="traced", interpolated_between=None,
                  predicted_step_s=0.1, predicted_samples_per_s=40.0, measured_samples_per_s=None, samples_per_step=4,
                  step={}, predicted_rank=1)
    argv = hf_command(cfg, hf_config=str(tiny / "config.json"), seq_len=32, dtype="fp32", world_size=1)
    assert argv[1:3] == ["-m", "oomdoctor.integrations.tune_trainer"] and "--grad-accum" in argv
    [t] = run_candidates([c], lambda x: argv, str(tmp_path), steps=2, warmup=1, timeout_s=300)
    log = open(t.log).read()
    assert t.outcome == "ran", log[-2000:]
    assert "stopped after 3 optimizer steps" in log and t.measured_samples_per_s > 0


def test_a_torchrun_command_is_traced_from_its_script():
    from oomdoctor.cli.tune_exec import launcher_world_size, script_argv

    cmd = ["torchrun", "--standalone", "--nproc_per_node=4", "train.py", "--bs", "8"]
    assert script_argv(cmd) == ["train.py", "--bs", "8"] and launcher_world_size(cmd) == 4
    cmd = ["python3", "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py", "--nproc_per_node=9"]
    assert script_argv(cmd) == ["train.py", "--nproc_per_node=9"] and launcher_world_size(cmd) == 2
    assert script_argv(["python", "train.py", "--x"]) == ["train.py", "--x"]
    assert launcher_world_size(["python", "train.py", "--nproc_per_node=3"]) is None


def test_with_a_gpu_the_top_k_run_and_the_answer_is_measured(tiny, tmp_path, capsys, monkeypatch):
    """The whole command with its runs, the GPU stood in by the CPU (the runs' machinery does not need one): the top
    2 configurations run, each timed after its warm-up, and the answer is the measured best of them."""
    import oomdoctor.cli.tune_exec as X

    monkeypatch.setattr(X, "gpu_count", lambda: 1)
    script = str(tiny / "train.py")
    d = _json(capsys, ["tune", "--knob", "mb=2,4", "--knob", "ck=none,full", "--global-batch", "4", "--allocator",
                       "defaults", "-j", "1", "--top", "2", "--steps", "2", "--warmup", "1", "--out",
                       str(tmp_path / "runs"), "--format", "json", "--", sys.executable, script, "--bs", "{mb}",
                       "--ck", "{ck}", "--ga", "{ga}"])
    assert len(d["trials"]) == 2 and all(t["outcome"] == "ran" for t in d["trials"])
    ran = {json.dumps(t["config"], sort_keys=True): t["measured_samples_per_s"] for t in d["trials"]}
    assert d["measured"] is True and "no-gpu" not in d["notes"]
    assert d["best"]["measured_samples_per_s"] == max(ran.values())
    assert json.dumps(d["best"]["config"], sort_keys=True) in ran
    # the runs are the two fastest predicted, each traced and fitting
    top2 = [c for c in d["candidates"] if c["predicted_rank"] in (1, 2)]
    assert {json.dumps(c["config"], sort_keys=True) for c in top2} == set(ran)
    assert d["gpu_seconds"] == pytest.approx(sum(t["seconds"] for t in d["trials"]), abs=0.05)
