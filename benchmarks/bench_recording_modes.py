"""Recording overhead by mode, side by side, on two real jobs; and whether the reports name the same sites.

Jobs (both seeded, so every run allocates the same sizes in the same order):

- ``trainer``: ``scenarios/trainer_gpt2.py``, Hugging Face Trainer, GPT-2 124M, bf16, AdamW, DDP over 2 GPUs,
  micro-batch 8 x 1024, under ``torchrun --standalone``.
- ``loop``: ``scenarios/plain_loop.py``, a plain loop on 1 GPU: GPT-2 124M, bf16 autocast, fused AdamW,
  micro-batch 8 x 1024.

Modes (``MODES``): ``plain`` (no recording); ``default`` (``oomdoctor run --stack-steps all``: Python stacks at
every allocation, today's default); ``none`` (``--stacks none``); ``new`` (``--stack-steps 3/10``: stacks in
steps 0-2 and every 10th step, none between); ``new4`` (``--stack-steps 3/4``). To split the cost of
``default`` between PyTorch and oomdoctor: ``torch-python`` and ``torch-none`` start PyTorch's recorder alone
(``context="alloc"`` / ``None``, Python stacks, 100,000 entries) at CUDA's initialisation from a
``sitecustomize`` of this benchmark, with no oomdoctor code in the job and no dump; ``hooks`` is
``oomdoctor run`` with everything of ours (the injection, the optimizer step hook, the tensor notes, the
dump at exit) but the allocator's history never turned on.

Runs: ``--lanes`` lists GPU groups; the trainer takes a whole lane (2 GPUs), the loop the lane's first GPU.
Lanes run at the same time (``0,1;2,3``: two jobs at once; ``--lanes 0,1`` runs one job at a time). Jobs are
ordered repetition by repetition, the modes' order rotating every repetition, so every mode meets the same
neighbours and drift hits all; a budget stops new jobs once it is spent (the finished repetitions are
complete). A run's figure is the median duration of steps 6..N on rank 0 (each step timed after a
``torch.cuda.synchronize()``); for the ``K/N`` modes the steps with and without stacks are also given apart.
A failed job is recorded (exit code, stderr tail) and the rest go on.

Sites: for repetition 0 the benchmark runs ``oomdoctor diagnose --format json`` on every recorded mode's
snapshots and compares each rank's largest holders (at the OOM, else the peak allocated) and ``top_sites``
with ``default``'s: the same labels, and bytes within 1%.

    python benchmarks/bench_recording_modes.py --out OUTDIR            # 4 GPUs, about 7 minutes

Writes ``OUTDIR/results.json`` (rewritten after every job) and ``OUTDIR/diagnose-<job>-<mode>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"trainer": ROOT / "scenarios" / "trainer_gpt2.py", "loop": ROOT / "scenarios" / "plain_loop.py"}

#: mode -> (``oomdoctor run`` options or None for no ``oomdoctor run``, extra environment)
MODES: dict[str, tuple[list[str] | None, dict[str, str]]] = {
    "plain": (None, {}),
    "default": (["--stack-steps", "all"], {}),
    "none": (["--stacks", "none"], {}),
    "new": (["--stack-steps", "3/10"], {}),
    "new4": (["--stack-steps", "3/4"], {}),
    "torch-python": (None, {"BENCH_TORCH_CONTEXT": "alloc"}),
    "torch-none": (None, {"BENCH_TORCH_CONTEXT": "none"}),
    "hooks": ([], {"BENCH_NO_HISTORY": "1"}),
}
PLANS = {"new": (3, 10), "new4": (3, 4)}
FIRST_TIMED = 4  # durations[k] is step k+1 (from 0): steps 5.. (from 0), i.e. 6..N counted from 1

SITECUSTOMIZE = '''"""The benchmark's sitecustomize: PyTorch's recorder alone (BENCH_TORCH_CONTEXT), or oomdoctor without
the allocator's history (BENCH_NO_HISTORY). Chains to the sitecustomize it shadows."""
import os
import sys


def _chain():
    import importlib.machinery
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)


