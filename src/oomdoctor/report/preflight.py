"""Preflight's answers for a GPU: a traced step (:mod:`oomdoctor.preflight`) replayed through the allocator
model (:mod:`oomdoctor.simulate`) within the memory the GPU leaves to PyTorch.

- **room**: the GPU's total memory (``torch.cuda.get_device_properties().total_memory``, a table by name or
  ``--gpu-memory``) less what lives outside the caching allocator (the CUDA context and the kernels of a
  training step, :data:`oomdoctor.preflight.snapshot.CUDA_CONTEXT_BYTES`, measured); cuBLAS workspaces go
  through the allocator and are in the trace;
- **peaks**: the replay's peak allocated (block sizes, rounded as ``CUDACachingAllocator.cpp``
  ``round_size`` and unsplit remainders are: what ``max_memory_allocated`` counts) and peak reserved, under
  the default settings, with the device limit at the room: a request the model cannot serve is the OOM;
- **largest micro-batch**: traces at other micro-batch sizes (fake tensors cost no memory, and the trace's
  time does not grow with the batch): the peak reserved grows linearly in the micro-batch; the fit's
  prediction is then checked by tracing at it and at its neighbours, so the answer is a traced size that
  replays without OOM, and the next one does not (never a fit above what replays);
- **settings**: the same trace replayed under other ``PYTORCH_CUDA_ALLOC_CONF`` values;
- **breakdown**: the accounting (:mod:`oomdoctor.analysis.accounting`) of the snapshot preflight writes (the trace
  laid out by the allocator model) at its peak allocated, parameters, gradients, optimizer state and the tracer's
  workspaces from the sidecar's recorded storages (the tracer knows them): what ``diagnose`` says of that snapshot.

Bytes throughout; facts only (the CLI renders them).
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..ids import BreakdownCategory, BreakdownLine
from ..simulate.capacity import Capacity
from ..simulate.whatif import simulate
from ..trace.load import MODULE_FACT_KINDS

if TYPE_CHECKING:
    from ..simulate.allocator import Block

#: the settings every preflight replays besides the default one
WHATIF_CONFIGS = ("expandable_segments:True", "max_split_size_mb:512", "roundup_power2_divisions:4",
                  "garbage_collection_threshold:0.8,max_split_size_mb:512")
#: traces spent on the largest micro-batch after the first two, at least; more (up to MAX_TRACES) while the
#: traces so far took less than TRACE_TIME_BUDGET_S (small models trace in a second: bisection can finish)
MAX_CHECK_TRACES = 6
MAX_TRACES = 24
TRACE_TIME_BUDGET_S = 120.0
#: the largest micro-batch probed
MAX_MICRO_BATCH = 1 << 16
MARGIN_FRACTION = 0.035
"""The largest micro-batch must replay with its peak reserved at most ``1 - MARGIN_FRACTION`` of the room: the
largest error of preflight's peak reserved against the corpus's real runs is -3.302% (accelerate-ddp-llama-b72,
docs/preflight.md, ``benchmarks/preflight_corpus.py``), rounded up. Without it, preflight answered 75 on that job
with 20 MB to spare in its replay, where 72 ran, 76 ran out and the real peak is 3.3% above the traced one."""


@dataclass
class Replayed:
    """One trace replayed: the micro-batch, peaks (bytes), the OOM's request (bytes) or None."""

    micro_batch: int | None
    peak_requested_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    oom: bool
    oom_request_bytes: int | None
    events: int
    trace_wall_s: float
    settings: list[dict[str, Any]] = field(default_factory=list[dict[str, Any]])


