"""Every snapshot shape of PyTorch 2.x becomes the same Trace."""

import pickle

import pytest
from builder import Job, MiB, SnapBuilder, frames

from oomdoctor import SnapshotError, load
from oomdoctor.trace.model import ACTION_CODES


def write(tmp_path, obj, name="rank0.pickle"):
    p = tmp_path / name
    p.write_bytes(pickle.dumps(obj))
    return p


def test_columns_and_interned_stacks(tmp_path):
    b = SnapBuilder()
    s = b.segment(20 * MiB)
    a1 = b.alloc(s, 0, 2 * MiB)
    a2 = b.alloc(s, 2 * MiB, 2 * MiB)
    b.free(a1)
    b.free(a2)
    t = load(b.write(tmp_path / "x.pickle"))
    dt = t.primary
    assert dt.num_events == 7
    assert [int(x) for x in dt.action] == [ACTION_CODES[n] for n in (
        "segment_alloc", "alloc", "alloc", "free_requested", "free_completed", "free_requested", "free_completed")]
    assert int(dt.size[1]) == 2 * MiB
    assert len(t.stacks.stacks) == 1 and len(t.stacks.frames) == 1  # one distinct stack, stored once
    assert set(dt.stack.tolist()) == {0}


def test_unknown_actions_are_skipped_with_a_warning(tmp_path):
    b = SnapBuilder()
    s = b.segment(20 * MiB)
    b.alloc(s, 0, MiB)
    snap = b.snapshot()
    snap["device_traces"][0].insert(1, {"action": "teleport", "addr": 0, "size": 0, "stream": 0})
    t = load(write(tmp_path, snap))
    assert t.primary.num_events == 2
    assert any("teleport" in w for w in t.warnings)


def test_state_only_snapshot_has_no_history(tmp_path):
    b = SnapBuilder()
    s = b.segment(20 * MiB, record=False)
    b.alloc(s, 0, MiB, record=False)
    snap = b.snapshot()
    snap["device_traces"] = [[]]
    t = load(write(tmp_path, snap))
    assert not t.has_history
    assert t.primary.final_reserved_bytes == 20 * MiB
    assert any("no allocation history" in w for w in t.warnings)


def test_older_list_of_segments_form(tmp_path):
    b = SnapBuilder()
    s = b.segment(20 * MiB)
    b.alloc(s, 0, MiB)
    segs = b.snapshot()["segments"]
    t = load(write(tmp_path, segs))
    assert not t.has_history
    assert t.meta["format"] == "memory_snapshot_list"
    assert t.primary.segments[0].blocks[0].is_allocated


def test_pre_2_1_blocks_with_history(tmp_path):
    seg = {"device": 0, "address": 4096, "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
           "blocks": [{"size": MiB, "state": "active_allocated",
                       "history": [{"real_size": 1000, "frames": [{"filename": "a.py", "line": 3, "name": "f"}]}]},
                      {"size": MiB, "state": "inactive", "history": []}]}
    t = load(write(tmp_path, {"segments": [seg], "device_traces": [[]]}))
    blk = t.primary.segments[0].blocks[0]
    assert blk.requested_size == 1000
    assert t.stacks.stack_frames(blk.stack) == [("a.py", 3, "f")]
    assert t.primary.segments[0].blocks[1].address == 4096 + MiB


def test_oom_entry_and_several_devices(tmp_path):
    b = SnapBuilder()
    s = b.segment(20 * MiB)
    b.alloc(s, 0, MiB)
    b.oom(64 * MiB, device_free=123)
    snap = b.snapshot()
    for seg in snap["segments"]:
        seg["device"] = 1
    snap["device_traces"] = [[], snap["device_traces"][0]]
    t = load(write(tmp_path, snap))
    assert list(t.devices) == [1]
    dt = t.primary
    assert int(dt.action[-1]) == ACTION_CODES["oom"]
    assert int(dt.device_free[-1]) == 123 and int(dt.device_free[0]) == -1


