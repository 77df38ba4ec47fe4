"""Capture without a GPU: names, atomic writes, the writable check, the recorder's step windows and
dumps against a stand-in for ``torch.cuda`` that serves a real snapshot, sidecars read back by ``load``,
and gathering with a dead rank."""

from __future__ import annotations

import errno
import json
import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
from builder import MiB, SnapBuilder

from oomdoctor.capture import CaptureError, Recorder, parse_steps
from oomdoctor.capture.files import atomic_write_bytes, ensure_writable, sidecar_name, snapshot_name
from oomdoctor.capture.gather import DirectoryStore, gather_payloads
from oomdoctor.capture.metadata import env_subset, place_markers, rank_info
from oomdoctor.capture.recorder import parse_stack_steps, stacked_step
from oomdoctor.trace import discover, load, load_ranks
from oomdoctor.trace.load import prefer_one_per_rank


def test_names_round_trip_through_the_loader():
    assert snapshot_name(3) == "rank3.pickle"
    assert snapshot_name(3, step=20) == "rank3_step20.pickle"
    assert snapshot_name(3, oom=True) == "rank3_oom.pickle"
    assert sidecar_name("/x/rank3_oom.pickle") == "rank3_oom.meta.json"


@pytest.mark.parametrize("text, window", [(None, None), ("2:4", (2, 4)), ("7", (7, 7)), ((0, 3), (0, 3))])
def test_parse_steps(text, window):
    assert parse_steps(text) == window


@pytest.mark.parametrize("bad", ["4:2", "a:b", "1:2:3", "-1:3", (1,)])
def test_parse_steps_rejects(bad):
    with pytest.raises(CaptureError, match="steps"):
        parse_steps(bad)


def test_ensure_writable_creates_and_refuses(tmp_path):
    assert ensure_writable(str(tmp_path / "a" / "b")) == str(tmp_path / "a" / "b")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CaptureError, match="cannot create the output directory"):
        ensure_writable(str(f / "sub"))
    with pytest.raises(CaptureError, match="not a directory"):
        ensure_writable(str(f))
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(CaptureError, match="not writable"):
            ensure_writable(str(ro))


