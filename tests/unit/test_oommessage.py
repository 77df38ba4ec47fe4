"""PyTorch's CUDA OOM message, parsed (``trace/oommessage.py``), and its use: the memory outside the caching
allocator in the prediction margin (``report/margin.py``), and the recorder writing it into the OOM sidecar.

The messages are real: the corpus jobs' own (``docs/corpus/*``: torch 2.11 on H200s), and PyTorch 1.x's form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builder import SnapBuilder
from test_capture import fake_recorder, small_snapshot

from oomdoctor import load
from oomdoctor.analysis import analyze
from oomdoctor.report.margin import OUTSIDE_GROWTH_BYTES, margin, margin_inputs, outside_allocator
from oomdoctor.trace.oommessage import parse_oom_message, sidecar_oom_message

MiB = 1 << 20
GiB = 1 << 30
CORPUS = Path(__file__).resolve().parents[2] / "docs" / "corpus"

# first-forward-accelerate-ddp-llama-b128's ground_truth.json (truncated at 400 characters, as the job kept it)
LLAMA = ("CUDA out of memory. Tried to allocate 15.62 GiB. GPU 0 has a total capacity of 139.80 GiB of which 4.99 GiB "
         "is free. Including non-PyTorch memory, this process has 134.80 GiB memory in use. Of the allocated memory "
         "133.21 GiB is allocated by PyTorch, and 103.36 MiB is reserved by PyTorch but unallocated. If reserved but "
         "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segm")
# compiled-lm-b152: CUDA graph private pools
COMPILED = ("CUDA out of memory. Tried to allocate 9.28 GiB. GPU 0 has a total capacity of 139.80 GiB of which 6.35 GiB "
            "is free. Including non-PyTorch memory, this process has 133.44 GiB memory in use. Of the allocated memory "
            "68.91 GiB is allocated by PyTorch, with 3.03 GiB allocated in private pools (e.g., CUDA Graphs), and "
            "63.72 GiB is reserved by PyTorch but unallocated.")
# PyTorch 1.x (a public traceback): no process usage
OLD = ("RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB "
       "already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch) If reserved memory is >> "
       "allocated memory try setting max_split_size_mb to avoid fragmentation.")
HALF_CENT_GIB = GiB // 200  # half a unit of two decimals of GiB


def gib(x: float) -> int:
    return round(x * GiB)


def test_the_llama_message_gives_every_number_and_the_memory_outside_the_allocator():
    m = parse_oom_message(LLAMA)
    assert (m.requested_bytes, m.device, m.total_bytes, m.free_bytes) == (gib(15.62), 0, gib(139.80), gib(4.99))
    assert (m.in_use_bytes, m.allocated_bytes, m.private_pools_bytes) == (gib(134.80), gib(133.21), None)
    assert m.reserved_bytes == gib(133.21) + round(103.36 * MiB)
    assert m.outside_bytes == gib(134.80) - gib(133.21) - round(103.36 * MiB)
    assert m.precision_bytes == HALF_CENT_GIB
    # the trace of that run says the same within the message's rounding: total - free - reserved at its OOM
    assert abs(m.outside_bytes - 1_611_530_240) <= 3 * m.precision_bytes


def test_private_pools_are_part_of_the_allocated_bytes_not_added_again():
    m = parse_oom_message(COMPILED)
    assert m.private_pools_bytes == gib(3.03) and m.allocated_bytes == gib(68.91)
    assert m.reserved_bytes == gib(68.91) + gib(63.72)
    assert m.outside_bytes == gib(133.44) - gib(68.91) - gib(63.72)


def test_the_old_message_has_no_process_usage():
    m = parse_oom_message(OLD)
    assert (m.requested_bytes, m.device, m.total_bytes, m.free_bytes) == (36 * MiB, 0, gib(7.93), round(47.06 * MiB))
    assert (m.allocated_bytes, m.reserved_bytes, m.in_use_bytes) == (round(130.35 * MiB), 188 * MiB, None)
    assert m.outside_bytes is None


def test_another_process_line_is_not_this_process():
    text = LLAMA.replace("is free. Including", "is free. Process 4242 has 2.00 GiB memory in use. Including")
    assert parse_oom_message(text).in_use_bytes == gib(134.80)


@pytest.mark.parametrize("text", [None, 3, "", "RuntimeError: CUDA error: an illegal memory access",
                                  "CUDA out of memory.", "CUDA out of memory. Tried to allocate lots"])
def test_no_message_no_numbers(text):
    assert parse_oom_message(text) is None


def test_every_oom_message_of_the_corpus_sweeps_parses_and_adds_up():
    """Every OOM of the corpus' sweeps (torch 2.11): in use = outside + reserved, and reserved + free is at most
    the total (the rest is the CUDA context and the like, outside), each within the rounding. A message cut before
    its reserved bytes (the sweeps keep 400 characters: round 14's messages list other processes first) has no reserved bytes and no outside bytes: never
    a guess."""
    seen = cut = 0
    for path in sorted(CORPUS.glob("*sweep*.jsonl")):
        for line in path.read_text().splitlines():
            text = json.loads(line).get("oom")
            if not text:
                continue
            m = parse_oom_message(text)
            assert m is not None and m.in_use_bytes is not None, text
            assert m.in_use_bytes + m.free_bytes <= m.total_bytes + 2 * m.precision_bytes
            if m.reserved_bytes is None:  # the sweeps keep a message's first 400 characters (scenarios/_truth.py)
                assert len(text) <= 400 and "reserved by PyTorch but unallocated" not in text, text
                cut += 1
                continue
            assert m.outside_bytes == m.in_use_bytes - m.reserved_bytes  # never clipped on these
            seen += 1
    assert seen >= 10 and cut <= 10, (seen, cut)


def built_oom(tmp_path, sidecar: dict | None):
    """A 4 GiB segment holding 1 GiB, an OOM for 8 GiB with 2 GiB free, on an 80 GiB GPU."""
    b = SnapBuilder()
    seg = b.segment(4 * GiB)
    b.alloc(seg, 0, GiB)
    b.oom(8 * GiB, device_free=2 * GiB)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = b.write(tmp_path / "rank0.pickle")
    (tmp_path / "rank0.meta.json").write_text(json.dumps({"gpu_total_memory_bytes": 80 * GiB, **(sidecar or {})}))
    return analyze(load(path))


def test_the_margins_inputs_take_the_memory_outside_the_allocator_from_the_oom_message(tmp_path):
    """The message says the process uses 7.50 GiB, of which PyTorch reserved 1.00 + 3.00 GiB: 3.50 GiB outside,
    what the sidecar gives the margin (``margin_inputs``; the GPU is shared with another process here, which the
    message's own usage leaves out: the GPU's total less the free and reserved bytes at the OOM is 74 GiB). The room
    was read at the OOM, so that memory is off it already: the claim keeps free only what it may grow by (issue 49:
    counted once)."""
    text = ("CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity of 80.00 GiB of which 2.00 GiB "
            "is free. Including non-PyTorch memory, this process has 7.50 GiB memory in use. Of the allocated memory "
            "1.00 GiB is allocated by PyTorch, and 3.00 GiB is reserved by PyTorch but unallocated.")
    a = built_oom(tmp_path / "with", {"oom": {"device": 0, "alloc_bytes": 8 * GiB, "message": text}})
    assert sidecar_oom_message(a.trace.meta).outside_bytes == gib(3.5)
    assert margin_inputs(a)["outside_bytes"] == gib(3.5)
    inputs = margin_inputs(a)
    assert outside_allocator(a, inputs["outside_bytes"]) == (OUTSIDE_GROWTH_BYTES, "outside-growth")
    assert margin(a, **inputs).outside_bytes == OUTSIDE_GROWTH_BYTES
    b = built_oom(tmp_path / "without", None)
    assert margin_inputs(b)["outside_bytes"] is None
    assert outside_allocator(b) == (OUTSIDE_GROWTH_BYTES, "outside-growth")


def test_a_message_that_is_not_a_string_is_ignored(tmp_path):
    a = built_oom(tmp_path, {"oom": {"device": 0, "message": ["CUDA out of memory"]}})
    assert sidecar_oom_message(a.trace.meta) is None
    assert margin_inputs(a)["outside_bytes"] is None


class OutOfMemoryError(RuntimeError):
    """Named as torch's."""


def test_the_recorder_writes_the_message_into_the_oom_sidecar(tmp_path):
    snap = small_snapshot(tmp_path)
    rec, _cuda = fake_recorder(tmp_path, snap)
    rec._enable(clear=False)
    rec._oom_observer(0, 4 * MiB, 37_529_939_968, 1 << 30)
    with pytest.raises(OutOfMemoryError):
        with rec:
            raise OutOfMemoryError(LLAMA)
    meta = json.loads((tmp_path / "out" / "rank0_oom.meta.json").read_text())
    assert meta["oom"]["message"] == LLAMA and meta["oom"]["alloc_bytes"] == 4 * MiB
    assert sidecar_oom_message(load(tmp_path / "out" / "rank0_oom.pickle").meta).in_use_bytes == gib(134.80)


def test_the_recorder_leaves_the_sidecar_alone_for_another_error(tmp_path):
    snap = small_snapshot(tmp_path)
    rec, _cuda = fake_recorder(tmp_path, snap)
    rec._enable(clear=False)
    rec._oom_observer(0, 4 * MiB, 37_529_939_968, 1 << 30)
    with pytest.raises(ValueError):
        with rec:
            raise ValueError("not memory")
    meta = json.loads((tmp_path / "out" / "rank0_oom.meta.json").read_text())
    assert "message" not in meta["oom"]
