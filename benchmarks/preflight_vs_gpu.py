"""Preflight's prediction against a real GPU run of the same Hugging Face Trainer job (issue 42).

The job: GPT-2 124M (``GPT2Config()`` defaults, random init, SDPA attention), ``transformers.Trainer`` with
``bf16=True`` (autocast), its default optimizer (``adamw_torch_fused``), micro-batch 8, sequence 1024, 3
steps, random token ids (no network, no dataset download).

Usage (on one GPU; about 1-2 minutes on an H100)::

    PYTHONPATH=src python benchmarks/preflight_vs_gpu.py OUTDIR [--micro-batch 8] [--seq-len 1024] [--steps 3]

Writes ``OUTDIR/preflight_vs_gpu.json``:

- ``gpu``: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the training steps (bytes),
  ``memory_stats`` at the end, the device's name and total memory, the free bytes with the model
  trained (``cudaMemGetInfo``), versions; the run's snapshot ``OUTDIR/gpu.pickle`` (with
  ``gpu.meta.json``);
- ``preflight``: ``oomdoctor preflight`` for the same job on this GPU's memory (a subprocess on the CPU,
  JSON), its traced snapshot ``OUTDIR/preflight.pickle``; when the CLI's dependencies (numpy, click, rich)
  are missing there, the tracer alone (torch only) writes the snapshot and its raw peak of requested
  bytes, and ``fallback_replay_command`` says how to replay it elsewhere;
- ``memtracker``: ``torch.distributed._tools.mem_tracker.MemTracker`` under ``FakeTensorMode`` (fake CUDA
  tensors, which need a CUDA build) on the same model and step (peak, bytes), or the error;
- ``ratios``: predicted / measured for each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _config_file(out: Path) -> Path:
    from transformers import GPT2Config

    p = out / "gpt2-124m-config.json"
    GPT2Config().to_json_file(str(p))
    return p


def gpu_run(out: Path, mb: int, seq: int, steps: int) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainingArguments

    torch.manual_seed(0)
    cfg = GPT2Config()
    n = mb * steps
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, cfg.vocab_size, (n, seq))]
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    args = TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=mb, bf16=True,
                             max_steps=steps, report_to=[], logging_steps=1000, save_strategy="no",
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    stats = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    torch.cuda.memory._dump_snapshot(str(out / "gpu.pickle"))
    torch.cuda.memory._record_memory_history(enabled=None)
    props = torch.cuda.get_device_properties(0)
    meta = {"format": "oomdoctor.sidecar/1", "kind": "final", "rank": 0, "world_size": 1,
            "torch_version": torch.__version__, "cuda_version": torch.version.cuda, "device": 0,
            "gpu_name": props.name, "gpu_total_memory_bytes": int(props.total_memory), "micro_batch": mb,
            "memory_stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))},
            "device_free_bytes": int(free)}
    (out / "gpu.meta.json").write_text(json.dumps(meta, indent=1))
    return {"gpu_name": props.name, "gpu_total_memory_bytes": int(props.total_memory),
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "optim": str(args.optim), "max_memory_allocated": int(torch.cuda.max_memory_allocated()),
            "max_memory_reserved": int(torch.cuda.max_memory_reserved()),
            "device_used_at_end": int(total - free), "reserved_at_end": int(stats["reserved_bytes.all.current"]),
            "outside_allocator_at_end": int(total - free - stats["reserved_bytes.all.current"]),
            "num_alloc_retries": int(stats.get("num_alloc_retries", 0)), "train_wall_s": round(wall, 2)}


def preflight_run(out: Path, cfg_file: Path, mb: int, seq: int, total: int, search: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(HERE / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "CUDA_VISIBLE_DEVICES": ""}  # preflight runs on the CPU, as a user's laptop would
    cmd = [sys.executable, "-m", "oomdoctor", "preflight", "--hf-config", str(cfg_file), "--micro-batch", str(mb),
           "--seq-len", str(seq), "--dtype", "bf16", "--optimizer", "adamw", "--gpu-memory", f"{total}B",
           "--format", "json", "-o", str(out / "preflight.pickle")] + ([] if search else ["--no-search"])
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    res = {"command": " ".join(cmd), "rc": p.returncode, "wall_s": round(time.perf_counter() - t0, 2)}
    if p.returncode == 0:
        try:
            res["result"] = json.loads(p.stdout)
            return res
        except ValueError:
            pass
    res["stderr_tail"] = p.stderr[-3000:]
    # fallback: the tracer alone (torch only), its raw peak of requested bytes
    try:
        sys.path.insert(0, str(HERE / "src"))
        import torch

        from oomdoctor.preflight.snapshot import CUDA_CONTEXT_BYTES, sidecar, snapshot_dict, write
        from oomdoctor.preflight.steps import HfJob, trace_hf

        job = HfJob(str(cfg_file), mb, seq)
        rec = trace_hf(job, cublas_workspace_bytes=32 << 20)
        write(out / "preflight.pickle", snapshot_dict(rec),
              sidecar(rec, gpu_name=None, gpu_total_bytes=total, torch_version=torch.__version__, micro_batch=mb,
                      job=job.as_dict()))
        res["fallback_snapshot"] = str(out / "preflight.pickle")
        res["fallback_replay_command"] = (f"oomdoctor simulate {out / 'preflight.pickle'} --cap "
                                          f"{total - CUDA_CONTEXT_BYTES} --cap-kind device --format json")
        cur = peak = 0
        for e in rec.events:
            if e["action"] == "alloc":
                cur += e["size"]
                peak = max(peak, cur)
            elif e["action"] == "free_completed":
                cur -= e["size"]
        res["fallback_trace_peak_requested_bytes"] = peak
        res["fallback_trace_wall_s"] = round(rec.wall_s, 2)
    except Exception:  # noqa: BLE001 - recorded in the output
        res["fallback_error"] = traceback.format_exc()[-2000:]
    return res


def memtracker_run(mb: int, seq: int, steps: int = 2) -> dict:
    """MemTracker (torch.distributed._tools.mem_tracker) in fake mode on the same step, as its docs show."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM, GPT2Config

    cfg = GPT2Config()
    t0 = time.perf_counter()
    try:
        with FakeTensorMode():
            dev = torch.device("cuda")
            with dev:
                model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
            opt = torch.optim.AdamW(model.parameters(), lr=5e-5, fused=True)
            mt = MemTracker()
            mt.track_external(model, opt)
            with mt:
                for _ in range(steps):
                    ids = torch.randint(0, cfg.vocab_size, (mb, seq), device=dev)
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad()
            peak = mt.get_tracker_snapshot("peak")
            total = max(int(v.get("Total", 0)) for v in peak.values())
        return {"peak_bytes": total, "wall_s": round(time.perf_counter() - t0, 2)}
    except Exception:  # noqa: BLE001 - recorded in the output
        return {"error": traceback.format_exc()[-2000:]}


