"""The small rules behind several findings and the verdict, each pinned at its boundaries.

- ``detectors/pipeline_output_cache.py``: ``_max_concurrent`` (blocks alive at once), ``_by_step`` (one group
  per burst of frees, i.e. per ``step()``), ``_candidate`` (at least 3 outputs and 256 MiB kept at once, freed in
  one burst within 10% of the span of their allocations); on hand-made lifetimes whose event indices are
  checked to be those of a possible trace (each event used once, a free after its allocation).
- ``detectors/fragmentation.py``: ``split_mb`` (half the failed request within [21, 1024] MiB, 512 without
  one), ``_fixes`` (which variable each PyTorch version reads, which fixes for which conditions),
  ``under_memory_fraction`` (a memory fraction from the sidecar or from an OOM below the device's free memory), read
  alike by the finding and the verdict's defragmenting settings.
- ``detectors/context.py``: ``version_from_text`` on every shape of version PyTorch prints and on the lower
  bounds the tool writes; ``TorchVersion.in_range`` on ``[lo, hi)`` at both ends.
- ``report/verdict.py``: ``state_verdict`` (the final-state verdict's numbers), ``_rank_bytes``,
  ``oom_with_findings`` (a capacity OOM re-read against a ``rank-imbalance`` finding).

Expected values come from the rules as the docstrings and the cited sources state them (PyTorch's version
history in ``shared/reference``), or from arithmetic on the inputs built here.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
from builder import MiB, SnapBuilder

from oomdoctor.analysis import analyze
from oomdoctor.detectors import fragmentation
from oomdoctor.detectors import pipeline_output_cache as poc
from oomdoctor.detectors.context import TorchVersion, applies, version_from_text
from oomdoctor.detectors.finding import Finding, Fix
from oomdoctor.render.words import verdict as words
from oomdoctor.report.fits import Room
from oomdoctor.report.verdict import Action, Verdict, _rank_bytes, oom_with_findings, state_verdict
from oomdoctor.trace.load import from_snapshot

GiB = 1024 * MiB


# --------------------------------------------------------------------------- pipeline-output-cache

def _lifetimes(alloc, free, size_mib=100, n=None):
    """Lifetimes of blocks (row i: allocated at event ``alloc[i]``, freed at ``free[i]``, -1: never freed), as
    ``lt`` carries them, after checking they could come from one trace; ``n``: the trace's event count."""
    alloc = np.asarray(alloc, dtype=np.int64)
    free = np.asarray(free, dtype=np.int64)
    events = np.concatenate([alloc, free[free >= 0]])
    assert len(set(events.tolist())) == events.size, "one event per allocation or free"
    assert ((free < 0) | (free > alloc)).all(), "a block is freed after it is allocated"
    n = int(events.max(initial=-1)) + 1 if n is None else n
    assert events.max(initial=-1) < n
    size = np.full(alloc.size, size_mib * MiB, dtype=np.int64) if np.isscalar(size_mib) else \
        np.asarray(size_mib, dtype=np.int64) * MiB
    return SimpleNamespace(alloc=alloc, free_requested=free, size=size), n


@pytest.mark.parametrize("alloc, free, n, expected", [
    ([], [], 0, 0),  # an empty trace holds nothing
    ([0, 2, 4], [1, 3, 5], 6, 1),  # each freed before the next is allocated
    ([0, 1, 2], [3, 4, 5], 6, 3),  # all allocated, then all freed
    ([0, 1, 2], [-1, -1, -1], 3, 3),  # never freed: alive to the end
    ([0, 2, 3, 4], [1, -1, -1, -1], 5, 3),  # one freed early; the three others at once from event 4
    ([0, 1, 3, 5], [2, 4, -1, 6], 7, 2),  # never more than two alive
], ids=["empty", "sequential", "nested", "never-freed", "one-freed-early", "two-at-a-time"])
def test_max_concurrent_counts_the_blocks_alive_at_once(alloc, free, n, expected):
    lt, n = _lifetimes(alloc, free, n=n)
    assert poc._max_concurrent(lt.alloc, lt.free_requested, n) == expected


def _by_step_rows(lt, n, g=None):
    g = np.arange(lt.alloc.size) if g is None else np.asarray(g)
    return [part.tolist() for part in poc._by_step(g, lt, n)]


