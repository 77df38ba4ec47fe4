"""Step-time overhead of recording (default settings) and the dump time, on one GPU.

A realistic training step: a 12-layer pre-norm LM (d=2048, 32,000 vocabulary, ~0.7 B parameters),
AdamW, bf16 autocast, batch 8 x 2048. Blocks of steps alternate off / on (recording with
``oomdoctor.record``'s defaults: Python stacks, 100,000-entry ring buffer) so drift hits both;
each step is timed on the host between two ``torch.cuda.synchronize()`` calls.

    python benchmarks/bench_capture_overhead.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scenarios"))
from _common import LM, lm_loss  # noqa: E402

from oomdoctor.capture.recorder import DEFAULT_MAX_ENTRIES  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = LM(32000, 2048, 12).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 32000, (8, 2048), device=dev)

    def step() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lm_loss(model(ids), ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    times = {"off": [], "on": []}
    for b in range(a.blocks):
        for mode in (("off", "on") if b % 2 == 0 else ("on", "off")):
            if mode == "on":
                torch.cuda.memory._record_memory_history("all", context="all", stacks="python",
                                                         max_entries=DEFAULT_MAX_ENTRIES)
            times[mode].extend(step() for _ in range(a.steps))
            if mode == "on":
                torch.cuda.memory._record_memory_history(None)
    # the dump: snapshot + pickle + atomic write, with a full ring buffer's worth of recent history
    torch.cuda.memory._record_memory_history("all", context="all", stacks="python", max_entries=DEFAULT_MAX_ENTRIES)
    for _ in range(a.steps):
        step()
    from oomdoctor.capture.files import atomic_write_bytes
    t0 = time.perf_counter()
    snap = torch.cuda.memory._snapshot()
    t1 = time.perf_counter()
    data = pickle.dumps(snap)
    with tempfile.TemporaryDirectory() as d:
        atomic_write_bytes(os.path.join(d, "rank0.pickle"), data)
    t2 = time.perf_counter()
    torch.cuda.memory._record_memory_history(None)
    events = sum(len(t) for t in snap["device_traces"])
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "parameters": sum(p.numel() for p in model.parameters()),
           "steps_per_mode": len(times["off"]), "median_step_s": med,
           "mean_step_s": {k: statistics.mean(v) for k, v in times.items()},
           "overhead_ratio_median": med["on"] / med["off"],
           "snapshot_s": t1 - t0, "pickle_and_write_s": t2 - t1, "dump_bytes": len(data), "dump_events": events,
           "events_per_step": events / a.steps, "step_times": times}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps({k: v for k, v in res.items() if k != "step_times"}, indent=2))


if __name__ == "__main__":
    main()
