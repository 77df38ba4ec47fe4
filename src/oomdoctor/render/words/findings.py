"""The words of the detectors' findings and fixes (issue 37: facts in the core, words at the edge).

A detector (:mod:`oomdoctor.detectors`) returns a :class:`~oomdoctor.detectors.finding.Finding` of ids and
numbers: its ``id``, a ``variant`` naming which wording applies, and its ``evidence``; each
:class:`~oomdoctor.detectors.finding.Fix` has a stable ``id``. Here those ids become sentences:

- :data:`TITLES` and :data:`SUMMARIES`: ``(finding id, variant)`` -> a template over the finding's evidence
  (``{key}``, ``{key:bytes}``, ``{key:us}``; filled by :func:`oomdoctor.render.format.fill`);
- :data:`FIXES`: fix id -> a template over the fix's own words parameters (:func:`fix_params`: ``{setting}``,
  ``{env}``, ``{framework}``, ``{knob}``), filled here by :func:`fix_text`.

Every key of the tables is a finding or fix a detector returns; ``tests/unit/test_words_findings.py`` holds each
to its words. The sources of the rules (PyTorch files and PRs) are in the detectors' docstrings.
"""

from __future__ import annotations

from typing import Any

from ...detectors.finding import Finding, FindingTitle, Fix
from ...frameworks import FRAMEWORKS, GRAPH_KEPT_FIX
from ..format import fill

#: ``(finding id, variant)`` -> the title template.
TITLES: dict[tuple[str, str], str] = {
    ("allgather-list", ""): "all_gather into a list then torch.cat copies the gathered data twice",
    ("cache-flush", "churn-unknown"): ("Cached memory released and allocated again {segment_free_bursts} times "
                                       "(empty_cache() or allocator retries), about {flush_time_us:us}"),
    ("cache-flush", "empty-cache"): ("torch.cuda.empty_cache() churn: about {flush_time_us:us} of flushing and "
                                     "allocating again over {empty_cache_bursts} flushes (a speed cost)"),
    ("cache-flush", "retries"): "Allocator retries: the job runs at the edge of its memory",
    ("cache-flush", "retries-or-gc"): ("Cached segments released in {allocator_retry_bursts} bursts: allocator "
                                       "retries or garbage collection"),
    ("deferred-free", "at-peak"): "Frees deferred by record_stream hold memory across layers and steps",
    ("deferred-free", "final-state"): "Frees deferred by record_stream hold memory across layers and steps",
    ("fragmentation", "oom"): "Out of memory with enough free memory, in pieces too small",
    ("fragmentation", "stranded"): "Reserved memory far above allocated: free space stranded in segments",
    ("kept-exception", ""): ("A caught out-of-memory error keeps the failed attempt's tensors ({held_bytes:bytes}) "
                             "while the job runs again"),
    ("memory-growth", ""): "Memory grows from step to step: tensors from earlier steps stay allocated",
    ("output-accumulation", "graph-kept"): "Every batch's autograd graph is kept alive (a loss summed without no_grad)",
    ("output-accumulation", "regrown"): "Outputs of every batch gathered into one growing buffer",
    ("output-accumulation", "kept-outputs"): "Outputs of many micro-batches are kept on the GPU",
    ("pipeline-output-cache", ""): "Last pipeline stage keeps every micro-batch's output until step() ends",
    ("rank-imbalance", ""): "Rank {rank} uses more memory than the other ranks",
    ("rank-imbalance", "held-at-end"): "Rank {rank} uses more memory than the other ranks",
    ("rank-imbalance", "most-different"): "Rank {rank} uses more memory than the other ranks",
    ("small-long-lived", ""): "Many small long-lived blocks pin segments",
}

#: ``deferred-free`` at the peak: whose stream held the frees (evidence ``owner``) in words.
DEFERRED_OWNERS: dict[str, str] = {
    "collective": "a collective's stream (NCCL, {collectives})",
    "fsdp": "FSDP's unshard / reduce-scatter streams",
    "point-to-point": "point-to-point send/recv streams",
    "user code": "a side stream your code calls record_stream() for",
    "unknown": "another stream (which one is not recorded: the frees were requested before the trace began)",
}

