"""What a memory plan is about: the model, the training setup, the hardware and the parallel plan.

Terms are Megatron-LM's and torchtitan's (``shared/reference/memory_estimation.md`` §1, §2): ``tp``
tensor parallel, ``pp`` pipeline stages, ``vpp`` virtual stages (model chunks) per rank, ``dp`` data
parallel, ``cp`` context parallel, ``ep`` expert parallel, ``sequence_parallel`` (Megatron SP, only
with ``tp > 1``), micro-batch size and count. Sizes are in bytes, counts are ints.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import OomdoctorError

SCHEDULES = ("1f1b", "interleaved", "gpipe", "zero-bubble", "zbv")
RECOMPUTE = ("none", "selective", "full")
DP_SHARDING = ("none", "zero1", "zero2", "zero3", "fsdp")
FRAMEWORKS = ("megatron", "torch", "hf")
LOOPS = ("trainer", "accelerate", "lightning", "plain")
"""The training loops ``framework="hf"`` knows (:mod:`.hf`): Hugging Face Trainer, an accelerate loop,
PyTorch Lightning, a plain PyTorch loop."""


class PlanError(OomdoctorError):
    """An invalid model, setup or parallel plan; the message shows the arithmetic that fails."""

    exit_code = 2


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. ``ffn_hidden_size`` is the MLP width (per expert for MoE);
    ``num_kv_heads`` < ``num_heads`` is GQA; ``gated_mlp`` is SwiGLU (three matrices);
    ``learned_positions`` adds a ``max_positions × hidden`` table (GPT-2); ``bias`` adds linear biases;
    ``norm`` is ``layernorm`` (weight and bias) or ``rmsnorm`` (weight only). ``family`` is the Hugging
    Face ``model_type`` (``gpt2``, ``llama``, ...) and ``activation`` its ``activation_function`` /
    ``hidden_act``: they pick the module code ``framework="hf"`` counts (:mod:`.hf`); ``use_cache`` is
    the config's default (a transformers model builds its KV cache in a training forward when it is on);
    ``dropout`` is whether the config's residual/embedding dropout is above 0 (GPT-2's ``resid_pdrop``).

    The docstring under each field is its description in the JSON schema (``oomdoctor schema plan estimate``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    name: str
    """the model's name"""
    num_layers: int
    """transformer layers"""
    hidden_size: int
    """hidden width"""
    ffn_hidden_size: int
    """MLP width (per expert for MoE)"""
    num_heads: int
    """attention heads"""
    num_kv_heads: int
    """key/value heads (fewer than heads: GQA)"""
    vocab_size: int
    """vocabulary"""
    tied_embeddings: bool = False
    """input and output embeddings shared"""
    gated_mlp: bool = True
    """SwiGLU (three matrices)"""
    bias: bool = False
    """linear layers have biases"""
    norm: str = "rmsnorm"
    """layernorm or rmsnorm"""
    learned_positions: int = 0
    """rows of a learned position table (GPT-2), 0 for none"""
    num_experts: int = 0
    """MoE experts"""
    experts_per_token: int = 0
    """experts each token is routed to"""
    shared_experts: int = 0
    """always-on experts"""
    family: str = ""
    """the Hugging Face model_type"""
    activation: str = ""
    """the MLP activation"""
    use_cache: bool = True
    """the config's default: a transformers model builds its KV cache in a training forward when it is on"""
    dropout: bool = False
    """the config's residual/embedding dropout is above 0"""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class TrainingSpec:
    """One optimizer step: ``global_batch`` sequences of ``seq_len`` tokens, in micro-batches of
    ``micro_batch``. Dtypes: ``param_bytes`` (2 for bf16/fp16 weights used in the forward),
    ``grad_bytes`` (Megatron keeps fp32 main grads: 4; ``grad_reduce_in_fp32=False``: 2), ``master_bytes``
    (fp32 master copy, 0 when training in fp32), ``optimizer_state_bytes`` (Adam: 8 per param).
    ``fp8`` saves linear-layer inputs in 1 byte (Transformer Engine). ``flash_attention`` drops the s²
    attention scores; ``dropout`` keeps 1-byte masks.

    The docstring under each field is its description in the JSON schema (``oomdoctor schema plan estimate``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    seq_len: int
    """tokens per sequence"""
    global_batch: int
    """sequences per optimizer step"""
    micro_batch: int = 1
    """sequences per micro-batch"""
    param_bytes: int = 2
    """bytes per weight used in the forward"""
    grad_bytes: int = 4
    """bytes per gradient element"""
    master_bytes: int = 4
    """bytes per fp32 master weight (0 without)"""
    optimizer_state_bytes: int = 8
    """optimizer state bytes per parameter (Adam: 8)"""
    fp8: bool = False
    """linear inputs saved in 1 byte (Transformer Engine)"""
    flash_attention: bool = True
    """no s^2 attention scores kept"""
    dropout: bool = False
    """dropout masks are kept (1 byte each)"""
    fused_cross_entropy: bool = False
    """the loss does not materialise fp32 logits"""


@dataclass(frozen=True)
class Hardware:
    """GPUs: ``gpu_memory_bytes`` each, ``gpus_per_node`` of them per node; bandwidths in bytes/s per
    GPU (intra-node NVLink, inter-node network); ``peak_flops`` dense bf16 per GPU."""

    name: str
    gpu_memory_bytes: int
    num_gpus: int
    gpus_per_node: int = 8
    intra_node_bw: float = 450e9
    inter_node_bw: float = 50e9
    peak_flops: float = 989e12


@dataclass(frozen=True)
class ParallelPlan:
    """How the model is spread. ``recompute_layers`` is the number of layers per stage that are fully
    recomputed (Megatron ``--recompute-method block --recompute-num-layers``); None means all of them
    when ``recompute == "full"``. ``return_outputs`` is ``torch.distributed.pipelining``'s
    ``step(return_outputs=True)``, which caches every micro-batch's output on the last stage.
    ``loop`` (one of :data:`LOOPS`) and ``use_cache`` (None: what the loop leaves it at) describe a
    ``framework="hf"`` job (:func:`.hf.loop_settings`).

    The docstring under each field is its description in the JSON schema (``oomdoctor schema plan estimate``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    tp: int = 1
    """tensor-parallel size"""
    pp: int = 1
    """pipeline-parallel size"""
    dp: int = 1
    """data-parallel size"""
    cp: int = 1
    """context-parallel size"""
    ep: int = 1
    """expert-parallel size"""
    vpp: int = 1
    """virtual pipeline stages per rank"""
    schedule: str = "1f1b"
    """the pipeline schedule (1f1b, interleaved, gpipe, zero-bubble, zbv)"""
    sequence_parallel: bool = False
    """Megatron sequence parallelism"""
    dp_sharding: str = "zero1"
    """none, zero1, zero2, zero3 or fsdp"""
    recompute: str = "none"
    """none, selective or full"""
    recompute_layers: int | None = None
    """layers per stage fully recomputed (null: all)"""
    cpu_offload_optimizer: bool = False
    """optimizer state in CPU memory"""
    return_outputs: bool = False
    """torch.distributed.pipelining step(return_outputs=True)"""
    framework: str = "megatron"
    """megatron or hf"""
    expandable_segments: bool = False
    """expandable_segments:True"""
    loop: str = "plain"
    """the training loop (framework hf)"""
    use_cache: bool | None = None
    """the config builds a KV cache in forward (null: what the loop leaves it at)"""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def label(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        parts.append(f"DP{self.dp}")
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        if self.sequence_parallel:
            parts.append("SP")
        if self.dp_sharding not in ("none", "zero1"):
            parts.append(self.dp_sharding.upper() if self.dp_sharding != "fsdp" else "FSDP")
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        return " ".join(parts)


def num_microbatches(train: TrainingSpec, plan: ParallelPlan) -> int:
    """``global_batch / (micro_batch × dp)`` (gradient-accumulation steps); raises when not whole."""
    per = train.micro_batch * plan.dp
    if train.global_batch % per:
        raise PlanError(f"global batch {train.global_batch} is not a multiple of micro_batch({train.micro_batch}) "
                        f"* dp({plan.dp}) = {per}")
    return train.global_batch // per


def validate(model: ModelSpec, train: TrainingSpec, plan: ParallelPlan, gpus: int | None = None) -> int:
    """Check the combination; return the number of micro-batches per step.

    Raises:
        PlanError: with the failing arithmetic, e.g. ``tp(8) * pp(4) * dp(2) * cp(1) = 64 != gpus(32)``.
    """
    if plan.schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {plan.schedule!r}: one of {', '.join(SCHEDULES)}")
    if plan.recompute not in RECOMPUTE:
        raise PlanError(f"unknown recompute {plan.recompute!r}: one of {', '.join(RECOMPUTE)}")
    if plan.dp_sharding not in DP_SHARDING:
        raise PlanError(f"unknown data-parallel sharding {plan.dp_sharding!r}: one of {', '.join(DP_SHARDING)}")
    for name in ("tp", "pp", "dp", "cp", "ep", "vpp"):
        if getattr(plan, name) < 1:
            raise PlanError(f"{name}({getattr(plan, name)}) must be at least 1")
    if gpus is not None and plan.world_size != gpus:
        raise PlanError(f"tp({plan.tp}) * pp({plan.pp}) * dp({plan.dp}) * cp({plan.cp}) = {plan.world_size} "
                        f"!= gpus({gpus})")
    if model.num_heads % plan.tp:
        raise PlanError(f"num_heads({model.num_heads}) % tp({plan.tp}) = {model.num_heads % plan.tp}: heads must "
                        "split evenly across tensor-parallel ranks")
    if model.num_kv_heads % plan.tp and plan.tp % model.num_kv_heads:
        raise PlanError(f"num_kv_heads({model.num_kv_heads}) and tp({plan.tp}) must divide one another")
    chunks = plan.pp * plan.vpp
    if model.num_layers % chunks:
        raise PlanError(f"num_layers({model.num_layers}) % (pp({plan.pp}) * vpp({plan.vpp})) = "
                        f"{model.num_layers % chunks}: every model chunk needs the same number of layers")
    if plan.vpp > 1 and plan.schedule not in ("interleaved", "zbv"):
        raise PlanError(f"vpp({plan.vpp}) > 1 needs schedule 'interleaved' (or 'zbv'), not {plan.schedule!r}")
    if plan.schedule == "zbv" and plan.vpp != 2:
        raise PlanError(f"schedule 'zbv' places exactly 2 chunks per rank: vpp({plan.vpp}) != 2")
    if plan.sequence_parallel and plan.tp == 1:
        raise PlanError("sequence_parallel needs tp > 1 (it shards along the tensor-parallel group)")
    if train.seq_len % plan.cp:
        raise PlanError(f"seq_len({train.seq_len}) % cp({plan.cp}) = {train.seq_len % plan.cp}")
    if plan.ep > 1 and (model.num_experts == 0 or model.num_experts % plan.ep):
        raise PlanError(f"ep({plan.ep}) needs num_experts({model.num_experts}) to be a multiple of it")
    if plan.cpu_offload_optimizer and plan.pp > 1 and plan.framework == "megatron":
        raise PlanError(f"CPU offloading with pp({plan.pp}) > 1 is not supported by Megatron-LM "
                        "('Currently there is no support for Pipeline parallelism with CPU offloading')")
    m = num_microbatches(train, plan)
    if plan.schedule == "interleaved" and plan.vpp > 1 and m % plan.pp:
        raise PlanError(f"interleaved 1F1B needs micro-batches({m}) to be a multiple of pp({plan.pp}) "
                        "(Megatron-LM schedules.py)")
    if plan.recompute_layers is not None and not 0 <= plan.recompute_layers <= model.num_layers // plan.pp:
        raise PlanError(f"recompute_layers({plan.recompute_layers}) must be within 0..{model.num_layers // plan.pp} "
                        "(the layers of one stage)")
    return m


# -- presets and Hugging Face configs -------------------------------------------------------------

PRESETS: dict[str, ModelSpec] = {
    # Llama 3 / 3.1 (Meta, arXiv:2407.21783 Table 3; HF config.json of meta-llama/Meta-Llama-3*)
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 14336, 32, 8, 128256, family="llama"),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 28672, 64, 8, 128256, family="llama"),
    "llama3-405b": ModelSpec("llama3-405b", 126, 16384, 53248, 128, 8, 128256, family="llama"),
    "llama2-7b": ModelSpec("llama2-7b", 32, 4096, 11008, 32, 32, 32000, family="llama"),
    "mistral-7b": ModelSpec("mistral-7b", 32, 4096, 14336, 32, 8, 32000, family="mistral"),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 28, 3584, 18944, 28, 4, 152064, bias=True, family="qwen2"),
    "mixtral-8x7b": ModelSpec("mixtral-8x7b", 32, 4096, 14336, 32, 8, 32000, num_experts=8, experts_per_token=2,
                                  family="mixtral"),
    "gpt2": ModelSpec("gpt2", 12, 768, 3072, 12, 12, 50257, tied_embeddings=True, gated_mlp=False, bias=True,
                      norm="layernorm", learned_positions=1024, family="gpt2", activation="gelu_new", dropout=True),
    "gpt2-medium": ModelSpec("gpt2-medium", 24, 1024, 4096, 16, 16, 50257, tied_embeddings=True, gated_mlp=False,
                             bias=True, norm="layernorm", learned_positions=1024, family="gpt2",
                             activation="gelu_new", dropout=True),
}


