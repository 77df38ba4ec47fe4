"""Tests written against surviving mutants of ``simulate/`` (issue 35 item 3): each asserts a fact of
PyTorch's allocator config (``c10/core/AllocatorConfig.cpp``) that a mutant changed and no test saw."""

import pytest

from oomdoctor.simulate.config import N_INTERVALS, ConfigError, parse_config


def test_divisions_greater_than_alone_fills_from_interval_1():
    # parseRoundUpPower2Divisions: last_index starts at 0, so ">:v" alone fills intervals 1..15 and
    # leaves interval 0 at 0 (kills config.x__parse_divisions__mutmut_29, last_index = 1).
    table = parse_config("roundup_power2_divisions:[>:4]").roundup_power2_divisions
    assert table == (0,) + (4,) * (N_INTERVALS - 1)


def test_backend_native_is_accepted():
    # "native" is a valid backend (kills config.x_parse_config__mutmut_163 and _164).
    assert parse_config("backend:native").backend == "native"
    assert parse_config("backend:cudaMallocAsync").backend == "cudaMallocAsync"


@pytest.mark.parametrize(("text", "message"), [
    # PyTorch's own words, which the tool repeats (the contract: a user greps them).
    ("max_split_size_mb:10", "CachingAllocator option max_split_size_mb too small, must be >= 20"),  # kills x_parse_config__mutmut_27 (">= 20.0")
    ("garbage_collection_threshold:1.5",
     "garbage_collect_threshold is invalid, set it in (0.0, 1.0)"),  # kills x_parse_config__mutmut_83
    ("roundup_power2_divisions:3", "For roundups, the divisions has to be power of 2 "),  # x__parse_divisions__mutmut_23
])
def test_pytorch_messages_exactly(text, message):
    with pytest.raises(ConfigError) as e:
        parse_config(text)
    # the whole line: "allocator config '<text>': <PyTorch's message>"
    assert str(e.value) == f"allocator config {text!r}: {message}"


def _fallback_rule(levels: list[int], request: int, **meta):
    """A FallbackRule over a device whose reserved bytes go through ``levels`` (bytes, from 0), then one
    allocation of ``request`` bytes (at event ``len(levels)``)."""
    from types import SimpleNamespace

    import numpy as np

    from oomdoctor.simulate.capacity import FallbackRule
    from oomdoctor.trace.model import ALLOC, SEGMENT_ALLOC, SEGMENT_FREE

    acts, sizes, cur = [], [], 0
    for level in levels:
        acts.append(SEGMENT_ALLOC if level > cur else SEGMENT_FREE)
        sizes.append(abs(level - cur))
        cur = level
    acts.append(ALLOC)
    sizes.append(request)
    dev = SimpleNamespace(events={"action": np.array(acts, dtype=np.int8), "size": np.array(sizes, dtype=np.int64)},
                          num_events=len(acts), final_reserved_bytes=cur)
    trace = SimpleNamespace(allocator_settings={}, meta=meta, stacks=SimpleNamespace(stacks=[], frames=[]))
    return FallbackRule(trace, dev)


G = 1 << 30


def test_fallback_rule_reaching_the_peak_exactly_is_no_failure():
    # alloc_block fails only when reserved + the segment would pass the cap, which is at least the recorded peak:
    # landing exactly on the peak fits (kills capacity.FallbackRule.__call__ mutant 12, '>' -> '>=').
    rule = _fallback_rule([10 * G, 8 * G], 2 * G)
    assert rule.peak == 10 * G and rule.reserved_before(2) == 8 * G and rule.segment_size(2) == 2 * G
    assert not rule(2, 2)
    assert rule(1, 2)  # 10 + 2 GiB would pass the peak


def test_fallback_rule_at_the_device_floor_is_no_fallback():
    # without a fraction, only frees within DEVICE_LIMIT_SHARE of the GPU can be a fallback: landing exactly on
    # that floor is still below it (kills capacity.FallbackRule.__call__ mutant 8, '<=' -> '<').
    total = 80 * G
    probe = _fallback_rule([G], G, memory_fraction=1.0, gpu_total_memory_bytes=total)
    floor = probe.device_floor
    assert floor is not None and floor % (2 << 20) == 0  # a multiple of the 2 MiB large-segment rounding
    # peak 1 GiB below the floor: from 2 GiB under the floor, a 2 GiB segment lands on it, above the peak
    rule = _fallback_rule([floor - G, floor - 2 * G], 2 * G, memory_fraction=1.0, gpu_total_memory_bytes=total)
    assert rule.reserved_before(2) + rule.segment_size(2) == floor and floor > rule.peak
    assert not rule(2, 2)
    over = _fallback_rule([floor - G, floor - 2 * G], 2 * G + (2 << 20), memory_fraction=1.0,
                          gpu_total_memory_bytes=total)
    assert over(2, 2)  # 2 MiB past the floor: the device's own limit may have been hit


def test_fallback_rule_reserved_before_the_first_event_is_the_start():
    # reserved_before(0) is the reserved bytes when the trace starts, not the last event's (kills
    # capacity.FallbackRule.reserved_before mutant 6, 'g0 > 0' -> 'g0 >= 0').
    rule = _fallback_rule([10 * G, 9 * G, 5 * G], 2 * G)
    assert rule.reserved_start == 0
    assert rule.reserved_before(0) == 0 and rule.reserved_before(1) == 10 * G and rule.reserved_before(3) == 5 * G


def test_private_pools_warning_says_which_pools_are_not_simulated():
    # the facts of each pool (id, segments, peak reserved bytes, events) and that they were replayed as recorded
    # (kills pools.PrivatePools.warning mutant 19, which changed that claim)
    import numpy as np

    from oomdoctor.simulate.pools import PoolSummary, PrivatePools

    one = PrivatePools(np.zeros(0, dtype=bool), pools={(1, 3): PoolSummary((1, 3), 2, 40 << 20, 7)})
    w = one.warning()
    assert w.startswith("CUDA-graph private pool (1, 3) (2 segments, up to 41943040 bytes reserved, 7 events) "
                        "replayed as recorded, not simulated")
    two = PrivatePools(np.zeros(0, dtype=bool), pools={(1, 3): PoolSummary((1, 3), 2, 40 << 20, 7),
                                                       (2, 5): PoolSummary((2, 5), 1, 2 << 20, 3)})
    assert two.warning().startswith("CUDA-graph private pools (1, 3) (2 segments, up to 41943040 bytes reserved, "
                                    "7 events), (2, 5) (1 segments, up to 2097152 bytes reserved, 3 events) "
                                    "replayed as recorded, not simulated")
