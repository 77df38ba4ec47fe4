"""The words of the findings and fixes (render/words/findings.py): each finding id + variant and each fix id, filled
from the numbers its detector gives (the rule tests assert those numbers: test_detector_rules.py and others)."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

import oomdoctor.detectors as detectors_pkg
from oomdoctor.detectors.finding import Evidence, Finding, FindingTitle, Fix
from oomdoctor.detectors.registry import EVIDENCE
from oomdoctor.render.words import findings as words
from oomdoctor.render.words import verdict as verdict_words
from oomdoctor.report.verdict import Action, Verdict
from oomdoctor.units import GiB, MiB

_BLANK = {int: 0, float: 0.0, str: "", bool: False}


def _f(id: str, variant: str, evidence: dict) -> Finding:
    """A finding of the kind ``(id, variant)`` with ``evidence``: its class's (:data:`EVIDENCE`), the fields the words
    do not read left blank (0, "", [], {}); a kind no detector writes has the bare :class:`Evidence`."""
    cls = EVIDENCE.get((id, variant), Evidence)
    hints = typing.get_type_hints(cls)
    names = {x.name for x in dataclasses.fields(cls)}
    assert set(evidence) <= names, f"{cls.__name__} has no field {sorted(set(evidence) - names)}"
    required = [x.name for x in dataclasses.fields(cls) if x.default is dataclasses.MISSING]
    blank = {n: _BLANK.get(hints[n], typing.get_origin(hints[n])) for n in required if n not in evidence}
    return Finding(id, "high", [0], 0, cls(**{k: x() if callable(x) else x for k, x in blank.items()}, **evidence),
                   variant=variant)


#: the numbers a fix's words cite from runs measured on a GPU (``Fix.measured``), for the fixes that cite some
MEASURED = {"expandable-segments-no-help": {"record_stream": [2_449_473_536, 3_053_453_312],
                                            "expandable_segments": [2_390_753_280, 2_663_383_040],
                                            "without_record_stream": [1_308_622_848, 1_308_622_848]}}


def _fix(id: str, setting: str | None = None, framework: str | None = None) -> Fix:
    return Fix(id, "all", "test", setting=setting, framework=framework, measured=MEASURED.get(id))


# --------------------------------------------------------------------------- every id has its words

def _outcomes(node: ast.expr) -> set[str]:
    """The strings an expression can take: a constant, or either branch of a conditional expression."""
    if isinstance(node, ast.IfExp):
        return _outcomes(node.body) | _outcomes(node.orelse)
    return {node.value} if isinstance(node, ast.Constant) and isinstance(node.value, str) else set()


def _detector_ids() -> tuple[set[str], set[tuple[str, str]]]:
    """The fix ids and the (finding id, variant) pairs written in the detectors' source: each ``Fix("id", ...)``
    and each ``variant=...`` string (or the strings of a conditional expression assigned to ``variant``)."""
    fixes: set[str] = set()
    pairs: set[tuple[str, str]] = set()
    for path in Path(detectors_pkg.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        fid = next((n.value.value for n in tree.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "ID" for t in n.targets)), None)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Fix" and node.args:
                fixes.add(node.args[0].value)
            values = []
            if isinstance(node, ast.keyword) and node.arg == "variant":
                values = [node.value]
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "variant" for t in node.targets):
                values = [node.value]
            for v in values:
                pairs |= {(fid, x) for x in _outcomes(v)}
        if fid is not None and not any(p[0] == fid for p in pairs):
            pairs.add((fid, ""))  # one wording: the default variant
    return fixes, pairs


def test_every_fix_and_wording_a_detector_writes_has_its_words():
    fixes, pairs = _detector_ids()
    assert fixes == set(words.FIXES)
    # rank-imbalance without a differing site keeps the default variant besides its two named ones
    assert pairs | {("rank-imbalance", "")} == set(words.TITLES) == set(words.SUMMARIES)


def test_every_fix_text_is_a_sentence():
    for fix_id in words.FIXES:
        fx = _fix(fix_id, "PYTORCH_ALLOC_CONF=max_split_size_mb:512",
                  "hf-trainer" if fix_id in words.FRAMEWORK_KNOBS else None)
        t = words.fix_text(fx)
        assert t[0].isupper() and t.endswith(".") and "  " not in t and "{" not in t, (fix_id, t)


def test_unknown_ids_raise():
    with pytest.raises(KeyError):
        words.fix_text(_fix("no-such-fix"))
    with pytest.raises(KeyError):
        words.title(_f("allgather-list", "no-such-variant", {}))


# --------------------------------------------------------------------------- findings, id by id

def test_allgather_list():
    f = _f("allgather-list", "", {"calls": 3, "flat_buffer_bytes_total": 352 * MiB,
                                  "largest_flat_buffer_bytes": 256 * MiB})
    assert words.title(f) == "all_gather into a list then torch.cat copies the gathered data twice"
    assert words.summary(f) == (
        "3 calls of all_gather into a list allocated a temporary flat buffer each (largest 256.00 MiB, 352.00 MiB in "
        "all) that is copied into the list and then copied again by torch.cat: three buffers of the gathered size "
        "instead of one, and more sizes for the allocator to cache.")


CACHE = {"segment_free_bursts": 3, "empty_cache_bursts": 3, "allocator_retry_bursts": 3, "freed_bytes": 192 * MiB,
         "reallocated_after_bytes": 168 * MiB, "flush_time_us": 70, "cuda_malloc_calls_after": 4, "alloc_retries": 1}


def test_cache_flush_empty_cache_churn():
    f = _f("cache-flush", "empty-cache", CACHE)
    assert words.title(f) == ("torch.cuda.empty_cache() churn: about 70 µs of flushing and allocating again over 3 "
                              "flushes (a speed cost)")
    assert words.summary(f) == (
        "empty_cache() released segments 3 times during training (192.00 MiB in all) and the trace allocated "
        "168.00 MiB again afterwards: each call synchronises the device and the next steps pay for fresh cudaMalloc "
        "calls (4 in all). The trace shows about 70 µs spent flushing and allocating again. It costs time, not "
        "memory: empty_cache() never gives PyTorch more room.")


def test_cache_flush_churn_without_free_stacks_names_both_causes():
    f = _f("cache-flush", "churn-unknown", CACHE)
    assert words.title(f) == ("Cached memory released and allocated again 3 times (empty_cache() or allocator "
                              "retries), about 70 µs")
    assert words.summary(f) == (
        "Cached segments were released 3 times during training (192.00 MiB in all) and the trace allocated 168.00 MiB "
        "again afterwards: either torch.cuda.empty_cache() calls or allocator retries, about 70 µs of flushing and 4 "
        "cudaMalloc calls. This trace has no free stacks (recorded with context='alloc') and no memory_stats to tell "
        "them apart; record with oomdoctor (its sidecar has num_alloc_retries).")


def test_cache_flush_retries_by_pytorchs_own_count():
    f = _f("cache-flush", "retries", CACHE)
    assert words.title(f) == "Allocator retries: the job runs at the edge of its memory"
    assert words.summary(f) == (
        "The allocator ran out of room without failing and retried: num_alloc_retries, PyTorch's own count, is 1. "
        "Each time it freed its cache and retried cudaMalloc, synchronising every stream. The job runs at the edge of "
        "the device's memory; the cost is time, not memory.")


def test_cache_flush_bursts_without_counters_are_not_called_retries():
    f = _f("cache-flush", "retries-or-gc", {**CACHE, "freed_bytes": 1536 * MiB})
    assert words.title(f) == "Cached segments released in 3 bursts: allocator retries or garbage collection"
    s = words.summary(f)
    assert s == (
        "The allocator released cached segments during training without empty_cache(), in 3 bursts of 1.50 GiB in all: "
        "retries after cudaMalloc failed, or the garbage collector (garbage_collection_threshold) releasing old "
        "blocks; this trace has no num_alloc_retries to tell them apart (record with oomdoctor: its sidecar has it). "
        "Either costs time, not memory.")
    assert "(s)" not in s and "retried" not in s


def test_deferred_free_final_state():
    f = _f("deferred-free", "final-state", {"held_at_end_bytes": 320 * MiB, "blocks_pending_at_end": 2,
                                            "reserved_bytes": GiB, "allocated_bytes": 96 * MiB, "owner": "fsdp"})
    assert words.summary(f) == (
        "2 blocks freed by Python but kept by the allocator until work on another stream (fsdp) finished hold "
        "320.00 MiB in the final state (1.00 GiB reserved for 96.00 MiB allocated). Recorded without history: how long "
        "each free waited, and which collective held it, are not known.")
    # one title, with or without history
    assert words.title(f) == words.title(_f("deferred-free", "at-peak", {})) == (
        "Frees deferred by record_stream hold memory across layers and steps")


@pytest.mark.parametrize("owner, stream", [
    ("collective", "a collective's stream (NCCL, nccl:all_reduce)"),
    ("fsdp", "FSDP's unshard / reduce-scatter streams"),
    ("point-to-point", "point-to-point send/recv streams"),
    ("user code", "a side stream your code calls record_stream() for"),
    ("unknown", "another stream (which one is not recorded: the frees were requested before the trace began)"),
])
def test_deferred_free_at_the_peak_names_whose_stream(owner, stream):
    f = _f("deferred-free", "at-peak", {
        "blocks_held_at_peak": 8, "held_at_peak_bytes": 512 * MiB, "peak_reserved_bytes": 2 * GiB,
        "peak_allocated_bytes": GiB, "median_deferral_us": 1500, "max_deferral_us": 20_000,
        "segment_allocs_before_peak": 12, "owner": owner, "collectives": "nccl:all_reduce"})
    assert words.summary(f) == (
        f"8 blocks freed by Python but kept by the allocator until work on {stream} finished hold 512.00 MiB at the "
        "peak of reserved memory (2.00 GiB reserved for 1.00 GiB allocated). Each free waited a median 1.5 ms (up to "
        "20.0 ms); meanwhile the allocator could not reuse the blocks and reserved new segments (12 cudaMalloc calls "
        "up to the peak). The memory is held, not fragmented: expandable_segments does not cure it.")


def test_fragmentation_at_an_oom():
    f = _f("fragmentation", "oom", {
        "requested_bytes": 60 * MiB, "cuda_malloc_bytes": 60 * MiB, "reserved_bytes": 400 * MiB,
        "reserved_unallocated_bytes": 320 * MiB, "largest_free_block_bytes": 40 * MiB,
        "free_in_used_segments_bytes": 320 * MiB, "pool": "large", "segments": 4})
    assert words.title(f) == "Out of memory with enough free memory, in pieces too small"
    assert words.summary(f) == (
        "Out of memory asking for 60.00 MiB (a cudaMalloc of 60.00 MiB, the size PyTorch's error message shows) while "
        "320.00 MiB of the 400.00 MiB reserved were not allocated: the largest free block of the large pool on this "
        "stream was 40.00 MiB. 320.00 MiB are free but stranded in 4 segments that still hold live blocks, so the "
        "allocator could not cudaMalloc a new segment under the cap and freeing its cache did not help.")


def test_fragmentation_at_the_peak():
    f = _f("fragmentation", "stranded", {
        "peak_reserved_bytes": 4 * GiB, "allocated_at_peak_bytes": 512 * MiB,
        "free_in_used_segments_bytes": 8 * 448 * MiB, "largest_free_block_bytes": 448 * MiB})
    assert words.title(f) == "Reserved memory far above allocated: free space stranded in segments"
    assert words.summary(f) == (
        "At the peak, 3.50 GiB of the 4.00 GiB reserved were free but stranded inside segments that still hold live "
        "blocks (largest free block 448.00 MiB); only 512.00 MiB were allocated.")


def test_memory_growth():
    f = _f("memory-growth", "", {"steps": 12, "step_source": "annotations", "leaking_steps": [3, 6, 9],
                                 "first_counted_step": 2, "last_counted_step": 9,
                                 "retained_bytes": 128 * MiB, "allocated_at_first_step_bytes": GiB,
                                 "allocated_at_last_step_bytes": GiB + 128 * MiB})
    assert words.title(f) == "Memory grows from step to step: tensors from earlier steps stay allocated"
    assert words.summary(f) == (
        "Over 12 training steps (found by annotations), of steps 2 to 9 (the two before are warm-up, the last two "
        "still running), steps 3, 6 and 9 each left blocks allocated that are still alive at the last step: "
        "128.00 MiB in all. Allocated memory at step start grew from 1.00 GiB to 1.12 GiB.")


def test_kept_exception():
    f = _f("kept-exception", "", {"oom_event": 46, "retry_event": 47, "held_bytes": 768 * MiB, "held_blocks": 3,
                                  "held_at_last_oom_bytes": 768 * MiB, "caught_ooms": 1})
    assert words.title(f) == "A caught out-of-memory error keeps the failed attempt's tensors (768.00 MiB) while the job runs again"
    assert words.summary(f) == (
        "The out-of-memory error at event 46 was caught, and when the same code ran again (event 47) the 3 blocks the "
        "failed attempt had made (768.00 MiB) were still allocated: the exception (its traceback and the frames it "
        "holds) keeps them alive. 768.00 MiB of them were still held at the last OOM.")


KEPT = {"kept_bytes": 384 * MiB, "blocks": 3, "passes": 3, "allocated_bytes": 641 * MiB, "kept_fraction": 0.599,
        "at": "the peak", "phase": "forward", "sites_per_pass": 1, "kept_unit": "batch", "kept_at": [0, 1, 2],
        "kept_every": 1}
KEPT_OPENING = ("At the peak, 384.00 MiB in 3 blocks are outputs of 3 micro-batches kept on the GPU while later ones "
                "ran (forward phase): 60% of the 641.00 MiB allocated.")


@pytest.mark.parametrize("unit, at, every, growth", [
    ("batch", [0, 1, 2], 1, "They grow by one batch's outputs with every batch until the device is full."),
    ("step", [4, 5, 6], 1, "They grow by one batch's outputs with every step until the device is full."),
    # issue 52: ddp-imbalance's rank 0 keeps a batch's logits every third step, as memory-growth says
    ("step", [0, 3, 6, 9], 3, "They grow by one batch's outputs every 3 steps (steps 0, 3, 6 and 9) until the "
                              "device is full."),
    ("batch", [0, 2, 7], 0, "They were kept at batches 0, 2 and 7, and grow until the device is full."),
    ("step", list(range(0, 31, 3)), 3, "They grow by one batch's outputs every 3 steps (steps 0, 3, 6, …, 27 and 30) "
                                       "until the device is full."),
])
def test_output_accumulation_kept_outputs(unit, at, every, growth):
    f = _f("output-accumulation", "kept-outputs", {**KEPT, "kept_unit": unit, "kept_at": at, "kept_every": every})
    assert words.title(f) == "Outputs of many micro-batches are kept on the GPU"
    assert words.summary(f) == KEPT_OPENING + " " + growth


def test_output_accumulation_graph_kept():
    f = _f("output-accumulation", "graph-kept", {**KEPT, "blocks": 12, "sites_per_pass": 4})
    assert words.title(f) == "Every batch's autograd graph is kept alive (a loss summed without no_grad)"
    assert words.summary(f) == (
        "At the peak, 384.00 MiB in 12 blocks of 3 batches are kept (forward phase): 4 different sites of each batch, "
        "the tensors autograd saves for a backward, so each batch's whole graph stays alive: 60% of the 641.00 MiB "
        "allocated. A loop that sums losses as tensors without torch.no_grad() does this.")


def test_output_accumulation_regrown():
    f = _f("output-accumulation", "regrown", {**KEPT, "at": "the OOM", "phase": "evaluation", "regrown_passes": 4})
    assert words.title(f) == "Outputs of every batch gathered into one growing buffer"
    assert words.summary(f) == (
        "At the OOM, 384.00 MiB are held by a buffer re-allocated larger for each of 4 batches (evaluation phase): "
        "every batch's outputs are concatenated onto the previous ones (60% of the 641.00 MiB allocated). It grows "
        "until the device is full.")


def test_pipeline_output_cache():
    f = _f("pipeline-output-cache", "", {"outputs_kept": 8, "output_bytes": 500 * MiB, "kept_bytes": 4000 * MiB,
                                         "median_held_us": 2_500_000})
    assert words.title(f) == "Last pipeline stage keeps every micro-batch's output until step() ends"
    assert words.summary(f) == (
        "This pipeline stage keeps 8 micro-batch outputs (3.91 GiB in the allocator's blocks, 500.00 MiB requested "
        "each) allocated at once until step() ends (median 2.5 s each): the schedule caches every output of the last "
        "stage to merge them, so memory grows with the number of micro-batches.")


IMBALANCE = {"rank": 4, "peak_allocated_bytes": 2816 * MiB, "others_median_peak_allocated_bytes": 2560 * MiB,
             "excess_bytes": 256 * MiB, "end_allocated_bytes": 1000 * MiB,
             "others_median_end_allocated_bytes": 250 * MiB, "top_site_extra_bytes": 180 * MiB, "top_site_blocks": 2,
             "top_site": "/w/a.py:1 in f"}
IMBALANCE_OPENING = ("Rank 4 peaks at 2.75 GiB allocated, 256.00 MiB above the median of the other ranks (2.50 GiB); "
                     "at the end it still holds 1000.00 MiB against 250.00 MiB.")


@pytest.mark.parametrize("variant, detail", [
    ("held-at-end", " The difference is 180.00 MiB in 2 blocks allocated at /w/a.py:1 in f, still held at the end on "
                    "this rank only."),
    ("most-different", " The most different site is /w/a.py:1 in f (180.00 MiB more)."),
    ("", ""),  # no site differs: no more is said
])
def test_rank_imbalance(variant, detail):
    f = _f("rank-imbalance", variant, IMBALANCE)
    assert words.title(f) == "Rank 4 uses more memory than the other ranks"
    assert words.summary(f) == IMBALANCE_OPENING + detail


def test_small_long_lived():
    f = _f("small-long-lived", "", {"blocks": 256, "bytes": 384 * MiB, "segments_pinned": 27,
                                    "free_in_pinned_segments_bytes": 276 * MiB})
    assert words.title(f) == "Many small long-lived blocks pin segments"
    assert words.summary(f) == (
        "256 small blocks (384.00 MiB) live for most of the trace, spread over 27 segments that hold 276.00 MiB of "
        "free space the allocator can neither release nor use for larger requests.")


# --------------------------------------------------------------------------- fixes

ENV_NOTE = ("PYTORCH_ALLOC_CONF from PyTorch 2.9, where PYTORCH_CUDA_ALLOC_CONF is still read as its alias; "
            "PYTORCH_CUDA_ALLOC_CONF before 2.9")


@pytest.mark.parametrize("env", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_fragmentation_fixes_name_the_variable_their_setting_goes_in(env):
    assert words.fix_text(_fix("expandable-segments", f"{env}=expandable_segments:True")) == (
        f"Set {env}=expandable_segments:True ({ENV_NOTE}): segments grow by mapping pages, so free space is not "
        "stranded between fixed-size segments. Not compatible with CUDA IPC of those tensors (issue #130330), NCCL "
        "user-buffer registration (--use-nccl-ub, NVIDIA/nccl#1584); with CUDA graphs and NCCL set "
        "NCCL_GRAPH_REGISTER=0 (issue #158029).")
    assert words.fix_text(_fix("max-split-size", f"{env}=max_split_size_mb:30")) == (
        f"Or set {env}=max_split_size_mb:30: blocks at least that large are never split, so large requests find whole "
        "blocks (ignored when expandable segments are on, issue #119452).")
    assert words.fix_text(_fix("garbage-collection-threshold", f"{env}=garbage_collection_threshold:0.8")) == (
        "Under the memory fraction (torch.cuda.set_per_process_memory_fraction), add garbage_collection_threshold:0.8 "
        f"to {env} to release old cached blocks before hitting the cap.")


@pytest.mark.parametrize("framework, words_", [
    ("hf-trainer", "Hugging Face Trainer: pass preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1) "
                   "to Trainer so that only what compute_metrics needs is kept (eval_accumulation_steps=N alone moves "
                   "the full logits to host RAM every N steps)."),
    ("lightning", "PyTorch Lightning: do not keep whole outputs in validation_step: append outputs.detach().cpu() or "
                  "only the reduced metric (torchmetrics updates state per batch)."),
])
def test_a_framework_fix_is_said_in_the_frameworks_words(framework, words_):
    assert words.fix_text(_fix("framework-eval-outputs", framework=framework)) == words_


FIX_WORDS = {
    "all-gather-into-tensor": ("Preallocate the output once and call dist.all_gather_into_tensor(out, inp) "
                               "(all_gather_single in recent releases); view it as chunks instead of concatenating a "
                               "list."),
    "reduce-scatter-tensor": "For reduce-scatter likewise use reduce_scatter_tensor instead of a list input.",
    "empty-cache-at-phase-changes": ("Call torch.cuda.empty_cache() only at phase changes (after initialisation, after "
                                     "evaluation), not every step; it never gives PyTorch more memory."),
    "lower-peak-no-retries": ("Lower the peak (activation checkpointing, a smaller micro-batch) or fix fragmentation "
                              "so the allocator never has to flush and retry; watch num_alloc_retries in "
                              "torch.cuda.memory_stats()."),
    "avoid-record-streams": ("Set TORCH_NCCL_AVOID_RECORD_STREAMS=1 before the process group is created: "
                             "ProcessGroupNCCL then keeps a reference to the collective's tensors until wait() instead "
                             "of calling record_stream."),
    "upgrade-collectives-current-stream": ("Upgrade to PyTorch >= 2.8, where synchronous collectives run on the "
                                           "current stream and never record_stream their tensors."),
    "fsdp-limit-all-gathers": ("FSDP1: keep limit_all_gathers=True (the default since 2.1) so the CPU cannot run "
                               "ahead with unsharded parameters; better, migrate to FSDP2 (fully_shard), which avoids "
                               "record_stream."),
    "async-op-wait": ("If your code runs the collective on its own stream and calls tensor.record_stream(stream), "
                      "drop record_stream: issue it with async_op=True and call work.wait() (or "
                      "torch.cuda.current_stream().wait_stream(stream)) before the tensor is reused, keeping a Python "
                      "reference until then."),
    "point-to-point-wait": ("Point-to-point sends still call record_stream in every version: wait on isend/irecv "
                            "works promptly and keep fewer micro-batches in flight."),
    # the tp-allreduce measurement (shared/snapshots/README.md): legacy, legacy + expandable, modern; issue 52: other
    # runs than the one diagnosed, whose own replay with expandable segments the prediction says
    "expandable-segments-no-help": ("Do not expect expandable_segments:True to help: the blocks are held, not "
                                    "fragmented. Measured on other runs of a two-rank tensor-parallel job, peak "
                                    "reserved per rank: 2.28 GiB to 2.84 GiB with record_stream, 2.23 GiB to 2.48 GiB "
                                    "with expandable segments too, 1.22 GiB without record_stream; how long the "
                                    "frees wait changes from run to run, so one run with expandable segments can "
                                    "land below another without."),
    "vary-shapes-less": "Vary shapes less: pad or bucket sequence lengths so freed blocks fit the next step's requests.",
    "detach-kept-tensors": ("Do not keep tensors that are attached to the graph or live on the GPU across steps: log "
                            "with loss.item() or t.detach().cpu(), and keep debug tensors on the CPU."),
    "bound-growing-containers": ("If a list or dict of tensors grows per step, bound it or clear it at the step "
                                 "boundary; find reference cycles with torch.utils.viz._cycles.warn_tensor_cycles()."),
    "no-grad-evaluation": ("Evaluate under torch.no_grad() or torch.inference_mode(), and sum losses as numbers "
                           "(val_loss += loss.item()) or detached tensors (loss.detach())."),
    "keep-what-the-metric-needs": ("Keep only what the metric needs per batch (e.g. logits.argmax(-1)), or move kept "
                                   "tensors to the CPU with t.detach().cpu(); accumulate metric state instead of "
                                   "outputs (torchmetrics)."),
    "return-outputs-false": ("Call schedule.step(..., return_outputs=False) when you do not use the merged outputs "
                             "(the loss is still computed by the schedule's loss_fn)."),
    "skip-output-chunks": ("Before 2.10: do not append outputs to stage.output_chunks on the last stage (patch "
                           "_PipelineStageBase.forward_one_chunk / PipelineScheduleSingle.step to skip the append when "
                           "the merged outputs are not used)."),
    "chunked-loss": ("Shrink what is kept: compute the loss inside the schedule and chunk or fuse the LM head and "
                     "cross-entropy so no full [tokens, vocab] logits tensor is materialised."),
    "per-rank-extras-off-gpu": ("Keep per-rank extras off the GPU: move logged or debug tensors to the CPU "
                                "(t.detach().cpu()) or keep scalars with .item(); run metrics and evaluation on every "
                                "rank or under inference_mode."),
    "sharded-checkpoint": ("Checkpoint with torch.distributed.checkpoint (sharded) or full state dicts offloaded to "
                           "the CPU (StateDictOptions(full_state_dict=True, cpu_offload=True)) instead of gathering "
                           "on rank 0."),
    "contiguous-buffer": ("Allocate long-lived tensors as views of one contiguous buffer (data = torch.empty(total); "
                          "t = data[a:b].view(shape)), then torch.cuda.empty_cache() once to drop the old pieces."),
    "bucket-view-gradients": ("DDP: gradient_as_bucket_view=True makes gradients views of the all-reduce buckets; "
                              "DeepSpeed: contiguous_gradients (default True); fused optimizers (fused=True) avoid "
                              "per-tensor temporaries."),
    "optimizer-state-first": ("Create optimizer state before the first forward (e.g. one zero-loss step) so it is not "
                              "interleaved with activations."),
    "release-exception": ("Leave the except block before retrying (set a flag, retry after it), or del the exception "
                          "and anything holding it or its traceback (a list of errors, sys.last_traceback): while it "
                          "lives, its traceback keeps the failed attempt's frames and every tensor they hold."),
}


@pytest.mark.parametrize("fix_id", sorted(FIX_WORDS))
def test_fix_words(fix_id):
    assert words.fix_text(_fix(fix_id)) == FIX_WORDS[fix_id]


def test_every_fix_without_a_setting_or_framework_is_pinned_above():
    params = {"expandable-segments", "max-split-size", "garbage-collection-threshold", "framework-eval-outputs"}
    assert set(FIX_WORDS) == set(words.FIXES) - params


# --------------------------------------------------------------------------- a verdict naming a finding

def test_a_verdict_names_its_finding_by_title_and_its_fix_by_id():
    f = _f("rank-imbalance", "held-at-end", IMBALANCE)
    ev = {"finding_bytes": 256 * MiB, "title": f.title_ref()}
    assert f.title_ref() == FindingTitle("rank-imbalance", "held-at-end", f.evidence.as_dict())
    assert f.title_ref().evidence["top_site"] == IMBALANCE["top_site"]  # the evidence as the words read it
    assert words.verdict_evidence(ev) == {"finding_bytes": 256 * MiB,
                                          "title": "Rank 4 uses more memory than the other ranks"}
    # a verdict decided by the finding says its title, and its action is the fix's words
    fx = _fix("sharded-checkpoint")
    v = Verdict(kind="imbalance", bytes=256 * MiB, ranks=[4], headroom_bytes=None, finding="rank-imbalance",
                evidence={**ev, "peak_reserved_bytes": GiB}, reasons=["finding-decides"],
                to_do=[Action(id="finding-fix", fix=fx)])
    assert verdict_words.summary(v) == ("Rank 4 uses more memory than the other ranks: 256.00 MiB at stake (no OOM in "
                                        "this trace; peak reserved 1.00 GiB).")
    assert verdict_words.actions(v) == [FIX_WORDS["sharded-checkpoint"]]
