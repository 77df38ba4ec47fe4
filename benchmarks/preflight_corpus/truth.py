"""GPU truths of the public-script corpus (issue 50 item 5): each entry of ``manifest.json`` run unmodified on
the GPU, its peaks read after K optimizer steps by ``truth_hook/sitecustomize.py`` (a global optimizer step hook
put on ``PYTHONPATH``; the script is not edited).

    python benchmarks/preflight_corpus/truth.py OUT --corpus .corpus --data DATA [--nproc 1|2] [--only NAME ...]
        [--timeout 150] [--parallel 3]

Per entry: ``timeout T python SCRIPT ARGS`` (or ``torchrun --standalone --nproc_per_node N SCRIPT ARGS``) in its own
working directory, ``OOMTRUTH_OUT`` set; its log in ``OUT/logs/NAME.log``. Writes ``OUT/truths.jsonl``, one line per
entry: ``name``, ``rc``, ``wall_s``, ``status`` (``measured``: rank 0 reached step K; ``ended``: the script ended
first; ``failed``: no line from the hook: the log's last lines are in ``error``), and rank 0's ``max_allocated``,
``max_reserved`` (bytes), ``per_step``, ``scaler_skipped``, ``device``, ``torch``; every rank's line in ``ranks``.
Entries run ``--parallel`` at a time on the one GPU: ``max_memory_*`` are per process, so they do not see each
other (the corpus's jobs use a few GB of the GPU's 140 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import HERE, entries, prepare, with_pythonpath  # noqa: E402

HOOK = HERE / "truth_hook"
_PREPARE = threading.Lock()  # entries can share a link (Lightning's Datasets): made one at a time


def run_one(e: dict, *, out: Path, corpus: Path, data: Path, timeout: int) -> dict:
    with _PREPARE:
        p = prepare(e, corpus=corpus, data=data, root=out / "runs")
    lines = out / "hook" / f"{e['name']}.jsonl"
    lines.parent.mkdir(parents=True, exist_ok=True)
    lines.unlink(missing_ok=True)
    env = with_pythonpath(p.env, str(HOOK))
    env.update(OOMTRUTH_OUT=str(lines), OOMTRUTH_NAME=e["name"], OOMTRUTH_STEPS=str(p.steps))
    if p.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={p.nproc}", *p.argv]
    else:
        cmd = [sys.executable, *p.argv]
    log = out / "logs" / f"{e['name']}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + f"\n# cwd {p.cwd}\n")
        f.flush()
        try:
            rc = subprocess.run(["timeout", "--kill-after=10", str(timeout), *cmd], cwd=p.cwd, env=env, stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
        except OSError as ex:
            rc = -1
            f.write(f"could not start: {ex}\n")
    wall = round(time.perf_counter() - t0, 1)
    rows = [json.loads(s) for s in lines.read_text().splitlines() if s.strip()] if lines.exists() else []
    ranks = [r for r in rows if r.get("cuda") or r.get("steps")]
    rank0 = next((r for r in ranks if r.get("rank", 0) == 0 and r.get("completed")), None) or \
        next((r for r in ranks if r.get("rank", 0) == 0), None)
    res = {"name": e["name"], "nproc": p.nproc, "k": p.steps, "rc": rc, "wall_s": wall, "ranks": ranks}
    if rank0 is None:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        res.update(status="failed", error="\n".join(tail)[-3000:])
    else:
        res.update(status="measured" if rank0.get("completed") else "ended",
                   **{k: rank0.get(k) for k in ("max_allocated", "max_reserved", "allocated", "reserved", "per_step",
                                                "steps", "scaler_calls", "scaler_skipped", "device", "torch",
                                                "num_alloc_retries", "num_ooms")})
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--nproc", type=int)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--timeout", type=int, default=150)
    ap.add_argument("--parallel", type=int, default=1)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    es = entries(a.only, nproc=a.nproc)
    res_path = a.out / "truths.jsonl"

    def go(e: dict) -> dict:
        r = run_one(e, out=a.out, corpus=a.corpus, data=a.data, timeout=a.timeout)
        with open(res_path, "a") as f:
            f.write(json.dumps(r) + "\n")
        gib = (r.get("max_allocated") or 0) / 2**30
        print(f"{r['name']}: {r['status']} rc={r['rc']} {r['wall_s']}s max_allocated={gib:.3f} GiB", flush=True)
        return r

    if a.parallel > 1:
        with ThreadPoolExecutor(a.parallel) as ex:
            list(ex.map(go, es))
    else:
        for e in es:
            go(e)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