@pytest.mark.parametrize("alloc, free, n, expected", [
    # fewer than 3 blocks are never a step's cache
    ([0, 10], [30, 31], 40, []),
    # exactly 3 (MIN_CONCURRENT) freed together: one step
    ([0, 10, 20], [30, 31, 32], 40, [[0, 1, 2]]),
    # two steps: 3 outputs kept and freed, then 3 more; allocations span 126 - 100 = 26 events, so a gap over
    # 2.6 events between frees separates the steps (the gap here is 130 - 123 = 7)
    ([100, 110, 120, 124, 125, 126], [121, 122, 123, 130, 131, 132], 140, [[0, 1, 2], [3, 4, 5]]),
    # the same frees with a gap of 3 events, where 10% of the span (0..30) is exactly 3: not longer, one step
    ([0, 6, 12, 18, 24, 30], [40, 41, 42, 45, 46, 47], 50, [[0, 1, 2, 3, 4, 5]]),
    # one event longer than 10% of the span: two steps
    ([0, 6, 12, 18, 24, 30], [40, 41, 42, 46, 47, 48], 50, [[0, 1, 2], [3, 4, 5]]),
    # a burst of 2 and a burst of 4: only the group of at least 3 is kept
    ([0, 6, 12, 18, 24, 30], [40, 41, 45, 46, 47, 48], 50, [[2, 3, 4, 5]]),
    # a block never freed counts as freed at the trace's last event (99): frees 97, 98, 99 are one burst
    # (10% of the span 0..20 is 2 events)
    ([0, 10, 20], [97, 98, -1], 100, [[0, 1, 2]]),
    # ... and frees 95, 96, 99 are not (a gap of 3 events): a group of 2 and one of 1, neither kept
    ([0, 10, 20], [95, 96, -1], 100, []),
], ids=["two-blocks", "three-in-one-burst", "two-steps", "gap-equal-10pct", "gap-over-10pct", "burst-of-two",
        "never-freed-joins-the-burst", "never-freed-apart"])
def test_by_step_splits_at_gaps_longer_than_a_tenth_of_the_allocation_span(alloc, free, n, expected):
    lt, n = _lifetimes(alloc, free, n=n)
    assert _by_step_rows(lt, n) == expected


def test_by_step_returns_the_rows_given_in_free_order_ties_in_row_order():
    """``g`` names rows of ``lt`` (here not 0..k-1 and not sorted); each part lists them by free event, and
    blocks with the same free event (never freed: the trace's end) keep their order in ``g``: a stable sort,
    so the same trace always gives the same rows (and the same stack for the site)."""
    k = 48
    alloc = np.arange(k)  # events 0..47
    free = np.full(k, -1)
    freed = np.arange(0, k, 2)  # every second block is freed, in reverse row order, at events 48..71
    free[freed] = k + np.arange(freed.size)[::-1]
    lt, n = _lifetimes(alloc, free, n=k + freed.size)
    g = np.concatenate([np.arange(1, k, 2)[::-1], np.arange(0, k, 2)])  # odd rows descending, then even rows
    end = n - 1
    expected = sorted(g.tolist(), key=lambda r: (free[r] if free[r] >= 0 else end, g.tolist().index(r)))
    assert _by_step_rows(lt, n, g) == [expected]


@pytest.mark.parametrize("alloc, free, n, size_mib, expected", [
    # 3 outputs of 100 MiB kept at once (MIN_CONCURRENT), freed within 2 events of a 40-event span
    ([0, 20, 40], [50, 51, 52], 60, 100, (300 * MiB, 3)),
    # 4 x 64 MiB = 256 MiB (MIN_BYTES exactly) is enough
    ([0, 20, 40, 60], [70, 71, 72, 73], 80, 64, (256 * MiB, 4)),
    # 3 x 85 MiB = 255 MiB is not
    ([0, 20, 40], [50, 51, 52], 60, 85, None),
    # 3 small outputs in a burst: not worth a finding
    ([0, 20, 40], [50, 51, 52], 60, 1, None),
    # never more than 2 alive at once (1 GiB each), though their frees (96, 98, 99) are within 10% of the
    # span 0..97: two are not a cache
    ([0, 95, 97], [98, 96, 99], 100, 1024, None),
    # frees spread over 2 events where 10% of the span (0..20) is 2: one burst
    ([0, 10, 20], [30, 31, 32], 40, 100, (300 * MiB, 3)),
    # spread over 3: one free per backward, not a burst
    ([0, 10, 20], [30, 31, 33], 40, 100, None),
    # freed one by one as the schedule goes (backward of each micro-batch)
    ([0, 10, 20], [30, 40, 50], 60, 100, None),
    # a block never freed counts as freed at the trace's last event (99): 97, 98, 99 is a burst
    ([0, 10, 20], [97, 98, -1], 100, 100, (300 * MiB, 3)),
    # ... and 96, 97, 99 is not
    ([0, 10, 20], [96, 97, -1], 100, 100, None),
    # none freed (the trace stops inside the step): a burst
    ([0, 10, 20], [-1, -1, -1], 30, 100, (300 * MiB, 3)),
], ids=["three-kept", "exactly-256MiB", "just-under-256MiB", "small", "two-at-once", "frees-within-10pct",
        "frees-over-10pct", "one-per-backward", "never-freed-in-burst", "never-freed-apart", "none-freed"])
