"""``oomdoctor preflight``'s words: the answer (:class:`oomdoctor.report.preflight.PreflightAnswer`) as text
and as JSON."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from .format import format_bytes, wrap_lines
from .words import breakdown as breakdown_words

if TYPE_CHECKING:  # annotations only
    from ..report.preflight import PreflightAnswer

#: what each ``not_traced`` id means
NOT_TRACED_TEXT = {
    "kernel_workspaces_chosen_at_run_time": "workspaces of kernels chosen at run time (cuDNN's convolution "
                                            "and RNN algorithms) are not traced; cuBLAS's, the attention "
                                            "kernels' and reductions' staging buffers are",
    "cudnn_benchmark": "torch.backends.cudnn.benchmark is on: the first step of each new convolution shape "
                       "also runs cuDNN's autotuner, whose workspace cuDNN sizes at run time, up to the free "
                       "memory, halving it until it fits (so it cannot run out of memory); it is not traced, "
                       "and raised the first steps' peak by 5% to 3x on the corpus's H200 runs",
    "torch_compile": "torch.compile is traced eager (the module as written): compiled kernels fuse and reuse "
                     "buffers, so the compiled peak differs",
    "cuda_streams": "side CUDA streams and events are traced on stream 0 (record_stream's deferred frees are not)",
    "cuda_graph": "CUDA graph captures ran once, eagerly; replays and the graph's private pool are not traced",
    "cpu_resident_optimizer_steps": "the step counters foreach Adam keeps on the host are counted on the GPU "
                                    "(4 bytes each, at most 512 bytes each once rounded)",
    "collectives": "collectives are not traced (one rank; NCCL's communicator is counted outside the allocator "
                   "when there are several)",
}


def preflight_dict(a: PreflightAnswer) -> dict[str, Any]:
    """The ``--format json`` contract (``oomdoctor schema preflight``): :meth:`PreflightAnswer.as_dict` (bytes,
    seconds) with ``schema_version`` and ``oomdoctor_version``, as every command's."""
    from .._version import SCHEMA_VERSION, __version__

    return {"schema_version": SCHEMA_VERSION, "oomdoctor_version": __version__, **a.as_dict()}


def render_preflight_json(a: PreflightAnswer) -> str:
    return json.dumps(preflight_dict(a), indent=2, default=str) + "\n"


#: what ``outside_allocator_source`` ids mean (the constants: ``oomdoctor.preflight.snapshot``, docs/plan.md)
OUTSIDE_SOURCE_TEXT = {
    "cuda-context": "the CUDA context and a training step's kernels (measured on an H200: 703 MiB)",
    "cuda-context+nccl": "the CUDA context and a training step's kernels (measured on an H200: 703 MiB) and "
                         "NCCL's world communicator (842 MiB)",
}
#: what each kind of invented value is (``oomdoctor.preflight.values``: the policy)
INVENTED_TEXT = {
    "false": "False (a check: isnan/isinf False, found_inf 0)",
    "finite": "a finite number, smaller at each read (early stopping never triggers)",
    "upper_bound": "its upper bound (traced on the largest path)",
    "assumed": "a value carried from an assumed check",
}


