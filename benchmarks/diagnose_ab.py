"""``oomdoctor diagnose`` of one snapshot with two source trees side by side, beside ``pickle.load``, in fresh
processes, alternated (the order rotating every repetition); CPU seconds of each child (``wait4``: user + sys) and wall, best and median. On a machine
shared with other work, CPU time is the steadier measure (docs/benchmarks.md). Both trees are byte-compiled first
(``compileall``), as an installed package is: where ``PYTHONDONTWRITEBYTECODE`` is set and no ``__pycache__`` exists,
every run would compile oomdoctor's sources again (0.2-0.5 s). Usage::

    python benchmarks/diagnose_ab.py SNAPSHOT.pickle N BEFORE_SRC AFTER_SRC   # e.g. a git archive's src/, ./src
    python benchmarks/diagnose_ab.py SNAPSHOT.pickle N BEFORE_SRC AFTER_SRC --blas --json OUT.json

``--blas`` adds the after tree with ``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` set to the CPU
count (as a user who set them would run it, and as the tree before ``cli.main.one_blas_thread`` ran), and the before
tree with them set to 1. ``--json`` writes every sample and the ratios (median and best) to a file.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time


def run(argv: list[str], env: dict | None) -> tuple[float, float]:
    """CPU seconds (user + sys) and wall seconds of one child."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed")
    return usage.ru_utime + usage.ru_stime, time.perf_counter() - t0


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    blas = "--blas" in sys.argv
    out_json = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    if out_json in args:
        args.remove(out_json)
    plain, n = args[0], int(args[1])
    trees = {"before": args[2], "after": args[3]}
    for src in trees.values():
        subprocess.run([sys.executable, "-m", "compileall", "-q", src], check=True, stdout=subprocess.DEVNULL)
    cmds = {"pickle_load": ([sys.executable, "-c", f"import pickle; pickle.load(open({plain!r}, 'rb'))"], None)}
    threads = {"before_blas1": ("before", "1"), "after_blas_all": ("after", str(os.cpu_count()))} if blas else {}
    for k, src in trees.items():
        env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
        cmds[f"diagnose_{k}"] = ([sys.executable, "-m", "oomdoctor", "diagnose", plain], env)
        cmds[f"help_{k}"] = ([sys.executable, "-m", "oomdoctor", "--help"], env)
    for k, (tree, count) in threads.items():
        env = dict(os.environ, PYTHONPATH=os.path.abspath(trees[tree]), OPENBLAS_NUM_THREADS=count,
                   OMP_NUM_THREADS=count, MKL_NUM_THREADS=count)
        cmds[f"diagnose_{k}"] = ([sys.executable, "-m", "oomdoctor", "diagnose", plain], env)
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in cmds}
    order = list(cmds.items())
    for rep in range(n):  # the order rotates every repetition: no command always runs first or last
        for k, (argv, env) in order[rep % len(order):] + order[:rep % len(order)]:
            res[k].append(run(argv, env))
    for k, v in res.items():
        c, w = sorted(x for x, _ in v), sorted(x for _, x in v)
        print(f"{k:24s} cpu best {c[0]:.3f} median {statistics.median(c):.3f} | "
              f"wall best {w[0]:.3f} median {statistics.median(w):.3f}")
    pc = min(x for x, _ in res["pickle_load"])
    pw = min(x for _, x in res["pickle_load"])
    mc = statistics.median(x for x, _ in res["pickle_load"])
    mw = statistics.median(x for _, x in res["pickle_load"])
    ratios = {}
    for k in [k for k in cmds if k.startswith("diagnose_")]:
        v = res[k]
        ratios[k] = {"cpu_best": min(x for x, _ in v) / pc, "wall_best": min(x for _, x in v) / pw,
                     "cpu_median": statistics.median(x for x, _ in v) / mc,
                     "wall_median": statistics.median(x for _, x in v) / mw}
        print(f"{k[len('diagnose_'):]}: diagnose/pickle.load best cpu {ratios[k]['cpu_best']:.2f}, wall "
              f"{ratios[k]['wall_best']:.2f} | median cpu {ratios[k]['cpu_median']:.2f}, wall {ratios[k]['wall_median']:.2f}")
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"snapshot": plain, "repeat": n, "cpus": os.cpu_count(), "trees": trees, "ratios": ratios,
                       "samples": {k: [{"cpu_s": c, "wall_s": w} for c, w in v] for k, v in res.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
