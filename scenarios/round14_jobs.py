"""The kinds of job issue 49 asks to record (items 1, 4 and 5), small enough that a run takes seconds on one H200 under a
``torch.cuda.set_per_process_memory_fraction`` cap (``--cap-gib``), so that where they run out is set by the cap, not
by the GPU. Nothing here knows about oomdoctor (``benchmarks/device/round14_calib.sh`` runs them under
``oomdoctor run``); each writes its ground truth (``scenarios/_truth.py``) and exits 1 on an out-of-memory error it
did not handle::

    python scenarios/round14_jobs.py --kind moco-bank --batch 64 --cap-gib 12 [--ground-truth FILE]
    python scenarios/round14_jobs.py --kind moco-bank --probe 16:512 --cap-gib 12   # in one process: largest that ran
    python scenarios/round14_jobs.py --kind moco-bank --batch 4 --cpu               # a dry run of the code, tiny shapes

Kinds (their halves: ``docs/corpus/round14_split.json``, committed before any was recorded):

- ``llama-256k-first-backward``: ``LlamaForCausalLM`` with a 256,000-token vocabulary (2 layers, 256 wide), seq 512,
  bf16 autocast, AdamW: the fp32 logits and their gradient dominate, and the first OOM comes in the first backward;
- ``moco-bank``: MoCo v2-style contrastive training: a query encoder, a momentum key encoder (no gradients), a memory
  bank ``queue`` of 128 x ``--bank`` (a registered buffer, 2 GiB by default) and ``l_neg = q @ queue.clone().detach()``
  every step (MoCo's reference code clones it): the bank and its clone do not grow with the batch, the logits do;
- ``kept-exception-retry``: a plain loop whose step at ``--batch`` runs out of memory; it catches the error and
  retries at half the batch *inside* the ``except`` block (``--retry inside``, the exception keeps the failed
  attempt's activations), or after leaving it (``--retry outside``);
- ``stage0-1f1b``: stage 0 of a 2-stage 1F1B schedule, one process: the first half of a decoder (embedding and
  ``--layers`` blocks); stage 1 is stood in for by a random gradient of the stage's output; each step runs
  ``--micro-batches`` micro-batches 1F1B (stage 0 of 2 holds two in flight: one warm-up forward, then a forward and
  a backward in turn);
- ``moe-edge``: decoder blocks whose MLP is a top-2 mixture of 8 experts (tokens gathered per expert with
  ``index_select``, so how many each expert gets varies from batch to batch), seq 512;
- ``optimizer-step-oom``: a stack of wide linears whose fp32 parameters and gradients fit under the cap but not Adam's
  two moments besides: the OOM is inside ``optimizer.step()`` at any batch (``--optimizer sgd``: SGD with momentum,
  one state; ``--optimizer adam``: Adam);
- ``varlen-llama-cap``: a Llama-shaped decoder (4 layers, 1024 wide) fine-tuned on batches of random lengths (128 to
  2048, seeded) under a cap of ``--cap-ratio`` x the peak allocated of a longest-length step, measured first
  (``shared/lab/frag_dynamic.py``'s construction): fragmentation, no pipeline.

2-GPU kinds (``torchrun --nproc_per_node=2``, the 2-GPU call of the device script): ``fsdp2-ac-edge`` (FSDP2
``fully_shard`` per block with ``checkpoint_wrapper`` activation checkpointing, GPT-like decoder) and
``stage0-1f1b-real`` (``torch.distributed.pipelining`` ``Schedule1F1B`` over 2 ranks, rank 0 capped so stage 0 runs
out first).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _truth import GroundTruth  # noqa: E402

GiB = 1 << 30


# --------------------------------------------------------------------------- shared pieces


class Block(nn.Module):
    """A pre-norm decoder block (causal attention through SDPA, GELU MLP or a given MLP)."""

    def __init__(self, d: int, heads: int, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.heads = heads
        self.mlp = mlp if mlp is not None else nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.n2(x))


class MoE(nn.Module):
    """Top-2 routing over ``experts`` GELU MLPs; tokens gathered per expert (sizes vary with the batch's routing)."""

    def __init__(self, d: int, experts: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                     for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.router(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                y = expert(x.index_select(0, tok)) * w[tok, slot].unsqueeze(-1)
                out = out.index_add(0, tok, y)
        return out.reshape(shape)


class Decoder(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, moe: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, MoE(d) if moe else None) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def lm_step(model, opt, ids: torch.Tensor, dev: torch.device) -> float:
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


# --------------------------------------------------------------------------- the kinds: build(a, dev) -> step(batch)


def llama_256k(a, dev):
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 4096 if a.cpu else 256_000
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64 if a.cpu else 256, intermediate_size=128 if a.cpu else 768,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=a.seq)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)

    def step(batch: int) -> None:
        ids = torch.randint(0, vocab, (batch, a.seq), generator=g).to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, opt, model


class MoCo(nn.Module):
    """Query and momentum key encoders (MLPs on flattened 3x32x32 images), and the memory bank: ``queue`` [dim, K]."""

    def __init__(self, feat: int, dim: int, bank: int) -> None:
        super().__init__()
        self.q = nn.Sequential(nn.Linear(feat, 2048), nn.ReLU(), nn.Linear(2048, dim))
        self.k = nn.Sequential(nn.Linear(feat, 2048), nn.ReLU(), nn.Linear(2048, dim))
        self.k.load_state_dict(self.q.state_dict())
        for p in self.k.parameters():
            p.requires_grad_(False)
        self.register_buffer("queue", F.normalize(torch.randn(dim, bank), dim=0))
        self.ptr = 0

    def forward(self, x_q: torch.Tensor, x_k: torch.Tensor) -> torch.Tensor:
        q = F.normalize(self.q(x_q), dim=1)
        with torch.no_grad():
            for pk, pq in zip(self.k.parameters(), self.q.parameters()):
                pk.mul_(0.999).add_(pq.detach(), alpha=0.001)
            k = F.normalize(self.k(x_k), dim=1)
        l_pos = (q * k).sum(1, keepdim=True)
        l_neg = q @ self.queue.clone().detach()  # MoCo's reference code: a copy of the bank every step
        logits = torch.cat([l_pos, l_neg], dim=1) / 0.07
        n = k.shape[0]
        end = min(self.ptr + n, self.queue.shape[1])
        self.queue[:, self.ptr:end] = k[: end - self.ptr].T
        self.ptr = end % self.queue.shape[1]
        return F.cross_entropy(logits, torch.zeros(n, dtype=torch.long, device=logits.device))


def moco_bank(a, dev):
    bank = 4096 if a.cpu else a.bank
    with torch.device(dev):
        model = MoCo(3 * 32 * 32, 128, bank)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.03, momentum=0.9)
    g = torch.Generator().manual_seed(0)

    def step(batch: int) -> None:
        x = torch.randn(batch, 3 * 32 * 32, generator=g).to(dev)
        loss = model(x, x + 0.1 * torch.randn_like(x))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, opt, model


