"""The public-script corpus's machinery (issue 50 item 5): the manifest and its split, an entry's working
directory, the GPU-truth step hook on a real (CPU) optimizer, and the table's errors and bounds."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "benchmarks" / "preflight_corpus"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


corpus = _load("corpus", CORPUS / "corpus.py")
table = _load("preflight_public_table", ROOT / "benchmarks" / "preflight_public_table.py")


def test_every_entry_is_in_exactly_one_half_and_a_script_never_straddles():
    m = corpus.manifest()
    s = json.loads(corpus.SPLIT.read_text())
    groups = {e["group"] for e in m["entries"]}
    assert set(s["dev"]) | set(s["heldout"]) == groups
    assert not set(s["dev"]) & set(s["heldout"])
    halves = corpus.split()
    assert set(halves) == {e["name"] for e in m["entries"]}
    for g in groups:  # a script's variants (timm's two models, ...) are all in one half
        assert len({halves[e["name"]] for e in m["entries"] if e["group"] == g}) == 1
    assert len(m["entries"]) >= 24 and len(groups) >= 24


def test_the_first_draw_is_the_seeded_shuffle_it_says():
    import random

    s = json.loads(corpus.SPLIT.read_text())
    removed = set(s.get("removed", {}))
    added = {g for a in s.get("additions", []) for g in a["dev"] + a["heldout"]}
    first = sorted((set(s["dev"]) | set(s["heldout"]) | removed) - added)
    r = random.Random(s["seed"])
    r.shuffle(first)
    assert sorted(first[: len(first) // 2]) == sorted(set(s["dev"]) - added)


def test_entries_name_their_source_and_fill_every_placeholder(tmp_path):
    for e in corpus.manifest()["entries"]:
        assert e["repo"] and len(e["commit"]) == 40 and e["path"] and e["license"] and e["steps"] >= 1
        assert e["argv"][0].startswith("{corpus}/") and e["argv"][0].endswith(".py")
        p = corpus.prepare(e, corpus=tmp_path / "c", data=tmp_path / "d", root=tmp_path / "runs")
        assert p.cwd.is_dir() and (p.cwd / "out").is_dir()
        assert not any("{" + k + "}" in a for a in p.argv for k in ("corpus", "data", "work", "out"))
        for link in e["links"]:
            assert Path(os.path.normpath(link.replace("{work}", str(p.cwd)).replace("{corpus}", str(tmp_path / "c")))
                        ).is_symlink()


def test_unknown_names_are_refused():
    with pytest.raises(KeyError, match="not-a-script"):
        corpus.entries(["not-a-script"])


@pytest.mark.parametrize("k", [3])
def test_the_hook_reads_after_the_kth_optimizer_step_and_ends_the_process(tmp_path, k):
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text("import torch\nm = torch.nn.Linear(4, 4)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "for i in range(10):\n    m(torch.randn(2, 4)).sum().backward()\n    opt.step()\n"
                      "    print('after', i + 1, flush=True)\n")
    out = tmp_path / "lines.jsonl"
    env = {**os.environ, "PYTHONPATH": str(CORPUS / "truth_hook"), "OOMTRUTH_OUT": str(out), "OOMTRUTH_NAME": "t",
           "OOMTRUTH_STEPS": str(k)}
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [w for i in range(1, k) for w in ("after", str(i))]  # stopped inside step k
    rows = [json.loads(s) for s in out.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["completed"] and rows[0]["steps"] == k and rows[0]["name"] == "t"


def test_a_script_that_ends_first_is_said_to_have_ended(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text("import torch\nm = torch.nn.Linear(4, 4)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "m(torch.randn(2, 4)).sum().backward()\nopt.step()\n")
    out = tmp_path / "lines.jsonl"
    env = {**os.environ, "PYTHONPATH": str(CORPUS / "truth_hook"), "OOMTRUTH_OUT": str(out), "OOMTRUTH_STEPS": "2"}
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=120)
    (row,) = [json.loads(s) for s in out.read_text().splitlines()]
    assert row["completed"] is False and row["steps"] == 1


def test_table_errors_and_bounds():
    rows = [{"name": "a", "traced": True, "peak_allocated_bytes": 1030, "peak_reserved_bytes": 2100},
            {"name": "b", "traced": True, "peak_allocated_bytes": 1040, "peak_reserved_bytes": 2000},
            {"name": "c", "traced": False, "reason": "oomdoctor: error: x.py:3: cannot be traced under fake tensors: y",
             "where": "x.py:3"}]
    truths = {n: {"status": "measured", "max_allocated": 1000, "max_reserved": 2000} for n in "abc"}
    a, b, c = table.join(rows, truths)
    assert a["allocated_error_pct"] == pytest.approx(3.0) and a["reserved_error_pct"] == pytest.approx(5.0)
    assert a["within_bounds"]  # 3% and 5% are inside
    assert b["allocated_error_pct"] == pytest.approx(4.0) and not b["within_bounds"]
    assert c["allocated_error_pct"] is None and not c["within_bounds"]
    assert "refused at x.py:3: y" in table.markdown("t", [a, b, c])


def test_table_refuses_heldout_rows_that_are_not_the_recorded_ones(tmp_path):
    held = [{"name": "h", "traced": False}]
    blob = json.dumps(held).encode()
    rec = {"dev": {"rows": []}, "heldout": {"total": 1, "traced": 0, "sha256_of_rows": hashlib.sha256(blob).hexdigest()}}
    (tmp_path / "rec.json").write_text(json.dumps(rec))
    (tmp_path / "held.json").write_bytes(blob)
    assert table.main(["--preflight", str(tmp_path / "rec.json"), "--heldout-rows", str(tmp_path / "held.json")]) == 0
    (tmp_path / "held.json").write_bytes(json.dumps([{"name": "h", "traced": True}]).encode())
    assert table.main(["--preflight", str(tmp_path / "rec.json"), "--heldout-rows", str(tmp_path / "held.json")]) == 2