def test_awaiting_free_spelling_is_pending(tmp_path):
    b = SnapBuilder()
    s = b.segment(20 * MiB)
    a = b.alloc(s, 0, MiB)
    b.free(a, deferred=True)
    snap = b.snapshot()
    snap["segments"][0]["blocks"][0]["state"] = "active_awaiting_free"
    t = load(write(tmp_path, snap))
    assert t.primary.segments[0].blocks[0].is_pending_free


@pytest.mark.parametrize("mutate, problem", [
    (lambda s: s["device_traces"][0][0].update(size="big"), "expected an integer"),
    (lambda s: s["device_traces"][0].append(7), "expected a dict"),
    (lambda s: s["device_traces"][0][0].pop("action"), "has no 'action'"),
    (lambda s: s["segments"][0]["blocks"][0].update(state="weird"), "unknown 'weird'"),
    # a block, segment or allocation of 2**48 bytes or more (a block size past the address space was a KeyError
    # in the allocator model's get_free_block), or an address past 63 bits, is refused before the replay
    (lambda s: s["device_traces"][0][1].update(size=2**48), r"device_traces\[0\]\[1\].size is 281474976710656"),
    (lambda s: s["device_traces"][0][0].update(size=2**62), r"device_traces\[0\]\[0\].size is 4611686018427387904"),
    (lambda s: s["segments"][0].update(total_size=2**48), "total_size 281474976710656 out of range"),
    (lambda s: s["segments"][0]["blocks"][0].update(size=2**48), r"blocks\[0\].size is 281474976710656"),
    (lambda s: s["segments"][0]["blocks"][0].update(requested_size=2**48), r"requested_size is 281474976710656"),
    (lambda s: s["segments"][0].update(address=2**63), "address 9223372036854775808"),
])
def test_wrong_field_types_are_named(tmp_path, mutate, problem):
    b = SnapBuilder()
    s = b.segment(20 * MiB)
    b.alloc(s, 0, MiB)
    snap = b.snapshot()
    mutate(snap)
    with pytest.raises(SnapshotError, match=problem):
        load(write(tmp_path, snap))


def test_malformed_frames_are_shown_as_unknown_and_counted(tmp_path):
    """A frame or stack of the wrong shape holds no bytes: the snapshot loads, the stack shows '??', and a
    warning counts them (an infinite line number was an OverflowError traceback in trace/build.py _int)."""
    b = SnapBuilder()
    s = b.segment(20 * MiB)
    for k in range(4):
        b.alloc(s, k * MiB, MiB)
    snap = b.snapshot()
    entries = snap["device_traces"][0]
    entries[1]["frames"] = [{"filename": "a.py", "line": float("inf"), "name": "f"}]
    entries[2]["frames"] = [7, {"filename": "b.py", "line": 3, "name": "g"}]
    entries[3]["frames"] = 5
    t = load(write(tmp_path, snap))
    dt = t.primary
    assert t.stacks.stack_frames(int(dt.stack[1])) == [("a.py", 0, "f")]
    assert t.stacks.stack_frames(int(dt.stack[2])) == [("??", 0, "??"), ("b.py", 3, "g")]
    assert int(dt.stack[3]) == -1
    assert any("2 malformed stack frames or stacks" in w for w in t.warnings)
    assert int(dt.size[1:5].sum()) == 4 * MiB  # the bytes are the recorded ones