def decoder_job(a, dev, moe: bool = False, d: int = 1024, layers: int = 4):
    vocab = 32_000
    if a.cpu:
        d, layers, vocab = 64, 2, 512
    with torch.device(dev):
        model = Decoder(vocab, d, layers, max(d // 64, 1), moe=moe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)

    def step(batch: int, seq: int | None = None) -> None:
        ids = torch.randint(0, vocab, (batch, seq or a.seq), generator=g).to(dev)
        lm_step(model, opt, ids, dev)
    return step, opt, model


def kept_exception(a, dev):
    step, opt, model = decoder_job(a, dev)

    def run(batch: int) -> None:
        try:
            step(batch)
        except torch.OutOfMemoryError as e:
            print(f"caught: {str(e).splitlines()[0][:120]}", flush=True)
            if a.retry == "inside":
                step(max(batch // 2, 1))  # the exception (and its traceback's frames) still alive here
                return
            failed = True
        else:
            return
        if failed:
            step(max(batch // 2, 1))  # after the except block: the exception was cleared
    return run, opt, model


def stage0_1f1b(a, dev):
    d, layers, vocab = (64, 2, 512) if a.cpu else (1024, a.layers, 32_000)
    with torch.device(dev):
        emb = nn.Embedding(vocab, d)
        blocks = nn.ModuleList(Block(d, max(d // 64, 1)) for _ in range(layers))
    params = list(emb.parameters()) + list(blocks.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)

    def forward(ids):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            x = emb(ids)
            for blk in blocks:
                x = blk(x)
        return x

    def step(batch: int) -> None:
        """One step of 1F1B as stage 0 of 2 runs it: warm-up forward, then forward and backward in turn, then the
        last backward; the backward's incoming gradient is stage 1's, stood in for by a random tensor."""
        in_flight = []
        for m in range(a.micro_batches):
            ids = torch.randint(0, vocab, (batch, a.seq), generator=g).to(dev)
            in_flight.append(forward(ids))
            if len(in_flight) == 2:  # stage 0 of 2: two micro-batches in flight before each backward
                out = in_flight.pop(0)
                out.backward(torch.randn_like(out))
        for out in in_flight:
            out.backward(torch.randn_like(out))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, opt, None


def optimizer_step_oom(a, dev):
    width, layers = (64, 2) if a.cpu else (a.width, a.layers)
    with torch.device(dev):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = (torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9) if a.optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(0)

    def step(batch: int) -> None:
        x = torch.randn(batch, width, generator=g).to(dev)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, opt, model


def varlen_llama(a, dev):
    step, opt, model = decoder_job(a, dev)
    g = torch.Generator().manual_seed(1234)
    top = 256 if a.cpu else 2048

    def run(batch: int) -> None:
        seq = int(torch.randint(2, top // 64 + 1, (1,), generator=g)) * 64
        step(batch, seq)
    # the cap: a longest-length step's peak allocated times --cap-ratio (shared/lab/frag_dynamic.py)
    if dev.type == "cuda":
        for _ in range(2):
            step(a.batch, top)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        a.cap_gib = peak * a.cap_ratio / GiB
    return run, opt, model


KINDS = {
    "decoder": decoder_job,  # kept-exception-retry's decoder without the retry: where it runs out
    "llama-256k-first-backward": llama_256k,
    "moco-bank": moco_bank,
    "kept-exception-retry": kept_exception,
    "stage0-1f1b": stage0_1f1b,
    "moe-edge": lambda a, dev: decoder_job(a, dev, moe=True, d=768, layers=4),
    "optimizer-step-oom": optimizer_step_oom,
    "varlen-llama-cap": varlen_llama,
}


# --------------------------------------------------------------------------- the 2-GPU kinds


def fsdp2_ac_edge(a) -> int:
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    cap(a)
    truth = GroundTruth(a.ground_truth, batch=a.batch, seq=a.seq, kind=a.kind, cap_bytes=int(a.cap_gib * GiB)).install()
    with torch.device(dev):
        model = Decoder(32_000, 1024, 8, 16)
    for i, blk in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(blk)
        fully_shard(model.blocks[i])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    rc = 0
    try:
        for _ in range(a.steps):
            lm_step(model, opt, torch.randint(0, 32_000, (a.batch, a.seq), generator=g).to(dev), dev)
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        rc = 1
    truth.write()
    dist.destroy_process_group()
    return rc


def stage0_1f1b_real(a) -> int:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    if rank == 0:
        cap(a)  # stage 0 runs out first
    truth = GroundTruth(a.ground_truth, batch=a.batch, seq=a.seq, kind=a.kind, stage=rank).install()
    d, vocab = 1024, 32_000
    with torch.device(dev):
        if rank == 0:
            stage_mod = nn.Sequential(nn.Embedding(vocab, d), *[Block(d, 16) for _ in range(a.layers)])
        else:
            stage_mod = nn.Sequential(*[Block(d, 16) for _ in range(a.layers)], nn.LayerNorm(d),
                                      nn.Linear(d, vocab, bias=False))
    stage = PipelineStage(stage_mod, rank, world, dev)
    sched = Schedule1F1B(stage, n_microbatches=a.micro_batches,
                         loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1).float(), y.flatten()))
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    rc = 0
    try:
        for _ in range(a.steps):
            ids = torch.randint(0, vocab, (a.batch * a.micro_batches, a.seq), generator=g).to(dev)
            if rank == 0:
                sched.step(ids)
            else:
                sched.step(target=ids)
            opt.step()
            opt.zero_grad(set_to_none=True)
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        rc = 1
    truth.write()
    dist.destroy_process_group()
    return rc


# --------------------------------------------------------------------------- driver


def cap(a) -> None:
    if a.cap_gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(a.cap_gib * GiB / total, 1.0))


def probe(a, step) -> int:
    """In one process: the largest batch of ``--probe LO:HI`` that runs ``--steps`` steps (doubling from LO, then
    bisection), as a first guess the device script confirms in fresh processes."""
    lo_s, hi_s = a.probe.split(":")
    lo, hi = int(lo_s), int(hi_s)

    def ok(b: int) -> bool:
        try:
            for _ in range(a.steps):
                step(b)
            return True
        except torch.OutOfMemoryError:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return False
    good, bad = 0, None
    b = lo
    while b <= hi and ok(b):
        good, b = b, b * 2
    bad = min(b, hi + 1)
    while bad - good > max(1, math.ceil(good * a.probe_step)):
        mid = (good + bad) // 2
        good, bad = (mid, bad) if ok(mid) else (good, mid)
    print(json.dumps({"probe": a.kind, "largest_ran": good, "first_oom": bad}), flush=True)
    return good


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", required=True, choices=(*KINDS, "fsdp2-ac-edge", "stage0-1f1b-real"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--cap-gib", type=float, default=12.0)
    p.add_argument("--cap-ratio", type=float, default=1.10, help="varlen-llama-cap: the cap over a longest step's peak")
    p.add_argument("--bank", type=int, default=4 * 1024 * 1024, help="moco-bank: the bank's entries (128 floats each)")
    p.add_argument("--retry", choices=("inside", "outside"), default="inside")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=8192)
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--probe", help="LO:HI: find the largest batch that runs, in this process")
    p.add_argument("--probe-step", type=float, default=0.02, help="stop bisecting within this fraction")
    p.add_argument("--ground-truth")
    p.add_argument("--cpu", action="store_true", help="tiny shapes, no GPU, no cap: a dry run of the code")
    a = p.parse_args()
    if a.kind == "fsdp2-ac-edge":
        return fsdp2_ac_edge(a)
    if a.kind == "stage0-1f1b-real":
        return stage0_1f1b_real(a)
    dev = torch.device("cpu" if a.cpu else "cuda")
    torch.manual_seed(0)
    if not a.cpu and a.kind != "varlen-llama-cap":
        cap(a)
    step, _opt, _model = KINDS[a.kind](a, dev)
    if not a.cpu and a.kind == "varlen-llama-cap":
        cap(a)
    truth = GroundTruth(a.ground_truth, batch=a.batch, seq=a.seq, kind=a.kind, cap_bytes=int(a.cap_gib * GiB),
                        retry=a.retry if a.kind == "kept-exception-retry" else None,
                        optimizer=a.optimizer if a.kind == "optimizer-step-oom" else None)
    if not a.cpu:
        truth.install()
    if a.probe:
        got = probe(a, step)
        truth.write(largest_ran=got)
        return 0
    rc = 0
    try:
        for _ in range(a.steps if a.kind != "varlen-llama-cap" else max(a.steps, 30)):
            step(a.batch)
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        rc = 1
    truth.write()
    return rc


if __name__ == "__main__":
    sys.exit(main())
