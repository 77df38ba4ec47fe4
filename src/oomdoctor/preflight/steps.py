"""The training steps preflight traces: any ``nn.Module`` (:func:`trace_module`) and Hugging Face's Trainer
step (:func:`trace_hf`).

The Hugging Face step is the one ``transformers.Trainer`` runs with ``bf16=True`` / ``fp16=True``
(``trainer.py`` ``training_step`` and ``_inner_training_loop``, accelerate's ``prepare_model``):

0. ``model.config.use_cache = False`` (``TrainingArguments.use_cache``'s default): no KV cache in training;
1. the batch is moved to the GPU (``input_ids`` and ``labels``, int64, ``micro_batch × seq_len``);
2. forward under autocast, the model computing its loss from ``labels``; accelerate wraps ``forward`` in
   ``convert_outputs_to_fp32``, so every fp16/bf16 output (the logits) is copied to fp32 after it;
3. ``loss.backward()`` outside autocast;
4. ``clip_grad_norm_(max_norm=1.0)`` (Trainer's default ``max_grad_norm``, foreach);
5. ``optimizer.step()``: ``torch.optim.AdamW(fused=True)`` (Trainer's default ``adamw_torch_fused`` on
   torch >= 2.8), ``sgd`` (foreach, no momentum), or ``adamw8bit`` (bitsandbytes, which needs CUDA: its
   state's shapes, :class:`AdamW8bitState`);
6. ``model.zero_grad()`` (``set_to_none``).

With ``world_size > 1`` the job is DDP under torchrun (Trainer's default ``find_unused_parameters=True``
without gradient checkpointing) and one rank is traced: DDP's gradient buckets (:func:`ddp_buckets`) live
from the start, its ``_DDPSink`` clones the outputs, and the collectives (in place on the buckets) are not
traced; NCCL's own memory is outside the allocator (the answers add it).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, cast

import torch

from ._private import PreflightError
from .tracer import AllocationTracer, CudaAutocastPolicy, TraceRecord, run_traced

__all__ = ["PreflightError", "HfJob", "trace_hf", "trace_module"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
OPTIMIZER_IMPLS = ("fused", "foreach", "for-loop")
#: the training loops traced, and the step each runs
LOOPS = {
    "trainer": "transformers.Trainer.training_step + clip_grad_norm_ + optimizer.step + zero_grad",
    "accelerate": "accelerate's README loop: accumulate(model), model(input_ids, labels).loss, "
                  "accelerator.backward (loss / grad_accum), optimizer.step, zero_grad",
}


def _facts(tracer: AllocationTracer, step: int, model: torch.nn.Module, opt: Any) -> None:
    params = [p for p in model.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in getattr(opt, "state", {}).values() if isinstance(s, dict)
             for v in s.values() if isinstance(v, torch.Tensor)]
    tracer.note_facts(step, {"parameters": params, "gradients": grads, "optimizer_state": state})


def trace_module(model_fn: Callable[[], torch.nn.Module], step_fn: Callable[[torch.nn.Module, Any, Any], Any],
                 batch_fn: Callable[[], Any], *, optimizer_fn: Callable[[torch.nn.Module], Any] | None = None,
                 steps: int = 2, cublas_workspace_bytes: int = 0) -> TraceRecord:
    """Trace ``steps`` training steps of any module under fake tensors.

    ``model_fn()`` builds the model (on the CPU, or on ``meta`` then ``to_empty(device="cpu")``: it runs
    under ``FakeTensorMode``, so no memory is used); ``optimizer_fn(model)`` its optimizer (default
    ``AdamW``); ``batch_fn()`` one micro-batch; ``step_fn(model, optimizer, batch)`` one step (forward,
    backward, ``optimizer.step()``, ``zero_grad``). Parameters, gradients and optimizer state are noted
    after each ``step_fn`` returns, before the next batch (gradients: those still set then).
    """
    def run(tracer: AllocationTracer) -> Any:
        tracer.mark_phase("train")
        model = model_fn()
        opt = (optimizer_fn or (lambda m: torch.optim.AdamW(m.parameters())))(model)
        for step in range(steps):
            tracer.mark_step(step)
            tracer.mark_phase("train")
            batch = batch_fn()
            step_fn(model, opt, batch)
            _facts(tracer, step, model, opt)
            del batch
        return model, opt

    return run_traced(run, cublas_workspace_bytes=cublas_workspace_bytes)


@dataclass(frozen=True)
class HfJob:
    """A Hugging Face causal-LM training job: the config file, micro-batch and sequence (tokens), the
    autocast dtype (``bf16``/``fp16``; ``fp32``: none), optimizer, activation checkpointing."""

    config: str
    micro_batch: int
    seq_len: int
    dtype: str = "bf16"
    optimizer: str = "adamw"
    gradient_checkpointing: bool = False
    steps: int = 2
    max_grad_norm: float = 1.0
    world_size: int = 1  # > 1: DistributedDataParallel under torchrun (one rank traced)
    loop: str = "trainer"  # "trainer" | "accelerate" (LOOPS)
    grad_accum: int = 1  # micro-batches per optimizer step
    #: AdamW's kernels (Trainer's loop): "fused" (``optim="adamw_torch_fused"``, the default), "foreach"
    #: (``adamw_torch``: ``torch.optim.AdamW``'s default on CUDA), "for-loop" (``foreach=False``)
    optimizer_impl: str = "fused"
    #: with gradient checkpointing, every k-th decoder layer checkpointed (transformers' ``every_n_layers``:
    #: layer i is when ``i % k == 0``); 1: all of them
    checkpoint_every: int = 1

    def as_dict(self) -> dict[str, Any]:
        return {"hf_config": self.config, "micro_batch": self.micro_batch, "seq_len": self.seq_len,
                "dtype": self.dtype, "optimizer": self.optimizer,
                "gradient_checkpointing": self.gradient_checkpointing, "steps": self.steps,
                "max_grad_norm": self.max_grad_norm if self.loop == "trainer" else None,
                "world_size": self.world_size, "ddp": self.world_size > 1, "loop": self.loop,
                "grad_accum": self.grad_accum, "use_reentrant": False, "step": LOOPS[self.loop],
                **({"optimizer_impl": self.optimizer_impl} if self.optimizer_impl != "fused" else {}),
                **({"checkpoint_every": self.checkpoint_every} if self.checkpoint_every != 1 else {})}


def load_config(path: str) -> Any:
    """A ``transformers`` config from a ``config.json`` (or a directory holding one). Raises PreflightError."""
    from transformers import AutoConfig, PretrainedConfig

    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    try:
        d = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise PreflightError(f"{path}: cannot read a Hugging Face config.json ({str(e)[:100]})") from None
    if not isinstance(d, dict):
        raise PreflightError(f"{path}: a Hugging Face config.json must be a JSON object")
    model_type = d.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, **d) if model_type else PretrainedConfig(**d)
    except (ValueError, KeyError, TypeError) as e:
        raise PreflightError(f"{path}: not a config transformers knows ({str(e)[:120]})") from None


def materialize(model: torch.nn.Module, device: str = "cpu") -> torch.nn.Module:
    """``model`` (on ``meta``) with every parameter and buffer allocated once on ``device``, as
    ``model.to("cuda")`` does: tensors shared by several modules (tied embeddings) stay one tensor
    (``Module.to_empty`` would untie them and allocate them twice)."""
    done: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in done:
                    done[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                mod._parameters[name] = cast(torch.nn.Parameter, done[id(p)])  # a parameter's: made a Parameter
        for name, b in list(mod._buffers.items()):
            if b is not None:
                if id(b) not in done:
                    done[id(b)] = torch.empty_like(b, device=device)
                mod._buffers[name] = done[id(b)]
    return model


class AdamW8bitState(torch.optim.Optimizer):
    """The memory of bitsandbytes' ``AdamW8bit`` (``bitsandbytes/optim/optimizer.py``
    ``Optimizer2State.init_state``), which cannot run on a CPU: per parameter of at least ``min_8bit_size``
    (4096) elements, two ``uint8`` states of its shape and two fp32 ``absmax`` of one value per block of 256;
    smaller ones two fp32 states; a ``step`` counter on the host. The fused 8-bit kernel updates in place:
    the step allocates nothing. The update itself is not computed (no numbers exist under fake tensors)."""

    def __init__(self, params: Any, lr: float = 1e-3, min_8bit_size: int = 4096, block: int = 256) -> None:
        super().__init__(params, {"lr": lr})
        self.min_8bit_size, self.block = min_8bit_size, block

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    if p.numel() >= self.min_8bit_size:
                        blocks = (p.numel() + self.block - 1) // self.block
                        st["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                        st["state2"] = torch.zeros_like(p, dtype=torch.uint8)
                        st["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                        st["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                    else:
                        st["state1"] = torch.zeros_like(p, dtype=torch.float32)
                        st["state2"] = torch.zeros_like(p, dtype=torch.float32)


DDP_FIRST_BUCKET_BYTES = 1 << 20
DDP_BUCKET_BYTES = 25 << 20


def ddp_buckets(params: Sequence[torch.Tensor]) -> list[int]:
    """Bytes of the gradient buckets ``DistributedDataParallel`` allocates at construction
    (``torch/nn/parallel/distributed.py`` ``_ddp_init_helper``, ``bucket_cap_mb=25``, first bucket 1 MiB),
    parameters in reverse order. The total is exact (every parameter's bytes once); the cut points
    approximate the reducer's (the corpus's GPT-2 shows a 9,216-byte first bucket, then one layer a bucket)."""
    out: list[int] = []
    cur = 0
    for p in reversed(params):
        n = p.numel() * p.element_size()
        if not out and cur and cur + n > DDP_FIRST_BUCKET_BYTES:
            out.append(cur)
            cur = 0
        cur += n
        if out and cur >= DDP_BUCKET_BYTES:
            out.append(cur)
            cur = 0
    if cur:
        out.append(cur)
    return out


def _ddp_sink(out: Any) -> Any:
    """``_DDPSink``: DDP clones every output tensor when it looks for unused parameters
    (``find_unused_parameters``, which Trainer turns on unless gradient checkpointing is)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, dict):
        for k in list(out.keys()):
            out[k] = _ddp_sink(out[k])
        return out
    if isinstance(out, (list, tuple)):
        return type(out)(_ddp_sink(v) for v in out)
    return out