def test_malformed_annotations_are_skipped_and_counted(tmp_path):
    """Each field of an ``external_annotations`` record is checked: a device that is a dict (a TypeError
    traceback in trace/build.py) or a bool, a time past a C long (an OverflowError in
    detectors/deferred_free.py), a stage or name of the wrong type. They are skipped and counted; the good
    ones are kept in order."""
    b = SnapBuilder()
    s = b.segment(20 * MiB)
    b.annotate("nccl:all_reduce", "START")
    x = b.alloc(s, 0, MiB)
    b.annotate("nccl:all_reduce", "END")
    b.free(x)
    snap = b.snapshot()
    good = list(snap["external_annotations"])
    snap["external_annotations"] += [
        {"device": {}, "stage": "START", "name": "nccl:x", "time_us": 1},
        {"device": True, "stage": "START", "name": "nccl:x", "time_us": 1},
        {"device": 0, "stage": "START", "name": "nccl:x", "time_us": 2**70},
        {"device": 0, "stage": "START", "name": "nccl:x", "time_us": 1.5},
        {"device": 0, "stage": b"START", "name": "nccl:x", "time_us": 1},
        {"device": 0, "stage": "END", "name": 5, "time_us": 1},
        {"device": 3, "stage": "END", "name": "nccl:x", "time_us": 1},  # no such device
        7,
    ]
    t = load(write(tmp_path, snap))
    assert [(a.name, a.stage, a.time_us) for a in t.primary.annotations] == [
        (g["name"], g["stage"], g["time_us"]) for g in good]
    assert any(w.startswith("8 malformed external annotations were skipped") for w in t.warnings), t.warnings
    snap["external_annotations"] = {"device": 0}
    t = load(write(tmp_path, snap))
    assert t.primary.annotations == [] and any("'external_annotations' is a dict" in w for w in t.warnings)


def test_an_oom_request_of_any_size_is_read_and_replayed_as_an_oom(tmp_path):
    """An ``oom`` entry records a request that failed; it may be far larger than any GPU (a wrong shape),
    so its size is not capped, and the replay ends in the same OOM instead of running out of addresses."""
    from oomdoctor.simulate.whatif import simulate
    b = SnapBuilder()
    s = b.segment(20 * MiB)
    b.alloc(s, 0, MiB)
    b.oom(2**62, device_free=MiB)
    t = load(b.write(tmp_path / "x.pickle"))
    assert int(t.primary.size[-1]) == 2**62
    r = simulate(t).self_replay
    assert r.oom is not None and r.oom.requested_bytes == 2**62 and r.oom.event_index == 2


def _tuple_key_first_of(frame_lists):
    """The reference grouping: one key tuple of identities per list, each mapped to its first index."""
    keys: dict = {}
    return [keys.setdefault(tuple(map(id, f)), i) for i, f in enumerate(frame_lists)]


def test_stack_grouping_in_numpy_matches_one_key_per_entry():
    """`_first_of_identical` groups frames lists exactly as the key tuples do: same objects in the same order,
    by identity (equal-looking frames that are distinct objects are distinct), on shared and unshared lists."""
    import random

    import numpy as np

    from oomdoctor.trace.build import _first_of_identical

    rng = random.Random(7)
    frames = [{"filename": f"f{i % 5}.py", "line": i % 3, "name": "g"} for i in range(40)]  # look-alikes too
    shared = [[rng.choice(frames) for _ in range(rng.randint(0, 6))] for _ in range(50)]
    lists = []
    for _ in range(3000):
        r = rng.random()
        lists.append(rng.choice(shared) if r < 0.4 else list(rng.choice(shared)) if r < 0.8
                     else [rng.choice(frames) for _ in range(rng.randint(0, 9))])
    got = _first_of_identical(lists)
    assert got is not None and got.tolist() == _tuple_key_first_of(lists)
    # two lists that differ only in order, or in one look-alike object, are not grouped
    a, b = frames[0], dict(frames[0])
    assert _first_of_identical([[a, frames[1]], [frames[1], a], [b, frames[1]], [a, frames[1]]]).tolist() == \
        [0, 1, 2, 0]
    assert _first_of_identical([]).tolist() == [] and _first_of_identical([[], ()]).tolist() == [0, 0]
    with pytest.raises(TypeError):
        _first_of_identical([[a], None])
    assert isinstance(got, np.ndarray)


def test_list_addresses_are_the_ids_of_the_items():
    """`_list_addresses` reads a list's item pointers: the items' `id`s in order; nothing for another type."""
    from oomdoctor.trace.build import _list_addresses

    items = [{"a": 1}, "x", 3.5, None, {"a": 1}]
    items = items + items[:2]
    assert _list_addresses(items).tolist() == [id(x) for x in items]
    assert _list_addresses([]).tolist() == []
    assert _list_addresses(tuple(items)) is None and _list_addresses(iter(items)) is None