def plan_run(cfg_file: Path, mb: int, seq: int, total: int) -> dict:
    cmd = [sys.executable, "-m", "oomdoctor", "plan", "estimate", "--model", str(cfg_file), "--framework", "hf",
           "--loop", "trainer", "--sharding", "none", "--seq", str(seq), "--mbs", str(mb), "--gbs", str(mb), "--gpus", "1",
           "--dropout", "--gpu-memory", f"{total / 2**30:.3f}GiB", "--format", "json"]
    env = {**os.environ, "PYTHONPATH": str(HERE / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if p.returncode != 0:
        return {"command": " ".join(cmd), "rc": p.returncode, "stderr_tail": p.stderr[-2000:]}
    try:
        return {"command": " ".join(cmd), "result": json.loads(p.stdout)}
    except ValueError:
        return {"command": " ".join(cmd), "stdout_tail": p.stdout[-2000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--skip-gpu", action="store_true", help="only the predictions (for a CPU machine)")
    ap.add_argument("--search", action="store_true",
                    help="also let preflight search the largest micro-batch (several more traces, minutes)")
    a = ap.parse_args()
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_file = _config_file(out)
    res: dict = {"job": {"model": "GPT-2 124M (GPT2Config defaults, random init, sdpa)", "micro_batch": a.micro_batch,
                         "seq_len": a.seq_len, "bf16_autocast": True, "optimizer": "Trainer default (adamw_torch_fused)",
                         "steps": a.steps}}
    total = 81559 * 2**20
    if not a.skip_gpu:
        res["gpu"] = gpu_run(out, a.micro_batch, a.seq_len, a.steps)
        total = res["gpu"]["gpu_total_memory_bytes"]
        res["memtracker"] = memtracker_run(a.micro_batch, a.seq_len)
    res["preflight"] = preflight_run(out, cfg_file, a.micro_batch, a.seq_len, total, a.search)
    res["plan_estimate"] = plan_run(cfg_file, a.micro_batch, a.seq_len, total)
    if "gpu" in res:
        g = res["gpu"]
        r = {}
        pf = res["preflight"].get("result") or {}
        if pf.get("peak_allocated_bytes"):
            r["preflight_allocated"] = pf["peak_allocated_bytes"] / g["max_memory_allocated"]
        if pf.get("peak_reserved_bytes"):
            r["preflight_reserved"] = pf["peak_reserved_bytes"] / g["max_memory_reserved"]
        if res["preflight"].get("fallback_trace_peak_requested_bytes"):
            r["preflight_trace_requested"] = (res["preflight"]["fallback_trace_peak_requested_bytes"]
                                              / g["max_memory_allocated"])
        if res["memtracker"].get("peak_bytes"):
            r["memtracker_allocated"] = res["memtracker"]["peak_bytes"] / g["max_memory_allocated"]
        res["ratios"] = r
    (out / "preflight_vs_gpu.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({k: res[k] for k in res if k in ("gpu", "ratios")}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
