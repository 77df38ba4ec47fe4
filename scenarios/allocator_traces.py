"""Traces that exercise the allocator's rarer paths, recorded from CUDA init, for exact self-replay tests.

One GPU, one process per run (``PYTORCH_CUDA_ALLOC_CONF`` is read when CUDA starts)::

    python scenarios/allocator_traces.py --out traces/            # every run below, then calibrate first
    python scenarios/allocator_traces.py --out traces/ --only cap-gc0.8

``lm-*`` runs train the pre-norm LM of ``_common.py`` (6 layers, 1024 wide, vocabulary 32,000), AdamW, bf16
autocast, batch 8, sequence lengths drawn from 128..2048 (multiples of 64, seed 1234), 24 steps. A
calibration process measures the peak allocated of one step at the longest length; ``cap-*`` runs set
``torch.cuda.set_per_process_memory_fraction`` to 1.15 x that peak before anything is allocated, so the
allocator runs at its limit (``release_cached_blocks`` retries, and garbage collection where a
threshold is set). ``nocap-*`` runs have no cap (the expandable-segments what-if pair).
``graph-manual`` captures an MLP's forward and backward with ``torch.cuda.graph`` into a private pool,
replays it, frees the graph and empties the cache; ``compiled-ro`` trains the LM under
``torch.compile(mode="reduce-overhead")`` (cudagraph trees).

Every run records with ``oomdoctor.record`` (sidecar with the cap) and writes ``truth.json`` beside the
snapshot: ``torch.cuda.memory_stats()`` at the end, ``torch.cuda.mem_get_info()`` and the device's
``total_memory``, whether it ran out of memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

RUNS = {
    "cap-default": "",
    "cap-mss256": "max_split_size_mb:256",
    "cap-gc0.6": "garbage_collection_threshold:0.6",
    "cap-gc0.8": "garbage_collection_threshold:0.8",
    "cap-gc0.95": "garbage_collection_threshold:0.95",
    "cap-gc0.8-mss256": "garbage_collection_threshold:0.8,max_split_size_mb:256",
    "cap-gc0.6-mss128": "garbage_collection_threshold:0.6,max_split_size_mb:128",
    "cap-expandable": "expandable_segments:True",
    "nocap-default": "",
    "nocap-expandable": "expandable_segments:True",
    "graph-manual": "",
    "compiled-ro": "",
}
VOCAB, D, LAYERS, BATCH, MAX_SEQ, STEPS = 32000, 1024, 6, 8, 2048, 24


def lm_step(model, opt, seq, dev):
    from _common import lm_train_step
    lm_train_step(model, opt, VOCAB, BATCH, seq, dev)


def child(name: str, out: str, cap_bytes: int | None) -> None:
    import torch
    from _common import LM

    import oomdoctor
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    total = torch.cuda.get_device_properties(dev).total_memory
    if cap_bytes is not None and name.startswith("cap-"):
        torch.cuda.set_per_process_memory_fraction(cap_bytes / total, dev)
    torch.manual_seed(0)
    oom = False
    t0 = time.time()
    with oomdoctor.record(out, max_entries=2_000_000) as rec:
        try:
            if name == "graph-manual":
                graph_manual(dev)
            elif name == "compiled-ro":
                model = LM(VOCAB, D, 4).to(dev)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                cmodel = torch.compile(model, mode="reduce-overhead")
                from _common import lm_loss
                for _ in range(6):
                    ids = torch.randint(0, VOCAB, (4, 512), device=dev)
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        logits = cmodel(ids)
                    lm_loss(logits, ids).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    rec.step()
            else:
                model = LM(VOCAB, D, LAYERS).to(dev)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                g = torch.Generator().manual_seed(1234)
                for _ in range(STEPS):
                    seq = int(torch.randint(2, MAX_SEQ // 64 + 1, (1,), generator=g)) * 64
                    lm_step(model, opt, seq, dev)
                    rec.step()
        except torch.OutOfMemoryError:
            oom = True
        torch.cuda.synchronize()
    free, tot = torch.cuda.mem_get_info(dev)
    truth = {"run": name, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "cap_bytes": cap_bytes
             if name.startswith("cap-") else None, "memory_fraction": torch.cuda.get_per_process_memory_fraction(dev)
             if hasattr(torch.cuda, "get_per_process_memory_fraction") else None,
             "props_total_memory": int(total), "mem_get_info_total": int(tot), "mem_get_info_free": int(free),
             "oom": oom, "wall_s": round(time.time() - t0, 1), "torch": torch.__version__,
             "memory_stats": {k: v for k, v in torch.cuda.memory_stats(dev).items()
                              if k.startswith(("num_", "reserved_bytes.all", "allocated_bytes.all"))}}
    with open(os.path.join(out, "truth.json"), "w") as f:
        json.dump(truth, f, indent=1)
    print("RESULT", json.dumps(truth), flush=True)


def graph_manual(dev) -> None:
    """An MLP's training step captured with torch.cuda.graph (warm-up on a side stream as the docs
    say), replayed 5 times; then the graph is deleted and the cache emptied (its pool is released)."""
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(4096, 16384), torch.nn.GELU(), torch.nn.Linear(16384, 4096)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2048, 4096, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
    for _ in range(5):
        x.copy_(torch.randn(2048, 4096, device=dev))
        g.replay()
    eager = [torch.randn(1024, 1024 * k, device=dev) for k in range(1, 9)]  # default-pool traffic after capture
    del eager, loss
    del g
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    y = torch.randn(8192, 8192, device=dev)
    del y


def calibrate() -> int:
    import torch
    from _common import LM
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = LM(VOCAB, D, LAYERS).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        lm_step(model, opt, MAX_SEQ, dev)
    torch.cuda.synchronize()
    return int(1.15 * torch.cuda.max_memory_allocated(dev))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--only", action="append", choices=sorted(RUNS))
    p.add_argument("--child")
    p.add_argument("--cap-bytes", type=int)
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--timeout", type=int, default=240)
    a = p.parse_args()
    if a.calibrate:
        print("CAP", calibrate(), flush=True)
        return
    if a.child:
        child(a.child, a.out, a.cap_bytes)
        return
    me = os.path.abspath(__file__)
    out = subprocess.run([sys.executable, me, "--out", a.out, "--calibrate"], capture_output=True, text=True,
                         timeout=a.timeout)
    cap = int(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("CAP")))
    print(f"cap {cap} bytes", flush=True)
    for name in a.only or RUNS:
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=RUNS[name])
        d = os.path.join(a.out, name)
        os.makedirs(d, exist_ok=True)
        t0 = time.time()
        try:
            r = subprocess.run([sys.executable, me, "--out", d, "--child", name, "--cap-bytes", str(cap)], env=env,
                               capture_output=True, text=True, timeout=a.timeout)
            rc, log = r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:
            rc, log = 124, f"timeout: {e}"
        with open(os.path.join(d, "job.log"), "w") as f:
            f.write(log)
        print(f"{name}: rc {rc} in {time.time() - t0:.0f}s; {log.strip().splitlines()[-1][:300] if log.strip() else ''}",
              flush=True)


if __name__ == "__main__":
    main()
