"""The byte-for-byte guard of a refactor: ``oomdoctor diagnose`` as a user runs it, JSON (and the HTML page, whose
views a refactor may move), on every snapshot of ``../shared/snapshots`` and every run of the real-job corpus
(docs/corpus/), with the code of a given source tree, written one file per output to a directory; and the comparison
of two such directories.

    python benchmarks/json_identity.py record SRC OUT_DIR [--shared DIR] [--no-html]   # SRC: a checkout's src/;
    # DIR: the snapshots (default: $OOMDOCTOR_SHARED/snapshots, else ../shared/snapshots)
    python benchmarks/json_identity.py compare BEFORE_DIR AFTER_DIR [--ignore-key KEY ...]   # KEY: a JSON key the
    # change added (removed from AFTER at every depth before comparing)

``record`` writes, per input, ``<label>.json`` (``diagnose --format json -j 1``; its exit status and stderr in
``<label>.json.rc``) and, for the shared snapshots, ``<label>.html`` (``--format html``); the multi-rank shared
directories also through a pool of two processes (``.j2.json``) and Dask (``.dask.json``, where ``distributed`` is
installed), so that every executor is held to the same bytes. The only edit made to an output: the temporary
directory a corpus run was unpacked into reads ``RUN``. No output holds a timing (``extra.waited_s`` is the in-job
summary's only, which no command here writes): nothing else is excluded (:data:`EXCLUDED`).

``compare`` lists every file that differs or is in one directory only and exits 1 if any does.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "docs" / "corpus"
SHARED = Path(os.environ.get("OOMDOCTOR_SHARED", ROOT.parent / "shared")) / "snapshots"
EXCLUDED: tuple[str, ...] = ()  # JSON keys left out of the comparison (timings): none exist
SNAPSHOT_SUFFIXES = (".pickle", ".pickle.xz", ".pkl", ".npz")


def _run(env: dict, args: list[str], out: Path, unpacked: str | None = None) -> None:
    p = subprocess.run([sys.executable, "-m", "oomdoctor", "diagnose", *args], capture_output=True, env=env)
    body, err = p.stdout, p.stderr
    if unpacked:
        body, err = body.replace(unpacked.encode(), b"RUN"), err.replace(unpacked.encode(), b"RUN")
    if out.suffix == ".json" and p.returncode == 0 and EXCLUDED:
        doc = json.loads(body)
        for k in EXCLUDED:
            doc.pop(k, None)
        body = json.dumps(doc, indent=2).encode()
    out.write_bytes(body)
    out.with_name(out.name + ".rc").write_bytes(f"{p.returncode}\n".encode() + err)


def _shared_inputs(shared: Path) -> list[tuple[str, Path]]:
    out = []
    for d in sorted(p for p in shared.iterdir() if p.is_dir()):
        files = sorted(f for f in d.iterdir() if f.name.endswith(SNAPSHOT_SUFFIXES))
        if len(files) > 1:
            out.append((f"shared-{d.name}", d))
        out += [(f"shared-{d.name}-{f.name.split('.')[0]}", f) for f in files]
    return out


def record(src: str, out_dir: str, shared: Path = SHARED, html: bool = True) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(Path(src).resolve()), "COLUMNS": "80"}
    try:
        import distributed  # noqa: F401
        dask = True
    except ImportError:
        dask = False
    for label, path in _shared_inputs(shared):
        _run(env, ["-j", "1", "--format", "json", str(path)], out / f"{label}.json")
        if html:
            _run(env, ["-j", "1", "--format", "html", str(path)], out / f"{label}.html")
        if path.is_dir() and len([f for f in path.iterdir() if f.name.endswith(SNAPSHOT_SUFFIXES)]) > 1:
            _run(env, ["-j", "2", "--format", "json", str(path)], out / f"{label}.j2.json")
            if dask and label == "shared-ddp-imbalance":
                _run(env, ["--executor", "dask", "--format", "json", str(path)], out / f"{label}.dask.json")
        print(label, flush=True)
    runs = json.loads((CORPUS / "runs.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        for name in runs:
            with tarfile.open(CORPUS / f"{name}.tar.xz") as tar:
                tar.extractall(tmp, filter="data")
            _run(env, ["-j", "1", "--format", "json", str(Path(tmp) / name)], out / f"corpus-{name}.json",
                 unpacked=str(Path(tmp) / name))
            print(name, flush=True)


def _without(x, keys: tuple[str, ...]):
    """``x`` (parsed JSON) with every dict key in ``keys`` removed, at every depth."""
    if isinstance(x, dict):
        return {k: _without(v, keys) for k, v in x.items() if k not in keys}
    if isinstance(x, list):
        return [_without(v, keys) for v in x]
    return x


def _same(b: Path, a: Path, ignore: tuple[str, ...]) -> bool:
    """Byte-identical; or, with ``ignore`` (keys a change added to the JSON), a ``.json`` output identical once those
    keys are removed from the after side, re-written as the CLI writes it (``indent=2`` and a newline)."""
    if filecmp.cmp(b, a, shallow=False):
        return True
    if not ignore or not a.name.endswith(".json"):
        return False
    try:
        doc = json.loads(a.read_bytes())
    except ValueError:
        return False
    return json.dumps(_without(doc, ignore), indent=2).encode() + b"\n" == b.read_bytes()


def compare(before: str, after: str, ignore: tuple[str, ...] = ()) -> int:
    """Every file that differs or is in one directory only; ``ignore``: JSON keys added by the change, removed from
    the after side before comparing (``--ignore-key KEY``, repeatable)."""
    b, a = Path(before), Path(after)
    names = sorted({p.name for p in b.iterdir()} | {p.name for p in a.iterdir()})
    bad = 0
    for n in names:
        if not (b / n).exists() or not (a / n).exists():
            print(f"only in {'after' if not (b / n).exists() else 'before'}: {n}")
            bad += 1
        elif not _same(b / n, a / n, ignore):
            print(f"differs: {n}")
            bad += 1
    print(f"{len(names) - bad} of {len(names)} files identical" + (f" (ignoring keys {', '.join(ignore)})" if ignore
                                                                    else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) >= 3 and args[0] == "record":
        shared = Path(args[args.index("--shared") + 1]) if "--shared" in args else SHARED
        record(args[1], args[2], shared, html="--no-html" not in args)
    elif len(args) >= 3 and args[0] == "compare":
        ignore = tuple(args[i + 1] for i, x in enumerate(args) if x == "--ignore-key" and i + 1 < len(args))
        sys.exit(compare(args[1], args[2], ignore))
    else:
        sys.exit("usage: json_identity.py record SRC OUT_DIR [--shared DIR] [--no-html] | compare BEFORE AFTER "
                 "[--ignore-key KEY ...]")
