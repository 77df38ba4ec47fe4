"""The paragraph the framework callbacks print (``render/words/paragraph.py``), on the bundled demo's report: each
sentence whole, with its numbers, and the branches the demo does not reach (what fits, no verdict) on its report
changed in code."""

from __future__ import annotations

import dataclasses

import pytest

from oomdoctor.cli.diagnose import demo_path
from oomdoctor.render.text import render_paragraph
from oomdoctor.render.words import paragraph
from oomdoctor.report.pipeline import build_report
from oomdoctor.trace.load import load


@pytest.fixture(scope="module")
def report():
    return build_report([load(str(demo_path()))])


def test_the_demos_paragraph_sentence_by_sentence(report):
    assert paragraph.lines(report, snapshot="/x/s.pickle", holders=2) == [
        "oomdoctor: DEFERRED-FREE on rank 0. Frees deferred by record_stream hold memory across layers and steps: "
        "1.62 GiB at stake (no OOM in this trace; peak reserved 2.84 GiB).",
        "At the peak of allocated memory (forward phase) rank 0 had 1.22 GiB allocated: unknown 1.06 GiB, "
        "temporaries 128.00 MiB, activations 32.00 MiB.",
        "Largest holders: 1.00 GiB unknown (setup) at <allocated before recording started>; 128.00 MiB temporaries "
        "(forward) at /workspace/lab/tp_legacy.py:32 in forward.",
        "What to do: (1) If your code runs the collective on its own stream and calls tensor.record_stream(stream), "
        "drop record_stream: issue it with async_op=True and call work.wait() (or "
        "torch.cuda.current_stream().wait_stream(stream)) before the tensor is reused, keeping a Python reference "
        "until then.",
        "Snapshot: /x/s.pickle (full report: oomdoctor diagnose /x/s.pickle).",
    ]
    # one holder asked for, no snapshot: the holders' sentence shortens and the last sentence goes
    short = paragraph.lines(report, holders=1)
    assert short is not None and len(short) == 4 and short[2].endswith("at <allocated before recording started>.")


def test_what_fits_is_said_when_the_replay_sized_it(report):
    r = report.ranks[0]
    assert r.fits is not None
    fitted = dataclasses.replace(r.fits, batch_scale=2.5, largest_micro_batch=20, expandable_batch_scale=4.0,
                                 expandable_at_limit=True)
    rep = dataclasses.replace(report, ranks=[dataclasses.replace(r, fits=fitted)])
    said = paragraph.lines(rep)
    assert said is not None
    assert ("Fits on this GPU (replayed): 2.5x the micro-batch (micro-batch 20), at least 4.0x with "
            "expandable_segments.") in said
    no_exp = dataclasses.replace(rep, ranks=[dataclasses.replace(r, fits=dataclasses.replace(
        fitted, largest_micro_batch=None, expandable_batch_scale=None))])
    assert "Fits on this GPU (replayed): 2.5x the micro-batch." in (paragraph.lines(no_exp) or [])


def test_no_verdict_is_one_line_naming_the_inputs(report):
    empty = dataclasses.replace(report, verdict=None)
    assert paragraph.lines(empty) is None
    assert render_paragraph(empty) == f"oomdoctor: nothing to diagnose in {report.inputs[0]}"
    assert paragraph.nothing(dataclasses.replace(report, inputs=[])) == "oomdoctor: nothing to diagnose in the recording"


def test_the_paragraph_wraps_each_sentence_with_a_hanging_indent(report):
    text = render_paragraph(report, width=60)
    assert all(len(line) <= 60 for line in text.splitlines())
    assert text.splitlines()[1].startswith("  ")  # the verdict's sentence continues, indented


def test_a_verdict_on_several_ranks_names_them_as_a_span(report):
    v = report.verdict
    rep = dataclasses.replace(report, verdict=dataclasses.replace(v, ranks=[0, 1, 2, 5]))
    head = (paragraph.lines(rep) or [""])[0]
    assert head.startswith("oomdoctor: DEFERRED-FREE on ranks 0–2, 5. Frees deferred by record_stream")


def test_two_ranks_are_plural_and_the_breakdown_is_the_verdicts_first_ranks(report):
    r0 = report.ranks[0]
    r1 = dataclasses.replace(r0, rank=1, holders=r0.holders[1:])
    v = dataclasses.replace(report.verdict, ranks=[1, 2])
    said = paragraph.lines(dataclasses.replace(report, ranks=[r0, r1], verdict=v)) or []
    assert said[0].startswith("oomdoctor: DEFERRED-FREE on ranks 1–2. ")
    assert " rank 1 had 1.22 GiB allocated" in said[1]
    assert said[2].startswith("Largest holders: 128.00 MiB temporaries (forward)")  # rank 1's, not rank 0's
    # a verdict naming no rank (or one the report lacks) speaks of the report's first rank
    for ranks in ([], [7]):
        alone = paragraph.lines(dataclasses.replace(report, ranks=[r1, r0], verdict=dataclasses.replace(v, ranks=ranks)))
        assert alone is not None and alone[2].startswith("Largest holders: 128.00 MiB temporaries")


def test_an_estimates_assumptions_are_listed_numbered_after_the_verdict(report):
    v = dataclasses.replace(report.verdict, evidence={
        **report.verdict.evidence, "estimate_assumptions": ["parameters-trained", "optimizer-state-seen"]})
    said = paragraph.lines(dataclasses.replace(report, verdict=v)) or []
    assert said[1] == ("What fits assumes: (1) every parameter is trained: its gradient has its size. "
                       "(2) the optimizer state seen.")


def test_nothing_names_every_input():
    from oomdoctor.report.model import Report

    assert paragraph.nothing(Report(ranks=[], findings=[], inputs=["a.pickle", "b.pickle"], oomdoctor_version="0")) == \
        "oomdoctor: nothing to diagnose in a.pickle, b.pickle"


def test_a_verdict_without_ranks_speaks_of_the_first_rank_and_a_step_is_named(report):
    r0 = report.ranks[0]
    r1 = dataclasses.replace(r0, rank=1, holders=r0.holders[1:],
                             breakdown=dataclasses.replace(r0.breakdown, step=3))
    v = dataclasses.replace(report.verdict, ranks=[])
    first = paragraph.lines(dataclasses.replace(report, ranks=[r0, r1], verdict=v)) or []
    assert first[2].startswith("Largest holders: 1.00 GiB unknown (setup)")  # rank 0's
    second = paragraph.lines(dataclasses.replace(report, ranks=[r0, r1], verdict=dataclasses.replace(v, ranks=[1])))
    assert second is not None and second[1].startswith("At the peak of allocated memory (step 3, forward phase) rank 1")
