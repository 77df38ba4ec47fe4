"""Memory terms, one function each, with their source. Bytes per rank (one GPU).

References are to ``shared/reference/memory_estimation.md`` (§), which cites the papers and framework
files: Korthikanti et al. 2022 (arXiv:2205.05198) for activations, ZeRO (arXiv:1910.02054) for model
states, Megatron-LM ``theoretical_memory_usage.py`` / ``schedules.py``, PyTorch
``torch/distributed/pipelining/schedules.py``.
"""

from __future__ import annotations

from .specs import ModelSpec, ParallelPlan, TrainingSpec

MiB = 1 << 20

# -- parameters ------------------------------------------------------------------------------------


def layer_params(m: ModelSpec, tp: int, ep: int = 1) -> tuple[int, int]:
    """``(sharded, replicated)`` parameters of one transformer layer on one tensor-parallel rank.
    Attention: Q and output ``h²`` each, K and V ``h · kv_heads · head_dim`` each; MLP: 2 (3 when gated)
    ``h × ffn`` matrices, per expert for MoE (experts split over ``ep``, the router replicated);
    norms replicated (Megatron ``compute_weight_and_optimizer_memory``, §1.3)."""
    h, kvd = m.hidden_size, m.num_kv_heads * m.head_dim
    attn = 2 * h * h + 2 * h * kvd + (h + 2 * kvd + h if m.bias else 0)
    mats = 3 if m.gated_mlp else 2
    mlp_one = mats * h * m.ffn_hidden_size + ((mats - 1) * m.ffn_hidden_size + h if m.bias else 0)
    if m.num_experts:
        mlp = mlp_one * (m.num_experts // ep + m.shared_experts)
        router = h * m.num_experts
    else:
        mlp, router = mlp_one, 0
    norms = 2 * h * (2 if m.norm == "layernorm" else 1)
    return (attn + mlp) // tp, norms + router


def stage_params(m: ModelSpec, plan: ParallelPlan, stage: int, vocab: int) -> int:
    """Parameters on one rank of pipeline stage ``stage``: its layers, the input embedding (and learned
    positions) on the first stage, the output layer on the last (untied, or tied with ``pp > 1``, where
    Megatron keeps a copy of the embedding on the last stage), the final norm on the last stage."""
    shard, repl = layer_params(m, plan.tp, plan.ep)
    n = (shard + repl) * (m.num_layers // plan.pp)
    first, last = stage == 0, stage == plan.pp - 1
    emb = vocab * m.hidden_size // plan.tp
    if first:
        n += emb + m.learned_positions * m.hidden_size
    if last:
        n += m.hidden_size * (2 if m.norm == "layernorm" else 1)
        if not m.tied_embeddings or plan.pp > 1:
            n += emb
    return n


# -- model states ----------------------------------------------------------------------------------


def model_state_bytes(params: int, train: TrainingSpec, plan: ParallelPlan) -> dict[str, int]:
    """Weights, gradients, master weights and optimizer state for ``params`` parameters.

    ZeRO §3.1/§5 (arXiv:1910.02054): mixed-precision Adam keeps 2 (weights) + grads + 4 (fp32 master)
    + 8 (Adam moments) bytes per parameter; Megatron keeps fp32 main grads (18 B, "bf16 params, fp32
    grads"; ``docs/user-guide/features/dist_optimizer.md``). Sharding over ``dp × cp`` (Megatron shards
    the distributed optimizer over both, §1.9): ZeRO-1 / distributed optimizer shards master and
    optimizer state (6 + 12/d), ZeRO-2 also the grads, ZeRO-3 / FSDP everything (FSDP2 keeps the
    sharded weights in fp32 as the master copy: 16/d, §0.1)."""
    d = plan.dp * plan.cp
    s = plan.dp_sharding
    shard_opt = s in ("zero1", "zero2", "zero3", "fsdp") and d > 1
    shard_grad = s in ("zero2", "zero3", "fsdp")
    shard_param = s in ("zero3", "fsdp")
    if s == "fsdp":  # FSDP2: fp32 sharded parameters are the master weights; unsharded bf16 copies are buffers
        weights, master = params * 4 // d, 0
        grads = params * train.grad_bytes // d
    else:
        weights = params * train.param_bytes // (d if shard_param else 1)
        master = params * train.master_bytes // (d if shard_opt else 1)
        grads = params * train.grad_bytes // (d if shard_grad else 1)
    opt = 0 if plan.cpu_offload_optimizer else params * train.optimizer_state_bytes // (d if shard_opt else 1)
    if plan.cpu_offload_optimizer:
        master = 0
    return {"weights": weights, "gradients": grads, "master_weights": master, "optimizer_state": opt}


def fsdp_unsharded_bytes(m: ModelSpec, plan: ParallelPlan, train: TrainingSpec, stage_params: int) -> int:
    """FSDP/ZeRO-3 gather buffers: the unit being computed plus one prefetched, unsharded in the
    compute dtype, and the unsharded gradients being reduce-scattered (§3 "FSDP / ZeRO-3 gather
    buffers"; PyTorch ``sac_ilp`` budgets 3 × the largest unit). Under pipeline parallelism torchtitan
    sets ``reshard_after_forward=False``: the whole stage's parameters stay unsharded, and its unsharded
    gradients persist across micro-batches until the last backward's reduce-scatter (§2.2), in the
    reduce dtype (``grad_bytes``). Without PP, torchtitan keeps the ``[norm, output]`` unit and the last block
    unsharded from the forward to the backward: the output matrix ``V·h/tp`` and one layer in the compute
    dtype (seen in the snapshots of ``benchmarks/measure_plan_gpu.py``, docs/plan.md)."""
    if plan.dp_sharding not in ("zero3", "fsdp") or plan.dp * plan.cp == 1:
        return 0
    shard, repl = layer_params(m, plan.tp, plan.ep)
    layer = shard + repl
    if plan.framework == "torch":
        if plan.pp > 1:
            return stage_params * (train.param_bytes + train.grad_bytes)
        # torchtitan parallelize.py: [norm, output] and the last block keep reshard_after_forward=False, so at the
        # loss (the activation peak) the output unit and one block are unsharded; no gradient exists yet
        return (m.vocab_size * m.hidden_size // plan.tp + layer) * train.param_bytes
    return 2 * layer * train.param_bytes + 2 * layer * train.grad_bytes


def ddp_bucket_bytes(params: int, train: TrainingSpec, plan: ParallelPlan) -> int:
    """PyTorch DDP without ``gradient_as_bucket_view`` keeps a flat copy of all gradients in its
    buckets (pytorch PR #41954, §3 "DDP gradient buckets"); Megatron's contiguous grad buffer is the
    gradients themselves (0 extra)."""
    if plan.framework != "torch" or plan.dp_sharding != "none" or plan.dp == 1:
        return 0
    return params * train.grad_bytes


def gradients_persist(plan: ParallelPlan, microbatches: int) -> bool:
    """Whether the (sharded) gradients are held while activations are: Megatron-LM allocates its
    contiguous main-grad buffers once (``distributed/param_and_grad_buffer.py``), so always. PyTorch
    creates gradients in the backward and frees them at ``zero_grad(set_to_none=True)`` (the default since
    2.0), so they meet the activations only when a later micro-batch runs its forward after a backward:
    gradient accumulation over ``microbatches > 1``. Under PP, FSDP2 accumulates the *unsharded*
    gradients instead (:func:`fsdp_unsharded_bytes`) and reduce-scatters once after the last backward
    (``torch/distributed/pipelining/stage.py`` ``backward_maybe_with_nosync``)."""
    if plan.framework != "torch":
        return True
    if plan.dp_sharding in ("zero3", "fsdp") and plan.dp * plan.cp > 1 and plan.pp > 1:
        return False
    return microbatches > 1


def optimizer_step_temporaries(params: int, train: TrainingSpec, plan: ParallelPlan) -> int:
    """PyTorch's foreach Adam/AdamW uses about ``sizeof(params)`` more at ``step()`` (torch.optim docs,
    issue #97712): the fp32 parameters the step updates, sharded like the optimizer state."""
    if plan.cpu_offload_optimizer:
        return 0
    d = plan.dp * plan.cp if plan.dp_sharding != "none" else 1
    return params * 4 // d


# -- activations -----------------------------------------------------------------------------------


def layer_activation_bytes(m: ModelSpec, train: TrainingSpec, plan: ParallelPlan, recompute: str) -> int:
    """Bytes one transformer layer saves for backward, for one micro-batch, on one rank: Megatron-LM's
    fused layers (:func:`megatron_layer_activation_bytes`) or PyTorch eager modules as torchtitan writes
    them (:func:`eager_layer_activation_bytes`), by ``plan.framework``."""
    if plan.framework == "torch":
        return eager_layer_activation_bytes(m, train, plan, recompute)
    return megatron_layer_activation_bytes(m, train, plan, recompute)


def megatron_layer_activation_bytes(m: ModelSpec, train: TrainingSpec, plan: ParallelPlan, recompute: str) -> int:
    """Bytes one Megatron-LM transformer layer saves for backward, for one micro-batch, on one rank.

    Korthikanti et al. §4.1 / Table 2 (arXiv:2205.05198), term by term so that GQA, SwiGLU, flash
    attention, dropout and FP8 change only their own terms (§1.1 "Adaptations"): with ``s`` the local
    sequence (÷ cp), ``b`` the micro-batch, ``h``, ``f``, heads ``a``, KV heads ``g``:

    - replicated across TP unless sequence parallel: two norm inputs 2sbh each, the QKV and fc1 inputs
      2sbh each (1 byte with FP8), and with dropout two masks sbh each;
    - sharded over TP: Q 2sbh, K and V 2sbh·g/a each, the output-projection input 2sbh, and the attention
      core: 5as²b (scores, dropout mask, dropout output) or 2as²b without dropout, or with flash
      attention only the log-sum-exp 4asb; MLP: GeLU 2sbf (its input) + 2sbf (fc2 input), SwiGLU
      2·2sbf (gate, up) + 2sbf (fc2 input; 1 byte with FP8).

    ``selective`` recompute drops the attention core; ``full`` keeps only the layer input 2sbh
    (÷ tp with sequence parallel).
    """
    s = train.seq_len // plan.cp
    b, h, f = train.micro_batch, m.hidden_size, m.ffn_hidden_size
    a, g, t = m.num_heads, m.num_kv_heads, plan.tp
    sbh = s * b * h
    repl_div = t if plan.sequence_parallel else 1
    if recompute == "full":
        return 2 * sbh // repl_div
    lin_in = 1 if train.fp8 else 2
    replicated = (2 + 2) * sbh + 2 * lin_in * sbh + (2 * sbh if train.dropout else 0)
    attn = 2 * sbh + 2 * 2 * sbh * g // a + 2 * sbh
    core = attention_core_bytes(train, recompute, a, s, b)
    if m.gated_mlp:
        mlp = 2 * 2 * s * b * f + lin_in * s * b * f
    else:
        mlp = 2 * s * b * f + lin_in * s * b * f
    if m.num_experts:
        mlp = mlp * max(m.experts_per_token, 1) + 2 * sbh  # each token in top-k experts; the dispatcher input
    return replicated // repl_div + (attn + core + mlp) // t


def attention_core_bytes(train: TrainingSpec, recompute: str, heads: int, s: int, b: int) -> int:
    """The attention core one layer saves, before the TP split: the s² scores, dropout mask and dropout
    output 5as²b (2as²b without dropout) of unfused attention, or flash attention's fp32 log-sum-exp 4asb;
    nothing under ``selective`` recompute, which recomputes it (Korthikanti et al. §5)."""
    if recompute == "selective":
        return 0
    if train.flash_attention:
        return 4 * heads * s * b
    return (5 if train.dropout else 2) * heads * s * s * b


def eager_layer_activation_bytes(m: ModelSpec, train: TrainingSpec, plan: ParallelPlan, recompute: str) -> int:
    """Bytes one layer of torchtitan's Llama (``torchtitan/models/llama3/model/model.py``) saves for
    backward in PyTorch eager mode, for one micro-batch, on one rank: what autograd keeps per op, not a
    fused kernel's choice (``s`` local sequence, ``b`` micro-batch, ``h``, ``f``, ``a`` heads, ``t`` = tp):

    - the two RMSNorm inputs, 2·2sbh (÷ t with sequence parallel);
    - the two norm outputs, which the QKV and w1/w3 projections save, 2·2sbh; with TP + sequence parallel
      the projections save the all-gathered input, so these stay whole (DTensor ``SequenceParallel`` +
      ``ColwiseParallel``; Megatron instead re-gathers in the backward);
    - attention, ÷ t: Q after RoPE 2sbh; K and V after ``repeat_kv``, which copies the KV heads up to
      ``a`` heads, 2sbh each; the SDPA output 2sbh (it is also ``wo``'s input); flash log-sum-exp 4asb
      (or the s² scores of unfused attention, as in Megatron's term); RoPE's fp32 copies are not saved
      (``mul`` saves an operand only when the other requires grad, and the frequencies do not);
    - the SwiGLU MLP ``w2(silu(w1 x) * w3 x)``, ÷ t: w1's output (silu's input), silu's output, w3's
      output and their product (w2's input), 4·2sbf; a GeLU MLP keeps fc1's output and GeLU's, 2·2sbf.

    Without TP that is 16sbh + 8sbf (+ 4asb): the snapshot of ``benchmarks/measure_plan_gpu.py``'s
    ``fsdp4`` run holds exactly these tensors per layer at its peak, and its ``probe`` counts 895,557,648
    bytes saved by one block at s=4096, b=2 besides its input: to 16 bytes, these terms less the input
    2sbh, plus the block's bf16 weights (which FSDP frees after the forward), the RoPE table and the
    RMSNorm fp32 reciprocals. ``full`` recompute (``checkpoint_wrapper``) keeps the
    block input 2sbh (÷ t with sequence parallel); ``selective`` drops the attention core, as Megatron's.
    """
    s = train.seq_len // plan.cp
    b, h, f = train.micro_batch, m.hidden_size, m.ffn_hidden_size
    a, t = m.num_heads, plan.tp
    sbh = s * b * h
    repl_div = t if plan.sequence_parallel else 1
    if recompute == "full":
        return 2 * sbh // repl_div
    norm_in = 2 * 2 * sbh // repl_div
    proj_in = 2 * 2 * sbh + (2 * sbh if train.dropout else 0)
    attn = 4 * 2 * sbh
    core = attention_core_bytes(train, recompute, a, s, b)
    mlp = (4 if m.gated_mlp else 2) * 2 * s * b * f
    if m.num_experts:
        mlp = mlp * max(m.experts_per_token, 1) + 2 * sbh
    return norm_in + proj_in + (attn + core + mlp) // t


def embedding_activation_bytes(train: TrainingSpec, plan: ParallelPlan, h: int) -> int:
    """First stage, per micro-batch: int64 input ids 8sb and, with dropout, the embedding dropout mask
    sbh (Megatron ``compute_activation_memory``: ``8·s·b·p + s·b·h·p``)."""
    s = train.seq_len // plan.cp
    return 8 * s * train.micro_batch + (s * train.micro_batch * h if train.dropout else 0) // (
        plan.tp if plan.sequence_parallel else 1)


def logits_loss_bytes(m: ModelSpec, train: TrainingSpec, plan: ParallelPlan, vocab: int) -> int:
    """Last stage, one micro-batch, per logit ``s·b·V/t``. Megatron: the bf16 logits × 2 plus the fp32
    copy its vocab-parallel cross-entropy works on × 4 (6 bytes; §2.3, the checks of §4.1). PyTorch
    (``F.cross_entropy(pred.float(), ...)``, torchtitan ``cross_entropy_loss``): at the start of its
    backward the fp32 log-softmax output, ``nll_loss``'s gradient and log-softmax's gradient are held,
    12 bytes (the bf16 logits were dropped with ``del pred``); with TP, ``loss_parallel``'s backward
    (``torch/distributed/tensor/parallel/loss.py`` ``_nll_loss_and_log_softmax_backward``) holds 16 bytes
    of its shard; under PP the schedule also keeps the stage's bf16 output until its backward, +2.
    Measured: 12.000 bytes per logit (``probe``), 16 with loss parallel (the ``fsdp2-tp2`` snapshot),
    ``benchmarks/measure_plan_gpu.py``. A fused cross-entropy keeps the bf16 logits and a bf16
    gradient (4 bytes)."""
    n = (train.seq_len // plan.cp) * train.micro_batch * vocab // plan.tp
    if train.fused_cross_entropy:
        return n * 4
    if plan.framework == "torch":
        per = 16 if plan.tp > 1 else 12
        return n * (per + (2 if plan.pp > 1 else 0))
    return n * 6


def held_losses_bytes(train: TrainingSpec, plan: ParallelPlan, vocab: int, microbatches: int) -> int:
    """Last stage under GPipe: every micro-batch's forward, loss included, runs before any backward
    (``torch/distributed/pipelining/schedules.py`` ``ScheduleGPipe``), so the other ``M − 1`` micro-batches'
    loss graphs are held at the first backward: each keeps the fp32 log-softmax output its backward needs
    (4 bytes per logit ``s·b·V/t``) and the bf16 stage output the schedule keeps for the stage's backward
    (2 bytes; with ``return_outputs=True`` that output is already in :func:`cached_outputs_bytes`).
    Other schedules run a micro-batch's backward right after its loss on the last stage: 0. Measured on
    the ``pp2-fsdp2-gpipe`` run of ``benchmarks/measure_plan_gpu.py`` (docs/plan.md)."""
    if plan.schedule != "gpipe" or plan.pp == 1:
        return 0
    n = (train.seq_len // plan.cp) * train.micro_batch * vocab // plan.tp
    return n * (4 + (0 if plan.return_outputs else 2)) * (microbatches - 1)


def cached_outputs_bytes(train: TrainingSpec, plan: ParallelPlan, vocab: int, microbatches: int) -> int:
    """``torch.distributed.pipelining`` with ``step(return_outputs=True)`` keeps every micro-batch's
    output on the last stage until ``step()`` returns: ``M · b · s · V/t`` bf16 (§2.4; PyTorch PR
    #165822 added ``return_outputs=False``). The micro-batch being computed is already in
    :func:`logits_loss_bytes`."""
    if not plan.return_outputs:
        return 0
    n = (train.seq_len // plan.cp) * train.micro_batch * vocab // plan.tp
    return 2 * n * (microbatches - 1)


# -- fixed costs -----------------------------------------------------------------------------------

CUBLAS_WORKSPACE_BYTES = 32 * MiB
"""Hopper cuBLAS workspace per handle and stream, through the caching allocator (PyTorch PR #120925,
``CUDABlas.cpp`` ``_getWorkspaceSize``: ``:4096:8``): one at the first GEMM of the main thread, one at the first
GEMM of the autograd engine's thread (both seen in ``shared/snapshots/ddp-clean``, 33,554,432 bytes, the second
with no Python frame). Preflight's tracer allocates them too (``preflight/snapshot.py`` ``cublas_workspace_bytes``)."""
CUDA_CONTEXT_BYTES = 740 * 10**6
"""CUDA context and the kernels of a training step, outside the caching allocator: 737 MB measured on
H200, CUDA 13.0, torch 2.11 after CUDA init, a GEMM and SDPA forward and backward
(``benchmarks/measure_plan_gpu.py overhead``, docs/plan.md); PyTorch PR #86509 measured 287 MB with
lazy module loading, 667 MB without (§3)."""
NCCL_FIRST_COMMUNICATOR_BYTES = 880 * 10**6
"""The first NCCL communicator (the world group, which ``init_process_group(device_id=...)`` creates):
883 MB measured (same run), its buffers plus NCCL's per-process state."""
NCCL_PER_COMMUNICATOR_BYTES = 510 * 10**6
"""Each further communicator: 508-510 MB measured (same run); nccl #964 measured 544-688 MB (§3)."""


def outside_allocator_bytes(world_size: int) -> int:
    """Bytes a process holds outside the caching allocator before its first step: the CUDA context, plus NCCL's
    first communicator when the job has more than one rank (:data:`CUDA_CONTEXT_BYTES`,
    :data:`NCCL_FIRST_COMMUNICATOR_BYTES`; measured, docs/plan.md). The room preflight, tune and what fits take
    from a GPU's total when nothing was read from the device."""
    return CUDA_CONTEXT_BYTES + (NCCL_FIRST_COMMUNICATOR_BYTES if world_size > 1 else 0)


def workspace_bytes(plan: ParallelPlan) -> int:
    """cuBLAS workspaces in ``allocated``: one per stream doing GEMMs (compute, and the tensor-parallel
    communication stream when ``tp > 1``)."""
    return CUBLAS_WORKSPACE_BYTES * (2 if plan.tp > 1 else 1)


def nccl_bytes(plan: ParallelPlan) -> int:
    """Outside the caching allocator: the world communicator, and one per parallel dimension larger
    than 1 (none on one GPU)."""
    groups = sum(1 for x in (plan.tp, plan.pp, plan.dp, plan.cp, plan.ep) if x > 1)
    if groups == 0:
        return 0
    return NCCL_FIRST_COMMUNICATOR_BYTES + NCCL_PER_COMMUNICATOR_BYTES * groups


def fragmentation_fraction(plan: ParallelPlan) -> float:
    """Reserved over allocated, minus one: 10% with the default allocator, 15% with interleaving plus
    recompute (more, smaller, shorter-lived blocks), 3% with ``expandable_segments`` (§3 "Allocator
    fragmentation": GMLake 15% average, Mist 8%, arXiv:2507.16274 up to 43% with VPP + recompute).
    ``torch.distributed.pipelining`` with FSDP2: 30%, the median reserved / allocated of the pipeline
    stages we measured (1.10-1.35 on H200, ``benchmarks/measure_plan_gpu.py``, docs/plan.md), which
    seed 003's stage 0 also shows (35.75 GiB reserved for about 26.6 GiB of terms); the non-pipelined
    FSDP2 and TP runs measured 1.05-1.20, inside the 10% default's error."""
    if plan.expandable_segments:
        return 0.03
    if plan.framework == "torch" and plan.pp > 1:
        return 0.30
    if plan.vpp > 1 and plan.recompute != "none":
        return 0.15
    return 0.10
