"""What a user reads holds no internal reference; templates fill or fail loudly; a Trace saves and loads."""

from __future__ import annotations

import ast
import pathlib
import re

import numpy as np
import pytest

import oomdoctor
from oomdoctor.render.format import STRICT_ENV, fill

SRC = pathlib.Path(oomdoctor.__file__).parent
INTERNAL = re.compile(r"shared/|\bseed \d|\bAP-\d|docs/corpus|checkpoint_crash|antipatterns\.md|(?<![/\w])docs/\w+\.md")


def _runtime_strings() -> list[tuple[str, int, str]]:
    """Every string constant of the package that can reach a user at run time: all of them but docstrings
    (a string alone as a statement, which only ``help()`` and the source show)."""
    out = []
    for py in SRC.rglob("*.py"):
        tree = ast.parse(py.read_text(encoding="utf-8"))
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        out += [(str(py.relative_to(SRC)), n.lineno, n.value) for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]
    return out


# the header of docs/json.md, which render/schema.py writes into the repository's docs (not shipped, not shown)
ALLOWED = {("render/schema.py", "Generated from `src/oomdoctor/render/schema.py`")}


def test_what_a_user_reads_cites_public_material():
    found = _runtime_strings()
    assert len(found) > 1000  # the walk reaches the fixes' sources, the CLI's help and the verdicts
    assert any("PR #96995" in s for _f, _l, s in found)
    bad = [f"{f}:{line}: {s[:80]}" for f, line, s in found if INTERNAL.search(s)
           and not any(f == af and s.startswith(a) for af, a in ALLOWED)]
    assert bad == []


def test_the_internal_pattern_catches_what_the_issue_found():
    for s in ("shared/snapshots/tp-allreduce stats.jsonl", "seed 001 tip 3", "antipatterns.md AP-06",
              "see docs/checkpoint_crash.md"):
        assert INTERNAL.search(s), s
    assert not INTERNAL.search("github.com/pytorch/torchtitan/blob/main/docs/fsdp.md")


def test_fill_renders_what_it_can_and_keeps_a_missing_key_visible(monkeypatch):
    monkeypatch.delenv(STRICT_ENV, raising=False)
    got = fill("{a:bytes} held, {missing:bytes} more, {b} ranks", {"a": 3 * 2**30, "b": 2})
    assert got == "3.00 GiB held, {missing} more, 2 ranks"
    assert fill("{a[x]:bytes}", {"a": {"x": 1024}}) == "1.00 KiB"
    assert fill("broken {", {}) == "broken {"


def test_fill_raises_on_a_missing_key_under_tests(monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(KeyError, match="missing"):
        fill("{missing:bytes}", {})
    with pytest.raises(ValueError):
        fill("broken {", {})


def test_trace_save_round_trips_through_load(tmp_path, demo_trace):
    out = tmp_path / "t.npz"
    demo_trace.save(out)
    back = oomdoctor.load(out)
    a, b = demo_trace.primary, back.primary
    assert b.num_events == a.num_events > 0
    for col in a.events:
        assert np.array_equal(a.events[col], b.events[col]), col
    assert [s.total_size for s in b.segments] == [s.total_size for s in a.segments]
    assert back.rank == demo_trace.rank
    assert back.path == str(out) and demo_trace.path.endswith(".pickle")  # the file read, not the one saved from
    d1, d2 = oomdoctor.diagnose(demo_trace.path), oomdoctor.diagnose(str(out))
    assert d2.report.ranks[0].peak_reserved_bytes == d1.report.ranks[0].peak_reserved_bytes
