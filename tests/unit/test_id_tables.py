"""One words table per kind of id (issue 53 item 2): every ``Literal`` kind of :mod:`oomdoctor.ids` has exactly one
table in :mod:`oomdoctor.render.words`, each of its ids one row there; the core keeps ids only (no description beside
an id in a core module); a table that misses or adds an id is refused at import; a renamed id's old name resolves to
it; and the type checker refuses an id that is not one of its kind."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from oomdoctor import ids
from oomdoctor.render.words import breakdown, capacity, fits, margin, simulate, tune, verdict
from oomdoctor.render.words.table import TableError, Words, current_id, meaning, table, text

SRC = Path(ids.__file__).resolve().parent
ROOT = SRC.parents[1]

#: each kind of ids.py (its tuple's name) -> its one words table
TABLES = {
    "VERDICT_KINDS": verdict.KINDS, "VERDICT_REASONS": verdict.REASONS, "VERDICT_ACTIONS": verdict.ACTIONS,
    "FITS_NOTES": fits.NOTES, "FITS_ASSUMPTIONS": fits.ASSUMPTIONS, "ROOM_SOURCES": capacity.ROOM_SOURCES,
    "CAPACITY_SOURCES": capacity.SOURCES, "RECOMMENDATION_REASONS": simulate.REASONS,
    "SIMULATION_NOTES": simulate.NOTES, "MARGIN_SOURCES": margin.SOURCES, "TUNE_NOTES": tune.NOTES,
    "BREAKDOWN_LINES": breakdown.LINES, "BREAKDOWN_POINTS": breakdown.POINTS,
    "PHASE_SOURCES": breakdown.PHASE_SOURCES_SAID, "UNKNOWN_WHYS": breakdown.UNKNOWN,
}

CORE = ("analysis", "simulate", "detectors", "report", "plan", "views", "trace")


def _kinds() -> dict[str, tuple[str, ...]]:
    """Every tuple of ids.py that is ``get_args`` of one of its ``Literal`` aliases."""
    aliases = [v for v in vars(ids).values() if typing.get_origin(v) is typing.Literal]
    return {k: v for k, v in vars(ids).items()
            if isinstance(v, tuple) and any(typing.get_args(a) == v for a in aliases)}


def test_every_kind_has_one_table_with_a_row_per_id_in_order():
    kinds = _kinds()
    assert set(kinds) == set(TABLES)
    for name, id_tuple in kinds.items():
        assert tuple(TABLES[name]) == id_tuple, name
        assert all(isinstance(w, Words) and (w.description or w.text) for w in TABLES[name].values()), name


def test_the_core_reexports_the_ids_not_descriptions():
    from oomdoctor.report import fits as core_fits
    from oomdoctor.report import margin as core_margin
    from oomdoctor.report import tune as core_tune
    from oomdoctor.report import verdict as core_verdict
    from oomdoctor.simulate import capacity as core_capacity
    from oomdoctor.simulate import whatif

    assert core_verdict.REASONS is ids.VERDICT_REASONS and core_verdict.ACTIONS is ids.VERDICT_ACTIONS
    assert core_verdict.KINDS is ids.VERDICT_KINDS and core_fits.NOTES is ids.FITS_NOTES
    assert core_fits.ASSUMPTIONS is ids.FITS_ASSUMPTIONS and core_capacity.SOURCES is ids.CAPACITY_SOURCES
    assert core_margin.SOURCES is ids.MARGIN_SOURCES and core_tune.NOTES is ids.TUNE_NOTES
    assert whatif.RECOMMENDATION_REASONS is ids.RECOMMENDATION_REASONS


def test_the_breakdown_reads_its_ids_from_ids_py_and_the_schema_enumerates_them():
    # the accounting indexes its categories and reasons by position: the ids' order is the core's order
    from oomdoctor.analysis import accounting, phases
    from oomdoctor.render import schema

    assert accounting.LINES is ids.BREAKDOWN_LINES and accounting.UNKNOWN_WHY is ids.UNKNOWN_WHYS
    assert accounting.CATEGORIES + (accounting.ROUNDING,) == ids.BREAKDOWN_LINES
    assert accounting.CATEGORIES[accounting.UNKNOWN] == "unknown" and accounting.CATEGORIES[accounting.BUFFERS] == "buffers"
    assert phases.SOURCE_NAMES is ids.PHASE_SOURCES and phases.SOURCE_NAMES[phases.INFERRED] == "inferred"
    assert schema.BREAKDOWN_POINTS is ids.BREAKDOWN_POINTS and schema.BREAKDOWN_LINES is ids.BREAKDOWN_LINES


def _described_ids(path: Path) -> list[str]:
    """Module-level dicts of ``path`` whose keys are ids of one kind and whose values are sentences."""
    every = {i for v in _kinds().values() for i in v}
    out = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(value, ast.Dict) or not value.keys:
            continue
        keys = [k.value for k in value.keys if isinstance(k, ast.Constant)]
        texts = [v for v in value.values if isinstance(v, (ast.Constant, ast.JoinedStr, ast.BinOp))
                 and len(ast.unparse(v).split()) >= 4]
        if len(keys) == len(value.keys) and set(keys) <= every and len(texts) == len(keys):
            out.append(f"{path}:{node.lineno}")
    return out


def test_no_core_module_describes_an_id():
    found = [x for pkg in CORE for p in sorted((SRC / pkg).rglob("*.py")) for x in _described_ids(p)]
    assert found == []


def test_the_scan_finds_a_description_beside_ids(tmp_path):
    """The scan above can fail: the verdict's reasons described in a core module, as they were before."""
    p = tmp_path / "described.py"
    p.write_text('REASONS = {\n    "room-known": "the room the allocator could use is known",\n'
                 '    "at-edge": "healthy with less than EDGE_FRACTION of the room left",\n}\n')
    assert _described_ids(p) == [f"{p}:1"]
    p.write_text('KINDS = {"room-known": "ok", "at-edge": "edge"}\n')  # short values: not sentences
    assert _described_ids(p) == []


