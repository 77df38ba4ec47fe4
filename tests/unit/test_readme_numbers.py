"""Every number README.md quotes from a ``docs/*.json`` is the one that JSON gives (issue 52: "162 tests skip" where
201 did, 512 ranks in "31 s" where docs said 14.1 s, Megatron's goldens at "median 4.5%, 97%" where ``plan validate``
prints 4.4% and 96.2%). ``benchmarks/readme_numbers.py`` holds the claims; ``--write`` rewrites the README."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("readme_numbers", ROOT / "benchmarks" / "readme_numbers.py")
numbers = importlib.util.module_from_spec(_spec)
sys.modules["readme_numbers"] = numbers  # its dataclasses look their module up
_spec.loader.exec_module(numbers)


def test_the_readme_says_every_number_as_its_json_gives_it():
    problems, _ = numbers.check((ROOT / "README.md").read_text(encoding="utf-8"))
    assert problems == [], "\n".join(problems) + "\nrewrite them: python benchmarks/readme_numbers.py --write"


def test_the_check_catches_a_stale_number_and_rewrites_only_the_number():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    stale = readme.replace("the default\ntakes 14.1 s on 2 CPUs", "the default\ntakes 31 s on 2 CPUs")
    assert stale != readme
    problems, fixed = numbers.check(stale)
    assert problems == ["bench_ranks.json: README.md says s = 31, the JSON gives 14.1 ('On {ranks} ranks ({gb} GB) the "
                        "default takes {s} s on {cpus} CPUs, {x}× faster than `--jobs 1`')"]
    assert fixed == readme  # the line break inside the claim stays where it was


def test_a_claim_the_readme_lost_is_reported():
    readme = (ROOT / "README.md").read_text(encoding="utf-8").replace("interactive in", "ready in")
    problems, _ = numbers.check(readme)
    assert len(problems) == 1 and problems[0].startswith("bench_html_report.json: no place in README.md says")


def test_each_number_comes_from_its_json(monkeypatch, tmp_path):
    """A number changed in its JSON changes what the README must say."""
    import json
    import shutil

    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs, ignore=shutil.ignore_patterns("corpus", "corpus_outputs", "mutation_runs",
                                                                        "device_runs", "img", "data"))
    d = json.loads((docs / "bench_ranks.json").read_text())
    next(r for r in d["rows"] if r["ranks"] == 512)["default_s"] = 20.04
    (docs / "bench_ranks.json").write_text(json.dumps(d))
    monkeypatch.setattr(numbers, "DOCS", docs)
    assert numbers.ranks_512()["s"] == "20.0"


@pytest.mark.parametrize("change, says", [
    ("another", "2 claims say 'completes' where the rerun ran out (expandable_segments:True on trainer-ddp-gpt2-b96, "
                "max_split_size_mb:1024 on lightning-fsdp-gpt2-b100)"),
    ("none", "0 claims say 'completes' where the rerun ran out (none)"),
])
def test_words_the_data_contradicts_are_reported(monkeypatch, change, says):
    """The README names the one claim that says "completes" where the rerun ran out (issue 49's calibration):
    another such claim, or none, contradicts its words, not only its numbers."""
    real = numbers._doc

    def doc(name):
        d = real(name)
        if name == "claims_vs_reruns.json":
            rows = d["rows"]
            if change == "another":
                rows[0] = dict(rows[0], says="completes", rerun="runs out", covered=False)
            else:
                rows[:] = [dict(x, rerun="completes", covered=True) if x["rerun"] == "runs out" and
                           x["says"] == "completes" else x for x in rows]
        return d

    monkeypatch.setattr(numbers, "_doc", doc)
    problems, _ = numbers.check((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(problems) == 1 and problems[0].startswith(f"claims_vs_reruns.json: {says}; the README names "
                                                         "max_split_size_mb:1024 on lightning-fsdp-gpt2-b100"), problems
