"""Round 14's device work for issue 49 (items 3-5), driven from ``benchmarks/device/round14_calib.sh``: record the new
kinds of job (``scenarios/round14_jobs.py``; halves in ``docs/corpus/round14_split.json``, committed before any was
recorded), sweep each to the largest micro-batch that runs, rerun each OOM with every allocator setting
``diagnose`` tries for it (its claims), and run the answers of what fits that no sweep ran yet
(``docs/corpus/round14_pending.json``).

    python3 scenarios/round14_calib.py --out DIR --part one [--budget-s 330]    # 1 GPU: every single-GPU kind at once
    python3 scenarios/round14_calib.py --out DIR --part two [--budget-s 330]    # 2 GPUs: fsdp2-ac-edge, stage0-1f1b-real

Every kind runs in its own thread at the same time (each process under its own memory-fraction cap, 8-14 GiB, so
together they stay below the GPU's memory); within a kind, in order:

1. ``probe``: one process finds the largest batch that runs (doubling, then bisection to 2%): a guess;
2. ``confirm``: fresh processes, unrecorded, at the guess and the probe's first OOM, stepping down (up) while the
   guess fails (the next passes): the largest that ran and the first that ran out, the sweep's truth;
3. ``record``: both under ``oomdoctor run`` (snapshots + sidecars + the job's ground truth): the OOM recording is
   what ``diagnose`` claims from, the other what it sizes from;
4. ``rerun``: the first OOM, unrecorded, with each setting the verdict tries (``expandable_segments:True`` twice,
   for the spread between reruns of one step; ``max_split_size_mb`` at half the failed request;
   ``garbage_collection_threshold:0.8``, every run being capped).

Kinds whose question is not a sweep: ``kept-exception-retry`` (recorded retrying inside the ``except`` block and
after it, at twice the probe's largest batch), ``optimizer-step-oom`` (recorded with Adam; rerun with SGD, and with
Adam at an eighth of the batch: a smaller micro-batch does not help), ``gnn-varsize-cap``
(``scenarios/graphsage_gc.py``, its own runs). Then, alone on the GPU, the pending answers of what fits.

Writes ``DIR/rows.jsonl`` (one row per process: kind, half, stage, batch, setting, exit code, the job's truth) and
``DIR/rec/<kind>/<run>/`` (recordings). Never raises: a failed part is a row with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = [sys.executable]
JOBS = PY + [os.path.join(HERE, "round14_jobs.py")]
SPLIT = json.load(open(os.path.join(ROOT, "docs", "corpus", "round14_split.json")))["kinds"]

#: kind -> (arguments, cap GiB, probe range)
ONE = {
    "llama-256k-first-backward": (["--seq", "512"], 12, "1:64"),
    "moco-bank": ([], 12, "8:1024"),
    "stage0-1f1b": (["--seq", "512", "--micro-batches", "4", "--layers", "8"], 12, "1:128"),
    "moe-edge": (["--seq", "512"], 12, "1:128"),
}
LOCK = threading.Lock()
DRY = False
"""--dry: every job with --cpu (tiny shapes, no cap), nothing recorded: the driver's own flow on a machine without a GPU."""