_IMBALANCE = ("Rank {rank} peaks at {peak_allocated_bytes:bytes} allocated, {excess_bytes:bytes} above the "
              "median of the other ranks ({others_median_peak_allocated_bytes:bytes}); at the end it still "
              "holds {end_allocated_bytes:bytes} against {others_median_end_allocated_bytes:bytes}.")

#: ``output-accumulation`` of kept outputs: how they grow, by the evidence's ``kept_every`` (1: with every step or
#: batch; more: evenly that many apart; 0: unevenly) and ``kept_unit`` (``step``, ``batch``), put in as
#: ``{growth_words}``.
KEPT_GROWTH: dict[tuple[str, str], str] = {
    ("every", "batch"): "They grow by one batch's outputs with every batch until the device is full.",
    ("every", "step"): "They grow by one batch's outputs with every step until the device is full.",
    ("apart", "batch"): ("They grow by one batch's outputs every {kept_every} batches (batches {kept_at:list}) until "
                         "the device is full."),
    ("apart", "step"): ("They grow by one batch's outputs every {kept_every} steps (steps {kept_at:list}) until the "
                        "device is full."),
    ("uneven", "batch"): "They were kept at batches {kept_at:list}, and grow until the device is full.",
    ("uneven", "step"): "They were kept at steps {kept_at:list}, and grow until the device is full.",
}

