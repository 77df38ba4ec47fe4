"""A micro-batch sweep of five new kinds of job (``scenarios/new_kinds.py``), with one recorded snapshot each, on
one GPU, for what-fits (issue 35, item 6a). Run it on a bare GPU machine (torch 2.11, no network)::

    python3 scenarios/sweep_new_kinds.py --out $OUT                  # all five kinds, at most 9 minutes
    python3 scenarios/sweep_new_kinds.py --out $OUT --kinds ema,teacher --budget-s 280
    python3 scenarios/sweep_new_kinds.py --selftest                  # the search on a stand-in, no GPU

The kinds and their halves are fixed here, before anything was measured (``SPLIT``), and written into the
output: the ``tuning`` half may be looked at while a rule changes; the ``held-out`` half is measured first and
counted only while no rule was changed against it. Every trial is a fresh process (``new_kinds.py --record
none``, ``--steps 3``: the optimizer state exists from the second step on), one at a time on the one GPU.

Per kind:

1. **Record** a snapshot at ``--record-batch`` (16) with a plain ``_record_memory_history(max_entries=100000)``
   from the start, as the kinds' corpus runs were (``new_kinds.py --record start``); halve it while it runs out.
2. A second point at twice that batch; a line through the two peaks reserved (``max_memory_reserved``) gives a
   first guess of the largest that runs in ``0.97 x total - 1 GiB``.
3. From the guess, steps of 5% up (or down) until the answer changes, then bisection until the largest that ran
   and the smallest that ran out are ``max(1, largest // 100)`` apart (1%).
4. When every kind is swept and time is left, the smallest batch that ran out is recorded too (an OOM snapshot:
   what-fits from an OOM in the first forward or backward), then the largest that ran (at the edge).

Written to ``--out`` (at most 8 files, as the device returns):

- ``new-kinds-sweep.jsonl``: one line per trial, the job's own ground truth (``scenarios/_truth.py``: peaks,
  parameters, gradients, optimizer state, the OOM message) with ``run``, ``kind``, ``half``, ``batch``,
  ``exit_code``, ``wall_s``, ``recorded``, like ``docs/corpus/*-sweep.jsonl``;
- ``new_kinds_sweep.json``: the split, the GPU, per kind the record batch, ``largest_ran``, ``smallest_oom``,
  the granularity, the trials and seconds, whether it finished, and any trial that broke the monotone order
  (a batch that ran above one that ran out);
- ``new-kinds-sweep-<kind>.tar``: per recorded run ``new-kinds-sweep-<kind>-b<B>.tar.xz``, a directory holding
  ``rank0.pickle``, ``ground_truth.json``, ``job.log`` and ``rank0.meta.json`` (written here from the job's own
  measurements: the GPU's total and free bytes, the snapshot's reserved bytes, the peaks, the OOM message; so that
  what fits has its room) (the corpus' layout; copy into ``docs/corpus/``).

A trial that neither ran nor ran out of memory (a crash, a timeout) stops that kind's search and is written as it
is, with its log tail.
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
GiB = 1 << 30
# Fixed before any sweep was run (issue 35, item 6a). Chosen so that each half holds a kind whose memory is
# dominated by the logits (chunked-loss / compiled-step) and one that adds a persistent copy (ema / teacher).
SPLIT = {
    "compiled-step": "tuning",
    "ema": "tuning",
    "gpu-dataset": "held-out",
    "chunked-loss": "held-out",
    "teacher": "held-out",
}
KINDS = tuple(SPLIT)


class Sweep:
    """The trials of one kind: ``trial(batch, record)`` returns the trial's line (``exit_code`` 0 ran, 1 OOM)."""

    def __init__(self, kind: str, trial, total_bytes: int, record_batch: int, deadline: float):
        self.kind, self.trial, self.total, self.deadline = kind, trial, total_bytes, deadline
        self.record_batch = record_batch
        self.lines: list[dict] = []
        self.ran: set[int] = set()
        self.oom: set[int] = set()
        self.broken: dict | None = None

    def _run(self, batch: int, record: bool = False) -> bool | None:
        """True: ran; False: out of memory; None: neither (or the budget is spent)."""
        if time.time() > self.deadline:
            return None
        line = self.trial(batch, record)
        self.lines.append(line)
        if line.get("exit_code") == 0:
            self.ran.add(batch)
            return True
        if line.get("oom"):
            self.oom.add(batch)
            return False
        self.broken = line
        return None

    @property
    def lo(self) -> int | None:
        below = [b for b in self.ran if not self.oom or b < min(self.oom)]
        return max(below) if below else None

    @property
    def hi(self) -> int | None:
        return min(self.oom) if self.oom else None

    def search(self) -> None:
        b1 = self.record_batch
        first = self._run(b1, record=True)
        while first is False and b1 > 1:  # the record batch ran out: halve it (each one recorded)
            b1 //= 2
            first = self._run(b1, record=True)
        if first is not True:
            return
        self.record_batch = b1
        b2 = 2 * b1
        second = self._run(b2)
        if second is None:
            return
        if second:
            r1 = self.lines[-2]["max_memory_reserved"]
            r2 = self.lines[-1]["max_memory_reserved"]
            slope = max(1, (r2 - r1) / (b2 - b1))
            room = 0.97 * self.total - GiB
            guess = min(max(int(b1 + (room - r1) / slope), b2 + 1), 64 * b1)
            ok = self._run(guess)
            if ok is None:
                return
            step, b, moves = max(1, guess // 20), guess, 0
            while True:  # 5% steps (doubling after 3) up from a run, down from an OOM, until the answer changes
                nxt = b + step if ok else b - step
                if nxt <= b2:  # b2 ran: the bisection starts there
                    break
                res = self._run(nxt)
                if res is None:
                    return
                if res != ok:
                    break
                b, moves = nxt, moves + 1
                if moves >= 3:
                    step *= 2
        self.bisect()

    def bisect(self) -> None:
        while self.lo is not None and self.hi is not None:
            lo, hi = self.lo, self.hi
            if hi - lo <= max(1, lo // 100):
                return
            if self._run((lo + hi) // 2) is None:
                return

    def finished(self) -> bool:
        lo, hi = self.lo, self.hi
        return lo is not None and hi is not None and hi - lo <= max(1, lo // 100)

    def summary(self) -> dict:
        lo, hi = self.lo, self.hi
        odd = sorted(b for b in self.ran if hi is not None and b > hi)
        return {"kind": self.kind, "half": SPLIT[self.kind], "record_batch": self.record_batch, "largest_ran": lo,
                "smallest_oom": hi, "granularity": max(1, (lo or 1) // 100), "finished": self.finished(),
                "trials": len(self.lines), "seconds": round(sum(x.get("wall_s", 0) for x in self.lines), 1),
                "ran_above_an_oom": odd, "broken": self.broken and {k: self.broken.get(k) for k in
                                                                     ("run", "exit_code", "log_tail")}}


def gpu_trial(kind: str, size: str, seq: int, steps: int, work: str, timeout: float, hard_end: float):
    def trial(batch: int, record: bool) -> dict:
        limit = max(20.0, min(timeout, hard_end - time.time()))  # the whole call stays under its 10 minutes
        name = f"new-kinds-sweep-{kind}-b{batch}"
        run_dir = os.path.join(work, name + ("" if record else "-trial"))
        os.makedirs(run_dir, exist_ok=True)
        gt = os.path.join(run_dir, "ground_truth.json")
        cmd = [sys.executable, os.path.join(HERE, "new_kinds.py"), "--kind", kind, "--size", size, "--batch",
               str(batch), "--seq", str(seq), "--steps", str(steps), "--ground-truth", gt,
               "--record", "start" if record else "none"]
        if record:
            cmd += ["--snapshot", os.path.join(run_dir, "rank0.pickle")]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=HERE,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
            rc, log = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, log = 124, f"timeout after {limit:.0f}s: {e}"
        wall = round(time.time() - t0, 1)
        with open(os.path.join(run_dir, "job.log"), "w") as f:
            f.write(log)
        line: dict = {}
        if os.path.exists(gt):
            with open(gt) as f:
                line = json.load(f)
        line.update(run=name, kind=kind, half=SPLIT[kind], batch=batch, exit_code=rc, wall_s=wall, recorded=record)
        if rc not in (0, 1) or (rc == 1 and not line.get("oom")):
            line["log_tail"] = log[-1500:]
        if rc == 1 and not line.get("oom") and "out of memory" in log:
            line["oom"] = next(x for x in log.splitlines() if "out of memory" in x)[:400]
        if record:
            write_sidecar(run_dir, line)
        print(json.dumps({k: line.get(k) for k in ("run", "half", "exit_code", "max_memory_reserved", "wall_s")}),
              flush=True)
        return line
    return trial


def write_sidecar(run_dir: str, truth: dict) -> None:
    """A sidecar beside the plain recording (``rank0.meta.json``), from what the job measured itself, so that
    ``diagnose`` knows the room of a run that did not run out (an OOM's trace entry has its own): the GPU's
    total, the free bytes (``cudaMemGetInfo``, read by ``_truth.py`` just before the dump) plus the reserved bytes
    of the snapshot (the sum of its segments) and the job's peaks."""
    import pickle

    snap = os.path.join(run_dir, "rank0.pickle")
    if not os.path.exists(snap) or truth.get("gpu_total_memory_bytes") is None:
        return
    with open(snap, "rb") as f:
        segments = pickle.load(f).get("segments", [])
    reserved = sum(int(sg.get("total_size", 0)) for sg in segments if sg.get("device", 0) == 0)
    meta = {"format": "oomdoctor.sidecar/1", "kind": "oom" if truth.get("oom") else "final", "rank": 0,
            "world_size": 1, "gpu_total_memory_bytes": truth["gpu_total_memory_bytes"],
            "device_free_bytes": truth.get("device_free_at_end_bytes"),
            "memory_stats": {"reserved_bytes.all.current": reserved,
                             "reserved_bytes.all.peak": truth.get("max_memory_reserved"),
                             "allocated_bytes.all.peak": truth.get("max_memory_allocated")},
            "torch_version": truth.get("torch"), "micro_batch": truth.get("batch"),
            "written_by": "scenarios/sweep_new_kinds.py, from the job's ground_truth.json and the snapshot"}
    if truth.get("oom"):
        meta["oom"] = {"message": truth["oom"]}
    with open(os.path.join(run_dir, "rank0.meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


def selftest() -> None:
    """The search on a stand-in job that runs up to a batch and needs 1 GiB + 0.37 GiB a sample: no GPU."""
    for edge, rec in ((97, 16), (13, 16), (400, 16), (33, 8)):
        def trial(batch, record, edge=edge):
            return {"run": f"b{batch}", "batch": batch, "exit_code": 0 if batch <= edge else 1,
                    "oom": None if batch <= edge else "CUDA out of memory.", "wall_s": 1.0,
                    "max_memory_reserved": int(GiB + 0.37 * GiB * batch)}
        s = Sweep("ema", trial, int(40 * GiB), rec, time.time() + 60)
        s.search()
        summ = s.summary()
        assert summ["largest_ran"] is not None and summ["finished"], summ
        assert summ["largest_ran"] <= edge < summ["smallest_oom"], summ
        assert edge - summ["largest_ran"] <= max(1, edge // 100), summ
        print(f"edge {edge}: largest_ran {summ['largest_ran']}, smallest_oom {summ['smallest_oom']}, "
              f"{summ['trials']} trials")
    print("selftest ok")


def pack(out: str, work: str, kind: str) -> str | None:
    recorded = sorted(d for d in os.listdir(work) if d.startswith(f"new-kinds-sweep-{kind}-b")
                      and not d.endswith("-trial"))
    if not recorded:
        return None
    path = os.path.join(out, f"new-kinds-sweep-{kind}.tar")
    with tarfile.open(path, "w") as tar:
        for name in recorded:
            arc = os.path.join(work, name + ".tar.xz")
            with tarfile.open(arc, "w:xz", preset=3) as inner:
                inner.add(os.path.join(work, name), arcname=name)
            tar.add(arc, arcname=os.path.basename(arc))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--size", default="small", choices=("small", "large"))
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--record-batch", type=int, default=16)
    p.add_argument("--budget-s", type=float, default=480, help="stop starting trials after this many seconds (a trial then ends within 60 s more)")
    p.add_argument("--trial-timeout", type=float, default=150)
    p.add_argument("--selftest", action="store_true")
    a = p.parse_args()
    if a.selftest:
        selftest()
        return
    if not a.out:
        p.error("--out is required")
    kinds = [k for k in a.kinds.split(",") if k]
    bad = [k for k in kinds if k not in SPLIT]
    if bad:
        p.error(f"unknown kinds {bad}; known: {list(SPLIT)}")
    import torch

    t0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    work = os.path.join("/tmp", "new-kinds-sweep")
    os.makedirs(work, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    total = int(props.total_memory)
    meta = {"split": SPLIT, "split_fixed": "in the script, before any trial (issue 35 item 6a)", "gpu": props.name,
            "gpu_total_memory_bytes": total, "torch": torch.__version__, "size": a.size, "seq": a.seq,
            "steps": a.steps, "kinds": kinds}
    # the held-out half first: it is measured before anything can be changed against it
    kinds.sort(key=lambda k: SPLIT[k] != "held-out")
    per_kind = (a.budget_s * 0.8) / max(1, len(kinds))
    sweeps: list[Sweep] = []
    lines_path = os.path.join(a.out, "new-kinds-sweep.jsonl")

    def dump() -> None:
        with open(lines_path, "w") as f:
            for s in sweeps:
                for line in s.lines:
                    f.write(json.dumps(line) + "\n")
        with open(os.path.join(a.out, "new_kinds_sweep.json"), "w") as f:
            json.dump({**meta, "seconds": round(time.time() - t0, 1), "kinds_swept": [s.summary() for s in sweeps]},
                      f, indent=1)

    for i, kind in enumerate(kinds):
        left = a.budget_s - (time.time() - t0)
        share = max(per_kind, left * 0.8 / (len(kinds) - i))
        s = Sweep(kind, gpu_trial(kind, a.size, a.seq, a.steps, work, a.trial_timeout, t0 + a.budget_s + 60), total,
                  a.record_batch,
                  min(time.time() + share, t0 + a.budget_s))
        sweeps.append(s)
        s.search()
        dump()
        print("SWEPT", json.dumps(s.summary()), flush=True)
    for which in ("smallest_oom", "largest_ran"):  # then the OOM and the edge, recorded, while time is left
        for s in sweeps:
            b = s.summary()[which]
            if b is None or time.time() - t0 > a.budget_s - 20:
                continue
            s.deadline = t0 + a.budget_s
            s._run(b, record=True)
            dump()
    dump()
    from concurrent.futures import ThreadPoolExecutor  # lzma releases the GIL: the kinds pack side by side

    with ThreadPoolExecutor(len(sweeps) or 1) as pool:
        list(pool.map(lambda s: pack(a.out, work, s.kind), sweeps))
    print("done in", round(time.time() - t0, 1), "s", flush=True)


if __name__ == "__main__":
    main()