#: The largest value a model size field (width, heads, layers, vocabulary, experts) may have: 2^31.
MAX_SIZE_FIELD = 1 << 31


def _get(cfg: dict[str, Any], path: str, *names: str, default: Any = None, required: bool = True) -> Any:
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    if required and default is None:
        raise PlanError(f"{path}: missing {' / '.join(names)} (a Hugging Face config.json of a decoder-only model)")
    return default


def from_hf_config(path: str | Path) -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face ``config.json`` (Llama, Mistral, Qwen2, Mixtral, GPT-2,
    GPT-NeoX field names).

    Raises:
        PlanError: unreadable file, not JSON, or a missing or malformed size field (named).
    """
    p = Path(path)
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise PlanError(f"{p}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise PlanError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{p}: a config.json must be a JSON object")
    src = str(p)
    archs = cfg.get("architectures")
    arch = " ".join(map(str, archs if isinstance(archs, list) else [])) + " " + str(cfg.get("model_type", ""))
    gpt2 = "gpt2" in arch.lower() or "GPT2" in arch
    neox = "neox" in arch.lower()
    def count(value: Any, field: str, least: int = 1) -> int:
        """A size field as an integer in [``least``, :data:`MAX_SIZE_FIELD`]; anything else (text, a
        fraction, NaN, a bool, 1e154) is named."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (
                float("inf"), float("-inf")) or value != int(value) or not least <= value <= MAX_SIZE_FIELD:
            raise PlanError(f"{src}: {field} must be a whole number in [{least}, {MAX_SIZE_FIELD}], got {value!r}")
        return int(value)

    def size(*names: str, default: Any = None, required: bool = True, least: int = 1) -> int:
        return count(_get(cfg, src, *names, default=default, required=required), names[0], least)

    hidden = size("hidden_size", "n_embd", "d_model")
    heads = size("num_attention_heads", "n_head")
    layers = size("num_hidden_layers", "n_layer")
    ffn = size("intermediate_size", "n_inner", default=4 * hidden, required=False) if cfg.get(
        "intermediate_size") or cfg.get("n_inner") else 4 * hidden
    kv = size("num_key_value_heads", default=heads, required=False)
    vocab = size("vocab_size")
    experts = size("num_local_experts", "num_experts", "n_routed_experts", default=0, required=False, least=0)
    ffn_moe = count(cfg["moe_intermediate_size"], "moe_intermediate_size") if cfg.get("moe_intermediate_size") \
        else ffn
    if heads % kv:
        raise PlanError(f"{src}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")
    gated = not (gpt2 or neox)
    return ModelSpec(
        name=str(cfg.get("_name_or_path") or cfg.get("model_type") or p.parent.name or "model"),
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn_moe if experts else ffn, num_heads=heads,
        num_kv_heads=kv, vocab_size=vocab,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", gpt2)), gated_mlp=gated,
        bias=gpt2 or neox or bool(cfg.get("attention_bias", False)),
        norm="layernorm" if (gpt2 or neox) else "rmsnorm",
        learned_positions=count(cfg.get("n_positions") or cfg.get("max_position_embeddings") or 0, "n_positions", 0)
        if gpt2 else 0,
        num_experts=experts, experts_per_token=count(cfg.get("num_experts_per_tok") or 0, "num_experts_per_tok", 0),
        shared_experts=count(cfg.get("n_shared_experts") or 0, "n_shared_experts", 0),
        family="gpt2" if gpt2 else _family(cfg),
        activation=str(cfg.get("activation_function") or cfg.get("hidden_act") or ("gelu_new" if gpt2 else "")),
        use_cache=cfg.get("use_cache") is not False,
        dropout=_dropout(cfg, gpt2))