#: ``(finding id, variant)`` -> the summary template (``deferred-free`` at the peak: ``{owner_words}`` is
#: :data:`DEFERRED_OWNERS` of its evidence's ``owner``; ``output-accumulation`` of kept outputs: ``{growth_words}``
#: is :data:`KEPT_GROWTH`'s; both put in by :func:`summary_template`).
SUMMARIES: dict[tuple[str, str], str] = {
    ("allgather-list", ""): (
        "{calls} calls of all_gather into a list allocated a temporary flat buffer each (largest "
        "{largest_flat_buffer_bytes:bytes}, {flat_buffer_bytes_total:bytes} in all) that is copied into "
        "the list and then copied again by torch.cat: three buffers of the gathered size instead of one, "
        "and more sizes for the allocator to cache."),
    ("cache-flush", "churn-unknown"): (
        "Cached segments were released {segment_free_bursts} times during training ({freed_bytes:bytes} in "
        "all) and the trace allocated {reallocated_after_bytes:bytes} again afterwards: either "
        "torch.cuda.empty_cache() calls or allocator retries, about {flush_time_us:us} of flushing and "
        "{cuda_malloc_calls_after} cudaMalloc calls. This trace has no free stacks (recorded with "
        "context='alloc') and no memory_stats to tell them apart; record with oomdoctor (its sidecar has "
        "num_alloc_retries)."),
    ("cache-flush", "empty-cache"): (
        "empty_cache() released segments {empty_cache_bursts} times during training ({freed_bytes:bytes} "
        "in all) and the trace allocated {reallocated_after_bytes:bytes} again afterwards: each call "
        "synchronises the device and the next steps pay for fresh cudaMalloc calls ({cuda_malloc_calls_after} "
        "in all). The trace shows about {flush_time_us:us} spent flushing and allocating again. It costs "
        "time, not memory: empty_cache() never gives PyTorch more room."),
    ("cache-flush", "retries"): (
        "The allocator ran out of room without failing and retried: num_alloc_retries, PyTorch's own count, "
        "is {alloc_retries}. Each time it freed its cache and retried cudaMalloc, synchronising every stream. The "
        "job runs at the edge of the device's memory; the cost is time, not memory."),
    ("cache-flush", "retries-or-gc"): (
        "The allocator released cached segments during training without empty_cache(), in "
        "{allocator_retry_bursts} bursts of {freed_bytes:bytes} in all: retries after cudaMalloc failed, or the garbage "
        "collector (garbage_collection_threshold) releasing old blocks; this trace has no num_alloc_retries "
        "to tell them apart (record with oomdoctor: its sidecar has it). Either costs time, not memory."),
    ("deferred-free", "final-state"): (
        "{blocks_pending_at_end} blocks freed by Python but kept by the allocator until work on another "
        "stream ({owner}) finished hold {held_at_end_bytes:bytes} in the final state ({reserved_bytes:bytes} "
        "reserved for {allocated_bytes:bytes} allocated). Recorded without history: how long each free "
        "waited, and which collective held it, are not known."),
    ("deferred-free", "at-peak"): (
        "{blocks_held_at_peak} blocks freed by Python but kept by the allocator until work on "
        "{owner_words} finished hold {held_at_peak_bytes:bytes} at the peak of reserved memory "
        "({peak_reserved_bytes:bytes} reserved for {peak_allocated_bytes:bytes} allocated). "
        "Each free waited a median {median_deferral_us:us} (up to {max_deferral_us:us}); meanwhile the "
        "allocator could not reuse the blocks and reserved new segments ({segment_allocs_before_peak} "
        "cudaMalloc calls up to the peak). The memory is held, not fragmented: expandable_segments "
        "does not cure it."),
    ("fragmentation", "oom"): (
        "Out of memory asking for {requested_bytes:bytes} (a cudaMalloc of {cuda_malloc_bytes:bytes}, "
        "the size PyTorch's error message shows) while {reserved_unallocated_bytes:bytes} "
        "of the {reserved_bytes:bytes} reserved were not allocated: the largest free block of the "
        "{pool} pool on this stream was {largest_free_block_bytes:bytes}. "
        "{free_in_used_segments_bytes:bytes} are free but stranded in {segments} segments that "
        "still hold live blocks, so the allocator could not cudaMalloc a new segment under the cap "
        "and freeing its cache did not help."),
    ("fragmentation", "stranded"): (
        "At the peak, {free_in_used_segments_bytes:bytes} of the {peak_reserved_bytes:bytes} reserved "
        "were free but stranded inside segments that still hold live blocks (largest free block "
        "{largest_free_block_bytes:bytes}); only {allocated_at_peak_bytes:bytes} were allocated."),
    ("kept-exception", ""): (
        "The out-of-memory error at event {oom_event} was caught, and when the same code ran again (event "
        "{retry_event}) the {held_blocks} blocks the failed attempt had made ({held_bytes:bytes}) were still allocated: "
        "the exception (its traceback and the frames it holds) keeps them alive. {held_at_last_oom_bytes:bytes} of "
        "them were still held at the last OOM."),
    ("memory-growth", ""): (
        "Over {steps} training steps (found by {step_source}), of steps {first_counted_step} to "
        "{last_counted_step} (the two before are warm-up, the last two still running), steps {leaking_steps:list} "
        "each left blocks "
        "allocated that are still alive at the last step: {retained_bytes:bytes} in all. Allocated memory "
        "at step start grew from {allocated_at_first_step_bytes:bytes} to {allocated_at_last_step_bytes:bytes}."),
    ("output-accumulation", "graph-kept"): (
        "At {at}, {kept_bytes:bytes} in {blocks} blocks of {passes} batches are kept ({phase} phase): "
        "{sites_per_pass} different sites of each batch, the tensors autograd saves for a backward, so each "
        "batch's whole graph stays alive: {kept_fraction:.0%} of the {allocated_bytes:bytes} allocated. "
        "A loop that sums losses as tensors without torch.no_grad() does this."),
    ("output-accumulation", "regrown"): (
        "At {at}, {kept_bytes:bytes} are held by a buffer re-allocated larger for each of {regrown_passes} "
        "batches ({phase} phase): every batch's outputs are concatenated onto the previous ones "
        "({kept_fraction:.0%} of the {allocated_bytes:bytes} allocated). It grows until the device is full."),
    ("output-accumulation", "kept-outputs"): (
        "At {at}, {kept_bytes:bytes} in {blocks} blocks are outputs of {passes} micro-batches kept on the "
        "GPU while later ones ran ({phase} phase): {kept_fraction:.0%} of the {allocated_bytes:bytes} "
        "allocated. {growth_words}"),
    ("pipeline-output-cache", ""): (
        "This pipeline stage keeps {outputs_kept} micro-batch outputs ({kept_bytes:bytes} in the allocator's "
        "blocks, {output_bytes:bytes} requested each) allocated at once until step() ends (median "
        "{median_held_us:us} each): "
        "the schedule caches every output of the last stage to merge them, so memory grows with the "
        "number of micro-batches."),
    ("rank-imbalance", ""): _IMBALANCE,
    ("rank-imbalance", "held-at-end"): _IMBALANCE + (
        " The difference is {top_site_extra_bytes:bytes} in {top_site_blocks} blocks allocated at "
        "{top_site}, still held at the end on this rank only."),
    ("rank-imbalance", "most-different"): _IMBALANCE + " The most different site is {top_site} ({top_site_extra_bytes:bytes} more).",
    ("small-long-lived", ""): (
        "{blocks} small blocks ({bytes:bytes}) live for most of the trace, spread over "
        "{segments_pinned} segments that hold {free_in_pinned_segments_bytes:bytes} of free space the "
        "allocator can neither release nor use for larger requests."),
}