def test_candidate_needs_three_blocks_256MiB_and_one_burst_of_frees(alloc, free, n, size_mib, expected):
    lt, n = _lifetimes(alloc, free, size_mib, n=n)
    g = np.arange(lt.alloc.size)
    got = poc._candidate(g, lt, n)
    if expected is None:
        assert got is None
    else:
        total, conc, rows = got
        assert (total, conc) == expected
        assert rows.tolist() == g.tolist()


# --------------------------------------------------------------------------- fragmentation

@pytest.mark.parametrize("request_bytes, expected", [
    (0, 512),  # no failed request (stranded memory without an OOM)
    (1, 21),  # half of nothing: the floor (PyTorch <= 2.8 refuses 20: "must be > 20")
    (10 * MiB, 21),
    (40 * MiB, 21),  # half is 20: still the floor
    (42 * MiB, 21),  # half is exactly the floor
    (44 * MiB, 22),  # first request above the floor
    (200 * MiB, 100),
    (200 * MiB + MiB - 1, 100),  # whole MiB only
    (201 * MiB, 100),  # half rounded down
    (2048 * MiB, 1024),  # half is exactly the ceiling
    (2050 * MiB, 1024),  # above it
    (80 * GiB, 1024),
])
def test_split_mb_is_half_the_request_within_21_and_1024_MiB(request_bytes, expected):
    assert fragmentation.split_mb(request_bytes) == expected


def _v(exact=None, minimum=None):
    return TorchVersion(exact, minimum, "x")


def _settings(fixes):
    return [f.setting for f in fixes]


@pytest.mark.parametrize("v, env, expandable_applies", [
    # PYTORCH_ALLOC_CONF is read from 2.9 (PYTORCH_CUDA_ALLOC_CONF before, and as an alias after);
    # expandable_segments exists from 2.1 (PR #96995)
    (_v((2, 0)), "PYTORCH_CUDA_ALLOC_CONF", False),
    (_v((2, 1)), "PYTORCH_CUDA_ALLOC_CONF", True),
    (_v((2, 8)), "PYTORCH_CUDA_ALLOC_CONF", True),
    (_v((2, 9)), "PYTORCH_ALLOC_CONF", True),
    (_v((2, 10)), "PYTORCH_ALLOC_CONF", True),
    (_v((3, 0)), "PYTORCH_ALLOC_CONF", True),
    (_v(minimum=(2, 10)), "PYTORCH_ALLOC_CONF", True),  # a lower bound that settles both
    (_v(minimum=(2, 5)), "PYTORCH_CUDA_ALLOC_CONF", True),  # >= 2.5: the old name is read by every version
    (_v(), "PYTORCH_CUDA_ALLOC_CONF", None),  # unknown: the name every version reads; cannot tell for 2.1
], ids=["2.0", "2.1", "2.8", "2.9", "2.10", "3.0", ">=2.10", ">=2.5", "unknown"])
def test_fragmentation_fixes_name_the_variable_the_version_reads(v, env, expandable_applies):
    fixes = fragmentation._fixes(v, False, 200 * MiB, True, True)  # shapes vary: the padding fix too
    assert _settings(fixes) == [f"{env}=expandable_segments:True", f"{env}=max_split_size_mb:100",
                                f"{env}=garbage_collection_threshold:0.8", None]
    assert [f.kind for f in fixes] == ["env", "env", "env", "code"]
    assert fixes[0].applies is expandable_applies
    assert fixes[0].what_if == {"config": "expandable_segments:True"}
    assert fixes[1].what_if == {"config": "max_split_size_mb:100"}
    assert [f.id for f in fixes] == ["expandable-segments", "max-split-size", "garbage-collection-threshold",
                                     "vary-shapes-less"]  # their words, naming the variable: test_words_findings


