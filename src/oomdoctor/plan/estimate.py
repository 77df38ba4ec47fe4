"""Per-rank peak memory of a training plan, term by term, for every pipeline stage.

::

    allocated(stage) = weights + master weights + optimizer state                  (terms.model_state_bytes)
                     + DDP buckets + cuBLAS workspaces
                     + gradients, when they persist (terms.gradients_persist)
                     + max( activation phase: FSDP gather buffers + autocast weight copies (framework hf)
                                + activations of the micro-batches in flight under the schedule
                                + embedding inputs (first stage)
                                + cached outputs (last stage, pipelining return_outputs=True)
                                + the other micro-batches' loss graphs (last stage, GPipe)
                                + max(one layer's recompute working set, logits and loss (last stage)),
                            step phase: optimizer-step temporaries + gradients, when they do not persist )
    reserved         = allocated × (1 + fragmentation)
    device           = reserved + CUDA context + NCCL

The recompute working set and the loss never coexist: a rank computes one op at a time, and the loss's
tensors are freed by the end of its backward, before any layer's backward recomputes.

Structure from ``shared/reference/memory_estimation.md`` §5; each term's source is in :mod:`.terms`, and
for Hugging Face models in eager PyTorch (``framework="hf"``) in :mod:`.hf`, where ``logits and loss`` is
the largest moment of the loss region, forward-only tensors (KV cache, last hidden state, the loop's
copies of the logits) included.

Each stage also gives its peak in ``oomdoctor diagnose``'s accounting categories
(:data:`oomdoctor.analysis.accounting.CATEGORIES`), so that a prediction and a recorded run compare
category by category: parameters (weights, master weights), gradients, optimizer state, communication (DDP
buckets), outputs (pipelining's cached outputs), temporaries (workspaces, the optimizer step's
temporaries, the loss region's copies and gradients) and activations (the rest: what backward reads).
Ranks of the same stage are symmetric (tensor, data and context parallel shards are equal), so one
estimate per stage stands for all its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import hf, terms
from .schedule import in_flight_chunks
from .specs import Hardware, ModelSpec, ParallelPlan, TrainingSpec, padded_vocab, validate


@dataclass
class StageEstimate:
    """One pipeline stage. ``terms`` maps each term's name to bytes; ``allocated_bytes`` is the peak of
    ``torch.cuda.memory_allocated`` (what Megatron logs as ``mem-max-allocated-bytes``),
    ``reserved_bytes`` of ``memory_reserved``, ``device_bytes`` what the GPU must hold (nvidia-smi).

    The docstring under each field is its description in the JSON schema (``oomdoctor schema plan estimate``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    stage: int
    """the pipeline stage"""
    parameters: int
    """parameters on the stage"""
    in_flight_chunks: int
    """micro-batches whose activations the schedule holds at once"""
    terms: dict[str, int]
    """bytes per term of the estimate (bytes)"""
    gradients_persist: bool
    """gradients are kept between micro-batches"""
    allocated_bytes: int
    """peak allocated: torch.cuda.memory_allocated, Megatron's mem-max-allocated-bytes (bytes)"""
    reserved_bytes: int
    """peak reserved: allocated + fragmentation (bytes)"""
    device_bytes: int
    """what the GPU must hold: reserved + CUDA context + NCCL (bytes)"""
    peak_phase: str
    """activations or optimizer step"""
    breakdown: dict[str, int]
    """model_states, activations, logits_and_loss, other: what allocated holds at its peak (bytes)"""
    categories: dict[str, int] = field(default_factory=dict)
    """diagnose's accounting categories at the peak (bytes)"""
    loss_moment: str = ""
    """framework hf: which moment of the loss region is the peak"""

    def check(self) -> None:
        """Assert that the terms add up to the three totals, and the breakdown to allocated."""
        t = self.terms
        static, act, step = phase_totals(t, self.gradients_persist)
        assert self.allocated_bytes == static + max(act, step)
        assert self.peak_phase == ("activations" if act >= step else "optimizer step")
        assert sum(self.breakdown.values()) == self.allocated_bytes
        assert sum(self.categories.values()) == self.allocated_bytes, (self.categories, self.allocated_bytes)
        assert self.reserved_bytes == self.allocated_bytes + t["fragmentation"]
        assert self.device_bytes == self.reserved_bytes + t["cuda_context"] + t["nccl"]


STATIC_TERMS = ("weights", "master_weights", "optimizer_state", "ddp_buckets", "workspace")
ACTIVATION_TERMS = ("fsdp_gather_buffers", "autocast_weight_copies", "activations", "embedding_inputs",
                    "cached_outputs", "held_losses")


def phase_totals(t: dict[str, int], gradients_persist: bool) -> tuple[int, int, int]:
    """``(static, activation phase, step phase)`` bytes of a stage's terms (see the module formula)."""
    grads = t["gradients"]
    static = sum(t[k] for k in STATIC_TERMS) + (grads if gradients_persist else 0)
    act = sum(t[k] for k in ACTIVATION_TERMS) + max(t["recompute_working_set"], t["logits_and_loss"])
    step = t["optimizer_step_temporaries"] + (0 if gradients_persist else grads)
    return static, act, step


def breakdown(t: dict[str, int], gradients_persist: bool) -> dict[str, int]:
    """What allocated holds at its peak, in the four groups ``plan estimate`` prints; they add up to
    allocated (asserted by :meth:`StageEstimate.check`)."""
    _, act, step = phase_totals(t, gradients_persist)
    states = t["weights"] + t["master_weights"] + t["optimizer_state"]
    other = t["workspace"] + t["ddp_buckets"]
    if act >= step:
        states += t["gradients"] if gradients_persist else 0
        loss_wins = t["logits_and_loss"] > t["recompute_working_set"]
        acts = t["activations"] + t["embedding_inputs"] + (0 if loss_wins else t["recompute_working_set"])
        logits = t["cached_outputs"] + t["held_losses"] + (t["logits_and_loss"] if loss_wins else 0)
        acts += t["autocast_weight_copies"]
        other += t["fsdp_gather_buffers"]
    else:
        states += t["gradients"]
        acts = logits = 0
        other += t["optimizer_step_temporaries"]
    return {"model_states": states, "activations": acts, "logits_and_loss": logits, "other": other}


def categories(t: dict[str, int], gradients_persist: bool, loss_not_saved: dict[str, int] | None = None
               ) -> dict[str, int]:
    """The peak in diagnose's accounting categories; they add up to allocated (asserted by
    :meth:`StageEstimate.check`). ``loss_not_saved`` is the part of ``logits_and_loss`` that backward does not
    read, by category (framework hf: the loop's copies, the loss gradients and forward-only tensors are
    temporaries, DDP's rebuilt buckets communication); the rest of the activation phase is activations."""
    _, act, step = phase_totals(t, gradients_persist)
    out = {"parameters": t["weights"] + t["master_weights"], "gradients": 0,
           "optimizer_state": t["optimizer_state"], "activations": 0, "temporaries": t["workspace"],
           "communication": t["ddp_buckets"], "outputs": 0}
    if act >= step:
        out["gradients"] = t["gradients"] if gradients_persist else 0
        loss_wins = t["logits_and_loss"] > t["recompute_working_set"]
        moved = (loss_not_saved or {}) if loss_wins else {}
        for c, b in moved.items():
            out[c] += b
        out["outputs"] = t["cached_outputs"]
        out["activations"] = act - t["cached_outputs"] - sum(moved.values())
    else:
        out["gradients"] = t["gradients"]
        out["temporaries"] += t["optimizer_step_temporaries"]
    return out


@dataclass
class Estimate:
    """The whole plan: one :class:`StageEstimate` per pipeline stage, the micro-batch count, and
    whether the worst stage fits ``hardware.gpu_memory_bytes``."""

    model: ModelSpec
    train: TrainingSpec
    plan: ParallelPlan
    hardware: Hardware | None
    microbatches: int
    vocab: int
    stages: list[StageEstimate] = field(default_factory=list)

    @property
    def peak(self) -> StageEstimate:
        """The stage needing the most device memory."""
        return max(self.stages, key=lambda s: (s.device_bytes, s.stage))

    @property
    def last(self) -> StageEstimate:
        return self.stages[-1]

    @property
    def fits(self) -> bool | None:
        if self.hardware is None:
            return None
        return self.peak.device_bytes <= self.hardware.gpu_memory_bytes


def estimate_stage(m: ModelSpec, train: TrainingSpec, plan: ParallelPlan, stage: int, microbatches: int,
                   vocab: int) -> StageEstimate:
    """The :class:`StageEstimate` of pipeline stage ``stage`` (0-based)."""
    params = terms.stage_params(m, plan, stage, vocab)
    chunks = in_flight_chunks(plan.schedule, plan.pp, stage, microbatches, plan.vpp)
    if plan.framework == "hf":
        t, not_saved, persist, moment = hf.stage_terms(m, train, plan, microbatches, vocab, params)
        return _finish(stage, params, chunks, t, persist, plan, not_saved, moment)
    t: dict[str, int] = dict(terms.model_state_bytes(params, train, plan))
    t["fsdp_gather_buffers"] = terms.fsdp_unsharded_bytes(m, plan, train, params)
    t["ddp_buckets"] = terms.ddp_bucket_bytes(params, train, plan)
    t["workspace"] = terms.workspace_bytes(plan)
    t["autocast_weight_copies"] = 0

    layers_stage = m.num_layers // plan.pp
    layers_chunk = layers_stage // plan.vpp
    full = plan.recompute == "full"
    n_full = (layers_stage if plan.recompute_layers is None else plan.recompute_layers) if full else 0
    none_mode = "selective" if plan.recompute == "selective" else "none"
    per_full = terms.layer_activation_bytes(m, train, plan, "full")
    per_none = terms.layer_activation_bytes(m, train, plan, none_mode)
    stage_bytes = n_full * per_full + (layers_stage - n_full) * per_none  # one micro-batch through the stage
    t["activations"] = stage_bytes * layers_chunk * chunks // layers_stage
    t["recompute_working_set"] = per_none if n_full else 0
    first, last = stage == 0, stage == plan.pp - 1
    stage_mbs = -(-chunks // plan.vpp)
    t["embedding_inputs"] = terms.embedding_activation_bytes(train, plan, m.hidden_size) * stage_mbs if first else 0
    t["logits_and_loss"] = terms.logits_loss_bytes(m, train, plan, vocab) if last else 0
    t["cached_outputs"] = terms.cached_outputs_bytes(train, plan, vocab, microbatches) if last else 0
    t["held_losses"] = terms.held_losses_bytes(train, plan, vocab, microbatches) if last else 0
    t["optimizer_step_temporaries"] = terms.optimizer_step_temporaries(params, train, plan)
    return _finish(stage, params, chunks, t, terms.gradients_persist(plan, microbatches), plan, None, "")


def _finish(stage: int, params: int, chunks: int, t: dict[str, int], persist: bool, plan: ParallelPlan,
            loss_not_saved: dict[str, int] | None, moment: str) -> StageEstimate:
    """Totals, fragmentation, fixed costs and the checked :class:`StageEstimate` of a stage's terms."""
    static, act, step = phase_totals(t, persist)
    phase = "activations" if act >= step else "optimizer step"
    allocated = static + max(act, step)
    t["fragmentation"] = int(allocated * terms.fragmentation_fraction(plan))
    reserved = allocated + t["fragmentation"]
    t["cuda_context"] = terms.CUDA_CONTEXT_BYTES
    t["nccl"] = terms.nccl_bytes(plan)
    est = StageEstimate(stage, params, chunks, t, persist, allocated, reserved,
                        reserved + t["cuda_context"] + t["nccl"], phase, breakdown(t, persist),
                        categories(t, persist, loss_not_saved), moment)
    est.check()
    return est


def estimate(m: ModelSpec, train: TrainingSpec, plan: ParallelPlan, hardware: Hardware | None = None, *,
             pad_vocab: bool = True) -> Estimate:
    """Estimate every pipeline stage of ``plan``.

    Raises:
        PlanError: the combination is invalid (see :func:`.specs.validate`).
    """
    mbs = validate(m, train, plan, hardware.num_gpus if hardware is not None else None)
    pad = pad_vocab and plan.framework == "megatron"  # PyTorch and transformers models keep the tokenizer's
    vocab = padded_vocab(m.vocab_size, plan.tp) if pad else m.vocab_size
    est = Estimate(m, train, plan, hardware, mbs, vocab)
    est.stages = [estimate_stage(m, train, plan, s, mbs, vocab) for s in range(plan.pp)]
    return est
