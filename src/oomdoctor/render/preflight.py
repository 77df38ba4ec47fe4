"""``oomdoctor preflight``'s words: the answer (:class:`oomdoctor.report.preflight.PreflightAnswer`) as text
and as JSON."""

from __future__ import annotations

import json
from typing import Any

from .format import format_bytes

#: what each ``not_traced`` id means
NOT_TRACED_TEXT = {
    "kernel_workspaces_chosen_at_run_time": "workspaces of kernels chosen at run time (cuDNN convolution "
                                            "algorithms, some GEMM splits) are not traced; cuBLAS's and flash "
                                            "attention's are",
    "torch_compile": "torch.compile is traced eager (the module as written): compiled kernels fuse and reuse "
                     "buffers, so the compiled peak differs",
    "cuda_streams": "side CUDA streams and events are traced on stream 0 (record_stream's deferred frees are not)",
    "cuda_graph": "CUDA graph captures ran once, eagerly; replays and the graph's private pool are not traced",
    "cpu_resident_optimizer_steps": "the step counters foreach Adam keeps on the host are counted on the GPU "
                                    "(4 bytes each, at most 512 bytes each once rounded)",
    "collectives": "collectives are not traced (one rank; NCCL's communicator is counted outside the allocator "
                   "when there are several)",
}


def preflight_dict(a: Any) -> dict[str, Any]:
    """The ``--format json`` contract (``oomdoctor schema preflight``): :meth:`PreflightAnswer.as_dict` (bytes,
    seconds) with ``schema_version`` and ``oomdoctor_version``, as every command's."""
    from .._version import SCHEMA_VERSION, __version__

    return {"schema_version": SCHEMA_VERSION, "oomdoctor_version": __version__, **a.as_dict()}


def render_preflight_json(a: Any) -> str:
    return json.dumps(preflight_dict(a), indent=2, default=str) + "\n"


#: what ``outside_allocator_source`` ids mean (the constants: ``oomdoctor.preflight.snapshot``, docs/plan.md)
OUTSIDE_SOURCE_TEXT = {
    "cuda-context": "the CUDA context and a training step's kernels (measured on an H200: 703 MiB)",
    "cuda-context+nccl": "the CUDA context and a training step's kernels (measured on an H200: 703 MiB) and "
                         "NCCL's world communicator (842 MiB)",
}
WIDTH = 80
#: what each kind of invented value is (``oomdoctor.preflight.values``: the policy)
INVENTED_TEXT = {
    "false": "False (a check: isnan/isinf False, found_inf 0)",
    "finite": "a finite number, smaller at each read (early stopping never triggers)",
    "upper_bound": "its upper bound (traced on the largest path)",
    "assumed": "a value carried from an assumed check",
}


def _wrap(text: str, indent: str = "") -> list[str]:
    """``text`` wrapped at :data:`WIDTH` columns, continuation lines indented by ``indent`` plus two spaces."""
    import textwrap

    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False, break_long_words=True) or [""]


def render_preflight_text(a: Any) -> str:
    """The answer in words, at most :data:`WIDTH` columns, bytes in binary units (``format_bytes``)."""
    job = a.job
    gpu = a.gpu_name or "the GPU"
    what = job.get("hf_config") or (" ".join(job["script"]) if job.get("script") else job.get("model_fn", "the job"))
    head = (f"oomdoctor preflight: {what}"
            + (f", micro-batch {a.micro_batch}" if a.micro_batch is not None else "")
            + (f" x {job['seq_len']} tokens" if job.get("seq_len") else "")
            + (f", {job['dtype']}" if job.get("dtype") else "") + (f", {job['optimizer']}" if job.get("optimizer") else "")
            + (", gradient checkpointing" if job.get("gradient_checkpointing") else ""))
    traced = (f"traced on the CPU under fake tensors in {a.trace_wall_s:.1f} s ({a.events:,} events)"
              + (f"; rank {(job.get('ranks_traced') or [0])[0]} of {job['world_size']}, collectives {job['collectives']}"
                 if job.get("collectives") else "")
              + (f"; {job['max_steps']} optimizer steps, then stopped" if job.get("max_steps") else ""))
    outside = OUTSIDE_SOURCE_TEXT.get(a.outside_allocator_source, a.outside_allocator_source)
    on = (f"on {gpu} ({format_bytes(a.gpu_total_bytes)}): {format_bytes(a.room_bytes)} for the caching allocator, "
          f"after {format_bytes(a.outside_allocator_bytes)} outside it, {outside}")
    lines = _wrap(head) + _wrap(traced) + _wrap(on) + [""]
    if a.oom:
        lines += _wrap(f"OUT OF MEMORY: a request of {format_bytes(a.oom_request_bytes or 0)} does not fit "
                       f"(peak reserved {format_bytes(a.peak_reserved_bytes)} before it)")
    else:
        lines += _wrap(f"fits: peak reserved {format_bytes(a.peak_reserved_bytes)}, peak allocated "
                       f"{format_bytes(a.peak_allocated_bytes)} (requested {format_bytes(a.peak_requested_bytes)}), "
                       f"headroom {format_bytes(a.room_bytes - a.peak_reserved_bytes)}")
    if a.largest_micro_batch_method == "traced":
        lines += _wrap("largest micro-batch that fits: " + (str(a.largest_micro_batch) if a.largest_micro_batch
                                                            else "none found within the traces spent")
                       + f", keeping {format_bytes(a.largest_micro_batch_margin_bytes)} free for the trace's error"
                       + " (traced at " + ", ".join(str(t["micro_batch"]) + (" OOM" if t["oom"] else "")
                                                    for t in a.micro_batch_traces) + ")")
    lines += [""] + _wrap(f"at the peak allocated ({a.breakdown_at.get('phase')}, step {a.breakdown_at.get('step')}):")
    for cat, n in sorted(a.breakdown.items(), key=lambda kv: -kv[1]):
        if n:
            src = a.breakdown_sources.get(cat)
            lines.append(f"  {format_bytes(n):>12}  {cat}" + (" (recorded by the tracer)" if src == "recorded" else ""))
    lines += ["", "allocator settings (PYTORCH_CUDA_ALLOC_CONF), replayed: peak reserved"]
    for s in a.settings:
        row = f"  {s['config']:<54} {format_bytes(s['peak_reserved_bytes']):>11}" + ("  OOM" if s["oom"] else "")
        lines += [row] if len(row) <= WIDTH else [f"  {s['config']}",
                                                   f"  {'':<54} {format_bytes(s['peak_reserved_bytes']):>11}"
                                                   + ("  OOM" if s["oom"] else "")]
    if a.invented_values:
        lines += [""] + _wrap("values read from the GPU were invented (fake tensors have none); control flow that "
                              "depends on them may differ from the GPU's:")
        for v in a.invented_values:
            lines += _wrap(f"{v['file']}:{v['line']}: {v['read']} -> {INVENTED_TEXT.get(v['kind'], v['kind'])}"
                           + (f" ({v['count']} reads)" if v["count"] > 1 else ""), "  ")
    lines += [""] + _wrap("not traced: " + "; ".join(NOT_TRACED_TEXT.get(k, k) for k in a.not_traced))
    if a.snapshot:
        lines += _wrap(f"snapshot: {a.snapshot} (oomdoctor diagnose / simulate / report read it)")
    return "\n".join(lines) + "\n"