def _torch_alone(context):
    import importlib.abc
    import importlib.util

    def start():
        import torch
        torch.cuda.memory._record_memory_history("all", context=None if context == "none" else context,
                                                 stacks="python", max_entries=100000)

    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "torch":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec("torch")
            real = spec.loader.exec_module

            def exec_module(module):
                real(module)
                module.cuda._lazy_call(start)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Hook())


def _no_history():
    from oomdoctor.capture import recorder

    def enable(self, clear):
        self.recording = True
    recorder.Recorder._enable = enable
    recorder.Recorder._switch_stacks = lambda self, on: None


if os.environ.get("BENCH_TORCH_CONTEXT"):
    _torch_alone(os.environ["BENCH_TORCH_CONTEXT"])
if os.environ.get("BENCH_NO_HISTORY"):
    _no_history()
_chain()
'''


def stacked(plan: tuple[int, int], step: int) -> bool:
    first, every = plan
    return step < first or (every > 0 and step % every == 0)


def job_cmd(job: str, mode: str, steps: int, times: Path, out: Path, work: Path, nproc: int) -> list[str]:
    if job == "trainer":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(SCRIPTS[job]), "--steps", str(steps), "--times", str(times), "--output-dir", str(work / "hf")]
    else:
        cmd = [sys.executable, str(SCRIPTS[job]), "--steps", str(steps), "--times", str(times)]
    opts = MODES[mode][0]
    if opts is not None:
        cmd = [sys.executable, "-m", "oomdoctor", "run", "--out", str(out), "--no-diagnose", *opts, "--", *cmd]
    return cmd


def run_job(spec: dict, gpus: list[str], work: Path, site_dir: Path, steps: int, timeout_s: float) -> dict:
    job, mode, rep = spec["job"], spec["mode"], spec["rep"]
    tag = f"{job}-{mode}-{rep}"
    jw = work / tag
    jw.mkdir(parents=True)
    times, out = jw / "times.json", jw / "out"
    use = gpus if job == "trainer" else gpus[:1]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(use), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **MODES[mode][1])
    if MODES[mode][1]:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(work / "site"), str(ROOT / "src"), env.get("PYTHONPATH"))
                                            if p)
    cmd = job_cmd(job, mode, steps, times, out, jw, len(use))
    res: dict = {"job": job, "mode": mode, "rep": rep, "gpus": use, "cmd": cmd[-12:]}
    t0 = time.perf_counter()
    # a session of its own: on a timeout the whole group (torchrun and its workers) is killed
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT), env=env,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        rc = f"timeout after {timeout_s} s"
    res["wall_s"] = round(time.perf_counter() - t0, 3)
    res["rc"] = rc
    if rc != 0:
        res["error"] = (err or "")[-3000:]
    try:
        ends = json.loads(times.read_text())["step_end_s"]
        durations = [b - a for a, b in zip(ends, ends[1:])]  # durations[k]: step k+1 (from 0)
        timed = list(range(FIRST_TIMED, len(durations)))
        res["median_step_s"] = statistics.median(durations[k] for k in timed)
        res["mean_step_s"] = statistics.mean(durations[k] for k in timed)
        res["step_s"] = [round(d, 6) for d in durations]
        if mode in PLANS:
            on = [durations[k] for k in timed if stacked(PLANS[mode], k + 1)]
            off = [durations[k] for k in timed if not stacked(PLANS[mode], k + 1)]
            res["median_stacked_step_s"] = statistics.median(on) if on else None
            res["median_unstacked_step_s"] = statistics.median(off) if off else None
    except Exception as e:  # noqa: BLE001 - the job failed before writing its times
        res["times_error"] = f"{type(e).__name__}: {e}"
    if out.is_dir():
        metas = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.meta.json"))]
        res["dump"] = [m.get("dump") for m in metas]
        res["recording"] = [m.get("recording") for m in metas[:1]]
        res["stack_markers"] = [len(m.get("stack_markers") or []) for m in metas]
        res["snapshot_bytes"] = [p.stat().st_size for p in sorted(out.glob("rank*.pickle"))]
        if rep == 0:
            shutil.copytree(out, site_dir / f"{job}-{mode}")
    shutil.rmtree(jw, ignore_errors=True)
    return res


def holders(report: dict) -> list[dict]:
    out = []
    for r in report.get("ranks", []):
        out.append({"rank": r.get("rank"), "peak_allocated_bytes": r.get("peak_allocated_bytes"),
                    "holders": [(h["label"], h["bytes"]) for h in r.get("holders", [])[:8]],
                    "top_sites": [(h["label"], h["bytes"]) for h in r.get("top_sites", [])[:8]]})
    return out


def same_sites(a: list, b: list, top: int = 5) -> dict:
    """The first ``top`` (label, bytes) of ``a`` (the baseline) against ``b``: labels in ``b``'s first ``top``
    (as a set) and each label's bytes within 1%."""
    a, bmap = a[:top], dict(b)
    labels_same = {x for x, _ in a} == {x for x, _ in b[:top]}
    worst = max((abs(bmap.get(lab, 0) - n) / n for lab, n in a if n), default=0.0)
    return {"same_labels": labels_same, "worst_bytes_diff": round(worst, 5), "bytes_within_1pct": worst <= 0.01}


def compare_sites(site_dir: Path, out: Path, jobs: list[str], modes: list[str], timeout_s: float) -> dict:
    procs = {}
    for job in jobs:
        for mode in modes:
            d = site_dir / f"{job}-{mode}"
            if d.is_dir() and MODES[mode][0] is not None:
                dest = out / f"diagnose-{job}-{mode}.json"
                procs[(job, mode)] = (subprocess.Popen(
                    [sys.executable, "-m", "oomdoctor", "diagnose", "--format", "json", "-o", str(dest), str(d)],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT)), dest)
    reports = {}
    deadline = time.perf_counter() + timeout_s
    for key, (p, dest) in procs.items():
        try:
            _, err = p.communicate(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            p.kill()
            reports[key] = {"error": "diagnose timed out"}
            continue
        try:
            reports[key] = holders(json.loads(dest.read_text()))
        except Exception as e:  # noqa: BLE001
            reports[key] = {"error": f"rc {p.returncode}: {type(e).__name__}: {e}; {err[-1500:]}"}
    result: dict = {}
    for job in jobs:
        base = reports.get((job, "default"))
        for mode in modes:
            got = reports.get((job, mode))
            if got is None or mode == "default":
                continue
            entry: dict = {"mode": got if isinstance(got, dict) else None}
            if isinstance(base, list) and isinstance(got, list):
                entry = {"ranks": []}
                for rb, rg in zip(base, got):
                    entry["ranks"].append({
                        "rank": rb["rank"], "peak_default": rb["peak_allocated_bytes"],
                        "peak_mode": rg["peak_allocated_bytes"],
                        "holders": same_sites(rb["holders"], rg["holders"]),
                        "top_sites": same_sites(rb["top_sites"], rg["top_sites"]),
                        "holders_default": rb["holders"], "holders_mode": rg["holders"]})
            else:
                entry["default"] = base
                entry["mode"] = got
            result[f"{job}/{mode}"] = entry
    return result


def summarize(runs: list[dict]) -> dict:
    out: dict = {}
    for job in sorted({r["job"] for r in runs}):
        ok = [r for r in runs if r["job"] == job and r.get("median_step_s")]
        med = {m: statistics.median(r["median_step_s"] for r in ok if r["mode"] == m)
               for m in sorted({r["mode"] for r in ok})}
        entry: dict = {"median_step_s": med, "runs": {m: sum(1 for r in ok if r["mode"] == m) for m in med}}
        if "plain" in med:
            entry["overhead_pct"] = {m: round(100 * (v / med["plain"] - 1), 2) for m, v in med.items() if m != "plain"}
            plain_by_rep = {r["rep"]: r["median_step_s"] for r in ok if r["mode"] == "plain"}
            entry["overhead_pct_per_rep"] = {
                m: [round(100 * (r["median_step_s"] / plain_by_rep[r["rep"]] - 1), 2) for r in ok
                    if r["mode"] == m and r["rep"] in plain_by_rep] for m in med if m != "plain"}
        split = {m: {"stacked": [r.get("median_stacked_step_s") for r in ok if r["mode"] == m],
                     "unstacked": [r.get("median_unstacked_step_s") for r in ok if r["mode"] == m]}
                 for m in med if m in PLANS}
        if split:
            entry["stacked_vs_unstacked_step_s"] = split
        entry["failed"] = [{k: r.get(k) for k in ("mode", "rep", "rc")} for r in runs
                           if r["job"] == job and not r.get("median_step_s")]
        out[job] = entry
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for results.json and the diagnose reports")
    p.add_argument("--lanes", default="0,1;2,3", help="GPU groups that run jobs at the same time, ';'-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--trainer-modes", default="plain,default,none,new,new4,torch-python,torch-none,hooks")
    p.add_argument("--loop-modes", default="plain,default,none,new")
    p.add_argument("--budget-s", type=float, default=400.0, help="no job starts after this (seconds from start)")
    p.add_argument("--job-timeout-s", type=float, default=150.0)
    p.add_argument("--diagnose-timeout-s", type=float, default=60.0)
    a = p.parse_args()
    t_start = time.perf_counter()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = {"trainer": [m for m in a.trainer_modes.split(",") if m], "loop": [m for m in a.loop_modes.split(",") if m]}
    bad = [m for ms in modes.values() for m in ms if m not in MODES]
    if bad:
        raise SystemExit(f"unknown modes {bad}: expected some of {', '.join(MODES)}")
    lanes = [lane.split(",") for lane in a.lanes.split(";") if lane]
    specs = []
    for rep in range(a.reps):
        for job in ("trainer", "loop"):
            ms = modes[job]
            for mode in (ms[rep % len(ms):] + ms[:rep % len(ms)]) if ms else []:
                specs.append({"job": job, "mode": mode, "rep": rep})
    q: queue.Queue = queue.Queue()
    for s in specs:
        q.put(s)
    runs: list[dict] = []
    lock = threading.Lock()
    info: dict = {"lanes": lanes, "steps": a.steps, "reps": a.reps, "modes": modes, "concurrent_lanes": len(lanes),
                  "timed_steps": f"{FIRST_TIMED + 2}..{a.steps} (from 1)", "plans": PLANS}
    try:
        import torch
        import transformers
        info |= {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                 "torch": torch.__version__, "transformers": transformers.__version__}
    except Exception as e:  # noqa: BLE001
        info["versions_error"] = str(e)
    longest = [0.0]

    def write(extra: dict | None = None) -> None:
        with lock:
            doc = {**info, "elapsed_s": round(time.perf_counter() - t_start, 1), "summary": summarize(runs),
                   **(extra or {}), "runs": runs}
        (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        (work / "site").mkdir()
        (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        site_dir = work / "sites"
        site_dir.mkdir()

        def lane_worker(i: int, gpus: list[str]) -> None:
            while True:
                elapsed = time.perf_counter() - t_start
                if elapsed + longest[0] > a.budget_s:
                    return
                try:
                    spec = q.get_nowait()
                except queue.Empty:
                    return
                r = run_job(spec, gpus, work, site_dir, a.steps, a.job_timeout_s)
                r["lane"] = i
                with lock:
                    runs.append(r)
                    longest[0] = max(longest[0], r["wall_s"])
                print(json.dumps({k: v for k, v in r.items() if k not in ("step_s", "cmd", "error")}), flush=True)
                if r.get("error"):
                    print(r["error"][-800:], file=sys.stderr, flush=True)
                write()

        threads = [threading.Thread(target=lane_worker, args=(i, g)) for i, g in enumerate(lanes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        skipped = [s for s in specs if not any(r["job"] == s["job"] and r["mode"] == s["mode"] and r["rep"] == s["rep"]
                                               for r in runs)]
        write({"skipped_for_budget": skipped})
        sites = compare_sites(site_dir, out, ["trainer", "loop"], sorted(set(modes["trainer"]) | set(modes["loop"])),
                              a.diagnose_timeout_s)
        write({"skipped_for_budget": skipped, "sites": sites})
    doc = json.loads((out / "results.json").read_text())
    print(json.dumps({k: doc[k] for k in ("summary", "elapsed_s")}, indent=1))
    for key, entry in doc.get("sites", {}).items():
        for r in entry.get("ranks", []):
            print(key, "rank", r["rank"], "holders", r["holders"], "top_sites", r["top_sites"])


if __name__ == "__main__":
    main()
