"""The verdict: the answer to the user's first question, per rank and for the job.

Computed once, after the detectors and the materiality rule, from the accounting, the anatomy, the
findings and the allocator model. Kinds (:data:`KINDS`):

At an OOM (the last ``oom`` entry of the rank; ``need`` = allocated bytes then + the failed request,
``room`` = what the allocator could hold, :func:`.fits.device_room`):

- ``growth``: memory kept across micro-batches (``outputs`` in the breakdown, or a material
  ``output-accumulation`` / ``memory-growth`` finding on the rank) at least
  the shortfall ``need - room`` and 64 MiB: the job accumulates, a bigger GPU only delays it;
- ``kept-exception``: a ``kept-exception`` finding on the rank: an earlier attempt's tensors, held by its caught
  exception when the work ran again, cover the shortfall (and 64 MiB): releasing the exception is the fix;
- ``imbalance``: a ``rank-imbalance`` finding on this rank whose excess covers the shortfall;
- ``capacity``: ``need > room``: the live tensors alone do not fit; no allocator setting helps. Pipeline knobs are
  advised only where the job runs a pipeline (:func:`schedule_evidence`); inside ``optimizer.step()`` the optimizer's
  own memory is (``optimizer-memory``), never a smaller micro-batch;
- ``deferred-free``: ``need <= room < need + pending frees``: blocks freed by Python but held for
  ``record_stream`` made the difference;
- ``fragmentation``: ``need <= room``: enough memory was free, cached or on the device, but not in
  one piece (PyTorch's "reserved but unallocated"); the simulator says whether
  ``expandable_segments`` lets the recorded trace through (``fits.expandable_batch_scale >= 1``). Only when
  the fix's replay gets through with margin (:mod:`.margin`): when it still runs out, runs out later in the
  step, or gets through with less spare room than the margin (at the edge), the verdict is ``capacity``,
  saying that fragmentation hit first.

Without an OOM: ``growth`` when a material ``memory-growth`` / ``output-accumulation`` finding says memory
grows across passes (``pipeline-output-cache`` is freed at every step's end: a finding, never the verdict); ``deferred-free`` or ``imbalance`` when such
a finding holds at least :data:`VERDICT_FRACTION` of the rank's peak reserved; else ``healthy``, said to be at
the edge with under :data:`EDGE_FRACTION` of the room left. The peak judged is the job's own where PyTorch's counters
say it (:mod:`oomdoctor.analysis.jobpeak`: a ring buffer may have dropped it), else the recorded window's. Fragmentation without an OOM is a finding, not the
verdict: the job ran. A snapshot without history is judged the same way on its final state; ``empty`` when it
holds nothing at all.

The job's verdict is its worst rank's: ranks that ran out of memory first, then by bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..analysis.accounting import KV_CACHE, OPTIMIZER_STATE, PARAMETERS, Breakdown
from ..analysis.device import DeviceAnalysis
from ..analysis.jobpeak import JobPeak
from ..analysis.phases import OPTIMIZER_PHASE, OPTIMIZER_STEP, annotation_windows
from ..analysis.rounding import round_size
from ..analysis.schedule import in_flight_parts, schedule_evidence
from ..detectors.finding import Finding, Fix, SiteRef
from ..detectors.kept_exception import KeptExceptionEvidence
from ..frameworks import Framework, detect_frameworks, running_files
from ..ids import VERDICT_ACTIONS, VERDICT_KINDS, VERDICT_REASONS, VerdictAction, VerdictKind, VerdictReason
from ..trace.model import DEFAULT_POOL
from ..units import MiB
from .fits import Fits, Room
from .margin import margin as prediction_margin

KINDS = VERDICT_KINDS
EDGE_FRACTION = 0.10
"""A healthy rank with less headroom than this fraction of its room is said to be at the edge."""
VERDICT_FRACTION = EDGE_FRACTION
"""(Equal to :data:`EDGE_FRACTION` by construction, docs/diagnose.md "Constants": a fix that frees less than the
margin under which a rank is called at the edge cannot change that call.) Without an OOM, memory held by deferred frees or one rank's excess decides the verdict when it is at least this
fraction of the rank's peak reserved (below it, the finding is listed and the rank is healthy); growth decides at
any material size (it grows); fragmentation never does (the job ran: its cache was reusable enough)."""
KV_CACHE_FRACTION = 0.2
"""A KV cache holding at least this fraction of the allocated bytes is named in the verdict."""
GROWTH_FINDINGS = ("output-accumulation", "memory-growth")
"""Findings of memory that grows across passes or steps. ``pipeline-output-cache`` is none: a pipeline's last
stage keeps its micro-batches' outputs until ``step()`` ends and frees them there, so memory does not grow from
step to step; it is listed as a finding under whatever verdict the rank gets."""
FINDING_KIND: dict[str, VerdictKind] = {"deferred-free": "deferred-free", "fragmentation": "fragmentation", "rank-imbalance": "imbalance",
                "kept-exception": "kept-exception", **{f: "growth" for f in GROWTH_FINDINGS}}

MIN_DECISIVE_BYTES = 64 * MiB


REASONS = VERDICT_REASONS
"""The ids a verdict's ``reasons`` may hold (:data:`oomdoctor.ids.VERDICT_REASONS`; what each means and how it is
said: :data:`oomdoctor.render.words.verdict.REASONS`)."""

ACTIONS = VERDICT_ACTIONS
"""The ids of a verdict's actions (:class:`Action`); their numbers are in the verdict's ``evidence``."""


@dataclass(kw_only=True)
class Action:
    """One thing to do: ``id`` (:data:`ACTIONS`); ``framework``: the id of the framework whose knob it names
    (:mod:`oomdoctor.frameworks`), if one; ``fix``: for ``finding-fix``, the finding's :class:`Fix` itself (its
    words are the renderers', :func:`oomdoctor.render.words.findings.fix_text`).

    The docstring under each field is its description in the JSON schema (``oomdoctor schema diagnose``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    id: VerdictAction
    """the action (oomdoctor.ids.VERDICT_ACTIONS)"""
    framework: str | None = None
    """the id of the framework whose knob it names"""
    fix: Fix | None = None
    """finding-fix: the finding's fix the action is, in the JSON its id (its words are the action's text)"""


@dataclass(kw_only=True)
class Verdict:
    """``kind`` (:data:`KINDS`), the ``bytes`` that decide it, the ``ranks`` it concerns, the ``headroom_bytes``
    left on the device at the peak of reserved memory (None when the device's room is unknown), the finding behind
    it, if one, the numbers behind it (``evidence``), the ids of the wording choices its summary makes
    (``reasons``, :data:`oomdoctor.ids.VERDICT_REASONS`) and what to do, in order (``to_do``, :class:`Action`). Facts only: the
    renderers say them (:mod:`oomdoctor.render.words.verdict`).

    The docstring under each field is its description in the JSON schema (``oomdoctor schema diagnose``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    kind: VerdictKind
    """the answer: what ran out of memory, or why memory is not what it should be"""
    bytes: int
    """the bytes that decide it (the shortfall, the free memory, the bytes kept, ...) (bytes)"""
    ranks: list[int]
    """the ranks it concerns"""
    headroom_bytes: int | None = None
    """room left at the peak of reserved memory, the job's own when PyTorch's counters say it (see the rank's
    peak_source) (null: the GPU's size is unknown or the rank ran out of memory) (bytes)"""
    finding: str | None = None
    """the id of the finding behind it"""
    evidence: dict[str, Any] = field(default_factory=dict[str, Any])
    """the numbers behind it (keys ending _bytes are bytes)"""
    reasons: list[VerdictReason] = field(default_factory=list[VerdictReason])
    """the ids of the wording choices the summary is said from, in the order they were made (report/verdict.py
    REASONS)"""
    to_do: list[Action] = field(default_factory=list[Action])
    """the ids the actions are said from, in order"""


def _material(findings: list[Finding], rank: int) -> list[Finding]:
    return [f for f in findings if rank in f.ranks and f.severity in ("medium", "high", "critical")]


def _rank_bytes(f: Finding, rank: int) -> int:
    return int(f.per_rank_bytes.get(rank, f.bytes))


def rank_verdict(a: DeviceAnalysis, findings: list[Finding], room: Room, bd: Breakdown, holders: Sequence[SiteRef],
                 fits: Callable[[], Fits | None],
                 defragmented: Callable[[], Mapping[str, Any] | None] = lambda: None) -> Verdict:
    """The verdict of one rank (see the module doc). ``bd``: the breakdown at the OOM or the peak;
    ``fits``: computes what fits when a verdict needs it (capacity, fragmentation): replays cost time;
    ``defragmented``: the prediction (:mod:`.predict`) of the trace replayed with the fragmentation fix
    (``expandable_segments:True``, or ``max_split_size_mb`` where segments are expandable already), or
    None when it cannot be replayed."""
    rank = a.rank
    jp = a.job_peak
    peak_reserved = jp.peak_reserved_bytes  # the job's own when known: a ring buffer may have dropped its peak
    headroom = room.bytes - peak_reserved if room.bytes is not None else None
    ev: dict[str, Any] = {"rank": rank, "peak_reserved_bytes": peak_reserved, "peak_allocated_bytes": jp.peak_allocated_bytes,
                          "room_bytes": room.bytes, "room_source": room.source,
                          "room_source_values": dict(room.values), "phase": bd.phase,
                          "step": bd.step if bd.step is not None else "-", "outputs_bytes": bd.categories["outputs"]}
    ev |= peak_evidence(jp)
    mine = _material(findings, rank)
    _logits(holders, bd, ev)
    if bd.categories.get("kv_cache", 0) >= KV_CACHE_FRACTION * max(bd.allocated_bytes, 1):
        ev["kv_cache_bytes"] = bd.categories["kv_cache"]
    if a.oom_events.size and a.phases.phase_name(int(a.oom_events[-1])) == "generation":
        growth = kv_growth_per_token(a, int(a.oom_events[-1]))
        if growth is not None:
            ev["kv_cache_growth_per_token_bytes"] = growth
    if a.oom_events.size:
        k = int(a.oom_events[-1])
        passes, recurrences = in_flight_parts(a.trace.stacks, a.lifetimes, a.accounting, a.phases, k)
        ev["in_flight"] = max(passes, recurrences)
        why = schedule_evidence(a, recurrences)
        if why is not None:
            ev["schedule_evidence"] = why
        if in_optimizer_step(a, k):
            lt, acc = a.lifetimes, a.accounting
            alive = lt.allocated_mask(k)
            ev["in_optimizer_step"] = True
            ev["optimizer_state_bytes"] = int(lt.size[alive & (acc.category == OPTIMIZER_STATE)].sum())
            ev["parameters_bytes"] = int(lt.size[alive & (acc.category == PARAMETERS)].sum())
        v = _oom_verdict(a, mine, room, bd, fits, defragmented, ev)
        v.to_do = _actions(v, a, mine, fits() if v.kind in ("capacity", "fragmentation") else None)
        return v
    reasons: list[VerdictReason] = ["room-known" if headroom is not None else "room-unknown", *_peak_reasons(jp)]
    if headroom is not None:
        assert room.bytes is not None  # headroom is room.bytes - peak_reserved
        ev["headroom_bytes"] = headroom
        if headroom < EDGE_FRACTION * room.bytes:
            ev["headroom_percent"] = round(100 * max(headroom, 0) / room.bytes, 1)
            reasons.append("at-edge")
            if "kv_cache_bytes" in ev:
                reasons.append("kv-cache-named")
    return with_findings(Verdict(kind="healthy", bytes=peak_reserved, ranks=[rank], headroom_bytes=headroom,
                                 finding=None, evidence=ev, reasons=reasons), findings)


def peak_evidence(jp: JobPeak) -> dict[str, Any]:
    """The job's peaks beside the recorded window's, for a verdict's evidence (bytes; ``peak_source``: see
    :data:`oomdoctor.analysis.jobpeak.PEAK_SOURCES`)."""
    return {"window_peak_reserved_bytes": jp.window_peak_reserved_bytes,
            "window_peak_allocated_bytes": jp.window_peak_allocated_bytes,
            "job_peak_reserved_bytes": jp.job_peak_reserved_bytes,
            "job_peak_allocated_bytes": jp.job_peak_allocated_bytes, "peak_source": jp.source}


def _peak_reasons(jp: JobPeak) -> list[VerdictReason]:
    """The reasons of a healthy verdict about its peaks: the window's peak is named where the job's is above it, as a
    miss where the gap is material (issue 52), and peaks before the window are said to be unknown where nothing says
    them (issue 41)."""
    def said(missed: bool, material: bool, window_missed: VerdictReason, job_peak: VerdictReason) -> list[VerdictReason]:
        return [window_missed if material else job_peak] if missed else []

    return ([*said(jp.reserved_missed, jp.reserved_missed_material, "reserved-window-missed", "reserved-job-peak"),
             *said(jp.allocated_missed, jp.allocated_missed_material, "allocated-window-missed", "allocated-job-peak"),
             *(["peaks-before-window-unknown"] if jp.source == "unknown-before-window" else [])])


def kv_growth_per_token(a: DeviceAnalysis, k: int) -> int | None:
    """Bytes the KV cache grows by per generated token up to event ``k``, from the cache's own blocks
    (category ``kv_cache``): the tensors alive at ``k`` (two per layer) were each re-made one token larger
    per token (``torch.cat`` in ``DynamicLayer.update``), so the allocations past the first set count the
    tokens, and the bytes alive at ``k`` less those when the first set was complete are their growth.
    None without a cache, or before a token was added; 0 for a cache that never grows (a static cache).
    With it a renderer can say what fits in batch x new tokens."""
    lt, acc = a.lifetimes, a.accounting
    rows = np.flatnonzero((acc.category == KV_CACHE) & (lt.alloc >= 0) & (lt.alloc <= k))
    alive = rows[lt.allocated_mask(k)[rows]]
    if alive.size == 0 or rows.size < 2 * alive.size:
        return None
    rows = rows[np.argsort(lt.alloc[rows], kind="stable")]
    first = int(lt.alloc[rows[alive.size - 1]])  # the first set of cache tensors made (the prefill)
    start = int(lt.requested[rows[lt.allocated_mask(first)[rows]]].sum())
    tokens = (rows.size - alive.size) / alive.size
    return max(int(round((int(lt.requested[alive].sum()) - start) / tokens)), 0)


def state_verdict(a: DeviceAnalysis, room: Room) -> Verdict:
    """A snapshot without history (``enabled="state"``): no OOM to judge, only the final state; ``empty``
    when it holds no segment either (recorded before any CUDA allocation, or with recording off). The
    caller re-reads it against the findings (:func:`with_findings`)."""
    jp = a.job_peak
    ev = {"rank": a.rank, "allocated_bytes": a.peak_allocated[0], "reserved_bytes": a.peak_reserved[0],
          "peak_reserved_bytes": jp.peak_reserved_bytes, "room_bytes": room.bytes} | peak_evidence(jp)
    if not a.device.segments:
        return Verdict(kind="empty", bytes=0, ranks=[a.rank], headroom_bytes=room.bytes, finding=None,
                       evidence=ev, reasons=["nothing-recorded"])
    return Verdict(kind="healthy", bytes=jp.peak_reserved_bytes, ranks=[a.rank],
                   headroom_bytes=room.bytes - jp.peak_reserved_bytes if room.bytes is not None else None,
                   finding=None, evidence=ev, reasons=["final-state-only"])


def with_findings(v: Verdict, findings: list[Finding]) -> Verdict:
    """A verdict without OOM re-read against ``findings``: the material finding with the most bytes at
    stake on the rank decides it (see the module doc); else ``v`` unchanged (healthy). Also used when
    the in-job summary adds the cross-rank findings (``report/merge.py``)."""
    rank = v.ranks[0]
    peak = v.evidence.get("peak_reserved_bytes") or 0
    mine = [f for f in _material(findings, rank) if f.id in FINDING_KIND and FINDING_KIND[f.id] != "fragmentation"
            and (FINDING_KIND[f.id] == "growth" or _rank_bytes(f, rank) >= VERDICT_FRACTION * peak)]
    if not mine:
        return _say_material(v, findings)
    f = max(mine, key=lambda x: (_rank_bytes(x, rank), _PREFER.index(FINDING_KIND[x.id])))
    ev = {**v.evidence, "finding": f.id, "finding_bytes": _rank_bytes(f, rank), "title": f.title_ref()}
    out = Verdict(kind=FINDING_KIND[f.id], bytes=_rank_bytes(f, rank), ranks=[rank],
                  headroom_bytes=v.headroom_bytes, finding=f.id, evidence=ev, reasons=["finding-decides"])
    fx = next((x for x in f.fixes if x.applies is not False), None)
    if fx is not None:
        out.to_do = [Action(id="finding-fix", fix=fx)]  # the fix itself: its words are the renderers'
    return out


def _say_material(v: Verdict, findings: list[Finding]) -> Verdict:
    """A healthy ``v`` whose rank has material findings that decide no verdict of their own says how many
    (``material_findings``, reason ``material-findings``): the report lists them under it."""
    n = len(_material(findings, v.ranks[0])) if v.kind == "healthy" and v.ranks else 0
    if not n:
        return v
    reasons = v.reasons if "material-findings" in v.reasons else [*v.reasons, "material-findings"]
    return replace(v, reasons=reasons, evidence={**v.evidence, "material_findings": n})


def _own_imbalance(mine: list[Finding], rank: int) -> Finding | None:
    """The first ``rank-imbalance`` finding on ``rank`` alone: the one an ``imbalance`` verdict rests on, for its
    bytes and for its action alike."""
    return next((f for f in mine if f.id == "rank-imbalance" and f.ranks == [rank]), None)


def _imbalance(mine: list[Finding], rank: int, short: int | None, ev: dict[str, Any]) -> Verdict | None:
    """``imbalance`` when a ``rank-imbalance`` finding on this rank alone holds at least the shortfall."""
    f = _own_imbalance(mine, rank)
    if f is None or short is None or short <= 0 or _rank_bytes(f, rank) < short:
        return None
    ev = {**ev, "excess_bytes": _rank_bytes(f, rank)}
    return Verdict(kind="imbalance", bytes=ev["excess_bytes"], ranks=[rank], headroom_bytes=None,
                   finding="rank-imbalance", evidence=ev, reasons=["rank-excess"])


_CAPACITY_EVIDENCE = ("largest_micro_batch", "batch_scale", "estimated_fit", "estimate_assumptions", "no_fit_reason",
                      "checkpointing_frees_bytes", "sharding_frees_bytes")
"""Evidence the capacity verdict adds after the imbalance check (what fits, and its actions')."""


def oom_with_findings(v: Verdict, findings: list[Finding]) -> Verdict:
    """An OOM rank's ``capacity`` verdict re-read against cross-rank findings (``rank-imbalance``, which a rank
    judged alone cannot see): ``imbalance`` when its excess covers the shortfall, with the evidence and action
    :func:`rank_verdict` gives it when all ranks are at hand; else ``v`` unchanged."""
    if v.kind != "capacity":
        return v
    rank = v.ranks[0]
    mine = _material(findings, rank)
    ev = {k: x for k, x in v.evidence.items() if k not in _CAPACITY_EVIDENCE}
    out = _imbalance(mine, rank, v.evidence.get("shortfall_bytes"), ev)
    if out is None:
        return v
    f = _own_imbalance(mine, rank)
    assert f is not None  # _imbalance found it
    fx = next((x for x in f.fixes if x.applies is not False), None)
    out.to_do = [Action(id="finding-fix", fix=fx)] if fx is not None else []
    return out


def _oom_verdict(a: DeviceAnalysis, mine: list[Finding], room: Room, bd: Breakdown,
                 get_fits: Callable[[], Fits | None], defragmented: Callable[[], Mapping[str, Any] | None],
                 ev: dict[str, Any]) -> Verdict:
    rank = a.rank
    k = int(a.oom_events[-1])
    request = int(round_size(a.device.events["size"][k:k + 1])[0])
    allocated = a.allocated_at(k)
    an = a.anatomy_at(k)
    need = allocated + request
    ev |= {"request_bytes": request, "allocated_bytes": allocated, "need_bytes": need,
           "reserved_unallocated_bytes": an.reserved_bytes - an.allocated_bytes,
           "largest_free_block_bytes": an.largest_free_block_bytes, "pending_free_bytes": an.pending_free_bytes}
    room_b = room.bytes
    short = need - room_b if room_b is not None else None
    if room_b is not None:  # short too
        ev["shortfall_bytes"] = short
        ev["free_bytes"] = room_b - allocated - an.pending_free_bytes  # pending frees are not free yet
    decisive = max(short or 0, MIN_DECISIVE_BYTES)
    kept_ex = next((f for f in mine if f.id == "kept-exception"), None)
    held = kept_ex.evidence if kept_ex is not None and isinstance(kept_ex.evidence, KeptExceptionEvidence) else None
    if kept_ex is not None and held is not None and held.held_at_last_oom_bytes >= decisive:
        # an earlier attempt's tensors, held by its caught exception, cover the shortfall: that is the cause, not
        # growth or capacity (issue 49)
        ev |= {"kept_exception_bytes": held.held_at_last_oom_bytes,
               "kept_oom_event": held.oom_event, "kept_retry_event": held.retry_event}
        return Verdict(kind="kept-exception", bytes=ev["kept_exception_bytes"], ranks=[rank], headroom_bytes=None,
                       finding=kept_ex.id, evidence=ev, reasons=["held-by-exception"])
    growth = [f for f in mine if f.id in GROWTH_FINDINGS]
    kept = max([bd.categories["outputs"]] + [_rank_bytes(f, rank) for f in growth])
    if kept >= decisive and (short is None or short > 0 or growth):
        ev["kept_bytes"] = kept
        f = max(growth, key=lambda x: _rank_bytes(x, rank)) if growth else None
        return Verdict(kind="growth", bytes=kept, ranks=[rank], headroom_bytes=None,
                       finding=f.id if f else None, evidence=ev, reasons=["kept-across-micro-batches"])
    got = _imbalance(mine, rank, short, ev)
    if got is not None:
        return got
    if short is None:
        return Verdict(kind="capacity", bytes=request, ranks=[rank], headroom_bytes=None, finding=None,
                       evidence=ev, reasons=["room-unknown"])
    assert room_b is not None  # short is need - room_b
    if short > 0:
        fits = get_fits()
        reasons: list[VerdictReason] = ["live-tensors-exceed-room"]
        if ev.get("in_flight", 0) >= 2 and "schedule_evidence" in ev:
            reasons.append("pipeline-in-flight")
        if ev.get("in_optimizer_step"):
            reasons.append("oom-in-optimizer-step")
        if "kv_cache_bytes" in ev:
            reasons.append("kv-cache-named")
        reasons += _fit_reason(fits, ev)
        _kv_fit(a, bd, ev, room_b, need, None)
        return Verdict(kind="capacity", bytes=short, ranks=[rank], headroom_bytes=None, finding=None,
                       evidence=ev, reasons=reasons)
    # need <= room < need + pending: the blocks freed by Python but held for other streams made the
    # difference, however few bytes they are (a small GPU or a MIG slice runs out by little)
    if an.pending_free_bytes > 0 and need + an.pending_free_bytes > room_b:
        return Verdict(kind="deferred-free", bytes=an.pending_free_bytes, ranks=[rank], headroom_bytes=None,
                       finding="deferred-free", evidence=ev, reasons=["pending-frees"])
    ev["room_kind"] = room.kind
    reasons: list[VerdictReason] = ["not-in-one-piece", *(["fraction-cap"] if room.kind == "fraction" else []),
                                    *(["cap-lower-end"] if room.source == "oom-fraction-cap" else [])]
    unreserved = room_b - an.reserved_bytes
    if unreserved >= 0 and ev["free_bytes"] == ev["reserved_unallocated_bytes"] - an.pending_free_bytes + unreserved:
        # the free bytes, split: reserved but not allocated (the fragmentation finding's bytes at stake, less the
        # deferred frees among them) and not yet reserved under the room; said so that the finding's number is the
        # verdict's too (issue 52)
        ev["unreserved_bytes"] = unreserved
        reasons.append("free-split")
    graph = sum(p.reserved_bytes for p in an.pools if p.pool_id != DEFAULT_POOL)
    if graph:
        ev["graph_pool_bytes"] = graph
        reasons.append("graph-pools")
    fixed = defragmented()
    if fixed is not None:
        ev["defragmented_config"] = fixed["config"]
        ev["defragmented_reach"] = fixed["reach"]
        ev.update({f"fix_{k}": val for k, val in fixed.items()})
        reasons.append("fix-simulated")
        if fixed.get("oom") is not None or fixed.get("at_edge"):
            # no setting gets the replay through the recorded steps with margin (report/margin.py): fragmentation hit
            # first, but the job is at capacity; never counted as a fix
            ev["margin_bytes"] = fixed.get("margin_bytes", 0)
            without: VerdictReason = "runs-out-without-it" if fixed.get("oom") is not None else "at-edge-without-it"
            reasons.extend(["fragmentation-hit-first", without, *_fit_reason(get_fits(), ev)])
            # the bytes that decide it: the failed request, or what the spare room lacks of the margin
            decides = (fixed["oom"]["requested_bytes"] if fixed.get("oom") is not None
                       else ev["margin_bytes"] - fixed.get("spare_bytes", 0))
            return Verdict(kind="capacity", bytes=decides, ranks=[rank], headroom_bytes=None, finding=None,
                           evidence=ev, reasons=reasons)
        # the setting gets the replay past the recorded OOM and through every recorded step: the OOM that happened
        # was fragmentation. Whether the job keeps running (the rest of the step, later steps) is the prediction's
        # continuation, a second statement with its own margin: it never changes the cause (issue 49)
        if fixed["reach"] == "step-ran-out":
            ev["extended_request_bytes"] = fixed["extended_oom_requested_bytes"]
            reasons.append("continuation-runs-out")
        left = _kv_fit(a, bd, ev, room_b, need, fixed.get("margin_bytes"))
        if left is not None and left < ev["kv_cache_growth_per_token_bytes"]:
            # generate(): the cache grows by the same bytes every token to come; a fix that leaves less than one
            # token's growth beyond the failed request and the margin does not carry the generation on
            reasons.extend(["fragmentation-hit-first", "kv-generation-at-capacity"])
            return Verdict(kind="capacity", bytes=ev["kv_cache_growth_per_token_bytes"] - left, ranks=[rank],
                           headroom_bytes=None, finding=None, evidence=ev, reasons=reasons)
        if left is not None:
            reasons.append("kv-fits-with-fix")
        ev["defragmented_outcome_template"] = fixed["outcome"]  # the JSON writes the words' template here
    reasons += _fit_reason(get_fits(), ev)
    # the bytes that decide it: the free ones its words say (pending frees are not free yet)
    return Verdict(kind="fragmentation", bytes=ev["free_bytes"], ranks=[rank], headroom_bytes=None,
                   finding="fragmentation", evidence=ev, reasons=reasons)


def in_optimizer_step(a: DeviceAnalysis, k: int) -> bool:
    """Is event ``k`` (an OOM) inside an optimizer's step? Where the trace holds torch.optim's own scopes
    (``Optimizer.step#``, its ``record_function``), only an event inside one is: they are the step's signal, the
    phase analysis only infers it. Without them, the phase analysis' optimizer phase (an optimizer not written
    with torch.optim). Issue 49: a GNN's next forward, its allocations recorded without stacks (the recorder's
    stack steps), continued the last update's optimizer phase, and a capacity OOM 0.8 s after the step's scope
    closed was told the optimizer's memory advice."""
    if a.phases.phase[k] != OPTIMIZER_PHASE:
        return False
    w = annotation_windows(a.device, OPTIMIZER_STEP)
    if not w.shape[0]:
        return True
    t = int(a.device.events["time_us"][k])
    return bool(np.any((w[:, 0] <= t) & (t <= w[:, 1])))


def _kv_fit(a: DeviceAnalysis, bd: Breakdown, ev: dict[str, Any], room: int, need: int,
            margin_bytes: int | None) -> int | None:
    """At an OOM inside ``generate()`` whose KV cache grows by ``kv_cache_growth_per_token_bytes`` (G) every
    token (:func:`kv_growth_per_token`): what fits, as data in ``ev``. ``kv_room_after_fix_bytes``: room - need -
    margin (bytes left beyond the failed request once fragmentation is gone; the margin is the fix's replay's,
    else :func:`.margin.margin`'s); ``kv_tokens_more``: that over G (more tokens at this batch);
    ``kv_cache_tokens``: the cache's length now (its bytes over G); ``kv_cache_tokens_fit``: the length that
    fits at this batch, (room - margin - everything but the cache) over G; batch x tokens scale together (the
    cache is batch x tokens x bytes per token per sequence). Returns room - need - margin, or None where G is
    unknown or 0 (a static cache)."""
    growth = ev.get("kv_cache_growth_per_token_bytes")
    kv = int(bd.categories.get("kv_cache", 0))
    if not growth or not kv:
        return None
    if margin_bytes is None:
        margin_bytes = prediction_margin(a).bytes
    ev["kv_margin_bytes"] = int(margin_bytes)
    left = room - need - int(margin_bytes)
    ev["kv_room_after_fix_bytes"] = max(left, 0)
    ev["kv_tokens_more"] = max(left, 0) // growth
    ev["kv_cache_tokens"] = kv // growth
    ev["kv_cache_tokens_fit"] = max(room - int(margin_bytes) - (need - kv), 0) // growth
    return left


def _fit_reason(fits: Fits | None, ev: dict[str, Any]) -> list[VerdictReason]:
    """What fits, as a reason and its numbers in ``ev``: ``fit-micro-batch`` when the largest whole micro-batch is
    known, else ``fit-batch-scale`` when the scale is; a trace cut in its first forward pass has only an estimate
    (``fit-lower-bound``, ``fit-estimate``; ``estimate_assumptions``: ids of :data:`.fits.ASSUMPTIONS`); with no answer
    at all, ``fit-not-said`` and the reason (``no_fit_reason``: an id of :data:`.fits.NOTES`); both with
    ``fit_note_values`` where the Fits has note values (the words: :mod:`oomdoctor.render.words.fits`); else none."""
    if fits is not None and fits.largest_micro_batch is not None:
        ev["largest_micro_batch"] = fits.largest_micro_batch
        return ["fit-micro-batch"]
    if fits is not None and fits.batch_scale is not None:
        ev["batch_scale"] = fits.batch_scale
        return ["fit-batch-scale"]
    if fits is not None and (fits.estimated_largest_micro_batch or fits.estimated_batch_scale):
        ev["estimated_fit"] = (fits.estimated_largest_micro_batch if fits.estimated_largest_micro_batch is not None
                               else f"{fits.estimated_batch_scale}x the current micro-batch")
        ev["estimate_assumptions"] = list(fits.assumptions)  # ids (report/fits.py ASSUMPTIONS)
        if fits.note_values:
            ev["fit_note_values"] = dict(fits.note_values)
        return ["fit-lower-bound" if fits.bound == "lower" else "fit-estimate"]
    if fits is not None and fits.notes:
        ev["no_fit_reason"] = fits.notes[-1]  # an id (report/fits.py NOTES)
        if fits.note_values:
            ev["fit_note_values"] = dict(fits.note_values)
        return ["fit-not-said"]
    return []


LOGITS_NAMES = ("cross_entropy", "log_softmax", "nll_loss", "_convert_to_fp32", "convert_to_fp32", "ForCausalLMLoss",
                "fixed_cross_entropy")
"""Functions of the loss (``torch/nn/functional.py`` ``cross_entropy`` = ``log_softmax`` + ``nll_loss``;
transformers' ``ForCausalLMLoss``/``fixed_cross_entropy``; accelerate's fp32 copy of the outputs), matched
at the exact function name of a frame: an attention softmax (Megatron's ``forward_torch_softmax``,
``torch.nn.functional.softmax``) is none of them."""
LOGITS_FRACTION = 0.2


def _frame_name(text: str) -> str:
    """The function of a frame written ``file:line in function`` (:func:`~oomdoctor.analysis.sites.frame_text`)."""
    return text.rpartition(" in ")[2]


def _logits(holders: Sequence[SiteRef], bd: Breakdown, ev: dict[str, Any]) -> None:
    """When the loss's logits (cross-entropy, log-softmax, fp32 copies of the output) hold at least
    :data:`LOGITS_FRACTION` of the allocated bytes, say so: the [tokens, vocabulary] tensors in fp32 are
    the usual cause of a language model's peak. A holder is the loss's when a frame of its stack (or its
    site) is one of :data:`LOGITS_NAMES`, by exact function name."""
    hit = [h for h in holders
           if any(_frame_name(x) in LOGITS_NAMES for x in [*(h.stack or []), h.label])]
    b = sum(h.bytes for h in hit)
    if hit and b >= LOGITS_FRACTION * max(bd.allocated_bytes, 1):
        ev["logits_bytes"] = b
        ev["logits_sites"] = ", ".join(h.label for h in hit[:3])


def _frameworks(a: DeviceAnalysis) -> list[Framework]:
    return detect_frameworks(running_files(a.trace.stacks))


SHARDING_FRAMEWORKS = ("fsdp1", "fsdp2", "deepspeed")
"""Frameworks whose presence means the job shards its model state already (FSDP1/2, DeepSpeed ZeRO)."""


def _unsharded_data_parallel(fws: list[Framework]) -> bool:
    """Whether sharding the optimizer state over data-parallel ranks is news to the job: it runs DDP (its
    forward goes through ``torch/nn/parallel/distributed.py``) and no FSDP or DeepSpeed code (which shard
    already). A job with several ranks and neither (tensor- or pipeline-parallel only) has no
    data-parallel ranks to shard over that the trace shows."""
    ids = {fw.id for fw in fws}
    return "ddp" in ids and not ids & set(SHARDING_FRAMEWORKS)


def _actions(v: Verdict, a: DeviceAnalysis, mine: list[Finding], fits: Fits | None) -> list[Action]:
    """What to do, in order (:data:`ACTIONS`); the numbers they name go into ``v.evidence``."""
    ev = v.evidence
    out: list[Action] = []
    fws = _frameworks(a)
    if v.kind == "capacity" and ev.get("in_flight", 0) >= 2 and "schedule_evidence" in ev:
        out.append(Action(id="pipeline-schedule"))
    if v.kind == "capacity" and ev.get("in_optimizer_step"):
        # inside optimizer.step() the activations are gone: neither a smaller micro-batch nor checkpointing helps;
        # an optimizer with less state, or its state sharded, does (issue 49)
        out.append(Action(id="optimizer-memory"))
        if (fits is not None and fits.sharding_optimizer_frees_bytes >= MIN_DECISIVE_BYTES
                and _unsharded_data_parallel(fws)):
            ev["sharding_frees_bytes"] = fits.sharding_optimizer_frees_bytes
            out.append(Action(id="shard-optimizer"))
        return out
    if v.kind in ("capacity", "fragmentation") and "kv_cache_bytes" in ev:
        out.append(Action(id="kv-cache-smaller", framework="generate"))
    if v.kind == "capacity":
        if fits is not None and fits.largest_micro_batch is not None:
            out.append(Action(id="micro-batch-at-most"))
        elif fits is not None and fits.batch_scale is not None:
            out.append(Action(id="micro-batch-scale"))
        if fits is not None and fits.checkpointing_frees_at_most_bytes:
            ev["checkpointing_frees_bytes"] = fits.checkpointing_frees_at_most_bytes
            out.append(Action(id="activation-checkpointing"))
        if (fits is not None and fits.sharding_optimizer_frees_bytes >= MIN_DECISIVE_BYTES
                and _unsharded_data_parallel(fws)):
            ev["sharding_frees_bytes"] = fits.sharding_optimizer_frees_bytes
            out.append(Action(id="shard-optimizer"))
        for fw in fws:
            if "activations" in fw.knobs:
                out.append(Action(id="framework-activations", framework=fw.id))
                break
    elif v.kind == "fragmentation":
        if "defragmented_reach" not in ev:
            out.append(Action(id="alloc-conf-not-simulated"))
        elif ev["defragmented_reach"] in ("step-completed", "complete") or ev.get("fix_oom", True) is None:
            out.append(Action(id="alloc-conf-simulated"))
        else:
            out.append(Action(id="alloc-conf-not-enough"))
        # no micro-batch cut: the free setting clears the recorded steps (issue 49); what fits with the recorded
        # settings stays in the summary and the fits section, as a fact
    elif v.finding is not None:
        f = (_own_imbalance(mine, v.ranks[0]) if v.kind == "imbalance"
             else next((x for x in mine if x.id == v.finding), None))
        fx = next((x for x in f.fixes if x.applies is not False), None) if f is not None else None
        if fx is not None:
            out.append(Action(id="finding-fix", fix=fx))
    if "logits_bytes" in ev and v.kind in ("capacity", "fragmentation"):
        out.append(Action(id="logits", framework=next((fw.id for fw in fws if "logits" in fw.knobs), None)))
    return out


# on equal bytes, the more specific kind: one rank's excess over the others says where the growth is
_PREFER = ("fragmentation", "deferred-free", "growth", "kept-exception", "imbalance")

_ORDER = {"kept-exception": 0, "growth": 0, "imbalance": 1, "capacity": 2, "deferred-free": 3, "fragmentation": 4,
          "healthy": 9, "empty": 10}


def job_verdict(verdicts: list[Verdict], oom_ranks: set[int]) -> Verdict | None:
    """The job's verdict: its worst rank's (ranks with an OOM first), naming every rank of that kind."""
    if not verdicts:
        return None
    worst = min(verdicts, key=lambda v: (v.ranks[0] not in oom_ranks, _ORDER.get(v.kind, 5), -v.bytes))
    ranks = sorted({r for v in verdicts if v.kind == worst.kind for r in v.ranks})
    return Verdict(kind=worst.kind, bytes=worst.bytes, ranks=ranks, headroom_bytes=worst.headroom_bytes,
                   finding=worst.finding, evidence=worst.evidence, reasons=worst.reasons, to_do=worst.to_do)


def with_tightest_rank(v: Verdict | None, fits_by_rank: dict[int, Fits | None]) -> Verdict | None:
    """The job's verdict with the job's answer to what fits: the smallest largest micro-batch of its ranks (a
    pipeline's stages differ; its tightest stage decides). Where the verdict states a larger one (its own
    rank's), the evidence takes the job's and names the rank (``largest_micro_batch_rank``); else ``v``
    unchanged."""
    got = {r: f.largest_micro_batch for r, f in fits_by_rank.items() if f is not None and f.largest_micro_batch}
    if v is None or not got or "largest_micro_batch" not in v.evidence:
        return v
    rank = min(got, key=lambda r: (got[r], r))
    if got[rank] < v.evidence["largest_micro_batch"]:
        v.evidence = {**v.evidence, "largest_micro_batch": got[rank], "largest_micro_batch_rank": rank}
    return v
