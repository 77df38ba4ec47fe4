"""What PyTorch's allocator history costs per event, and per step of a CPU-bound training step, measured in one process.

Issue 38 item 3: recording a Hugging Face Trainer DDP job costs about +2.5% of the median step with our default
(``--stack-steps 3/10``), and most steps of that default record every allocator event without a stack
(``context=None``). Between-run noise on the device (about ±3% per run) hides a cost of that size, so this script
measures it inside one process, where the modes alternate in short blocks and are compared block by block:

- ``events``: a loop of ``torch.empty`` / ``del`` on the current stream (three allocator events each: ``alloc``,
  ``free_requested``, ``free_completed``; sizes cycle over four small-pool sizes so no ``cudaMalloc`` happens after
  the first round). Gives the cost of one event, in ns, per mode.
- ``step``: a CPU-bound training step (GPT-2 124M, micro-batch ``--batch`` x ``--seq``, bf16 autocast, AdamW,
  as ``scenarios/plain_loop.py``): the step time per mode, and the allocator events per step.

Modes (``torch.cuda.memory._record_memory_history``, ``max_entries`` 100,000 as our recorder):

- ``off``: history disabled;
- ``nostack``: ``enabled="all", context=None`` (what our default records in every step but the stacked ones);
- ``stacks``: ``enabled="all", context="alloc", stacks="python"`` (a stacked step; ``--stack-steps all``);
- ``skipreq``: ``nostack`` with ``skip_actions=["free_requested"]`` (torch >= 2.9; fewer events per free).

Turning history off clears its buffer (``recordHistory`` in ``c10/cuda/CUDACachingAllocator.cpp``), so every block
starts from an empty ring buffer; ``--fill`` first fills it (a wrapped buffer, as in a long job).

    python benchmarks/bench_record_event_cost.py --json OUT.json [--blocks 8] [--block-steps 10]

Prints one line per measurement and writes the raw block times to ``--json``. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

MAX_ENTRIES = 100_000
MODES = ("off", "nostack", "stacks", "skipreq")


def set_mode(mode: str) -> None:
    mem = torch.cuda.memory
    mem._record_memory_history(None)  # clears the buffer (and its stacks)
    if mode == "off":
        return
    kw = {"context": None if mode in ("nostack", "skipreq") else "alloc", "stacks": "python",
          "max_entries": MAX_ENTRIES}
    if mode == "skipreq":
        kw["skip_actions"] = ["free_requested"]
    mem._record_memory_history("all", **kw)


def fill_buffer() -> None:
    """Fill the ring buffer past max_entries, so that later events overwrite old ones."""
    for i in range(MAX_ENTRIES // 3 + 10):
        x = torch.empty(256 * (1 + i % 4), device="cuda")
        del x


def blocks(modes: list[str], n: int, fill: bool):
    """``n`` rounds of every mode, the order rotating each round; each mode is switched on (its ring buffer filled
    first with ``fill``) before it is yielded."""
    for b in range(n):
        for m in modes[b % len(modes):] + modes[:b % len(modes)]:
            set_mode(m)
            if fill and m != "off":
                fill_buffer()
            yield m


def events_block(n: int) -> float:
    sizes = [256, 1024, 4096, 16384]
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for i in range(n):
        x = torch.empty(sizes[i & 3], device="cuda")
        del x
    t1 = time.perf_counter_ns()
    return (t1 - t0) / n  # ns per iteration (3 events)


def count_events(fn) -> int:
    set_mode("nostack")
    fn()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    dev = torch.cuda.current_device()
    n = len(snap["device_traces"][dev])
    set_mode("off")
    return n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--blocks", type=int, default=8, help="blocks per mode, modes rotating")
    p.add_argument("--iters", type=int, default=20000, help="empty/del pairs per events block")
    p.add_argument("--block-steps", type=int, default=10, help="training steps per step block")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--fill", action="store_true", help="fill the ring buffer before each block")
    p.add_argument("--modes", default=",".join(MODES))
    a = p.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    out: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "fill": a.fill,
                 "max_entries": MAX_ENTRIES, "events": {m: [] for m in modes}, "step": {m: [] for m in modes}}
    torch.cuda.init()
    events_block(2000)  # warm the small pool
    for m in blocks(modes, a.blocks, a.fill):
        out["events"][m].append(events_block(a.iters))
    set_mode("off")
    base = statistics.median(out["events"]["off"]) if "off" in modes else None
    for m in modes:
        med = statistics.median(out["events"][m])
        extra = "" if base is None else f"  +{(med - base) / 3:.0f} ns per event over off"
        print(f"events {m:8s} {med:8.0f} ns per empty/del (3 events){extra}", flush=True)

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=a.seq)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(0)

    def step() -> None:
        ids = torch.randint(0, 50257, (a.batch, a.seq), generator=g).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    out["events_per_step"] = count_events(step)
    for m in blocks(modes, a.blocks, a.fill):
        step()  # one step unmeasured after the switch
        times = []
        for _ in range(a.block_steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out["step"][m].append(statistics.median(times))
    set_mode("off")
    print(f"step: {out['events_per_step']} allocator events per step", flush=True)
    base = statistics.median(out["step"]["off"]) if "off" in modes else None
    for m in modes:
        med = statistics.median(out["step"][m])
        extra = ""
        if base is not None and m != "off":
            paired = [s / o - 1 for s, o in zip(out["step"][m], out["step"]["off"])]
            extra = (f"  {100 * (med / base - 1):+.2f}% over off (paired blocks: median "
                     f"{100 * statistics.median(paired):+.2f}%, each {', '.join(f'{100 * x:+.1f}' for x in paired)})")
        print(f"step   {m:8s} {1000 * med:8.2f} ms{extra}", flush=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