@dataclass
class PreflightAnswer:
    """Everything ``oomdoctor preflight`` reports (bytes, seconds).

    The docstring under each field is its description in the JSON schema (``oomdoctor schema preflight``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    job: dict[str, Any]
    """the job traced: --hf-config's (hf_config, micro_batch, seq_len, dtype, optimizer, loop, world_size, ...), a
    script's (script, max_steps, world_size, ranks_traced, collectives), or the Python API's (model_fn, steps)"""
    gpu_name: str | None
    """the GPU assumed (--gpu), null with --gpu-memory"""
    gpu_total_bytes: int
    """the GPU's total memory (bytes)"""
    outside_allocator_bytes: int
    """memory outside the caching allocator: the CUDA context and kernels, and NCCL's communicator for more than one
    rank (bytes, measured constants)"""
    outside_allocator_source: str
    """where outside_allocator_bytes comes from, an id: 'cuda-context' (the CUDA context and a training step's
    kernels, measured) or 'cuda-context+nccl' (and NCCL's world communicator, measured)"""
    room_bytes: int
    """the allocator's room: gpu_total_bytes less outside_allocator_bytes (bytes)"""
    peak_allocated_bytes: int
    """the replay's peak allocated, blocks rounded as the allocator does (torch.cuda.max_memory_allocated's meaning;
    bytes)"""
    peak_reserved_bytes: int
    """the replay's peak reserved (max_memory_reserved's meaning; bytes)"""
    peak_requested_bytes: int
    """the trace's peak of requested bytes, before rounding (bytes)"""
    oom: bool
    """the replay ran out of the room"""
    oom_request_bytes: int | None
    """the request that did not fit (bytes), null without an OOM"""
    micro_batch: int | None
    """the micro-batch traced (null: a script's or a batch_fn's own)"""
    largest_micro_batch: int | None
    """the largest traced micro-batch that replays without OOM and with largest_micro_batch_margin_bytes to spare,
    the next traced one not (null: not searched)"""
    largest_micro_batch_method: str
    """'traced' or 'not searched'"""
    micro_batch_traces: list[dict[str, Any]]
    """every trace: micro_batch, peak_allocated_bytes, peak_reserved_bytes, oom, trace_wall_s"""
    breakdown: dict[BreakdownLine, int]
    """bytes per category at the peak allocated (parameters, gradients, optimizer_state, activations, temporaries,
    ...); they add up to breakdown_at.allocated_bytes"""
    breakdown_sources: dict[BreakdownCategory, str]
    """per category, where its bytes come from ('recorded': the tracer's facts; 'trace': the accounting's rules)"""
    breakdown_at: dict[str, Any]
    """the moment of the breakdown: event_index, step, phase, allocated_bytes"""
    settings: list[dict[str, Any]]
    """the same trace replayed per allocator setting: config, peak_reserved_bytes, peak_allocated_bytes, oom,
    oom_request_bytes"""
    snapshot: str | None
    """the traced snapshot written (-o), laid out by the allocator model; null without -o"""
    trace_wall_s: float
    """wall time of the traces (s)"""
    events: int
    """the events of the snapshot preflight writes, as diagnose counts them: the allocations and frees traced and
    the allocator model's segment calls"""
    not_traced: list[str]
    """ids of what the trace leaves out or treats in a stated way (kernel_workspaces_chosen_at_run_time,
    torch_compile, cpu_resident_optimizer_steps, collectives; a script's cuda_streams, cuda_graph; cudnn_benchmark
    when a convolution ran with torch.backends.cudnn.benchmark on)"""
    invented_values: list[dict[str, Any]] = field(default_factory=list[dict[str, Any]])
    """every line where the trace read a value from the GPU and was given a stand-in (fake tensors have no values):
    file, line, kind ('false': a check such as isnan/isinf, found_inf 0; 'finite': a loss or metric, a positive
    finite number decreasing at each read of the line; 'upper_bound': a data-dependent shape or count at its
    largest; 'assumed': a constant carried from those), read (item, bool, float, int, index, tolist, print, cpu,
    numpy, equal, or the shape op), count. Control flow that depends on them may differ from the GPU's"""
    largest_micro_batch_margin_bytes: int = 0
    """what largest_micro_batch keeps free of the room: its replay's peak reserved is at most room_bytes less this
    (3.5% of the room, preflight's largest measured error on peak reserved; bytes; 0: not searched)"""
    oom_site: dict[str, Any] | None = None
    """where the request that did not fit was made: file, line, function of the innermost frame of the traced
    stack outside the Python installation (the job's own code; the innermost frame when every frame is in it);
    null without an OOM or without a stack (schema 2.2)"""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def room(gpu_total_bytes: int, outside_bytes: int, *, given: bool = False, nccl: bool = False) -> Capacity:
    """The allocator's room on the GPU (bytes), as a device limit: source ``device-room`` (an id of
    :data:`oomdoctor.simulate.capacity.SOURCES`) with ``room_source`` ``gpu-total``, the words of what fits'
    room (``render/words/capacity.py``). ``given``: the total came from ``--gpu-memory``; ``nccl``: NCCL's
    communicator is among what runs outside the allocator (more than one rank)."""
    limit = max(gpu_total_bytes - outside_bytes, 0)
    return Capacity(limit_bytes=limit, kind="device", source="device-room", certainty="given",
                    evidence="given", source_values={"room_source": "gpu-total", "given": given, "nccl": nccl})


