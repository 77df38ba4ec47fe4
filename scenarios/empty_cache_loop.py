"""A training loop that calls ``torch.cuda.empty_cache()`` after every step, a habit copied from forum
answers: the cache is handed back to the driver and ``cudaMalloc``-ed again at the next step. Healthy (it
never runs out), only slower.

Nothing in it knows about oomdoctor (run it under ``oomdoctor run``)::

    python scenarios/empty_cache_loop.py --batch 16 --steps 12 [--ground-truth FILE]

The decoder of ``own_optimizer.py`` (1024 wide, 8 layers), AdamW, bf16 autocast, sequence 1024; the job
times its steps (``step_s``: wall seconds per step after a synchronize).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
from _truth import GroundTruth
from own_optimizer import Decoder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--ground-truth")
    a = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = Decoder(32000, 1024, 8).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    truth = GroundTruth(a.ground_truth, batch=a.batch, seq=a.seq, framework="plain").install()
    g = torch.Generator().manual_seed(0)
    times = []
    try:
        for _ in range(a.steps):
            t0 = time.perf_counter()
            ids = torch.randint(0, 32000, (a.batch, a.seq), generator=g).to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids)
                loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            del logits, loss
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            times.append(round(time.perf_counter() - t0, 4))
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        raise
    finally:
        truth.write(step_s=times, num_alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries"))


if __name__ == "__main__":
    main()