def test_atomic_write_replaces_or_leaves_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "rank0.pickle"
    atomic_write_bytes(str(p), b"old")
    assert p.read_bytes() == b"old" and oct(p.stat().st_mode & 0o777) == oct(0o666 & ~_umask())

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        atomic_write_bytes(str(p), b"new" * 1000)
    assert p.read_bytes() == b"old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["rank0.pickle"]  # no temporary left behind


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_env_subset_and_rank_info():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_DEBUG": "INFO", "TORCH_NCCL_X": "1",
           "HOME": "/root", "AWS_SECRET_ACCESS_KEY": "s", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}
    assert list(env_subset(env)) == ["LOCAL_RANK", "NCCL_DEBUG", "PYTORCH_CUDA_ALLOC_CONF", "RANK", "TORCH_NCCL_X",
                                      "WORLD_SIZE"]
    assert rank_info(env) == (3, 1, 8)
    assert rank_info({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16"}) == (5, 1, 16)
    assert rank_info({}) == (0, 0, 1)


def test_place_markers():
    times = [10, 20, 20, 30, 40]
    got = place_markers([{"step": 0, "time_us": 5}, {"step": 1, "time_us": 20}, {"step": 2, "time_us": 35},
                         {"step": 3, "time_us": 99}], times)
    assert [m["event_index"] for m in got] == [0, 1, 4, 5]


def test_prefer_one_per_rank():
    files = ["d/rank0.pickle", "d/rank0_oom.pickle", "d/rank1_step3.pickle", "d/rank1_step12.pickle",
             "d/rank2.pickle", "d/rank2_step5.pickle", "d/other.pickle"]
    assert prefer_one_per_rank(files) == ["d/other.pickle", "d/rank0_oom.pickle", "d/rank1_step12.pickle",
                                          "d/rank2.pickle"]


# ---- the recorder, against a stand-in for torch.cuda that serves a real snapshot --------------------

class FakeCuda:
    """``torch.cuda`` as far as the recorder uses it; ``_snapshot`` returns a snapshot built in code
    whose trace times are ``time_us`` values the test controls."""

    def __init__(self, snapshot: dict, fail_snapshot: bool = False):
        self.snap = snapshot
        self.fail_snapshot = fail_snapshot
        self.history_calls: list[tuple] = []
        self.contexts: list[str | None] = []
        self.memory = SimpleNamespace(_record_memory_history=self._record, _snapshot=self._snapshot)
        self.nccl = SimpleNamespace(version=lambda: (2, 28, 9))

    def _record(self, enabled="all", **kw):
        self.history_calls.append((enabled, kw.get("clear_history", False)))
        self.contexts.append(kw.get("context"))

    def _snapshot(self):
        if self.fail_snapshot:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.snap

    def current_device(self):
        return 0

    def get_device_properties(self, d):
        return SimpleNamespace(name="NVIDIA H200", total_memory=150_119_759_872)

    def get_per_process_memory_fraction(self, d):
        return 0.25

    def memory_stats(self, d):
        return {"num_alloc_retries": 2, "num_ooms": 1, "allocated_bytes.all.peak": 8 * MiB}


def fake_recorder(tmp_path, snapshot, **kw) -> tuple[Recorder, FakeCuda]:
    cuda = FakeCuda(snapshot)
    rec = Recorder(str(tmp_path / "out"), **kw)
    rec._torch = SimpleNamespace(cuda=cuda, __version__="2.11.0+cu130", version=SimpleNamespace(cuda="13.0"))
    rec.active = True
    rec.markers.append({"step": 0, "time_us": 0})
    return rec, cuda


def small_snapshot(tmp_path) -> dict:
    b = SnapBuilder()
    s = b.segment(64 * MiB)
    for i in range(6):
        b.alloc(s, i * 4 * MiB, 4 * MiB)
    return pickle.loads(Path(b.write(tmp_path / "src.pickle")).read_bytes())


def test_the_default_gathers_stacks_in_the_first_three_steps_and_every_tenth(tmp_path):
    # the default measured on the device (docs/capture.md, round 5): +2.53% step time where "all" cost +8.79%
    rec, _ = fake_recorder(tmp_path, small_snapshot(tmp_path))
    assert rec.stack_plan == (3, 10)
    assert [s for s in range(25) if stacked_step(rec.stack_plan, s)] == [0, 1, 2, 10, 20]
    rec_none, _ = fake_recorder(tmp_path, small_snapshot(tmp_path), stacks="none")
    assert rec_none.stack_plan is None


def test_recorder_window_dumps_once_with_sidecar(tmp_path):
    snap = small_snapshot(tmp_path)
    rec, cuda = fake_recorder(tmp_path, snap, steps="1:2", on_oom=False, stack_steps="all")
    assert cuda.history_calls == []  # window starts later and no OOM dumps asked: nothing recorded yet
    rec.step()  # step 0 ends -> window opens at step 1
    assert cuda.history_calls == [("all", True)]
    rec.step()
    rec.step()  # step 2 ends -> dump and stop recording
    assert cuda.history_calls[-1] == (None, False)
    rec.step()
    rec.stop()
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["rank0_step2.meta.json", "rank0_step2.pickle"]
    t = load(tmp_path / "out" / "rank0_step2.pickle")
    assert t.rank == 0 and t.meta["kind"] == "window" and t.meta["torch_version"] == "2.11.0+cu130"
    assert t.meta["memory_cap_bytes"] == int(0.25 * 150_119_759_872)
    assert t.meta["memory_stats"]["num_alloc_retries"] == 2
    assert [m["step"] for m in t.meta["step_markers"]] == [0, 1, 2, 3]
    # free stacks are off by default (they crash non-reentrant checkpointing, docs/checkpoint_crash.md)
    assert t.meta["recording"] == {"max_entries": 100_000, "stacks": "python", "context": "alloc", "steps": [1, 2],
                                   "stack_steps": None, "stack_steps_fit": None}
    assert "stack_markers" not in t.meta  # stacks at every step: nothing to mark
    assert cuda.contexts[0] == "alloc"
    assert set(t.meta["dump"]) == {"snapshot_s", "pickle_and_write_s"} and t.meta["dump"]["snapshot_s"] >= 0
    assert t.devices[0].num_events == 7  # segment_alloc + 6 allocs


def test_recorder_oom_observer_never_raises_and_final_dump_is_skipped(tmp_path, capsys):
    snap = small_snapshot(tmp_path)
    rec, cuda = fake_recorder(tmp_path, snap)
    rec._enable(clear=False)
    rec._oom_observer(0, 4 * MiB, 37_529_939_968, 1 << 30)
    assert (tmp_path / "out" / "rank0_oom.pickle").exists()
    rec.stop()  # no step since the OOM: the OOM dump is the record of this run
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["rank0_oom.meta.json", "rank0_oom.pickle"]
    meta = json.loads((out / "rank0_oom.meta.json").read_text())
    assert meta["oom"] == {"device": 0, "alloc_bytes": 4 * MiB, "device_limit_bytes": 37_529_939_968,
                           "device_free_bytes": 1 << 30}
    failing, fcuda = fake_recorder(tmp_path / "b", snap)
    fcuda.fail_snapshot = True
    failing._oom_observer(0, 1, 2, 3)  # must not raise into the allocator
    assert "illegal memory access" in capsys.readouterr().err


def test_a_later_oom_with_no_step_after_it_is_dumped_over_the_first_at_the_stop(tmp_path):
    """A job that catches its OOM and retries inside the ``except`` block, where it runs out again (issue 49): the
    observer dumps at the first only, then notes the second; no step ran after it, so the job died of it, and the
    stop dumps the OOM again with the second's numbers. A step after the later OOM: the job went on, and the run's
    final dump is written as after any caught OOM."""
    snap = small_snapshot(tmp_path)
    rec, cuda = fake_recorder(tmp_path, snap)
    rec._enable(clear=False)
    rec._oom_observer(0, 4 * MiB, 37_529_939_968, 1 << 30)
    first = (tmp_path / "out" / "rank0_oom.pickle").stat().st_mtime_ns
    rec._oom_observer(0, 2 * MiB, 37_529_939_968, 1 << 20)  # noted, not dumped: the first dump is untouched
    assert (tmp_path / "out" / "rank0_oom.pickle").stat().st_mtime_ns == first and len(rec.written) == 1
    rec.stop()
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["rank0_oom.meta.json", "rank0_oom.pickle"]
    assert len(rec.written) == 2
    meta = json.loads((out / "rank0_oom.meta.json").read_text())
    assert meta["kind"] == "oom" and meta["oom"] == {"device": 0, "alloc_bytes": 2 * MiB,
                                                     "device_limit_bytes": 37_529_939_968, "device_free_bytes": 1 << 20}
    # a step after the later OOM: recovered, the final dump as usual and the OOM dump left as it was
    rec2, _ = fake_recorder(tmp_path / "b", snap)
    rec2._enable(clear=False)
    rec2._oom_observer(0, 4 * MiB, 37_529_939_968, 1 << 30)
    rec2._oom_observer(0, 2 * MiB, 37_529_939_968, 1 << 20)
    rec2.step()
    rec2.stop()
    out2 = tmp_path / "b" / "out"
    assert sorted(p.name for p in out2.iterdir()) == ["rank0.meta.json", "rank0.pickle", "rank0_oom.meta.json",
                                                      "rank0_oom.pickle"]
    assert json.loads((out2 / "rank0_oom.meta.json").read_text())["oom"]["alloc_bytes"] == 4 * MiB
    # a later OOM after a step, none after it: the job died of the later one
    rec3, _ = fake_recorder(tmp_path / "c", snap)
    rec3._enable(clear=False)
    rec3._oom_observer(0, 4 * MiB, 37_529_939_968, 1 << 30)
    rec3.step()
    rec3._oom_observer(0, 6 * MiB, 37_529_939_968, 1 << 20)
    rec3.stop()
    out3 = tmp_path / "c" / "out"
    assert sorted(p.name for p in out3.iterdir()) == ["rank0_oom.meta.json", "rank0_oom.pickle"]
    assert json.loads((out3 / "rank0_oom.meta.json").read_text())["oom"]["alloc_bytes"] == 6 * MiB


def test_recorder_failed_dump_warns_and_goes_on(tmp_path, capsys, monkeypatch):
    rec, _ = fake_recorder(tmp_path, small_snapshot(tmp_path))
    rec._enable(clear=False)
    import oomdoctor.capture.recorder as recorder_mod

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(recorder_mod, "atomic_write_bytes", full)
    rec.stop()
    err = capsys.readouterr().err
    assert "writing a snapshot" in err and "No space left on device" in err and "training goes on" in err
    assert str(tmp_path / "out" / "rank0.pickle") in err
    assert rec.failures == {"writing a snapshot": 1}
    assert list((tmp_path / "out").iterdir()) == []


def test_recorder_failures_are_logged_once_and_never_raise(tmp_path, capsys):
    """Every hook the recorder puts into the job swallows its own failures: the first of each kind is
    printed, the rest counted, and a last line sums them up at stop()."""
    rec, cuda = fake_recorder(tmp_path, small_snapshot(tmp_path), steps="1:1", on_oom=False)

    def broken(*a, **kw):
        raise RuntimeError("CUDA driver shutting down")

    cuda.memory._record_memory_history = broken  # opening the window fails at every step
    for _ in range(5):
        rec._optimizer_hook(object(), (), {})  # what torch.optim calls after each step
    assert rec.step_count == 5 and rec.failures == {"the optimizer step hook": 1}
    rec.step()
    cuda.memory._snapshot = broken
    rec._oom_observer(0, 1, 2, 3)
    rec.stop()
    err = capsys.readouterr().err
    assert err.count("CUDA driver shutting down") == 2  # the optimizer hook once, the OOM dump once
    assert "the optimizer step hook x1, writing a snapshot x1" in err


def test_recorder_with_unwritable_directory_warns_and_records_nothing(tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("x")
    rec = Recorder(str(f / "sub"))  # cannot be created: a file is in the way
    assert rec.out_dir is None and rec.start() is rec and not rec.active
    rec.step()
    rec.stop()
    assert "nothing will be recorded; training goes on" in capsys.readouterr().err


def test_free_stacks_are_opt_in_and_warned(tmp_path, capsys, monkeypatch):
    snap = small_snapshot(tmp_path)
    rec, cuda = fake_recorder(tmp_path, snap, free_stacks=True)
    rec._enable(clear=False)
    assert cuda.contexts == ["all"] and rec.metadata(snap, "final")["recording"]["context"] == "all"
    torch = SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: True))
    monkeypatch.setitem(__import__("sys").modules, "torch", torch)
    Recorder(str(tmp_path / "o2"), free_stacks=True, on_oom=False)._start()
    assert "non-reentrant activation checkpointing" in capsys.readouterr().err


def test_recorder_without_torch_or_cuda_only_warns(tmp_path, capsys):
    rec = Recorder(str(tmp_path / "out")).start()
    assert not rec.active
    rec.stop()
    err = capsys.readouterr().err
    assert "nothing is recorded" in err
    assert list((tmp_path / "out").iterdir()) == []


def test_recorder_rejects_bad_arguments(tmp_path):
    with pytest.raises(CaptureError, match="stacks"):
        Recorder(str(tmp_path), stacks="cpp")
    with pytest.raises(CaptureError, match="max_entries"):
        Recorder(str(tmp_path), max_entries=0)


@pytest.mark.parametrize("spec, plan", [("all", None), (None, None), ("3", (3, 0)), ("3/10", (3, 10)),
                                        ((2, 4), (2, 4))])
def test_parse_stack_steps(spec, plan):
    assert parse_stack_steps(spec) == plan


@pytest.mark.parametrize("bad", ["0/4", "3/-1", "a", "1/2/3", "", (1,)])
def test_parse_stack_steps_rejects(bad):
    with pytest.raises(CaptureError, match="stack steps"):
        parse_stack_steps(bad)


def test_stacked_steps_switch_the_context_and_keep_the_history(tmp_path):
    """'2/4': stacks in steps 0, 1, 4, 8; every switch re-calls the recorder with clear_history=False
    (recordHistory keeps the ring buffer then) and is marked in the sidecar."""
    snap = small_snapshot(tmp_path)
    rec, cuda = fake_recorder(tmp_path, snap, stack_steps="2/4", on_oom=False)
    rec._enable(clear=False)
    for _ in range(9):
        rec.step()  # ends steps 0..8; step_count is then 9
    assert [stacked_step((2, 4), s) for s in range(10)] == [True, True, False, False, True, False, False, False,
                                                           True, False]
    assert cuda.contexts == ["alloc", None, "alloc", None, "alloc", None]
    assert all(clear is False for _, clear in cuda.history_calls)  # never clears while switching
    assert [(m["step"], m["stacks"]) for m in rec.stack_marks] == [(0, True), (2, False), (4, True), (5, False),
                                                                   (8, True), (9, False)]
    rec.stop()
    meta = json.loads((tmp_path / "out" / "rank0.meta.json").read_text())
    assert meta["recording"]["stack_steps"] == [2, 4]
    assert [(m["step"], m["stacks"]) for m in meta["stack_markers"]] == [(0, True), (2, False), (4, True),
                                                                         (5, False), (8, True), (9, False)]
    assert all("event_index" in m for m in meta["stack_markers"])


def test_stacked_steps_fit_the_ring_buffer(tmp_path, monkeypatch):
    """When the first K steps end, N is lowered so that max_entries holds two stacked steps: step 1 makes 4
    events (times 30..60, after its start marker at 25) and the buffer holds 20 events: N 10 -> 20 // 8 = 2."""
    import oomdoctor.capture.recorder as recorder
    clock = iter([5, 25, 65, 66, 70, 80, 90, 100, 110])
    monkeypatch.setattr(recorder, "now_us", lambda: next(clock))
    events = [{"action": "alloc", "addr": 1 << 20, "size": 512, "stream": 0, "time_us": t, "frames": []}
              for t in (10, 20, 30, 40, 50, 60)]
    rec, cuda = fake_recorder(tmp_path, {"segments": [], "device_traces": [events]}, stack_steps="2/10",
                              max_entries=20, on_oom=False)
    rec._enable(clear=False)  # stack marker at 5
    rec.step()  # step 1 starts at 25
    rec.step()  # step 2 starts at 65: the fit counts step 1's events; N becomes 2, so step 2 keeps stacks
    assert rec.stack_fit == {"asked": [2, 10], "events_per_step": 4}
    assert rec.stack_plan == (2, 2)
    rec.step()  # step 3 starts at 66: off at 70
    rec.step()  # step 4 starts at 80: on at 90
    assert [(m["step"], m["stacks"], m["time_us"]) for m in rec.stack_marks] == [(0, True, 5), (3, False, 70),
                                                                                (4, True, 90)]
    rec_meta = rec.metadata(None, "final")["recording"]
    assert rec_meta["stack_steps"] == [2, 2] and rec_meta["stack_steps_fit"] == {"asked": [2, 10], "events_per_step": 4}
    # a buffer that holds enough keeps N
    clock2 = iter([5, 25, 65, 66, 70])
    monkeypatch.setattr(recorder, "now_us", lambda: next(clock2))
    big, _ = fake_recorder(tmp_path / "b", {"segments": [], "device_traces": [events]}, stack_steps="2/10",
                           max_entries=100, on_oom=False)
    big._enable(clear=False)
    big.step()
    big.step()
    assert big.stack_plan == (2, 10) and big.stack_fit["events_per_step"] == 4


def test_stacked_steps_with_a_window_and_without_stacks(tmp_path):
    snap = small_snapshot(tmp_path)
    rec, cuda = fake_recorder(tmp_path, snap, steps="5:6", stack_steps="1/4", on_oom=False)
    for _ in range(7):
        rec.step()  # the window opens at step 5 (no stacks: 5 % 4 != 0), step 6 none, dumped at 7
    assert cuda.history_calls[0] == ("all", True) and cuda.contexts[0] is None
    assert [(m["step"], m["stacks"]) for m in rec.stack_marks] == [(5, False)]
    none, ncuda = fake_recorder(tmp_path / "n", snap, stacks="none", stack_steps="1/4", on_oom=False)
    none._enable(clear=False)
    for _ in range(5):
        none.step()
    assert ncuda.contexts == [None] and none.stack_plan is None and none.stack_marks == []


def test_stacked_steps_on_old_torch_keep_stacks_everywhere(tmp_path):
    """torch < 2.4 has no clear_history and clears at every call: no switching there."""
    rec, cuda = fake_recorder(tmp_path, small_snapshot(tmp_path), stack_steps="1/4", on_oom=False)

    def old(enabled="all", context="all", stacks="all", max_entries=0):
        cuda.contexts.append(context)
    cuda.memory._record_memory_history = old
    rec._enable(clear=False)
    for _ in range(3):
        rec.step()
    assert cuda.contexts == ["alloc"] and rec.stack_plan is None


# ---- gathering --------------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_gather_names_the_rank_that_never_answers(tmp_path):
    store = DirectoryStore(str(tmp_path))
    assert gather_payloads(store, "job", 2, 4, b"two") is None  # other ranks return at once
    gather_payloads(store, "job", 1, 4, b"one")
    clock = Clock()
    got = gather_payloads(store, "job", 0, 4, b"zero", timeout_s=5, poll_s=0.5, clock=clock, sleep=clock.sleep)
    assert got.payloads == {0: b"zero", 1: b"one", 2: b"two"}
    assert got.missing == [3] and got.waited_s == pytest.approx(5.0)


def test_discover_ignores_store_and_temporary_files(tmp_path):
    b = SnapBuilder()
    s = b.segment(64 * MiB)
    b.alloc(s, 0, MiB)
    b.write(tmp_path / "rank0.pickle")
    DirectoryStore(str(tmp_path)).set("job/rank0", b"{}")
    (tmp_path / ".rank1.pickle.123.abcd.tmp").write_bytes(b"\x80")
    (tmp_path / "summary.json").write_text("{}")
    assert [Path(p).name for p in discover([tmp_path])] == ["rank0.pickle"]
    assert [t.rank for t in load_ranks([tmp_path])] == [0]


class _Tensor:
    """What the recorder reads of a ``torch.Tensor``: where its storage is and how big."""

    def __init__(self, ptr: int, n: int) -> None:
        self.is_cuda, self.device, self.grad = True, SimpleNamespace(index=0), None
        self._st = SimpleNamespace(data_ptr=lambda: ptr, nbytes=lambda: n)

    def untyped_storage(self):
        return self._st


class _Optimizer:  # a plain object: the recorder must hold it weakly
    def __init__(self, param_groups, state) -> None:
        self.param_groups, self.state = param_groups, state


def test_every_dump_notes_the_optimizers_storages_for_the_final_state(tmp_path):
    """A long job's ring buffer drops the first steps, where the step records were noted: the dump's own
    record says what the blocks of the final state hold, and the accounting takes it."""
    from oomdoctor.analysis import analyze
    from oomdoctor.analysis.accounting import CATEGORIES, RECORDED

    snap = small_snapshot(tmp_path)
    base = snap["segments"][0]["address"]
    rec, _ = fake_recorder(tmp_path, snap)
    rec._enable(clear=False)
    p = _Tensor(base, 4 * MiB)
    p.grad = _Tensor(base + 4 * MiB, 4 * MiB)
    opt = _Optimizer([{"params": [p]}], {p: {"exp_avg": _Tensor(base + 8 * MiB + 512, 1024), "step": 3}})
    rec._optimizer_hook(opt, (), {})  # step 1 ends: noted at the real clock, after the test trace's times
    rec.stop()
    t = load(tmp_path / "out" / "rank0.pickle")
    step, dump = t.meta["tensors"]
    assert "at" not in step and dump["at"] == "dump" and dump["step"] == 1
    assert dump["parameters"] == [[base, 4 * MiB]] and dump["gradients"] == [[base + 4 * MiB, 4 * MiB]]
    assert dump["optimizer_state"] == [[base + 8 * MiB + 512, 1024]]
    a = analyze(t)
    acc, lt = a.accounting, a.lifetimes
    got = {int(lt.addr[r]) - base: (CATEGORIES[acc.category[r]], int(acc.source[r])) for r in range(len(lt))}
    assert got[0] == ("parameters", RECORDED) and got[4 * MiB] == ("gradients", RECORDED)
    assert got[8 * MiB] == ("optimizer_state", RECORDED)  # the block that contains the storage
    assert all(src != RECORDED for off, (_c, src) in got.items() if off >= 12 * MiB)
    del opt, p
    import gc

    gc.collect()
    assert len(rec._optimizers) == 0  # held weakly: the recorder keeps no optimizer alive


def test_autorecord_passes_stack_steps_from_the_run_configuration(monkeypatch, tmp_path):
    import oomdoctor.capture.autorecord as autorecord
    seen = {}

    class Fake:
        def start(self):
            return self

        def stop(self):
            pass

    def make(out, **kw):
        seen.update(kw, out=out)
        return Fake()
    monkeypatch.setattr(autorecord, "_recorder", None)
    monkeypatch.setattr(autorecord, "_make_recorder", make)
    monkeypatch.setenv(autorecord.CONFIG_ENV, json.dumps({"out": str(tmp_path), "stack_steps": "3/10"}))
    autorecord.start()
    assert seen["stack_steps"] == "3/10" and seen["out"] == str(tmp_path)
    monkeypatch.setattr(autorecord, "_recorder", None)
    monkeypatch.setenv(autorecord.CONFIG_ENV, json.dumps({"out": str(tmp_path)}))
    autorecord.start()
    assert seen["stack_steps"] == "all"  # a configuration written before the option: stacks at every step


STOP_SCRIPT = """
import sys, torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from oomdoctor.capture import autorecord

class Rec:  # stands in for the Recorder started at CUDA's initialisation, whose hook comes after the stop's
    _hook_handle = None
    step_count = 0
    first = None
    def _optimizer_hook(self, optimizer, args, kwargs):  # counts the first optimizer's steps, as the Recorder does
        self.first = self.first or id(optimizer)
        if id(optimizer) != self.first:
            return
        self.step_count += 1
        print(f"recorder counted step {self.step_count}", flush=True)
    def optimizer_step_ended(self, optimizer, args, kwargs, after):
        from oomdoctor.capture.recorder import Recorder
        Recorder.optimizer_step_ended(self, optimizer, args, kwargs, after)
    def stop(self):
        print(f"recorder dumped after step {self.step_count}", flush=True)

autorecord.install_stop(torch, int(sys.argv[1]))
rec = autorecord._recorder = Rec()
if sys.argv[2] == "after":
    rec._hook_handle = register_optimizer_step_post_hook(rec._optimizer_hook)
m = torch.nn.Linear(2, 2)
opts = [torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m.parameters(), lr=0.1)]
for step in range(1, 10):
    m(torch.ones(1, 2)).sum().backward()
    for o in opts:  # two optimizers per step: one step counted
        o.step()
    print(f"loop step {step}", flush=True)
"""


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("recorder", ["after", "none"])
def test_the_stop_ends_the_process_inside_the_kth_optimizer_step_after_the_recorder_counts_it(tmp_path, steps,
                                                                                              recorder):
    import subprocess
    import sys
    script = tmp_path / "job.py"
    script.write_text(STOP_SCRIPT)
    p = subprocess.run([sys.executable, str(script), str(steps), recorder], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("loop step") == steps - 1  # the K-th step's optimizer.step() never returns
    assert f"stopped after {steps} optimizer steps" in p.stderr
    if recorder == "after":  # the recorder's hook counted every step, the K-th one included, exactly once
        assert p.stdout.count("recorder counted step") == steps and f"recorder dumped after step {steps}\n" in p.stdout
    else:
        assert "recorder counted" not in p.stdout
