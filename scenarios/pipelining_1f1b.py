"""``torch.distributed.pipelining`` with ``Schedule1F1B`` on 2 GPUs, as its tutorial builds it: one
``PipelineStage`` per rank, a decoder of ``torch.nn.TransformerEncoderLayer`` split in two, the LM head and
loss on the last stage, AdamW per stage, bf16 weights.

Nothing in it knows about oomdoctor (run it under ``oomdoctor run``)::

    torchrun --nproc_per_node=2 scenarios/pipelining_1f1b.py --micro-batch-size 4 --micro-batches 8 \
        [--ground-truth FILE]      # rank 0 writes FILE, rank 1 FILE with .rank1 before .json

``step(..., return_outputs=False)`` (PyTorch >= 2.10) so that the last stage does not keep every
micro-batch's logits (seed 003): what is left is the schedule itself: stage 0 keeps the activations of
two micro-batches awaiting their backward (1F1B's warm-up is one forward per later stage), stage 1 one.
"""

from __future__ import annotations

import argparse
import inspect
import os

import torch
import torch.nn as nn
from _truth import GroundTruth
from torch.distributed.pipelining import PipelineStage, Schedule1F1B


class Stage(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, first: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d) if first else None
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 16, 4 * d, batch_first=True) for _ in range(layers))
        self.norm = None if first else nn.LayerNorm(d)
        self.head = None if first else nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x)
        for layer in self.layers:
            x = layer(x)
        return x if self.head is None else self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--micro-batch-size", "--batch", type=int, default=4, dest="batch")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4, help="per stage")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--ground-truth")
    a = p.parse_args()
    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    torch.distributed.init_process_group("nccl", device_id=dev)
    torch.manual_seed(0)
    mod = Stage(a.vocab, a.width, a.layers, rank == 0).to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-4)
    path = a.ground_truth if rank == 0 or not a.ground_truth else a.ground_truth.replace(".json", f".rank{rank}.json")
    truth = GroundTruth(path, batch=a.batch, micro_batches=a.micro_batches, schedule="1F1B", seq=a.seq,
                        stage=rank, framework="torch.distributed.pipelining").install()
    stage = PipelineStage(mod, stage_index=rank, num_stages=2, device=dev)
    sched = Schedule1F1B(stage, n_microbatches=a.micro_batches, loss_fn=loss_fn)
    kw = {"return_outputs": False} if "return_outputs" in inspect.signature(sched.step).parameters else {}
    g = torch.Generator().manual_seed(0)
    try:
        for _ in range(a.steps):
            ids = torch.randint(0, a.vocab, (a.micro_batches * a.batch, a.seq), generator=g).to(dev)
            if rank == 0:
                sched.step(ids, **kw)
            else:
                sched.step(target=ids, losses=[], **kw)
            opt.step()
            opt.zero_grad()
        torch.distributed.barrier()
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        raise
    finally:
        truth.write()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
