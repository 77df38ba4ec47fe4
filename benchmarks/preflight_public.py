"""``oomdoctor preflight`` on the public-script corpus (issue 50 item 5), each script unmodified, on this CPU.

    python benchmarks/preflight_public.py OUTDIR --corpus .corpus --data DATA [--half dev|heldout|all]
        [--only NAME ...] [--timeout 900] [--json docs/preflight_public_before.json]
        [--heldout-private PATH] [--src src] [--reuse OLD/rows.jsonl ...]

Per entry of ``benchmarks/preflight_corpus/manifest.json`` (``make_data.py`` makes DATA first, as on the GPU):

    oomdoctor preflight --steps K --gpu H200 --format json -o OUTDIR/NAME.pickle [--nproc-per-node N] \\
        -- python SCRIPT ARGS...

in the entry's own working directory, with its environment, as a subprocess (``--src``'s oomdoctor first on
``PYTHONPATH``: the code measured). Recorded per entry: ``traced`` (exit 0) or refused, with the one line
preflight said (``reason``) and the ``file:line`` it names (``where``); the predicted ``peak_allocated_bytes`` /
``peak_reserved_bytes``; the stand-in values it lists (``invented_values``, where preflight has them); ``not_traced``;
the wall time of the whole call (``wall_s``) and of the trace (``trace_wall_s``).

Held-out discipline (``split.json``): ``--json`` gets the development half's rows in full and, for the held-out
half, only counts (traced / refused / total) and the SHA-256 of the held-out rows, which go to
``--heldout-private`` (a file kept out of the repository: the held-out scripts' failures are not shown to whoever
changes preflight's rules).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "benchmarks" / "preflight_corpus"))
from corpus import entries, prepare, split, with_pythonpath  # noqa: E402

_WHERE = re.compile(r"(?P<file>[^\s:]+\.py):(?P<line>\d+)")


def _reason(stderr: str) -> str:
    """The one line preflight said (``oomdoctor: error: ...``), else the last non-empty line of stderr."""
    lines = [s for s in stderr.strip().splitlines() if s.strip()]
    said = [s for s in lines if s.startswith("oomdoctor: error:") or s.startswith("Error:")]
    return (said or lines or ["(no output)"])[-1].strip()


def _where(reason: str, corpus: Path) -> str | None:
    m = _WHERE.search(reason)
    if not m:
        return None
    f = m.group("file")
    try:
        f = str(Path(f).resolve().relative_to(corpus.resolve()))
    except ValueError:
        pass
    return f"{f}:{m.group('line')}"


def run_one(e: dict, *, out: Path, corpus: Path, data: Path, src: Path, timeout: int) -> dict[str, Any]:
    p = prepare(e, corpus=corpus, data=data, root=out / "runs")
    snap = out / f"{e['name']}.pickle"
    cmd = [sys.executable, "-m", "oomdoctor", "preflight", "--steps", str(p.steps), "--gpu", "H200", "--format", "json",
           "-o", str(snap)]
    if p.nproc > 1:
        cmd += ["--nproc-per-node", str(p.nproc)]
    cmd += ["--", "python", *p.argv]
    env = with_pythonpath(p.env, str(src.resolve()))
    env.update(CUDA_VISIBLE_DEVICES="", COLUMNS="100")
    t0 = time.perf_counter()
    row: dict[str, Any] = {"name": e["name"], "group": e["group"], "nproc": p.nproc, "steps": p.steps,
                           "command": " ".join(["oomdoctor", *cmd[3:]]).replace(str(corpus.resolve()), "{corpus}")
                           .replace(str(data.resolve()), "{data}").replace(str(p.cwd.resolve()), "{work}")
                           .replace(str(out.resolve()), "OUTDIR")}
    try:
        r = subprocess.run(cmd, cwd=p.cwd, env=env, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
        rc, stdout, stderr = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as ex:
        rc, stdout = None, ""
        stderr = (ex.stderr.decode(errors="replace") if isinstance(ex.stderr, bytes) else (ex.stderr or "")) + \
            f"\noomdoctor: error: (benchmark) no answer within {timeout} s"
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    row["rc"] = rc
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "logs" / f"{e['name']}.stderr").write_text(stderr)
    res = None
    if rc == 0:
        try:
            res = json.loads(stdout)
        except json.JSONDecodeError:
            stderr += "\noomdoctor: error: (benchmark) the JSON on stdout does not parse"
    if res is None:
        reason = _reason(stderr)
        row.update(traced=False, reason=reason, where=_where(reason, corpus))
        return row
    row.update(traced=True, peak_allocated_bytes=res.get("peak_allocated_bytes"),
               peak_reserved_bytes=res.get("peak_reserved_bytes"), oom=res.get("oom"),
               trace_wall_s=res.get("trace_wall_s"), events=res.get("events"), not_traced=res.get("not_traced"),
               invented_values=res.get("invented_values"), breakdown=res.get("breakdown"))
    return row


def summary(rows: list[dict]) -> dict[str, int]:
    return {"total": len(rows), "traced": sum(1 for r in rows if r.get("traced")),
            "refused": sum(1 for r in rows if not r.get("traced"))}


def _code(src: Path) -> dict[str, Any]:
    try:
        rev = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        tree = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD:./"], capture_output=True,
                              text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "."], capture_output=True,
                                    text=True).stdout.strip())
    except OSError:
        rev, tree, dirty = "", "", False
    import torch

    return {"oomdoctor_commit": rev, "src_tree": tree, "dirty": dirty, "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--half", choices=["dev", "heldout", "all"], default="all")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--src", type=Path, default=HERE / "src")
    ap.add_argument("--json", type=Path, help="the public record: dev rows in full, held-out counts and digest")
    ap.add_argument("--heldout-private", type=Path, help="where the held-out rows go (kept out of the repository)")
    ap.add_argument("--reuse", type=Path, nargs="*", default=[],
                    help="rows.jsonl of earlier runs of the same code: their rows are kept, only the other entries run")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    from make_data import make

    make(a.data)
    halves = split()
    es = entries(a.only, half=None if a.half == "all" else a.half)
    earlier = {}
    for p in a.reuse:
        for s in p.read_text().splitlines():
            if s.strip():
                r = json.loads(s)
                earlier[r["name"]] = r
    rows = []
    for e in es:
        r = earlier.get(e["name"]) or run_one(e, out=a.out, corpus=a.corpus, data=a.data, src=a.src, timeout=a.timeout)
        r["half"] = halves[e["name"]]
        rows.append(r)
        shown = "traced" if r["traced"] else "refused"
        if r["half"] == "dev":
            shown += f": {r.get('reason', '')[:150]}" if not r["traced"] else \
                f": allocated {r['peak_allocated_bytes']:,} B, reserved {r['peak_reserved_bytes']:,} B"
        print(f"[{r['half']}] {e['name']}: {shown} ({r['wall_s']} s)", flush=True)
        with open(a.out / "rows.jsonl", "a") as f:
            f.write(json.dumps(r) + "\n")
    dev = [r for r in rows if r["half"] == "dev"]
    held = [r for r in rows if r["half"] == "heldout"]
    record: dict[str, Any] = {"generated": time.strftime("%Y-%m-%d"), **_code(a.src),
                              "command": "python benchmarks/preflight_public.py OUTDIR --corpus .corpus --data DATA",
                              "dev": {**summary(dev), "rows": dev}}
    if held:
        blob = json.dumps(held, sort_keys=True, indent=1).encode()
        record["heldout"] = {**summary(held), "sha256_of_rows": hashlib.sha256(blob).hexdigest(),
                             "rows": "kept back (held-out discipline): counts only"}
        if a.heldout_private:
            a.heldout_private.parent.mkdir(parents=True, exist_ok=True)
            a.heldout_private.write_bytes(blob)
    if a.json:
        a.json.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: (v if k not in ("dev", "heldout") else {kk: vv for kk, vv in v.items() if kk != "rows"})
                      for k, v in record.items()}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
