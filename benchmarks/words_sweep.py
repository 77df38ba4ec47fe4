"""The Done-when sweep of issue 37: every command's text output, piped at 80 columns, on every snapshot.

``python benchmarks/words_sweep.py [SNAPSHOTS_DIR] [--out DIR] [--quick]`` runs ``COLUMNS=80 oomdoctor <cmd> ...``
(stdout piped, so rich writes plain text) for diagnose, report, simulate (recorded settings, ``--search``,
``--config expandable_segments:True``), slice (by event and by step), export (Perfetto and folded), diff (two
directories, two files), plan estimate/search/validate and every ``--help``, on every ``*.pickle`` under
``SNAPSHOTS_DIR`` (default ``../shared/snapshots``, or ``$OOMDOCTOR_SHARED/snapshots``), on every directory of ranks
there and on the bundled demo; then the commands that run or trace a job (:func:`tool_commands`: preflight of a
Hugging Face config and of a script, diagnose and simulate of preflight's snapshot, run, fit, verify, plan estimate of
a Trainer job); and checks each output with :func:`problems`. Issue 52: every command, preflight included.
Prints one line per problem and a count; exit 1 when any is found. ``--out DIR`` also writes ``sweep.json``
(every command, its seconds and its problems). ``--quick``: one snapshot per folder.

:func:`problems` is what ``tests/integration/test_words_sweep.py`` asserts on. What it checks, per line:

- no line longer than 80 characters; no trailing space;
- no number or unit cut: no ``…`` at all in a piped output (rich's ellipsis of a cut cell or a cut box title);
- no internal word (:data:`INTERNAL_WORDS`): ``reach:``, ``device's room``, ``from inferred``, ``rank(s)``,
  a raw byte count of 11 digits or more written without thousands separators;
- no nested parentheses within one paragraph (inside a box, the box's border is read past);
- no number on one line and its unit on the next;
- a wrapped line keeps its indent: a line that starts at the paragraph's left edge right after a line of
  that paragraph indented deeper and filled to within :data:`FULL` columns of the width is a wrap that
  went back to column 0;
- every column of a table under a header rule (``───``) has a header over it.

:func:`headline_problems` checks that the headline of each ``diagnose`` (its ``--format json`` verdict) agrees
with the body of its report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WIDTH = 80
FULL = 14
"""A line within this many columns of the width was filled by a wrap (words are at most this long)."""

INTERNAL_WORDS = {
    "reach:": re.compile(r"\breach: "),
    "device's room": re.compile(r"device's room"),
    "from inferred": re.compile(r"\bfrom inferred\b"),
    "rank(s)": re.compile(r"\b(?:rank|finding|time|block|pair|option|column|file|step|segment|event|byte)\(s\)"),
    "raw byte count": re.compile(r"(?<![\d,.\w])\d{11,}(?![\d,.])"),
    "material finding": re.compile(r"\bmaterial finding"),
    "the rest read from the trace": re.compile(r"\bthe rest read from the trace"),
    "snapshot has": re.compile(r">= \d+\.\d+ \(snapshot has"),
    "a category of a few bytes": re.compile(r"\b(?:outputs kept|allocator rounding|unknown|temporaries) \d{1,3} B\b"),
    "1 + plural": re.compile(r"(?<![\d.,])\b1 (?:trials|micro-batches|ranks|steps|blocks|events|files|findings|segments"
                             r"|passes|stages|replays|runs|GPUs|processes|frees|allocations|settings|rank pairs)\b"),
}
"""Words a newcomer has to decode (issues 37, 52): internal terms, ``(s)`` plurals, raw 11+-digit byte counts, the
materiality rule's own word, a breakdown's category of a few bytes, a lower bound of PyTorch's version as the code
writes it, and a count of one with a plural noun."""

_BOX_LEFT = re.compile(r"^[│┃║] ?")
_BOX_RIGHT = re.compile(r" ?[│┃║]$")
_BOX_EDGE = re.compile(r"^[╭┏╔╰┗╚┌└]")
_RULE = re.compile(r"^\s*─[─ ]*$")
_NUMBER_END = re.compile(r"(?<![:\w])\d+(?:\.\d+)?$")
_UNIT_START = re.compile(r"^\s*(?:[KMGT]iB|B|GB|µs|ms|s)\b")


def _inner(line: str) -> str:
    """A line without the box border around it."""
    return _BOX_RIGHT.sub("", _BOX_LEFT.sub("", line))


def _paragraphs(lines: list[str]) -> list[list[tuple[int, str]]]:
    """Runs of non-blank lines (box borders stripped), with their line numbers."""
    out, cur = [], []
    for i, ln in enumerate(lines):
        if _BOX_EDGE.match(ln):
            if cur:
                out.append(cur)
            cur = []
            continue
        inner = _inner(ln)
        if not inner.strip():
            if cur:
                out.append(cur)
            cur = []
        else:
            cur.append((i, inner.rstrip()))
    if cur:
        out.append(cur)
    return out


_CALL = re.compile(r"([\w.\]])\([^()]*\)")
_ITEM = re.compile(r"^\s*(?:\d+\. |- |simulated: |source: |note)")


def _prose(s: str) -> str:
    """``s`` without the arguments of code calls (``t.detach().cpu()``, ``argmax(-1)``): their parentheses are code,
    not a parenthesis in a parenthesis."""
    while True:
        t = _CALL.sub(r"\1", s)
        if t == s:
            return s
        s = t


def _indent(s: str) -> int:
    return len(s) - len(s.lstrip(" "))


def _table_problems(lines: list[str]) -> list[str]:
    out = []
    for i, ln in enumerate(lines):
        if not _RULE.match(ln) or i == 0 or not lines[i - 1].strip():
            continue
        header = lines[i - 1]
        rows = []
        for r in lines[i + 1:]:
            if not r.strip() or _RULE.match(r):
                break
            rows.append(r)
        if not rows:
            continue
        width = max(len(x) for x in rows + [header])
        used = [any(c < len(r) and r[c] != " " for r in rows) for c in range(width)]
        c = 0
        while c < width:
            if not used[c]:
                c += 1
                continue
            start = c
            while c < width and (used[c] or (c + 1 < width and used[c + 1] and c > start)):
                c += 1
            if not header[start:c].strip() and not header[max(start - 2, 0):c + 2].strip():
                out.append(f"line {i + 2}: a table column (characters {start}-{c}) has no header: {rows[0]!r}")
            c += 1
    return out


def problems(text: str, width: int = WIDTH) -> list[str]:
    """Every problem of one piped text output (see the module doc), one line each, naming the line."""
    out = []
    lines = text.splitlines()
    for n, ln in enumerate(lines, 1):
        if len(ln) > width:
            out.append(f"line {n}: {len(ln)} columns: {ln!r}")
        if ln != ln.rstrip():
            out.append(f"line {n}: trailing spaces: {ln!r}")
        if "…" in ln:
            out.append(f"line {n}: cut (…): {ln.strip()!r}")
        for word, pat in INTERNAL_WORDS.items():
            if pat.search(ln):
                out.append(f"line {n}: internal word {word!r}: {ln.strip()!r}")
    for para in _paragraphs(lines):
        depth = 0
        for n, s in para:
            if _ITEM.match(s):
                depth = 0  # a new item of a list
            s = _prose(s)
            for ch in s:
                depth += ch == "("
                if depth > 1 and ch == "(":
                    out.append(f"line {n + 1}: nested parentheses: {s.strip()!r}")
                    break
                depth = max(depth - (ch == ")"), 0)
        left = min(_indent(s) for _n, s in para)
        for k, ((_a, prev), (n, s)) in enumerate(zip(para, para[1:])):
            inner_width = width - 4 if _BOX_LEFT.match(lines[n]) else width
            cells = "   " in prev.strip()  # a table row, not a wrapped paragraph
            # a hanging indent: prev continues the filled, less indented line above it, so s starts a new item
            before = para[k - 1][1] if k > 0 else None
            hanging = (before is not None and _indent(before) < _indent(prev)
                       and len(before) >= inner_width - FULL)
            if (_indent(s) == left and _indent(prev) > left and len(prev) >= inner_width - FULL and not cells
                    and not hanging and not _RULE.match(prev) and not s.lstrip().startswith(("─", "note", "rank"))):
                out.append(f"line {n + 1}: a wrapped line lost its indent: {s.strip()!r}")
    for n, (prev, ln) in enumerate(zip(lines, lines[1:]), 2):
        if _NUMBER_END.search(_inner(prev)) and _UNIT_START.match(_inner(ln)):
            out.append(f"line {n}: a number and its unit on two lines: {prev.strip()[-20:]!r} / {ln.strip()[:12]!r}")
    out += _table_problems(lines)
    return out


_SIZE = re.compile(r"-?\d+\.\d\d [KMG]iB")
_MATERIAL = ("medium", "high", "critical")


def _ints(x) -> set[int]:
    if isinstance(x, bool):
        return set()
    if isinstance(x, int):
        return {x}
    if isinstance(x, dict):
        return set().union(*map(_ints, x.values())) if x else set()
    if isinstance(x, (list, tuple)):
        return set().union(*map(_ints, x)) if x else set()
    return set()


def headline_problems(doc: dict) -> list[str]:
    """Where the headline (``diagnose --format json``'s verdict) disagrees with the body of its own report:

    - it says "nothing worth fixing" while a finding is MEDIUM or above;
    - it is ``healthy`` on a rank that ran out of memory;
    - it quotes a size (``7.99 GiB``) that no number of its evidence, the findings or the ranks' peaks formats to;
    - under a memory-fraction cap (``room_kind`` ``fraction``) it counts the device's free memory;
    - it says what fits is not said because the allocator model does not reproduce the recording, where the
      prediction it quotes says the self-replay was exact;
    - a prediction's outcome quotes a peak reserved other than its own ``peak_reserved_bytes`` (the number
      ``oomdoctor simulate`` prints for the setting) or its extended step's.
    """
    from oomdoctor.render.format import fill, format_bytes

    v = doc.get("verdict")
    if not v:
        return []
    out = []
    ev = v.get("evidence") or {}
    summary = fill(v["summary"], ev) if "{" in v["summary"] else v["summary"]
    material = [f for f in doc.get("findings", []) if f["severity"] in _MATERIAL]
    if "nothing worth fixing" in summary and material:
        out.append(f"headline says nothing worth fixing; the report has {material[0]['severity'].upper()} "
                   f"{material[0]['id']}")
    if v["kind"] == "healthy" and any(r.get("oom") for r in doc.get("ranks", []) if r["rank"] in v["ranks"]):
        out.append("headline healthy on a rank that ran out of memory")
    known = {format_bytes(n) for n in _ints(ev) | _ints(doc.get("findings", []))
             | _ints([{k: r.get(k) for k in ("peak_reserved_bytes", "peak_allocated_bytes")} for r in doc["ranks"]])}
    for size in _SIZE.findall(summary):
        if size not in known:
            out.append(f"headline quotes {size}, which no number of its report formats to")
    predictions = [fx["prediction"] for f in doc.get("findings", []) for fx in f.get("fixes", []) if fx.get("prediction")]
    capped = (ev.get("room_kind") == "fraction" or ev.get("fix_capacity_kind") == "fraction"
              or any(p.get("capacity_kind") == "fraction" for p in predictions if v["ranks"] == [p.get("rank")]))
    if capped and "on the device" in summary:
        out.append("headline counts the device's free memory under a memory-fraction cap")
    if "does not reproduce this recording" in summary and ev.get("fix_self_replay_exact"):
        out.append("headline says the model does not reproduce the recording; its prediction's self-replay is exact")
    for f in doc.get("findings", []):
        for fx in f.get("fixes", []):
            p = fx.get("prediction")
            if not p:
                continue
            said = re.findall(r"peak reserved (?:of )?(-?\d+\.\d\d [KMG]iB)", fill(p["outcome"], p))
            own = {format_bytes(p["peak_reserved_bytes"])}
            if p.get("extended_peak_reserved_bytes") is not None:
                own.add(format_bytes(p["extended_peak_reserved_bytes"]))
            out += [f"{f['id']} with {p['config'] or 'the recorded settings'}: quotes peak reserved {x}, its replay's "
                    f"is {format_bytes(p['peak_reserved_bytes'])}" for x in said if x not in own]
    return out


def _oomdoctor(args: list[str], cwd: str) -> tuple[int, str, str, float]:
    env = {**os.environ, "COLUMNS": str(WIDTH)}
    env.pop("OOMDOCTOR_STRICT_TEMPLATES", None)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "oomdoctor", *args], capture_output=True, text=True, env=env,
                       cwd=cwd, timeout=900)
    return p.returncode, p.stdout, p.stderr, time.perf_counter() - t0


HELPS = [[], ["diagnose"], ["simulate"], ["run"], ["report"], ["diff"], ["slice"], ["export"], ["plan"],
         ["plan", "estimate"], ["plan", "search"], ["plan", "validate"], ["fit"], ["verify"], ["preflight"],
         ["schema"]]


TINY_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 50257, "n_positions": 1024}
"""A Hugging Face config preflight traces in seconds of CPU (two 128-wide layers)."""

TRAIN_PY = """import torch
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).to("cuda")
opt = torch.optim.AdamW(model.parameters())
for step in range(3):
    loss = model(torch.randn(64, 512, device="cuda")).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""
