"""A gpt-fast-style inference job whose peak falls out of a small ring buffer (issue 41).

A Llama-shaped model (transformers, random init, bf16, no download) prefills a large batch of long prompts
(full logits: batch x prompt x vocabulary, the job's peak) and then decodes ``--new-tokens`` tokens one at a
time, greedily, with the KV cache the prefill made: a long decode whose events push the prefill out of a
``--max-entries`` ring buffer. Not compiled (gpt-fast compiles the decode step; the memory shape is the same).

Variants (``--variant``), each writing into ``OUT/<variant>/``:

- ``plain``: the job records itself the way PyTorch's docs show it,
  ``torch.cuda.memory._record_memory_history(max_entries=N)`` then ``_dump_snapshot(OUT/plain/snapshot.pickle)``:
  no sidecar;
- ``oomdoctor``: nothing in the job; run it under ``oomdoctor run --max-entries N --out OUT/oomdoctor`` (the
  recorder writes ``rank0.pickle`` and its sidecar, with PyTorch's counters);
- ``all`` (the one to run): both of the above as subprocesses, then ``oomdoctor diagnose --format json`` on
  each (``OUT/<variant>/diagnose.json``, ``diagnose.txt``) and ``OUT/summary.json``: whether the prefill fell
  out of each window (the first recorded event after the prefill's end), the job's peaks, and what diagnose
  said.

Each variant writes ``ground_truth.json`` (``scenarios/_truth.py``) with ``prefill_max_memory_allocated``
(``torch.cuda.max_memory_allocated()`` right after the prefill: the job's peak), ``prefill_end_time_us`` (µs
since the epoch, the trace's clock) and ``memory_stats`` (``torch.cuda.memory_stats()`` counters at the end).

    python scenarios/inference_prefill_window.py --variant all --out OUT      # about 1 minute on one H100

``--cpu``: a tiny dry run of the job's code without a GPU (nothing recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

COUNTERS = ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "active_bytes.all.peak",
            "allocated_bytes.all.current", "reserved_bytes.all.current", "num_alloc_retries", "num_ooms",
            "num_device_alloc", "num_device_free")


def job(a: argparse.Namespace) -> None:
    import torch
    from _truth import GroundTruth
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(a.out) / a.variant
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cpu" if a.cpu else "cuda")
    if a.variant == "plain" and not a.cpu:
        torch.cuda.memory._record_memory_history(max_entries=a.max_entries)
    shape = dict(num_hidden_layers=a.layers, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                 intermediate_size=2816)
    if a.cpu:
        shape.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    cfg = LlamaConfig(vocab_size=32000, max_position_embeddings=a.prompt + a.new_tokens, **shape)
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    truth = GroundTruth(str(out / "ground_truth.json"), batch=a.batch, prompt=a.prompt, new_tokens=a.new_tokens,
                        layers=cfg.num_hidden_layers, max_entries=a.max_entries, variant=a.variant,
                        framework="plain decode loop (gpt-fast style)")
    if not a.cpu:
        truth.count_model(model)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.prompt), generator=torch.Generator().manual_seed(0)).to(dev)
    try:
        with torch.inference_mode():
            o = model(input_ids=ids, use_cache=True)  # prefill: every position's logits, the job's peak
            nxt = o.logits[:, -1].argmax(-1, keepdim=True)
            cache = o.past_key_values
            del o
            if not a.cpu:
                torch.cuda.synchronize()
                truth.note(prefill_max_memory_allocated=torch.cuda.max_memory_allocated(),
                           prefill_max_memory_reserved=torch.cuda.max_memory_reserved())
            truth.note(prefill_end_time_us=time.time_ns() // 1000)
            for _ in range(a.new_tokens - 1):  # decode, one token at a time
                o = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                cache = o.past_key_values
                nxt = o.logits[:, -1].argmax(-1, keepdim=True)
                del o
            if not a.cpu:
                torch.cuda.synchronize()
        truth.note(generated_tokens=a.new_tokens, decode_end_time_us=time.time_ns() // 1000)
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        raise
    finally:
        if not a.cpu:
            stats = torch.cuda.memory_stats()
            truth.note(memory_stats={k: int(stats.get(k, 0)) for k in COUNTERS})
            truth.write()
            if a.variant == "plain":
                torch.cuda.memory._dump_snapshot(str(out / "snapshot.pickle"))
        else:
            print(json.dumps(truth.truth, default=str))


def _first_event_us(pickle_path: Path) -> int | None:
    import pickle

    with open(pickle_path, "rb") as f:
        snap = pickle.load(f)
    traces = [t for t in snap.get("device_traces") or [] if t]
    return min(int(t[0]["time_us"]) for t in traces) if traces else None


def run_all(a: argparse.Namespace) -> None:
    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--out", str(root), "--batch", str(a.batch), "--prompt", str(a.prompt), "--new-tokens",
              str(a.new_tokens), "--layers", str(a.layers), "--max-entries", str(a.max_entries)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    summary: dict = {"command": " ".join(sys.argv), "variants": {}}
    for variant in ("oomdoctor", "plain"):
        cmd = me + ["--variant", variant] + common
        if variant == "oomdoctor":
            cmd = [sys.executable, "-m", "oomdoctor", "run", "--out", str(root / variant), "--max-entries",
                   str(a.max_entries), "--no-diagnose", "--"] + cmd
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        rec: dict = {"exit_code": proc.returncode, "wall_s": round(time.time() - t0, 1),
                     "stderr_tail": proc.stderr[-2000:]}
        d = root / variant
        snap = d / ("rank0.pickle" if variant == "oomdoctor" else "snapshot.pickle")
        truth = json.loads((d / "ground_truth.json").read_text()) if (d / "ground_truth.json").is_file() else {}
        rec["ground_truth"] = truth
        if snap.is_file():
            first = _first_event_us(snap)
            rec["first_event_us"] = first
            rec["prefill_out_of_window"] = (first is not None and "prefill_end_time_us" in truth
                                            and first > truth["prefill_end_time_us"])
            for fmt in ("json", "text"):
                dg = subprocess.run([sys.executable, "-m", "oomdoctor", "diagnose", "--format", fmt, str(snap)],
                                    capture_output=True, text=True, env=env)
                (d / f"diagnose.{'json' if fmt == 'json' else 'txt'}").write_text(dg.stdout + dg.stderr)
                if fmt == "json" and dg.returncode == 0:
                    r = json.loads(dg.stdout)["ranks"][0]
                    rec["diagnose"] = {k: r.get(k) for k in (
                        "peak_allocated_bytes", "peak_reserved_bytes", "job_peak_allocated_bytes",
                        "job_peak_reserved_bytes", "peak_source", "alloc_retries", "alloc_retries_source")}
        summary["variants"][variant] = rec
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({v: {k: r.get(k) for k in ("exit_code", "wall_s", "prefill_out_of_window", "diagnose")}
                      for v, r in summary["variants"].items()}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=("plain", "oomdoctor", "all"), required=True)
    p.add_argument("--out", required=True, help="directory for the snapshots, ground truth and reports")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--max-entries", type=int, default=20_000)
    p.add_argument("--cpu", action="store_true", help="tiny dry run without a GPU")
    a = p.parse_args()
    if a.variant == "all":
        run_all(a)
    else:
        job(a)


if __name__ == "__main__":
    main()
