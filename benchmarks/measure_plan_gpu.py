"""Measure ``max_reserved`` of a small Llama-3-style model under torchtitan-like FSDP2 / TP / PP on
2-4 GPUs, and compare it with ``oomdoctor plan estimate`` for the same configuration.

The model follows torchtitan's Llama 3 (``torchtitan/models/llama3/model/model.py``): RMSNorm,
complex-valued RoPE, GQA via ``repeat_kv`` and ``scaled_dot_product_attention``, SwiGLU, untied output.
Its dimensions are Llama 3.2 1B's (16 layers, h 2048, FFN 8192, 32 heads, 8 KV heads, vocabulary 128256),
1.50e9 parameters with the untied output. The parallelisms follow torchtitan's ``parallelize.py``:

- FSDP2: ``fully_shard`` per block, the embedding, the output, and the root, ``MixedPrecisionPolicy(bf16,
  fp32 reduce)``; ``reshard_after_forward=False`` under PP;
- TP: torchtitan's plan (sequence parallel norms, colwise wq/wk/wv/w1/w3, rowwise wo/w2, loss parallel);
- PP: ``torch.distributed.pipelining`` 1F1B, ``step(return_outputs=...)``; the stages split the layers evenly;
- full activation checkpointing: ``checkpoint_wrapper`` (non-reentrant) per block.

Data is random token ids; AdamW (foreach); each run trains ``--steps`` steps. The memory is read with
``torch.cuda.max_memory_reserved`` / ``max_memory_allocated`` since the model was built (meta device,
then ``to_empty``), and device use as ``total - free`` from ``cudaMemGetInfo`` at the end.

Run on a machine with 4 GPUs (2 for the 2-GPU configurations)::

    python benchmarks/measure_plan_gpu.py run --json docs/plan_gpu.json

``run`` starts one ``torchrun`` per configuration (``worker`` is what each rank runs) and writes the
measured and predicted bytes per rank; ``compare FILE`` recomputes the predictions for a saved run
(no GPU needed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 128256, 2048, 8192, 16, 32, 8


@dataclass(frozen=True)
class Config:
    """One measured run. ``local_batch`` sequences per data-parallel rank per step, in micro-batches of
    ``micro_batch`` (only PP splits them)."""

    name: str
    gpus: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    seq: int = 4096
    local_batch: int = 1
    micro_batch: int = 1
    ac: str = "none"  # "none" or "full"
    return_outputs: bool = False
    schedule: str = "1f1b"  # "1f1b" or "gpipe" (PP only)

    @property
    def microbatches(self) -> int:
        return self.local_batch // self.micro_batch


CONFIGS = [
    Config("fsdp4", 4, dp=4, local_batch=2, micro_batch=2),
    Config("fsdp4-ac", 4, dp=4, local_batch=4, micro_batch=4, ac="full"),
    Config("fsdp2-tp2", 4, dp=2, tp=2, local_batch=2, micro_batch=2),
    Config("pp2-fsdp2", 4, dp=2, pp=2, local_batch=8, ac="full"),
    Config("pp2-fsdp2-outputs", 4, dp=2, pp=2, local_batch=8, ac="full", return_outputs=True),
    Config("pp2-fsdp2-noac", 4, dp=2, pp=2, local_batch=8),
    Config("pp2-fsdp2-gpipe", 4, dp=2, pp=2, local_batch=8, ac="full", schedule="gpipe"),
    Config("fsdp2", 2, dp=2, local_batch=2, micro_batch=2),
    Config("tp2", 2, tp=2, dp=1, local_batch=2, micro_batch=2),
]
BY_NAME = {c.name: c for c in CONFIGS}


# -- the model (torchtitan Llama 3, trimmed) ---------------------------------------------------------


def build_model(torch, nn, F):
    def precompute_freqs_cis(dim: int, end: int, theta: float = 500000.0):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        t = torch.arange(end, device=freqs.device, dtype=torch.float32)
        return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))

    def apply_rotary_emb(xq, xk, freqs_cis):
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        fc = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
        return (torch.view_as_real(xq_ * fc).flatten(3).type_as(xq),
                torch.view_as_real(xk_ * fc).flatten(3).type_as(xk))

    def repeat_kv(x, n_rep: int):
        bs, slen, n_kv, hd = x.shape
        if n_rep == 1:
            return x
        return x[:, :, :, None, :].expand(bs, slen, n_kv, n_rep, hd).reshape(bs, slen, n_kv * n_rep, hd)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.head_dim = HIDDEN // HEADS
            self.wq = nn.Linear(HIDDEN, HEADS * self.head_dim, bias=False)
            self.wk = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias=False)
            self.wv = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias=False)
            self.wo = nn.Linear(HEADS * self.head_dim, HIDDEN, bias=False)

        def forward(self, x, freqs_cis):
            bs, seqlen, _ = x.shape
            xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)   # -1: local heads under TP
            xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
            xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
            xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
            rep = xq.shape[2] // xk.shape[2]
            xk, xv = repeat_kv(xk, rep), repeat_kv(xv, rep)
            out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                                 is_causal=True)
            return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(HIDDEN, FFN, bias=False)
            self.w2 = nn.Linear(FFN, HIDDEN, bias=False)
            self.w3 = nn.Linear(HIDDEN, FFN, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm = nn.RMSNorm(HIDDEN, eps=1e-5)
            self.attention = Attention()
            self.ffn_norm = nn.RMSNorm(HIDDEN, eps=1e-5)
            self.feed_forward = FeedForward()

        def forward(self, x, freqs_cis):
            h = x + self.attention(self.attention_norm(x), freqs_cis)
            return h + self.feed_forward(self.ffn_norm(h))

    class Transformer(nn.Module):
        def __init__(self, seq: int):
            super().__init__()
            self.seq = seq
            self.tok_embeddings = nn.Embedding(VOCAB, HIDDEN)
            self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
            self.norm = nn.RMSNorm(HIDDEN, eps=1e-5)
            self.output = nn.Linear(HIDDEN, VOCAB, bias=False)
            self.register_buffer("freqs_cis", torch.empty(seq, HIDDEN // HEADS // 2, dtype=torch.complex64),
                                 persistent=False)

        def init_weights(self):
            with torch.no_grad():
                self.freqs_cis.copy_(precompute_freqs_cis(HIDDEN // HEADS, self.seq).to(self.freqs_cis.device))
                for p in self.parameters():
                    if p.dim() > 1:
                        nn.init.normal_(p, std=0.02)
                    else:
                        nn.init.ones_(p)

        def forward(self, tokens):
            h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
            for layer in self.layers.values():
                h = layer(h, self.freqs_cis)
            h = self.norm(h) if self.norm is not None else h
            return self.output(h) if self.output is not None else h

    return Transformer


# -- one rank ----------------------------------------------------------------------------------------


def worker(cfg: Config, out_dir: Path, steps: int, snapshot: Path | None = None) -> None:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    torch.distributed.init_process_group("nccl", device_id=dev)
    mesh = init_device_mesh("cuda", (cfg.pp, cfg.dp, cfg.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()

    Transformer = build_model(torch, nn, F)
    with torch.device("meta"):
        model = Transformer(cfg.seq)
    per = LAYERS // cfg.pp
    if cfg.pp > 1:  # keep this stage's layers (torchtitan pipeline_module_split)
        for i in range(LAYERS):
            if not pp_rank * per <= i < (pp_rank + 1) * per:
                del model.layers[str(i)]
        if pp_rank != 0:
            model.tok_embeddings = None
        if pp_rank != cfg.pp - 1:
            model.norm = None
            model.output = None

    if cfg.tp > 1:
        tp_mesh = mesh["tp"]
        top = {}
        if model.tok_embeddings is not None:
            top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        if model.output is not None:
            top["norm"] = SequenceParallel()
            top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
        parallelize_module(model, tp_mesh, top)
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            })
    if cfg.ac == "full":
        for k in list(model.layers.keys()):
            model.layers[k] = checkpoint_wrapper(model.layers[k], preserve_rng_state=False)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.dp > 1:
        dp_mesh = mesh["dp"]
        reshard = cfg.pp == 1
        if model.tok_embeddings is not None:
            fully_shard(model.tok_embeddings, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
        for i, block in enumerate(model.layers.values()):
            last = i == len(model.layers) - 1
            fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard and not last)
        if model.output is not None:
            fully_shard([model.norm, model.output], mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    model.to_empty(device=dev)
    model.init_weights()
    # no FSDP mixed precision without FSDP: autocast, as torchtitan's maybe_enable_amp
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cfg.dp == 1 else contextlib.nullcontext()
    params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())  # this rank's shards
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()

    def loss_fn(pred, labels):
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))

    g = torch.Generator(device=dev).manual_seed(1234 + dp_rank)
    per_step = []
    if snapshot is not None:  # oomdoctor's own recorder: one snapshot per rank
        import oomdoctor
        recorder = oomdoctor.record(str(snapshot)).start()
    if cfg.pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        stage = PipelineStage(model, pp_rank, cfg.pp, dev, group=mesh["pp"].get_group())
        schedule_cls = ScheduleGPipe if cfg.schedule == "gpipe" else Schedule1F1B
        sched = schedule_cls(stage, n_microbatches=cfg.microbatches, loss_fn=loss_fn)
    for _ in range(steps):
        tokens = torch.randint(VOCAB, (cfg.local_batch, cfg.seq), device=dev, generator=g)
        labels = torch.randint(VOCAB, (cfg.local_batch, cfg.seq), device=dev, generator=g)
        opt.zero_grad(set_to_none=True)
        if cfg.pp > 1:
            kw = {"return_outputs": cfg.return_outputs}
            if pp_rank == 0:
                sched.step(tokens, **kw)
            elif pp_rank == cfg.pp - 1:
                sched.step(target=labels, losses=[], **kw)
            else:
                sched.step(**kw)
        else:
            with amp:
                pred = model(tokens)
            if cfg.tp > 1:
                with loss_parallel():
                    loss = loss_fn(pred, labels)
                    del pred
                    loss.backward()
            else:
                loss = loss_fn(pred, labels)
                del pred
                loss.backward()
        opt.step()
        torch.cuda.synchronize()
        per_step.append(torch.cuda.max_memory_reserved())
        if snapshot is not None:
            recorder.step()
    if snapshot is not None:
        recorder.stop()
    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    rec = {"config": cfg.name, "rank": rank, "pp_rank": pp_rank, "dp_rank": dp_rank,
           "tp_rank": mesh["tp"].get_local_rank(), "local_params": params,
           "max_reserved_bytes": torch.cuda.max_memory_reserved(), "max_allocated_bytes": torch.cuda.max_memory_allocated(),
           "reserved_after_step": per_step, "device_used_bytes": total - free, "gpu_total_bytes": total,
           "num_alloc_retries": stats.get("num_alloc_retries", 0), "num_ooms": stats.get("num_ooms", 0),
           "torch_version": torch.__version__, "gpu_name": torch.cuda.get_device_name(dev)}
    (out_dir / f"{cfg.name}.rank{rank}.json").write_text(json.dumps(rec))
    torch.distributed.destroy_process_group()


def probe(seq: int, batch: int) -> dict:
    """Bytes one bf16 block saves for backward (distinct storages, via ``saved_tensors_hooks``) and the
    peak above the logits' own bytes while cross-entropy runs forward and backward, per logit."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    dev = torch.device("cuda", 0)
    Transformer = build_model(torch, nn, F)
    with torch.device("meta"):
        model = Transformer(seq)
    model.to_empty(device=dev)
    model.init_weights()
    block = model.layers["0"].to(torch.bfloat16)
    x = torch.randn(batch, seq, HIDDEN, device=dev, dtype=torch.bfloat16, requires_grad=True)
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x, model.freqs_cis)
    saved = sum(seen.values()) - x.untyped_storage().nbytes() * (x.untyped_storage().data_ptr() in seen)
    del y
    n = batch * seq
    logits = torch.randn(batch, seq, VOCAB, device=dev, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(VOCAB, (batch, seq), device=dev)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1)).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    sbh, sbf = n * HIDDEN, n * FFN
    return {"seq": seq, "batch": batch, "block_saved_bytes": saved, "block_saved_storages": len(seen),
            "sbh": sbh, "sbf": sbf, "loss_peak_bytes_above_logits": peak, "logits": n * VOCAB,
            "loss_peak_bytes_per_logit": peak / (n * VOCAB)}


