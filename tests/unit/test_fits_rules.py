"""What fits when a trace ends inside its first forward pass (``report/fits.py``: the estimate, its room).

The trace is completed by the estimate's stated assumptions (``simulate/extend.py`` ``mirror_backward``): the
failed request is the pass's output and the loss keeps ``LOSS_COPIES`` (5) more blocks of its size; every
parameter gets a gradient of its size; the optimizer state to come is the one seen, else Adam's two moments
per parameter; the backward frees what the forward saved, last first, making a gradient of the same size for
each; then the next step's forward runs again as recorded. The micro-batch's blocks are scaled and the result
replayed under the room, keeping free 512 bytes per block that grows (the allocator's rounding: no complete
step, so no spread of peaks, ``job_margin``), searching at most up to one less than the recorded micro-batch (it ran out
of memory). The answer is a lower bound (``bound == "lower"``): the blocks that grow are replayed
``1 + UNSEEN_FRAGMENTATION`` larger; the tests of the replay's arithmetic set that allowance to 0 (``exact``,
autouse), the tests at the end check it.

The traces are small and built in code so that the answer can be worked out by hand: every size is a multiple
of 2 MiB and at least 10 MiB at the scales that decide, so each block the caching allocator cannot take from
its cache is a segment of exactly its size; on a miss above the limit it frees every cached segment and tries
again (``release_cached_blocks``; no ``max_split_size``), and a cached block larger than the request is split
(best fit, the front part used). The micro-batch is 16, so the scales tried are whole sixteenths (exact in
binary: a scaled request has no rounding of its own). Each test's docstring gives the arithmetic.

Also the room every answer is replayed under (``device_room``): a cap in the sidecar, else the OOM's reserved
plus free bytes, else the sidecar's at the dump, else the GPU's memory less the planner's constants.
"""

from __future__ import annotations

import json
import math

import pytest
from builder import SnapBuilder, frames
from test_accounting import OPT_STATE, SETUP, model

from oomdoctor import load
from oomdoctor.analysis import analyze
from oomdoctor.report import fits as fits_module
from oomdoctor.report.fits import LOSS_COPIES, Fits, Room, device_room, fits

MiB = 1 << 20
GiB = 1 << 30
MB = 16  # the recorded micro-batch: its blocks scale by m / 16


@pytest.fixture(autouse=True)
def no_outside_growth(monkeypatch):
    """The replay's arithmetic on rooms of a few hundred MiB: the margin's outside part (what the memory outside the
    allocator may grow by after the room was read at the OOM, 92 MiB measured on H200 jobs; test_margin_rules.py)
    is set to 0, so the margin is the rounding alone."""
    from oomdoctor.report import margin as margin_module

    monkeypatch.setattr(margin_module, "OUTSIDE_GROWTH_BYTES", 0)
    monkeypatch.setattr(margin_module, "OUTSIDE_GROWTH_AFTER_STEP_BYTES", 0)


@pytest.fixture(autouse=True)
def exact(monkeypatch, request):
    """The replay's arithmetic without the allowance for unseen fragmentation (tests named ``*allowance*`` keep it)."""
    if "allowance" not in request.node.name:
        monkeypatch.setattr(fits_module, "UNSEEN_FRAGMENTATION", 0.0)


TF = "/venv/lib/python3.12/site-packages/transformers"
CACHE = frames((f"{TF}/cache_utils.py", 500, "update"), ("/w/model.py", 30, "forward"),
               ("/w/train.py", 30, "main"))  # a DynamicCache's update: a forward with use_cache=True