_DROPOUT_FIELDS = ("resid_pdrop", "embd_pdrop", "hidden_dropout", "hidden_dropout_prob")


def _dropout(cfg: dict[str, Any], gpt2: bool) -> bool:
    """Whether the residual / embedding dropout is on: a field above 0, or, with none given, the config
    class's default (``GPT2Config``: 0.1; Llama-family configs have no such dropout)."""
    given = [cfg[k] for k in _DROPOUT_FIELDS if k in cfg]
    if not given:
        return gpt2
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in given)


def _family(cfg: dict[str, Any]) -> str:
    """The ``model_type``, else the first architecture without its head (``LlamaForCausalLM`` -> llama)."""
    if isinstance(cfg.get("model_type"), str) and cfg["model_type"]:
        return cfg["model_type"].lower()
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return re.sub(r"(ForCausalLM|LMHeadModel|Model)$", "", archs[0]).lower()
    return ""


def model_spec(name_or_path: str) -> ModelSpec:
    """A preset by name (see :data:`PRESETS`) or a ``config.json`` path."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path.endswith(".json") or Path(name_or_path).exists():
        p = Path(name_or_path)
        return from_hf_config(p / "config.json" if p.is_dir() else p)
    raise PlanError(f"unknown model {name_or_path!r}: a config.json path or one of {', '.join(sorted(PRESETS))}")


def padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by × tp``
    (``megatron/training/tokenizer/tokenizer.py`` ``_vocab_size_with_padding``, default 128)."""
    m = multiple * tp
    return int(math.ceil(vocab / m) * m)