def test_stack_column_is_the_same_when_keyed_one_by_one(tmp_path, monkeypatch):
    """Where the NumPy grouping cannot be used (a hash collision, another interpreter), the entries are keyed
    one by one, with the same stack ids."""
    import numpy as np

    from oomdoctor.trace import build

    job = Job()
    specs = [[("a.py", i % 4, "f"), ("b.py", 1, "g")][: 1 + i % 2] for i in range(30)]
    for spec in specs:
        job.alloc(MiB, fr=frames(*spec))  # new dicts each time: equal stacks, distinct objects
    path = job.b.write(tmp_path / "s.pickle")
    t = load(str(path))
    fast = t.primary.events["stack"].copy()
    assert [t.stacks.stack_frames(int(s)) for s in fast[1:]] == specs  # after the segment_alloc
    monkeypatch.setattr(build, "_first_of_identical", lambda frame_lists: None)
    slow = load(str(path)).primary.events["stack"]
    assert np.array_equal(fast, slow)


@pytest.mark.parametrize("raw", [
    [{"device": d, "stage": s, "name": f"n{i % 3}", "time_us": 10 * i} for i, (d, s) in
     enumerate([(0, "START"), (1, "START"), (0, "END"), (1, "END"), (0, "START")])],
    [{"device": 0, "stage": "START", "time_us": 5}, {"device": 0, "stage": "END", "name": "x", "time_us": -(1 << 63)}],
    [{"device": 0, "stage": "START", "name": ["x"], "time_us": 1}, {"device": True, "stage": "END", "time_us": 2}],
    [{"device": 0, "stage": "STOP", "name": "x", "time_us": 1 << 63}, "not a dict"],
    [],
])
def test_annotations_read_in_c_passes_as_one_by_one(raw, monkeypatch):
    """The C-pass reading of ``external_annotations`` appends what the per-record loop appends, in the same order,
    and leaves the malformed cases to it (the same records kept, the same warning)."""
    from oomdoctor.trace import build

    def read(alike: bool):
        devices: dict[int, list] = {d: [] for d in (0, 1)}
        warnings: list[str] = []
        if not alike:
            monkeypatch.setattr(build, "_annotations_alike", lambda raw, devices: False)
        build._annotations(raw, devices, warnings)
        monkeypatch.undo()
        return devices, warnings

    assert read(True) == read(False)


