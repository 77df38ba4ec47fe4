"""Imports run one way (ARCHITECTURE.md, "Layers and their rules"): a module imports only its own layer and
the layers below it. Read from the source (ast), every import, also those inside functions and under
TYPE_CHECKING."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

#: bottom first; a package's modules may import from their own layer and any earlier one
LAYERS = [
    {"_version", "errors", "_lazy", "units", "frameworks", "ids"},
    {"capture"},
    {"trace"},
    {"analysis"},
    {"simulate"},
    {"detectors"},
    {"plan"},
    {"views"},  # what the page draws of a rank's analysis: below report, whose per-rank work draws it
    {"report"},
    {"render", "preflight"},  # preflight: torch, its snapshots written by capture's files, the report's answer
    {"cli", "jobsummary", "notebook", "integrations", "pytest_plugin", "__main__", "<root>"},
]
#: modules that may reach a layer above their own at call time: none (the preflight package's ``__call__`` hands to
#: its own ``api`` module, and the sitecustomize ``oomdoctor run`` injects lives in cli/)
ENTRY_POINTS: set[str] = set()


def _layer(top: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if top in names)


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported module or package attribute, line) of every oomdoctor import in ``path``."""
    mod = ".".join(path.relative_to(SRC).with_suffix("").parts)
    pkg = mod[: -len(".__init__")] if mod.endswith(".__init__") else mod.rsplit(".", 1)[0]
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                target = ".".join(base + ([n.module] if n.module else []))
            else:
                target = n.module or ""
            if target == "oomdoctor":
                out += [(f"oomdoctor.{a.name}", n.lineno) for a in n.names]
            elif target.startswith("oomdoctor."):
                out.append((target, n.lineno))
        elif isinstance(n, ast.Import):
            out += [(a.name, n.lineno) for a in n.names if a.name.startswith("oomdoctor")]
    return out


def _top(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "<root>"
    return parts[1] if (SRC / "oomdoctor" / parts[1]).is_dir() or (SRC / "oomdoctor" / f"{parts[1]}.py").exists() \
        else "<root>"  # a package attribute: oomdoctor.load, oomdoctor.record


def violations() -> list[str]:
    out = []
    for p in sorted((SRC / "oomdoctor").rglob("*.py")):
        mod = ".".join(p.relative_to(SRC).with_suffix("").parts)
        if mod in ENTRY_POINTS:
            continue
        here = _top(mod.removesuffix(".__init__")) if mod != "oomdoctor.__init__" else "<root>"
        for target, line in _imports(p):
            there = _top(target)
            if there != here and _layer(there) > _layer(here):
                out.append(f"{p.relative_to(SRC)}:{line} ({here}) imports {target} ({there})")
    return out


def test_every_package_is_in_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in (SRC / "oomdoctor").iterdir()
            if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())) and p.stem != "__init__"}
    assert tops <= set().union(*LAYERS), tops - set().union(*LAYERS)


def test_imports_run_downwards():
    assert violations() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The rule can fail: a render import in analysis is named."""
    fake = tmp_path / "oomdoctor"
    (fake / "analysis").mkdir(parents=True)
    (fake / "render").mkdir()
    for d in (fake, fake / "analysis", fake / "render"):
        (d / "__init__.py").write_text("")
    (fake / "analysis" / "bad.py").write_text("def f():\n    from ..render import text\n")
    (fake / "_version.py").write_text("")
    (fake / "render" / "ok.py").write_text("from ..analysis import bad\nfrom .._version import __version__\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    assert violations() == ["oomdoctor/analysis/bad.py:2 (analysis) imports oomdoctor.render (render)"]


def test_the_import_linter_contracts_hold():
    """pyproject.toml's [tool.importlinter] contracts (layers, no torch in the core, no cycles), as `lint-imports`
    checks them in .ci/run: direct and indirect imports, at any depth."""
    pytest.importorskip("importlinter")
    from importlinter.cli import lint_imports

    assert lint_imports(config_filename=str(SRC.parent / "pyproject.toml"), no_cache=True, no_logo=True) == 0
