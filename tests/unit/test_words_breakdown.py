"""The words of a breakdown (``render/words/breakdown.py``) on breakdowns built here: each id said from its table,
small lines folded into one term that still names them, a reason without words left unsaid, and an id another
version wrote said as itself."""

from __future__ import annotations

from oomdoctor.analysis.accounting import Breakdown
from oomdoctor.render.words import breakdown as words
from oomdoctor.render.words.table import text

MiB = 1 << 20
GiB = 1 << 30


def _bd(**kw) -> Breakdown:
    cats = {"activations": 3 * GiB, "parameters": GiB, "rounding": 512, "outputs": 4, "unknown": 2 * MiB}
    base = dict(at="oom", event_index=7, step=2, phase="forward", categories=cats,
                sources={"parameters": "recorded", "activations": "trace", "outputs": "trace", "unknown": "trace"},
                allocated_bytes=sum(cats.values()), phase_source="markers",
                unknown_why={"in_trace": MiB, "before_trace": MiB})
    base.update(kw)
    out = Breakdown(**base)
    out.check()
    return out


def test_the_lines_are_said_largest_first_with_the_small_ones_in_one_term():
    assert words.terms(_bd()) == ["activations 3.00 GiB", "parameters 1.00 GiB", "unknown 2.00 MiB",
                                  "516 B in allocator rounding and outputs kept"]


def test_said_names_the_point_the_phase_source_the_recorded_lines_and_only_reasons_with_words():
    said = words.said(_bd())
    assert said.total.startswith("at the OOM (step 2, forward phase, marked by the framework): ")
    assert said.source == "parameters as oomdoctor run recorded them; the other categories from the allocation trace"
    # in_trace has a description and no words: the 1 MiB born in the trace is not said, the other reason is
    assert said.unknown == "unknown: 1.00 MiB born before the trace; their stack places nothing"
    assert words.said(_bd(unknown_why={"in_trace": 2 * MiB})).unknown is None


def test_an_id_of_another_version_is_said_as_itself():
    bd = _bd(at="step_start", phase_source="sidecar")
    assert words.at(bd) == "step_start" and words.phase_source(bd) == "sidecar"
    assert words.unknown_why("gone") is None  # type: ignore[arg-type]


def test_every_line_point_and_source_has_words():
    from oomdoctor import ids

    assert [words.line(i) for i in ids.BREAKDOWN_LINES][-1] == "allocator rounding"
    assert all(text(words.POINTS, i) for i in ids.BREAKDOWN_POINTS)
    assert all(text(words.PHASE_SOURCES_SAID, i) for i in ids.PHASE_SOURCES)
