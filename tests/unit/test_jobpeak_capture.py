"""Issue 41, the recorder's half: every dump notes PyTorch's own counters per recorded device (sidecar
``device_counters``), read right after ``_snapshot()``; a counter that cannot be read never reaches the job;
the loader carries them, reads a framework's ``memory_stats`` JSON when there is no sidecar, and still loads
old sidecars without them."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

from builder import MiB, SnapBuilder

from oomdoctor.capture import Recorder
from oomdoctor.capture.metadata import COUNTER_KEYS, device_counters, recorded_devices
from oomdoctor.trace import discover, load

GiB = 1 << 30


class CountingCuda:
    """``torch.cuda`` as the recorder uses it, whose counters move at every ``_snapshot()`` (so a test can
    tell counters read at the snapshot from counters read later)."""

    def __init__(self, snapshot: dict, devices: int = 2):
        self.snap = snapshot
        self.calls = 0
        self.asked: list[tuple[str, int]] = []
        self.broken: set[str] = set()
        self.memory = SimpleNamespace(_record_memory_history=lambda *a, **k: None, _snapshot=self._snapshot)
        self.nccl = SimpleNamespace(version=lambda: (2, 28, 9))

    def _snapshot(self):
        self.calls += 1
        return self.snap

    def current_device(self):
        return 0

    def get_device_properties(self, d):
        if "props" in self.broken:
            raise RuntimeError("no properties")
        return SimpleNamespace(name="NVIDIA H100", total_memory=80 * GiB + d)

    def get_per_process_memory_fraction(self, d):
        return 1.0

    def memory_stats(self, d):
        self.asked.append(("memory_stats", d))
        if "stats" in self.broken:
            raise RuntimeError("CUDA error: driver shutting down")
        n = self.calls
        return {"allocated_bytes.all.peak": 30 * GiB + n + d, "reserved_bytes.all.peak": 32 * GiB + n,
                "active_bytes.all.peak": 31 * GiB, "allocated_bytes.all.current": 10 * GiB,
                "reserved_bytes.all.current": 12 * GiB, "num_alloc_retries": 3 + n, "num_ooms": 0,
                "num_device_alloc": 40, "num_device_free": 7, "inactive_split.all.peak": 5}

    def mem_get_info(self, d):
        self.asked.append(("mem_get_info", d))
        if "info" in self.broken:
            raise RuntimeError("cudaMemGetInfo failed")
        return 60 * GiB, 80 * GiB


def _recorder(tmp_path, snap, **kw) -> tuple[Recorder, CountingCuda]:
    cuda = CountingCuda(snap)
    rec = Recorder(str(tmp_path / "out"), on_oom=False, **kw)
    rec._torch = SimpleNamespace(cuda=cuda, __version__="2.11.0+cu130", version=SimpleNamespace(cuda="13.0"))
    rec.active = True
    rec.markers.append({"step": 0, "time_us": 0})
    return rec, cuda


def _snap(tmp_path, drop_first: int = 0) -> dict:
    b = SnapBuilder()
    s = b.segment(64 * MiB)
    for i in range(6):
        b.alloc(s, i * 4 * MiB, 4 * MiB)
    return pickle.loads(Path(b.write(tmp_path / "src.pickle", drop_first=drop_first)).read_bytes())


def test_every_dump_notes_the_counters_read_at_the_snapshot(tmp_path):
    snap = _snap(tmp_path)
    rec, cuda = _recorder(tmp_path, snap)
    rec._enable(clear=False)
    path = rec.dump_now("rank0_test.pickle", "test")
    meta = json.loads((tmp_path / "out" / "rank0_test.meta.json").read_text())
    [c] = meta["device_counters"]  # only device 0 holds anything
    assert c["device"] == 0 and set(COUNTER_KEYS) <= set(c)
    assert c["allocated_bytes.all.peak"] == 30 * GiB + 1  # read after the first (and only) _snapshot()
    assert c["num_alloc_retries"] == 4 and c["num_device_alloc"] == 40 and c["num_device_free"] == 7
    assert c["device_free_bytes"] == 60 * GiB and c["device_total_bytes"] == 80 * GiB
    assert c["gpu_total_memory_bytes"] == 80 * GiB and c["time_us"] > 0
    assert "inactive_split.all.peak" not in c  # only the counters named; the whole dict stays in memory_stats
    assert meta["memory_stats"]["inactive_split.all.peak"] == 5
    t = load(path)
    assert t.meta["device_counters"] == meta["device_counters"]


def test_counters_are_asked_only_of_devices_the_snapshot_holds():
    snap = {"segments": [{"device": 3}], "device_traces": [[{"action": "alloc"}], [], [{"action": "alloc"}]]}
    assert recorded_devices(snap, 1) == [0, 1, 2, 3]
    assert recorded_devices({"segments": [], "device_traces": []}, 0) == [0]
    assert recorded_devices(None, 2) == [2]
    cuda = CountingCuda({})
    out = device_counters(SimpleNamespace(cuda=cuda), [0, 2])
    assert [c["device"] for c in out] == [0, 2] and out[1]["allocated_bytes.all.peak"] == 30 * GiB + 2
    assert {d for _, d in cuda.asked} == {0, 2}


def test_a_counter_that_cannot_be_read_is_null_and_the_dump_goes_on(tmp_path, capsys):
    rec, cuda = _recorder(tmp_path, _snap(tmp_path))
    rec._enable(clear=False)
    cuda.broken = {"stats", "info", "props"}
    path = rec.dump_now("rank0.pickle", "final")
    assert path is not None and rec.failures == {}
    meta = json.loads((tmp_path / "out" / "rank0.meta.json").read_text())
    [c] = meta["device_counters"]
    assert all(c[k] is None for k in COUNTER_KEYS) and c["device_free_bytes"] is None
    assert c["gpu_total_memory_bytes"] is None
    assert load(path).meta["device_counters"] == [c]  # nulls load


def test_reading_the_device_list_failing_is_caught_once(tmp_path, capsys):
    rec, cuda = _recorder(tmp_path, _snap(tmp_path))
    rec._enable(clear=False)

    def broken():
        raise RuntimeError("no current device")

    assert rec._counters({"device_traces": []}) is not None
    cuda.current_device = broken
    assert rec._counters({"device_traces": []}) is None
    assert rec.failures == {"reading the allocator's counters": 1}
    assert "reading the allocator's counters failed" in capsys.readouterr().err


def test_old_sidecars_without_counters_still_load(tmp_path):
    b = SnapBuilder()
    s = b.segment(8 * MiB)
    b.alloc(s, 0, 2 * MiB)
    p = b.write(tmp_path / "rank0.pickle")
    (tmp_path / "rank0.meta.json").write_text(json.dumps({"format": "oomdoctor.sidecar/1", "rank": 0}))
    t = load(p)
    assert "device_counters" not in t.meta and t.rank == 0


def test_malformed_counters_are_dropped_with_a_warning(tmp_path):
    b = SnapBuilder()
    s = b.segment(8 * MiB)
    b.alloc(s, 0, 2 * MiB)
    p = b.write(tmp_path / "rank0.pickle")
    (tmp_path / "rank0.meta.json").write_text(json.dumps({"rank": 0, "device_counters": [{"device": 0,
                                                                                          "num_ooms": -1}]}))
    t = load(p)
    assert "device_counters" not in t.meta
    assert any("device_counters" in w for w in t.warnings)


def test_a_memory_stats_json_beside_a_snapshot_without_sidecar_is_read(tmp_path):
    b = SnapBuilder()
    s = b.segment(8 * MiB)
    b.alloc(s, 0, 2 * MiB)
    p = b.write(tmp_path / "snapshot_rank1.pickle")
    stats = {"allocated_bytes.all.peak": 6 * MiB, "reserved_bytes.all.peak": 8 * MiB, "num_alloc_retries": 2}
    (tmp_path / "memory_stats_rank1.json").write_text(json.dumps(stats))
    t = load(p)
    assert t.meta["memory_stats"] == stats and t.meta["memory_stats_file"].endswith("memory_stats_rank1.json")
    assert "sidecar" not in t.meta
    # the wrapped form, and the <stem>.memory_stats.json name, win over the rank's
    (tmp_path / "snapshot_rank1.memory_stats.json").write_text(json.dumps(
        {"memory_stats": {"num_ooms": 1}, "device": 0, "device_free_bytes": 5 * MiB, "other": "x"}))
    t = load(p)
    assert t.meta["memory_stats"] == {"num_ooms": 1} and t.meta["device_free_bytes"] == 5 * MiB
    assert "other" not in t.meta
    # a sidecar wins over both
    (tmp_path / "snapshot_rank1.meta.json").write_text(json.dumps({"rank": 1}))
    assert "memory_stats" not in load(p).meta
    # the directory's listing passes over them
    assert discover([tmp_path]) == [str(p)]