def test_a_table_refuses_a_missing_an_extra_or_an_empty_row_and_a_clashing_old_name():
    ok = {"a": Words(description="the a"), "b": Words(text="the b is {n}")}
    assert list(table("k", ("b", "a"), ok)) == ["b", "a"]
    with pytest.raises(TableError, match=r"missing for \['c'\]"):
        table("k", ("a", "b", "c"), ok)
    with pytest.raises(TableError, match=r"not k's: \['b'\]"):
        table("k", ("a",), ok)
    with pytest.raises(TableError, match="neither"):
        table("k", ("a",), {"a": Words(description=" ")})
    with pytest.raises(TableError, match=r"old names .*\['b'\]"):
        table("k", ("a", "b"), {"a": Words(description="x", old_names=("b",)), "b": Words(description="y")})
    with pytest.raises(TableError, match=r"old names .*\['z'\]"):
        table("k", ("a", "b"), {"a": Words(description="x", old_names=("z",)), "b": Words(description="y",
                                                                                           old_names=("z",))})


def test_old_names_resolve_to_the_current_id_and_words_are_read_by_id():
    rows = table("k", ("new", "other"), {"new": Words(description="the new one", text="new {x}",
                                                      old_names=("old",)),
                                         "other": Words(description="the other one")})
    assert current_id(rows, "old") == "new" and current_id(rows, "new") == "new"
    assert current_id(rows, "gone") is None
    assert text(rows, "new") == "new {x}" and meaning(rows, "other") == "the other one"
    with pytest.raises(KeyError):
        text(rows, "other")  # said by a function: no one template


def test_each_real_table_is_read_the_way_its_renderer_reads_it():
    assert fits.note("replay-failed", {"replay_error": "x"}) == "the trace cannot be replayed: x"
    assert tune.note("no-gpu").startswith("no GPU here")
    assert simulate.reason("lowest-peak") == "lowest peak reserved without an OOM"
    assert margin.source("self-replay-exact") == "the self-replay reproduces the reserved bytes"
    assert capacity.room_source("none", {}) == "unknown: no OOM and no sidecar with the GPU's memory"


@pytest.mark.skipif(shutil.which("pyright") is None and not (Path(sys.executable).parent / "pyright").exists(),
                    reason="pyright is not installed (it is in the test extra)")
def test_the_type_checker_refuses_an_id_of_no_kind(tmp_path):
    """A misspelt reason, a sentence passed as a capacity's source: pyright (pinned, as in .ci/run) says both."""
    snippet = tmp_path / "misuse.py"
    snippet.write_text(
        "from oomdoctor.report.verdict import Verdict\n"
        "from oomdoctor.simulate.capacity import Capacity\n"
        "Verdict(kind='healthy', bytes=0, ranks=[0], reasons=['room-knwn'])\n"
        "Capacity(limit_bytes=1, kind='device', source='the GPU total less the CUDA context')\n"
        "Verdict(kind='healthy', bytes=0, ranks=[0], reasons=['room-known'])\n")
    (tmp_path / "pyrightconfig.json").write_text(json.dumps({"extraPaths": [str(SRC.parent)], "pythonVersion": "3.11"}))
    exe = shutil.which("pyright") or str(Path(sys.executable).parent / "pyright")
    got = subprocess.run([exe, "--pythonpath", sys.executable, "--outputjson", str(snippet)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    diags = json.loads(got.stdout)["generalDiagnostics"]
    lines = sorted({d["range"]["start"]["line"] + 1 for d in diags if d["severity"] == "error"})
    assert lines == [3, 4], [d["message"][:120] for d in diags]
