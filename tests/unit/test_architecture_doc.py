"""docs/architecture.md is true to the code (issue 53 item 7): every module it names imports, every file it names
exists, and every function or class it names (``name(...)`` in the diagram, a CamelCase name or an UPPER_CASE table
in a code span) is defined in the source. A rename that leaves the document behind fails here."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "oomdoctor"
DOC = (ROOT / "docs" / "architecture.md").read_text()

#: names the document writes that are not this package's: pydantic's, dataclasses', the JSON's fields
FOREIGN = {"TypeAdapter", "asdict", "json_schema"}


def _files() -> list[str]:
    return sorted(set(re.findall(r"(?<![\w/.])((?:[a-z_]+/)+[a-z_]+\.py)\b", DOC)))


def _defined() -> set[str]:
    """Every function, class and module-level name assigned in the source."""
    out: set[str] = set()
    for p in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Name):
                        out.add(t.id)
    return out


def _named() -> set[str]:
    """Functions called in the text or its diagrams (``load(path)``), and the classes and id tables of its code
    spans (``Verdict``, ``REASONS``, ``Capacity.source``'s class)."""
    calls = set(re.findall(r"\b([a-z_][a-z0-9_]*)\((?:[a-z_, ]*|\.\.\.)\)", DOC))
    spans = re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", DOC, flags=re.S))  # the diagrams' fences aside
    caps = {m.group(1) for s in spans for m in [re.match(r"([A-Z][A-Za-z]+|[A-Z][A-Z_]+)\b", s)] if m}
    return (calls | caps) - FOREIGN - {"preflight"}


@pytest.mark.parametrize("rel", _files())
def test_every_file_it_names_exists(rel):
    assert (SRC / rel).is_file() or (ROOT / rel).is_file(), rel


@pytest.mark.parametrize("rel", [f for f in _files() if (SRC / f).is_file()])
def test_every_module_it_names_imports(rel):
    importlib.import_module("oomdoctor." + rel.removesuffix(".py").replace("/", "."))


def test_every_function_and_class_it_names_is_defined():
    named = _named()
    assert len(named) >= 20, sorted(named)  # the diagram's stages and the id tables, read
    assert sorted(named - _defined()) == []


def test_the_layers_it_draws_are_the_contracts():
    """The diagram's boxes name every package of the contract's layers, and no other."""
    import tomllib

    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    packages = {p.strip() for layer in layers for p in re.split(r"[:|]", layer)}
    box = DOC[DOC.index(" ┌"):DOC.index(" └")]
    drawn = set(re.findall(r"│ ([a-z_]+)\b", box)) | set(re.findall(r"· ([a-z_]+)", box))
    assert packages <= drawn | {"__main__", "_lazy", "_version"}, sorted(packages - drawn)
    assert {p for p in drawn if (SRC / p).exists() or (SRC / f"{p}.py").exists()} <= packages
