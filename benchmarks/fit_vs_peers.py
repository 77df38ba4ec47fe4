"""``oomdoctor fit`` against Hugging Face's ``auto_find_batch_size`` and Lightning's ``BatchSizeFinder``, and
``oomdoctor verify`` on a job with a known fix: trials, wall time and the answer of each, on the same jobs.

Run on a GPU machine (2 GPUs for the ``torchrun`` part) from the repository root, with torch, transformers,
accelerate and lightning installed (no network needed)::

    python benchmarks/fit_vs_peers.py OUT_DIR                      # every part
    python benchmarks/fit_vs_peers.py OUT_DIR --parts trainer,plain,verify
    python benchmarks/fit_vs_peers.py OUT_DIR --parts torchrun

Each part writes ``OUT_DIR/<part>.json``; ``OUT_DIR/summary.md`` is the table of every part run so far. The jobs
(``scenarios/fit_job.py``): GPT-2 124M, sequence 512, AdamW, bf16 autocast, per-device micro-batch B.

- ``trainer``: the Hugging Face Trainer job, one GPU: ``oomdoctor fit`` (a recorded first trial at ``--start``,
  then guided trials of 2 optimizer steps, each a fresh process) against ``Trainer(auto_find_batch_size=True)``
  started at ``--peer-start`` (it only ever lowers the batch: x0.9 per OOM in accelerate >= 1.x).
- ``plain``: the plain PyTorch loop, one GPU: ``oomdoctor fit`` against accelerate's
  ``find_executable_batch_size`` around the same loop and Lightning's ``Tuner.scale_batch_size(mode="binsearch")``
  on the same model (init 2, doubling then bisecting, 2 steps per trial, then Lightning's 5% margin).
- ``torchrun``: the Trainer job under ``torchrun --nproc_per_node=2`` (DDP): ``oomdoctor fit`` against
  ``auto_find_batch_size`` under torchrun. Lightning's tuner refuses distributed strategies: not run.
- ``verify``: ``oomdoctor verify --steps 14`` on ``scenarios/fragmentation_oom.py`` (a fragmentation OOM under a
  memory fraction; the diagnosis proposes expandable segments, max_split_size_mb and the garbage collector).
- ``vit``: issue 49 item 6's case, ``scenarios/vit_job.py`` (ViT-B/16, synthetic 224 x 224 images, AdamW, bf16
  autocast, one GPU) under a memory-fraction cap of ``--vit-cap-gib`` (8 GiB: the edge near 100, so that the three
  searches fit one device call; the job is the real one, the room is smaller): ``oomdoctor fit`` started at 1 (the
  recorded trial at 1 guides the search), the doubling search on the same job (``oomdoctor fit --no-record`` from
  1: the same trials without the replay's guess), and accelerate's ``find_executable_batch_size`` (the search of
  ``auto_find_batch_size``) from ``--vit-peer-start``.

The answer of each tool is compared with ``oomdoctor fit``'s, which is bracketed by real runs (the largest that
ran, and that plus one, which ran out of memory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "scenarios" / "fit_job.py")
PY = sys.executable
PARTS = ("trainer", "plain", "torchrun", "verify", "vit")
VIT = str(ROOT / "scenarios" / "vit_job.py")


def run(argv: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int, float, bool]:
    """(exit code, seconds, timed out); output in ``log``."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            code, out = p.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            code, out = p.wait(), True
    return code, round(time.perf_counter() - t0, 2), out


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), e.get("PYTHONPATH", "")) if p)
    e.setdefault("PYTHONUNBUFFERED", "1")
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        e.setdefault(k, v)
    return e


def fit(out: Path, name: str, cmd: list[str], a: argparse.Namespace, start: int | None = None,
        extra: tuple[str, ...] = (), tool: str = "oomdoctor fit") -> dict:
    res = out / f"fit-{name}.json"
    argv = [PY, "-m", "oomdoctor", "fit", "--steps", "2", "--start", str(a.start if start is None else start),
            "--high", str(a.high), *extra, "--out", str(out / f"fit-{name}"), "--trial-timeout", "150", "--format",
            "json", "-o", str(res), "--", *cmd]
    code, secs, timed_out = run(argv, out / f"fit-{name}.log", a.timeout, env())
    doc = json.loads(res.read_text()) if res.is_file() else {}
    return {"tool": tool, "exit_code": code, "timed_out": timed_out, "seconds": secs,
            "answer": doc.get("largest_micro_batch"), "smallest_oom": doc.get("smallest_oom_micro_batch"),
            "trials": doc.get("trial_count"), "guide": doc.get("guide"),
            "predicted": doc.get("predicted_micro_batch"), "analysis_seconds": doc.get("analysis_seconds"),
            "error": doc.get("error"), "guess_contradicted": doc.get("guess_contradicted"),
            "tried": [(t["micro_batch"], t["outcome"], t["seconds"]) for t in doc.get("trials", [])]}


def peer(out: Path, name: str, argv: list[str], a: argparse.Namespace, timeout: float | None = None) -> dict:
    res = out / f"{name}.json"
    code, secs, timed_out = run([*argv, "--result", str(res)], out / f"{name}.log", timeout or a.timeout, env())
    doc = json.loads(res.read_text()) if res.is_file() else {}
    return {"tool": doc.get("tool", name), "exit_code": code, "timed_out": timed_out, "seconds": secs,
            "search_seconds": doc.get("seconds"), "answer": doc.get("answer"), "trials": doc.get("trials"),
            "tried": list(zip(doc.get("tried", []), doc.get("outcomes", []))),
            "largest_ran": doc.get("largest_ran", doc.get("answer"))}


