"""One rank's walk through the code, from its file to its report and from its report to the lines a user reads
(issue 53 item 6): the files the reader of the code has to follow, in the order the code runs them.

    python benchmarks/walk.py SNAPSHOT [--src SRC] [--json OUT]   # SRC: a checkout's src/ (default: this one's)

What is counted, from Python's profiler (``sys.setprofile``: every call and return of a Python function):

- the **walk** is the sequence of the package's source files a reader follows, reading each function once: the file of
  a function of the package when it is called for the first time, and the file its caller is in when that first call
  returns, with consecutive repeats collapsed. A function called again (in a loop: the replay's allocator calls, one
  per event) was read already and adds nothing; time spent in other code (numpy, the standard library) stays in the
  file that called it;
- a **stay** is one element of that sequence; **files** are the distinct files in it;
- a **return** is a stay in a file the walk has already left once (a reader jumps back to a file already open);
- a **climb back up** is a *call* into a file that is already on the call stack below the caller (a callback, or two
  modules that call each other): the reader has to go back up to a file they came down from, other than by its
  function returning. A walk where each stage is a function called once, in order, from one pipeline module has none.

Two walks are measured: **file to report** (``oomdoctor.trace.load.load`` of SNAPSHOT, then
``oomdoctor.report.pipeline.summarize_rank``: one rank, as ``oomdoctor diagnose -j 1`` runs each rank) and
**rendering** (the text renderer on that report, as ``diagnose`` writes it). Deterministic: the same code and the same
snapshot give the same numbers. These are this project's own measure, defined above; they are not the numbers of
another tool.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Walk:
    """The profiler hook: the walk of the package's files (see the module doc)."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip(os.sep) + os.sep
        self.seq: list[str] = []
        self.stack: list[tuple[str | None, bool]] = []  # per Python frame: its package file (None: other code), first
        self.read: set[Any] = set()  # the code objects called once already
        self.climbs: list[tuple[str, str]] = []

    def _mine(self, filename: str) -> str | None:
        return filename[len(self.root):] if filename.startswith(self.root) else None

    def _innermost(self) -> str | None:
        return next((f for f, _ in reversed(self.stack) if f is not None), None)

    def _visit(self, f: str | None) -> None:
        if f is not None and (not self.seq or self.seq[-1] != f):
            self.seq.append(f)

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            f = self._mine(frame.f_code.co_filename)
            first = f is not None and frame.f_code not in self.read
            if first:
                self.read.add(frame.f_code)
                caller = self._innermost()
                if caller is not None and f != caller and any(x == f for x, _ in self.stack):
                    self.climbs.append((caller, f))
                self._visit(f)
            self.stack.append((f, first))
        elif event == "return":
            if self.stack:
                _, first = self.stack.pop()
                if first:
                    self._visit(self._innermost())

    def numbers(self) -> dict[str, Any]:
        seen: set[str] = set()
        returns = 0
        for f in self.seq:
            if f in seen:
                returns += 1
            seen.add(f)
        return {"stays": len(self.seq), "files": len(seen), "returns": returns, "climbs_back_up": len(self.climbs),
                "climbs": sorted({f"{a} -> {b}" for a, b in self.climbs}), "walk": self.seq}


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
    args = ap.parse_args(argv)
    sys.path.insert(0, args.src)
    import oomdoctor

    root = str(Path(oomdoctor.__file__).resolve().parent)
    assert root.startswith(str(Path(args.src).resolve())), f"imported {root}, not from {args.src}"
    from oomdoctor.render.text import render_text_plain
    from oomdoctor.report.pipeline import summarize_rank
    from oomdoctor.trace.load import load

    load(args.snapshot)  # warm: imports and first-use caches are not the walk
    outcome, to_report = walk(root, lambda: summarize_rank(load(args.snapshot)))
    render_text_plain(outcome.report)  # warm
    _, rendering = walk(root, lambda: render_text_plain(outcome.report))
    out = {"snapshot": args.snapshot, "src": args.src, "file_to_report": to_report, "rendering": rendering}
    for name in ("file_to_report", "rendering"):
        n = out[name]
        print(f"{name}: {n['stays']} stays in {n['files']} files, {n['returns']} returns to a file already left, "
              f"{n['climbs_back_up']} climbs back up")
        for c in n["climbs"]:
            print(f"  climb: {c}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