def test_fragmentation_fixes_cite_their_public_sources_and_say_what_to_replay():
    """Every fix cites public material as it is written there (pull requests and issues by number, the CUDA
    semantics notes, the allocator's source file), and each setting carries the config the replay tries."""
    exp, split, gc, _code = fragmentation._fixes(_v((2, 9)), False, 200 * MiB, True, True)
    assert "pytorch/pytorch PR #96995" in exp.source and "pytorch.org/docs/stable/notes/cuda.html" in exp.source
    assert "CUDACachingAllocator.cpp" in split.source and "pytorch.org/docs/stable/notes/cuda.html" in split.source
    assert gc.what_if == {"config": "garbage_collection_threshold:0.8"}


@pytest.mark.parametrize("expandable_on, request_bytes, capped, settings", [
    (False, 200 * MiB, False, ["expandable_segments:True", "max_split_size_mb:100", None]),
    (True, 200 * MiB, False, ["max_split_size_mb:100", None]),  # already on: not proposed again
    (True, 200 * MiB, True, ["max_split_size_mb:100", "garbage_collection_threshold:0.8", None]),
    (False, 0, False, ["expandable_segments:True", "max_split_size_mb:512", None]),  # no OOM request
    (False, 4 * GiB, True, ["expandable_segments:True", "max_split_size_mb:1024",
                            "garbage_collection_threshold:0.8", None]),
], ids=["plain", "expandable-on", "expandable-on-capped", "no-request", "capped-large-request"])
def test_fragmentation_fixes_follow_the_conditions(expandable_on, request_bytes, capped, settings):
    """garbage_collection_threshold only under a memory fraction (the collector runs only then,
    CUDACachingAllocator.cpp malloc); max_split_size_mb from :func:`split_mb` of the request."""
    fixes = fragmentation._fixes(_v((2, 9)), expandable_on, request_bytes, capped, True)  # the last: shapes vary
    assert [s.split("=", 1)[1] if s else None for s in _settings(fixes)] == settings
    # static shapes: no padding fix (None, a code change, is the last)
    fixes = fragmentation._fixes(_v((2, 9)), expandable_on, request_bytes, capped)
    assert [s.split("=", 1)[1] if s else None for s in _settings(fixes)] == settings[:-1]


def _analysis(b: SnapBuilder, meta: dict | None = None, name: str = "rank0.pickle", state_only: bool = False):
    snap = b.snapshot()
    if state_only:
        snap["device_traces"] = [[]]
    return analyze(from_snapshot(snap, name, meta))


def _fragmented(device_free: int | None = None) -> SnapBuilder:
    """Four 100 MiB segments, each with a 20 MiB block in its middle, then an OOM asking for 60 MiB (a
    cudaMalloc of 60 MiB: > 10 MiB requests are rounded to 2 MiB) with ``device_free`` bytes free on the
    device."""
    b = SnapBuilder()
    for s in [b.segment(100 * MiB) for _ in range(4)]:
        b.alloc(s, 40 * MiB, 20 * MiB)
    if device_free is not None:
        b.oom(60 * MiB, device_free=device_free)
    return b


@pytest.mark.parametrize("device_free, meta, capped", [
    (None, None, False),  # no OOM, no sidecar: nothing says there was a cap
    (0, None, False),  # the device itself was full
    (60 * MiB - 1, None, False),  # one byte short of the cudaMalloc: the device was full
    (60 * MiB, None, True),  # the device could have given it: a fraction refused it
    (8 * GiB, None, True),
    (None, {"memory_cap_bytes": 40 * GiB}, True),  # the sidecar's cap
    (None, {"memory_fraction": 0.5, "gpu_total_memory_bytes": 80 * GiB}, True),
    (None, {"memory_fraction": 0.5}, True),  # a fraction below 1 is a cap, its bytes known or not
    (None, {"memory_fraction": 1.0, "gpu_total_memory_bytes": 80 * GiB}, False),  # a fraction of 1 is no cap
    (0, {"memory_cap_bytes": 40 * GiB}, True),
], ids=["no-oom", "device-full", "one-byte-short", "device-had-room", "device-had-lots", "sidecar-cap",
        "sidecar-fraction", "fraction-without-total", "fraction-one", "sidecar-and-full-device"])