_ENV_NOTE = ("PYTORCH_ALLOC_CONF from PyTorch 2.9, where PYTORCH_CUDA_ALLOC_CONF is still read as its alias; "
             "PYTORCH_CUDA_ALLOC_CONF before 2.9")

#: fix id -> its text, a template over :func:`fix_params`.
FIXES: dict[str, str] = {
    # allgather-list
    "all-gather-into-tensor": (
        "Preallocate the output once and call dist.all_gather_into_tensor(out, inp) (all_gather_single in "
        "recent releases); view it as chunks instead of concatenating a list."),
    "reduce-scatter-tensor": "For reduce-scatter likewise use reduce_scatter_tensor instead of a list input.",
    # cache-flush
    "empty-cache-at-phase-changes": (
        "Call torch.cuda.empty_cache() only at phase changes (after initialisation, after evaluation), not "
        "every step; it never gives PyTorch more memory."),
    "lower-peak-no-retries": (
        "Lower the peak (activation checkpointing, a smaller micro-batch) or fix fragmentation so the "
        "allocator never has to flush and retry; watch num_alloc_retries in torch.cuda.memory_stats()."),
    # deferred-free
    "avoid-record-streams": (
        "Set TORCH_NCCL_AVOID_RECORD_STREAMS=1 before the process group is created: ProcessGroupNCCL then "
        "keeps a reference to the collective's tensors until wait() instead of calling record_stream."),
    "upgrade-collectives-current-stream": (
        "Upgrade to PyTorch >= 2.8, where synchronous collectives run on the current stream and never "
        "record_stream their tensors."),
    "fsdp-limit-all-gathers": (
        "FSDP1: keep limit_all_gathers=True (the default since 2.1) so the CPU cannot run ahead with "
        "unsharded parameters; better, migrate to FSDP2 (fully_shard), which avoids record_stream."),
    "async-op-wait": (
        "If your code runs the collective on its own stream and calls tensor.record_stream(stream), drop "
        "record_stream: issue it with async_op=True and call work.wait() (or "
        "torch.cuda.current_stream().wait_stream(stream)) before the tensor is reused, keeping a Python "
        "reference until then."),
    "point-to-point-wait": (
        "Point-to-point sends still call record_stream in every version: wait on isend/irecv works "
        "promptly and keep fewer micro-batches in flight."),
    "expandable-segments-no-help": (
        "Do not expect expandable_segments:True to help: the blocks are held, not fragmented. Measured on other runs "
        "of a two-rank tensor-parallel job, peak reserved per rank: {measured[record_stream][0]:bytes} to "
        "{measured[record_stream][1]:bytes} with record_stream, {measured[expandable_segments][0]:bytes} to "
        "{measured[expandable_segments][1]:bytes} with expandable segments too, "
        "{measured[without_record_stream][1]:bytes} without record_stream; how long the frees wait changes from run "
        "to run, so one run with expandable segments can land below another without."),
    # fragmentation
    "expandable-segments": (
        "Set {setting} (" + _ENV_NOTE + "): segments grow by mapping pages, so free space "
        "is not stranded between fixed-size segments. Not compatible with CUDA IPC of those tensors "
        "(issue #130330), NCCL user-buffer registration (--use-nccl-ub, NVIDIA/nccl#1584); with CUDA "
        "graphs and NCCL set NCCL_GRAPH_REGISTER=0 (issue #158029)."),
    "max-split-size": (
        "Or set {setting}: blocks at least that large are never split, so large "
        "requests find whole blocks (ignored when expandable segments are on, issue #119452)."),
    "garbage-collection-threshold": (
        "Under the memory fraction (torch.cuda.set_per_process_memory_fraction), add "
        "garbage_collection_threshold:0.8 to {env} to release old cached blocks before hitting the cap."),
    "vary-shapes-less": "Vary shapes less: pad or bucket sequence lengths so freed blocks fit the next step's requests.",
    # kept-exception
    "release-exception": (
        "Leave the except block before retrying (set a flag, retry after it), or del the exception and anything "
        "holding it or its traceback (a list of errors, sys.last_traceback): while it lives, its traceback keeps the "
        "failed attempt's frames and every tensor they hold."),
    # memory-growth
    "detach-kept-tensors": (
        "Do not keep tensors that are attached to the graph or live on the GPU across steps: log with "
        "loss.item() or t.detach().cpu(), and keep debug tensors on the CPU."),
    "bound-growing-containers": (
        "If a list or dict of tensors grows per step, bound it or clear it at the step boundary; find "
        "reference cycles with torch.utils.viz._cycles.warn_tensor_cycles()."),
    # output-accumulation
    "no-grad-evaluation": GRAPH_KEPT_FIX[:1].upper() + GRAPH_KEPT_FIX[1:] + ".",
    "framework-eval-outputs": "{framework}: {knob}.",
    "keep-what-the-metric-needs": (
        "Keep only what the metric needs per batch (e.g. logits.argmax(-1)), or move kept tensors to "
        "the CPU with t.detach().cpu(); accumulate metric state instead of outputs (torchmetrics)."),
    # pipeline-output-cache
    "return-outputs-false": (
        "Call schedule.step(..., return_outputs=False) when you do not use the merged outputs (the loss "
        "is still computed by the schedule's loss_fn)."),
    "skip-output-chunks": (
        "Before 2.10: do not append outputs to stage.output_chunks on the last stage (patch "
        "_PipelineStageBase.forward_one_chunk / PipelineScheduleSingle.step to skip the append when the merged "
        "outputs are not used)."),
    "chunked-loss": (
        "Shrink what is kept: compute the loss inside the schedule and chunk or fuse the LM head and "
        "cross-entropy so no full [tokens, vocab] logits tensor is materialised."),
    # rank-imbalance
    "per-rank-extras-off-gpu": (
        "Keep per-rank extras off the GPU: move logged or debug tensors to the CPU (t.detach().cpu()) or "
        "keep scalars with .item(); run metrics and evaluation on every rank or under inference_mode."),
    "sharded-checkpoint": (
        "Checkpoint with torch.distributed.checkpoint (sharded) or full state dicts offloaded to the CPU "
        "(StateDictOptions(full_state_dict=True, cpu_offload=True)) instead of gathering on rank 0."),
    # small-long-lived
    "contiguous-buffer": (
        "Allocate long-lived tensors as views of one contiguous buffer (data = torch.empty(total); "
        "t = data[a:b].view(shape)), then torch.cuda.empty_cache() once to drop the old pieces."),
    "bucket-view-gradients": (
        "DDP: gradient_as_bucket_view=True makes gradients views of the all-reduce buckets; DeepSpeed: "
        "contiguous_gradients (default True); fused optimizers (fused=True) avoid per-tensor temporaries."),
    "optimizer-state-first": (
        "Create optimizer state before the first forward (e.g. one zero-loss step) so it is not "
        "interleaved with activations."),
}