def first_forward(tmp_path, *, params=(100,), state=(), acts=(32,), request=32, expandable=False,
                  params_before_trace=False, cache=()):
    """Parameters (Module._apply), optimizer state (Adam's _init_group: a resumed optimizer), then the first
    forward pass: activations (model code), and an OOM for ``request`` MiB. Sizes in MiB."""
    b = SnapBuilder()
    if expandable:
        b.settings.update(expandable_segments=True, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    seg = b.segment(16 * GiB, expandable=expandable, record=not params_before_trace)
    off = 0

    def alloc(size_mib: int, fr, record: bool = True) -> None:
        nonlocal off
        b.alloc(seg, off, size_mib * MiB, fr=fr, record=record)
        off += size_mib * MiB

    for p in params:
        alloc(p, SETUP, record=not params_before_trace)
    for s in state:
        alloc(s, OPT_STATE)
    for i, x in enumerate(acts):
        alloc(x, model(20 + i))
    for x in cache:
        alloc(x, CACHE)
    b.oom(request * MiB, device_free=0)
    return analyze(load(b.write(tmp_path / "rank0.pickle")))


def device(mib: int) -> Room:
    return Room(bytes=mib * MiB, kind="device", source="oom-device")


def fraction(mib: int) -> Room:
    return Room(bytes=mib * MiB, kind="fraction", source="oom-fraction-cap")


def assert_said_as_an_estimate(f: Fits, *, state_seen: bool) -> None:
    """The assumptions are the docstring's, in its order, and one note says the answer is an estimate (ids: their
    words are test_words_fits.py's)."""
    assert f.bound == "lower"
    assert f.assumptions == ["loss-copies", "parameters-trained",
                             "optimizer-state-seen" if state_seen else "optimizer-state-adam",
                             "backward-mirrors-forward", "unseen-fragmentation"]
    assert f.note_values["loss_copies"] == LOSS_COPIES
    assert f.note_values["unseen_fragmentation_percent"] == round(100 * fits_module.UNSEEN_FRAGMENTATION)
    assert f.notes.count("first-forward-estimate") == 1
    assert "cut-in-first-forward" not in f.notes and "replay-failed" not in f.notes  # replayed, as an estimate
    assert f.largest_micro_batch is None and f.batch_scale is None  # never a replayed answer


def assert_micro_batches(f: Fits, m: int) -> None:
    """``m`` sixteenths of the micro-batch fit, the scale given to three decimals, rounded down (a lower bound)."""
    assert f.estimated_largest_micro_batch == m
    assert f.estimated_batch_scale == math.floor(m / MB * 1000 + 1e-6) / 1000


def test_without_optimizer_state_adams_two_moments_are_made_and_the_next_forward_decides(tmp_path):
    """Parameter 100 MiB; one activation of 32 MiB and a request of 32 MiB: at m/16 both are 2m MiB.
    The estimated step: P 100, A 2m, loss 6 x 2m, gradient 100, A's gradient 2m (first peak 200 + 16m), the
    8 blocks of 2m freed, Adam's state 2 x 100 (the cached segments freed to make room: 400 reserved), then
    the gradient freed and the next forward's A' and 6 requests: the first five of them split the freed
    100 MiB gradient block while they fit in it, the rest get segments of their own.
    m = 9 (18 MiB): 5 in the 100 MiB block, 2 more segments: 436 MiB <= 440 MiB less 512 bytes: fits.
    m = 10 (20 MiB): 5 fill the block, 2 more: 440 MiB, not under 440 MiB less the 512-byte margin: OOM.
    So 9 of 16. Tried: 1, 16 (the bounds), then 8, 12, 10, 9: six replays."""
    a = first_forward(tmp_path)
    f = fits(a, device(440), MB)
    assert_said_as_an_estimate(f, state_seen=False)
    assert_micro_batches(f, 9)
    assert f.margin_bytes == 512  # one block grows with the batch at the peak: its rounding
    assert f.replays == 6


def test_optimizer_state_already_alive_is_not_made_again(tmp_path):
    """As above, with 200 MiB of optimizer state alive before the forward (a resumed optimizer): nothing more
    is made for it. First peak: 100 + 200 + 2m + 6 x 2m + 100 + 2m = 400 + 16m; the next forward reuses the
    eight cached 2m blocks. Under 560 MiB less 512 bytes: m = 9 (544) fits, m = 10 (560) does not: 9.
    (Adam's 2 x 100 MiB more would not fit at any scale: 400 + 200 > 560.) Tried: 1, 16, 8, 12, 10, 9."""
    a = first_forward(tmp_path, state=(200,))
    f = fits(a, device(560), MB)
    assert_said_as_an_estimate(f, state_seen=True)
    assert_micro_batches(f, 9)
    assert f.replays == 6


def test_two_saved_activations_are_both_freed_by_the_backward(tmp_path):
    """Two activations of 32 MiB (2m each), no state: first peak 200 + 18m; after Adam's state 400 reserved;
    the next forward's 8 blocks of 2m: floor(100 / 2m) split the freed gradient block, the rest are new
    segments. m = 7 (14 MiB): 7 in the block, 1 more: 414 <= 420 MiB less 1 KiB (two blocks' rounding): fits.
    m = 8 (16 MiB): 6 in the block, 2 more: 432: OOM. So 7 of 16 (tried 1, 16, 8, 4, 6, 7)."""
    a = first_forward(tmp_path, acts=(32, 32))
    f = fits(a, device(420), MB)
    assert_said_as_an_estimate(f, state_seen=False)
    assert_micro_batches(f, 7)
    assert f.margin_bytes == 2 * 512
    assert f.replays == 6


def test_blocks_made_after_the_oom_are_not_the_failed_passs(tmp_path):
    """The loop caught the OOM and went on (a retry's forward made one more 320 MiB block): what the failed
    pass saved is what was alive at its failure, so the estimate is the first test's: 9 of 16. The new block
    is alive at the peak of allocated bytes, so the margin is two blocks' rounding (1 KiB), which leaves m = 9
    (436 MiB) and m = 10 (440 MiB) on the same sides of 440 MiB."""
    b = SnapBuilder()
    seg = b.segment(16 * GiB)
    b.alloc(seg, 0, 100 * MiB, fr=SETUP)
    b.alloc(seg, 100 * MiB, 32 * MiB, fr=model(20))
    b.oom(32 * MiB, device_free=0)
    b.alloc(seg, 132 * MiB, 320 * MiB, fr=model(21))
    a = analyze(load(b.write(tmp_path / "rank0.pickle")))
    assert int(a.oom_events[-1]) == a.num_events - 2
    f = fits(a, device(440), MB)
    assert_said_as_an_estimate(f, state_seen=False)
    assert_micro_batches(f, 9)
    assert f.margin_bytes == 2 * 512


def test_an_activation_made_by_the_traces_first_event_is_saved(tmp_path):
    """A ring buffer that starts with the forward: the parameter and its segment were made before the
    trace's first event (event 0 is the activation's allocation). It is saved like any other."""
    a = first_forward(tmp_path, params_before_trace=True)
    assert int(a.lifetimes.alloc[a.accounting.category == fits_module.ACTIVATIONS][0]) == 0
    f = fits(a, device(440), MB)
    assert f.assumptions and f.estimated_largest_micro_batch is not None
    assert "cut-in-first-forward" not in f.notes and "replay-failed" not in f.notes


def test_the_search_stops_below_the_recorded_micro_batch(tmp_path):
    """The recorded micro-batch ran out of memory: the lower bound is at most one less, however large the room
    (16 GiB: the whole step at 16/16 needs under 1 GiB). Two replays: the bounds."""
    a = first_forward(tmp_path)
    f = fits(a, device(16 * 1024), MB)
    assert_micro_batches(f, MB - 1)
    assert f.estimated_batch_scale == 0.937 and f.replays == 2


def test_nothing_fits_when_the_recorded_part_alone_exceeds_the_room(tmp_path):
    """A 100 MiB parameter under a 50 MiB room: not even the smallest scale replays. Still an estimate (said
    as one, with its assumptions), with no number; one replay (the lowest scale)."""
    a = first_forward(tmp_path)
    f = fits(a, device(50), MB)
    assert_said_as_an_estimate(f, state_seen=False)
    assert f.estimated_batch_scale is None and f.estimated_largest_micro_batch is None
    assert f.replays == 1


def test_without_a_micro_batch_the_scale_is_searched_down_to_two_percent(tmp_path):
    """No parameters; activation and request of 3200 MiB each: at scale s the step's eight blocks (A, the
    request and 5 loss copies, A's gradient) are 3200 s MiB each, rounded up to 2 MiB. Under 1000 MiB:
    s = 0.038 (122 MiB blocks: 976) fits, s = 0.039 (126 MiB: 1008) does not. Bisection from 0.02 to 1 to
    within 0.01 ends below that edge, within 0.01 of it: between 0.028 and 0.039. No micro-batch, no count."""
    a = first_forward(tmp_path, params=(), acts=(3200,), request=3200)
    f = fits(a, device(1000), None)
    assert f.estimated_batch_scale is not None and 0.028 <= f.estimated_batch_scale < 0.039
    assert f.estimated_largest_micro_batch is None
    assert_said_as_an_estimate(f, state_seen=False)


@pytest.mark.parametrize("room, m", [(fraction(95), 6), (device(95), 5)])
def test_a_fraction_cap_is_checked_with_the_request_a_device_with_its_pages(tmp_path, room, m):
    """Expandable segments (recorded), no parameters: the eight blocks of a step are 2m MiB each, laid end to
    end in one reservation mapped in 20 MiB pages; the next forward reuses the freed range. A device limit
    counts the pages mapped: 16m MiB rounded up to 20 must stay under 95 MiB: m = 5 (80), not 6 (100).
    A fraction cap checks the reserved bytes plus the request itself before mapping (PyTorch's
    ``alloc_block``), so the last page may go past it: at m = 6 (12 MiB blocks ending at 12, 24, ..., 96) the
    pages are taken at 20 + 12, 40 + 12, 60 + 12 and 80 + 12 = 92 <= 95: fits; at m = 7 (14 MiB) the eighth
    block needs 100 + 14 = 114: OOM."""
    a = first_forward(tmp_path, params=(), expandable=True)
    assert a.trace.allocator_settings.get("expandable_segments") is True
    f = fits(a, room, MB)
    assert_micro_batches(f, m)


def test_the_estimate_adds_its_replays_to_those_already_counted(tmp_path):
    """``_first_forward_estimate`` fills ``out``: its six replays (the first test's) add to any counted."""
    a = first_forward(tmp_path)
    out = Fits(440 * MiB, "test", micro_batch=MB, replays=4)
    assert fits_module._first_forward_estimate(a, device(440), MB, out) is True
    assert out.replays == 4 + 6 and out.estimated_largest_micro_batch == 9


def test_no_saved_activation_means_no_estimate(tmp_path):
    """Only a temporary of the forward, freed before the OOM: nothing was saved for a backward to mirror, so
    there is nothing to estimate from and ``fits`` says the trace cannot be replayed."""
    b = SnapBuilder()
    seg = b.segment(16 * GiB)
    b.alloc(seg, 0, 100 * MiB, fr=SETUP)
    t = b.alloc(seg, 100 * MiB, 32 * MiB, fr=model(20))
    b.free(t)
    b.oom(32 * MiB, device_free=0)
    a = analyze(load(b.write(tmp_path / "rank0.pickle")))
    out = Fits(440 * MiB, "test", micro_batch=MB)
    assert fits_module._first_forward_estimate(a, device(440), MB, out) is False
    assert out.replays == 0 and not out.assumptions and out.estimated_batch_scale is None
    f = fits(a, device(440), MB)
    assert f.batch_scaled_bytes_at_peak == 32 * MiB  # the temporary grows with the batch: the rule applies
    assert "cut-in-first-forward" in f.notes
    assert not f.assumptions and f.estimated_batch_scale is None


# -- the room (device_room): the best evidence first, as the module doc orders it ---------------------------

def room_of(tmp_path, meta: dict | None, *, oom_free: int | None = 3 * GiB) -> Room:
    """A 16 GiB segment (reserved) holding one 1 GiB parameter, then an OOM whose ``device_free`` is
    ``oom_free`` (no OOM when None); ``meta``: the sidecar."""
    b = SnapBuilder()
    seg = b.segment(16 * GiB)
    b.alloc(seg, 0, GiB, fr=SETUP)
    if oom_free is not None:
        b.oom(32 * GiB, device_free=oom_free)
    path = b.write(tmp_path / "rank0.pickle")
    if meta is not None:
        (tmp_path / "rank0.meta.json").write_text(json.dumps(meta))
    return device_room(analyze(load(path)))


def test_a_memory_cap_in_the_sidecar_is_the_room_before_anything_else(tmp_path):
    r = room_of(tmp_path, {"memory_cap_bytes": 20 * GiB, "device_free_bytes": GiB,
                           "gpu_total_memory_bytes": 80 * GiB,
                           "memory_stats": {"reserved_bytes.all.current": 16 * GiB}})
    assert (r.bytes, r.kind, r.source, r.values) == (20 * GiB, "fraction", "sidecar-cap",
                                                     {"capacity_source": "sidecar-memory-cap"})


def test_a_memory_fraction_times_the_gpus_memory_is_a_cap(tmp_path):
    r = room_of(tmp_path, {"memory_fraction": 0.25, "gpu_total_memory_bytes": 80 * GiB})
    assert (r.bytes, r.kind, r.source) == (20 * GiB, "fraction", "sidecar-cap")
    assert r.values == {"capacity_source": "sidecar-memory-fraction", "fraction": 0.25,
                        "gpu_total_memory_bytes": 80 * GiB}


@pytest.mark.parametrize("free_gib", [3, 0])
def test_without_a_cap_the_oom_says_what_was_there_to_take(tmp_path, free_gib):
    """Reserved at the OOM (the 16 GiB segment) plus the device's free bytes then (none is a measurement
    too); it wins over the sidecar's figures at the dump."""
    r = room_of(tmp_path, {"device_free_bytes": GiB, "memory_stats": {"reserved_bytes.all.current": 16 * GiB},
                           "gpu_total_memory_bytes": 80 * GiB}, oom_free=free_gib * GiB)
    assert (r.bytes, r.kind, r.source) == ((16 + free_gib) * GiB, "device", "oom-device")


def test_an_oom_without_its_free_bytes_gives_way_to_the_sidecar(tmp_path):
    """``device_free`` < 0 (not recorded): the sidecar's free bytes at the dump plus its reserved bytes."""
    r = room_of(tmp_path, {"device_free_bytes": 2 * GiB, "gpu_total_memory_bytes": 80 * GiB,
                           "memory_stats": {"reserved_bytes.all.current": 16 * GiB}}, oom_free=-1)
    assert (r.bytes, r.kind, r.source) == (18 * GiB, "device", "sidecar-free")


@pytest.mark.parametrize("world, nccl", [(None, False), (1, False), (4, True)])
def test_the_gpus_memory_less_what_lives_outside_the_allocator_is_an_estimate(tmp_path, world, nccl):
    """Only the GPU's total: less the CUDA context, and NCCL's first communicator when the job is distributed
    (planner constants)."""
    from oomdoctor.plan.terms import CUDA_CONTEXT_BYTES, NCCL_FIRST_COMMUNICATOR_BYTES
    meta = {"gpu_total_memory_bytes": 80 * GiB}
    if world is not None:
        meta["world_size"] = world
    r = room_of(tmp_path, meta, oom_free=None)
    assert (r.kind, r.source, r.values) == ("estimated", "gpu-total", {"given": False, "nccl": nccl})
    assert r.bytes == 80 * GiB - CUDA_CONTEXT_BYTES - (NCCL_FIRST_COMMUNICATOR_BYTES if nccl else 0)


def test_no_oom_and_no_sidecar_leave_the_room_unknown(tmp_path):
    r = room_of(tmp_path, None, oom_free=None)
    assert (r.bytes, r.kind, r.source) == (None, "none", "none")


# -- what the pass holds, and the lower bound's allowance --------------------------------------------------------

def test_a_kv_cache_the_pass_made_is_freed_by_the_mirrored_backward_like_an_activation(tmp_path):
    """A forward with use_cache=True (training a Llama with transformers' default) holds a DynamicCache's blocks
    at the OOM: categorised kv_cache, not activations. The backward frees them too; kept, the next step's forward
    would make them a second time (the accelerate Llama b128 run: 16 GiB of cache counted twice, 66 where 72
    ran). One activation and one cache block of 32 MiB: the arithmetic of two saved activations, 7 of 16."""
    from oomdoctor.analysis.accounting import KV_CACHE
    a = first_forward(tmp_path, acts=(32,), cache=(32,))
    assert int((a.accounting.category == KV_CACHE).sum()) == 1
    f = fits(a, device(420), MB)
    assert_said_as_an_estimate(f, state_seen=False)
    assert_micro_batches(f, 7)


@pytest.mark.parametrize("allowance, m", [(0.0, 9), (0.25, 7)])
def test_the_allowance_replays_the_growing_blocks_larger_and_answers_below(tmp_path, monkeypatch, allowance, m):
    """The first test's trace (room 440 MiB: 18 MiB blocks fit, 20 MiB do not, m = 9 exactly). With a 25%
    allowance for unseen fragmentation, micro-batch m replays blocks of 2.5 m MiB: m = 7 (17.5 MiB, under the
    18 that fit) fits, m = 8 (20 MiB) does not: 7, a lower bound under the exact 9."""
    monkeypatch.setattr(fits_module, "UNSEEN_FRAGMENTATION", allowance)
    a = first_forward(tmp_path)
    f = fits(a, device(440), MB)
    assert f.bound == "lower" and f.estimated_largest_micro_batch == m
    assert f.assumptions[-1] == "unseen-fragmentation"
    assert f.note_values["unseen_fragmentation_percent"] == round(100 * allowance)

