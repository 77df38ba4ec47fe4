"""Numbers said twice agree (issue 52): where two places of one output, or two commands, say the same number of the
same snapshot, they say it equal. On the real snapshots of ``shared/snapshots`` (skipped without them).

Here, the pairs inside ``diagnose`` that issue 52 found apart; ``test_identities_commands.py`` holds the pairs across
commands on every shared snapshot."""

from __future__ import annotations

import numpy as np
import pytest

from oomdoctor import load, load_ranks
from oomdoctor.report import build_report


@pytest.fixture(scope="module")
def pp_last_stage(snapshots):
    trace = load(snapshots / "pp-microbatch" / "return-outputs-rank1.pickle")
    return build_report([trace])


def test_the_pipeline_finding_and_the_breakdown_count_the_same_outputs(pp_last_stage):
    """The last stage keeps its 8 micro-batches' logits (stats.jsonl: the last stage grows with the micro-batches):
    the finding says 8 and so do the breakdown and its holders, the first micro-batch's (made by the schedule's
    warm-up loop, a stack of its own) included; the holders' bytes are the finding's."""
    r = pp_last_stage.ranks[0]
    (f,) = [f for f in pp_last_stage.findings if f.id == "pipeline-output-cache"]
    assert f.evidence.outputs_kept == 8
    bd = next(b for b in r.breakdowns if b.at == "peak_allocated")
    site = f.sites[0].label
    (held,) = [h for h in r.holders if h.category == "outputs" and h.label == site]
    assert (held.count, held.bytes) == (f.evidence.outputs_kept, f.evidence.kept_bytes)
    # the breakdown's line counts requested bytes: 8 x the logits each micro-batch asked for, and the 4 KiB losses
    assert bd.categories["outputs"] - 8 * f.evidence.output_bytes < 64 * 1024
    assert bd.counts["outputs"] >= 8 and bd.categories["temporaries"] < 4 * 2**30


def test_output_accumulation_and_memory_growth_name_the_same_steps(snapshots):
    """ddp-imbalance's rank 0 keeps a batch's logits every third step: output-accumulation says when (steps 0, 3, 6
    and 9, every 3) and memory-growth the same steps inside the ones it counts (2 to 9: warm-up and the last two are
    not); neither says "every step"."""
    report = build_report(load_ranks([snapshots / "ddp-imbalance"]))
    by_id = {f.id: f for f in report.findings}
    acc, growth = by_id["output-accumulation"].evidence, by_id["memory-growth"].evidence
    assert (acc.kept_unit, acc.kept_at, acc.kept_every) == ("step", [0, 3, 6, 9], 3)
    counted = range(growth.first_counted_step, growth.last_counted_step + 1)
    assert growth.leaking_steps == [s for s in acc.kept_at if s in counted] == [3, 6, 9]
    assert np.isclose(sum(growth.retained_bytes_per_step), growth.retained_bytes)