def test_capped_means_a_memory_fraction_from_the_sidecar_or_an_oom_below_the_device(device_free, meta, capped):
    from oomdoctor.report.rank_predictions import defragmenting_settings

    a = _analysis(_fragmented(device_free), meta)
    assert fragmentation.under_memory_fraction(a) is capped
    # the verdict tries the collector exactly where the finding proposes it
    assert ("garbage_collection_threshold:0.8" in defragmenting_settings(a)) is capped
    if device_free is not None:  # the finding proposes the collector only then
        (f,) = fragmentation.detect(SimpleNamespace(analyses=[a], versions={a.rank: _v((2, 9))}))
        assert any("garbage_collection_threshold" in (x.setting or "") for x in f.fixes) is capped


# --------------------------------------------------------------------------- versions

@pytest.mark.parametrize("text, exact, minimum", [
    ("2.8.0", (2, 8), None),
    ("2.11.0+cu130", (2, 11), None),
    ("2.9.0a0+git1234", (2, 9), None),
    ("2.10.0.dev20251101", (2, 10), None),
    ("2.7.1+rocm6.3", (2, 7), None),
    ("10.2", (10, 2), None),
    (" 2.8.0", (2, 8), None),  # leading space
    (">= 2.10 (snapshot has 'user_metadata')", None, (2, 10)),  # the tool's own lower bound, read back
    (">= 2.3 (snapshot has 'allocator_settings')", None, (2, 3)),
    (">=2.8", None, (2, 8)),
    ("unknown", None, None),
    ("", None, None),
    ("garbage", None, None),
    ("torch 2.8.0", None, None),
    ("v2.8.0", None, None),
    ("2", None, None),
    ("<= 2.8", None, None),
])
def test_version_from_text_reads_every_shape_pytorch_prints(text, exact, minimum):
    assert version_from_text(text) == TorchVersion(exact, minimum, text)


def test_version_from_text_reads_back_what_torch_version_writes():
    """A report's ``torch_version`` text read back is the version it was written from: the sidecar's exact
    version, a lower bound from a snapshot field, or unknown."""
    from oomdoctor.detectors.context import torch_version

    b = SnapBuilder()
    s = b.segment(4 * MiB)
    b.alloc(s, 0, MiB)
    for meta in ({"torch_version": "2.11.0+cu130"}, None):
        v = torch_version(_analysis(b, meta))
        assert v.exact == ((2, 11) if meta else None)
        assert version_from_text(v.text) == v
    v = torch_version(analyze(from_snapshot({"segments": [], "device_traces": [[]]}, "rank0.pickle")))
    assert version_from_text(v.text) == v == TorchVersion(None, None, "unknown")


@pytest.mark.parametrize("v, expected", [
    (_v((2, 3)), False),
    (_v((2, 4)), True),  # lo included
    (_v((2, 9)), True),
    (_v((2, 10)), False),  # hi excluded
    (_v((2, 11)), False),
    (_v((1, 13)), False),
    (_v((3, 0)), False),
    (_v(minimum=(2, 11)), False),  # a lower bound past hi settles it
    (_v(minimum=(2, 10)), False),  # a lower bound at hi: already out
    (_v(minimum=(2, 9)), None),  # could be 2.9 or 2.12
    (_v(minimum=(2, 4)), None),
    (_v(minimum=(2, 2)), None),
    (_v(), None),
], ids=["2.3", "2.4", "2.9", "2.10", "2.11", "1.13", "3.0", ">=2.11", ">=2.10", ">=2.9", ">=2.4", ">=2.2",
        "unknown"])
def test_in_range_is_lo_inclusive_hi_exclusive(v, expected):
    assert v.in_range((2, 4), (2, 10)) is expected
    assert applies("2.4-2.9", v) is expected  # "both ends included": 2.4 up to every 2.9.x


# --------------------------------------------------------------------------- verdict