def part(name: str, out: Path, a: argparse.Namespace) -> dict:
    ps = str(a.peer_start)
    if name == "trainer":
        rows = [fit(out, "trainer", [PY, JOB, "--harness", "trainer", "--batch", "{mb}"], a),
                peer(out, "hf-auto-find-trainer", [PY, JOB, "--harness", "trainer", "--auto-find", "--batch", ps,
                                                   "--steps", "2"], a)]
    elif name == "plain":
        rows = [fit(out, "plain", [PY, JOB, "--harness", "plain", "--batch", "{mb}"], a),
                peer(out, "accelerate-find-plain", [PY, JOB, "--harness", "plain", "--auto-find", "--batch", ps,
                                                    "--steps", "2"], a),
                peer(out, "lightning-binsearch", [PY, JOB, "--harness", "lightning", "--binsearch", "--steps", "2"],
                     a)]
    elif name == "vit":
        job = [PY, VIT, "--cap-gib", str(a.vit_cap_gib)]
        rows = [fit(out, "vit", [*job, "--batch", "{mb}"], a, start=1),
                fit(out, "vit-doubling", [*job, "--batch", "{mb}"], a, start=1, extra=("--no-record",),
                    tool="doubling search (oomdoctor fit --no-record)"),
                peer(out, "accelerate-find-vit", [*job, "--auto-find", "--batch", str(a.vit_peer_start),
                                                  "--steps", "2"], a, timeout=a.vit_peer_timeout)]
        if rows[0].get("trials") and rows[1].get("trials"):
            rows[0]["trials_vs_doubling"] = rows[0]["trials"] - rows[1]["trials"]  # issue 49: at most EXTRA_TRIALS
    elif name == "torchrun":
        tr = [PY, "-m", "torch.distributed.run", "--nproc_per_node=2", JOB, "--harness", "trainer"]
        rows = [fit(out, "torchrun", [*tr, "--batch", "{mb}"], a),
                peer(out, "hf-auto-find-torchrun", [*tr, "--auto-find", "--batch", ps, "--steps", "2"], a),
                {"tool": "lightning Tuner.scale_batch_size(mode='binsearch')", "answer": None,
                 "note": "not run: Lightning's tuner does not support distributed strategies"}]
    else:
        res = out / "verify-fragmentation.json"
        argv = [PY, "-m", "oomdoctor", "verify", "--steps", "14", "--out", str(out / "verify-fragmentation"),
                "--trial-timeout", "150", "--format", "json", "-o", str(res), "--",
                PY, str(ROOT / "scenarios" / "fragmentation_oom.py"), "--variant", "default"]
        code, secs, timed_out = run(argv, out / "verify-fragmentation.log", a.timeout, env())
        doc = json.loads(res.read_text()) if res.is_file() else {}
        rows = [{"tool": "oomdoctor verify", "exit_code": code, "timed_out": timed_out, "seconds": secs,
                 "baseline": (doc.get("baseline") or {}).get("outcome"), "refuted": doc.get("refuted"),
                 "settings": [{k: s.get(k) for k in ("config", "predicted_oom", "predicted_peak_reserved_bytes",
                                                     "margin_bytes", "measured_peak_reserved_bytes", "oom",
                                                     "confirmed", "why")} | {"seconds": s["trial"]["seconds"]}
                              for s in doc.get("settings", [])]}]
    truth = rows[0].get("answer") if name != "verify" else None
    for r in rows[1:]:
        if truth is not None and r.get("answer") is not None:
            r["versus_fit"] = r["answer"] - truth  # negative: below the largest that runs; positive: would OOM
    return {"part": name, "gpu": gpu(), "rows": rows}


def gpu() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def table(out: Path) -> str:
    lines = ["| job | tool | answer | vs fit | trials | wall s | tried (* ran out, ! neither) |",
             "|---|---|---|---|---|---|---|"]
    for name in PARTS:
        f = out / f"{name}.json"
        if not f.is_file():
            continue
        doc = json.loads(f.read_text())
        for r in doc["rows"]:
            if name == "verify":
                for s in r.get("settings", []):
                    lines.append(f"| fragmentation_oom | verify {s['config']} | "
                                 f"{'confirmed' if s['confirmed'] else 'refuted' if s['confirmed'] is False else s['why']}"
                                 f" | | | {s['seconds']} | |")
                continue
            tried = " ".join(f"{t[0]}{'' if t[1] == 'ran' else '*' if t[1] == 'oom' else '!'}"
                             for t in r.get("tried", []))
            lines.append(f"| {name} | {r['tool']} | {r.get('answer')} | {r.get('versus_fit', '')} | "
                         f"{r.get('trials', '')} | {r.get('seconds', '')} | {tried} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--start", type=int, default=32, help="oomdoctor fit's recorded first micro-batch")
    ap.add_argument("--high", type=int, default=512)
    ap.add_argument("--peer-start", type=int, default=256, help="auto_find_batch_size's starting batch")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per tool run (a hung one is killed)")
    ap.add_argument("--vit-cap-gib", type=float, default=8.0, help="the ViT job's memory-fraction cap (GiB)")
    ap.add_argument("--vit-peer-start", type=int, default=512, help="find_executable_batch_size's start on ViT")
    ap.add_argument("--vit-peer-timeout", type=float, default=90, help="seconds for find_executable_batch_size on ViT")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in a.parts.split(","):
        if name not in PARTS:
            sys.exit(f"fit_vs_peers.py: unknown part {name!r}; one of {', '.join(PARTS)}")
        t0 = time.perf_counter()
        doc = part(name, out, a)
        doc["seconds"] = round(time.perf_counter() - t0, 2)
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
        print(f"{name}: {doc['seconds']} s", flush=True)
    (out / "summary.md").write_text(table(out))
    print(table(out))


if __name__ == "__main__":
    main()
