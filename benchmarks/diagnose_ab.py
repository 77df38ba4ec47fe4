"""``oomdoctor diagnose`` of one snapshot with two source trees side by side, beside ``pickle.load``, in fresh
processes, alternated; CPU seconds of each child (``wait4``: user + sys) and wall, best and median. On a machine
shared with other work, CPU time is the steadier measure (docs/benchmarks.md). Both trees are byte-compiled first
(``compileall``), as an installed package is: where ``PYTHONDONTWRITEBYTECODE`` is set and no ``__pycache__`` exists,
every run would compile oomdoctor's sources again (0.2-0.5 s). Usage::

    python benchmarks/diagnose_ab.py SNAPSHOT.pickle N BEFORE_SRC AFTER_SRC   # e.g. a git archive's src/, ./src
"""

from __future__ import annotations

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
    plain, n = sys.argv[1], int(sys.argv[2])
    trees = {"before": sys.argv[3], "after": sys.argv[4]}
    for src in trees.values():
        subprocess.run([sys.executable, "-m", "compileall", "-q", src], check=True, stdout=subprocess.DEVNULL)
    cmds = {"pickle_load": ([sys.executable, "-c", f"import pickle; pickle.load(open({plain!r}, 'rb'))"], None)}
    for k, src in trees.items():
        env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
        cmds[f"diagnose_{k}"] = ([sys.executable, "-m", "oomdoctor", "diagnose", plain], env)
        cmds[f"help_{k}"] = ([sys.executable, "-m", "oomdoctor", "--help"], env)
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in cmds}
    for _ in range(n):
        for k, (argv, env) in cmds.items():
            res[k].append(run(argv, env))
    for k, v in res.items():
        c, w = sorted(x for x, _ in v), sorted(x for _, x in v)
        print(f"{k:18s} cpu best {c[0]:.3f} median {statistics.median(c):.3f} | "
              f"wall best {w[0]:.3f} median {statistics.median(w):.3f}")
    pc = min(x for x, _ in res["pickle_load"])
    pw = min(x for _, x in res["pickle_load"])
    for k in trees:
        print(f"{k}: diagnose/pickle.load cpu {min(x for x, _ in res['diagnose_' + k]) / pc:.2f}, "
              f"wall {min(x for _, x in res['diagnose_' + k]) / pw:.2f}")


if __name__ == "__main__":
    main()
