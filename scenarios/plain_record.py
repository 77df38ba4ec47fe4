"""A job that records its own memory the way PyTorch's docs show it, with no oomdoctor anywhere:
``torch.cuda.memory._record_memory_history(max_entries=100000)`` at the start (every other setting left at its
default: stacks and contexts of allocations and frees, C++ frames included) and
``torch.cuda.memory._dump_snapshot(PATH)`` at the end; no sidecar. Past a few hundred steps' worth of events
the 100,000-entry ring buffer has wrapped.

    python scenarios/plain_record.py --model gpt2 --steps 40 --snapshot OUT.pickle [--ground-truth FILE]

- ``--model gpt2``: transformers' GPT-2 124M (random init), bf16 autocast, fused AdamW, sequence 1024.
- ``--model resnet50``: torchvision's ResNet-50, SGD with momentum 0.9 and weight decay, 224x224 random images,
  channels-last, bf16 autocast.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from _truth import GroundTruth


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("gpt2", "resnet50"), required=True)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--snapshot", required=True)
    p.add_argument("--ground-truth")
    a = p.parse_args()
    torch.cuda.memory._record_memory_history(max_entries=100000)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    if a.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config()).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        from torchvision.models import resnet50

        model = resnet50().to(dev, memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    truth = GroundTruth(a.ground_truth, batch=a.batch, steps=a.steps, model=a.model, framework="plain").install()
    g = torch.Generator().manual_seed(0)
    try:
        for _ in range(a.steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if a.model == "gpt2":
                    ids = torch.randint(0, 50257, (a.batch, 1024), generator=g).to(dev)
                    loss = model(input_ids=ids, labels=ids).loss
                else:
                    x = torch.randn(a.batch, 3, 224, 224, generator=g).to(dev, memory_format=torch.channels_last)
                    y = torch.randint(0, 1000, (a.batch,), generator=g).to(dev)
                    loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        raise
    finally:
        truth.write()
        torch.cuda.memory._dump_snapshot(a.snapshot)


if __name__ == "__main__":
    main()
