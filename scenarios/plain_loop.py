"""A plain training loop on one GPU, as users write it, with no recording code: the second job of the
recording-overhead benchmark (``benchmarks/bench_recording_modes.py``), run plain and under ``oomdoctor run``.

GPT-2 124M (transformers, random init; 12 layers, 768 wide, 50,257 vocabulary), bf16 autocast, fused AdamW,
micro-batch 8 x 1024 tokens, random tokens made on the host and copied each step.

    python scenarios/plain_loop.py --steps 40 --times FILE   # FILE: the wall time at every step's end (after a sync)
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--times")
    a = p.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = GPT2LMHeadModel(GPT2Config(n_positions=a.seq)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(0)
    ends = []
    for _ in range(a.steps):
        ids = torch.randint(0, 50257, (a.batch, a.seq), generator=g).to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        ends.append(time.perf_counter())
    if a.times:
        with open(a.times, "w") as f:
            json.dump({"step_end_s": ends}, f)


if __name__ == "__main__":
    main()