@contextlib.contextmanager
def _not_tracing() -> Iterator[None]:
    """transformers' ``is_tracing(tensor)`` says True for a FakeTensor (``utils/import_utils.py``), so under
    the fake mode its mask code materializes a ``b × 1 × s × s`` causal mask and SDPA loses ``is_causal``
    (measured: GPT-2 gets a (2, 1, 16, 16) mask under fake tensors, None with real ones). While active, the
    check ignores fake tensors (it still sees torch.compile, jit and stream capture), as on the GPU."""
    import sys

    from transformers.utils import import_utils

    orig = getattr(import_utils, "is_tracing", None)
    if orig is None:  # older transformers: no FakeTensor check to undo
        yield
        return

    def is_tracing(tensor: Any = None) -> bool:
        return orig(None)

    patched: list[Any] = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("transformers") and getattr(m, "is_tracing", None) is orig]
    mu: Any = sys.modules.get("transformers.masking_utils")
    find: Any = getattr(mu, "find_packed_sequence_indices", None)

    def unpacked(position_ids: Any) -> None:
        """The packed-sequence check reads values (``.all()``): its tensors are traced, its answer is the
        one for the batches preflight builds (no packing, positions ``0..s-1``): None."""
        mu.is_tracing = orig
        try:
            find(position_ids)
        finally:
            mu.is_tracing = is_tracing
        return None

    for m in patched:
        m.is_tracing = is_tracing
    if find is not None:
        mu.find_packed_sequence_indices = unpacked
    try:
        yield
    finally:
        for m in patched:
            m.is_tracing = orig
        if find is not None:
            mu.find_packed_sequence_indices = find


