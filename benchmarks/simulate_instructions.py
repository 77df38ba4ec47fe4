"""Instructions retired by each stage of ``oomdoctor simulate FILE`` (one configuration), counted by valgrind's
callgrind in one process: the stages of ``cli/simulate.py`` and ``simulate.whatif.simulate_recorded`` called
one by one, a ``getppid()`` between stages, and callgrind told to dump its counters before each
(``--dump-before=getppid``). Instruction counts do not move with the load of a shared machine, as seconds do.
Usage::

    python benchmarks/simulate_instructions.py SNAPSHOT [--src DIR] [--json OUT]

``--src``: the ``src`` folder to measure (put first on ``PYTHONPATH``; default: this checkout's). The bytecode is
compiled first, in place (as an installed package has it); ``OPENBLAS_NUM_THREADS=1``, ``PYTHONHASHSEED=0``. Takes about
a minute of CPU per million events. Needs ``valgrind`` on ``PATH``. ``pickle.load`` of the file (in the same
process, after the stages) is the baseline issue 38 counts from.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STAGES = ["python start-up", "import numpy", "import click, rich", "import oomdoctor (cli.main, cli.simulate)",
          "load (replay_only)", "prepare (lifetimes, FallbackRule, the ops)", "infer_capacity",
          "settle_capacity", "simulate() (timeline, the self-replay, validate)", "render (text, with its imports)",
          "pickle.load (the baseline)"]


def one(snapshot: str) -> None:
    """The stages, in this process (run under callgrind), a ``getppid()`` after each."""
    mark = os.getppid
    mark()
    import numpy  # noqa: F401

    mark()
    import click  # noqa: F401
    import rich.console  # noqa: F401

    mark()
    import oomdoctor.cli.main  # noqa: F401
    import oomdoctor.cli.simulate
    from oomdoctor.cli.inputs import load_with_progress
    from oomdoctor.simulate import whatif
    from oomdoctor.simulate.capacity import infer_capacity
    from oomdoctor.simulate.replay import prepare

    # as the command does where it keeps the decoded snapshot (it ends in os._exit, cli/main.exit_now)
    keep = "keep_decoded" in Path(oomdoctor.cli.simulate.__file__).read_text()
    mark()
    if keep:
        from oomdoctor.trace.load import keep_decoded

        keep_decoded()
    try:
        trace = load_with_progress([snapshot], replay_only=True)[0]
    except TypeError:  # a tree before issue 38 round 10
        trace = load_with_progress([snapshot])[0]
    mark()
    prepared = prepare(trace)
    mark()
    capacity = infer_capacity(trace, prepared.device)
    mark()
    capacity = whatif.settle_capacity(prepared, capacity)
    mark()
    sim = whatif.simulate(trace, capacity=capacity, prepared=prepared)
    mark()
    import io

    from rich.console import Console

    from oomdoctor.render.text import render_simulation_text

    render_simulation_text(sim, Console(file=io.StringIO(), width=100))
    mark()
    import pickle

    with open(snapshot, "rb") as f:
        pickle.load(f)  # and freed, as the baseline process frees it
    mark()
    sys.stdout.flush()
    os._exit(0)  # as the command ends (cli/main.exit_now)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot")
    ap.add_argument("--src", default=str(ROOT / "src"))
    ap.add_argument("--json")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        one(a.snapshot)
        return
    with tempfile.TemporaryDirectory() as tmp:
        # the bytecode in place, next to the sources (a PYTHONPYCACHEPREFIX would leave numpy's, click's and rich's
        # own caches unread: their imports would compile them, several times what they cost installed)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
        env.update(PYTHONPATH=a.src, OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0")
        subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(a.src, "oomdoctor")], check=True,
                       env=env, stdout=subprocess.DEVNULL)
        out = os.path.join(tmp, "cg.out")
        subprocess.run(["valgrind", "--tool=callgrind", "--dump-before=getppid", f"--callgrind-out-file={out}",
                        sys.executable, __file__, a.snapshot, "--one"], check=True, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        parts = sorted(glob.glob(out + ".*"), key=lambda p: int(p.rsplit(".", 1)[1]))
        counts = []
        for p in parts:
            with open(p) as f:
                counts.append(next(int(line.split()[1]) for line in f if line.startswith("totals:")))
    # dump k holds what ran between mark k-1 and mark k; the first, before the first mark, is the start-up
    assert len(counts) == len(STAGES), (len(counts), len(STAGES))
    stages = dict(zip(STAGES, counts))
    command = sum(v for k, v in stages.items() if k != "pickle.load (the baseline)")
    load = stages["pickle.load (the baseline)"]
    width = max(map(len, stages))
    for k, v in stages.items():
        print(f"{k:<{width}}  {v / 1e9:7.3f} G")
    print(f"{'the command (all but pickle.load)':<{width}}  {command / 1e9:7.3f} G")
    print(f"{'beyond pickle.load':<{width}}  {(command - load) / 1e9:7.3f} G")
    if a.json:
        Path(a.json).write_text(json.dumps({"snapshot": Path(a.snapshot).name, "src": a.src, "instructions": stages,
                                            "command": command, "beyond_pickle_load": command - load}, indent=2)
                                + "\n")


if __name__ == "__main__":
    main()