"""A user's script for ``preflight -- python train.py``."""

STEPS_PY = """import sys
import torch
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    model(torch.ones(int(sys.argv[1]) if len(sys.argv) > 1 else 2, 64)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""
"""A job for ``fit`` and ``verify`` on the CPU: torch optimizer steps, which the stop they inject counts (a trial
runs only when it fires after K steps: issue 49), and the micro-batch as its argument."""


def tool_commands(tmp: str, *, search: bool = True) -> list[list[str]]:
    """The commands that run a job or trace one rather than read snapshots: ``preflight`` (a Hugging Face config,
    with the search of the largest micro-batch unless ``search`` is False, and a script), then ``diagnose`` and
    ``simulate`` of preflight's own snapshot; ``run`` of a short script; ``fit`` and ``verify`` of a CPU job with
    optimizer steps (:data:`STEPS_PY`; no GPU here: without ``--allow-no-gpu`` they refuse at once, issue 49; with it
    they run the trials and say what that means); ``plan estimate`` of a Trainer job. Writes its inputs into ``tmp``, and names them relative
    to it: the commands run there (as a user names a file in the directory they work in)."""
    (Path(tmp) / "tiny-gpt2.json").write_text(json.dumps(TINY_GPT2))
    (Path(tmp) / "train.py").write_text(TRAIN_PY)
    (Path(tmp) / "steps.py").write_text(STEPS_PY)
    cfg, script, snap, tmp = "tiny-gpt2.json", "train.py", "pf.pickle", "."
    return [
        ["preflight", "--hf-config", str(cfg), "--micro-batch", "2", "--seq-len", "64", "--gpu", "H100-80GB", "-o", snap,
         *(() if search else ("--no-search",))],
        ["diagnose", snap], ["simulate", snap],
        ["preflight", "--gpu", "H100-80GB", "--", "python", str(script)],
        ["run", "--out", f"{tmp}/run", "--", sys.executable, "-c", "print('no CUDA here')"],
        ["fit", "--allow-no-gpu", "--high", "2", "--out", f"{tmp}/fit", "--", sys.executable, "steps.py", "{mb}"],
        ["verify", "--allow-no-gpu", "--setting", "expandable_segments:True", "--out", f"{tmp}/verify", "--",
         sys.executable, "steps.py"],
        ["plan", "estimate", "--model", "gpt2", "--framework", "hf", "--loop", "trainer", "--sharding", "none", "--gpus",
         "2", "--gpu", "h200", "--seq", "1024", "--mbs", "8", "--gbs", "16"],
    ]


def commands(snapshots: Path | None, demo: str, tmp: str, *, quick: bool = False,
             tools: bool = True) -> list[list[str]]:
    """The sweep's command lines (without ``oomdoctor``); ``tools``: with :func:`tool_commands`."""
    root = Path(__file__).resolve().parents[1]
    cmds = [[*h, "--help"] for h in HELPS]
    cmds += [
        ["plan", "estimate", "--model", "llama3-70b", "--gpus", "32", "--seq", "4096", "--gbs", "32", "--tp", "4",
         "--pp", "4", "--vpp", "5"],
        ["plan", "search", "--model", "llama3-8b", "--gpus", "16", "--seq", "8192", "--gbs", "64",
         "--sharding", "fsdp", "--framework", "torch"],
        ["plan", "validate", str(root / "tests" / "data" / "golden_memory_sample.csv")],
    ]
    files = [demo]
    runs: list[list[str]] = []  # the files of one run of several ranks
    if snapshots is not None and snapshots.is_dir():
        for folder in sorted(p for p in snapshots.iterdir() if p.is_dir()):
            pickles = sorted(str(p) for p in folder.glob("*.pickle"))
            files += pickles[:1] if quick else pickles
            by_run: dict[str, list[str]] = {}
            for p in pickles:
                by_run.setdefault(re.sub(r"rank\d+$", "", Path(p).stem), []).append(p)
            runs += [group for group in by_run.values() if len(group) > 1]
    for i, f in enumerate(files):
        cmds += [["diagnose", f], ["simulate", f], ["simulate", f, "--search", "-j", "1"],
                 ["simulate", f, "--config", "expandable_segments:True"],
                 ["report", f, "-o", f"{tmp}/r{i}.html", "-j", "1"],
                 ["slice", f, "--end", "100", "-o", f"{tmp}/s{i}.pickle"],
                 ["export", f, "-o", f"{tmp}/e{i}.json", "-j", "1"],
                 ["export", f, "--format", "folded", "-o", f"{tmp}/f{i}.folded"]]
    for group in runs[:2] if quick else runs:
        cmds += [["diagnose", *group, "-j", "1"]]
    clean = [g for g in runs if "ddp-clean" in g[0]]
    bug = [g for g in runs if "ddp-imbalance" in g[0]]
    if clean and bug:
        cmds += [["diff", str(Path(bug[0][0]).parent), str(Path(clean[0][0]).parent), "-j", "1"],
                 ["slice", clean[0][0], "--by", "step", "--start", "10", "--end", "12", "-o", f"{tmp}/steps.pickle"]]
    legacy = [f for f in files if f.endswith("tp-allreduce/legacy-rank0.pickle")]
    modern = [f for f in files if f.endswith("tp-allreduce/modern-rank0.pickle")]
    if legacy and modern:
        cmds += [["diff", legacy[0], modern[0], "-j", "1"]]
    return cmds + (tool_commands(tmp, search=not quick) if tools else [])


