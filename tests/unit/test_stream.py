"""Streaming load (trace/stream.py): the same Trace as the in-memory path, on real snapshots drained every few
KiB, and the same refusals on bad input."""

from __future__ import annotations

import lzma
import os
import pickle

import numpy as np
import pytest

from oomdoctor.errors import SnapshotError, UnsafeSnapshotError
from oomdoctor.trace import load
from oomdoctor.trace import stream as st
from oomdoctor.trace.build import build_trace


def resolved(trace, sid: int) -> tuple:
    return tuple(trace.stacks.frames[f] for f in trace.stacks.stacks[sid]) if sid >= 0 else ()


def same_trace(a, b) -> None:
    """Equal up to the order stacks were interned in."""
    da, db = a.primary.events, b.primary.events
    for k in db:
        if k != "stack":
            assert np.array_equal(da[k], db[k]), k
    assert [resolved(a, s) for s in da["stack"].tolist()] == [resolved(b, s) for s in db["stack"].tolist()]
    seg = [[(s.address, s.total_size, s.pool_id, [(x.address, x.size, x.state, resolved(t, x.stack)) for x in s.blocks])
            for s in t.primary.segments] for t in (a, b)]
    assert seg[0] == seg[1]
    assert a.strings == b.strings and a.meta["trace_entry_keys"] == b.meta["trace_entry_keys"]


@pytest.mark.parametrize("name", ["fsdp2-gpt2/rank0.pickle", "tp-allreduce/legacy-rank0.pickle",
                                  "large/fsdp2-gpt2-60steps-rank0.pickle.xz"])
def test_streaming_gives_the_same_trace(snapshots, name):
    path = str(snapshots / name)
    obj, drained = st.load_streaming(path, every=64 << 10)
    streamed = build_trace(path, obj, drained)
    ref = load(path, sidecar=False)
    same_trace(streamed, ref)
    if name.startswith("large"):  # 271,109 entries taken out in many chunks while the file streamed in
        chunks = next(iter(drained.chunks.values()))
        assert len(chunks) > 100 and sum(len(c["action"]) for c in chunks) > 0.99 * ref.primary.num_events


def test_load_streams_large_framed_pickles_only(snapshots, tmp_path, monkeypatch):
    path = str(snapshots / "fsdp2-gpt2/rank0.pickle")
    assert not st.should_stream(path)  # 2 MB: the in-memory path
    monkeypatch.setattr(st, "STREAM_MIN_BYTES", 1 << 20)
    assert st.should_stream(path)
    old = tmp_path / "proto2.pickle"
    with open(path, "rb") as f:
        old.write_bytes(pickle.dumps(pickle.load(f), protocol=2))
    assert not st.should_stream(str(old))  # unframed: the unpickler would call read() per opcode
    assert not st.should_stream(str(tmp_path / "missing.pickle"))


def test_streaming_refuses_what_the_in_memory_path_refuses(snapshots, tmp_path):
    raw = (snapshots / "fsdp2-gpt2/rank0.pickle").read_bytes()
    cut = tmp_path / "cut.pickle"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(SnapshotError, match="truncated"):
        st.load_streaming(str(cut), every=4096)
    xz = tmp_path / "cut.pickle.xz"
    xz.write_bytes(lzma.compress(raw)[:-100])
    with pytest.raises(SnapshotError, match="cut.pickle.xz"):
        st.load_streaming(str(xz), every=4096)
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [], "device_traces": [[{"action": os.system}]]}, protocol=4))
    with pytest.raises(UnsafeSnapshotError):
        st.load_streaming(str(evil), every=16)