def write(out: str, row: dict) -> None:
    with LOCK, open(os.path.join(out, "rows.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def run(out: str, kind: str, stage: str, cmd: list[str], *, batch: int | None = None, conf: str = "",
        record: str | None = None, timeout: int = 150, extra: dict | None = None, truth_arg: bool = True) -> dict:
    """One process; its row (the job's truth merged in). ``record``: a run directory under ``out/rec/kind``."""
    d = os.path.join(out, "rec", kind, record) if record else os.path.join(out, "tmp", kind, f"{stage}-{batch}-{conf}")
    os.makedirs(d, exist_ok=True)
    truth = os.path.join(d, "ground_truth.json")
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = env["PYTORCH_ALLOC_CONF"] = conf
    wrap = [*PY, "-m", "oomdoctor", "run", "--out", d, "--no-diagnose", "--"] if record and not DRY else []
    full = (wrap + cmd + (["--ground-truth", truth] if truth_arg else [])
            + (["--cpu"] if DRY and "round14_jobs.py" in " ".join(cmd) else []))
    t0 = time.time()
    try:
        with open(os.path.join(d, "job.log"), "w") as log:
            rc = subprocess.run(full, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=ROOT).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    except Exception as e:  # noqa: BLE001 - logged, never aborts the others
        rc = f"error: {e}"
    row = {"kind": kind, "half": SPLIT.get(kind, {}).get("half"), "stage": stage, "batch": batch, "alloc_conf": conf,
           "exit_code": rc, "wall_s": round(time.time() - t0, 1), "recorded": record, **(extra or {})}
    try:
        row.update({k: v for k, v in json.load(open(truth)).items() if k not in row or k == "batch"})
    except Exception:  # noqa: BLE001 - no truth written (killed, or crashed before)
        pass
    row["log"] = os.path.join(d, "job.log")
    try:
        row["log_tail"] = open(row["log"]).read()[-600:]
    except OSError:
        pass
    write(out, row)
    return row


def probe(out: str, kind: str, args: list[str], cap: float, rng: str) -> tuple[int, int] | None:
    d = os.path.join(out, "tmp", kind)
    os.makedirs(d, exist_ok=True)
    r = run(out, kind, "probe", [*JOBS, "--kind", kind, *args, "--cap-gib", str(cap), "--probe", rng, "--steps", "2"])
    try:
        text = open(r["log"]).read()
    except OSError:
        return None
    for ln in text.splitlines():
        if ln.startswith('{"probe"'):
            p = json.loads(ln)
            return p["largest_ran"], p["first_oom"]
    return None


def split_setting(row: dict) -> str | None:
    """``max_split_size_mb`` at half the request the OOM message names (the fragmentation detector's rule)."""
    try:
        from oomdoctor.detectors.fragmentation import split_mb
        from oomdoctor.trace.oommessage import parse_oom_message

        m = parse_oom_message(row.get("oom") or "")
        return f"max_split_size_mb:{split_mb(m.requested_bytes)}" if m and m.requested_bytes else None
    except Exception:  # noqa: BLE001
        return None


def sweep_kind(out: str, kind: str, deadline: float) -> None:
    args, cap, rng = ONE[kind]
    base = [*JOBS, "--kind", kind, *args, "--cap-gib", str(cap)]
    got = probe(out, kind, args, cap, rng)
    if got is None or got[0] == 0:
        write(out, {"kind": kind, "stage": "probe-failed"})
        return
    good, bad = got
    # confirm in fresh processes: step down while the guess runs out, up while the first OOM runs
    ok_row = run(out, kind, "confirm", [*base, "--batch", str(good)], batch=good)
    tries = 0
    while ok_row["exit_code"] != 0 and good > 1 and tries < 3 and time.time() < deadline:
        bad, good = good, max(good - max(1, good // 20), 1)
        ok_row = run(out, kind, "confirm", [*base, "--batch", str(good)], batch=good)
        tries += 1
    bad_row = run(out, kind, "confirm", [*base, "--batch", str(bad)], batch=bad)
    tries = 0
    while bad_row["exit_code"] == 0 and tries < 3 and time.time() < deadline:
        good, bad = bad, bad + max(1, bad // 20)
        bad_row = run(out, kind, "confirm", [*base, "--batch", str(bad)], batch=bad)
        tries += 1
    write(out, {"kind": kind, "stage": "sweep", "largest_ran": good, "first_oom": bad})
    if time.time() > deadline:
        return
    run(out, kind, "record", [*base, "--batch", str(good)], batch=good, record=f"{kind}-b{good}")
    oom = run(out, kind, "record", [*base, "--batch", str(bad)], batch=bad, record=f"{kind}-b{bad}")
    reruns(out, kind, base, bad, oom, deadline)


def reruns(out: str, kind: str, base: list[str], batch: int, oom_row: dict, deadline: float,
           gc: bool = True) -> None:
    settings = ["expandable_segments:True", "expandable_segments:True"]
    split = split_setting(oom_row)
    if split:
        settings.append(split)
    if gc:
        settings.append("garbage_collection_threshold:0.8")
    rec = oom_row.get("recorded")
    for i, conf in enumerate(settings):
        if time.time() > deadline:
            return
        run(out, kind, "rerun", [*base, "--batch", str(batch)], batch=batch, conf=conf,
            extra={"rerun_of": rec, "repeat": i if conf == "expandable_segments:True" else 0})


def kept(out: str, deadline: float) -> None:
    kind = "kept-exception-retry"
    base = [*JOBS, "--kind", kind, "--seq", "512", "--cap-gib", "12", "--steps", "2"]
    got = probe(out, "decoder", ["--seq", "512"], 12, "1:256")  # the same decoder without the retry: its edge
    b = 2 * got[0] if got and got[0] else 64
    for retry in ("inside", "outside"):
        run(out, kind, "record", [*base, "--retry", retry, "--batch", str(b)], batch=b, record=f"{kind}-{retry}-b{b}",
            extra={"retry": retry})


def optimizer(out: str, deadline: float) -> None:
    kind = "optimizer-step-oom"
    base = [*JOBS, "--kind", kind, "--cap-gib", "8", "--width", "8192", "--layers", "8", "--steps", "2"]
    oom = run(out, kind, "record", [*base, "--batch", "64"], batch=64, record=f"{kind}-adam-b64")
    run(out, kind, "rerun", [*base, "--batch", "64", "--optimizer", "sgd"], batch=64,
        extra={"rerun_of": oom.get("recorded"), "variant": "sgd"})
    run(out, kind, "rerun", [*base, "--batch", "8"], batch=8, extra={"rerun_of": oom.get("recorded"),
                                                                     "variant": "batch/8"})
    reruns(out, kind, base, 64, oom, deadline)


def varlen(out: str, deadline: float) -> None:
    kind = "varlen-llama-cap"
    base = [*JOBS, "--kind", kind, "--seq", "2048", "--cap-ratio", "1.10", "--steps", "30"]
    oom = run(out, kind, "record", [*base, "--batch", "8"], batch=8, record=f"{kind}-b8", timeout=200)
    reruns(out, kind, base, 8, oom, deadline)


def gnn(out: str, deadline: float) -> None:
    kind = "gnn-varsize-cap"
    d = os.path.join(out, "rec", kind)
    os.makedirs(d, exist_ok=True)
    run(out, kind, "record", [*PY, os.path.join(HERE, "graphsage_gc.py"), "--out", d, *(["--cpu"] if DRY else [])],
        timeout=200, truth_arg=False)


def pending(out: str, deadline: float) -> None:
    """The answers of what fits on corpus jobs that no sweep ran (docs/corpus/round14_pending.json), alone on the
    GPU: does the answer run?"""
    path = os.path.join(ROOT, "docs", "corpus", "round14_pending.json")
    todo = json.load(open(path)).get("runs", []) if os.path.exists(path) else []
    for item in todo:
        if time.time() + item.get("expected_s", 60) > deadline + 60:
            write(out, {"kind": "pending", "stage": "skipped-budget", **item})
            continue
        cmd = [*PY, os.path.join(ROOT, item["script"]), *item["args"], "--batch", str(item["batch"])]
        run(out, item["job"], "fit-check", cmd, batch=item["batch"], timeout=item.get("timeout", 120),
            extra={"answer_of": item.get("answer_of")})


def two(out: str, deadline: float) -> None:
    """2 GPUs: fsdp2-ac-edge (a coarse sweep under torchrun, then the edge recorded and its OOM rerun) and
    stage0-1f1b-real (rank 0 capped: stage 0 runs out first)."""
    tr = [*PY, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    for kind, args, sizes in (("fsdp2-ac-edge", ["--seq", "1024", "--cap-gib", "10", "--steps", "3"],
                               (2, 4, 6, 8, 12, 16, 24, 32)),
                              ("stage0-1f1b-real", ["--seq", "512", "--cap-gib", "10", "--steps", "2",
                                                    "--micro-batches", "4", "--layers", "8"], (1, 2, 4, 6, 8, 12, 16))):
        base = [*tr, os.path.join(HERE, "round14_jobs.py"), "--kind", kind, *args]
        good = None
        for b in sizes:
            if time.time() > deadline:
                return
            r = run(out, kind, "confirm", [*base, "--batch", str(b)], batch=b, timeout=120)
            if r["exit_code"] != 0:
                write(out, {"kind": kind, "stage": "sweep", "largest_ran": good, "first_oom": b})
                if good:
                    run(out, kind, "record", [*base, "--batch", str(good)], batch=good, record=f"{kind}-b{good}",
                        timeout=150)
                oom = run(out, kind, "record", [*base, "--batch", str(b)], batch=b, record=f"{kind}-b{b}", timeout=150)
                reruns(out, kind, base, b, oom, deadline, gc=True)
                break
            good = b


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--part", choices=("one", "two"), default="one")
    p.add_argument("--budget-s", type=float, default=300)
    p.add_argument("--dry", action="store_true", help="jobs with --cpu, nothing recorded (the driver's flow only)")
    a = p.parse_args()
    global DRY
    DRY = a.dry
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    deadline = t0 + a.budget_s
    if a.part == "two":
        two(a.out, deadline)
        return
    threads = [threading.Thread(target=sweep_kind, args=(a.out, k, deadline - 90)) for k in ONE]
    threads += [threading.Thread(target=f, args=(a.out, deadline - 90)) for f in (kept, optimizer, varlen, gnn)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # every process has its own timeout; the pending checks need the GPU to themselves
    pending(a.out, deadline)
    write(a.out, {"stage": "done", "wall_s": round(time.time() - t0, 1)})


if __name__ == "__main__":
    main()
