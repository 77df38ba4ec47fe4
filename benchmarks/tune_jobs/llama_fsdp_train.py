"""A ~1B Llama-shaped decoder trained under torchrun with knobs, for ``oomdoctor tune --nproc-per-node 2 -- torchrun
--nproc_per_node=2 benchmarks/tune_jobs/llama_fsdp_train.py --bs {mb} --ga {ga} --shard {shard} --ac {ac}``
(benchmarks/device/round14_tune.sh): plain PyTorch (RMSNorm, causal SDPA, SwiGLU; dim 2048, 16 layers, 16 heads,
FFN 5632, vocab 32000, untied head: 0.95B parameters), random weights and tokens.

- ``--shard ddp``: DistributedDataParallel, bf16 autocast over fp32 weights;
- ``--shard full``: FSDP2 ``fully_shard`` of every block and the root, ``reshard_after_forward=True`` (ZeRO-3-like),
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
- ``--shard noreshard``: the same with ``reshard_after_forward=False`` (parameters kept gathered between forward and
  backward: ZeRO-2-like);
- ``--ac full``: every block checkpointed (non-reentrant).

AdamW (foreach), gradient accumulation ``--ga`` (FSDP2 reduce-scatters each micro-batch; DDP syncs on the last).
Trains until stopped."""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

p = argparse.ArgumentParser()
p.add_argument("--bs", type=int, required=True)
p.add_argument("--ga", type=int, default=1)
p.add_argument("--seq", type=int, default=2048)
p.add_argument("--shard", default="full", choices=["ddp", "full", "noreshard"])
p.add_argument("--ac", default="none", choices=["none", "full"])
p.add_argument("--dim", type=int, default=2048)
p.add_argument("--layers", type=int, default=16)
p.add_argument("--heads", type=int, default=16)
p.add_argument("--ffn", type=int, default=5632)
p.add_argument("--vocab", type=int, default=32000)
p.add_argument("--steps", type=int, default=1_000_000)
a = p.parse_args()


class Block(nn.Module):
    def __init__(self, d, h, f):
        super().__init__()
        self.h = h
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.w1, self.w3, self.w2 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        y = self.n2(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(a.vocab, a.dim)
        self.blocks = nn.ModuleList([Block(a.dim, a.heads, a.ffn) for _ in range(a.layers)])
        self.norm, self.head = nn.RMSNorm(a.dim), nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if a.ac == "full" else blk(x)
        return self.head(self.norm(x))


dist.init_process_group("nccl")
local = int(os.environ.get("LOCAL_RANK", "0"))
torch.cuda.set_device(local)
torch.manual_seed(0)
with torch.device("cuda"):
    model = Llama()
if a.shard == "ddp":
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local])
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
else:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp, reshard_after_forward=a.shard == "full")
    fully_shard(model, mp_policy=mp, reshard_after_forward=a.shard == "full")
    autocast = contextlib.nullcontext
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(a.steps):
    for i in range(a.ga):
        ids = torch.randint(0, a.vocab, (a.bs, a.seq), device="cuda")
        sync = contextlib.nullcontext() if a.shard != "ddp" or i == a.ga - 1 else model.no_sync()
        with sync:
            with autocast():
                logits = model(ids)
                loss = F.cross_entropy(logits.float().view(-1, a.vocab), ids.view(-1)) / a.ga
            del logits
            loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
