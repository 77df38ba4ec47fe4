"""``simulate/pools.private_pools`` on small traces built in code (issue 35 item 3): which events belong to a
private pool by each of its three rules, the pool summaries, and a replay that counts those segments as recorded."""

import pickle

import numpy as np
from builder import SnapBuilder

from oomdoctor.analysis.fragmentation import live_segments
from oomdoctor.simulate.pools import PoolSummary, private_pools
from oomdoctor.simulate.replay import prepare, replay
from oomdoctor.trace.load import load

MiB = 1 << 20
GRAPH = (1, 3)


def write(tmp_path, b, pools=None, event_pools=None):
    """The builder's snapshot with ``pools`` (segment address -> pool id) set on its final segments and, when
    given, ``event_pools`` (one pool id per event) recorded as each entry's ``pool_id`` (PyTorch >= 2.13)."""
    snap = b.snapshot()
    for s in snap["segments"]:
        s["segment_pool_id"] = (pools or {}).get(s["address"], (0, 0))
    if event_pools is not None:
        for e, p in zip(snap["device_traces"][0], event_pools):
            e["pool_id"] = p
    path = tmp_path / "pools.pickle"
    path.write_bytes(pickle.dumps(snap))
    return load(path)


def classify(t):
    dt = t.primary
    return private_pools(t, dt, live_segments(dt, -1))


def graph_trace(tmp_path, **kw):
    """e0 a default 20 MiB segment (stream 0), e1 a block in it; e2 a 20 MiB segment on the capture stream 7, alive
    at the end in pool (1, 3), e3 a block at its start; e4 a second segment on stream 7, e5-e7 a block in it made
    and freed, e8 that segment freed; e9 a block in the default segment."""
    b = SnapBuilder()
    d = b.segment(20 * MiB)
    b.alloc(d, 0, 4 * MiB)
    g1 = b.segment(20 * MiB, stream=7)
    b.alloc(g1, 0, 2 * MiB)
    g2 = b.segment(20 * MiB, stream=7)
    b.free(b.alloc(g2, 0, 6 * MiB))
    b.free_segment(g2)
    b.alloc(d, 4 * MiB, 4 * MiB)
    return write(tmp_path, b, {g1: GRAPH}, **kw), (d, g1, g2)


def test_private_pool_by_the_final_segments_and_their_stream(tmp_path):
    t, _ = graph_trace(tmp_path)
    pp = classify(t)
    assert pp.private.tolist() == [False, False, True, True, True, True, True, True, True, False]
    # segments: g1 and g2; at most 40 MiB at once; events: 3 segment entries + 1 block in g1 + 3 in g2
    assert pp.pools == {GRAPH: PoolSummary(GRAPH, 2, 40 * MiB, 7)}
    assert pp.start_segments == set() and pp.private.dtype == bool


def test_no_private_pool_is_none(tmp_path):
    b = SnapBuilder()
    b.free(b.alloc(b.segment(20 * MiB), 0, 4 * MiB))
    assert classify(write(tmp_path, b)) is None
    # recorded pool ids, all default, on a trace whose segments are all freed: still none
    b = SnapBuilder()
    s = b.segment(20 * MiB)
    b.free(b.alloc(s, 0, 4 * MiB))
    b.free_segment(s)
    assert classify(write(tmp_path, b, event_pools=[(0, 0)] * 4)) is None


def test_recorded_pool_ids_decide_first(tmp_path):
    # the capture stream's freed segment recorded in pool (2, 5), though the final segments on stream 7 are (1, 3)
    ids = [(0, 0), (0, 0), GRAPH, GRAPH, (2, 5), (2, 5), (2, 5), (2, 5), (2, 5), (0, 0)]
    t, _ = graph_trace(tmp_path, event_pools=ids)
    pp = classify(t)
    assert pp.private.tolist() == [False, False, True, True, True, True, True, True, True, False]
    assert pp.pools == {GRAPH: PoolSummary(GRAPH, 1, 20 * MiB, 2), (2, 5): PoolSummary((2, 5), 1, 20 * MiB, 5)}


def test_a_stream_of_several_pools_takes_its_most_common(tmp_path):
    # stream 7 holds two final segments of (1, 3) and one of (4, 4): a segment freed there belongs to (1, 3)
    b = SnapBuilder()
    a1, a2, a3 = (b.segment(2 * MiB, stream=7) for _ in range(3))
    g = b.segment(20 * MiB, stream=7)
    b.free_segment(g)
    t = write(tmp_path, b, {a1: (4, 4), a2: GRAPH, a3: GRAPH})
    pp = classify(t)
    assert pp.private.tolist() == [True] * 5
    assert pp.pools[GRAPH] == PoolSummary(GRAPH, 3, 24 * MiB, 4) and pp.pools[(4, 4)] == PoolSummary((4, 4), 1,
                                                                                                       2 * MiB, 1)


def test_segments_of_a_private_pool_alive_at_the_start(tmp_path):
    b = SnapBuilder()
    g = b.segment(20 * MiB, stream=7, record=False)  # made before the trace
    b.alloc(g, 0, 2 * MiB)
    b.alloc(b.segment(20 * MiB), 0, 2 * MiB)
    t = write(tmp_path, b, {g: GRAPH})
    pp = classify(t)
    assert pp.start_segments == {g}
    assert pp.private.tolist() == [True, False, False]
    assert pp.pools == {GRAPH: PoolSummary(GRAPH, 1, 20 * MiB, 1)}  # no segment entry; its one block event


def test_a_replay_counts_private_segments_as_recorded(tmp_path):
    t, (d, g1, g2) = graph_trace(tmp_path)
    p = prepare(t)
    assert p.external == [(2, 20 * MiB), (4, 20 * MiB), (8, -20 * MiB)]
    r = replay(p)
    assert r.matches_recorded is True and r.validation.reserved_events_differing == 0
    assert (r.peak_reserved_bytes, r.end_reserved_bytes) == (60 * MiB, 40 * MiB)
    assert r.model.external_reserved == 20 * MiB and r.model.reserved == 40 * MiB
    assert any("private pool" in w for w in p.warnings)
    # the default pool alone is simulated: its segment events are the model's
    assert [e[1] for e in r.model.segment_events] == [d]
    assert np.count_nonzero(~classify(t).private) == 3