def _peak_requested(events: list[dict[str, Any]]) -> int:
    cur = peak = 0
    for e in events:
        if e["action"] == "alloc":
            cur += e["size"]
            peak = max(peak, cur)
        elif e["action"] == "free_completed":
            cur -= e["size"]
    return peak


def replay_file(path: str, capacity: Capacity, configs: tuple[str, ...] = WHATIF_CONFIGS) -> tuple[Any, Any]:
    """Load a traced snapshot and replay it: ``(trace, Simulation)``."""
    from ..trace import load

    trace = load(path)
    return trace, simulate(trace, configs=list(configs), capacity=capacity)


def replayed(path: str, capacity: Capacity, micro_batch: int | None, events: list[dict[str, Any]], wall_s: float,
             configs: tuple[str, ...] = WHATIF_CONFIGS) -> tuple[Replayed, Any]:
    trace, sim = replay_file(path, capacity, configs)
    r0 = sim.self_replay
    settings = [{"config": str(r.config) if r is not r0 else "(defaults)", "peak_reserved_bytes": r.peak_reserved_bytes,
                 "peak_allocated_bytes": r.peak_allocated_bytes, "oom": r.oom is not None,
                 "oom_request_bytes": r.oom.requested_bytes if r.oom else None} for r in sim.results]
    return Replayed(micro_batch, _peak_requested(events), r0.peak_allocated_bytes, r0.peak_reserved_bytes,
                    r0.oom is not None, r0.oom.requested_bytes if r0.oom else None, len(events), wall_s,
                    settings), trace


def _installed_dirs() -> tuple[str, ...]:
    """The Python installation's library directories (``sysconfig``: stdlib, purelib, platlib), where the job's own
    code is not."""
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple(sorted({str(Path(paths[k]).resolve()) for k in ("stdlib", "platstdlib", "purelib", "platlib")
                         if paths.get(k)}))


