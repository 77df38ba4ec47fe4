"""A pipeline schedule on one GPU in plain PyTorch: the model cut into stages (modules), micro-batches in flight.

Each stage's input is detached and made a leaf, as a stage receives it from its neighbour; a micro-batch's
backward runs stage by stage in reverse with the gradient of the next stage's input, as pipeline runtimes
do (``torch.distributed.pipelining`` ``stage_backward``, Megatron's ``backward_step``). Nothing in it knows
about oomdoctor (run it under ``oomdoctor run``)::

    python scenarios/pipeline_single.py --schedule gpipe --micro-batches 8 --micro-batch-size 8 \
        [--ground-truth FILE]

- ``gpipe`` (Huang et al. 2019, arXiv:1811.06965): every micro-batch's forward, then every backward: all M
  micro-batches' activations are held at once.
- ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021, arXiv:2006.09503): as many forwards as there are
  stages, then one backward per forward: at most S micro-batches in flight.

A decoder of ``torch.nn.TransformerEncoderLayer`` (1024 wide, 16 heads), 2 layers per stage, 4 stages, a
32,000-word head on the last; bf16 autocast over fp32 weights; AdamW steps once per batch of M micro-batches.
"""

from __future__ import annotations

import argparse
from collections import deque

import torch
import torch.nn as nn
from _truth import GroundTruth


class Stage(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, first: bool, last: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d) if first else None
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 16, 4 * d, batch_first=True, norm_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


def forward(stages: list[Stage], ids: torch.Tensor, dev: torch.device) -> tuple[list, torch.Tensor]:
    """One micro-batch through every stage: the (input, output) pairs each stage keeps, and the loss."""
    kept, x = [], ids
    for s in stages:
        inp = x.detach().requires_grad_(x.is_floating_point())
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            out = s(inp)
        kept.append((inp, out))
        x = out
    loss = nn.functional.cross_entropy(x[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    return kept, loss


def backward(kept: list, loss: torch.Tensor, micro_batches: int) -> None:
    """Stage by stage in reverse, each with the gradient of the next stage's input."""
    grad = None
    for inp, out in reversed(kept):
        if grad is None:
            (loss / micro_batches).backward()
        else:
            out.backward(grad)
        grad = inp.grad


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch-size", "--batch", type=int, default=4, dest="batch")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--ground-truth")
    p.add_argument("--cpu", action="store_true", help="tiny dry run without a GPU")
    a = p.parse_args()
    dev = torch.device("cpu" if a.cpu else "cuda")
    torch.manual_seed(0)
    vocab, d = (500, 64) if a.cpu else (32000, 1024)
    stages = [Stage(vocab, d, 2, i == 0, i == a.stages - 1).to(dev) for i in range(a.stages)]
    opt = torch.optim.AdamW([q for s in stages for q in s.parameters()], lr=1e-4)
    truth = GroundTruth(a.ground_truth, batch=a.batch, micro_batches=a.micro_batches, schedule=a.schedule,
                        stages=a.stages, seq=a.seq, framework="plain")
    if not a.cpu:
        truth.install()
    g = torch.Generator().manual_seed(0)
    try:
        for _ in range(a.steps):
            batches = [torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(dev) for _ in range(a.micro_batches)]
            in_flight: deque = deque()
            for ids in batches:
                in_flight.append(forward(stages, ids, dev))
                if a.schedule == "1f1b" and len(in_flight) >= a.stages:
                    backward(*in_flight.popleft(), a.micro_batches)
            while in_flight:
                backward(*in_flight.popleft(), a.micro_batches)
            opt.step()
            opt.zero_grad()
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        raise
    finally:
        truth.write()


if __name__ == "__main__":
    main()