def _finding(id="rank-imbalance", ranks=(2,), bytes_=0, per_rank=None, severity="high", fixes=()):
    return Finding(id, severity, list(ranks), bytes_, fixes=list(fixes), per_rank_bytes=dict(per_rank or {}))


@pytest.mark.parametrize("per_rank, rank, expected", [
    ({1: 300, 2: 700}, 2, 700),  # the rank's own share
    ({1: 300, 2: 700}, 1, 300),
    ({1: 300}, 2, 1000),  # no share recorded for the rank: the finding's bytes
    ({}, 0, 1000),
])
def test_rank_bytes_is_the_ranks_share_else_the_findings_bytes(per_rank, rank, expected):
    assert _rank_bytes(_finding(ranks=(0, 1, 2), bytes_=1000, per_rank=per_rank), rank) == expected


def _capacity(rank=2, shortfall=100 * MiB, kind="capacity"):
    ev = {"rank": rank, "shortfall_bytes": shortfall, "need_bytes": 900 * MiB, "batch_scale": 0.5,
          "estimated_fit": "x", "largest_micro_batch": 3, "no_fit_reason": "r", "estimate_assumptions": "a",
          "checkpointing_frees_bytes": 1, "sharding_frees_bytes": 2}
    return Verdict(kind=kind, bytes=900 * MiB, ranks=[rank], headroom_bytes=None, finding=None, evidence=ev,
                   reasons=["live-tensors-exceed-room"], to_do=[Action(id="pipeline-schedule")])


@pytest.mark.parametrize("findings, shortfall, kind, imbalance", [
    ([_finding(per_rank={2: 150 * MiB})], 100 * MiB, "capacity", True),  # the excess covers the shortfall
    ([_finding(per_rank={2: 100 * MiB})], 100 * MiB, "capacity", True),  # exactly
    ([_finding(per_rank={2: 100 * MiB - 1})], 100 * MiB, "capacity", False),  # one byte short
    ([_finding(bytes_=150 * MiB)], 100 * MiB, "capacity", True),  # no per-rank share: the finding's bytes
    ([_finding(per_rank={2: 150 * MiB})], 100 * MiB, "fragmentation", False),  # only capacity is re-read
    ([_finding(per_rank={2: 150 * MiB})], None, "capacity", False),  # shortfall unknown
    ([_finding(per_rank={2: 150 * MiB})], 0, "capacity", False),  # nothing short
    ([_finding(ranks=(1, 2), per_rank={2: 150 * MiB})], 100 * MiB, "capacity", False),  # not this rank alone
    ([_finding(ranks=(1,), per_rank={1: 150 * MiB})], 100 * MiB, "capacity", False),  # another rank's
    ([_finding(per_rank={2: 150 * MiB}, severity="low")], 100 * MiB, "capacity", False),  # not material
    ([_finding(id="deferred-free", per_rank={2: 150 * MiB})], 100 * MiB, "capacity", False),
    ([], 100 * MiB, "capacity", False),
], ids=["covers", "exactly", "one-byte-short", "finding-bytes", "not-capacity", "no-shortfall", "zero-shortfall",
        "two-ranks", "other-rank", "low-severity", "other-finding", "no-findings"])
def test_oom_with_findings_turns_capacity_into_imbalance_when_the_excess_covers_the_shortfall(
        findings, shortfall, kind, imbalance):
    v = _capacity(shortfall=shortfall, kind=kind)
    out = oom_with_findings(v, findings)
    if not imbalance:
        assert out is v
        return
    excess = _rank_bytes(findings[0], 2)
    assert (out.kind, out.bytes, out.ranks, out.finding) == ("imbalance", excess, [2], "rank-imbalance")
    # the capacity verdict's what-fits evidence is dropped; the rest is kept, with the excess
    assert out.evidence == {"rank": 2, "shortfall_bytes": shortfall, "need_bytes": 900 * MiB, "excess_bytes": excess}
    # the verdict's sentence (the first line a user reads) names the excess (its words: test_words_verdict)
    assert out.reasons == ["rank-excess"]