#: The framework knob each framework fix names (``Fix.framework``: a :data:`oomdoctor.frameworks.FRAMEWORKS` id).
FRAMEWORK_KNOBS: dict[str, str] = {"framework-eval-outputs": "eval-outputs"}



#: a fix's mark by ``Fix.applies``: whether the user's PyTorch has the setting or API (the fix's version range), not
#: whether it fits (its simulated prediction says that)
APPLIES_MARK = {True: "✓ in your PyTorch", False: "✗ not in your PyTorch", None: "? check your PyTorch version"}

ALREADY_MARK = "✗ already in your PyTorch"
"""An upgrade's mark where the user's PyTorch is already at or past it (``Fix.kind == "upgrade"`` and
``applies`` False): nothing to upgrade to, not a version too old for the fix."""


def applies_mark(fx: Fix) -> str:
    """The mark of ``fx`` by whether the user's PyTorch has it (:data:`APPLIES_MARK`); an upgrade the user's PyTorch
    has already is said so (:data:`ALREADY_MARK`)."""
    if fx.kind == "upgrade" and fx.applies is False:
        return ALREADY_MARK
    return APPLIES_MARK[fx.applies]


def title_template(finding_id: str, variant: str) -> str:
    """The title of ``(finding_id, variant)``, a template over the finding's evidence.

    Raises:
        KeyError: no words for that pair (a detector's new wording must add its words here)."""
    return TITLES[(finding_id, variant)]


