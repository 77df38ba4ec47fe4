"""The detectors' findings, whole: title, severity, bytes, evidence, the sentence a user reads and the fixes.

- ``detectors/output_accumulation.py``: ``detect_rank`` on evaluation loops built here (one batch's input, a
  temporary, the kept outputs per batch): outputs of at least three batches kept (``MIN_PASSES``), at least
  1 MiB of them (``MIN_KEPT_BYTES``), a whole graph when four sites per batch are kept (``GRAPH_SITES``), one
  buffer re-allocated larger for three passes in a row (``_regrown``, ``MIN_REGROWN``) and the severity boundary
  (``HIGH_FRACTION`` of the allocated bytes); at the OOM or at the peak; outputs born before the trace; the
  Trainer's own fix when its frames are in the trace; pipeline schedules left to ``pipeline-output-cache``.

- ``detectors/small_long_lived.py``: ``detect_rank`` at its boundaries: 256 blocks (``MIN_BLOCKS``), smaller
  than 10 MiB (``kMinLargeAlloc``), alive for at least half the trace (``duration // 2`` of the first and last
  events' times), the segment each pins (a block at a segment's first byte is that segment's), the pinned free
  bytes at least 256 MiB (``MIN_PINNED_BYTES``) and 10% of reserved memory (``MIN_PINNED_FRACTION``).
- ``detectors/rank_imbalance.py``: ``_detect_group`` on rank profiles built here: a rank at least 10% and
  256 MiB above the median of the others (both boundaries at once: 2816 MiB against 2560 MiB), severity high
  from 20% above, the sites that hold at least 16 MiB more on it (at the end first, else at its peak, five at
  most), the sentence for each; ``_group`` (the pipeline stage from the sidecar, else a pipeline rank alone,
  else all) and ``profile``.
- ``detectors/pipeline_output_cache.py``: ``detect_rank`` on pipeline schedules built here: outputs of
  ``forward_one_chunk`` (only that function of ``pipelining/stage.py``) kept until one burst of frees (within 10%
  of the span of their allocations), or never freed; the biggest group of one site and size wins; evidence
  (the median time each output was held) and the fixes' applicability for each PyTorch version
  (``return_outputs=False`` from 2.10, the patch before it).
- ``detectors/fragmentation.py``: ``detect_rank`` at an OOM (the request larger than the largest free block,
  and no larger than the reserved-but-unallocated bytes, both boundaries) with its whole evidence, and at the
  peak of reserved memory (stranded bytes); expandable segments from the allocator settings or a segment;
  ``_fixes``' full texts, versions and sources.
- ``detectors/allgather_list.py``: ``detect_rank``: the flat buffers allocated with ``all_gather`` of
  ``distributed_c10d.py`` as the innermost Python frame, in the trace (not before it); the whole finding.
- ``report/fits.py``: ``device_room``, each source of the room with its whole sentence: the OOM's reserved
  plus free bytes, the sidecar's, the GPU's total less the CUDA context (and NCCL's first communicator on more
  than one rank), none; the boundaries of the GPU's total (0 says nothing) and of the world size (2 is
  distributed). ``_margin`` (with the helpers of ``test_fits_main_rules``): after exactly two steps the
  persistent memory made after the first step's peak is kept free; with no finished step, twice the parameters
  and the note saying so, whole; a forward-only OOM keeps only the job's margin.
- ``detectors/cache_flush.py``: ``detect_rank`` and ``_training_bursts`` on an evaluation loop with
  ``empty_cache()`` flushes (free stacks recorded): inside the passes they count; at setup, after the last model
  allocation, right before an OOM or before a CUDA graph's recording they do not; the evidence read off the
  event clock (``_flush_cost``) and the whole finding.

Every expected number is arithmetic on the bytes placed in the trace; every sentence is the module's template
filled with that evidence (``oomdoctor.render.format.fill``).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from builder import MiB, SnapBuilder, frames
from test_fits_main_rules import (
    GRAD,
    OPT_STATE,
    PARAM,
    STATE,
    analysed,
    oom_after_steps,
    oom_in_first_backward,
    train,
)

from oomdoctor.analysis import analyze
from oomdoctor.analysis.accounting import OUTPUTS
from oomdoctor.analysis.ranks import RankProfile, SiteBytes
from oomdoctor.detectors import Context
from oomdoctor.detectors import allgather_list as agl
from oomdoctor.detectors import cache_flush as cf
from oomdoctor.detectors import fragmentation as frag
from oomdoctor.detectors import output_accumulation as oa
from oomdoctor.detectors import pipeline_output_cache as poc
from oomdoctor.detectors import rank_imbalance as ri
from oomdoctor.detectors import small_long_lived as sll
from oomdoctor.detectors.context import TorchVersion
from oomdoctor.detectors.finding import Fix, SiteRef
from oomdoctor.plan.terms import CUDA_CONTEXT_BYTES, NCCL_FIRST_COMMUNICATOR_BYTES
from oomdoctor.report.fits import Room, _margin, device_room, job_margin
from oomdoctor.trace.load import from_snapshot
from oomdoctor.trace.model import SEGMENT_FREE

GiB = 1024 * MiB
KiB = 1024
TORCH = "/venv/lib/python3.12/site-packages/torch"
HF = "/venv/lib/python3.12/site-packages/transformers"
MAIN = ("/w/eval.py", 30, "main")
TRAINER = (f"{HF}/trainer.py", 4300, "evaluation_loop")
BASE = frames(("/w/eval.py", 5, "main"))  # setup code: not model code
INPUT = frames(("/w/eval.py", 25, "main"))  # the batch's transfer: not model code
CONCAT = frames((f"{HF}/trainer_pt_utils.py", 120, "nested_concat"), TRAINER)
GENERATE = frames((f"{HF}/generation/utils.py", 2400, "generate"), MAIN)
PIPELINE = (f"{TORCH}/distributed/pipelining/stage.py", 699, "forward_one_chunk")


def model(line: int, outer: tuple = MAIN) -> list[dict]:
    return frames(("/w/model.py", line, "forward"), (f"{TORCH}/nn/modules/module.py", 1790, "_call_impl"), outer)


def _analysis(b: SnapBuilder, drop_first: int = 0):
    return analyze(from_snapshot(b.snapshot(drop_first), "rank0.pickle", None))


def _evaluation(batches: int = 3, keep=(128 * MiB,), base: int = 256 * MiB, tmp: int = 64 * MiB,
                outer: tuple = MAIN, oom: bool = False, first_at_zero: bool = False, keeps=None) -> SnapBuilder:
    """An evaluation loop: ``base`` bytes of setup, then per batch its input (1 MiB, freed at the batch's end),
    a temporary of ``tmp`` bytes from the model and the outputs ``keep`` (one site each, model.py:40 on),
    never freed (``keeps[i]``: batch i's own outputs). ``first_at_zero``: the first batch's first output is the trace's first event (no setup, no
    input)."""
    b = SnapBuilder()
    seg = b.segment(32 * GiB, record=not first_at_zero)
    off = 0
    if base:
        b.alloc(seg, off, base, fr=BASE)
        off += base
    for i in range(batches):
        x = None
        if not (first_at_zero and i == 0):
            x = b.alloc(seg, off, MiB, fr=INPUT)
            off += MiB
            t = b.alloc(seg, off, tmp, fr=model(20, outer))
            b.free(t)
        for j, size in enumerate(keeps[i] if keeps else keep):
            b.alloc(seg, off, size, fr=model(40 + j, outer))
            off += size
        if x is None:
            t = b.alloc(seg, off, tmp, fr=model(20, outer))
            b.free(t)
        else:
            b.free(x)
    if oom:
        b.oom(GiB, device_free=0)
    return b


def _regrowing(batches: int, sizes=None, fr=CONCAT, oom: bool = False) -> SnapBuilder:
    """Trainer's evaluation loop concatenating each batch's logits onto the previous ones (``nested_concat``):
    per batch its input, a model temporary, then a new buffer of ``sizes[i]`` bytes (64 MiB more each batch
    by default) that replaces the last one."""
    sizes = sizes or [(i + 1) * 64 * MiB for i in range(batches)]
    b = SnapBuilder()
    seg = b.segment(32 * GiB)
    b.alloc(seg, 0, 256 * MiB, fr=BASE)
    off = 256 * MiB
    buf = None
    for size in sizes:
        x = b.alloc(seg, off, MiB, fr=INPUT)
        off += MiB
        t = b.alloc(seg, off, 64 * MiB, fr=model(20, TRAINER))
        b.free(t)
        new = b.alloc(seg, off, size, fr=fr)
        off += size
        if buf is not None:
            b.free(buf)
        buf = new
        b.free(x)
    if oom:
        b.oom(GiB, device_free=0)
    return b


TRAINER_FIX = Fix("framework-eval-outputs", versions="all",
                  source="transformers Trainer docs (preprocess_logits_for_metrics); a measured Trainer evaluation "
                         "whose eval_accumulation_steps moved 79 GB of logits per rank to host RAM", kind="config",
                  framework="hf-trainer")
KEEP_LESS_FIX = Fix("keep-what-the-metric-needs", versions="all",
                    source="PyTorch FAQ (accumulating history); torchmetrics docs", kind="code")
GRAPH_FIX = Fix("no-grad-evaluation", versions="all",
                source="PyTorch FAQ 'Don't accumulate history across your training loop'; torch.no_grad docs",
                kind="code")


def _accumulation(b: SnapBuilder, drop_first: int = 0):
    a = _analysis(b, drop_first)
    return oa.detect_rank(a, Context([a]))


def _check_accumulation(f, *, kept, blocks, passes, allocated, at, phase, per_pass, variant, fixes,
                        severity="high", regrown=None, kept_at=None, unit="batch", every=1):
    evidence = {"kept_bytes": kept, "blocks": blocks, "passes": passes, "allocated_bytes": allocated,
                "kept_fraction": round(kept / allocated, 3), "at": at, "phase": phase, "sites_per_pass": per_pass,
                "kept_unit": unit, "kept_at": list(range(passes)) if kept_at is None else kept_at,
                "kept_every": every}
    if regrown is not None:
        evidence["regrown_passes"] = regrown
    assert f is not None
    assert (f.id, f.severity, f.variant, f.ranks, f.bytes, f.per_rank_bytes) == (
        "output-accumulation", severity, variant, [0], kept, {0: kept})
    assert f.evidence.as_dict() == evidence
    assert list(f.evidence.as_dict()) == list(evidence)
    assert f.fixes == fixes


def test_outputs_of_three_batches_kept_at_the_peak():
    # 256 MiB setup + three 128 MiB logits + the last batch's 1 MiB input at the peak (the last logits' birth)
    f = _accumulation(_evaluation(3))
    allocated = 256 * MiB + 3 * 128 * MiB + MiB
    _check_accumulation(f, kept=3 * 128 * MiB, blocks=3, passes=3, allocated=allocated, at="the peak",
                        phase="forward", per_pass=1, variant="kept-outputs",
                        fixes=[KEEP_LESS_FIX])
    assert f.evidence.kept_fraction == 0.599  # 384 / 641: three decimals, not four (its words: test_words_findings)
    assert [(s.label, s.bytes, s.count) for s in f.sites] == [("/w/model.py:40 in forward", 3 * 128 * MiB, 3)]


def test_outputs_kept_every_other_batch_say_when_they_were_kept():
    """Issue 52: the words said "one batch per step" whatever the cadence; the evidence says at which batches (or
    steps) the outputs kept were made and, when evenly spaced, how many apart."""
    f = _accumulation(_evaluation(5, keeps=[(128 * MiB,), (), (128 * MiB,), (), (128 * MiB,)]))
    assert (f.evidence.kept_unit, f.evidence.kept_at, f.evidence.kept_every) == ("batch", [0, 2, 4], 2)
    f = _accumulation(_evaluation(5, keeps=[(128 * MiB,), (128 * MiB,), (), (), (128 * MiB,)]))
    assert (f.evidence.kept_unit, f.evidence.kept_at, f.evidence.kept_every) == ("batch", [0, 1, 4], 0)


def test_outputs_of_two_batches_are_the_last_batch_still_referenced():
    assert _accumulation(_evaluation(2)) is None


def test_at_the_oom_under_the_trainer_its_own_fix_comes_first():
    f = _accumulation(_evaluation(3, outer=TRAINER, oom=True))
    # at the OOM the last input is freed: 256 MiB + 3 x 128 MiB
    _check_accumulation(f, kept=3 * 128 * MiB, blocks=3, passes=3, allocated=256 * MiB + 3 * 128 * MiB,
                        at="the OOM", phase="evaluation", per_pass=1,
                        variant="kept-outputs", fixes=[TRAINER_FIX, KEEP_LESS_FIX])


@pytest.mark.parametrize("base, severity", [
    (4 * 3 * 128 * MiB - 3 * 128 * MiB - MiB, "high"),  # kept is exactly a quarter of the allocated bytes
    (4 * 3 * 128 * MiB - 3 * 128 * MiB - MiB + 512, "medium"),  # 512 bytes more allocated: less than a quarter
])
def test_severity_is_high_from_a_quarter_of_the_allocated_bytes(base, severity):
    f = _accumulation(_evaluation(3, base=base))
    _check_accumulation(f, kept=3 * 128 * MiB, blocks=3, passes=3, allocated=base + 3 * 128 * MiB + MiB,
                        at="the peak", phase="forward", per_pass=1, severity=severity,
                        variant="kept-outputs", fixes=[KEEP_LESS_FIX])


@pytest.mark.parametrize("keeps, found", [
    ([(512 * KiB,), (256 * KiB,), (256 * KiB,)], True),  # one site, three batches: exactly 1 MiB
    ([(512 * KiB,), (256 * KiB,), (255 * KiB,)], False),  # 1 KiB less: a metric per step, not outputs
])
def test_one_mib_kept_is_outputs_less_is_not(keeps, found):
    # a 4 KiB temporary, no setup: the peak is the last output's birth, with the last input (1 MiB)
    f = _accumulation(_evaluation(3, keeps=keeps, tmp=4 * KiB, base=0))
    if not found:
        assert f is None
        return
    _check_accumulation(f, kept=MiB, blocks=3, passes=3, allocated=2 * MiB, at="the peak", phase="forward",
                        per_pass=1, variant="kept-outputs", fixes=[KEEP_LESS_FIX], severity="high")


def test_three_small_sites_per_batch():
    # 512 KiB + 256 KiB + 256 KiB per batch from three sites: 3 MiB in 9 blocks
    f = _accumulation(_evaluation(3, keep=(512 * KiB, 256 * KiB, 256 * KiB), tmp=4 * KiB, base=0))
    _check_accumulation(f, kept=3 * MiB, blocks=9, passes=3, allocated=4 * MiB, at="the peak", phase="forward",
                        per_pass=3, variant="kept-outputs", fixes=[KEEP_LESS_FIX])


def test_four_sites_kept_per_batch_are_the_whole_graph():
    f = _accumulation(_evaluation(3, keep=(32 * MiB,) * 4))
    _check_accumulation(f, kept=12 * 32 * MiB, blocks=12, passes=3, allocated=256 * MiB + 12 * 32 * MiB + MiB,
                        at="the peak", phase="forward", per_pass=4,
                        variant="graph-kept",
                        fixes=[GRAPH_FIX])


def test_three_sites_kept_per_batch_are_outputs_not_a_graph():
    f = _accumulation(_evaluation(3, keep=(32 * MiB,) * 3, outer=TRAINER))
    _check_accumulation(f, kept=9 * 32 * MiB, blocks=9, passes=3, allocated=256 * MiB + 9 * 32 * MiB + MiB,
                        at="the peak", phase="evaluation", per_pass=3,
                        variant="kept-outputs", fixes=[TRAINER_FIX, KEEP_LESS_FIX])


def test_sites_per_pass_counts_model_code_only():
    # each batch keeps its logits (model code) and a gathered copy made by the Trainer (evaluation code, not
    # the model's): one model site per batch
    b = _evaluation(3, keep=(128 * MiB,), outer=TRAINER)
    seg = next(iter(b.segments))
    for i in range(3):
        b.alloc(seg, 20 * GiB + i * 64 * MiB, 64 * MiB, fr=CONCAT)
    f = _accumulation(b)
    assert f.evidence.sites_per_pass == 1 and f.evidence.passes == 3


def test_an_output_born_at_the_first_event_counts_its_pass_and_phase():
    # the first batch's 256 MiB logits are event 0 (no segment event, no setup); two more batches keep 128 MiB
    b = _evaluation(3, keeps=[(256 * MiB,), (128 * MiB,), (128 * MiB,)], base=0, first_at_zero=True)
    assert b.events[0]["action"] == "alloc" and b.events[0]["size"] == 256 * MiB
    f = _accumulation(b)
    _check_accumulation(f, kept=512 * MiB, blocks=3, passes=3, allocated=512 * MiB + MiB, at="the peak",
                        phase="forward", per_pass=1, variant="kept-outputs",
                        fixes=[KEEP_LESS_FIX])


def test_outputs_born_before_the_trace_are_placed_before_it():
    # four batches; the first batch's (bigger) logits were allocated before the ring buffer's first entry
    b = SnapBuilder()
    seg = b.segment(32 * GiB)
    off = 0
    for i in range(4):
        x = b.alloc(seg, off, MiB, fr=INPUT)
        off += MiB
        t = b.alloc(seg, off, 64 * MiB, fr=model(20))
        b.free(t)
        b.alloc(seg, off, (512 if i == 0 else 128) * MiB, fr=model(40))
        off += (512 if i == 0 else 128) * MiB
        b.free(x)
    f = _accumulation(b, drop_first=6)  # segment, input, temporary (2 events), logits, the input's free (2)
    allocated = 512 * MiB + 3 * 128 * MiB + MiB
    _check_accumulation(f, kept=allocated - MiB, blocks=4, passes=3, allocated=allocated, at="the peak",
                        phase="before the trace", per_pass=1,
                        variant="kept-outputs", fixes=[KEEP_LESS_FIX])


def test_outputs_of_a_pipeline_schedule_are_left_to_pipeline_output_cache():
    assert _accumulation(_evaluation(3, outer=PIPELINE)) is None


def test_an_empty_trace_has_no_finding():
    b = SnapBuilder()
    seg = b.segment(GiB, record=False)
    b.alloc(seg, 0, 512 * MiB, fr=model(40), record=False)
    a = _analysis(b)
    assert a.num_events == 0
    assert oa.detect_rank(a, Context([a])) is None
    assert oa.detect(Context([a])) == []


@pytest.mark.parametrize("batches", [4, 5])
def test_one_buffer_regrown_every_batch(batches):
    f = _accumulation(_regrowing(batches))
    # at the peak the new buffer (batches x 64 MiB) and the last one are both alive, with the input
    kept = (2 * batches - 1) * 64 * MiB
    allocated = 256 * MiB + kept + MiB
    # the two buffers alive were made by the last two batches
    _check_accumulation(f, kept=kept, blocks=2, passes=2, allocated=allocated, at="the peak", phase="evaluation",
                        per_pass=0, variant="regrown", kept_at=[batches - 2, batches - 1],
                        fixes=[TRAINER_FIX, KEEP_LESS_FIX], regrown=batches)
    a = _analysis(_regrowing(batches))
    assert oa.detect(Context([a])) == [oa.detect_rank(a, Context([a]))]


def test_one_regrown_buffer_alone_at_the_oom():
    f = _accumulation(_regrowing(4, oom=True))
    _check_accumulation(f, kept=4 * 64 * MiB, blocks=1, passes=1, allocated=256 * MiB + 4 * 64 * MiB, at="the OOM",
                        phase="evaluation", per_pass=0, variant="regrown", kept_at=[3], every=0,
                        fixes=[TRAINER_FIX, KEEP_LESS_FIX], regrown=4)


def _regrown_of(b: SnapBuilder) -> int:
    a = _analysis(b)
    rows = np.flatnonzero(a.lifetimes.allocated_mask(a.peak_allocated[1]) & (a.accounting.category == OUTPUTS))
    return oa._regrown(a, rows)


@pytest.mark.parametrize("sizes, expected", [
    ([64 * MiB, 128 * MiB, 192 * MiB], 0),  # three passes: too few to see three rises
    ([64 * MiB, 128 * MiB, 192 * MiB, 256 * MiB], 4),  # at the starts: 0, 64, 128, 192 MiB: three rises
    ([64 * MiB, 128 * MiB, 128 * MiB, 256 * MiB, 320 * MiB], 0),  # 0, 64, 128, 128, 256: a flat pass breaks the run
    ([64 * MiB] * 5, 0),  # the same size re-allocated: no rise after the first
    # 0, 1, 2, 3, 1, 2, 3, 4 (x 64 MiB): the longest run of rises is three, a shrink starts again from none
    ([k * 64 * MiB for k in (1, 2, 3, 1, 2, 3, 4, 1)], 4),
    ([k * 64 * MiB for k in (1, 2, 3, 4, 1, 2, 1)], 5),  # 0, 1, 2, 3, 4, 1, 2: four rises
])
def test_regrown_counts_the_longest_run_of_rises_at_pass_starts(sizes, expected):
    assert _regrown_of(_regrowing(len(sizes), sizes)) == expected


def test_a_buffer_grown_inside_generate_is_not_regrown():
    assert _regrown_of(_regrowing(5, fr=GENERATE)) == 0
    assert _accumulation(_regrowing(5, fr=GENERATE)) is None


def test_in_model_sites_per_pass_is_the_median_over_passes_including_the_first_event():
    # model sites kept per batch: 1 (born at event 0), 2, 2, 4, 4, 4: the median is 3, not a graph; without the
    # first batch's it would be 4 (a site counts as outputs once it is kept in two batches that later ones follow)
    keeps = [(32 * MiB,) * n for n in (1, 2, 2, 4, 4, 4)]
    f = _accumulation(_evaluation(6, keeps=keeps, base=0, tmp=MiB, first_at_zero=True))
    _check_accumulation(f, kept=17 * 32 * MiB, blocks=17, passes=6, allocated=17 * 32 * MiB + MiB, at="the peak",
                        phase="forward", per_pass=3, variant="kept-outputs",
                        fixes=[KEEP_LESS_FIX])


def test_four_batches_kept_are_outputs_even_though_their_sum_grows():
    # four passes kept: the site's bytes at the pass starts rise three times (0, 1, 2, 3 x 128 MiB), but kept
    # outputs of at least three batches are accumulation, not one regrown buffer
    f = _accumulation(_evaluation(4))
    _check_accumulation(f, kept=4 * 128 * MiB, blocks=4, passes=4, allocated=256 * MiB + 4 * 128 * MiB + MiB,
                        at="the peak", phase="forward", per_pass=1,
                        variant="kept-outputs", fixes=[KEEP_LESS_FIX])


def test_three_batches_kept_and_regrown_are_outputs():
    # four batches each keep 128 MiB of model.py:40; the first batch's is freed in the last batch, after its
    # start: the site rose at every pass start (0, 1, 2, 3 x 128 MiB), and at the OOM three batches' are kept
    b = SnapBuilder()
    seg = b.segment(32 * GiB)
    b.alloc(seg, 0, 256 * MiB, fr=BASE)
    off = 256 * MiB
    first = None
    for i in range(4):
        x = b.alloc(seg, off, MiB, fr=INPUT)
        off += MiB
        t = b.alloc(seg, off, 64 * MiB, fr=model(20))
        b.free(t)
        if i == 3:
            b.free(first)
        out = b.alloc(seg, off, 128 * MiB, fr=model(40))
        off += 128 * MiB
        first = first or out
        b.free(x)
    b.oom(GiB, device_free=0)
    assert _regrown_of(b) == 4
    f = _accumulation(b)
    _check_accumulation(f, kept=3 * 128 * MiB, blocks=3, passes=3, allocated=256 * MiB + 3 * 128 * MiB,
                        at="the OOM", phase="forward", per_pass=1, kept_at=[1, 2, 3],
                        variant="kept-outputs", fixes=[KEEP_LESS_FIX])


def test_regrown_looks_only_at_the_sites_of_the_kept_outputs():
    # a Trainer buffer regrown over four batches, freed before the OOM; at the OOM only the logits of batches 1
    # and 2 are kept (freed after it): two batches, and their own site did not rise three times
    b = SnapBuilder()
    seg = b.segment(32 * GiB)
    b.alloc(seg, 0, 256 * MiB, fr=BASE)
    off = 256 * MiB
    buf, logits = None, []
    for i in range(4):
        x = b.alloc(seg, off, MiB, fr=INPUT)
        off += MiB
        t = b.alloc(seg, off, 64 * MiB, fr=model(20, TRAINER))
        b.free(t)
        if i in (1, 2):
            logits.append(b.alloc(seg, off, 128 * MiB, fr=model(40, TRAINER)))
            off += 128 * MiB
        new = b.alloc(seg, off, (i + 1) * 64 * MiB, fr=CONCAT)
        off += (i + 1) * 64 * MiB
        if buf is not None:
            b.free(buf)
        buf = new
        b.free(x)
    b.free(buf)
    b.oom(GiB, device_free=0)
    for lg in logits:
        b.free(lg)
    a = _analysis(b)
    k = int(a.oom_events[-1])
    rows = np.flatnonzero(a.lifetimes.allocated_mask(k) & (a.accounting.category == OUTPUTS))
    assert a.lifetimes.size[rows].tolist() == [128 * MiB, 128 * MiB]
    assert oa._regrown(a, rows) == 0
    assert oa.detect_rank(a, Context([a])) is None


# --------------------------------------------------------------------------- small-long-lived

SMALL = 1536 * KiB  # 1.5 MiB: a block that shares a segment (< 10 MiB)
T0 = 1_000_000  # the builder's clock at the first event
DURATION = 20_001  # the trace's first to last event, in microseconds: half of it is 10,000 (floor)


def _pinning(with_half: bool = True, last_size: int = 151 * MiB + 512 * KiB, extra_reserved: int = 0,
             extra_large_block: int = 10 * MiB) -> SnapBuilder:
    """25 segments of 20 MiB with ten 1.5 MiB blocks each (every 2 MiB, the first at the segment's start),
    a 26th with four of them and a 27th of ``last_size`` bytes holding one at its start and one block of
    ``extra_large_block`` bytes (not small when >= 10 MiB): 255 small blocks from the trace's start. Then a
    training loop on a 64 MiB segment; at ``T0 + 10,001`` (exactly half the trace before its end) a 256th small
    block when ``with_half``, at ``T0 + 10,002`` one that lived 1 us less than half, both in the 26th segment;
    the last event at ``T0 + DURATION``. ``extra_reserved``: one more segment, empty, that only adds to the
    reserved bytes."""
    b = SnapBuilder()
    segs = [b.segment(20 * MiB) for _ in range(26)] + [b.segment(last_size)]
    for s in segs[:25]:
        for j in range(10):
            b.alloc(s, j * 2 * MiB, SMALL)
    for j in range(4):
        b.alloc(segs[25], j * 2 * MiB, SMALL)
    b.alloc(segs[26], 0, SMALL)
    b.alloc(segs[26], 20 * MiB, extra_large_block)
    if extra_reserved:
        b.segment(extra_reserved)
    big = b.segment(64 * MiB)
    for _ in range(3):
        b.free(b.alloc(big, 0, 64 * MiB))
    b.t = T0 + DURATION - DURATION // 2
    if with_half:
        b.alloc(segs[25], 10 * MiB, SMALL)
    b.t = T0 + DURATION - DURATION // 2 + 1
    b.alloc(segs[25], 12 * MiB, SMALL)
    for _ in range(3):
        b.free(b.alloc(big, 0, 64 * MiB))
    x = b.alloc(big, 0, 64 * MiB)
    b.t = T0 + DURATION - 10
    b.free(x)  # free_requested, then free_completed 10 us later: the last event
    return b


def _small_long_lived(b: SnapBuilder):
    a = _analysis(b)
    tu = a.device.events["time_us"]
    assert (int(tu[0]), int(tu[-1])) == (T0, T0 + DURATION)
    return sll.detect_rank(a, Context([a]))


SLL_FIXES = [
    Fix("contiguous-buffer", versions="all",
        source="Megatron-LM's contiguous gradient buffer (megatron/core/distributed/param_and_grad_buffer.py)",
        kind="code"),
    Fix("bucket-view-gradients",
        versions=">=1.7", source="torch/nn/parallel/distributed.py docstring; DeepSpeed PR #1199", kind="config"),
    Fix("optimizer-state-first", versions="all",
        source="the allocator's best-fit reuse of freed blocks (c10/cuda/CUDACachingAllocator.cpp get_free_block)",
        kind="code"),
]


def _pinned_free(last_size: int, extra_large_block: int = 10 * MiB) -> int:
    # 25 segments with 5 MiB free each, the 26th with 20 - 6 x 1.5 = 11 MiB, the 27th less its two blocks
    return 25 * 5 * MiB + 11 * MiB + last_size - SMALL - extra_large_block


def test_small_long_lived_blocks_pin_their_segments():
    f = _small_long_lived(_pinning())
    free = _pinned_free(151 * MiB + 512 * KiB)
    assert free == 276 * MiB
    reserved = 26 * 20 * MiB + 151 * MiB + 512 * KiB + 64 * MiB
    evidence = {"blocks": 256, "bytes": 256 * SMALL, "segments_pinned": 27, "free_in_pinned_segments_bytes": free,
                "reserved_bytes": reserved}
    assert (f.id, f.severity, f.variant, f.ranks, f.bytes, f.per_rank_bytes) == (
        "small-long-lived", "low", "", [0], free, {0: free})
    assert f.evidence.as_dict() == evidence and list(f.evidence.as_dict()) == list(evidence)
    assert f.fixes == SLL_FIXES
    assert [(s.label, s.bytes, s.count) for s in f.sites] == [("/work/train.py:10 in step", 256 * SMALL, 256)]
    assert sll.detect(Context([_analysis(_pinning())])) == [f]


def test_255_small_blocks_are_too_few():
    # without the block born exactly half the trace before its end (the one born 1 us later is too young)
    assert _small_long_lived(_pinning(with_half=False)) is None


def test_a_10_mib_block_is_not_small():
    # a 10 MiB - 512 B block is small: one more block
    f = _small_long_lived(_pinning(extra_large_block=10 * MiB - 512))
    assert f.evidence.blocks == 257 and f.evidence.bytes == 256 * SMALL + 10 * MiB - 512


def test_a_trace_without_elapsed_time_keeps_every_block():
    # every event at the same microsecond: no duration (taken as 1 us, half of it 0), every block is old enough
    b = _pinning()
    for e in b.events:
        e["time_us"] = T0
    a = _analysis(b)
    f = sll.detect_rank(a, Context([a]))
    assert f.evidence.blocks == 257  # the one born 1 us too late counts now


def test_blocks_from_before_the_trace_and_at_its_first_event_are_born_at_its_start():
    # 255 small blocks allocated before the trace (no event) and one as its first event; the rest of the trace
    # begins 15 ms later and ends 20 ms after the first event: all 256 lived through all of it
    b = SnapBuilder()
    segs = [b.segment(20 * MiB, record=False) for _ in range(25)] + [b.segment(140 * MiB, record=False)]
    b.alloc(segs[0], 0, SMALL)
    for i, s in enumerate(segs):
        for j in range(10):
            if (i, j) != (0, 0) and i * 10 + j < 256:
                b.alloc(s, j * 2 * MiB, SMALL, record=False)
    b.t = T0 + 15_000
    big = b.segment(64 * MiB)
    b.free(b.alloc(big, 0, 64 * MiB))
    b.t = T0 + DURATION - 10
    b.free(b.alloc(big, 0, 64 * MiB))
    a = _analysis(b)
    assert int(a.device.events["time_us"][0]) == T0 and int(a.device.events["time_us"][1]) == T0 + 15_000
    f = sll.detect_rank(a, Context([a]))
    # 25 segments with 5 MiB free each and the 26th (140 MiB) with 6 blocks
    assert (f.evidence.blocks, f.evidence.segments_pinned, f.bytes) == (256, 26, 25 * 5 * MiB + 131 * MiB)


@pytest.mark.parametrize("last_size, found", [
    (131 * MiB + 512 * KiB, True),  # exactly 256 MiB free in the pinned segments
    (131 * MiB, False),  # 512 KiB less
])
def test_pinned_free_bytes_from_256_mib(last_size, found):
    f = _small_long_lived(_pinning(last_size=last_size))
    if found:
        assert f.bytes == _pinned_free(last_size) == 256 * MiB
    else:
        assert f is None


@pytest.mark.parametrize("extra, found", [
    (2760 * MiB - (26 * 20 * MiB + 151 * MiB + 512 * KiB + 64 * MiB), True),  # reserved 2760 MiB: 276 is 10%
    (2770 * MiB - (26 * 20 * MiB + 151 * MiB + 512 * KiB + 64 * MiB), False),  # 2770 MiB: 276 is less than 10%
])
def test_pinned_free_bytes_from_a_tenth_of_reserved(extra, found):
    f = _small_long_lived(_pinning(extra_reserved=extra))
    if found:
        assert f.evidence.reserved_bytes == 2760 * MiB and f.bytes == 276 * MiB
    else:
        assert f is None


# --------------------------------------------------------------------------- rank-imbalance

def _sites(**deltas: int) -> dict:
    """Sites keyed as ranks.site_key does, each with its bytes, a block count of 2 and a SiteRef labelled by name."""
    return {f"/w/{name}.py:1:f": SiteBytes(b, 2, SiteRef(f"/w/{name}.py:1 in f", b, 2)) for name, b in deltas.items()}


def _profile(rank, peak, end, at_peak=None, at_end=None, group="all"):
    return RankProfile(rank, peak, peak + 512 * MiB, end, group, _sites(**(at_peak or {})), _sites(**(at_end or {})))


RI_FIXES = [
    Fix("per-rank-extras-off-gpu", versions="all",
        source="PyTorch FAQ 'Don't accumulate history across your training loop' "
               "(pytorch.org/docs/stable/notes/faq.html)", kind="code"),
    Fix("sharded-checkpoint",
        versions=">=2.2", source="torch/distributed/checkpoint/state_dict.py StateDictOptions", kind="code"),
]


def test_rank_imbalance_with_sites_still_held_at_the_end():
    # rank 4 peaks at 2816 MiB, the others at 2560 MiB: exactly 10% and exactly 256 MiB above them
    end_sites = dict(a=200 * MiB, b=150 * MiB, c=100 * MiB, d=60 * MiB, e=50 * MiB, f=16 * MiB, g=16 * MiB - 1)
    others_end = dict(a=10 * MiB, b=20 * MiB)
    pk = [_profile(4, 2816 * MiB, 1000 * MiB, at_peak={"p": 300 * MiB}, at_end=end_sites),
          _profile(5, 2560 * MiB, 200 * MiB, at_end=others_end),
          _profile(6, 2560 * MiB, 300 * MiB, at_end={"a": 30 * MiB})]
    (f,) = ri._detect_group(pk)
    # per site at the end: rank 4's bytes less the others' median (a: 10 and 30 -> 20; b: 20 and 0 -> 10)
    # five at most: f (exactly 16 MiB more) is the sixth site; g (1 byte less than 16 MiB more) is none
    extra = [{"site": "/w/a.py:1 in f", "bytes": 200 * MiB, "others_bytes": 20 * MiB, "blocks": 2},
             {"site": "/w/b.py:1 in f", "bytes": 150 * MiB, "others_bytes": 10 * MiB, "blocks": 2},
             {"site": "/w/c.py:1 in f", "bytes": 100 * MiB, "others_bytes": 0, "blocks": 2},
             {"site": "/w/d.py:1 in f", "bytes": 60 * MiB, "others_bytes": 0, "blocks": 2},
             {"site": "/w/e.py:1 in f", "bytes": 50 * MiB, "others_bytes": 0, "blocks": 2}]
    evidence = {"rank": 4, "peak_allocated_bytes": 2816 * MiB, "others_median_peak_allocated_bytes": 2560 * MiB,
                "excess_bytes": 256 * MiB, "peak_reserved_bytes": 3328 * MiB, "end_allocated_bytes": 1000 * MiB,
                "others_median_end_allocated_bytes": 250 * MiB, "ranks_compared": 3,
                "per_rank_peak_allocated_bytes": {4: 2816 * MiB, 5: 2560 * MiB, 6: 2560 * MiB},
                "extra_at_end": extra, "top_site_extra_bytes": 180 * MiB, "top_site_blocks": 2,
                "top_site": "/w/a.py:1 in f"}
    assert (f.id, f.severity, f.variant, f.ranks, f.bytes, f.per_rank_bytes) == (
        "rank-imbalance", "medium", "held-at-end", [4], 256 * MiB, {4: 256 * MiB})
    assert f.evidence.as_dict() == evidence and list(f.evidence.as_dict()) == list(evidence)
    assert [r.label for r in f.sites] == [f"/w/{n}.py:1 in f" for n in "abcde"]
    assert f.fixes == RI_FIXES
    # the whole group through detect_profiles: the same finding
    assert ri.detect_profiles(pk) == [f]


def test_rank_imbalance_with_sites_at_its_peak_only():
    # 1536 MiB against 1280 MiB: 256 MiB, exactly 20% above: high; nothing held more at the end
    peak_sites = dict(p=100 * MiB, q=16 * MiB, r=16 * MiB - 1)
    pk = [_profile(1, 1280 * MiB, 100 * MiB, at_peak={"p": 40 * MiB}, at_end={"z": 100 * MiB}),
          _profile(0, 1536 * MiB, 100 * MiB, at_peak=peak_sites, at_end={"z": 100 * MiB + 16 * MiB - 1}),
          _profile(2, 1280 * MiB, 100 * MiB, at_end={"z": 100 * MiB})]
    (f,) = ri._detect_group(pk)
    assert (f.severity, f.ranks, f.bytes) == ("high", [0], 256 * MiB)
    assert f.evidence.extra_at_end == []
    assert (f.evidence.top_site_extra_bytes, f.evidence.top_site_blocks, f.evidence.top_site) == (
        80 * MiB, 2, "/w/p.py:1 in f")  # p: 100 less the median of 40 and 0
    assert f.evidence.others_median_end_allocated_bytes == 100 * MiB
    assert f.variant == "most-different"
    assert [r.label for r in f.sites] == ["/w/p.py:1 in f", "/w/q.py:1 in f"]


def test_a_site_exactly_16_mib_more_at_the_end_is_extra():
    pk = [_profile(0, 2816 * MiB, 116 * MiB, at_peak={"p": 300 * MiB}, at_end={"z": 116 * MiB}),
          _profile(1, 2560 * MiB, 100 * MiB, at_end={"z": 100 * MiB})]
    (f,) = ri._detect_group(pk)
    assert f.evidence.as_dict()["extra_at_end"] == [
        {"site": "/w/z.py:1 in f", "bytes": 116 * MiB, "others_bytes": 100 * MiB, "blocks": 2}]
    assert (f.evidence.top_site, f.evidence.top_site_extra_bytes) == ("/w/z.py:1 in f", 16 * MiB)
    assert [r.label for r in f.sites] == ["/w/z.py:1 in f"]


def test_rank_imbalance_without_any_site_says_no_more():
    pk = [_profile(0, 2816 * MiB, 0), _profile(1, 2560 * MiB, 0)]
    (f,) = ri._detect_group(pk)
    assert "top_site" not in f.evidence.as_dict() and f.sites == [] and f.variant == ""


@pytest.mark.parametrize("peaks", [
    (2816 * MiB - 512, 2560 * MiB),  # 512 bytes short of 10% (and of 256 MiB)
    (5120 * MiB + 300 * MiB, 5120 * MiB),  # 300 MiB above, but under 10%
    (1000 * MiB + 255 * MiB, 1000 * MiB),  # 25.5% above, but under 256 MiB
])
def test_a_rank_must_be_both_10_percent_and_256_mib_above(peaks):
    assert ri._detect_group([_profile(r, p, 0) for r, p in enumerate(peaks)]) == []


def _ranked(name: str, meta: dict | None = None, fr=None, sites: int = 1):
    """A rank whose trace holds ``sites`` blocks of 64 MiB from different lines at its peak, then frees all
    but the first."""
    b = SnapBuilder()
    seg = b.segment(GiB)
    blocks = [b.alloc(seg, i * 64 * MiB, 64 * MiB, fr=fr or frames(("/w/train.py", 10 + i, "step")))
              for i in range(sites)]
    for x in blocks[1:]:
        b.free(x)
    return analyze(from_snapshot(b.snapshot(), name, meta))


@pytest.mark.parametrize("meta, fr, group", [
    ({"pp_rank": 1}, None, "stage 1"),
    ({"pipeline_stage": 2}, None, "stage 2"),
    ({"pp_rank": 0, "pipeline_stage": 5}, None, "stage 0"),  # pp_rank first
    ({"pipeline_stage": 2}, frames(PIPELINE, MAIN), "stage 2"),
    (None, frames(PIPELINE, MAIN), "pipeline rank 3"),  # a pipeline stage not known: compared with nobody
    (None, None, "all"),
])
def test_ranks_are_grouped_by_pipeline_stage(meta, fr, group):
    assert ri._group(_ranked("rank3.pickle", meta, fr)) == group


def test_profile_has_every_site_at_the_peak_and_at_the_end():
    a = _ranked("rank2.pickle", sites=7)
    p = ri.profile(a)
    assert (p.rank, p.peak_allocated_bytes, p.end_allocated_bytes, p.group) == (2, 7 * 64 * MiB, 64 * MiB, "all")
    assert p.peak_reserved_bytes == GiB
    assert sorted(p.sites_at_peak) == [f"/w/train.py:{10 + i}:step" for i in range(7)]  # all seven, not five
    assert [(s.bytes, s.count, s.ref.label) for s in p.sites_at_peak.values()] == [
        (64 * MiB, 1, f"/w/train.py:{10 + i} in step") for i in range(7)]
    assert list(p.sites_at_end) == ["/w/train.py:10:step"]
    assert p.sites_at_end["/w/train.py:10:step"].ref.label == "/w/train.py:10 in step"


# --------------------------------------------------------------------------- pipeline-output-cache

def _pp_frames(name: str = "forward_one_chunk", line: int = 36) -> list[dict]:
    return frames((f"{TORCH}/nn/modules/linear.py", 134, "forward"), ("/w/model.py", line, "forward"),
                  (f"{TORCH}/distributed/pipelining/stage.py", 699, name), ("/w/train.py", 80, "main"))


def _schedule(micro: int = 8, size: int = 500 * MiB, frees: str = "burst", fr=None, setup: int = 0,
              first_at_zero: bool = False, groups=None) -> SnapBuilder:
    """Per micro-batch one output of ``size`` bytes (``groups``: several outputs per micro-batch, one per
    ``(line, size, count)``: the first ``count`` micro-batches make it), then ten 100 MiB temporaries; after the
    last micro-batch the outputs are freed one after another (``burst``), with five temporaries between each
    (``spread``), or not at all (``never``). ``setup``: allocations freed at once before the first output."""
    b = SnapBuilder()
    seg = b.segment(64 * GiB, record=not first_at_zero)
    for _ in range(setup):
        b.free(b.alloc(seg, 60 * GiB, MiB))
    groups = groups or [(36, size, micro)]
    outs = []
    for m in range(max(c for _l, _s, c in groups)):
        for j, (line, sz, count) in enumerate(groups):
            if m < count:
                outs.append((j, b.alloc(seg, (m * len(groups) + j) * 512 * MiB, sz, fr=fr or _pp_frames(line=line))))
        for _ in range(10):
            b.free(b.alloc(seg, 50 * GiB, 100 * MiB))
    for _j, o in sorted(outs) if frees != "never" else []:  # one group after the other
        b.free(o)
        if frees == "spread":
            for _ in range(5):
                b.free(b.alloc(seg, 50 * GiB, 100 * MiB))
    return b


def _pipeline_finding(b: SnapBuilder, version: TorchVersion | None = None):
    a = _analysis(b)
    v = version or TorchVersion((2, 9), None, "2.9.1")
    return poc.detect_rank(a, SimpleNamespace(analyses=[a], versions={a.rank: v}))


def _held_us(b: SnapBuilder, fr_line: int = 36) -> list[int]:
    """Per output of ``fr_line``: the time from its alloc to its free_requested (to the last event when never
    freed), from the recorded events."""
    born = {e["addr"]: e["time_us"] for e in b.events
            if e["action"] == "alloc" and e["frames"] == _pp_frames(line=fr_line)}
    freed = {e["addr"]: e["time_us"] for e in b.events if e["action"] == "free_requested" and e["addr"] in born}
    return [freed.get(addr, b.events[-1]["time_us"]) - t for addr, t in born.items()]


def _poc_fixes(return_outputs_applies, patch_applies) -> list[Fix]:
    return [
        Fix("return-outputs-false", versions=">=2.10",
            source="pytorch/pytorch PR #165822; torchtitan PR #1922", kind="code", setting="return_outputs=False",
            applies=return_outputs_applies),
        Fix("skip-output-chunks", versions="2.4-2.9",
            source="pytorch/pytorch issue #159251; discuss.pytorch.org/t/221886", kind="code",
            applies=patch_applies),
        Fix("chunked-loss", versions="all",
            source="github.com/pytorch/torchtitan/blob/main/docs/chunked_loss.md", kind="code"),
    ]


def test_pipeline_outputs_kept_until_one_burst_of_frees():
    b = _schedule()
    f = _pipeline_finding(b)
    held = _held_us(b)
    assert len(held) == 8
    evidence = {"outputs_kept": 8, "output_bytes": 500 * MiB, "kept_bytes": 8 * 500 * MiB,
                "micro_batches_seen": 8, "median_held_us": int(np.median(held)),
                "peak_allocated_bytes": 8 * 500 * MiB + 100 * MiB, "torch_version": "2.9.1"}
    assert (f.id, f.severity, f.variant, f.ranks, f.bytes, f.per_rank_bytes) == (
        "pipeline-output-cache", "high", "", [0], 8 * 500 * MiB, {0: 8 * 500 * MiB})
    assert f.evidence.as_dict() == evidence and list(f.evidence.as_dict()) == list(evidence)
    assert f.fixes == _poc_fixes(False, True)
    assert [(s.label, s.bytes, s.count) for s in f.sites] == [("/w/model.py:36 in forward", 8 * 500 * MiB, 8)]


@pytest.mark.parametrize("version, return_outputs, patch", [
    (TorchVersion((2, 9), None, "2.9.1"), False, True),
    (TorchVersion((2, 10), None, "2.10.0"), True, False),
    (TorchVersion((2, 11), None, "2.11.0"), True, False),
    (TorchVersion(None, (2, 10), ">= 2.10 (snapshot has 'x')"), True, False),
    (TorchVersion(None, (2, 8), ">= 2.8 (snapshot has 'x')"), None, None),
    (TorchVersion(None, None, "unknown"), None, None),
])
def test_pipeline_fixes_apply_by_version(version, return_outputs, patch):
    f = _pipeline_finding(_schedule(), version)
    assert f.fixes == _poc_fixes(return_outputs, patch)
    assert f.evidence.torch_version == version.text


def test_pipeline_outputs_never_freed_are_held_to_the_last_event():
    b = _schedule(micro=4, frees="never")
    f = _pipeline_finding(b)
    held = _held_us(b)
    # a micro-batch is 31 events of 10 us (its output, then ten temporaries: alloc, free_requested,
    # free_completed); the last output lives through the 30 events after it
    assert held == [1230, 920, 610, 300]
    assert (f.evidence.outputs_kept, f.evidence.micro_batches_seen, f.evidence.median_held_us) == (
        4, 4, 765)


def test_pipeline_outputs_kept_are_the_blocks_alive_at_once_with_their_own_sizes():
    """Issue 52: the first micro-batch's output took a block 1 MiB larger than asked (an unsplit remainder, which
    the final segments show: the trace ends before step() frees them); the bytes kept are the blocks' own sizes
    added up, as the report's holders and the finding's site say them, never the count times the largest."""
    b = SnapBuilder()
    seg = b.segment(64 * GiB)
    outs = [b.alloc(seg, 0, 501 * MiB, requested=500 * MiB, fr=_pp_frames())]
    for m in range(1, 4):
        outs.append(b.alloc(seg, m * 512 * MiB, 500 * MiB, fr=_pp_frames()))
        for _ in range(10):
            b.free(b.alloc(seg, 50 * GiB, 100 * MiB))
    f = _pipeline_finding(b)
    assert (f.evidence.outputs_kept, f.evidence.output_bytes) == (4, 500 * MiB)
    assert f.evidence.kept_bytes == f.bytes == f.per_rank_bytes[0] == 4 * 500 * MiB + MiB
    assert [(s.bytes, s.count) for s in f.sites] == [(f.bytes, 4)]


def test_pipeline_outputs_freed_one_by_one_are_not_cached():
    # 12 outputs after 300 setup allocations: each free 12 events after the last (within 10% of the 231 events
    # the allocations span), but all of them over 132 events: not one burst
    assert _pipeline_finding(_schedule(micro=12, frees="spread", setup=300)) is None


def test_only_forward_one_chunk_makes_pipeline_outputs():
    assert _pipeline_finding(_schedule(fr=_pp_frames(name="get_fwd_send_ops"))) is None


def test_an_output_at_the_first_event_counts():
    b = _schedule(micro=3, size=100 * MiB, first_at_zero=True)
    assert b.events[0]["action"] == "alloc" and b.events[0]["size"] == 100 * MiB
    f = _pipeline_finding(b)
    # three outputs of 100 MiB: 300 MiB, above the 256 MiB a cache must hold
    assert (f.evidence.outputs_kept, f.evidence.micro_batches_seen, f.bytes) == (3, 3, 300 * MiB)


@pytest.mark.parametrize("counts, winner", [((5, 3), 36), ((3, 5), 37)])
def test_the_group_keeping_most_bytes_wins(counts, winner):
    # two sites of one stage, each kept until the burst: the one keeping more bytes at once is the finding
    b = _schedule(groups=[(36, 300 * MiB, counts[0]), (37, 300 * MiB, counts[1])])
    f = _pipeline_finding(b)
    assert (f.bytes, f.evidence.outputs_kept) == (5 * 300 * MiB, 5)
    assert f.sites[0].label == f"/w/model.py:{winner} in forward"


# --------------------------------------------------------------------------- fragmentation

V29 = TorchVersion((2, 9), None, "2.9.0")
V28 = TorchVersion((2, 8), None, "2.8.0")


def _frag_fixes(env: str, split: int, expandable: bool, capped: bool, varies: bool = False, applies=True) -> list[Fix]:
    out = []
    if expandable:
        out.append(Fix(
            "expandable-segments", versions=">=2.1",
            source="pytorch/pytorch PR #96995; pytorch.org/docs/stable/notes/cuda.html"
                   "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf",
            kind="env", setting=f"{env}=expandable_segments:True", applies=applies,
            what_if={"config": "expandable_segments:True"}))
    out.append(Fix(
        "max-split-size", versions=">=1.10",
        source="pytorch.org/docs/stable/notes/cuda.html; CUDACachingAllocator.cpp get_free_block/should_split",
        kind="env", setting=f"{env}=max_split_size_mb:{split}", what_if={"config": f"max_split_size_mb:{split}"}))
    if capped:
        out.append(Fix(
            "garbage-collection-threshold", versions=">=1.12", source="CUDACachingAllocator.cpp garbage_collect_cached_blocks", kind="env",
            setting=f"{env}=garbage_collection_threshold:0.8", what_if={"config": "garbage_collection_threshold:0.8"}))
    if varies:
        out.append(Fix("vary-shapes-less",
            versions="all", source="PyTorch CUDA semantics notes, 'Optimizing memory usage with "
                                   "PYTORCH_CUDA_ALLOC_CONF' (pytorch.org/docs/stable/notes/cuda.html)", kind="code"))
    return out


@pytest.mark.parametrize("expandable, asked, capped, v, env, split", [
    (False, 60 * MiB, True, V29, "PYTORCH_ALLOC_CONF", 30),
    (False, 0, False, V28, "PYTORCH_CUDA_ALLOC_CONF", 512),
    (True, 4 * GiB, True, V28, "PYTORCH_CUDA_ALLOC_CONF", 1024),
])
def test_fragmentation_fixes_in_full(expandable, asked, capped, v, env, split):
    assert frag._fixes(v, expandable, asked, capped) == _frag_fixes(env, split, not expandable, capped, False)
    # padding or bucketing sequence lengths only for a job whose shapes vary (shapes_vary)
    assert frag._fixes(v, expandable, asked, capped, True) == _frag_fixes(env, split, not expandable, capped, True)


def _stranded_oom(request: int, holes: int = 40 * MiB, device_free: int = 0, expandable_setting: bool = False):
    """Four 100 MiB segments, each with a live block in its middle leaving two holes of ``holes`` bytes, then an
    OOM asking for ``request`` bytes."""
    b = SnapBuilder()
    for s in [b.segment(100 * MiB) for _ in range(4)]:
        b.alloc(s, holes, 100 * MiB - 2 * holes)
    b.oom(request, device_free=device_free)
    b.settings["expandable_segments"] = expandable_setting
    return b


def _fragmentation(b: SnapBuilder, v: TorchVersion = V29, meta: dict | None = None):
    a = analyze(from_snapshot(b.snapshot(), "rank0.pickle", meta))
    return frag.detect_rank(a, SimpleNamespace(analyses=[a], versions={a.rank: v}))


def test_fragmentation_at_an_oom_in_full():
    # 4 x 100 MiB reserved, 4 x 20 MiB allocated, holes of 40 MiB; 60 MiB asked; the device had 60 MiB free
    f = _fragmentation(_stranded_oom(60 * MiB, device_free=60 * MiB))
    evidence = {"oom_event": 8, "requested_bytes": 60 * MiB, "cuda_malloc_bytes": 60 * MiB,
                "reserved_bytes": 400 * MiB, "allocated_bytes": 80 * MiB, "reserved_unallocated_bytes": 320 * MiB,
                "largest_free_block_bytes": 40 * MiB, "largest_free_block_any_stream_bytes": 40 * MiB,
                "free_in_used_segments_bytes": 320 * MiB, "free_segments_bytes": 0, "pending_free_bytes": 0,
                "device_free_bytes": 60 * MiB, "pool": "large", "stream": 0, "segments": 4,
                "expandable_segments": False}
    assert (f.id, f.severity, f.variant, f.ranks, f.bytes, f.per_rank_bytes, f.sites) == (
        "fragmentation", "critical", "oom", [0], 320 * MiB, {0: 320 * MiB}, [])
    assert f.evidence.as_dict() == evidence and list(f.evidence.as_dict()) == list(evidence)
    # the device had the 60 MiB: a memory fraction refused them, so the collector is proposed
    assert f.fixes == _frag_fixes("PYTORCH_ALLOC_CONF", 30, True, True)


def test_fragmentation_at_an_oom_with_expandable_segments_set():
    f = _fragmentation(_stranded_oom(60 * MiB, expandable_setting=True))
    assert f.evidence.expandable_segments is True
    assert f.fixes == _frag_fixes("PYTORCH_ALLOC_CONF", 30, False, False)


@pytest.mark.parametrize("asked, holes, found", [
    (40 * MiB, 40 * MiB, False),  # the largest free block fits the request: not fragmentation
    (40 * MiB + 2 * MiB, 40 * MiB, True),
    (60 * MiB, 7680 * KiB, True),  # 4 x 2 x 7.5 MiB = 60 MiB unallocated: exactly the request
    (62 * MiB, 7680 * KiB, False),  # more than all the free bytes: capacity, not fragmentation
])
def test_fragmentation_at_an_oom_boundaries(asked, holes, found):
    f = _fragmentation(_stranded_oom(asked, holes=holes))
    assert (f is not None) is found
    if found:
        assert (f.evidence.requested_bytes, f.evidence.largest_free_block_bytes, f.bytes) == (
            asked, holes, 8 * holes)


def _stranded_peak(segments: int = 8, kept: int = 64 * MiB, size: int = 512 * MiB, expandable_setting=False):
    """Per segment of ``size`` bytes: a block of ``kept`` bytes that stays, and the rest of the segment in one
    block that is freed; the segments are never released."""
    b = SnapBuilder()
    b.settings["expandable_segments"] = expandable_setting
    for _ in range(segments):
        s = b.segment(size)
        b.alloc(s, 0, kept)
        b.free(b.alloc(s, kept, size - kept))
    return b


def test_fragmentation_at_the_peak_of_reserved():
    # reserved peaks with the 8th segment (4 GiB), taken at the allocation it was made for (its 64 MiB block):
    # every segment then holds 64 MiB and 448 MiB free
    f = _fragmentation(_stranded_peak(), V28)
    evidence = {"peak_reserved_bytes": 4 * GiB, "allocated_at_peak_bytes": 8 * 64 * MiB,
                "free_in_used_segments_bytes": 8 * 448 * MiB, "free_segments_bytes": 0,
                "largest_free_block_bytes": 448 * MiB, "segments": 8}
    assert (f.id, f.severity, f.variant, f.ranks, f.bytes, f.per_rank_bytes, f.sites) == (
        "fragmentation", "high", "stranded", [0], 8 * 448 * MiB, {0: 8 * 448 * MiB}, [])
    assert f.evidence.as_dict() == evidence and list(f.evidence.as_dict()) == list(evidence)
    assert f.fixes == _frag_fixes("PYTORCH_CUDA_ALLOC_CONF", 512, True, False)


def test_no_stranded_finding_with_expandable_segments():
    assert _fragmentation(_stranded_peak(expandable_setting=True)) is None


@pytest.mark.parametrize("segments, size, kept, meta, found", [
    (4, 512 * MiB, 256 * MiB, None, True),  # 4 x 256 MiB = exactly 1 GiB stranded (reserved 2 GiB)
    (4, 512 * MiB, 256 * MiB + 512, None, False),  # 2 KiB less
    # 8 x 128 MiB = 1 GiB stranded of 8 GiB reserved: less than a quarter of it
    (8, GiB, 896 * MiB, None, False),
    (8, 4 * GiB, 3968 * MiB, {"memory_cap_bytes": 40 * GiB}, False),
    (2, GiB, 512 * MiB, {"memory_cap_bytes": 40 * GiB}, True),  # 1 GiB of 2 GiB, under a sidecar's cap
])
def test_stranded_bytes_from_1_gib_and_a_quarter_of_reserved(segments, size, kept, meta, found):
    f = _fragmentation(_stranded_peak(segments, kept, size), V28, meta)
    if not found:
        assert f is None
        return
    assert (f.bytes, f.evidence.peak_reserved_bytes) == (GiB, segments * size)
    assert f.fixes == _frag_fixes("PYTORCH_CUDA_ALLOC_CONF", 512, True, meta is not None)


# --------------------------------------------------------------------------- allgather-list

C10D = f"{TORCH}/distributed/distributed_c10d.py"
AG = frames((C10D, 4079, "all_gather"), ("/w/train.py", 26, "main"))


def _gathers(sizes, fr=AG, first_at_zero: bool = False) -> SnapBuilder:
    """One all_gather into a list per size: its flat buffer, freed after the copy into the list; a 512 MiB
    block stays from the start."""
    b = SnapBuilder()
    seg = b.segment(2 * GiB, record=not first_at_zero)
    for i, size in enumerate(sizes):
        b.free(b.alloc(seg, 0, size, fr=fr))
        if i == 0:
            b.alloc(seg, GiB, 512 * MiB, fr=frames(("/w/train.py", 20, "main")))
    return b


def _allgather(b: SnapBuilder, drop_first: int = 0):
    a = _analysis(b, drop_first)
    return agl.detect_rank(a, Context([a]))


AG_FIXES = [
    Fix("all-gather-into-tensor", versions=">=1.13",
        source="pytorch/pytorch PR #85686; DeepSpeed PR #4705", kind="code", setting="all_gather_into_tensor"),
    Fix("reduce-scatter-tensor", versions=">=1.13",
        source="pytorch/pytorch PR #85686", kind="code"),
]


@pytest.mark.parametrize("first_at_zero", [False, True])
def test_allgather_list_in_full(first_at_zero):
    b = _gathers([64 * MiB, 256 * MiB, 32 * MiB], first_at_zero=first_at_zero)
    f = _allgather(b)
    evidence = {"calls": 3, "flat_buffer_bytes_total": 352 * MiB, "largest_flat_buffer_bytes": 256 * MiB,
                "extra_copies_per_call": 2, "peak_reserved_bytes": 2 * GiB, "peak_allocated_bytes": 768 * MiB}
    assert (f.id, f.severity, f.variant, f.ranks, f.bytes, f.per_rank_bytes) == (
        "allgather-list", "medium", "", [0], 256 * MiB, {0: 256 * MiB})
    assert f.evidence.as_dict() == evidence and list(f.evidence.as_dict()) == list(evidence)
    assert f.fixes == AG_FIXES
    assert [(s.label, s.count) for s in f.sites] == [("/w/train.py:26 in main", 3)]
    a = _analysis(b)
    assert agl.detect(Context([a])) == [agl.detect_rank(a, Context([a]))]


def test_allgather_list_needs_all_gather_as_the_innermost_python_frame():
    inner = frames(("/w/helpers.py", 3, "gather"), (C10D, 4079, "all_gather"), ("/w/train.py", 26, "main"))
    assert _allgather(_gathers([64 * MiB] * 3, fr=inner)) is None
    assert _allgather(_gathers([64 * MiB] * 3, fr=frames((C10D, 2800, "all_reduce"), ("/w/train.py", 26, "main")))) \
        is None


def test_allgather_buffers_from_before_the_trace_are_not_counted():
    # a flat buffer still allocated when the ring buffer starts: not a call the trace saw
    b = SnapBuilder()
    seg = b.segment(2 * GiB)
    b.alloc(seg, 0, 128 * MiB, fr=AG)
    b.free(b.alloc(seg, GiB, 64 * MiB, fr=AG))
    f = _allgather(b, drop_first=2)  # the segment and the first buffer's alloc
    assert (f.evidence.calls, f.bytes) == (1, 64 * MiB)


# --------------------------------------------------------------------------- device_room

def _room(meta: dict | None, oom_free: int | None = None) -> Room:
    """A 16 GiB segment holding 1 GiB, then an OOM whose ``device_free`` is ``oom_free`` (none when None)."""
    b = SnapBuilder()
    seg = b.segment(16 * GiB)
    b.alloc(seg, 0, GiB)
    if oom_free is not None:
        b.oom(32 * GiB, device_free=oom_free)
    return device_room(analyze(from_snapshot(b.snapshot(), "rank0.pickle", meta)))


@pytest.mark.parametrize("meta, oom_free, room", [
    (None, 3 * GiB, Room(bytes=19 * GiB, kind="device", source="oom-device")),
    ({"device_free_bytes": 2 * GiB, "memory_stats": {"reserved_bytes.all.current": 16 * GiB}}, None,
     Room(bytes=18 * GiB, kind="device", source="sidecar-free")),
    ({"gpu_total_memory_bytes": 80 * GiB, "world_size": 1}, None,
     Room(bytes=80 * GiB - CUDA_CONTEXT_BYTES, kind="estimated", source="gpu-total",
          values={"given": False, "nccl": False})),
    ({"gpu_total_memory_bytes": 80 * GiB, "world_size": 2}, None,
     Room(bytes=80 * GiB - CUDA_CONTEXT_BYTES - NCCL_FIRST_COMMUNICATOR_BYTES, kind="estimated",
          source="gpu-total", values={"given": False, "nccl": True})),
    ({"gpu_total_memory_bytes": 1}, None,
     Room(bytes=1 - CUDA_CONTEXT_BYTES, kind="estimated", source="gpu-total",
          values={"given": False, "nccl": False})),
    ({"gpu_total_memory_bytes": 0}, None, Room(bytes=None, kind="none", source="none")),
    (None, None, Room(bytes=None, kind="none", source="none")),
], ids=["oom", "sidecar", "one-rank", "two-ranks", "one-byte-gpu", "zero-byte-gpu", "nothing"])
def test_device_room_from_each_source(meta, oom_free, room):
    assert _room(meta, oom_free) == room


# --------------------------------------------------------------------------- cache-flush

EMPTY_CACHE = frames((f"{TORCH}/cuda/memory.py", 224, "empty_cache"), ("/w/eval.py", 70, "main"))


def _flushing(record: str = "_record", last_batch: bool = False) -> tuple[SnapBuilder, dict]:
    """An evaluation loop of six batches. empty_cache() flushes a segment made for a model block: at setup,
    in batch 0 before a CUDA graph's recording, in batches 1, 2 and 3 (the ones that count), in batch 4 right
    before an OOM the loop survives, and after the last batch (``last_batch``: also inside the last batch, before
    its last model allocation; ``record``: the function of cudagraph_trees.py after batch 0's flush). Returns the builder and the event indices of the
    counted flushes and of the segments made after the first of them."""
    b = SnapBuilder()
    main = b.segment(8 * GiB)
    b.alloc(main, 0, 256 * MiB, fr=BASE)
    marks: dict = {"flushes": [], "segments_after": []}

    def flush(size, fr=model(50), counted=False):
        if marks["flushes"]:
            marks["segments_after"].append(len(b.events))
        s = b.segment(size)
        b.free(b.alloc(s, 0, size, fr=fr))
        if counted:
            marks["flushes"].append(len(b.events))
        b.free_segment(s, fr=EMPTY_CACHE)

    flush(128 * MiB, fr=BASE)  # setup
    off = 256 * MiB
    for i in range(6):
        x = b.alloc(main, off, MiB, fr=INPUT)
        off += MiB
        b.free(b.alloc(main, off, 64 * MiB, fr=model(20)))
        if i == 0:
            flush(16 * MiB)
            b.free(b.alloc(main, off, 8 * MiB, fr=frames((f"{TORCH}/_inductor/cudagraph_trees.py", 700, record),
                                                          ("/w/eval.py", 30, "main"))))
        if i in (1, 2, 3):
            flush(64 * MiB, counted=True)
        if i == 4:
            flush(32 * MiB)
            b.oom(4 * GiB, device_free=0)
        if i == 5 and last_batch:
            flush(4 * MiB)
        b.free(b.alloc(main, off, 64 * MiB, fr=model(21)))
        b.free(x)
    flush(8 * MiB, fr=BASE)  # after the last model allocation
    return b, marks


def test_cache_flush_counts_the_flushes_inside_the_passes():
    b, marks = _flushing()
    a = analyze(from_snapshot(b.snapshot(), "rank0.pickle", {"recording": {"context": "all"}}))
    f = cf.detect_rank(a, Context([a]))
    t = [e["time_us"] for e in b.events]
    # each counted flush: from the event before its segment free to it; each segment made after the first
    # counted flush (batches 2, 3 and 4, and after the loop): from the event before it
    flush_us = sum(t[k] - t[k - 1] for k in marks["flushes"]) + sum(t[k] - t[k - 1] for k in marks["segments_after"])
    assert len(marks["segments_after"]) == 4 and flush_us == 7 * 10
    evidence = {"segment_free_bursts": 3, "empty_cache_bursts": 3, "allocator_retry_bursts": 0,
                "num_alloc_retries": 0, "freed_bytes": 3 * 64 * MiB,
                "reallocated_after_bytes": 64 * MiB + 64 * MiB + 32 * MiB + 8 * MiB,
                "last_flush_event": marks["flushes"][-1], "bursts_classified_by": "free stacks",
                "flush_time_us": flush_us, "cuda_malloc_calls_after": 4, "alloc_retries": 0,
                "alloc_retries_source": "inferred from segment-free bursts"}
    assert (f.id, f.severity, f.variant, f.ranks, f.bytes, f.per_rank_bytes, f.sites) == (
        "cache-flush", "low", "empty-cache", [0], 0, {0: 0}, [])
    assert f.evidence.as_dict() == evidence and list(f.evidence.as_dict()) == list(evidence)
    assert f.fixes == [Fix("empty-cache-at-phase-changes", versions="all",
        source="discuss.pytorch.org/t/34232 (albanD); pytorch.org/docs/stable/notes/cuda.html#memory-management",
        kind="code")]
    # the segment frees, one burst each: only batches 1 to 3's are training bursts
    act = a.device.events["action"]
    frees = np.flatnonzero(act == SEGMENT_FREE)
    assert frees.size == 7
    keep = cf._training_bursts(a, frees, np.arange(7))
    assert keep.tolist() == [False, False, True, True, True, False, False]
    assert frees[keep].tolist() == marks["flushes"]
    assert cf._training_bursts(a, frees[:0], np.arange(0)).tolist() == []


@pytest.mark.parametrize("record, last_batch, kept", [
    ("_record", False, [False, False, True, True, True, False, False]),
    ("record_function", False, [False, False, True, True, True, False, False]),
    ("run", False, [False, True, True, True, True, False, False]),  # not the recording of a graph: it counts
    ("_record", True, [False, False, True, True, True, False, True, False]),  # before the last model allocation
])
def test_training_bursts_are_inside_the_passes_and_not_before_an_oom_or_a_graph(record, last_batch, kept):
    b, _ = _flushing(record, last_batch)
    a = analyze(from_snapshot(b.snapshot(), "rank0.pickle", {"recording": {"context": "all"}}))
    frees = np.flatnonzero(a.device.events["action"] == SEGMENT_FREE)
    assert cf._training_bursts(a, frees, np.arange(frees.size)).tolist() == kept


def test_cache_flush_without_free_stacks_names_both_causes():
    # recorded with context="alloc" and no memory_stats: the three bursts cannot be told apart
    b, marks = _flushing()
    a = analyze(from_snapshot(b.snapshot(), "rank0.pickle", {"recording": {"context": "alloc"}}))
    f = cf.detect_rank(a, Context([a]))
    assert (f.evidence.bursts_classified_by, f.evidence.empty_cache_bursts) == ("unknown", 3)
    assert (f.variant, f.evidence.segment_free_bursts, f.evidence.flush_time_us) == ("churn-unknown", 3, 70)
    assert [x.id for x in f.fixes] == ["empty-cache-at-phase-changes"]


RETRY_FIX = Fix("lower-peak-no-retries",
                versions="all", source="zdevito 'A guide to PyTorch's CUDA Caching Allocator'; torchtitan metrics.py",
                kind="code")


def test_allocator_retries_from_memory_stats_alone():
    # no segment was freed in the trace, but the sidecar counts one retry
    b = SnapBuilder()
    seg = b.segment(GiB)
    b.free(b.alloc(seg, 0, 512 * MiB))
    a = analyze(from_snapshot(b.snapshot(), "rank0.pickle", {"memory_stats": {"num_alloc_retries": 1},
                                                              "recording": {"context": "alloc"}}))
    f = cf.detect_rank(a, Context([a]))
    evidence = {"segment_free_bursts": 0, "empty_cache_bursts": 0, "allocator_retry_bursts": 0,
                "num_alloc_retries": 1, "freed_bytes": 0, "reallocated_after_bytes": 0, "last_flush_event": -1,
                "bursts_classified_by": "memory_stats", "flush_time_us": 0,
                "cuda_malloc_calls_after": 0, "alloc_retries": 1, "alloc_retries_source": "sidecar"}
    assert f.evidence.as_dict() == evidence
    assert (f.variant, f.severity, f.bytes) == ("retries", "low", 0)
    assert f.fixes == [RETRY_FIX]


def test_retries_counted_by_memory_stats_less_the_ooms():
    # the sidecar counts two retries; one was the OOM's own: one retry and two of the three bursts were flushes
    b, _ = _flushing()
    a = analyze(from_snapshot(b.snapshot(), "rank0.pickle", {"recording": {"context": "alloc"},
                                                              "memory_stats": {"num_alloc_retries": 2}}))
    f = cf.detect_rank(a, Context([a]))
    assert (f.evidence.num_alloc_retries, f.evidence.empty_cache_bursts, f.evidence.allocator_retry_bursts,
            f.evidence.bursts_classified_by) == (1, 2, 1, "memory_stats")
    assert [x.id for x in f.fixes] == ["empty-cache-at-phase-changes", RETRY_FIX.id]


# --------------------------------------------------------------------------- _margin

def test_margin_after_exactly_two_steps_keeps_the_state_made_after_the_first_peak(tmp_path):
    # two finished steps, optimizer state made lazily at step 1 (after step 0's peak), then an OOM in step 2
    a = analysed(tmp_path, oom_after_steps(2, state_step1=80 * MiB))
    base, _ = job_margin(a)
    assert _margin(a, 2000 * MiB) == (base + 80 * MiB, None)


def test_margin_without_a_finished_step_says_so_whole(tmp_path):
    r, _ = oom_in_first_backward()
    a = analysed(tmp_path, r)
    base, _ = job_margin(a)
    assert _margin(a, 2000 * MiB) == (base + 2 * (2 * PARAM) + 2 * PARAM, "optimizer-state-assumed")


def test_margin_of_a_forward_only_oom_is_the_jobs_own(tmp_path):
    # parameters, one forward pass, an OOM: no backward ran, so no optimizer state is to come
    r = train(0)
    r.forward(64 * MiB)
    r.b.oom(64 * MiB, device_free=0)
    a = analysed(tmp_path, r)
    assert not a.phases.has_backward
    assert _margin(a, 2000 * MiB) == (job_margin(a)[0], None)


def test_margin_after_one_step_keeps_the_state_made_below_its_peak(tmp_path):
    # one finished step whose optimizer state (4 x 64 MiB) is made after its activations and gradients are
    # freed, below the step's peak; then the next step's forward runs out: two step starts, the state kept free
    a = analysed(tmp_path, oom_after_steps(1, late_state=True))
    assert len(a.phases.steps) == 2
    base, _ = job_margin(a)
    assert _margin(a, 2000 * MiB) == (base + 4 * STATE, None)


def test_margin_with_optimizer_state_but_no_second_step_is_the_jobs_own(tmp_path):
    # the first step's optimizer made its state, then ran out: the state is there, nothing is estimated
    r = train(0)
    r.forward(64 * MiB)
    for _ in range(2):
        r.alloc(GRAD, [])
    for _ in range(4):
        r.alloc(STATE, OPT_STATE)
    r.b.oom(STATE, device_free=0)
    a = analysed(tmp_path, r)
    assert a.phases.has_backward and (a.phases.steps is None or len(a.phases.steps) < 2)
    assert _margin(a, 2000 * MiB) == (job_margin(a)[0], None)
