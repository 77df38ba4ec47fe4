"""The words of a capacity's and a room's source (``render/words/capacity.py``): every id of
``simulate/capacity.py`` ``SOURCES`` and ``report/fits.py`` ``ROOM_SOURCES`` is said, with its numbers, raw in the
JSON and in binary units on the terminal; an unknown id is an error, never a guess."""

from __future__ import annotations

import pytest

from oomdoctor.ids import ROOM_SOURCES
from oomdoctor.render.format import format_bytes
from oomdoctor.render.words import capacity as W
from oomdoctor.simulate.capacity import SOURCES, Capacity

GiB = 1 << 30
VALUES = {
    "sidecar-memory-cap": {},
    "sidecar-memory-fraction": {"fraction": 0.5, "gpu_total_memory_bytes": 80 * GiB},
    "oom-device": {"event": 12, "device_free_bytes": GiB, "reserved_bytes": 70 * GiB},
    "oom-fraction-cap": {"event": 12, "device_free_bytes": 9 * GiB},
    "fallbacks": {"runs": 3},
    "fallbacks-disagree": {"runs": 2, "upper_bytes": 10 * GiB, "peak_reserved_bytes": 11 * GiB},
    "fallbacks-unreproduced": {"runs": 4},
    "no-evidence": {},
    "unlimited": {},
    "given": {"kind": "device"},
    "device-room": {"room_source": "oom-device"},
}


def test_every_capacity_source_is_said():
    assert set(VALUES) == set(SOURCES)
    said = {s: W.capacity_source(s, v, 20 * GiB, 21 * GiB) for s, v in VALUES.items()}
    assert len(set(said.values())) == len(said) and all(said.values())


def test_the_numbers_are_raw_in_the_json_and_in_binary_units_on_the_terminal():
    v = VALUES["oom-device"]
    assert W.capacity_source("oom-device", v, None, None) == (
        f"the OOM at event 12: {GiB} bytes free on the device + {70 * GiB} reserved")
    assert W.capacity_source("oom-device", v, None, None, count=format_bytes) == (
        "the OOM at event 12: 1.00 GiB bytes free on the device + 70.00 GiB reserved")


def test_a_fallbacks_cap_says_its_bounds_the_retries_and_what_settling_found():
    c = Capacity(limit_bytes=20 * GiB, kind="fraction", source="fallbacks", certainty="bounded",
                 lower_bytes=20 * GiB, upper_bytes=21 * GiB, evidence="fallbacks",
                 source_values={"runs": 3, "alloc_retries": 2})
    assert W.said(c) == (f"3 allocator fallbacks in the trace (cached segments freed before a new segment): the cap "
                         f"lies in [{20 * GiB}, {21 * GiB}] bytes; the sidecar counts 2 alloc retries; the lower end "
                         "is used")
    settled = Capacity(limit_bytes=20 * GiB + 5, kind="fraction", source="fallbacks", certainty="bounded", lower_bytes=20 * GiB, upper_bytes=21 * GiB, evidence="fallbacks", source_values={"runs": 3, "settled_caps": 9, "settled_cap": 20 * GiB + 5, "settled_exact": False,
                        "settled_unmatched": 4})
    assert W.said(settled).endswith(f"bytes; of 9 caps replayed, {20 * GiB + 5} comes closest (4 segment events "
                                    "unmatched)")
    assert "the lower end is used" not in W.said(settled)


@pytest.mark.parametrize("source, values, words", [
    ("sidecar-cap", {"capacity_source": "sidecar-memory-fraction", "fraction": 0.25, "gpu_total_memory_bytes": 8},
     "set_per_process_memory_fraction: memory_fraction 0.25 x gpu_total_memory_bytes 8 (sidecar)"),
    ("gpu-total", {"given": True, "nccl": True},
     "the GPU's total memory (given with --gpu-memory) less the CUDA context and NCCL's buffers (planner constants)"),
    ("gpu-total", {"given": False, "nccl": False}, "the GPU's total memory less the CUDA context (planner constants)"),
    ("none", {}, "unknown: no OOM and no sidecar with the GPU's memory"),
])
def test_room_sources_in_words(source, values, words):
    assert W.room_source(source, values) == words


def test_every_room_source_is_said_and_an_unknown_id_is_an_error():
    values = {"capacity_source": "sidecar-memory-cap"}
    assert len({W.room_source(s, values) for s in ROOM_SOURCES}) == len(ROOM_SOURCES)
    with pytest.raises(KeyError):
        W.room_source("the test", {})
    with pytest.raises(KeyError):
        W.capacity_source("a sentence", {}, None, None)


def test_every_simulation_id_is_said():
    from oomdoctor.render.words import simulate as S
    from oomdoctor.simulate.whatif import INCOMPATIBILITIES, RECOMMENDATION_REASONS, SIMULATION_NOTES
    assert set(S.REASONS) == set(RECOMMENDATION_REASONS) and set(S.NOTES) == set(SIMULATION_NOTES)
    ids = [i for ids in INCOMPATIBILITIES.values() for i in ids]
    assert len(ids) == len(set(ids)) and set(ids) == set(S.INCOMPATIBILITIES)
    assert all("(" in S.INCOMPATIBILITIES[i] for i in ids if i != "max-split-at-least-20-mib")  # each names a source


def test_a_cap_set_during_the_run_says_from_which_event():
    cap = Capacity(limit_bytes=12 << 30, kind="fraction", source="sidecar-memory-cap", certainty="exact",
                   lower_bytes=12 << 30, upper_bytes=12 << 30, evidence="sidecar", source_values={},
                   from_event=2177)
    assert W.said(cap) == ("the memory cap in the sidecar (memory_cap_bytes), from event 2177 on (reserved bytes were "
                           "above it before: it was set during the run; the replay's peaks are taken from there)")
    assert W.said(Capacity(limit_bytes=12 << 30, kind="fraction", source="sidecar-memory-cap")) == "the memory cap in the sidecar (memory_cap_bytes)"