def sweep(snapshots: Path | None, *, quick: bool = False) -> list[dict]:
    """Run every command of :func:`commands`; one record each: args, exit code, seconds, problems."""
    from oomdoctor.cli.diagnose import demo_path

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for args in commands(snapshots, demo_path(), tmp, quick=quick):
            rc, stdout, stderr, wall = _oomdoctor(args, tmp)
            found = problems(stdout)
            if args[0] == "diagnose" and "--help" not in args:
                rc2, js, _err, wall2 = _oomdoctor([*args, "--format", "json"], tmp)
                wall += wall2
                found += headline_problems(json.loads(js)) if rc2 in (0, 1) else [f"--format json: exit {rc2}"]
            if rc not in (0, 1):  # 1: a gate or an OOM found; 2 and up: a failure
                found.append(f"exit {rc}: {stderr.strip()[-300:]}")
            out.append({"args": args, "rc": rc, "seconds": round(wall, 2), "lines": len(stdout.splitlines()),
                        "problems": found})
    return out


def main() -> int:
    default = Path(os.environ.get("OOMDOCTOR_SHARED", Path(__file__).resolve().parents[2] / "shared")) / "snapshots"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshots", nargs="?", type=Path, default=default)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true")
    ns = ap.parse_args()
    records = sweep(ns.snapshots, quick=ns.quick)
    total = 0
    for r in records:
        for p in r["problems"]:
            print(f"oomdoctor {' '.join(r['args'])}: {p}")
        total += len(r["problems"])
    print(f"{len(records)} commands, {sum(r['seconds'] for r in records):.0f} s, {total} problems")
    if ns.out:
        ns.out.mkdir(parents=True, exist_ok=True)
        (ns.out / "sweep.json").write_text(json.dumps(records, indent=1))
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
