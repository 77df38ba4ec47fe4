"""Memory terms of a Hugging Face ``transformers`` model trained in eager PyTorch (``framework="hf"``).

What the Trainer, accelerate, Lightning or a plain loop holds per rank that Megatron-LM's fused layers
do not, counted op by op from the module code: the tensors autograd saves, in the dtypes autocast gives
them, plus what the loop wraps around the model. Sources are the modules as of transformers 5.17, torch
2.11, accelerate 1.15, Lightning 2.6 (file and line below), and every count was read back from a real
run's snapshot: the blocks alive at the peak of ``docs/corpus/*`` (``docs/plan.md``, "Real training
loops"). Bytes per token unless a name says otherwise; ``h`` width, ``f`` MLP width, ``a`` heads,
``kvd`` = KV heads × head dim, ``V`` vocabulary.

Precision (:class:`LoopSettings`): ``w`` is the dtype of the weights the forward reads and of the
residual stream (4 under autocast over fp32 weights, 2 with FSDP's bf16 mixed precision), ``c`` the
dtype matmuls compute in (2 under autocast or bf16 weights, else 4). Autocast (``torch/amp``,
``aten/src/ATen/autocast_mode.cpp``) runs ``addmm``/``linear``/``sdpa`` in bf16 and casts their
inputs (a new tensor, saved instead of the input, and one per call: three ``q/k/v`` projections of the
same fp32 input make three casts), runs ``layer_norm``/``pow``/``rsqrt`` in fp32, and caches the bf16
copy of each weight until autocast exits; autograd keeps the copies the matmuls saved until their
backward.

The loss (``transformers/loss/loss_utils.py`` ``ForCausalLMLoss``): ``logits.float()`` (4V), then
``cross_entropy`` = ``log_softmax`` (its fp32 output is saved, 4V) + ``nll_loss``. Its backward holds the
saved output, ``nll_loss``'s gradient and ``log_softmax``'s gradient: 12 B per logit, the torchtitan
count of :func:`.terms.logits_loss_bytes`. Before the backward, the forward holds the bf16 logits, the
fp32 copy and the saved output (10 B), and after the model returns the loop may copy the logits again.
"""

from __future__ import annotations

from dataclasses import dataclass

from .specs import LOOPS, ModelSpec, ParallelPlan, PlanError, TrainingSpec
from .terms import CUBLAS_WORKSPACE_BYTES, layer_params, optimizer_step_temporaries

