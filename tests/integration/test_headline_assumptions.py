"""Issue 52: a headline that carries its assumptions. After an OOM in the first forward pass, the verdict box of a
2-rank Trainer job held one sentence with five assumptions chained by semicolons, and the same chain again under
"what fits" on each rank. The headline says the answer and its kind; the assumptions are listed once, below it, and
in the JSON (``verdict.assumptions``)."""

from __future__ import annotations

import json

import pytest
from test_corpus import unpack

from oomdoctor.cli.main import main

RUN = "first-forward-trainer-ddp-gpt2-b160"  # batch 160 ran out in the first forward pass; 94 ran


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return unpack(tmp_path_factory.mktemp("first-forward"), RUN)


def _out(capsys, monkeypatch, argv):
    monkeypatch.setenv("COLUMNS", "80")
    capsys.readouterr()
    assert main(argv) == 0
    return capsys.readouterr().out


def test_the_verdict_says_the_answer_and_its_kind_without_the_chain(run, capsys, monkeypatch):
    doc = json.loads(_out(capsys, monkeypatch, ["diagnose", str(run), "--micro-batch", "160", "--format", "json",
                                                "-j", "1"]))
    v = doc["verdict"]
    assert "At least 90 fits: a lower bound from the first forward pass" in v["summary"]
    assert "every parameter is trained" not in v["summary"] and ";" not in v["summary"].split("At least 90")[1]
    # the assumptions in the JSON: the verdict's, in words, the same as each rank's own
    assert len(v["assumptions"]) == 5 and v["assumptions"][1] == "every parameter is trained: its gradient has its size"
    assert all(r["fits"]["assumptions"] == v["assumptions"] for r in doc["ranks"])


def test_the_text_lists_the_assumptions_once(run, capsys, monkeypatch):
    out = _out(capsys, monkeypatch, ["diagnose", str(run), "--micro-batch", "160", "-j", "1"])
    text = " ".join(line.strip("┃│ ") for line in out.splitlines())
    assert text.count("every parameter is trained") == 1, out
    assert text.count("the backward mirrors the forward") == 1
    box = out.split("┗")[0]
    assert "assumes:" in box and "- every parameter is trained" in box  # one a line, under the verdict
    assert out.count("at least micro-batch 90, a lower bound from the first forward pass") == 2  # each rank's line
