"""A GraphSAGE-like job on graphs of very different sizes, under ``torch.cuda.set_per_process_memory_fraction``,
with and without ``garbage_collection_threshold:0.8``, recorded: both capped runs run out at the same step, the
one whose graph does not fit under the cap, so that the model can be checked to predict that OOM (issue 35,
item 6b; the issue's GraphSAGE case was predicted to complete under GC where the rerun ran out). Pure torch, no
torch_geometric. One GPU; about 1-2 minutes::

    python3 scenarios/graphsage_gc.py --out $OUT
    python3 scenarios/graphsage_gc.py --out /tmp/g --cpu        # a dry run of the job's code, no GPU, no cap

The job: a 3-layer GraphSAGE (mean aggregation: ``index_add_`` of the gathered neighbour features, divided by
the in-degree; ``lin_self(h) + lin_neigh(mean)``, ReLU), 128 input features, 256 hidden, 16 classes, Adam, one
graph per step. The graphs are built on the CPU (seed 0) and moved to the GPU as a loader does: ``NODES`` nodes
(``AVG_DEGREE`` = 16 random edges per node), so a step's memory follows its graph's size, from 10,000 to 300,000
nodes; the last graph is twice the largest before it.

Runs, each a fresh process recorded with ``oomdoctor.record`` (snapshot ``rank0.pickle`` or ``rank0_oom.pickle``
and its sidecar, which holds the cap and the allocator setting; ``rec.step()`` after each step):

- ``nocap``: no cap; it measures each step's peak allocated (``reset_peak_memory_stats`` at each step start).
- the cap: ``max(peak before the last step) x --headroom`` (1.3), kept under ``0.9 x`` the last step's peak
  (else the geometric mean of the two), so every step but the last fits with room to spare and the last cannot
  fit whatever the allocator frees. ``cap-default`` (no setting), ``cap-gc0.8``
  (``garbage_collection_threshold:0.8``), and two more that cost seconds: ``cap-gc0.8-mss256`` (with
  ``max_split_size_mb:256``, the pair whose replay regressed) and ``cap-expandable``.

Written to ``--out`` (8 files at most): ``graphsage_gc.json`` (the GPU, the graphs, each step's peak, the cap,
per run: exit, the step it ran out at, the full OOM message, ``torch.cuda.memory_stats()``'s counters at the end)
and one ``graphsage-<run>.tar.xz`` per run (the run's directory: snapshot(s), sidecars, ``truth.json``,
``job.log``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NODES = (60_000, 20_000, 120_000, 40_000, 90_000, 10_000, 150_000, 30_000, 110_000, 50_000, 300_000)
AVG_DEGREE, FEATURES, HIDDEN, CLASSES, LAYERS = 16, 128, 256, 16, 3
RUNS = {
    "nocap": "",
    "cap-default": "",
    "cap-gc0.8": "garbage_collection_threshold:0.8",
    "cap-gc0.8-mss256": "garbage_collection_threshold:0.8,max_split_size_mb:256",
    "cap-expandable": "expandable_segments:True",
}


def graphs(cpu: bool):
    """The job's graphs, in order: (x [N, FEATURES] f32, edge_index [2, E] int64, y [N] int64), on the CPU."""
    import torch
    g = torch.Generator().manual_seed(0)
    for n in NODES:
        n = n // 1000 if cpu else n
        e = n * AVG_DEGREE
        x = torch.randn(n, FEATURES, generator=g)
        edge_index = torch.randint(0, n, (2, e), generator=g)
        y = torch.randint(0, CLASSES, (n,), generator=g)
        yield x, edge_index, y


