"""``oomdoctor preflight`` against the real GPU runs of the corpus (issue 42): the jobs preflight can express,
traced on the CPU, compared with what the jobs measured on their H200s and with the verdict their real
snapshots get.

    python benchmarks/preflight_corpus.py OUTDIR [--only RUN ...] [--memtracker] [--json OUT.json]

Per run (``JOBS``): ``oomdoctor preflight ... --gpu H200 --no-search --format json -o OUTDIR/RUN.pickle`` as a
user runs it (a subprocess), then ``oomdoctor diagnose OUTDIR/RUN.pickle --format json`` on the traced
snapshot (laid out by the allocator model). Printed, per run: the measured peak allocated / reserved
(``torch.cuda.max_memory_*`` of rank 0, the sweeps' records or the archive's ``ground_truth.json``) and
preflight's error (%); OOM measured / predicted; the real run's verdict (``docs/corpus/runs.json``, which
``tests/integration/test_corpus.py`` checks ``diagnose`` gives on the real snapshot) and the traced
snapshot's; ``oomdoctor plan estimate``'s peak allocated / reserved (``benchmarks/plan_corpus.py``'s
``predict``, the same job terms). ``--memtracker``: ``torch.distributed._tools.mem_tracker.MemTracker``
in fake mode on one iteration of the same step (fake CPU tensors: fake CUDA tensors abort a CPU-only
build), its peak, or the error.

Runs that ran out of memory report the peaks at the OOM (the job's counters stop there, and so does the
traced snapshot's replay): the comparison that counts for them is the OOM column.
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
from typing import Any

HERE = Path(__file__).resolve().parents[1]
CORPUS = HERE / "docs" / "corpus"
sys.path.insert(0, str(HERE / "benchmarks"))

GPT2 = str(CORPUS / "configs" / "gpt2.json")
LLAMA = str(CORPUS / "configs" / "llama-8x1024.json")
_TRAINER = ["--hf-config", GPT2, "--seq-len", "1024", "--ddp", "2"]
_ACCEL = ["--hf-config", LLAMA, "--seq-len", "2048", "--ddp", "2", "--loop", "accelerate", "--grad-accum", "2"]

#: run (a corpus run: runs.json, a sweep record or both) -> preflight's arguments (the job as it ran)
JOBS: dict[str, list[str]] = {
    "trainer-ddp-gpt2-b48": _TRAINER + ["--micro-batch", "48"],
    "trainer-ddp-gpt2-b88": _TRAINER + ["--micro-batch", "88"],
    "trainer-ddp-gpt2-b92": _TRAINER + ["--micro-batch", "92"],
    "trainer-ddp-gpt2-b96": _TRAINER + ["--micro-batch", "96"],
    "trainer-ddp-gpt2-checkpointing-b88": _TRAINER + ["--micro-batch", "88", "--gradient-checkpointing"],
    "first-forward-trainer-ddp-gpt2-b160": _TRAINER + ["--micro-batch", "160"],
    "accelerate-ddp-llama-b72": _ACCEL + ["--micro-batch", "72"],
    "accelerate-ddp-llama-b76": _ACCEL + ["--micro-batch", "76"],
}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(HERE / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "CUDA_VISIBLE_DEVICES": "", "COLUMNS": "100"}


def measured() -> dict[str, dict[str, Any]]:
    """Every corpus run with what it measured (``plan_corpus.all_rows``), by run name."""
    from plan_corpus import all_rows

    return {r["run"]: r for r in all_rows()}


def preflight(run: str, out: Path) -> dict[str, Any]:
    snap = out / f"{run}.pickle"
    cmd = [sys.executable, "-m", "oomdoctor", "preflight", *JOBS[run], "--gpu", "H200", "--no-search",
           "--format", "json", "-o", str(snap)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=1800)
    res: dict[str, Any] = {"command": " ".join(["oomdoctor", *cmd[3:]]).replace(str(HERE) + "/", ""),
                           "rc": p.returncode, "wall_s": round(time.perf_counter() - t0, 1)}
    if p.returncode != 0:
        res["stderr_tail"] = p.stderr[-1500:]
        return res
    res["result"] = json.loads(p.stdout)
    t0 = time.perf_counter()
    d = subprocess.run([sys.executable, "-m", "oomdoctor", "diagnose", str(snap), "--format", "json"],
                       capture_output=True, text=True, env=_env(), timeout=1800)
    res["diagnose_wall_s"] = round(time.perf_counter() - t0, 1)
    if d.returncode != 0 and not d.stdout.strip():
        res["diagnose_error"] = d.stderr[-1500:]
    else:
        v = json.loads(d.stdout).get("verdict") or {}
        res["traced_verdict"] = v.get("kind")
        res["traced_verdict_edge"] = v.get("at_edge")
    return res


def plan(row: dict[str, Any]) -> dict[str, Any]:
    from plan_corpus import predict

    e = predict(row)
    if isinstance(e, str):
        return {"refused": e}
    s = e.peak
    return {"allocated": s.allocated_bytes, "reserved": s.reserved_bytes, "fits": e.fits}


_MEMTRACKER = r'''
import json, sys, time, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoModelForCausalLM
sys.path.insert(0, sys.argv[1])
from oomdoctor.preflight.steps import load_config, materialize
cfg = load_config(sys.argv[2]); b, s, ckpt, trainer = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6] == "trainer"
if trainer:
    cfg.use_cache = False
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
t0 = time.perf_counter()
with FakeTensorMode(allow_non_fake_inputs=True):
    model = materialize(model)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, fused=trainer or None)
    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        ids = torch.randint(0, cfg.vocab_size, (b, s))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if trainer:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    peak = mt.get_tracker_snapshot("peak")
print(json.dumps({"peak_bytes": max(int(v.get("Total", 0)) for v in peak.values()),
                  "wall_s": round(time.perf_counter() - t0, 1)}))
'''


def memtracker(run: str) -> dict[str, Any]:
    """MemTracker in fake mode, one iteration of the job's step (no DDP: MemTracker has no process group to
    fake), in a subprocess (a fake-tensor failure can abort the process)."""
    a = JOBS[run]
    cfg, b, s = a[a.index("--hf-config") + 1], a[a.index("--micro-batch") + 1], a[a.index("--seq-len") + 1]
    loop = a[a.index("--loop") + 1] if "--loop" in a else "trainer"
    cmd = [sys.executable, "-c", _MEMTRACKER, str(HERE / "src"), cfg, b, s,
           "1" if "--gradient-checkpointing" in a else "0", loop]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=1800)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 1800 s"}
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        return {"error": (lines[-1] if lines else f"exit {p.returncode}")[:300], "rc": p.returncode}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _pct(pred: int | None, real: int | None) -> str:
    return f"{(pred - real) / real * 100:+.3f}%" if pred and real else "-"


def _b(n: int | None) -> str:
    return f"{n:,}" if n else "-"


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| run | measured max allocated | preflight | error | measured max reserved | preflight | error "
           "| OOM measured / predicted | verdict real / traced | plan estimate allocated / reserved "
           "| MemTracker (fake, 1 iteration) |", "|" + "---|" * 11]
    for r in rows:
        m, p = r["measured"], (r["preflight"].get("result") or {})
        pa, pr = p.get("peak_allocated_bytes"), p.get("peak_reserved_bytes")
        oom_m = "OOM" if m.get("exit_code") else "ran"
        oom_p = ("OOM" if p.get("oom") else "fits") if p else f"failed (rc {r['preflight']['rc']})"
        pl = r["plan"]
        pls = (f"{_pct(pl['allocated'], m.get('max_memory_allocated'))} / "
               f"{_pct(pl['reserved'], m.get('max_memory_reserved'))}" if "allocated" in pl else "refused")
        mt = r.get("memtracker")
        mts = "-" if mt is None else (f"{_pct(mt['peak_bytes'], m.get('max_memory_allocated'))} of allocated"
                                      if "peak_bytes" in mt else f"failed: {mt['error'][:80]}")
        out.append(f"| {r['run']} | {_b(m.get('max_memory_allocated'))} | {_b(pa)} | "
                   f"{_pct(pa, m.get('max_memory_allocated'))} | {_b(m.get('max_memory_reserved'))} | {_b(pr)} | "
                   f"{_pct(pr, m.get('max_memory_reserved'))} | {oom_m} / {oom_p} | "
                   f"{r['real_verdict'] or '-'} / {r['preflight'].get('traced_verdict', '-')} | {pls} | {mts} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--only", nargs="*", help="these runs only")
    ap.add_argument("--memtracker", action="store_true", help="also MemTracker in fake mode (slow)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    runs = json.loads((CORPUS / "runs.json").read_text())
    meas = measured()
    rows = []
    for run in a.only or JOBS:
        m = meas.get(run) or {}
        row: dict[str, Any] = {"run": run, "measured": m, "real_verdict": (runs.get(run) or {}).get("verdict")}
        try:
            row["plan"] = plan(m) if m else {"refused": "no measurement"}
        except Exception as e:  # noqa: BLE001 - recorded in the output
            row["plan"] = {"refused": f"{type(e).__name__}: {e}"[:200]}
        row["preflight"] = preflight(run, out)
        if a.memtracker:
            row["memtracker"] = memtracker(run)
        rows.append(row)
        p = row["preflight"]
        print(f"{run}: rc {p['rc']} {p['wall_s']} s, verdict {row['real_verdict']} / {p.get('traced_verdict')}",
              file=sys.stderr, flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1, default=str) + "\n")
    print(table(rows))
    try:
        for r in rows:
            print(f"{r['run']}: {r['preflight']['command']}")
    except KeyError:
        traceback.print_exc()
    return 0


if __name__ == "__main__":
    sys.exit(main())
