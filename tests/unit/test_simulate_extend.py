"""``simulate/extend.extend_by_previous_step`` on device traces written event by event (issue 35 item 3): which
events of the previous step are appended, at which addresses and sizes, and every field of the Extension."""

import numpy as np

from oomdoctor.simulate.extend import FRESH, _growth, _keys, extend_by_previous_step
from oomdoctor.trace.model import ALLOC, EVENT_COLUMNS, FREE_COMPLETED, FREE_REQUESTED, OOM, DeviceTrace

A, R, C = ALLOC, FREE_REQUESTED, FREE_COMPLETED


def device(rows, annotations=("a1",)):
    """Events ``(action, addr, size, stack)``; time_us 10 per event; the other columns -1."""
    n = len(rows)
    ev = {name: np.full(n, -1, dtype=dt) for name, dt in EVENT_COLUMNS.items()}
    for k, (act, addr, size, stack) in enumerate(rows):
        ev["action"][k], ev["addr"][k], ev["size"][k], ev["stack"][k] = act, addr, size, stack
    ev["time_us"] = np.arange(n, dtype=np.int64) * 10
    ev["stream"] = np.zeros(n, dtype=np.int64)
    return DeviceTrace(0, ev, [], list(annotations))


# weights (stack 9), X (8) and Y (7) made before the previous step; the previous step [3, 17), the cut one from 17
ROWS = [
    (A, 0x100, 1, 9), (A, 0x200, 2, 8), (A, 0x300, 3, 7),
    (A, 0x1000, 10, 1),             # 3: key (1, 0), made before the matched point
    (A, 0x2000, 20, 2),             # 4: key (2, 0): matches the failed request
    (A, 0x3000, 30, 3),             # 5: made and freed after the matched point
    (R, 0x3000, 30, 3), (C, 0x3000, 30, 3),
    (R, 0x1000, 10, 1), (C, 0x1000, 10, 1),   # 8-9: freed: the cut step's block of key (1, 0)
    (R, 0x200, 2, 8), (C, 0x200, 2, 8),       # 10-11: X, made before: its address is live again at the OOM
    (R, 0x300, 3, 7),                         # 12: Y, freed (requested only) and not remade: dropped
    (A, 0x4000, 40, 4),             # 13: freed only at the cut step's first event: state kept past the step
    (R, 0x2000, 20, 2), (C, 0x2000, 20, 2),   # 14-15
    (A, 0x5000, 5, 6),              # 16: made and never freed: kept past the step
    (R, 0x4000, 40, 4),             # 17: the cut step starts with the free of 13
    (A, 0x6000, 10, 1),             # 18: key (1, 0) in the cut step
    (A, 0x200, 2, 8),               # 19: X again, at its old address
    (OOM, 0, 20, 2),                  # 20: the OOM: key (2, 0)
]


def test_extension_appends_the_rest_of_the_previous_step():
    dt = device(ROWS)
    ext = extend_by_previous_step(dt, np.array([3, 17]))
    assert (ext.first_appended, ext.appended, ext.previous_step, ext.oom_event, ext.scale, ext.scaled) == (
        20, 10, (3, 17), 20, 1.0, 0)
    ev = ext.device.events
    assert ext.device.num_events == 30 and ext.device.device == 0
    assert ext.device.annotations == ["a1"] and ext.device.segments == []
    tail = list(zip(ev["action"][20:].tolist(), ev["addr"][20:].tolist(), ev["size"][20:].tolist()))
    assert tail == [(A, 0x2000 + FRESH, 20), (A, 0x3000 + FRESH, 30), (R, 0x3000 + FRESH, 30), (C, 0x3000 + FRESH, 30),
                    (R, 0x6000, 10), (C, 0x6000, 10), (R, 0x200, 2), (C, 0x200, 2),
                    (R, 0x2000 + FRESH, 20), (C, 0x2000 + FRESH, 20)]
    # the recorded events up to the OOM, unchanged; the appended ones shifted in time by oom - matched (200 - 40 us)
    for name in ev:
        assert np.array_equal(ev[name][:20], dt.events[name][:20]), name
        assert ev[name].dtype == dt.events[name].dtype, name
    assert ev["time_us"][20:].tolist() == [t * 10 + 160 for t in (4, 5, 6, 7, 8, 9, 10, 11, 14, 15)]
    assert ev["stack"][20:].tolist() == [2, 3, 3, 3, 1, 1, 8, 8, 2, 2]
    assert ev["time_us"].dtype == np.int64 and ev["addr"].dtype == np.int64


def test_extension_scales_the_appended_blocks_by_the_steps_growth():
    rows = list(ROWS)
    rows[18] = (A, 0x6000, 25, 1)  # key (1, 0) grew 2.5x: the only match, so the median
    ext = extend_by_previous_step(device(rows), np.array([3, 17]))
    assert (ext.scale, ext.scaled, ext.appended) == (2.5, 2, 10)
    tail = list(zip(ext.device.events["addr"][20:].tolist(), ext.device.events["size"][20:].tolist()))
    # allocations ceil(size x 2.5), their frees the same; frees sent to recorded blocks keep their sizes
    assert tail == [(0x2000 + FRESH, 50), (0x3000 + FRESH, 75), (0x3000 + FRESH, 75), (0x3000 + FRESH, 75),
                    (0x6000, 10), (0x6000, 10), (0x200, 2), (0x200, 2), (0x2000 + FRESH, 50), (0x2000 + FRESH, 50)]
    rows[18] = (A, 0x6000, 7, 1)  # shrank: no scaling down
    ext = extend_by_previous_step(device(rows), np.array([3, 17]))
    assert (ext.scale, ext.scaled) == (1.0, 0) and ext.device.events["size"][20] == 20


