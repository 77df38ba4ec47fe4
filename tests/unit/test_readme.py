"""README.md's examples are real output, regenerated here so they cannot go stale.

Each example sits between ``<!-- example:NAME -->`` and ``<!-- /example -->`` in README.md. The test renders it
afresh and compares; ``OOMDOCTOR_UPDATE_README=1 python -m pytest tests/unit/test_readme.py`` rewrites them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from oomdoctor.cli.main import main

README = Path(__file__).resolve().parents[2] / "README.md"
UPDATE = os.environ.get("OOMDOCTOR_UPDATE_README") == "1"
_BLOCK = re.compile(r"(<!-- example:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /example -->)", re.S)


def _run(capsys, monkeypatch, argv: list[str]) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    capsys.readouterr()
    assert main(argv) == 0
    return capsys.readouterr().out


def _check(name: str, lang: str, text: str) -> None:
    body = f"```{lang}\n{text.rstrip()}\n```\n"
    readme = README.read_text(encoding="utf-8")
    m = {b.group("name"): b for b in _BLOCK.finditer(readme)}.get(name)
    assert m is not None, f"README.md has no <!-- example:{name} --> block"
    if UPDATE:
        README.write_text(readme[:m.start("body")] + body + readme[m.end("body"):], encoding="utf-8")
        return
    assert m.group("body") == body, f"README.md's {name} example is stale: OOMDOCTOR_UPDATE_README=1 rewrites it"


def _head(text: str, until: str) -> str:
    """The lines of ``text`` before the first that starts with ``until``, then an ellipsis line."""
    lines = [x.rstrip() for x in text.splitlines()]
    cut = next(i for i, x in enumerate(lines) if x.startswith(until))
    return "\n".join(lines[:cut] + ["…"])


def test_the_demo_example_is_the_demo_output(capsys, monkeypatch):
    out = _run(capsys, monkeypatch, ["diagnose", "--demo"])
    assert out.startswith("oomdoctor ") and "deferred-free" in out.splitlines()[0]
    _check("diagnose-demo", "text", _head(out, "│ Fix:"))


def test_the_json_example_is_the_demo_output_with_its_verdict(capsys, monkeypatch):
    d = json.loads(_run(capsys, monkeypatch, ["diagnose", "--demo", "--format", "json"]))
    v, r, f = d["verdict"], d["ranks"][0], d["findings"][0]
    keep = {
        "schema_version": d["schema_version"],
        "verdict": {k: v[k] for k in ("kind", "summary", "bytes", "ranks", "finding")} | {"actions": v["actions"][:1]},
        "ranks": [{k: r[k] for k in ("rank", "peak_allocated_bytes", "peak_reserved_bytes", "oom")}],
        "findings": [{k: f[k] for k in ("id", "severity", "title", "ranks", "bytes")}
                     | {"fixes": [{k: f["fixes"][0][k] for k in ("versions", "setting", "applies")}]}],
    }
    assert keep["verdict"]["kind"] == "deferred-free"
    _check("diagnose-json", "json", json.dumps(keep, indent=1, ensure_ascii=False))


def test_the_simulate_example_is_real_output(capsys, monkeypatch, snapshots):
    # a relative path, so the wrapped title does not depend on where the snapshots live
    monkeypatch.chdir(snapshots)
    path = os.path.join("fragmentation-oom", "default-oom.pickle")
    out = _run(capsys, monkeypatch, ["simulate", path, "--config", "expandable_segments:True",
                                     "--config", "max_split_size_mb:512"])
    assert "34.78 GiB" in out
    _check("simulate", "text", out)


def test_every_example_block_is_checked():
    names = {m.group("name") for m in _BLOCK.finditer(README.read_text(encoding="utf-8"))}
    assert names == {"diagnose-demo", "diagnose-json", "simulate"}


@pytest.mark.parametrize("stale", ["seed 0", "../shared", "segsum", "savable", "shared/snapshots"])
def test_the_readme_holds_no_internal_reference(stale):
    assert stale not in README.read_text(encoding="utf-8")


def test_ci_runs_the_readme_test_command():
    """.ci/run ends with the README's test command (after its own venv), lint-imports, pyright and skip reasons
    included."""
    readme = README.read_text(encoding="utf-8")
    cmd = next(line for line in readme.splitlines() if line.startswith("python3 -m venv .venv && ") and "pytest" in line)
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8").rstrip().splitlines()[-1]
    assert cmd.endswith(" && " + ci)
    assert "lint-imports && ruff check src tests benchmarks scenarios && pyright -p pyproject.toml && python -m pytest -q -rs" in ci


def test_the_api_names_the_readme_gives_analyze_exist(demo_trace):
    """The README's comment on ``analyze(trace)`` names attributes and methods that exist, as it spells them."""
    from oomdoctor.analysis import analyze

    line = next(x for x in README.read_text(encoding="utf-8").splitlines() if x.startswith("a = analyze(trace)"))
    names = re.findall(r"\.(\w+)(\(k\))?", line.split("#", 1)[1])
    assert len(names) == 5
    a = analyze(demo_trace)
    for name, call in names:
        assert hasattr(a, name), name
        assert callable(getattr(a, name)) == bool(call), name  # methods with (k), attributes without


def test_the_readme_says_what_skips_without_the_snapshots_and_where_they_go():
    text = " ".join(README.read_text(encoding="utf-8").split())
    # no count: none of docs/*.json holds it, and the README's went stale (issue 52: "162" where 201 skipped)
    assert "the tests that read them skip, each with its reason (`-rs`)" in text
    assert "OOMDOCTOR_SHARED=DIR" in text and "`DIR/snapshots/`" in text