def render_preflight_text(a: PreflightAnswer, width: int = 80) -> str:
    """The answer as text wrapped at ``width`` columns (a wrapped line keeps its indent; a number stays with its
    unit): the job, where it was traced, the GPU, fits or not, the largest micro-batch, the breakdown, the allocator
    settings replayed, the values invented for reads from the fake GPU, what is not traced."""
    job = a.job
    gpu = a.gpu_name or "the GPU"
    what = job.get("hf_config") or (" ".join(job["script"]) if job.get("script") else job.get("model_fn", "the job"))
    details = ", ".join(x for x in (
        (f"micro-batch {a.micro_batch}" if a.micro_batch is not None else "")
        + (f" x {job['seq_len']} tokens" if job.get("seq_len") else ""),
        job.get("dtype") or "", job.get("optimizer") or "",
        "gradient checkpointing" if job.get("gradient_checkpointing") else "") if x)
    outside = OUTSIDE_SOURCE_TEXT.get(a.outside_allocator_source, a.outside_allocator_source)
    lines = ["oomdoctor preflight" + (f": {details}" if details else ""),
             f"job: {what}",  # a line of its own: a long path never leaves the first line without its words
             f"traced on the CPU under fake tensors in {a.trace_wall_s:.1f} s ({a.events:,} events)"
             + (f"; rank {(job.get('ranks_traced') or [0])[0]} of {job['world_size']}, collectives "
                f"{job['collectives']}" if job.get("collectives") else "")
             + (f"; {job['max_steps']} optimizer steps, then stopped" if job.get("max_steps") else ""),
             f"on {gpu} ({format_bytes(a.gpu_total_bytes)}): {format_bytes(a.room_bytes)} for the caching "
             f"allocator, after {format_bytes(a.outside_allocator_bytes)} outside it, {outside}", ""]
    if a.oom:
        lines.append(f"OUT OF MEMORY: a request of {format_bytes(a.oom_request_bytes or 0)} does not fit "
                     f"(peak reserved {format_bytes(a.peak_reserved_bytes)} before it)"
                     + (f", made at {a.oom_site['file']}:{a.oom_site['line']} ({a.oom_site['function']})"
                        if a.oom_site else ""))
    else:
        lines.append(f"fits: peak reserved {format_bytes(a.peak_reserved_bytes)}, peak allocated "
                     f"{format_bytes(a.peak_allocated_bytes)} (requested {format_bytes(a.peak_requested_bytes)}), "
                     f"headroom {format_bytes(a.room_bytes - a.peak_reserved_bytes)}")
    if a.largest_micro_batch_method == "traced":
        lines.append("largest micro-batch that fits: " + (str(a.largest_micro_batch) if a.largest_micro_batch
                                                          else "none found within the traces spent")
                     + f", keeping {format_bytes(a.largest_micro_batch_margin_bytes)} free for the trace's error"
                     + " (traced at " + ", ".join(str(t["micro_batch"]) + (" OOM" if t["oom"] else "")
                                                  for t in a.micro_batch_traces) + ")")
    lines += ["", f"at the peak allocated ({a.breakdown_at.get('phase')}, step {a.breakdown_at.get('step')}):"]
    for cat, n in sorted(a.breakdown.items(), key=lambda kv: -kv[1]):
        if n:
            src = a.breakdown_sources.get(cat) if cat != "rounding" else None  # rounding has no source
            lines.append(f"  {format_bytes(n):>12}  {breakdown_words.line(cat)}"
                         + (" (recorded by the tracer)" if src == "recorded" else ""))
    lines += ["", "allocator settings (PYTORCH_CUDA_ALLOC_CONF), replayed:"]
    col = min(max((len(s["config"]) for s in a.settings), default=0), max(width - 2 - 31, 12))
    for s in a.settings:  # a setting longer than its column gets a line of its own, its numbers under it
        numbers = f"peak reserved {format_bytes(s['peak_reserved_bytes']):>11}" + ("  OOM" if s["oom"] else "")
        config = s["config"] if len(s["config"]) <= col else s["config"] + "\n" + " " * (col + 2)
        lines.append(f"  {config:<{col}} {numbers}")
    if a.invented_values:
        lines += ["", "values read from the GPU were invented (fake tensors have none); control flow that "
                      "depends on them may differ from the GPU's:"]
        for v in a.invented_values:
            lines.append(f"  {v['file']}:{v['line']}: {v['read']} -> {INVENTED_TEXT.get(v['kind'], v['kind'])}"
                         + (f" ({v['count']} reads)" if v["count"] > 1 else ""))
    lines += ["", "not traced: " + "; ".join(NOT_TRACED_TEXT.get(k, k) for k in a.not_traced)]
    if a.snapshot:
        lines.append(f"snapshot: {a.snapshot} (oomdoctor diagnose / simulate / report read it)")
    return wrap_lines("\n".join(lines), width) + "\n"