def _to_fp32(out: Any) -> Any:
    """accelerate's ``convert_outputs_to_fp32``: fp16/bf16 tensors of the model's output as fp32
    (``accelerate/utils/operations.py``)."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
    if isinstance(out, dict):
        for k in list(out.keys()):
            out[k] = _to_fp32(out[k])
        return out
    if isinstance(out, (list, tuple)):
        return type(out)(_to_fp32(v) for v in out)
    return out


def checkpoint_kwargs(tracer: AllocationTracer) -> dict[str, Any]:
    """``gradient_checkpointing_kwargs`` for the trace: non-reentrant (transformers 5's default), with CUDA's
    policies (:class:`.tracer.CudaAutocastPolicy`) active in the recomputation too. The autograd engine
    runs the recomputation without the caller's ``TorchFunctionMode`` (measured: without this, the
    recomputed blocks ran CPU's math attention, a ``b × h × s × s`` matrix, and CPU's dropout), so it is
    entered again through ``torch.utils.checkpoint``'s ``context_fn`` (``(forward, recompute)`` contexts,
    non-reentrant only)."""
    return {"use_reentrant": False,
            "context_fn": lambda: (contextlib.nullcontext(), CudaAutocastPolicy(tracer))}


def trace_hf(job: HfJob, *, config: Any = None, cublas_workspace_bytes: int = 0) -> TraceRecord:
    """Trace ``job`` as its loop runs it (the module doc). ``config``: a ready ``transformers`` config
    (else read from ``job.config``). Raises PreflightError for an unknown dtype, optimizer or loop.

    ``loop="accelerate"`` is accelerate's README loop (``Accelerator(mixed_precision=...,
    gradient_accumulation_steps=K)``, ``accelerate/accelerator.py``): the config's ``use_cache`` as given (the
    loop does not set it), ``torch.optim.AdamW`` at its defaults (foreach on CUDA), no gradient clipping, DDP
    without ``find_unused_parameters`` (accelerate's ``DistributedDataParallelKwargs`` default: no output
    clone), ``K`` micro-batches per optimizer step (``accumulate``: the loss divided by ``K``, the gradients
    summed into ``.grad``, the optimizer's step and ``zero_grad`` skipped until the last), the batch one
    int64 tensor given as ``input_ids`` and ``labels``. ``job.steps`` counts optimizer steps."""
    from transformers import AutoModelForCausalLM

    if job.dtype not in DTYPES:
        raise PreflightError(f"unknown dtype {job.dtype!r}: one of {', '.join(DTYPES)}")
    if job.optimizer not in OPTIMIZERS:
        raise PreflightError(f"unknown optimizer {job.optimizer!r}: one of {', '.join(OPTIMIZERS)}")
    if job.loop not in LOOPS:
        raise PreflightError(f"unknown loop {job.loop!r}: one of {', '.join(LOOPS)}")
    if job.optimizer_impl not in OPTIMIZER_IMPLS:
        raise PreflightError(f"unknown optimizer kernels {job.optimizer_impl!r}: one of {', '.join(OPTIMIZER_IMPLS)}")
    trainer = job.loop == "trainer"
    cfg = config if config is not None else load_config(job.config)
    if trainer:
        cfg.use_cache = False  # Trainer sets model.config.use_cache = args.use_cache, False by default ("Finalize")
    low = DTYPES[job.dtype]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    vocab = int(cfg.vocab_size)

    def run(tracer: AllocationTracer) -> Any:
        with _not_tracing():
            return steps(tracer)

    def steps(tracer: AllocationTracer) -> Any:
        tracer.mark_phase("train")
        m: Any = materialize(model)  # Trainer / accelerate move the model to the GPU: one block per tensor
        if job.gradient_checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(tracer))
            if job.checkpoint_every > 1:  # transformers' every_n_layers (modeling_utils _set_gradient_checkpointing)
                from transformers.modeling_layers import GradientCheckpointingLayer

                layers = [x for x in m.modules() if isinstance(x, GradientCheckpointingLayer)]
                for i, layer in enumerate(layers):
                    layer.gradient_checkpointing = i % job.checkpoint_every == 0
        m.train()
        params = [p for p in m.parameters() if p.requires_grad]
        buckets = [torch.empty(n, dtype=torch.uint8) for n in ddp_buckets(params)] if job.world_size > 1 else []
        if job.optimizer == "sgd":
            opt = torch.optim.SGD(params, lr=1e-3)
        elif job.optimizer == "adamw8bit":
            opt = AdamW8bitState(params, lr=5e-5)
        elif trainer:
            kernels = {"fused": {"fused": True}, "foreach": {}, "for-loop": {"foreach": False}}[job.optimizer_impl]
            opt = torch.optim.AdamW(params, lr=5e-5, **kernels)
        else:
            opt = torch.optim.AdamW(params, lr=3e-4)
        for step in range(job.steps):
            tracer.mark_step(step)
            for k in range(job.grad_accum):
                tracer.mark_phase("train")
                ids = torch.randint(0, vocab, (job.micro_batch, job.seq_len))
                inputs = {"input_ids": ids, "labels": ids.clone() if trainer else ids}
                if low is not torch.float32:
                    with torch.autocast("cpu", dtype=low):
                        out = m(**inputs)
                    out = _to_fp32(out)
                else:
                    out = m(**inputs)
                if trainer and job.world_size > 1 and not job.gradient_checkpointing:
                    out = _ddp_sink(out)
                loss = out["loss"]
                del out, inputs, ids
                if job.grad_accum > 1:
                    loss = loss / job.grad_accum
                loss.backward()
                del loss
            tracer.mark_phase("optimizer")
            if trainer and job.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, job.max_grad_norm)
            opt.step()
            _facts(tracer, step, m, opt)
            m.zero_grad(set_to_none=True)
        return m, opt, buckets

    return run_traced(run, cublas_workspace_bytes=cublas_workspace_bytes)
