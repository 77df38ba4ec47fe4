"""``oomdoctor plan estimate|search|validate``: memory per rank before the job runs."""

from __future__ import annotations

import re
from dataclasses import replace

import click

from ..errors import UsageError
from ..plan.estimate import estimate
from ..plan.gpus import GPUS, gpu_by_name
from ..plan.search import search
from ..plan.specs import (
    DP_SHARDING,
    FRAMEWORKS,
    LOOPS,
    RECOMPUTE,
    SCHEDULES,
    Hardware,
    ParallelPlan,
    TrainingSpec,
    model_spec,
)
from ..plan.validate import validate_csv
from ..render.protocol import formats
from .output import OUTPUT, emit

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(GB|GiB|G)?\s*$", re.IGNORECASE)


def parse_memory(text: str) -> int:
    """``80`` or ``80GB`` (10^9 bytes), ``80GiB`` (2^30 bytes)."""
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"bad GPU memory {text!r}: a number of GB (1e9 bytes) or with a unit: 80GB, 80GiB")
    unit = (m.group(2) or "GB").lower()
    return int(float(m.group(1)) * (2**30 if unit == "gib" else 10**9))


def _common(f):
    opts = [
        click.option("--model", "model", required=True, help="A preset (llama3-8b, llama3-70b, ...) or a Hugging "
                     "Face config.json."),
        click.option("--seq", "seq_len", type=int, default=4096, show_default=True, help="Sequence length."),
        click.option("--gbs", "global_batch", type=int, default=32, show_default=True, help="Global batch (sequences)."),
        click.option("--mbs", "micro_batch", type=int, default=1, show_default=True, help="Micro-batch size."),
        click.option("--grad-dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
                     help="Gradient dtype (Megatron grad_reduce_in_fp32)."),
        click.option("--fp8", is_flag=True, help="FP8 linear layers (inputs saved in 1 byte)."),
        click.option("--no-flash", is_flag=True, help="Unfused attention (s^2 scores saved)."),
        click.option("--dropout", is_flag=True, help="Dropout on (1-byte masks saved)."),
        click.option("--fused-ce", is_flag=True, help="Fused cross-entropy."),
        click.option("--gpu", type=click.Choice(sorted(g.lower() for g in GPUS)), default="h100-80gb",
                     show_default=True),
        click.option("--gpus", type=int, required=True, help="Number of GPUs."),
        click.option("--gpu-memory", help="Override the GPU memory: 80GB or 80GiB."),
        click.option("--gpus-per-node", type=int, default=8, show_default=True),
        click.option("--inter-node-gbps", type=float, default=50.0, show_default=True,
                     help="Network bandwidth per GPU, GB/s."),
        click.option("--sharding", type=click.Choice(DP_SHARDING), default="zero1", show_default=True,
                     help="Data-parallel sharding (zero1 = Megatron's distributed optimizer)."),
        click.option("--framework", type=click.Choice(FRAMEWORKS), default="megatron", show_default=True,
                     help="megatron: Megatron-LM; torch: torchtitan-style PyTorch; hf: a transformers model in eager "
                     "PyTorch (GPT-2 / Llama family, DDP or FSDP; --recompute full = gradient_checkpointing)."),
        click.option("--loop", type=click.Choice(LOOPS), default="plain", show_default=True,
                     help="With --framework hf: the training loop (Trainer, accelerate, Lightning, plain PyTorch), "
                     "which decides autocast, bf16 weights, the copies of the logits and the KV cache."),
        click.option("--use-cache/--no-use-cache", "use_cache", default=None,
                     help="With --framework hf: whether the model builds its KV cache in training [default: off "
                     "under Trainer, else the config's use_cache]."),
        click.option("--return-outputs", is_flag=True, help="torch.distributed.pipelining step(return_outputs=True)."),
        click.option("--expandable-segments", is_flag=True, help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."),
        click.option("--format", "fmt", type=click.Choice(formats("plan estimate")), default="text",
                     show_default=True),
        click.option("-o", "--output", type=OUTPUT, help="Write to this file (- for standard output)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _specs(kw: dict) -> tuple:
    model = model_spec(kw["model"])
    train = TrainingSpec(seq_len=kw["seq_len"], global_batch=kw["global_batch"], micro_batch=kw["micro_batch"],
                         grad_bytes=4 if kw["grad_dtype"] == "fp32" else 2, fp8=kw["fp8"],
                         flash_attention=not kw["no_flash"], dropout=kw["dropout"], fused_cross_entropy=kw["fused_ce"])
    g = gpu_by_name(kw["gpu"])
    mem, flops, nvlink = g.total_bytes, g.bf16_flops, g.nvlink_bytes_per_s
    if kw["gpu_memory"]:
        mem = parse_memory(kw["gpu_memory"])
    hw = Hardware(kw["gpu"], mem, kw["gpus"], kw["gpus_per_node"], nvlink, kw["inter_node_gbps"] * 1e9, flops)
    base = ParallelPlan(dp_sharding=kw["sharding"], framework=kw["framework"], return_outputs=kw["return_outputs"],
                        expandable_segments=kw["expandable_segments"], loop=kw["loop"], use_cache=kw["use_cache"])
    return model, train, hw, base


@click.group("plan")
def command() -> None:
    """Predict per-rank peak memory of a training configuration, and search the parallel plans that fit."""


@command.command("estimate", short_help="Memory per pipeline stage of one plan, term by term.")
@_common
@click.option("--tp", type=int, default=1, show_default=True)
@click.option("--pp", type=int, default=1, show_default=True)
@click.option("--vpp", type=int, default=1, show_default=True, help="Virtual stages (model chunks) per rank.")
@click.option("--cp", type=int, default=1, show_default=True)
@click.option("--ep", type=int, default=1, show_default=True)
@click.option("--schedule", type=click.Choice(SCHEDULES), default=None,
              help="Pipeline schedule [default: interleaved with --vpp > 1, else 1f1b].")
@click.option("--sp/--no-sp", "sequence_parallel", default=None, help="Sequence parallel [default: on when tp > 1].")
@click.option("--recompute", type=click.Choice(RECOMPUTE), default="none", show_default=True)
@click.option("--recompute-layers", type=int, default=None, help="Layers per stage fully recomputed.")
def estimate_cmd(tp, pp, vpp, cp, ep, schedule, sequence_parallel, recompute, recompute_layers, **kw) -> None:
    """Memory per pipeline stage of one plan, term by term; the data-parallel size is the rest of the GPUs."""
    model, train, hw, base = _specs(kw)
    if hw.num_gpus % (tp * pp * cp):
        raise UsageError(f"tp({tp}) * pp({pp}) * cp({cp}) = {tp * pp * cp} does not divide gpus({hw.num_gpus}): "
                         "the data-parallel size must be whole")
    plan = replace(base, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, dp=hw.num_gpus // (tp * pp * cp),
                   schedule=schedule or ("interleaved" if vpp > 1 else "1f1b"),
                   sequence_parallel=tp > 1 if sequence_parallel is None else sequence_parallel,
                   recompute=recompute, recompute_layers=recompute_layers)
    e = estimate(model, train, plan, hw)
    emit(kw["output"], "plan estimate", kw["fmt"], e)


_PLAN_SPEC = re.compile(r"^(?:(tp|pp|vpp|cp)=?(\d+)[,\s]*)+$", re.IGNORECASE)


def parse_plan(text: str, base: ParallelPlan, gpus: int) -> ParallelPlan:
    """``tp4,pp8,vpp5`` (or ``tp=4 pp=8 vpp=5``) -> a plan, DP being the rest of the GPUs."""
    if not _PLAN_SPEC.match(text.strip()):
        raise UsageError(f"bad --plan {text!r}: like tp4,pp4,vpp5")
    vals = {k.lower(): int(v) for k, v in re.findall(r"(tp|pp|vpp|cp)=?(\d+)", text, re.IGNORECASE)}
    tp, pp, vpp, cp = vals.get("tp", 1), vals.get("pp", 1), vals.get("vpp", 1), vals.get("cp", 1)
    if gpus % (tp * pp * cp):
        raise UsageError(f"--plan {text!r}: tp({tp}) * pp({pp}) * cp({cp}) = {tp * pp * cp} does not divide "
                         f"gpus({gpus})")
    return replace(base, tp=tp, pp=pp, vpp=vpp, cp=cp, dp=gpus // (tp * pp * cp), sequence_parallel=tp > 1,
                   schedule="interleaved" if vpp > 1 else "1f1b")


@command.command("search", short_help="The parallel plans that fit, by modelled throughput.")
@_common
@click.option("--plan", "plans", multiple=True, help="Compare only these plans (repeatable): tp4,pp4,vpp5.")
@click.option("--top", type=int, default=15, show_default=True, help="Rows shown in the text table.")
def search_cmd(plans, top, **kw) -> None:
    """Enumerate TP x PP x VPP x recompute for the GPUs, drop what does not fit, rank by modelled throughput."""
    model, train, hw, base = _specs(kw)
    chosen = [parse_plan(p, base, hw.num_gpus) for p in plans] or None
    r = search(model, train, hw, base, plans=chosen)
    if not r.candidates:
        raise UsageError("no valid plan for these GPUs and this model (check --gpus, --gbs and --mbs)")
    emit(kw["output"], "plan search", kw["fmt"], r, limit=top)


@command.command("validate", short_help="Check against a Megatron-LM CI golden-memory CSV.")
@click.argument("csv_path", type=click.Path(dir_okay=False, path_type=str))
@click.option("--format", "fmt", type=click.Choice(formats("plan validate")), default="text", show_default=True)
@click.option("-o", "--output", type=OUTPUT, help="Write to this file (- for standard output).")
def validate_cmd(csv_path: str, fmt: str, output: str | None) -> None:
    """Predict each row of a Megatron-LM CI golden-memory CSV and report the errors on the GPT rows."""
    v = validate_csv(csv_path)
    emit(output, "plan validate", fmt, v)