def summary_template(f: Finding) -> str:
    """The summary of ``f``, a template over its evidence (``deferred-free`` at the peak: its owner's words put in).

    Raises:
        KeyError: no words for ``(f.id, f.variant)``, or for a ``deferred-free`` owner."""
    template = SUMMARIES[(f.id, f.variant)]
    ev = f.evidence.as_dict()
    if "{owner_words}" in template:
        template = template.replace("{owner_words}", DEFERRED_OWNERS[ev["owner"]])
    if "{growth_words}" in template:
        every = ev["kept_every"]
        kind = "every" if every == 1 else "apart" if every else "uneven"
        template = template.replace("{growth_words}", KEPT_GROWTH[(kind, ev["kept_unit"])])
    return template


def title(f: Finding) -> str:
    """``f``'s title filled from its evidence (one line)."""
    return fill(title_template(f.id, f.variant), f.evidence.as_dict())


def summary(f: Finding) -> str:
    """``f``'s summary filled from its evidence (one paragraph)."""
    return fill(summary_template(f), f.evidence.as_dict())


def resolve_title(ref: FindingTitle) -> str:
    """The title a verdict refers to (``evidence["title"]``), filled from its finding's evidence."""
    return fill(title_template(ref.id, ref.variant), ref.evidence)


def fix_params(fx: Fix) -> dict[str, Any]:
    """What a fix's words name besides its id: ``setting`` (e.g. ``PYTORCH_ALLOC_CONF=max_split_size_mb:512``),
    ``env`` (the variable the setting goes in), ``framework`` and ``knob`` (the framework's name and its advice
    on the fix's topic, :mod:`oomdoctor.frameworks`), ``measured`` (what runs on a GPU measured, which it cites)."""
    out: dict[str, Any] = {"setting": fx.setting, "env": (fx.setting or "").partition("=")[0],
                           "measured": fx.measured}
    if fx.framework is not None:
        fw = next(x for x in FRAMEWORKS if x.id == fx.framework)
        out |= {"framework": fw.name, "knob": fw.knobs[FRAMEWORK_KNOBS[fx.id]]}
    return out


def fix_text(fx: Fix) -> str:
    """``fx`` in words: the sentence the text, JSON and HTML reports show.

    Raises:
        KeyError: no words for ``fx.id``."""
    template = FIXES[fx.id]
    if "{" not in template:
        return template
    return fill(template, fix_params(fx))


def verdict_evidence(evidence: dict[str, Any]) -> dict[str, Any]:
    """A verdict's evidence with the finding title it names (a :class:`FindingTitle`) in words."""
    return {k: resolve_title(x) if isinstance(x, FindingTitle) else x for k, x in evidence.items()}


def related_line(f: Any) -> str | None:
    """``the same allocation sites as: memory-growth, output-accumulation``, or None without related findings."""
    return f"the same allocation sites as: {', '.join(f.related)}" if f.related else None