@pytest.mark.parametrize("fixes, action", [
    ([Fix("sharded-checkpoint", "all", "s", applies=None)], 0),  # may apply: the fix itself is the action
    ([Fix("a", "<2.0", "s", applies=False), Fix("b", "all", "s", applies=True)], 1),  # first that may apply
    ([Fix("a", "<2.0", "s", applies=False)], None),  # none applies: no action
    ([], None),
], ids=["may-apply", "skips-known-not-to-apply", "none-applies", "no-fixes"])
def test_oom_with_findings_takes_its_action_from_the_first_fix_that_may_apply(fixes, action):
    out = oom_with_findings(_capacity(), [_finding(per_rank={2: 150 * MiB}, fixes=fixes)])
    assert out.kind == "imbalance" and out.to_do == ([] if action is None else [Action(id="finding-fix",
                                                                                       fix=fixes[action])])


def test_oom_with_findings_takes_its_action_from_the_finding_it_rests_on():
    """The bytes come from the rank-imbalance finding on this rank alone; so does the action, even when a finding
    on several ranks comes first in the list."""
    shared = _finding(ranks=(1, 2), per_rank={2: 150 * MiB}, fixes=[Fix("rebalance-1-and-2", "all", "s")])
    own = _finding(per_rank={2: 150 * MiB}, fixes=[Fix("per-rank-extras-off-gpu", "all", "s")])
    out = oom_with_findings(_capacity(), [shared, own])
    assert out.kind == "imbalance" and out.to_do == [Action(id="finding-fix", fix=own.fixes[0])]


def _state(b: SnapBuilder | None, room_bytes: int | None, name="rank5.pickle"):
    if b is None:
        a = analyze(from_snapshot({"segments": [], "device_traces": [[]]}, name))
    else:
        a = _analysis(b, name=name, state_only=True)
    return state_verdict(a, Room(bytes=room_bytes, kind="device" if room_bytes else "estimated", source="test"))


@pytest.mark.parametrize("room_bytes", [4 * GiB, None])
def test_an_empty_state_verdict_holds_nothing_and_the_whole_room(room_bytes):
    v = _state(None, room_bytes)
    assert (v.kind, v.bytes, v.ranks, v.finding) == ("empty", 0, [5], None)
    assert v.headroom_bytes == room_bytes  # nothing reserved: all the room is left (unknown stays unknown)
    # a final state without counters: the peaks before it are not known (issue 41), said as data
    assert v.evidence == {"rank": 5, "allocated_bytes": 0, "reserved_bytes": 0, "peak_reserved_bytes": 0,
                          "room_bytes": room_bytes, "window_peak_reserved_bytes": 0, "window_peak_allocated_bytes": 0,
                          "job_peak_reserved_bytes": None, "job_peak_allocated_bytes": None,
                          "peak_source": "unknown-before-window"}
    # the docstring's two reasons: taken before any CUDA allocation, or nothing recorded on this device
    assert v.reasons == ["nothing-recorded"]
    assert words.summary(v).startswith("nothing recorded") and "before any CUDA allocation" in words.summary(v)
    assert v.to_do == []


@pytest.mark.parametrize("room_bytes, headroom", [(4 * GiB, 4 * GiB - 1536 * MiB), (1536 * MiB, 0), (None, None)])
def test_a_final_state_verdict_reports_allocated_reserved_and_room(room_bytes, headroom):
    b = SnapBuilder()
    s1, s2 = b.segment(1024 * MiB), b.segment(512 * MiB)
    b.alloc(s1, 0, 256 * MiB)
    b.alloc(s1, 512 * MiB, 128 * MiB)
    b.alloc(s2, 0, 64 * MiB)
    v = _state(b, room_bytes, "rank7.pickle")
    reserved, allocated = 1536 * MiB, (256 + 128 + 64) * MiB
    assert (v.kind, v.bytes, v.ranks, v.finding, v.headroom_bytes) == ("healthy", reserved, [7], None, headroom)
    assert v.evidence == {"rank": 7, "allocated_bytes": allocated, "reserved_bytes": reserved,
                          "peak_reserved_bytes": reserved, "room_bytes": room_bytes,
                          "window_peak_reserved_bytes": reserved, "window_peak_allocated_bytes": allocated,
                          "job_peak_reserved_bytes": None, "job_peak_allocated_bytes": None,
                          "peak_source": "unknown-before-window"}
    # it tells how to record the history: PyTorch's call, as written in its memory docs
    assert v.reasons == ["final-state-only"]
    text = words.summary(v)
    assert re.search(r"(^|\s)torch\.cuda\.memory\._record_memory_history\(max_entries=\d+\) ", text), text
    assert text.endswith(".")
