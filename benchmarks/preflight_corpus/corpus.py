"""The public-script corpus's manifest and split, shared by the preflight runner (``benchmarks/preflight_public.py``),
the GPU-truth driver (``truth.py``) and the table (``benchmarks/preflight_public_table.py``).

An entry of ``manifest.json`` is run by :func:`prepare`: its own empty working directory (its cwd), the links it
needs made, its argv and environment with the placeholders filled (``{corpus}``, ``{data}``, ``{work}``,
``{out}``). Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MANIFEST = HERE / "manifest.json"
SPLIT = HERE / "split.json"


def manifest() -> dict[str, Any]:
    return json.loads(MANIFEST.read_text())


def entries(names: list[str] | None = None, *, half: str | None = None, nproc: int | None = None) -> list[dict]:
    """The manifest's entries, in its order: those named, of one half (``dev`` / ``heldout``, :func:`split`),
    of one GPU count. Raises ``KeyError`` for an unknown name."""
    es = manifest()["entries"]
    if names:
        by = {e["name"]: e for e in es}
        missing = [n for n in names if n not in by]
        if missing:
            raise KeyError(f"not in {MANIFEST.name}: {', '.join(missing)}")
        es = [by[n] for n in names]
    if half:
        sp = split()
        es = [e for e in es if sp.get(e["name"]) == half]
    if nproc is not None:
        es = [e for e in es if e["nproc"] == nproc]
    return es


def split() -> dict[str, str]:
    """``{entry name: "dev" | "heldout"}`` from ``split.json`` (a group, one script, is wholly in one half)."""
    s = json.loads(SPLIT.read_text())
    half = {g: h for h in ("dev", "heldout") for g in s[h]}
    return {e["name"]: half[e["group"]] for e in manifest()["entries"]}


@dataclass
class Prepared:
    name: str
    cwd: Path
    argv: list[str]  # after the interpreter: the script (a path) and its arguments
    env: dict[str, str]  # to add to the environment (PYTHONPATH prepended to the caller's)
    nproc: int
    steps: int


def _fill(s: str, subs: dict[str, str]) -> str:
    for k, v in subs.items():
        s = s.replace("{" + k + "}", v)
    return s


def prepare(entry: dict, *, corpus: Path, data: Path, root: Path, fresh: bool = True) -> Prepared:
    """Make ``root/NAME/work`` (emptied when ``fresh``) and the entry's links; fill its argv and env."""
    base = root / entry["name"]
    work = base / "work"
    if fresh and base.exists():
        shutil.rmtree(base)
    (work / "out").mkdir(parents=True, exist_ok=True)
    subs = {"corpus": str(corpus.resolve()), "data": str(data.resolve()), "work": str(work.resolve()),
            "out": str((work / "out").resolve())}
    for link, target in entry.get("links", {}).items():
        lp, tp = Path(os.path.normpath(_fill(link, subs))), Path(_fill(target, subs))
        lp.parent.mkdir(parents=True, exist_ok=True)
        if lp.is_symlink() or lp.exists():
            if lp.is_symlink() and lp.resolve() == tp.resolve():
                continue
            if lp.is_symlink():
                lp.unlink()
            else:
                raise FileExistsError(f"{entry['name']}: {lp} exists and is not a link")
        lp.symlink_to(tp)
    env = {k: _fill(v, subs) for k, v in {**manifest().get("common_env", {}), **entry.get("env", {})}.items()}
    return Prepared(entry["name"], work, [_fill(a, subs) for a in entry["argv"]], env, entry["nproc"], entry["steps"])


def with_pythonpath(env: dict[str, str], *first: str) -> dict[str, str]:
    """``os.environ`` with ``env`` on top, and ``first`` then ``env``'s PYTHONPATH then the caller's, in that order."""
    parts = [*first, env.get("PYTHONPATH", ""), os.environ.get("PYTHONPATH", "")]
    out = {**os.environ, **env}
    out["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    return out