def test_replay_only_keeps_what_the_replay_reads(tmp_path):
    """``load(..., replay_only=True)`` (``oomdoctor simulate``): the stacks of segment entries (an empty_cache()
    frame tells a user's release from a fallback), -1 for every other entry's stack and the metadata columns, no
    annotations; every other column as a full load has it, and the replay the same."""
    from oomdoctor.simulate.capacity import infer_capacity
    from oomdoctor.simulate.replay import prepare, replay
    from oomdoctor.simulate.whatif import settle_capacity

    empty_cache = frames(("/usr/lib/python3/site-packages/torch/cuda/memory.py", 222, "empty_cache"),
                         ("/work/train.py", 50, "step"))
    b = SnapBuilder()
    s1 = b.segment(20 * MiB)
    keep = b.alloc(s1, 0, 4 * MiB, fr=frames(("/work/model.py", 3, "forward")))
    s2 = b.segment(40 * MiB)
    t = b.alloc(s2, 0, 40 * MiB)
    b.annotate("ProfilerStep#1", "START")
    b.free(t)
    b.free_segment(s2, fr=empty_cache)
    b.alloc(s1, 4 * MiB, 4 * MiB)
    b.free(keep)
    path = b.write(tmp_path / "ec.pickle")
    snap = pickle.loads(path.read_bytes())
    snap["device_traces"][0][1]["user_metadata"] = "tag"
    path.write_bytes(pickle.dumps(snap))
    full, lean = load(path), load(path, replay_only=True)
    fd, ld = full.primary, lean.primary
    seg_codes = (ACTION_CODES["segment_alloc"], ACTION_CODES["segment_free"])
    seg = [i for i, a in enumerate(fd.action.tolist()) if a in seg_codes]
    assert seg == [0, 2, 6]
    assert ([lean.stacks.stack_frames(int(ld.stack[i])) for i in seg]
            == [full.stacks.stack_frames(int(fd.stack[i])) for i in seg])
    assert lean.stacks.stack_frames(int(ld.stack[6]))[0][2] == "empty_cache"
    assert all(int(ld.stack[i]) == -1 for i in range(fd.num_events) if i not in seg)
    assert int(fd.events["user_metadata"][1]) >= 0 and set(ld.events["user_metadata"].tolist()) == {-1}
    assert set(ld.events["compile_context"].tolist()) == {-1}
    assert fd.annotations and not ld.annotations
    assert lean.meta["columns"] == "replay" and "columns" not in full.meta
    for k in ("action", "addr", "size", "stream", "time_us", "device_free", "pool"):
        assert fd.events[k].tolist() == ld.events[k].tolist(), k
    results = []
    for tr in (full, lean):
        p = prepare(tr)
        cap = settle_capacity(p, infer_capacity(tr, p.device))
        r = replay(p, capacity=cap)
        results.append((cap, r.peak_reserved_bytes, r.end_reserved_bytes, r.matches_recorded, r.model.segment_events))
    assert results[0] == results[1] and results[1][3] is True


def test_present_in_all_is_the_keys_no_entry_lacks():
    """``_present_in_all`` (the ``replay_only`` load's proof that the keys it does not read are in every entry):
    one pass for all keys, and the per-key answer where an entry lacks one."""
    from oomdoctor.trace.build import _present_in_all

    entries = [{"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 2, "c": 3}, {"a": 1, "c": 3, "d": 4}]
    assert _present_in_all(entries, ["a", "c"]) == {"a", "c"}
    assert _present_in_all(entries, ["a", "b", "c"]) == {"a", "c"}
    assert _present_in_all(entries, ["b"]) == set()
    assert _present_in_all(entries, []) == set()


def test_replay_only_reads_device_free_where_an_entry_trades_a_key_for_it(tmp_path):
    """An entry with as many keys as the first that lacks ``frames`` but has ``device_free``: the ``replay_only``
    load must not take ``device_free`` for absent from all (its entries are alike by count, not by keys)."""
    b = SnapBuilder()
    s1 = b.segment(20 * MiB)
    t = b.alloc(s1, 0, 4 * MiB)
    b.free(t)
    path = b.write(tmp_path / "trade.pickle")
    snap = pickle.loads(path.read_bytes())
    e = snap["device_traces"][0][1]
    del e["frames"]
    e["device_free"] = 12345
    path.write_bytes(pickle.dumps(snap))
    full, lean = load(path), load(path, replay_only=True)
    assert full.primary.events["device_free"].tolist()[1] == 12345
    assert lean.primary.events["device_free"].tolist() == full.primary.events["device_free"].tolist()


def test_interned_labels_do_not_depend_on_the_hash_seed():
    """An entry field of labels (``user_metadata``, ``compile_context``, pool ids) is interned in the order its
    values first appear: a set's order follows the process's string hash seed, so the ids (and anything ordered by
    them) differed from one run to the next."""
    import os
    import subprocess
    import sys

    code = ("from oomdoctor.trace.build import _table_col\n"
            "table = {}\n"
            "vals = ['fwd', 'bwd', 'opt', 'fwd', 'eval', 'load', 'bwd', 'step', 'log']\n"
            "print(_table_col(vals, lambda v: table.setdefault(v, len(table)), lambda v: v is None).tolist())\n")
    got = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout
           for seed in range(6)}
    assert got == {"[0, 1, 2, 0, 3, 4, 1, 5, 6]\n"}
