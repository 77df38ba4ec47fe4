"""The framework callbacks on CPU, driven by the real Trainer and Lightning loops.

The allocator's history needs a GPU; here the recorder is marked active so the frameworks' real events
reach it (steps, phase marks, the micro-batch), and the diagnosis is exercised on real shared snapshots.
The same events on a GPU, with recording: tests/gpu/test_integrations_gpu.py (docs/integrations.md).
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import shutil
from pathlib import Path

import pytest

from oomdoctor import diagnose, load
from oomdoctor.analysis.phases import EVALUATION_PHASE, FORWARD_PHASE, OPTIMIZER_PHASE, find_phases
from oomdoctor.integrations import MemorySession
from oomdoctor.integrations.session import batch_size

ROOT = Path(__file__).resolve().parents[2]
# 4 steps, evaluation after steps 2 and 4: each step trains, steps the optimizer, trains (zero_grad)
MARKS = ["train", "optimizer", "train", "optimizer", "train", "evaluation"] * 2 + ["train"]
TINY = ["--layers", "2", "--width", "64", "--heads", "2", "--vocab", "128", "--seq", "32", "--steps", "4"]


def scenario(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scenarios" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trainer_callback_marks_steps_phases_and_the_micro_batch(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from oomdoctor.integrations import TrainerMemoryCallback

    job = scenario("callback_trainer")
    a = job.parse([*TINY, "--eval-steps", "2", "--output-dir", str(tmp_path / "hf")])
    cb = TrainerMemoryCallback(str(tmp_path / "mem"))
    cb.session.recorder.active = True  # what start() sets when CUDA is there
    with_cb = job.build(a, [cb])
    with_cb.train()
    rec = cb.session.recorder
    assert rec.step_count == 4
    assert [m["phase"] for m in rec.phase_marks] == MARKS
    assert rec.micro_batch == 4
    assert cb.session.ended
    plain = job.build(a, [])
    plain.train()
    losses = [[h.get("loss"), h.get("eval_loss")] for h in with_cb.state.log_history[:-1]]
    assert losses == [[h.get("loss"), h.get("eval_loss")] for h in plain.state.log_history[:-1]]


def test_lightning_callback_marks_steps_phases_and_the_micro_batch(tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    from oomdoctor.integrations import LightningMemoryCallback

    job = scenario("callback_lightning")
    a = job.parse([*TINY, "--val-every", "2"])
    cb = LightningMemoryCallback(str(tmp_path / "mem"))
    cb.session.recorder.active = True
    trainer, module, train, val = job.build(a, [cb])
    trainer.fit(module, train, *val)
    rec = cb.session.recorder
    assert rec.step_count == 4
    assert [m["phase"] for m in rec.phase_marks] == MARKS
    assert rec.micro_batch == 4
    assert cb.session.ended


def _oom_session(tmp_path: Path, snapshots: Path) -> MemorySession:
    out = tmp_path / "mem"
    s = MemorySession(str(out))
    path = out / "rank0_oom.pickle"
    shutil.copy(snapshots / "fragmentation-oom" / "default-oom.pickle", path)
    s.recorder.active = s.recorder.oom_dumped = True  # what the allocator's OOM observer sets
    s.recorder.written.append(str(path))
    return s


def test_after_an_oom_the_rank_prints_its_diagnosis_once(tmp_path, snapshots, capsys):
    s = _oom_session(tmp_path, snapshots)
    expected = diagnose(s.recorder.written[0]).verdict.kind
    s.step()  # the next event after the OOM (a retry) tells it
    s.tell_oom()
    err = capsys.readouterr().err
    assert err.count(f"oomdoctor: {expected.upper()} on rank 0.") == 1
    assert "Largest holders:" in err and "What to do:" in err
    assert f"Snapshot: {s.recorder.written[0]}" in err.replace("\n  ", " ")
    assert s.report.verdict.kind == expected


def test_at_exit_the_oom_diagnosis_is_repeated_below_the_traceback(tmp_path, snapshots, capsys, monkeypatch):
    s = _oom_session(tmp_path, snapshots)
    s.tell_oom()  # Lightning's on_exception
    capsys.readouterr()
    monkeypatch.setattr("sys.last_value", RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                        raising=False)
    s._at_exit()
    assert capsys.readouterr().err.strip() == s.paragraph
    monkeypatch.setattr("sys.last_value", KeyError("x"), raising=False)
    s._at_exit()
    assert capsys.readouterr().err == ""


def test_the_end_of_training_summary_is_the_paragraph_of_the_diagnosis(tmp_path, snapshots, capsys):
    src = snapshots / "tp-allreduce" / "legacy-rank0.pickle"
    s = MemorySession(str(tmp_path / "mem"))
    with open(src, "rb") as f:
        snap = pickle.load(f)  # our own recording, trusted
    s.recorder.written.append(str(src))
    s._summarize(s.recorder, snap, {"rank": 0, "world_size": 1})
    out = capsys.readouterr().out
    kind = diagnose(str(src)).verdict.kind
    assert out.startswith(f"oomdoctor: {kind.upper()} on rank 0.")
    assert s.report.verdict.kind == kind
    assert json.loads((tmp_path / "mem" / "summary.json").read_text())["verdict"]["kind"] == kind


def test_a_failing_callback_never_reaches_the_job(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    from oomdoctor.integrations import TrainerMemoryCallback

    cb = TrainerMemoryCallback(str(tmp_path / "mem"))

    def boom():
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(cb.session.recorder, "step", boom)
    for _ in range(3):
        assert cb.on_step_end(None, None, None) is None
    err = capsys.readouterr().err
    assert err.count("disk on fire") == 1 and "training goes on" in err


def test_bad_arguments_are_the_only_errors(tmp_path):
    from oomdoctor.capture import CaptureError

    with pytest.raises(CaptureError, match="steps"):
        MemorySession(str(tmp_path), steps="5:2")
    with pytest.raises(CaptureError, match="stacks"):
        MemorySession(str(tmp_path), stacks="some")


def test_batch_size_reads_the_first_tensor():
    torch = pytest.importorskip("torch")
    assert batch_size(torch.zeros(7, 3)) == 7
    assert batch_size({"input_ids": torch.zeros(5, 9), "labels": torch.zeros(5, 9)}) == 5
    assert batch_size([("a", torch.zeros(3))]) == 3
    assert batch_size({"text": ["a", "b"]}) is None


def test_phase_marks_relabel_forward_allocations(snapshots):
    trace = load(snapshots / "fsdp2-gpt2" / "rank0.pickle")
    dt = trace.primary
    before = find_phases(trace, dt).phase
    t = dt.events["time_us"]
    mid = int(t[t.size // 2])
    trace.meta["phase_markers"] = [{"phase": "evaluation", "time_us": int(t[0])}, {"phase": "train", "time_us": mid}]
    after = find_phases(trace, dt).phase
    first, second = slice(0, int(t.searchsorted(mid))), slice(int(t.searchsorted(mid, side="right")), None)
    assert (before[first] == FORWARD_PHASE).any()
    assert not (after[first] == FORWARD_PHASE).any()  # every forward allocation of the marked half is evaluation
    assert (after[first] == EVALUATION_PHASE).sum() >= (before[first] == FORWARD_PHASE).sum()
    assert (after[second] == before[second]).all()  # "train" overrides nothing
    trace.meta["phase_markers"] = [{"phase": "optimizer", "time_us": int(t[0])}]
    assert not (find_phases(trace, dt).phase == FORWARD_PHASE).any()
    assert (find_phases(trace, dt).phase == OPTIMIZER_PHASE).any()


def test_malformed_phase_markers_are_dropped_with_a_warning(tmp_path, snapshots):
    shutil.copy(snapshots / "tp-allreduce" / "legacy-rank0.pickle", tmp_path / "rank0.pickle")
    (tmp_path / "rank0.meta.json").write_text(json.dumps({"phase_markers": [{"phase": "evaluation", "time_us": "x"}]}))
    trace = load(tmp_path / "rank0.pickle")
    assert "phase_markers" not in trace.meta
    assert any("phase_markers" in w for w in trace.warnings)


def test_a_step_window_keeps_the_jobs_step_numbers(snapshots):
    """A window ``10:12`` dumps a trace that begins at step 10: breakdowns say step 10, not 0."""
    trace = load(snapshots / "fsdp2-gpt2" / "rank0.pickle")
    dt = trace.primary
    t = dt.events["time_us"]
    mid = int(t[t.size // 2])
    trace.meta["step_markers"] = [{"step": 9, "time_us": int(t[0]) - 20}, {"step": 10, "time_us": int(t[0]) - 10},
                                  {"step": 11, "time_us": mid}]
    ph = find_phases(trace, dt)
    assert ph.steps.source == "markers" and ph.steps.first == 10
    assert ph.step_of(0) == 10 and ph.step_of(t.size - 1) == 11
