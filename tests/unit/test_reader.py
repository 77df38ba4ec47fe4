"""Loading is safe and every bad input gets one clear error naming the file."""

import bz2
import gzip
import json
import lzma
import pickle

import pytest
import zstandard
from builder import MiB, SnapBuilder

from oomdoctor import SnapshotError, UnsafeSnapshotError, load


class Evil:
    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/oomdoctor-pwned",))


def small_snapshot() -> dict:
    b = SnapBuilder()
    s = b.segment(20 * MiB)
    a = b.alloc(s, 0, 4 * MiB)
    b.free(a)
    b.alloc(s, 0, 2 * MiB)
    return b.snapshot()


def test_malicious_pickle_is_refused_and_not_run(tmp_path):
    target = tmp_path / "evil.pickle"
    marker = "/tmp/oomdoctor-pwned"
    import os

    if os.path.exists(marker):
        os.remove(marker)
    target.write_bytes(pickle.dumps({"segments": [], "device_traces": [[Evil()]]}))
    with pytest.raises(UnsafeSnapshotError) as e:
        load(target)
    assert "evil.pickle" in str(e.value)
    assert "system" in e.value.global_name
    assert not os.path.exists(marker)


def test_any_global_is_refused(tmp_path):
    import collections

    p = tmp_path / "od.pickle"
    p.write_bytes(pickle.dumps(collections.OrderedDict(segments=[])))
    with pytest.raises(UnsafeSnapshotError, match="collections.OrderedDict"):
        load(p)


@pytest.mark.parametrize("content, problem", [
    (b"", "empty"),
    (b"\x80\x05\x95\x10\x00\x00\x00", "truncated"),
    (bytes(range(7, 200)), "neither a pickle nor JSON"),
    (b'{"hello": 1}', "no 'segments'"),
    (b"[1, 2", "does not parse"),
    (pickle.dumps(42), "not a memory snapshot"),
    (pickle.dumps({"segments": "x"}), "'segments' is a str"),
    (pickle.dumps({"segments": [{"address": 1}]}), "no 'total_size'"),
    (gzip.compress(b"\x80\x05 broken")[:-6], "gzip-compressed data is truncated"),
])
def test_bad_inputs_get_one_line_errors(tmp_path, content, problem):
    p = tmp_path / "bad.pickle"
    p.write_bytes(content)
    with pytest.raises(SnapshotError) as e:
        load(p)
    msg = str(e.value)
    assert msg.startswith(str(p))
    assert problem in msg
    assert "\n" not in msg


def test_missing_file(tmp_path):
    with pytest.raises(SnapshotError, match="no such file"):
        load(tmp_path / "nope.pickle")


@pytest.mark.parametrize("compress", [gzip.compress, lzma.compress, bz2.compress,
                                      lambda d: zstandard.ZstdCompressor().compress(d)])
def test_compression_is_detected_by_magic_not_name(tmp_path, compress):
    raw = pickle.dumps(small_snapshot())
    p = tmp_path / "rank0.pickle"  # no compression suffix on purpose
    p.write_bytes(compress(raw))
    t = load(p)
    assert t.primary.num_events == 5
    assert t.primary.final_reserved_bytes == 20 * MiB


def test_json_form_equals_pickle_form(tmp_path):
    snap = small_snapshot()
    pj, pp = tmp_path / "s.json", tmp_path / "s.pickle"
    pj.write_text(json.dumps(snap))
    pp.write_bytes(pickle.dumps(snap))
    a, b = load(pj), load(pp)
    for col in a.primary.events:
        assert (a.primary.events[col] == b.primary.events[col]).all(), col
    assert a.stacks.frames == b.stacks.frames
