"""Record the real-job corpus on GPUs: third-party training loops under ``oomdoctor run``, each with a
batch sweep that finds the largest per-device micro-batch that fits (docs/corpus/README.md).

Every run is recorded (recording changes nothing the job allocates) and measures its own ground truth
(scenarios/_truth.py). The sweep for a job: two small batches give memory per sample; the batch that
should just fit is tried, then one sweep step more, stepping until a fitting batch sits next to an
OOMing one. Kept per job: the largest fitting run and the first OOMing one (snapshots, sidecars, ground
truth, log), and one JSON line per run in ``<job>-sweep.jsonl``; the other runs keep ground truth and log
only. Extra single runs (``EXTRA``) are recorded as they are. Everything lands in ``--out``.

    python3 scenarios/record_corpus.py --out $OUT --jobs trainer-fsdp2,lightning-fsdp --budget-s 540
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

TORCHRUN1 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
PY = [sys.executable]

# name -> (command before the batch option, sweep step, first two batches)
JOBS: dict[str, tuple[list[str], int, tuple[int, int]]] = {
    "trainer-fsdp2-gpt2": (TORCHRUN + ["scenarios/trainer_gpt2.py", "--fsdp", "--steps", "3",
                                       "--output-dir", "/tmp/hf-fsdp"], 8, (32, 64)),
    "trainer-ddp-gpt2": (TORCHRUN + ["scenarios/trainer_gpt2.py", "--steps", "3", "--output-dir", "/tmp/hf-ddp"],
                         8, (48, 80)),
    "lightning-fsdp-gpt2": ([sys.executable, "scenarios/lightning_gpt2.py", "--devices", "2", "--strategy", "fsdp",
                             "--steps", "3"], 8, (32, 64)),
    "accelerate-ddp-llama": (TORCHRUN + ["scenarios/accelerate_llama.py", "--steps", "2", "--grad-accum", "2"],
                             4, (8, 16)),
    "compiled-lm": ([sys.executable, "scenarios/compiled_loop.py", "--steps", "5"], 32, (64, 128)),
    # the kinds added for issues 25/26 (docs/corpus/README.md says which half each run is in)
    "deepspeed-z1-gpt2": (TORCHRUN1 + ["scenarios/deepspeed_gpt2.py", "--stage", "1", "--steps", "3"], 8, (72, 88)),
    "deepspeed-z2-gpt2": (TORCHRUN1 + ["scenarios/deepspeed_gpt2.py", "--stage", "2", "--steps", "3"], 8, (72, 88)),
    "pipeline-gpipe": (PY + ["scenarios/pipeline_single.py", "--schedule", "gpipe", "--micro-batches", "8"], 4,
                       (16, 24)),
    "generate-mha": (PY + ["scenarios/generate_kv.py", "--model", "mha"], 256, (2048, 3072)),
    "generate-gqa": (PY + ["scenarios/generate_kv.py", "--model", "gqa"], 512, (4096, 6144)),
    "pipelining-1f1b": (TORCHRUN + ["scenarios/pipelining_1f1b.py", "--micro-batches", "8"], 4, (24, 40)),
}

# name -> command of a single recorded run (no sweep)
EXTRA: dict[str, list[str]] = {
    "lightning-ddp-gpt2-val-logits": [sys.executable, "scenarios/lightning_gpt2.py", "--devices", "2",
                                      "--strategy", "ddp", "--steps", "3", "--batch", "8",
                                      "--validate-samples", "3200", "--val-batch", "8", "--keep-val-logits"],
    "trainer-ddp-gpt2-b96-expandable": TORCHRUN + ["scenarios/trainer_gpt2.py", "--steps", "4", "--batch", "96",
                                                  "--output-dir", "/tmp/hf-exp"],
}
EXPANDABLE = {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
# between the sweep's points, where the simulator's "what fits" lands: does it fit?
EXTRA.update({
    "trainer-ddp-gpt2-b92": TORCHRUN + ["scenarios/trainer_gpt2.py", "--steps", "3", "--batch", "92",
                                        "--output-dir", "/tmp/hf-92"],
    "trainer-fsdp2-gpt2-b116": JOBS["trainer-fsdp2-gpt2"][0] + ["--batch", "116"],
    "lightning-fsdp-gpt2-b100": JOBS["lightning-fsdp-gpt2"][0] + ["--batch", "100"],
    "trainer-fsdp2-gpt2-b120-expandable": JOBS["trainer-fsdp2-gpt2"][0] + ["--batch", "120"],
    "accelerate-ddp-llama-b76-expandable": JOBS["accelerate-ddp-llama"][0] + ["--batch", "76"],
    "lightning-fsdp-gpt2-b104-expandable": JOBS["lightning-fsdp-gpt2"][0] + ["--batch", "104"],
})
EXTRA.update({
    "deepspeed-z3-gpt2-b16": TORCHRUN1 + ["scenarios/deepspeed_gpt2.py", "--stage", "3", "--steps", "3", "--batch", "16"],
    "own-optimizer-adam": PY + ["scenarios/own_optimizer.py", "--optimizer", "adam", "--batch", "8", "--steps", "4"],
    "own-optimizer-lion": PY + ["scenarios/own_optimizer.py", "--optimizer", "lion", "--batch", "8", "--steps", "4"],
    "eval-no-grad-decoder": PY + ["scenarios/eval_no_grad.py", "--model", "decoder"],
    "eval-no-grad-gpt2": PY + ["scenarios/eval_no_grad.py", "--model", "gpt2"],
    "empty-cache-loop": PY + ["scenarios/empty_cache_loop.py", "--batch", "16", "--steps", "12"],
    "trainer-gpt2-eval-accumulation-steps": PY + ["scenarios/trainer_gpt2.py", "--steps", "4", "--batch", "16",
                                                  "--eval-samples", "64", "--eval-batch", "16",
                                                  "--eval-accumulation-steps", "2", "--output-dir", "/tmp/hf-eval"],
    # recorded as users record: oomdoctor run's defaults over 50+ steps (the ring buffer wraps), and plain
    # _record_memory_history(max_entries=100000) + _dump_snapshot() with no sidecar (PLAIN below)
    "wrapped-trainer-ddp-gpt2-b32": TORCHRUN + ["scenarios/trainer_gpt2.py", "--steps", "60", "--batch", "32",
                                                "--output-dir", "/tmp/hf-wrap"],
    "wrapped-accelerate-ddp-llama-b16": TORCHRUN + ["scenarios/accelerate_llama.py", "--steps", "50", "--batch", "16",
                                                    "--grad-accum", "2"],
    "plain-record-gpt2": PY + ["scenarios/plain_record.py", "--model", "gpt2", "--batch", "16", "--steps", "40",
                               "--snapshot", "{dir}/snapshot.pickle"],
    "plain-record-resnet50": PY + ["scenarios/plain_record.py", "--model", "resnet50", "--batch", "64", "--steps", "80",
                                   "--snapshot", "{dir}/snapshot.pickle"],
    # out of memory inside the first forward pass: a batch set far too high (the sweeps above give the truth)
    "first-forward-trainer-ddp-gpt2-b160": TORCHRUN + ["scenarios/trainer_gpt2.py", "--steps", "2", "--batch", "160",
                                                       "--output-dir", "/tmp/hf-ff"],
    "first-forward-accelerate-ddp-llama-b128": TORCHRUN + ["scenarios/accelerate_llama.py", "--steps", "2",
                                                           "--batch", "128", "--grad-accum", "2"],
})
PLAIN = {"plain-record-gpt2", "plain-record-resnet50"}
"""Runs that record themselves (no ``oomdoctor run``)."""
EXTRA_ENV = {name: EXPANDABLE for name in EXTRA if name.endswith("-expandable")}


def run(work: str, name: str, cmd: list[str], env_extra: dict | None = None, timeout_s: int = 240,
        record: bool = True) -> dict:
    """One run under ``oomdoctor run`` into ``work/name`` (names in :data:`PLAIN` record themselves, and
    ``record=False`` runs the job bare); returns its ground truth plus exit code and time. ``{dir}`` in
    ``cmd`` is the run's directory."""
    d = os.path.join(work, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    env = dict(os.environ, **(env_extra or {}))
    cmd = [c.replace("{dir}", d) for c in cmd]
    bare = name in PLAIN or not record
    wrap = [] if bare else [sys.executable, "-m", "oomdoctor", "run", "--out", d, "--no-diagnose", "--"]
    full = wrap + cmd + ["--ground-truth", os.path.join(d, "ground_truth.json")]
    t0 = time.time()
    with open(os.path.join(d, "job.log"), "w") as log:
        try:
            rc = subprocess.run(full, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    try:
        with open(os.path.join(d, "ground_truth.json")) as f:
            truth = json.load(f)
    except (OSError, ValueError):
        truth = {}
    truth.update(run=name, exit_code=rc, wall_s=round(time.time() - t0, 1))
    print(f"{name}: exit {rc} in {truth['wall_s']} s, max reserved {truth.get('max_memory_reserved')}", flush=True)
    return truth


def command_of(name: str) -> list[str]:
    """The command of a corpus run by its name: a single run of :data:`EXTRA`, or a sweep job's run
    ``<job>-b<batch>``."""
    if name in EXTRA:
        return EXTRA[name]
    job, _, batch = name.rpartition("-b")
    return JOBS[job][0] + ["--batch", batch]


def rerun(work: str, out: str, item: str, deadline: float) -> None:
    """``<run>@<PYTORCH_ALLOC_CONF value>``: the run again under that allocator setting, unrecorded (only
    whether it completes, and its peaks, count), one JSON line in ``reruns.jsonl``."""
    name, _, conf = item.partition("@")
    slug = conf.replace(":", "-").replace(",", "_")
    t = run(work, f"{name}@{slug}", command_of(name), {"PYTORCH_ALLOC_CONF": conf},
            timeout_s=int(max(30, min(240, deadline + 30 - time.time()))), record=False)
    t.update(rerun_of=name, alloc_conf=conf)
    with open(os.path.join(out, "reruns.jsonl"), "a") as f:
        f.write(json.dumps(t) + "\n")


def fits(t: dict) -> bool:
    return t.get("exit_code") == 0


def sweep(work: str, out: str, job: str, deadline: float, max_runs: int = 99, resume: bool = False) -> None:
    cmd, step, (b0, b1) = JOBS[job]
    rows: dict[int, dict] = {}
    resumed = False
    if resume:  # go on from the runs docs/corpus already holds for this job
        prior = os.path.join(os.path.dirname(HERE), "docs", "corpus", f"{job}-sweep.jsonl")
        if os.path.exists(prior):
            for ln in open(prior).read().splitlines():
                r = json.loads(ln)
                rows[int(r.get("batch") or r["run"].rsplit("-b", 1)[1])] = r
        max_runs += len(rows)
    resumed = bool(rows)

    def at(b: int) -> dict:
        if b not in rows:
            rows[b] = run(work, f"{job}-b{b}", cmd + ["--batch", str(b)],
                          timeout_s=int(max(30, min(240, deadline + 30 - time.time()))))
            with open(os.path.join(out, f"{job}-sweep.jsonl"), "a") as f:
                f.write(json.dumps(rows[b]) + "\n")
        return rows[b]

    def boundary() -> tuple[int | None, int | None]:
        ok = [b for b, t in rows.items() if fits(t)]
        bad = [b for b, t in rows.items() if not fits(t)]
        hi_ok = max(ok, default=None)
        lo_bad = min((b for b in bad if hi_ok is None or b > hi_ok), default=None)
        return hi_ok, lo_bad

    at(b0)
    if fits(rows[b0]) and not resumed:
        t1 = at(b1)
        if fits(t1) and all(k in t for t in (rows[b0], t1) for k in ("max_memory_reserved", "gpu_total_memory_bytes",
                                                                        "device_free_at_end_bytes")):
            r0, r1 = rows[b0]["max_memory_reserved"], t1["max_memory_reserved"]
            usable = t1["gpu_total_memory_bytes"] - max(0, t1["gpu_total_memory_bytes"] - t1["device_free_at_end_bytes"]
                                                         - r1)
            per = max((r1 - r0) / (b1 - b0), 1)
            guess = b1 + int((0.96 * usable - r1) / per) // step * step
            at(max(guess, b1 + step))
    while time.time() < deadline - 20 and len(rows) < max_runs:
        hi_ok, lo_bad = boundary()
        if hi_ok is not None and lo_bad is not None and lo_bad - hi_ok <= step:
            break
        if lo_bad is None:
            nxt = hi_ok + step
        elif hi_ok is None:
            nxt = max(step, lo_bad - step)
        else:
            nxt = hi_ok + max(step, (lo_bad - hi_ok) // 2 // step * step)
        if nxt in rows or nxt <= 0:
            break
        at(nxt)
    hi_ok, lo_bad = boundary()
    for b in list(rows):
        d = os.path.join(work, f"{job}-b{b}")
        if not os.path.isdir(d):
            continue  # recorded in an earlier session
        if b in (hi_ok, lo_bad):
            archive(work, out, f"{job}-b{b}")
        else:
            keep = [p for p in os.listdir(d) if p in ("ground_truth.json", "job.log")]
            small = os.path.join(work, f"{job}-b{b}-truth")
            os.makedirs(small, exist_ok=True)
            for p in keep:
                shutil.copy(os.path.join(d, p), small)
            archive(work, out, f"{job}-b{b}-truth")
    print(f"{job}: largest fitting {hi_ok}, first OOM {lo_bad}", flush=True)


def archive(work: str, out: str, name: str) -> None:
    subprocess.run(["tar", "-C", work, "-cf", os.path.join(out, "runs", f"{name}.tar"), name], check=False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--jobs", default="", help="comma-separated sweep jobs")
    p.add_argument("--extra", default="", help="comma-separated single runs")
    p.add_argument("--plan", default="", help="comma-separated sweep jobs and single runs, in the order given "
                                              "(after --extra and --jobs)")
    p.add_argument("--max-sweep-runs", type=int, default=99)
    p.add_argument("--resume", action="store_true", help="sweeps go on from docs/corpus/<job>-sweep.jsonl")
    p.add_argument("--budget-s", type=float, default=540)
    a = p.parse_args()
    deadline = time.time() + a.budget_s
    os.chdir(os.path.dirname(HERE))
    work = "/tmp/corpus-work"
    os.makedirs(os.path.join(a.out, "runs"), exist_ok=True)
    names = [n for n in (a.extra + "," + a.jobs + "," + a.plan).split(",") if n]
    for name in names:
        if time.time() > deadline - (90 if name in JOBS else 40):
            print(f"{name}: skipped (time)", flush=True)
            continue
        if "@" in name:
            try:
                rerun(work, a.out, name, deadline)
            except Exception as e:  # noqa: BLE001 - one job's failure must not stop the queue
                print(f"{name}: rerun failed: {type(e).__name__}: {e}", flush=True)
            continue
        if name in JOBS:
            try:
                sweep(work, a.out, name, deadline, a.max_sweep_runs, a.resume)
            except Exception as e:  # noqa: BLE001 - one job's failure must not stop the queue
                print(f"{name}: sweep failed: {type(e).__name__}: {e}", flush=True)
            continue
        if name not in EXTRA:  # one more point of a sweep, between the ones it has: <job>-b<batch>
            job = name.rpartition("-b")[0]
            t = run(work, name, command_of(name), timeout_s=int(max(30, min(240, deadline + 30 - time.time()))),
                    record=False)
            t.setdefault("batch", int(name.rpartition("-b")[2]))
            with open(os.path.join(a.out, f"{job}-sweep-extra.jsonl"), "a") as f:
                f.write(json.dumps(t) + "\n")
            continue
        t = run(work, name, EXTRA[name], EXTRA_ENV.get(name),
                timeout_s=int(max(30, min(240, deadline + 30 - time.time()))))
        with open(os.path.join(a.out, "extra.jsonl"), "a") as f:
            f.write(json.dumps(t) + "\n")
        archive(work, a.out, name)


if __name__ == "__main__":
    main()
