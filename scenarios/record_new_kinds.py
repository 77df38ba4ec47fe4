"""Record the issue-36 kinds (``scenarios/new_kinds.py``) on every GPU of one machine at once, then pack them.

    python3 scenarios/record_new_kinds.py --out $OUT [--kinds ema,teacher] [--budget-s 500]

Each kind has two runs, ``small`` and ``large``; the halves were fixed before any run was recorded and before any
rule was changed for these kinds: the ``small`` run of every kind is in the ``tuning`` half, the ``large`` run in
the ``held-out`` half (``HALF`` below; ``docs/corpus/runs.json`` copies it). Single-GPU runs go one per free GPU
(``CUDA_VISIBLE_DEVICES``); the 4-GPU ``fsdp2-tp`` runs wait for the four. A run dir holds the snapshot(s),
``ground_truth.json`` and ``job.log``; each is packed as ``new-kinds-<name>.tar.xz`` into a few bundles under
``--out`` (the device returns at most 8 files).
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
SINGLE = ("compiled-step", "late-record", "gpu-dataset", "chunked-loss", "static-kv", "ema", "teacher")
HALF = {"small": "tuning", "large": "held-out"}


def _cmd(kind: str, size: str, run_dir: str, gpus: int) -> list[str]:
    script = os.path.join(HERE, "new_kinds.py")
    args = ["--kind", kind, "--size", size, "--snapshot", os.path.join(run_dir, "rank{rank}.pickle"),
            "--ground-truth", os.path.join(run_dir, "ground_truth.json")]
    if gpus > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                script, *args]
    return [sys.executable, script, *args]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kinds", default=",".join(SINGLE + ("fsdp2-tp",)))
    p.add_argument("--budget-s", type=float, default=500)
    a = p.parse_args()
    import torch

    ngpu = torch.cuda.device_count()
    kinds = a.kinds.split(",")
    work = os.path.join("/tmp", "new-kinds")
    os.makedirs(work, exist_ok=True)
    queue = [(k, s) for s in ("small", "large") for k in kinds if k in SINGLE]
    multi = [(k, s) for s in ("small", "large") for k in kinds if k == "fsdp2-tp"]
    t0 = time.time()
    free = list(range(ngpu))
    running: list[tuple[subprocess.Popen, int, str, float]] = []
    results = []

    def launch(kind: str, size: str, gpus: list[int]) -> None:
        name = f"{kind}-{size}"
        run_dir = os.path.join(work, name)
        os.makedirs(run_dir, exist_ok=True)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), "PYTHONUNBUFFERED": "1"}
        log = open(os.path.join(run_dir, "job.log"), "w")
        proc = subprocess.Popen(_cmd(kind, size, run_dir, len(gpus)), stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=HERE)
        running.append((proc, gpus, name, time.time()))

    def reap() -> None:
        """Wait until at least one running job ends (or the budget kills them all)."""
        while running:
            over = time.time() - t0 > a.budget_s
            ended = [item for item in running if item[0].poll() is not None or over]
            for item in ended:
                proc, gpus, name, start = item
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                running.remove(item)
                free.extend(gpus)
                results.append({"name": name, "exit": proc.returncode, "seconds": round(time.time() - start, 1),
                                "half": HALF[name.rsplit("-", 1)[1]]})
                print(json.dumps(results[-1]), flush=True)
            if ended:
                return
            time.sleep(1)

    while queue:
        while free and queue:
            kind, size = queue.pop(0)
            launch(kind, size, [free.pop(0)])
        reap()
    for kind, size in multi:
        if ngpu < 4:
            results.append({"name": f"{kind}-{size}", "skipped": f"{ngpu} GPUs"})
            continue
        while len(free) < 4:
            reap()
        gpus = sorted(free)[:4]
        for g in gpus:
            free.remove(g)
        launch(kind, size, gpus)
    while running:
        reap()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "new_kinds_runs.json"), "w") as f:
        json.dump(results, f, indent=1)
    names = sorted(os.listdir(work))
    bundles = [names[i::5] for i in range(5)]
    for i, group in enumerate(bundles):
        with tarfile.open(os.path.join(a.out, f"new-kinds-{i}.tar"), "w") as tar:
            for name in group:
                arc = os.path.join("/tmp", f"new-kinds-{name}.tar.xz")
                with tarfile.open(arc, "w:xz") as inner:
                    inner.add(os.path.join(work, name), arcname=f"new-kinds-{name}")
                tar.add(arc, arcname=os.path.basename(arc))
    print("done in", round(time.time() - t0, 1), "s", flush=True)


if __name__ == "__main__":
    main()