def build(dev):
    import torch
    import torch.nn as nn

    class SAGE(nn.Module):
        """One GraphSAGE layer, mean aggregation (Hamilton et al. 2017; torch_geometric's SAGEConv)."""

        def __init__(self, i: int, o: int):
            super().__init__()
            self.lin_self, self.lin_neigh = nn.Linear(i, o), nn.Linear(i, o, bias=False)

        def forward(self, h, src, dst, inv_deg):
            agg = torch.zeros_like(h).index_add_(0, dst, h[src]) * inv_deg
            return self.lin_self(h) + self.lin_neigh(agg)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            dims = [FEATURES] + [HIDDEN] * LAYERS
            self.layers = nn.ModuleList(SAGE(a, b) for a, b in zip(dims, dims[1:]))
            self.out = nn.Linear(HIDDEN, CLASSES)

        def forward(self, x, edge_index):
            src, dst = edge_index[0], edge_index[1]
            deg = torch.zeros(x.shape[0], device=x.device).index_add_(0, dst, torch.ones_like(dst, dtype=x.dtype))
            inv_deg = (1.0 / deg.clamp(min=1)).unsqueeze(1)
            h = x
            for layer in self.layers:
                h = torch.relu(layer(h, src, dst, inv_deg))
            return self.out(h)

    torch.manual_seed(0)
    model = Net().to(dev)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def child(name: str, out: str, cap_bytes: int | None, cpu: bool) -> None:
    import torch
    import torch.nn.functional as F

    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    total = 0
    if not cpu:
        torch.cuda.set_device(dev)
        total = torch.cuda.get_device_properties(dev).total_memory
        if cap_bytes is not None:  # before anything is allocated, as the job would
            torch.cuda.set_per_process_memory_fraction(cap_bytes / total, dev)
    truth = {"run": name, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "cap_bytes": cap_bytes,
             "memory_fraction": cap_bytes / total if cap_bytes and total else None, "steps_done": 0,
             "oom_step": None, "oom": None, "step_peak_allocated": [], "step_peak_reserved": []}
    t0 = time.time()
    rec = None
    if not cpu:
        sys.path.insert(0, os.path.join(ROOT, "src"))
        import oomdoctor
        rec = oomdoctor.record(out).start()
    try:
        model, opt = build(dev)
        for i, (x, edge_index, y) in enumerate(graphs(cpu)):
            if not cpu:
                torch.cuda.reset_peak_memory_stats(dev)
            try:
                x, edge_index, y = x.to(dev), edge_index.to(dev), y.to(dev)
                loss = F.cross_entropy(model(x, edge_index), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del x, edge_index, y, loss
            except torch.OutOfMemoryError as e:
                truth.update(oom_step=i, oom=str(e))
                break
            finally:
                if not cpu:
                    truth["step_peak_allocated"].append(torch.cuda.max_memory_allocated(dev))
                    truth["step_peak_reserved"].append(torch.cuda.max_memory_reserved(dev))
            truth["steps_done"] = i + 1
            if rec is not None:
                rec.step()
        if not cpu:
            torch.cuda.synchronize()
    finally:
        if rec is not None:
            rec.stop()
    truth["wall_s"] = round(time.time() - t0, 1)
    truth["torch"] = torch.__version__
    if not cpu:
        free, tot = torch.cuda.mem_get_info(dev)
        truth.update(gpu_total_memory_bytes=int(total), mem_get_info_free=int(free), mem_get_info_total=int(tot),
                     memory_stats={k: v for k, v in torch.cuda.memory_stats(dev).items()
                                   if k.startswith(("num_", "reserved_bytes.all", "allocated_bytes.all"))})
    with open(os.path.join(out, "truth.json"), "w") as f:
        json.dump(truth, f, indent=1)
    print("RESULT", json.dumps({k: truth[k] for k in ("run", "steps_done", "oom_step")}), flush=True)


def choose_cap(peaks: list[int], headroom: float) -> int:
    """Between the peak of every step before the last (times ``headroom``) and the last step's own peak."""
    before, last = max(peaks[:-1]), peaks[-1]
    cap = int(before * headroom)
    if cap >= 0.9 * last:
        cap = int((before * last) ** 0.5)
    return cap


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--child")
    p.add_argument("--cap-bytes", type=int)
    p.add_argument("--headroom", type=float, default=1.3)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--timeout", type=int, default=150)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.child:
        child(a.child, a.out, a.cap_bytes, a.cpu)
        return
    me = os.path.abspath(__file__)
    work = os.path.join("/tmp", "graphsage-gc")
    t0 = time.time()
    result: dict = {"nodes": NODES, "avg_degree": AVG_DEGREE, "features": FEATURES, "hidden": HIDDEN,
                    "layers": LAYERS, "runs": {}}
    if not a.cpu:
        import torch
        result["gpu"] = torch.cuda.get_device_name(0)
    cap = None
    for name, conf in RUNS.items():
        if a.cpu and name != "nocap":
            continue
        d = os.path.join(work, name)
        os.makedirs(d, exist_ok=True)
        cmd = [sys.executable, me, "--out", d, "--child", name] + (["--cpu"] if a.cpu else [])
        if name.startswith("cap-"):
            cmd += ["--cap-bytes", str(cap)]
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf, "PYTHONUNBUFFERED": "1"}
        env.pop("PYTORCH_ALLOC_CONF", None)
        s0 = time.time()
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
            rc, log = r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:
            rc, log = 124, f"timeout: {e}"
        with open(os.path.join(d, "job.log"), "w") as f:
            f.write(log)
        truth = {}
        if os.path.exists(os.path.join(d, "truth.json")):
            with open(os.path.join(d, "truth.json")) as f:
                truth = json.load(f)
        truth.update(exit_code=rc, seconds=round(time.time() - s0, 1))
        if rc != 0:
            truth["log_tail"] = log[-1500:]
        result["runs"][name] = truth
        print(name, json.dumps({k: truth.get(k) for k in ("exit_code", "steps_done", "oom_step", "seconds")}),
              flush=True)
        if name == "nocap":
            peaks = truth.get("step_peak_allocated") or []
            if a.cpu:
                break
            if len(peaks) != len(NODES) or truth.get("oom_step") is not None:
                result["error"] = "the uncapped run did not run every graph: no cap to choose"
                break
            cap = choose_cap(peaks, a.headroom)
            result.update(cap_bytes=cap, step_peak_allocated=peaks, headroom=a.headroom,
                          last_step_over_cap=round(peaks[-1] / cap, 3),
                          before_last_under_cap=round(max(peaks[:-1]) / cap, 3))
    capped = {n: r.get("oom_step") for n, r in result["runs"].items() if n.startswith("cap-")}
    result["capped_oom_steps"] = capped
    result["gc_ran_out_like_default"] = (capped.get("cap-gc0.8") is not None
                                         and capped.get("cap-gc0.8") == capped.get("cap-default"))
    result["seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(a.out, "graphsage_gc.json"), "w") as f:
        json.dump(result, f, indent=1)
    for name in result["runs"]:
        with tarfile.open(os.path.join(a.out, f"graphsage-{name}.tar.xz"), "w:xz") as tar:
            tar.add(os.path.join(work, name), arcname=f"graphsage-{name}")
    print("capped runs ran out at steps", capped, "in", result["seconds"], "s", flush=True)


if __name__ == "__main__":
    main()
