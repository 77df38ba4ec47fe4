"""Where the seconds of ``oomdoctor simulate FILE`` (one configuration) go, stage by stage, in one process: the
stages of ``cli/simulate.py`` and ``simulate.whatif.simulate_recorded`` called one by one, each timed in CPU
seconds (``time.process_time``) and wall seconds. Usage::

    python benchmarks/simulate_stages.py SNAPSHOT [--repeat N] [--json OUT]   # PYTHONPATH picks the source tree

Each pass runs in a fresh process, as the command does (imports, a first replay that grows the heap); the
median of each stage over ``--repeat`` passes (default 5) is printed. ``pickle.load`` of the same bytes (read
into memory first) is timed in the same process for the baseline. After the self-replay with its validation (what
the command runs), a second replay without validation shows what a warm heap costs, and ``simulate()`` runs a
third (plus the recorded timeline). Works on any source tree since the issue-38 rounds (``prepare(trace, lt=...)``).
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[2] / "shared/snapshots/large/fsdp2-gpt2-60steps-rank0.pickle.xz"


class Clock:
    """CPU and wall seconds between marks."""

    def __init__(self) -> None:
        self.t = (time.process_time(), time.perf_counter())

    def lap(self) -> tuple[float, float]:
        now = (time.process_time(), time.perf_counter())
        d = (now[0] - self.t[0], now[1] - self.t[1])
        self.t = now
        return d


def one(snapshot: str) -> dict[str, tuple[float, float]]:
    """One pass, in this (fresh) process."""
    out: dict[str, tuple[float, float]] = {}
    c = Clock()
    import numpy  # noqa: F401

    out["import numpy"] = c.lap()
    import click  # noqa: F401
    import rich.console  # noqa: F401

    out["import click, rich"] = c.lap()
    import oomdoctor.cli.main  # noqa: F401
    import oomdoctor.cli.simulate  # noqa: F401
    from oomdoctor.analysis.lifetimes import lifetimes
    from oomdoctor.analysis.timeline import timeline
    from oomdoctor.render import render_simulation_text
    from oomdoctor.simulate.capacity import infer_capacity
    from oomdoctor.simulate.whatif import settle_capacity, simulate
    from oomdoctor.trace.load import load

    replay_mod = sys.modules["oomdoctor.simulate.replay"]
    out["import oomdoctor (cli, simulate, render)"] = c.lap()
    with open(snapshot, "rb") as f:
        xz = f.read(6).startswith(b"\xfd7zXZ")
    raw = (lzma.open if xz else open)(snapshot, "rb").read()
    c.lap()
    pickle.loads(raw)
    out["pickle.load (the baseline, from memory)"] = c.lap()
    del raw
    # as the command does where it keeps the decoded snapshot (it ends in os._exit: cli/main.exit_now)
    if "keep_decoded" in Path(sys.modules["oomdoctor.cli.simulate"].__file__).read_text():
        from oomdoctor.trace.load import keep_decoded

        keep_decoded()
    c.lap()
    try:  # as the command loads it since issue 38 round 10: the columns the replay reads
        trace = load(snapshot, replay_only=True)
    except TypeError:  # an older tree: everything
        trace = load(snapshot)
    out["load (with the decompression of an .xz)" if xz else "load"] = c.lap()
    from rich.console import Console

    c.lap()
    lt = lifetimes(trace, trace.primary)
    out["lifetimes"] = c.lap()
    prepared = replay_mod.prepare(trace, lt=lt)
    out["prepare (without lifetimes)"] = c.lap()
    capacity = settle_capacity(prepared, infer_capacity(trace, prepared.device))
    out["capacity"] = c.lap()
    timeline(prepared.device, prepared.lifetimes)
    out["timeline (the recorded peaks)"] = c.lap()
    replay_mod.replay(prepared, capacity=capacity, validate=True)
    out["replay and validate (the first replay in the process)"] = c.lap()
    replay_mod.replay(prepared, capacity=capacity, validate=False)
    out["replay again, without validate"] = c.lap()
    sim = simulate(trace, capacity=capacity, prepared=prepared)
    out["simulate() with a third replay"] = c.lap()
    render_simulation_text(sim, Console(file=io.StringIO(), width=100))
    out["render"] = c.lap()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot", nargs="?", default=str(DEFAULT))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.snapshot)))
        return
    import oomdoctor

    # the bytecode compiled once, in place, as an installed package has it (a PYTHONPYCACHEPREFIX would leave
    # numpy's, click's and rich's own caches unread, as in simulate_instructions.py)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(oomdoctor.__file__).parent)], check=True,
                   env=env, stdout=subprocess.DEVNULL)
    runs = [json.loads(subprocess.run([sys.executable, __file__, a.snapshot, "--one"], capture_output=True,
                                      text=True, check=True, env=env).stdout) for _ in range(a.repeat)]
    out = {k: (statistics.median(r[k][0] for r in runs), statistics.median(r[k][1] for r in runs)) for k in runs[0]}
    res = {"snapshot": Path(a.snapshot).name, "repeat": a.repeat, "medians": "of each stage over fresh processes",
           "cpu_s": {k: round(v[0], 4) for k, v in out.items()}, "wall_s": {k: round(v[1], 4) for k, v in out.items()}}
    width = max(map(len, out))
    for k, (cpu, wall) in out.items():
        print(f"{k:<{width}}  cpu {cpu:7.3f} s  wall {wall:7.3f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