def test_extension_drops_frees_of_blocks_already_gone():
    rows = list(ROWS)
    rows[19] = (A, 0x7000, 2, 8)  # X not remade at its address: its recorded free has nothing to free
    rows.insert(19, (R, 0x6000, 10, 1))  # the cut step's (1, 0) block freed before the OOM
    ext = extend_by_previous_step(device(rows), np.array([3, 17]))
    assert ext.oom_event == ext.first_appended == 21
    tail = list(zip(ext.device.events["action"][21:].tolist(), ext.device.events["addr"][21:].tolist()))
    assert tail == [(A, 0x2000 + FRESH), (A, 0x3000 + FRESH), (R, 0x3000 + FRESH), (C, 0x3000 + FRESH),
                    (R, 0x2000 + FRESH), (C, 0x2000 + FRESH)]


def test_a_requested_free_ends_a_block_before_its_completion():
    # Y's free was requested (12) and never completed: Y is gone at the OOM even if made again elsewhere
    rows = list(ROWS)
    rows[19] = (A, 0x300 + 0x10000, 2, 8)
    ext = extend_by_previous_step(device(rows), np.array([3, 17]))
    assert 0x300 not in ext.device.events["addr"][20:].tolist()


def test_no_extension_without_an_oom_a_previous_step_or_a_match():
    dt = device(ROWS)
    assert extend_by_previous_step(device(ROWS[:20]), np.array([3, 17])) is None  # no OOM
    assert extend_by_previous_step(dt, np.array([17])) is None  # the OOM's step is the first
    assert extend_by_previous_step(dt, np.array([25])) is None  # the OOM before any step
    assert extend_by_previous_step(dt, np.array([17, 17])) is None  # an empty previous step
    rows = list(ROWS)
    rows[20] = (OOM, 0, 20, 5)  # a stack the previous step never allocated from
    assert extend_by_previous_step(device(rows), np.array([3, 17])) is None
    rows[20] = (OOM, 0, 20, 6)  # matches 16, kept past its step: nothing after it to append
    assert extend_by_previous_step(device(rows[:16] + [(A, 0x5000, 5, 6)] + rows[17:]), np.array([3, 16])) is None


def test_the_last_oom_and_the_step_holding_it():
    rows = list(ROWS) + [(A, 0x8000, 1, 5)]
    rows.insert(19, (OOM, 0, 99, 5))  # an earlier OOM of a stack with no match: the last one decides
    ext = extend_by_previous_step(device(rows), np.array([0, 3, 17]))
    assert (ext.oom_event, ext.previous_step) == (21, (3, 17))
    assert ext.device.num_events == 21 + ext.appended


def test_keys_rank_each_stacks_allocations():
    action = np.array([A, A, R, A, C, A, A], dtype=np.int8)
    stack = np.array([5, 5, 5, 6, 5, 5, 6], dtype=np.int32)
    assert _keys(action, stack, 0, 7) == {0: (5, 0), 1: (5, 1), 3: (6, 0), 5: (5, 2), 6: (6, 1)}
    assert _keys(action, stack, 1, 6) == {1: (5, 0), 3: (6, 0), 5: (5, 1)}
    assert _keys(action, stack, 2, 3) == {}


def test_growth_is_the_lower_median_ratio_at_least_one():
    size = np.array([10, 20, 30, 40, 0, 25, 60, 90, 200, 7], dtype=np.int64)
    by_key = {("a", 0): 0, ("b", 0): 1, ("c", 0): 2, ("d", 0): 3, ("z", 0): 4}
    # ratios 2.5, 3, 3, 5: the lower median is 3
    assert _growth(size, {5: ("a", 0), 6: ("b", 0), 7: ("c", 0), 8: ("d", 0), 9: ("q", 0)}, by_key) == 3.0
    assert _growth(size, {5: ("a", 0), 6: ("b", 0)}, by_key) == 2.5  # two: the lower one
    assert _growth(size, {9: ("a", 0)}, by_key) == 1.0  # shrank: at least 1
    assert _growth(size, {9: ("z", 0)}, by_key) == 1.0  # a zero-byte previous one is no ratio
    assert _growth(size, {}, by_key) == 1.0


def test_a_block_of_the_previous_step_ends_at_its_free_request():
    # 5's free completes only in the cut step (a deferred free): its request, in the previous step, ended it there,
    # so it is no state kept past the step and is appended with its request
    rows = list(ROWS)
    done = rows.pop(7)
    assert done == (C, 0x3000, 30, 3)
    rows.insert(17, done)  # after the cut step's first event (now 16)
    ext = extend_by_previous_step(device(rows), np.array([3, 16]))
    tail = list(zip(ext.device.events["action"][20:].tolist(), ext.device.events["addr"][20:].tolist()))
    assert tail == [(A, 0x2000 + FRESH), (A, 0x3000 + FRESH), (R, 0x3000 + FRESH), (R, 0x6000), (C, 0x6000),
                    (R, 0x200), (C, 0x200), (R, 0x2000 + FRESH), (C, 0x2000 + FRESH)]