GPT2_FAMILIES = ("gpt2",)
LLAMA_FAMILIES = ("llama", "mistral", "qwen2")
FAMILIES = GPT2_FAMILIES + LLAMA_FAMILIES
GELU_NEW = ("gelu_new", "")
GELU_FUSED = ("gelu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class LoopSettings:
    """What the loop does around the model (:func:`loop_settings` gives each loop's defaults and sources)."""

    autocast: bool  # bf16 autocast in the forward
    weight_bytes: int  # w: dtype of the weights the forward reads (and of the residual stream)
    stored_bytes: int  # dtype of the parameters as the optimizer holds them (fp32 masters: 4)
    fp32_output_copy: bool  # accelerate's convert_outputs_to_fp32 copies the bf16 logits to fp32
    ddp_output_clone: bool  # DDP(find_unused_parameters=True) clones the outputs (_DDPSink)
    use_cache: bool  # the model builds its DynamicCache in a training forward

    @property
    def compute_bytes(self) -> int:
        """c: the dtype the matmuls and attention run in."""
        return 2 if self.autocast or self.weight_bytes == 2 else 4


def loop_settings(m: ModelSpec, plan: ParallelPlan) -> LoopSettings:
    """Each loop's defaults with bf16 mixed precision, as the loop's own code sets them.

    - Data parallel without sharding (DDP, or one GPU): autocast over fp32 weights. Trainer ``bf16=True``
      and ``Accelerator(mixed_precision="bf16")`` wrap the forward in autocast and in
      ``convert_outputs_to_fp32`` (``accelerate/accelerator.py`` ``prepare_model``: ``native_amp``);
      Lightning ``precision="bf16-mixed"`` uses autocast alone (``plugins/precision/amp.py``).
    - FSDP: Trainer / accelerate with FSDP2 set ``MixedPrecisionPolicy(param_dtype=bf16)`` and no autocast
      (``accelerate/utils/dataclasses.py`` ``set_mixed_precision``; the ``trainer-fsdp2-gpt2`` snapshot's
      LayerNorm outputs are bf16); Lightning's ``FSDPStrategy`` with ``bf16-mixed`` sets FSDP1
      ``MixedPrecision(param_dtype=bf16)`` and keeps autocast (``plugins/precision/fsdp.py``; its
      LayerNorm outputs are fp32). A plain loop under FSDP is taken as FSDP2 without autocast.
    - Trainer's DDP sets ``find_unused_parameters = not gradient_checkpointing`` for a ``PreTrainedModel``
      (``transformers/trainer.py``); with it DDP's ``_post_forward`` passes the outputs through
      ``_DDPSink``, which clones them (``torch/nn/parallel/distributed.py``). accelerate and Lightning
      default to ``find_unused_parameters=False``.
    - The KV cache: Trainer sets ``model.config.use_cache = args.use_cache`` (False by default,
      ``trainer.py`` "Finalize"); other loops keep the config's ``use_cache`` (True for GPT-2 and Llama),
      except under gradient checkpointing (``utils/generic.py`` ``merge_with_config_defaults``).
    ``plan.use_cache`` overrides the cache default.

    Raises:
        PlanError: an unknown loop.
    """
    if plan.loop not in LOOPS:
        raise PlanError(f"unknown training loop {plan.loop!r}: one of {', '.join(LOOPS)}")
    fsdp = plan.dp_sharding == "fsdp"
    if fsdp:
        autocast, w = plan.loop == "lightning", 2
    else:
        autocast, w = True, 4
    checkpointing = plan.recompute == "full"
    cache = m.use_cache and plan.loop != "trainer" and not checkpointing
    return LoopSettings(
        autocast=autocast, weight_bytes=w, stored_bytes=4,
        fp32_output_copy=autocast and plan.loop in ("trainer", "accelerate"),
        ddp_output_clone=plan.loop == "trainer" and not fsdp and plan.dp > 1 and not checkpointing,
        use_cache=cache if plan.use_cache is None else plan.use_cache)


def check(m: ModelSpec, train: TrainingSpec, plan: ParallelPlan) -> None:
    """Refuse what these terms do not model, with the reason.

    Raises:
        PlanError: tensor, pipeline, context or expert parallelism, a sharding other than none/fsdp,
            selective recompute, a model family or activation whose module code is not counted here.
    """
    for name in ("tp", "pp", "cp", "ep", "vpp"):
        if getattr(plan, name) != 1:
            raise PlanError(f"framework 'hf' models data parallelism (DDP or FSDP) only: {name}({getattr(plan, name)}) "
                            "must be 1 (use --framework torch for torchtitan-style TP/PP/CP)")
    if plan.dp_sharding not in ("none", "fsdp"):
        raise PlanError(f"framework 'hf' takes --sharding none (DDP) or fsdp, not {plan.dp_sharding!r}")
    if plan.recompute == "selective":
        raise PlanError("framework 'hf' takes --recompute none or full (gradient_checkpointing=True)")
    if m.family not in FAMILIES:
        raise PlanError(f"framework 'hf' counts the modules of {', '.join(FAMILIES)}; model_type "
                        f"{m.family or 'unknown'!r} is not modelled")
    if m.num_experts:
        raise PlanError("framework 'hf' does not model mixture-of-experts layers")
    if m.family in GPT2_FAMILIES and m.activation not in GELU_NEW + GELU_FUSED:
        raise PlanError(f"framework 'hf': GPT-2 activation {m.activation!r} is not modelled "
                        f"(one of {', '.join(a for a in GELU_NEW + GELU_FUSED if a)})")
    if m.family in LLAMA_FAMILIES and m.activation not in ("silu", ""):
        raise PlanError(f"framework 'hf': Llama-family activation {m.activation!r} is not modelled (silu)")
    if train.fused_cross_entropy or train.fp8 or not train.flash_attention:
        raise PlanError("framework 'hf' models transformers' own loss with sdpa attention in bf16: "
                        "--fused-ce, --fp8 and --no-flash do not apply")


# -- one decoder layer ------------------------------------------------------------------------------


def gpt2_layer(m: ModelSpec, st: LoopSettings, dropout: bool) -> tuple[dict[str, int], int]:
    """``GPT2Block`` (``models/gpt2/modeling_gpt2.py``): ``(saved, forward_only)`` bytes per token.

    - ``ln_1``/``ln_2`` save their input in fp32 under autocast (the fp32 residual itself, or a cast of a
      bf16 one), else the input: 2 × (4 or w)·h, plus mean and rstd (2 × 2 × 4 B);
    - ``c_attn`` (``Conv1D`` = ``addmm``) saves its input in c (c·h) and its output holds q, k, v as views
      (3c·h, kept whole by the ``sdpa`` that saves them); ``sdpa`` saves its output (c·h; ``c_proj``'s
      input) and the log-sum-exp (4a); ``c_fc`` saves its input (c·h);
    - ``gelu_new`` (``activations.py`` ``NewGELUActivation``: ``0.5 * x * (1 + tanh(√(2/π)(x + 0.044715
      x³)))``): under autocast ``pow`` saves an fp32 copy of ``x``, ``tanh`` its fp32 output, the product
      both fp32 ``1 + tanh`` and bf16 ``0.5 x``, and ``c_proj`` a bf16 cast of the fp32 product: 16f;
      without autocast all five in c: 5c·f. A fused ``gelu`` saves its input and ``c_proj`` its output:
      2c·f;
    - ``resid_dropout`` after attention and after the MLP: 1-byte masks, 2h;
    - with the KV cache, ``DynamicLayer.update`` (``cache_utils.py``) ``torch.cat``s K and V into new
      tensors in their dtype (c), which ``sdpa`` then saves: 2c·h.
    Nothing is forward-only."""
    h, f, a = m.hidden_size, m.ffn_hidden_size, m.num_heads
    c, ac = st.compute_bytes, st.autocast
    ln_in = 4 if ac else st.weight_bytes
    if m.activation in GELU_FUSED:
        gelu = 2 * c * f
    else:
        gelu = 16 * f if ac else 5 * c * f
    saved = {"norm_inputs": 2 * ln_in * h + 16, "matmul_inputs": 2 * c * h, "qkv": 3 * c * h,
             "attention": c * h + 4 * a, "mlp": gelu, "dropout_masks": 2 * h if dropout else 0,
             "kv_cache": 2 * c * h if st.use_cache else 0}
    return saved, 0


def llama_layer(m: ModelSpec, st: LoopSettings, dropout: bool) -> tuple[dict[str, int], int]:
    """``LlamaDecoderLayer`` (``models/llama/modeling_llama.py``; Mistral and Qwen2 share it):
    ``(saved, forward_only)`` bytes per token.

    - ``LlamaRMSNorm`` (``x.to(fp32)``; ``x * rsqrt(x.pow(2).mean() + eps)``; ``weight * y.to(dtype)``)
      saves the fp32 input (the residual itself when it is fp32, else a copy) 4h, ``rsqrt`` 4 B, and the
      normalised ``y`` in the input dtype w·h; two per layer;
    - the projections' inputs: autocast over fp32 weights gives an fp32 norm output, which ``q/k/v_proj``
      cast three times and ``gate/up_proj`` twice (5c·h); otherwise they share the bf16 output (2c·h);
    - RoPE's ``q * cos + rotate_half(q) * sin`` saves only ``cos``/``sin``; its outputs are in the wider of
      c and w (``cos`` has the hidden dtype); ``sdpa`` saves q, K and V in c (autocast casts) — c·h +
      2c·kvd — its output (``o_proj``'s input) c·h and the log-sum-exp 4a; ``attention_dropout`` is 0;
    - the MLP ``down(silu(gate(x)) * up(x))`` saves gate's output, silu's, up's and the product: 4c·f;
    - the KV cache copies K and V in K's dtype (the wider of c and w: a bf16 V is promoted). When that is
      c, ``sdpa`` saves the copies instead of K and V (nothing more); when it is wider (autocast over fp32),
      ``sdpa`` saves the casts and the fp32 copies live only until the model's outputs are dropped, before
      the backward: forward-only 2·w·kvd."""
    h, f, a = m.hidden_size, m.ffn_hidden_size, m.num_heads
    kvd = m.num_kv_heads * m.head_dim
    c, w = st.compute_bytes, st.weight_bytes
    casts = 5 if st.autocast and w == 4 else 2
    saved = {"norm_inputs": 2 * (4 * h + 4 + w * h), "matmul_inputs": casts * c * h,
             "attention": 2 * c * h + 2 * c * kvd + 4 * a, "mlp": 4 * c * f}
    rope = max(c, w)
    forward_only = 2 * rope * kvd if st.use_cache and rope > c else 0
    return saved, forward_only


def layer_bytes(m: ModelSpec, st: LoopSettings, dropout: bool) -> tuple[int, int]:
    """``(saved, forward_only)`` bytes per token of one layer of ``m``'s family."""
    fn = gpt2_layer if m.family in GPT2_FAMILIES else llama_layer
    saved, fwd = fn(m, st, dropout)
    return sum(saved.values()), fwd


def head_bytes(m: ModelSpec, st: LoopSettings, dropout: bool) -> tuple[int, int]:
    """Outside the layers, per token: ``(saved, forward_only)``. Saved: the int64 input ids and labels
    and the shifted labels ``ForCausalLMLoss`` pads (3 × 8 B); the final norm as in the layers; the LM
    head's input in c; GPT-2's embedding dropout mask (h). Forward-only: the final norm's output, held as
    the base model's ``last_hidden_state`` until ``forward`` returns (fp32 under autocast for LayerNorm,
    else w)."""
    h, w, c = m.hidden_size, st.weight_bytes, st.compute_bytes
    if m.family in GPT2_FAMILIES:
        norm = (4 if st.autocast else w) * h + 8
        hidden = (4 if st.autocast else w) * h
        extra = h if dropout else 0
    else:
        norm = 4 * h + 4 + w * h
        hidden = w * h
        extra = 0
    return 24 + norm + c * h + extra, hidden


@dataclass(frozen=True)
class LossMoment:
    """One moment of the loss region, per token: bytes saved for backward (activations), bytes of
    temporaries (copies, gradients, forward-only tensors), and whether the layers' autocast weight
    copies are still cached then (inside the autocast region)."""

    name: str
    activations: int
    temporaries: int
    inside_autocast: bool

    @property
    def total(self) -> int:
        return self.activations + self.temporaries

    @property
    def forward(self) -> bool:
        return self.name.startswith("forward")


def loss_moments(m: ModelSpec, st: LoopSettings, vocab: int, layer_fwd: int, head_fwd: int) -> list[LossMoment]:
    """The three candidate peaks of the loss region, per token (``layer_fwd`` is all layers'
    forward-only bytes):

    - ``forward, at log_softmax``: the logits (c·V), their fp32 copy (4V unless c is 4), the saved
      ``log_softmax`` output (4V), the final hidden state and the forward-only cache;
    - ``forward, after the model returns``: the saved output and the cache, with the largest of the
      returned logits, accelerate's fp32 conversion (old + new) and DDP's clone of what is returned;
    - ``backward, at log_softmax``: the saved output, ``nll_loss``'s gradient and ``log_softmax``'s
      gradient, 4V each (the loops drop the outputs before ``backward``)."""
    c = st.compute_bytes
    v4 = 4 * vocab
    inside = LossMoment("forward, at log_softmax", v4,
                        c * vocab + (v4 if c < 4 else 0) + head_fwd + layer_fwd, True)
    out = c * vocab
    held = [out]
    if st.fp32_output_copy and c < 4:
        held.append(out + v4)
        out = v4
    if st.ddp_output_clone:
        held.append(2 * out)
    after = LossMoment("forward, after the model returns", v4, max(held) + layer_fwd, False)
    backward = LossMoment("backward, at log_softmax", v4, 2 * v4, False)
    return [inside, after, backward]


def stage_terms(m: ModelSpec, train: TrainingSpec, plan: ParallelPlan, microbatches: int, vocab: int,
                params: int) -> tuple[dict[str, int], dict[str, int], bool, str]:
    """The terms of :mod:`.estimate`'s formula for one rank of an ``hf`` job with ``params`` parameters, the
    bytes of the loss region that are not activations (by diagnose category: ``temporaries``,
    ``communication``), whether gradients are held at the activation peak, and which loss moment is the peak.

    Static: parameters as the optimizer holds them (fp32: P·4, ÷ d under FSDP), AdamW's two moments
    (8 B, ÷ d), DDP's flat bucket copy of the gradients (``gradient_as_bucket_view=False``, the default in
    all three loops), two cuBLAS workspaces (the forward's thread and the autograd engine's, 32 MiB each on
    Hopper), and gradients when a later micro-batch's forward runs after a backward (gradient
    accumulation). DDP without ``find_unused_parameters`` (accelerate, Lightning, a plain loop, Trainer under
    gradient checkpointing) rebuilds its buckets in the second iteration's forward while the first set is
    still held: the forward moments also count a second bucket set. Activation phase: the bf16 copies of
    every matmul weight autocast made (over fp32 weights: 2 B per weight and bias of the layers and the LM
    head; under gradient checkpointing only the LM head's survive the autocast region), FSDP's unsharded root (embeddings, LM head, final norm: FSDP1
    and FSDP2 do not reshard the root between forward and backward), the layers' and head's saved
    tensors, and the largest :func:`loss_moments`.

    Raises:
        PlanError: see :func:`check`.
    """
    check(m, train, plan)
    st = loop_settings(m, plan)
    n = train.micro_batch * train.seq_len
    d = plan.dp if plan.dp_sharding == "fsdp" else 1
    shard, _ = layer_params(m, 1)
    matmul_params = m.num_layers * shard + vocab * m.hidden_size
    dropout = train.dropout or m.dropout
    layer_saved, layer_fwd = layer_bytes(m, st, dropout)
    head_saved, head_fwd = head_bytes(m, st, dropout)
    full = plan.recompute == "full"
    t: dict[str, int] = {
        "weights": params * st.stored_bytes // d, "master_weights": 0,
        "gradients": params * st.stored_bytes // d, "optimizer_state": 2 * params * st.stored_bytes // d,
        "ddp_buckets": params * st.stored_bytes if plan.dp_sharding == "none" and plan.dp > 1 else 0,
        "workspace": 2 * CUBLAS_WORKSPACE_BYTES,
        "fsdp_gather_buffers": 0, "cached_outputs": 0, "held_losses": 0,
    }
    if d > 1:
        root = vocab * m.hidden_size * (1 if m.tied_embeddings else 2) + m.learned_positions * m.hidden_size \
            + m.hidden_size * (2 if m.norm == "layernorm" else 1)
        t["fsdp_gather_buffers"] = root * st.compute_bytes
    casts = 2 * matmul_params if st.autocast and st.weight_bytes == 4 else 0
    layer_casts = casts - 2 * vocab * m.hidden_size if casts else 0
    # gradient checkpointing (non-reentrant, transformers' default) keeps each block's input, in w
    per_layer = st.weight_bytes * m.hidden_size if full else layer_saved
    t["activations"] = m.num_layers * per_layer * n
    t["embedding_inputs"] = head_saved * n
    t["autocast_weight_copies"] = casts - layer_casts if full else casts
    moments = loss_moments(m, st, vocab, 0 if full else m.num_layers * layer_fwd, head_fwd)

    # DDP without find_unused_parameters rebuilds its buckets in the second iteration's _pre_forward
    # (reducer._rebuild_buckets, torch/nn/parallel/distributed.py); the buckets built at construction were still
    # held through that forward in our recordings (docs/plan.md), and sometimes later: an upper bound
    old_buckets = t["ddp_buckets"] if t["ddp_buckets"] and not st.ddp_output_clone else 0

    def moment_bytes(mo: LossMoment) -> int:
        return mo.total * n + (layer_casts if full and mo.inside_autocast else 0) + (old_buckets if mo.forward else 0)

    peak = max(moments, key=moment_bytes)
    t["logits_and_loss"] = moment_bytes(peak)
    t["recompute_working_set"] = (layer_saved + layer_fwd) * n if full else 0
    t["optimizer_step_temporaries"] = optimizer_step_temporaries(params, train, plan)
    rebuilt = old_buckets if peak.forward else 0
    not_saved = {"communication": rebuilt, "temporaries": t["logits_and_loss"] - peak.activations * n - rebuilt}
    return t, not_saved, microbatches > 1, peak.name


__all__ = ["FAMILIES", "LoopSettings", "LossMoment", "check", "gpt2_layer", "head_bytes", "layer_bytes",
           "llama_layer", "loop_settings", "loss_moments", "stage_terms"]