def overhead(out_dir: Path) -> None:
    """Device memory outside the caching allocator, step by step, on each rank (``total - free`` from
    ``cudaMemGetInfo`` minus ``memory_reserved``): after CUDA init, after the first GEMM and SDPA (cuBLAS,
    kernels), after the world communicator's first all-reduce, and after each of two more groups'."""
    import torch
    import torch.nn.functional as F

    rank, local, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)

    def outside() -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free - torch.cuda.memory_reserved()

    steps = {}
    torch.zeros(1, device=dev)
    steps["cuda_init"] = outside()
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    (a @ a).sum().item()
    q = torch.randn(1, 32, 4096, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    steps["after_gemm_and_sdpa"] = outside()
    torch.distributed.init_process_group("nccl", device_id=dev)
    x = torch.ones(1 << 20, device=dev)
    torch.distributed.all_reduce(x)
    steps["after_world_allreduce"] = outside()
    for i in range(2):
        g = torch.distributed.new_group(list(range(world)))
        torch.distributed.all_reduce(x, group=g)
        steps[f"after_group_{i + 1}_allreduce"] = outside()
    (out_dir / f"overhead.rank{rank}.json").write_text(json.dumps({"rank": rank, "world_size": world,
                                                                  "outside_allocator_bytes": steps}))
    torch.distributed.destroy_process_group()


# -- prediction ---------------------------------------------------------------------------------------


def predict(cfg: Config) -> dict[int, dict]:
    """``oomdoctor.plan`` estimate of each pipeline stage for ``cfg``: {stage: bytes}."""
    sys.path.insert(0, str(ROOT / "src"))
    from oomdoctor.plan.estimate import estimate
    from oomdoctor.plan.specs import ModelSpec, ParallelPlan, TrainingSpec

    model = ModelSpec("llama3.2-1b-untied", LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB)
    train = TrainingSpec(seq_len=cfg.seq, global_batch=cfg.local_batch * cfg.dp, micro_batch=cfg.micro_batch,
                         grad_bytes=4)
    plan = ParallelPlan(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, sequence_parallel=cfg.tp > 1, schedule=cfg.schedule,
                        dp_sharding="fsdp" if cfg.dp > 1 else "none",
                        recompute="full" if cfg.ac == "full" else "none", return_outputs=cfg.return_outputs,
                        framework="torch")
    est = estimate(model, train, plan)
    return {s.stage: {"allocated": s.allocated_bytes, "reserved": s.reserved_bytes, "device": s.device_bytes,
                      "parameters": s.parameters, "terms": s.terms} for s in est.stages}


def compare(records: list[dict]) -> dict:
    """Measured vs predicted per rank; errors are (predicted - measured) / measured of max_reserved."""
    rows = []
    for rec in sorted(records, key=lambda r: ([c.name for c in CONFIGS].index(r["config"]), r["rank"])):
        cfg = BY_NAME[rec["config"]]
        p = predict(cfg)[rec["pp_rank"]]
        rows.append({"config": cfg.name, "rank": rec["rank"], "stage": rec["pp_rank"], "plan": asdict(cfg),
                     "measured_reserved_bytes": rec["max_reserved_bytes"],
                     "predicted_reserved_bytes": p["reserved"],
                     "reserved_error": (p["reserved"] - rec["max_reserved_bytes"]) / rec["max_reserved_bytes"],
                     "measured_allocated_bytes": rec["max_allocated_bytes"],
                     "predicted_allocated_bytes": p["allocated"],
                     "allocated_error": (p["allocated"] - rec["max_allocated_bytes"]) / rec["max_allocated_bytes"],
                     "measured_device_bytes": rec["device_used_bytes"], "predicted_device_bytes": p["device"],
                     "local_params": rec["local_params"], "predicted_parameters": p["parameters"],
                     "terms": p["terms"], "num_alloc_retries": rec["num_alloc_retries"]})
    res = [abs(r["reserved_error"]) for r in rows]
    alloc = [abs(r["allocated_error"]) for r in rows]
    return {"rows": rows, "environment": {k: records[0][k] for k in ("torch_version", "gpu_name", "gpu_total_bytes")},
            "median_abs_reserved_error": statistics.median(res), "max_abs_reserved_error": max(res),
            "median_abs_allocated_error": statistics.median(alloc), "max_abs_allocated_error": max(alloc)}


def print_table(result: dict) -> None:
    g = 2**30
    print(f"{'config':<20} {'rank':>4} {'stage':>5} {'reserved meas':>13} {'pred':>7} {'err':>7} "
          f"{'alloc meas':>10} {'pred':>7} {'err':>7}")
    for r in result["rows"]:
        print(f"{r['config']:<20} {r['rank']:>4} {r['stage']:>5} {r['measured_reserved_bytes'] / g:>11.2f}Gi "
              f"{r['predicted_reserved_bytes'] / g:>7.2f} {r['reserved_error']:>+7.1%} "
              f"{r['measured_allocated_bytes'] / g:>8.2f}Gi {r['predicted_allocated_bytes'] / g:>7.2f} "
              f"{r['allocated_error']:>+7.1%}")
    print(f"|error| of max_reserved: median {result['median_abs_reserved_error']:.1%}, "
          f"max {result['max_abs_reserved_error']:.1%}; of max_allocated: median "
          f"{result['median_abs_allocated_error']:.1%}, max {result['max_abs_allocated_error']:.1%}")


def run(names: list[str], steps: int, gpus_available: int, save: Path | None) -> list[dict]:
    """Run each configuration under torchrun; the records so far are saved to ``save`` after each."""
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            cfg = BY_NAME[name]
            if cfg.gpus > gpus_available:
                print(f"skip {name}: needs {cfg.gpus} GPUs", file=sys.stderr)
                continue
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc_per_node={cfg.gpus}", __file__, "worker", "--config", name,
                                   "--out", tmp, "--steps", str(steps)], env=env, capture_output=True, text=True,
                                  timeout=600)
            if proc.returncode:
                print(f"{name}: exit {proc.returncode}\n{proc.stderr[-4000:]}", file=sys.stderr)
                continue
            for p in sorted(Path(tmp).glob(f"{name}.rank*.json")):
                records.append(json.loads(p.read_text()))
            if save:
                save.write_text(json.dumps({"records": records}, indent=1) + "\n")
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--config", required=True, choices=sorted(BY_NAME))
    w.add_argument("--out", required=True, type=Path)
    w.add_argument("--steps", type=int, default=3)
    w.add_argument("--snapshot", type=Path, help="record each rank's memory snapshot here (oomdoctor.record)")
    pr = sub.add_parser("probe", help="bytes one block saves for backward, and the loss's peak per logit (1 GPU)")
    pr.add_argument("--seq", type=int, default=4096)
    pr.add_argument("--batch", type=int, default=2)
    o = sub.add_parser("overhead", help="memory outside the allocator: context, kernels, NCCL (under torchrun)")
    o.add_argument("--out", required=True, type=Path)
    r = sub.add_parser("run")
    r.add_argument("--config", action="append", choices=sorted(BY_NAME), help="default: all")
    r.add_argument("--steps", type=int, default=3)
    r.add_argument("--json", type=Path, help="write measured + predicted rows here")
    c = sub.add_parser("compare")
    c.add_argument("file", type=Path, help="a --json file written by run")
    c.add_argument("--json", type=Path, help="write its records with today's predictions here")
    a = ap.parse_args()
    if a.cmd == "worker":
        worker(BY_NAME[a.config], a.out, a.steps, a.snapshot)
        return 0
    if a.cmd == "overhead":
        overhead(a.out)
        return 0
    if a.cmd == "probe":
        print(json.dumps(probe(a.seq, a.batch), indent=1))
        return 0
    if a.cmd == "compare":
        saved = json.loads(a.file.read_text())
        result = compare(saved["records"])
        print_table(result)
        if a.json:
            a.json.write_text(json.dumps({"records": saved["records"], **result}, indent=1) + "\n")
        return 0
    import torch
    records = run(a.config or [c.name for c in CONFIGS], a.steps, torch.cuda.device_count(), a.json)
    if not records:
        print("no configuration ran", file=sys.stderr)
        return 1
    result = compare(records)
    print_table(result)
    if a.json:
        a.json.write_text(json.dumps({"records": records, **result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
