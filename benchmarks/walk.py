"""One rank's walk through the code, from its file to its report and from its report to the lines a user reads
(issue 53 item 6): the files the reader of the code has to follow, in the order the code runs them.

    python benchmarks/walk.py SNAPSHOT [--src SRC] [--json OUT]   # SRC: a checkout's src/ (default: this one's)

What is counted, from Python's profiler (``sys.setprofile``: every call and return of a Python function):

- the **walk** is the sequence of the package's source files a reader opens, reading each function once: the file of
  a function of the package when it is called for the first time, consecutive repeats collapsed. A function called
  again (in a loop: the replay's allocator calls, one per event) was read already and adds nothing; time spent in
  other code (numpy, the standard library) adds nothing either;
- a **stay** is one element of that sequence; **files** are the distinct files in it;
- a **return** is a stay in a file the walk has already left once (a reader jumps back to a file already open);
- a **climb back up** is a stay in a file that is on the call stack at that moment, below the caller: the reader goes
  back up to a file they came down from (a function calling a helper of its own file after it called into another
  file, a callback, two modules calling each other). A walk where each stage is a function called once, in order, by
  a pipeline that calls nothing of its own in between has none. The climbs are split in two: a **callback** is a
  climb where the caller is in another file than the one climbed back to (a callback, or two modules calling each
  other: control handed back up the stack); the rest are a function calling a helper of its own file after it called
  out (``own_helper``).

These definitions reproduce the review's numbers on the code the review read: on ``3280cb9^`` the healthy rank's walk
is 131 stays in 39 files, 92 returns and 44 climbs back up, where the review (``farm-studio walk``, whose source we do
not have) counted 132, 39, 93 and 44; the one stay more is the review's starting file, a file the walk returns to.

Nested code (a comprehension, a generator expression, a lambda, a local function: a code object defined inside a
function) is a function to Python's profiler, so it is counted as one above, as the review counts it. The numbers are
given a second time with it **read in place** (``nested_read_in_place``): nested code called from its own file is read
with the function it is written in and adds no stay; called from another file (a callback) it counts as any function.

Two walks are measured: **file to report** (``oomdoctor.trace.load.load`` of SNAPSHOT, then
``oomdoctor.report.pipeline.summarize_rank``: one rank, as ``oomdoctor diagnose -j 1`` runs each rank) and
**rendering** (the text renderer on that report, as ``diagnose`` writes it). Deterministic: the same code and the same
snapshot give the same numbers. Each walk runs once before it is measured, so that the modules imported on first
use (a module's own code, run once per process) are not in it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _nested(code: Any) -> bool:
    """Whether a code object is defined inside a function (``f.<locals>.g``, ``<listcomp>``, ``<genexpr>``, ...)."""
    return "<locals>" in code.co_qualname or code.co_name.startswith("<")


class Walk:
    """The profiler hook: the walk of the package's files (see the module doc), counted twice: every code object its
    own function (``all``), and nested code read in place (``in_place``)."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip(os.sep) + os.sep
        self.stack: list[str | None] = []  # per Python frame: its package file (None: other code)
        self.read: set[tuple[str, Any]] = set()  # the (file, code object) pairs called once already
        # per variant, each stay: (file, climb, callback, function)
        self.seq: dict[str, list[tuple[str, bool, bool, str]]] = {"all": [], "in_place": []}

    def _mine(self, filename: str) -> str | None:
        return filename[len(self.root):] if filename.startswith(self.root) else None

    def _visit(self, how: str, f: str, name: str) -> None:
        seq = self.seq[how]
        if not seq or seq[-1][0] != f:
            climb = f in self.stack
            seq.append((f, climb, climb and self.stack[-1] != f, name))

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            f = self._mine(code.co_filename)
            # keyed with the file: two code objects of identical source at the same line in two files compare equal
            if f is not None and (f, code) not in self.read:
                self.read.add((f, code))
                name = f"{code.co_qualname}:{code.co_firstlineno}"
                self._visit("all", f, name)
                if not (_nested(code) and self.stack and self.stack[-1] == f):
                    self._visit("in_place", f, name)
            self.stack.append(f)
        elif event == "return" and self.stack:
            self.stack.pop()

    def numbers(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for how, key in (("all", "all_code"), ("in_place", "nested_read_in_place")):
            seen: set[str] = set()
            returns = 0
            for f, _, _, _ in self.seq[how]:
                returns += f in seen
                seen.add(f)
            climbs = [(f, callback, name) for f, climb, callback, name in self.seq[how] if climb]
            out[key] = {"stays": len(self.seq[how]), "files": len(seen), "returns": returns,
                        "climbs_back_up": len(climbs), "callbacks": sum(c for _, c, _ in climbs),
                        "climbs": [f"{f} {name}{' (callback)' if c else ''}" for f, c, name in climbs],
                        "walk": [f"{f} {name}" for f, _, _, name in self.seq[how]]}
        return out


def walk(root: str, run: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Run ``run`` under the hook; its result and the walk's numbers."""
    w = Walk(root)
    sys.setprofile(w)
    try:
        out = run()
    finally:
        sys.setprofile(None)
    return out, w.numbers()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot")
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    ap.add_argument("--json", help="write the numbers (and the walks) here")
    ap.add_argument("--climbs", action="store_true", help="list each climb back up (file, function: line)")
    args = ap.parse_args(argv)
    sys.path.insert(0, args.src)
    import oomdoctor

    root = str(Path(oomdoctor.__file__).resolve().parent)
    assert root.startswith(str(Path(args.src).resolve())), f"imported {root}, not from {args.src}"
    from oomdoctor.render.text import render_text_plain
    from oomdoctor.report.pipeline import summarize_rank
    from oomdoctor.trace.load import load

    summarize_rank(load(args.snapshot))  # warm: the modules a path imports on first use are not the walk
    outcome, to_report = walk(root, lambda: summarize_rank(load(args.snapshot)))
    render_text_plain(outcome.report)  # warm
    _, rendering = walk(root, lambda: render_text_plain(outcome.report))
    out = {"snapshot": args.snapshot, "src": args.src, "file_to_report": to_report, "rendering": rendering}
    for name in ("file_to_report", "rendering"):
        for how, n in out[name].items():
            print(f"{name} ({how}): {n['stays']} stays in {n['files']} files, {n['returns']} returns to a file "
                  f"already left, {n['climbs_back_up']} climbs back up ({n['callbacks']} callbacks)")
            if args.climbs:
                for c in n["climbs"]:
                    print(f"  climb: {c}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