def _site(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``{file, line, function}`` of the innermost frame outside :func:`_installed_dirs` (the job's own code), or of
    the innermost frame when all are inside; None for no frame."""
    if not frames:
        return None
    dirs = _installed_dirs()

    def own(f: dict[str, Any]) -> bool:
        fn = str(f.get("filename", ""))
        try:
            resolved = Path(fn).resolve()
        except (OSError, ValueError):
            return False
        return fn.startswith("/") and not any(resolved.is_relative_to(d) for d in dirs)

    f = next((f for f in frames if own(f)), frames[0])
    return {"file": f.get("filename"), "line": f.get("line"), "function": f.get("name")}


def margin_bytes(room_bytes: int) -> int:
    """What the largest micro-batch keeps free of the room (bytes): :data:`MARGIN_FRACTION` of it."""
    return int(room_bytes * MARGIN_FRACTION)


def largest_micro_batch(at: Callable[[int], Replayed], first: Replayed, room_bytes: int,
                        budget: int = MAX_CHECK_TRACES) -> tuple[int | None, list[Replayed]]:
    """The largest micro-batch whose trace replays without OOM and with :func:`margin_bytes` of the room to
    spare (its peak reserved at most ``room_bytes - margin_bytes(room_bytes)``), from ``first`` (a traced size) and
    ``at(n)`` (trace and replay size ``n``), spending at most ``budget`` traces after the first two.

    Allocated bytes grow linearly in the micro-batch: a line through two traced sizes' peak allocated,
    plus the larger one's reserved-over-allocated, predicts the size that fills ``room_bytes``; then the
    bracket between the largest size that fits and the smallest that does not is closed, each probe the
    line's prediction inside the bracket (its midpoint when the line points outside). None: not even 1
    fits, or the bracket did not close within the budget (the answer is never a size not traced)."""
    def size(r: Replayed) -> int:
        assert r.micro_batch is not None  # the search traces given sizes, from the first's on
        return r.micro_batch

    seen: dict[int, Replayed] = {size(first): first}
    margin = margin_bytes(room_bytes)

    def fits(r: Replayed) -> bool:
        return not r.oom and r.peak_reserved_bytes <= room_bytes - margin

    def get(n: int) -> Replayed:
        if n not in seen:
            seen[n] = at(n)
        return seen[n]

    def done() -> list[Replayed]:
        return sorted(seen.values(), key=size)

    m = size(first)
    get(max(1, m // 2) if m > 1 else 2)
    spent = 0
    while True:
        ok = [n for n, r in seen.items() if fits(r)]
        ooms = [n for n, r in seen.items() if not fits(r)]
        lo = max(ok, default=0)
        hi = min((n for n in ooms if n > lo), default=None)
        if hi is not None and hi == lo + 1:
            return (lo or None), done()
        elapsed = sum(r.trace_wall_s for r in seen.values())
        if spent >= budget and (spent >= MAX_TRACES or elapsed >= TRACE_TIME_BUDGET_S):
            return None, done()
        pts = sorted(ok, key=lambda n: -n)[:2]
        guess = None
        if len(pts) == 2:
            a, b = seen[min(pts)], seen[max(pts)]
            slope = (b.peak_allocated_bytes - a.peak_allocated_bytes) / (size(b) - size(a))
            if slope > 0:
                overhead = b.peak_reserved_bytes - b.peak_allocated_bytes
                guess = int(size(b) + (room_bytes - margin - overhead - b.peak_allocated_bytes) / slope)
        if guess is not None and guess <= lo:
            guess = lo + 1  # the line says lo fills the room: check the next size
        if hi is None:
            guess = min(guess if guess is not None else 2 * max(lo, 1), MAX_MICRO_BATCH)
        elif guess is None or guess >= hi or guess in seen:
            guess = (lo + hi) // 2
        if guess in seen or guess < 1:  # nothing new left to probe (or the cap reached)
            return None, done()
        get(guess)
        spent += 1


def breakdown_of(trace: Any) -> tuple[dict[BreakdownLine, int], dict[BreakdownCategory, str], dict[str, Any]]:
    """The accounting's lines at the traced snapshot's peak allocated (requested bytes)."""
    from ..analysis.device import analyze

    a = analyze(trace)
    _, k = a.peak_allocated
    b = a.breakdown_at(k, "peak_allocated")
    return dict(b.categories), dict(b.sources), {"event_index": b.event_index, "step": b.step, "phase": b.phase,
                                                 "allocated_bytes": b.allocated_bytes}


def lay_out(snapshot: dict[str, Any], room_bytes: int | None,
            addresses: dict[int, int] | None = None) -> dict[str, Any]:
    """The traced snapshot as the allocator model would have recorded it on the GPU: every request
    replayed (default settings) through :class:`oomdoctor.simulate.allocator.CachingAllocator` with the
    device limit ``room_bytes``; ``alloc``/``free_*`` entries at the model's block addresses (sizes stay the
    requested bytes, as ``CUDACachingAllocator.cpp`` records ``orig_size``), the model's ``segment_alloc`` /
    ``segment_free`` entries before the request that caused them, an ``oom`` entry (``size`` the rounded
    request, ``device_free`` the room left) where the model runs out, the trace ending there as an OOM
    snapshot does, and ``segments`` the model's final state. ``diagnose`` then reads reserved memory,
    fragmentation and the OOM from it. ``addresses``: filled with each traced allocation's address -> its block's
    address in the model (for the sidecar's facts, :func:`laid_out_meta`). Raises nothing the model does not (a
    trace it cannot replay keeps its original form: the caller decides)."""
    import numpy as np

    from ..analysis.rounding import round_size
    from ..simulate.allocator import CachingAllocator
    from ..simulate.config import config_from_settings
    from ..trace.model import ACTION_NAMES

    config = config_from_settings(snapshot.get("allocator_settings"))
    table = np.asarray(config.roundup_power2_divisions, dtype=np.int64)
    sim = CachingAllocator(config, device_limit=room_bytes)
    events = snapshot["device_traces"][0]
    sizes = round_size(np.asarray([e["size"] if e["action"] == "alloc" else 0 for e in events], dtype=np.int64),
                       table).tolist()
    out: list[dict[str, Any]] = []
    live: dict[int, Block] = {}
    frames_of: dict[int, list[Any]] = {}

    def segs(n0: int, e: dict[str, Any]) -> None:
        for act, ptr, size in sim.segment_events[n0:]:
            out.append({"action": ACTION_NAMES[act], "addr": ptr, "size": size, "stream": 0, "time_us": e["time_us"],
                        "compile_context": "N/A", "user_metadata": "", "frames": e["frames"]})

    for i, e in enumerate(events):
        a = e["action"]
        n0 = len(sim.segment_events)
        if a == "alloc":
            b = sim.malloc(sizes[i], e["size"], 0)
            segs(n0, e)
            if b is None:
                out.append({"action": "oom", "addr": 0, "size": sizes[i], "stream": 0, "time_us": e["time_us"],
                            "device_free": max((room_bytes or 0) - sim.reserved, 0), "compile_context": "N/A",
                            "user_metadata": "", "frames": e["frames"]})
                break
            live[e["addr"]] = b
            if addresses is not None:
                addresses[e["addr"]] = b.ptr  # a block's address holds while it is allocated
            frames_of[b.ptr] = e["frames"]
            out.append({**e, "addr": b.ptr})
        elif a == "free_requested":
            out.append({**e, "addr": live[e["addr"]].ptr})
        elif a == "free_completed":
            b = live.pop(e["addr"])
            ptr = b.ptr  # freeing merges the block with free neighbours, which moves its ptr
            sim.free(b)
            out.append({**e, "addr": ptr})
            segs(n0, e)
    blocks = [b for b in live.values()] + [b for pool in (sim.small, sim.large) for b in pool.free_blocks()]
    heads: dict[int, Block] = {}
    for b in blocks:
        h = b
        while h.prev is not None:
            h = h.prev
        heads[h.ptr] = h
    segments: list[dict[str, Any]] = []
    for ptr in sorted(heads):
        h = heads[ptr]
        rows: list[dict[str, Any]] = []
        b = h
        while b is not None:
            rows.append({"address": b.ptr, "size": b.size, "requested_size": b.requested if b.allocated else 0,
                         "state": "active_allocated" if b.allocated else "inactive",
                         "frames": frames_of.get(b.ptr, []) if b.allocated else []})
            b = b.next
        total = sum(r["size"] for r in rows)
        alloc = sum(r["size"] for r in rows if r["state"] == "active_allocated")
        segments.append({"device": 0, "address": ptr, "total_size": total, "allocated_size": alloc,
                         "active_size": alloc, "requested_size": sum(r["requested_size"] for r in rows),
                         "stream": 0, "segment_type": "small" if h.pool.is_small else "large",
                         "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": rows})
    return {**snapshot, "segments": segments, "device_traces": [out]}


def laid_out_meta(meta: dict[str, Any], addresses: dict[int, int]) -> dict[str, Any]:
    """The sidecar of a laid-out snapshot (:func:`lay_out`): its facts (``tensors``, ``modules``, the kernel buffers) at the
    addresses the allocator model gave the blocks, so that ``diagnose`` places them on the snapshot's blocks as
    preflight placed them on the traced ones (issue 52: it read the parameters as unknown). A storage the model never
    laid out (after its OOM) is left out."""
    def moved(pairs: list[list[int]]) -> list[list[int]]:
        return sorted([addresses[a], n] for a, n in pairs if a in addresses)

    def moved_parts(items: list[list[Any]]) -> list[list[Any]]:  # a module record's [address, bytes, part]
        return sorted([addresses[a], n, part] for a, n, part in items if a in addresses)

    out = dict(meta)
    tensors: list[dict[str, Any]] = meta.get("tensors") or []
    out["tensors"] = [{k: moved(v) if k in ("parameters", "gradients", "optimizer_state", "workspaces") else v
                       for k, v in rec.items()} for rec in tensors]
    if meta.get("modules"):
        out["modules"] = [{**rec, "roots": [{k: moved_parts(v) if k in MODULE_FACT_KINDS else v for k, v in root.items()}
                                            for root in rec.get("roots", ())]} for rec in meta["modules"]]
    pf = dict(meta.get("preflight") or {})
    if pf.get("kernel_buffers"):
        pf["kernel_buffers"] = [{**k, "addr": addresses[k["addr"]]} for k in pf["kernel_buffers"]
                                if k["addr"] in addresses]
    out["preflight"] = pf
    return out


#: what the trace leaves out, said by id (the CLI words them)
NOT_TRACED: tuple[str, ...] = ("kernel_workspaces_chosen_at_run_time", "cpu_resident_optimizer_steps",
              "collectives")


def answer(trace_fn: Callable[[int | None], tuple[dict[str, Any], dict[str, Any], Any]], *, micro_batch: int | None,
           gpu_name: str | None, gpu_total_bytes: int, outside_bytes: int, outside_source: str,
           snapshot_path: str | None, write: Callable[[str, dict[str, Any], dict[str, Any]], object],
           search: bool = True, gpu_memory_given: bool = False) -> PreflightAnswer:
    """Trace, replay and answer.

    ``trace_fn(n)`` traces the job at micro-batch ``n`` (None: as given) and returns ``(snapshot dict,
    sidecar dict, record)``; the one at ``micro_batch`` is written to ``snapshot_path`` (a temporary file
    when None) with ``write(path, snapshot, sidecar)`` (:func:`oomdoctor.preflight.snapshot.write`, passed in by
    the caller: the tracer's package imports torch, which this layer never does). ``search``: look for the largest
    micro-batch (needs ``micro_batch``).
    """

    cap = room(gpu_total_bytes, outside_bytes, given=gpu_memory_given, nccl=outside_source.endswith("+nccl"))
    tmp = tempfile.TemporaryDirectory()
    kept: dict[str, Any] = {}
    try:
        def at(n: int | None, keep: bool = False) -> tuple[Replayed, Any]:
            snap, meta, rec = trace_fn(n)
            p = str(Path(tmp.name) / f"mb{n}.pickle")
            write(p, snap, meta)
            if keep:
                kept.update(snap=snap, meta=meta)
            return replayed(p, cap, n, rec.events, rec.wall_s)

        first, trace = at(micro_batch, keep=True)
        largest, method, traces = None, "not searched", [first]
        if search and micro_batch:
            def at_n(n: int) -> Replayed:
                return at(n)[0]
            largest, traces = largest_micro_batch(at_n, first, int(cap.limit_bytes or 0))
            method = "traced"
        # the snapshot as written (-o) is the one every number below is read from, as diagnose reads it: its
        # events (the allocator model's segment calls too) and its breakdown (issue 52)
        addresses: dict[int, int] = {}
        laid = lay_out(kept["snap"], cap.limit_bytes, addresses)
        meta = laid_out_meta(kept["meta"], addresses)
        last: dict[str, Any] = laid["device_traces"][0][-1] if laid["device_traces"][0] else {}
        if last.get("action") == "oom":
            meta["kind"] = "oom"
            meta["oom"] = {"device": 0, "alloc_bytes": last["size"], "device_limit_bytes": cap.limit_bytes,
                           "device_free_bytes": last["device_free"]}
        meta["preflight"] = {**meta.get("preflight", {}),
                             "laid_out_by": "oomdoctor.simulate's allocator model, default settings, device limit "
                                            f"{cap.limit_bytes} bytes (the GPU's total less what runs outside the "
                                            "allocator)"}
        # read back from a file of its own: -o may be a FIFO, a device or standard output, which cannot be read
        written = str(Path(tmp.name) / "laid-out.pickle")
        write(written, laid, meta)
        if snapshot_path:
            write(snapshot_path, laid, meta)
        from ..trace import load

        cats, sources, where = breakdown_of(load(written))
        oom_site = _site(last.get("frames") or []) if last.get("action") == "oom" else None
        events = len(laid["device_traces"][0])
    finally:
        tmp.cleanup()
    return PreflightAnswer(
        job=dict(trace.meta.get("preflight", {}).get("job", {})), gpu_name=gpu_name, gpu_total_bytes=gpu_total_bytes,
        outside_allocator_bytes=outside_bytes, outside_allocator_source=outside_source,
        room_bytes=int(cap.limit_bytes or 0), peak_allocated_bytes=first.peak_allocated_bytes,
        peak_reserved_bytes=first.peak_reserved_bytes, peak_requested_bytes=first.peak_requested_bytes,
        oom=first.oom, oom_request_bytes=first.oom_request_bytes, micro_batch=micro_batch,
        largest_micro_batch=largest, largest_micro_batch_method=method,
        largest_micro_batch_margin_bytes=margin_bytes(int(cap.limit_bytes or 0)) if method == "traced" else 0,
        micro_batch_traces=[{"micro_batch": r.micro_batch, "peak_allocated_bytes": r.peak_allocated_bytes,
                             "peak_reserved_bytes": r.peak_reserved_bytes, "oom": r.oom,
                             "trace_wall_s": round(r.trace_wall_s, 2)} for r in traces],
        breakdown=cats, breakdown_sources=sources, breakdown_at=where, settings=first.settings,
        snapshot=snapshot_path, trace_wall_s=round(sum(r.trace_wall_s for r in traces), 2), events=events,
        not_traced=list(NOT_TRACED) + [n for n in trace.meta.get("preflight", {}).get("notes", []) if n not in NOT_TRACED],
        invented_values=list(trace.meta.get("preflight", {}).get("invented_values", [])), oom_site=oom_site)
