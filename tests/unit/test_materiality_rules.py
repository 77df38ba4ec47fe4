"""The materiality rule (``detectors/materiality.py``), pinned clause by clause on findings built here.

- ``simulated_saving``: a finding's own replay counts only without an OOM on either side (``oom``,
  ``recorded_oom_event_index``) and with an exact self-replay; the saving is recorded minus simulated peak
  reserved, never negative.
- ``apply``: bytes at stake capped at the peak reserved of the finding's ranks (the claim kept as
  ``claimed_bytes``), each rank's share capped at that rank's peak; a simulated saving below the claim replaces it
  (``simulated_saving_bytes``); under ``max(fraction x peak, min_bytes)`` a finding above LOW becomes LOW, with the
  threshold and the severity it had in its evidence. Ranks without a recorded peak count 0.
- ``rank_key``: severity first, then bytes at stake, largest first.

Every expected value is arithmetic on the bytes given here.
"""

from __future__ import annotations

import pytest

from oomdoctor.detectors.finding import Finding
from oomdoctor.detectors.materiality import DEFAULT_MIN_BYTES, Materiality, apply, rank_key, simulated_saving
from oomdoctor.units import GiB, MiB


def finding(bytes_: int, severity: str = "high", ranks=(0,), per_rank=None, prediction=None) -> Finding:
    return Finding("fragmentation", severity, list(ranks), bytes_, per_rank_bytes=dict(per_rank or {}),
                   prediction=prediction)


def replay(recorded: int, simulated: int, **kw) -> dict:
    return {"recorded_peak_reserved_bytes": recorded, "peak_reserved_bytes": simulated, "self_replay_exact": True,
            "oom": None, "recorded_oom_event_index": None, **kw}


# ----------------------------------------------------------------------------------------- simulated_saving

def test_simulated_saving_is_the_drop_in_peak_reserved_never_negative():
    assert simulated_saving(finding(GiB, prediction=replay(5 * GiB, 3 * GiB))) == 2 * GiB
    assert simulated_saving(finding(GiB, prediction=replay(3 * GiB, 5 * GiB))) == 0


@pytest.mark.parametrize("prediction", [
    None,
    {},
    replay(5 * GiB, 3 * GiB, oom=12),  # the replay of the fix ran out of memory
    replay(5 * GiB, 3 * GiB, recorded_oom_event_index=7),  # the recording ended in an OOM
    replay(5 * GiB, 3 * GiB, oom=12, recorded_oom_event_index=7),
    replay(5 * GiB, 3 * GiB, self_replay_exact=False),
])
def test_simulated_saving_says_nothing_with_an_oom_or_an_inexact_replay(prediction):
    assert simulated_saving(finding(GiB, prediction=prediction)) is None


# ------------------------------------------------------------------------------------------------ apply

def test_bytes_at_stake_are_capped_at_the_ranks_peak_and_the_claim_kept():
    f = finding(10 * GiB, ranks=(0, 1), per_rank={0: 10 * GiB, 1: 3 * GiB, 2: 9 * GiB})
    apply([f], {0: 4 * GiB, 1: 6 * GiB})
    assert f.bytes == 6 * GiB and f.evidence.claimed_bytes == 10 * GiB
    # each rank's share capped at its own peak; a rank without a recorded peak keeps its share
    assert f.per_rank_bytes == {0: 4 * GiB, 1: 3 * GiB, 2: 9 * GiB}


def test_bytes_equal_to_the_peak_are_not_capped():
    f = finding(4 * GiB)
    apply([f], {0: 4 * GiB})
    assert f.bytes == 4 * GiB and "claimed_bytes" not in f.evidence.as_dict()


def test_ranks_without_a_recorded_peak_cap_nothing():
    f = finding(10 * GiB, ranks=(5,), per_rank={5: 10 * GiB})
    apply([f], {0: 4 * GiB})
    assert f.bytes == 10 * GiB and f.per_rank_bytes == {5: 10 * GiB} and "claimed_bytes" not in f.evidence.as_dict()


def test_a_smaller_simulated_saving_replaces_the_claim():
    f = finding(3 * GiB, per_rank={0: 3 * GiB}, prediction=replay(8 * GiB, 7 * GiB))
    apply([f], {0: 8 * GiB})
    assert f.bytes == GiB and f.per_rank_bytes == {0: GiB}
    assert f.evidence.as_dict() == {"claimed_bytes": 3 * GiB, "simulated_saving_bytes": GiB}
    assert f.severity == "high"  # 1 GiB is above max(1% of 8 GiB, 64 MiB)


def test_a_simulated_saving_equal_to_the_claim_changes_nothing():
    f = finding(GiB, per_rank={0: GiB}, prediction=replay(8 * GiB, 7 * GiB))
    apply([f], {0: 8 * GiB})
    assert f.bytes == GiB and f.evidence.as_dict() == {}


def test_under_the_threshold_a_finding_becomes_low_with_its_evidence():
    peak = 20 * GiB  # 1% of it (about 205 MiB) is above the 64 MiB floor
    limit = int(0.01 * peak)
    f = finding(limit - 1, severity="critical")
    apply([f], {0: peak})
    assert f.severity == "low"
    assert f.evidence.as_dict() == {"materiality_threshold_bytes": limit, "severity_before_materiality": "critical"}
    at = finding(limit, severity="critical")  # at the threshold: material
    apply([at], {0: peak})
    assert at.severity == "critical" and at.evidence.as_dict() == {}


def test_the_floor_holds_on_small_gpus():
    f = finding(DEFAULT_MIN_BYTES - 1, severity="medium")
    apply([f], {0: GiB})  # 1% of 1 GiB is below the 64 MiB floor
    assert f.severity == "low" and f.evidence.materiality_threshold_bytes == DEFAULT_MIN_BYTES


@pytest.mark.parametrize("severity", ["low", "info"])
def test_a_finding_already_low_or_info_is_left_alone(severity):
    f = finding(MiB, severity=severity)
    apply([f], {0: 80 * GiB})
    assert f.severity == severity and f.evidence.as_dict() == {}


def test_ranks_without_a_peak_count_zero_and_no_rank_counts_zero():
    rule = Materiality(fraction=100.0, min_bytes=0)  # threshold = 100 x the peak: the peak used is visible
    alone = finding(50, ranks=(5,))
    apply([alone], {0: 1}, rule)  # rank 5 has no recorded peak: 0, threshold 0 (with 1, it would be 100)
    assert alone.severity == "high" and alone.evidence.as_dict() == {}
    nobody = finding(50, ranks=())
    apply([nobody], {0: 1}, rule)  # no rank: peak 0
    assert nobody.severity == "high" and nobody.evidence.as_dict() == {}
    assert Materiality(fraction=100.0, min_bytes=0).threshold(1) == 100  # so a peak of 1 byte would demote both


def test_apply_ranks_by_severity_then_bytes_largest_first():
    small_high, big_high = finding(2 * GiB), finding(3 * GiB)
    crit, med, info = finding(GiB, "critical"), finding(9 * GiB, "medium"), finding(8 * GiB, "info")
    out = apply([small_high, info, med, crit, big_high], {0: 80 * GiB})
    assert out == [crit, big_high, small_high, med, info]


def test_rank_key_is_severity_then_negated_bytes():
    assert rank_key(finding(5, "critical")) == (0, -5)
    assert rank_key(finding(5, "medium")) == (2, -5)
    assert rank_key(finding(7, "info")) == (4, -7)
