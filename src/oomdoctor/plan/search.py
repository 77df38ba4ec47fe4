"""Search: every valid parallel plan for N GPUs, which fit, and which is fastest.

The throughput model is deliberately simple and says what it counts. Per optimizer step, on one rank:

- compute: ``6·N_params·tokens + 12·L·h·s·tokens`` FLOPs (Narayanan et al. 2021, arXiv:2104.04473
  eq. 3, without the recompute term), plus one more forward (``2·N·tokens``) for full recompute and the
  attention core for selective (Korthikanti et al. §5: about 2.7% at their sizes, taken as 3%), spread
  over all GPUs at :data:`MFU` of the peak (twice the bf16 peak with FP8 GEMMs, as H100's dense FP8
  rate is twice its bf16 rate);
- tensor parallel: 4 all-reduces per layer per micro-batch (2 forward, 2 backward; with sequence
  parallelism the same volume as reduce-scatter plus all-gather) of ``s·b·h`` bf16, each moving
  ``2(t−1)/t`` of it, over NVLink inside a node and the network across (Megatron-LM paper §3.2);
  exposed, because the next GEMM needs its result;
- pipeline bubble: the bubble fraction of :func:`.schedule.bubble_fraction` of the busy time;
- data parallel: reduce-scatter of gradients and all-gather of parameters, ``2(d−1)/d`` of the
  rank's parameter bytes, over the network when the group spans nodes; :data:`DP_EXPOSED` of it is
  not hidden behind the backward pass.

Relative throughput is the best plan's step time over each plan's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from ..units import GiB
from .estimate import Estimate, estimate
from .schedule import bubble_fraction
from .specs import Hardware, ModelSpec, ParallelPlan, PlanError, TrainingSpec

MFU = 0.5
"""Model-FLOPs utilisation of the compute itself (GEMMs and attention), before communication."""
DP_EXPOSED = 0.2
"""Share of data-parallel communication not overlapped with the backward pass (bucketed overlap)."""
SELECTIVE_RECOMPUTE_COST = 0.03
FULL_RECOMPUTE_COST = 2 / 6
PREFER_GAIN = 0.05
"""A plan that fits only with ``expandable_segments:True`` ranks above one that fits with the default allocator only
when it is modelled at least this much faster (relative throughput; issue 52). Such a plan runs within the
fragmentation margin of the GPU (77.3 of 79.6 GiB for Llama-3-8B's fastest plan on 16 H100s), where anything the
estimate does not count (a larger batch of tokens, a framework's buffers) runs out, and the setting has its own
incompatibilities (CUDA IPC, NCCL user buffers); while the step-time model is first order (a fixed :data:`MFU`, a
fixed :data:`DP_EXPOSED`), so a difference of a few percent between two plans is within what it leaves out."""


@dataclass
class StepTime:
    """Seconds per optimizer step, by component."""

    compute_s: float
    tp_comm_s: float
    bubble_s: float
    dp_comm_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.bubble_s + self.dp_comm_s


@dataclass
class Candidate:
    """A plan with its estimate, whether it fits, and its modelled step time. ``fits`` is ``"yes"``,
    ``"with expandable_segments"`` (fits only once the fragmentation margin shrinks) or ``"no"``;
    ``setting`` is the allocator setting it fits with (``""``: none needed, or it does not fit) and
    ``fit_estimate`` the estimate under that setting (the plan's peak as it would run)."""

    plan: ParallelPlan
    estimate: Estimate
    fits: str
    step: StepTime
    relative_throughput: float = 0.0
    why: list[str] = field(default_factory=list)
    setting: str = ""
    fit_estimate: Estimate | None = None

    def __post_init__(self) -> None:
        if self.fit_estimate is None:
            self.fit_estimate = self.estimate

    @property
    def as_run(self) -> Estimate:
        """``fit_estimate``, never None once made (:meth:`__post_init__`): the plan's peak as it would run."""
        return self.fit_estimate if self.fit_estimate is not None else self.estimate


@dataclass
class SearchResult:
    model: ModelSpec
    train: TrainingSpec
    hardware: Hardware
    candidates: list[Candidate]
    rules: list[str]
    rejected: int

    @property
    def best(self) -> Candidate | None:
        fit = [c for c in self.candidates if c.fits != "no"]
        return fit[0] if fit else None


def _params_total(e: Estimate) -> int:
    """All parameters of the model (sum over stages of one tensor-parallel shard, times tp)."""
    return sum(s.parameters for s in e.stages) * e.plan.tp


def step_time(e: Estimate, hw: Hardware) -> StepTime:
    """The modelled step time of an estimated plan (see the module docstring)."""
    m, t, p = e.model, e.train, e.plan
    tokens = t.global_batch * t.seq_len
    n = _params_total(e)
    flops = 6 * n * tokens + 12 * m.num_layers * m.hidden_size * t.seq_len * tokens
    if p.recompute == "full":
        flops *= 1 + FULL_RECOMPUTE_COST
    elif p.recompute == "selective":
        flops *= 1 + SELECTIVE_RECOMPUTE_COST
    peak = hw.peak_flops * (2 if t.fp8 else 1)
    compute = flops / (hw.num_gpus * peak * MFU)
    tp_comm = 0.0
    if p.tp > 1:
        bw = hw.intra_node_bw if p.tp <= hw.gpus_per_node else hw.inter_node_bw
        size = (t.seq_len // p.cp) * t.micro_batch * m.hidden_size * 2
        per = 2 * (p.tp - 1) / p.tp * size / bw
        tp_comm = 4 * per * (m.num_layers // p.pp) * e.microbatches
    busy = compute + tp_comm
    bubble = busy * bubble_fraction(p.schedule, p.pp, e.microbatches, p.vpp)
    dp_comm = 0.0
    d = p.dp * p.cp
    if d > 1:
        spans = p.tp * p.cp * p.dp > hw.gpus_per_node
        bw = hw.inter_node_bw if spans else hw.intra_node_bw
        rank_params = max(s.parameters for s in e.stages)
        dp_comm = DP_EXPOSED * 2 * (d - 1) / d * rank_params * t.grad_bytes / bw
    return StepTime(compute, tp_comm, bubble, dp_comm)


EXPANDABLE = "expandable_segments:True"


def _fits(e: Estimate, hw: Hardware) -> tuple[str, str, Estimate]:
    """Whether ``e`` fits ``hw``: ``(fits, setting, estimate under that setting)``."""
    if e.peak.device_bytes <= hw.gpu_memory_bytes:
        return "yes", "", e
    if e.plan.expandable_segments:
        return "no", "", e
    relaxed = estimate(e.model, e.train, replace(e.plan, expandable_segments=True), hw)
    if relaxed.peak.device_bytes <= hw.gpu_memory_bytes:
        return "with expandable_segments", EXPANDABLE, relaxed
    return "no", "", e


def _divisors(n: int, cap: int) -> list[int]:
    return [x for x in range(1, min(n, cap) + 1) if n % x == 0]


def enumerate_plans(m: ModelSpec, train: TrainingSpec, hw: Hardware, base: ParallelPlan, *,
                    max_pp: int = 16, max_vpp: int = 10, recompute: tuple[str, ...] = ("none", "selective", "full"),
                    ) -> list[ParallelPlan]:
    """Every TP × PP × VPP × recompute combination for ``hw.num_gpus`` (CP and EP from ``base``;
    sequence parallel whenever ``tp > 1``), valid or not."""
    out = []
    for tp in (1, 2, 4, 8, 16):
        if tp > hw.gpus_per_node or hw.num_gpus % tp:
            continue
        for pp in _divisors(m.num_layers, max_pp):
            if hw.num_gpus % (tp * pp * base.cp):
                continue
            dp = hw.num_gpus // (tp * pp * base.cp)
            vpps = [1] + ([v for v in _divisors(m.num_layers // pp, max_vpp) if v > 1] if pp > 1 else [])
            for vpp in vpps:
                for rc in recompute:
                    out.append(replace(base, tp=tp, pp=pp, dp=dp, vpp=vpp, sequence_parallel=tp > 1,
                                       schedule="interleaved" if vpp > 1 else (
                                           base.schedule if base.schedule != "interleaved" else "1f1b"),
                                       recompute=rc, recompute_layers=None))
    return out


def evaluate(m: ModelSpec, train: TrainingSpec, hw: Hardware, plans: list[ParallelPlan]) -> list[Candidate]:
    """Estimate and time each valid plan, ranked: fitting plans first (fastest first), then the rest by
    how far over they are. Invalid plans are dropped."""
    cands = []
    for p in plans:
        try:
            e = estimate(m, train, p, hw)
        except PlanError:
            continue
        fits, setting, as_run = _fits(e, hw)
        cands.append(Candidate(p, e, fits, step_time(e, hw), setting=setting, fit_estimate=as_run))
    fitting = [c for c in cands if c.fits != "no"]
    best = min((c.step.total_s for c in fitting), default=min((c.step.total_s for c in cands), default=1.0))
    for c in cands:
        c.relative_throughput = best / c.step.total_s
        c.why = _why(c, hw)
    order = {"yes": 0, "with expandable_segments": 0, "no": 1}

    def score(c: Candidate) -> float:  # an expandable-only plan must be PREFER_GAIN faster to rank above
        return c.relative_throughput / (1 + PREFER_GAIN) if c.fits == "with expandable_segments" else \
            c.relative_throughput

    cands.sort(key=lambda c: (order[c.fits], -score(c) if c.fits != "no" else c.estimate.peak.device_bytes,
                              c.estimate.peak.device_bytes))
    _say_trade(cands, hw)
    return cands


def _say_trade(cands: list[Candidate], hw: Hardware) -> None:
    """Where a plan that fits with the default allocator ranks above faster ones that fit only with
    ``expandable_segments:True`` (:data:`PREFER_GAIN`), say the trade on both."""
    best = next((c for c in cands if c.fits == "yes"), None)
    if best is None:
        return
    passed = [c for c in cands if c.fits == "with expandable_segments" and c.relative_throughput >
              best.relative_throughput and cands.index(c) > cands.index(best)]
    if not passed:
        return
    top = max(passed, key=lambda c: c.relative_throughput)
    gain = top.relative_throughput / best.relative_throughput - 1
    room = f"{top.as_run.peak.device_bytes / GiB:.1f} of {hw.gpu_memory_bytes / GiB:.1f} GiB"
    best.why.insert(0, f"ranked above {top.plan.label()}, modelled {100 * gain:.1f}% faster, which fits only with "
                       f"{EXPANDABLE} ({room}): a gain under {100 * PREFER_GAIN:.0f}% is not worth the tighter fit")
    for c in passed:
        gain = c.relative_throughput / best.relative_throughput - 1
        c.why.insert(0, f"modelled {100 * gain:.1f}% faster than {best.plan.label()}, but fits only with {EXPANDABLE}: "
                        f"ranked below it (a gain under {100 * PREFER_GAIN:.0f}%)")


def _why(c: Candidate, hw: Hardware) -> list[str]:
    s, out = c.step, []
    total = s.total_s
    if s.tp_comm_s / total >= 0.05:
        where = "NVLink" if c.plan.tp <= hw.gpus_per_node else "the network"
        out.append(f"TP all-reduces {100 * s.tp_comm_s / total:.0f}% of the step over {where}")
    if s.bubble_s / total >= 0.02:
        n = c.estimate.microbatches
        out.append(f"pipeline bubble {100 * s.bubble_s / total:.0f}% ({n} micro-batch{'' if n == 1 else 'es'})")
    if c.plan.recompute != "none":
        cost = FULL_RECOMPUTE_COST if c.plan.recompute == "full" else SELECTIVE_RECOMPUTE_COST
        out.append(f"{c.plan.recompute} recompute +{100 * cost:.0f}% compute")
    if s.dp_comm_s / total >= 0.02:
        out.append(f"exposed DP communication {100 * s.dp_comm_s / total:.0f}%")
    peak = c.estimate.peak
    if c.fits == "with expandable_segments":
        out.append(f"fits with {EXPANDABLE}: {c.as_run.peak.device_bytes / GiB:.1f} GiB; the default "
                   f"allocator's fragmentation margin ({peak.terms['fragmentation'] / GiB:.1f} GiB) would take it to "
                   f"{peak.device_bytes / GiB:.1f} GiB")
    elif c.fits == "no":
        out.append(f"stage {peak.stage} needs {(peak.device_bytes - hw.gpu_memory_bytes) / GiB:.1f} GiB more")
    return out


def alloc_conf_env() -> str:
    """The allocator's environment variable to name: ``PYTORCH_ALLOC_CONF`` where the installed PyTorch is 2.9 or
    later (the name it reads first), else ``PYTORCH_CUDA_ALLOC_CONF`` (read by every version, from 2.9 as an
    alias), the rule :mod:`oomdoctor.detectors.fragmentation` applies to a trace's version. The version comes from
    the package metadata; torch is never imported."""
    from importlib import metadata

    try:
        m = re.match(r"(\d+)\.(\d+)", metadata.version("torch"))
    except metadata.PackageNotFoundError:
        m = None
    return "PYTORCH_ALLOC_CONF" if m and (int(m.group(1)), int(m.group(2))) >= (2, 9) else "PYTORCH_CUDA_ALLOC_CONF"


RULES = [
    "A plan over capacity only by its fragmentation margin fits with {env}=expandable_segments:True: "
    "set that before changing the parallelism (it costs no throughput); such a plan's peak is given with it.",
    "A plan that fits with the default allocator ranks above one that needs expandable_segments:True unless that one "
    "is modelled at least " + f"{100 * PREFER_GAIN:.0f}" + "% faster: it runs at the edge of the GPU.",
    "Tensor parallelism is kept inside one node (NVLink); its all-reduces are on the critical path, so a larger TP "
    "costs throughput in proportion to the all-reduce volume.",
    "More pipeline stages cut memory per rank but lower DP and add a bubble of (p-1)/(v*M); interleaving (VPP) shrinks "
    "the bubble but the last stage then holds about p-(p-1)/v micro-batches, not 1.",
    "Recompute is the last resort: full recompute adds a forward pass (+33% compute), selective about 3%.",
    "Plans are ranked by modelled throughput among those that fit (but for the rule above); the worst pipeline stage "
    "decides whether a plan fits.",
]


def search(m: ModelSpec, train: TrainingSpec, hw: Hardware, base: ParallelPlan | None = None,
           plans: list[ParallelPlan] | None = None) -> SearchResult:
    """Enumerate (or take ``plans``), estimate, time and rank. ``base`` carries the settings not
    searched (sharding, framework, CP, EP, schedule family, ``return_outputs``)."""
    base = base or ParallelPlan()
    cand_plans = plans if plans is not None else enumerate_plans(m, train, hw, base)
    cands = evaluate(m, train, hw, cand_plans)
    return SearchResult(m, train, hw, cands, [r.format(env=alloc_conf_env()) for r in RULES], rejected=len(cand_plans) - len(cands))
