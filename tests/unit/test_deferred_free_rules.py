"""The rules of ``detectors/deferred_free.py``, one decision at a time.

* ``_fixes``: which remedies are offered for each owner of the deferred frees (a collective, FSDP, point-to-point
  sends, user code, or unknown) and each PyTorch version, and what each says: its kind, setting, the versions
  it is for, whether it applies, how the simulator replays it (``what_if``) and the public material it cites.
  The expectations come from the module docstring and the PyTorch history it cites:
  ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` exists from 2.1 to 2.7 (PRs #89880/#97053) and is the default behaviour
  from 2.8 (PR #148590, relanded as #150398); FSDP1's ``limit_all_gathers=True`` (PRs #83666/#83917) or FSDP2;
  point-to-point sends keep ``record_stream`` in every version; ``expandable_segments`` does not help (the
  tp-allreduce measurement of ``shared/snapshots/README.md``: 2.84 GiB legacy, 2.23 GiB expandable, 1.22 GiB
  modern).
* ``_detect_final_state`` (a snapshot without history): the held-bytes threshold at its boundary, the severity
  boundary, whose stream the pending blocks' stacks name, and the numbers the finding carries.
* ``_owners``: which owner each deferred block is attributed to (its allocation's or its free's stack, an
  ``nccl:*`` scope starting while it is allocated, the ends of that interval) and the bytes per owner at the peak.
"""

from __future__ import annotations

import json
import pickle
import re

import numpy as np
import pytest
from builder import MiB, SnapBuilder, frames

from oomdoctor import load
from oomdoctor.analysis import analyze
from oomdoctor.detectors import Context, deferred_free
from oomdoctor.detectors.context import TorchVersion, applies

GiB = 1 << 30
SITE = "/usr/lib/python3.12/site-packages/torch/"
TRAIN = ("/work/train.py", 10, "step")
FSDP = frames((SITE + "distributed/fsdp/_runtime_utils.py", 1500, "_unshard"), TRAIN)
PIPELINING = frames((SITE + "distributed/pipelining/stage.py", 600, "get_fwd_send_ops"), TRAIN)
ISEND = frames((SITE + "distributed/distributed_c10d.py", 2100, "isend"), TRAIN)
ALL_REDUCE = frames((SITE + "distributed/distributed_c10d.py", 2800, "all_reduce"), TRAIN)
USER2 = frames(("/work/train.py", 42, "backward_hook"))


# ---------------------------------------------------------------------------------------------------------------
# _fixes
# ---------------------------------------------------------------------------------------------------------------

VERSIONS = {
    "2.0": TorchVersion((2, 0), None, "2.0.1"),
    "2.1": TorchVersion((2, 1), None, "2.1.2"),
    "2.7": TorchVersion((2, 7), None, "2.7.1"),
    "2.8": TorchVersion((2, 8), None, "2.8.0"),
    "2.11": TorchVersion((2, 11), None, "2.11.0+cu130"),
    "unknown": TorchVersion(None, None, "unknown"),
    ">=2.8": TorchVersion(None, (2, 8), ">= 2.8 (snapshot has 'compile_context')"),
    ">=2.5": TorchVersion(None, (2, 5), ">= 2.5 (snapshot has 'external_annotations')"),
}

# each fix by its stable id (its words: test_words_findings), named here as this file's tests name them
FIX_IDS = {
    "avoid-record-streams": "avoid-record-streams",
    "upgrade-collectives-current-stream": "upgrade",
    "fsdp-limit-all-gathers": "limit-all-gathers",
    "async-op-wait": "async-wait",
    "point-to-point-wait": "p2p-wait",
    "expandable-segments-no-help": "not-expandable",
}


def _fix_id(fix) -> str:
    assert fix.id in FIX_IDS, f"a fix this file does not know: {fix.id!r}"
    return FIX_IDS[fix.id]


def _fixes_by_id(owner: str, version: str) -> dict:
    fixes = deferred_free._fixes(owner, VERSIONS[version])
    out = {_fix_id(f): f for f in fixes}
    assert len(out) == len(fixes), "a fix offered twice"
    return out


MODERN_VERSIONS = ("2.8", "2.11", ">=2.8")
ALL_VERSIONS = tuple(VERSIONS)

# Which fixes each owner gets. The env var and the upgrade change what ProcessGroupNCCL does with a collective's
# tensors, so they are for collectives, FSDP (its unshard/reduce-scatter are collectives) and an unknown owner;
# limit_all_gathers is FSDP's own; async_op + wait() is for code that calls record_stream itself, which is every
# owner's case once collectives stopped calling it (>= 2.8); point-to-point sends call it in every version;
# the expandable_segments warning is for everyone.
NOT_MODERN_VERSIONS = ("2.0", "2.1", "2.7", "unknown", ">=2.5")
OFFERED = {
    "collective": ("collective", ALL_VERSIONS, {"avoid-record-streams", "upgrade", "async-wait", "not-expandable"}),
    "unknown": ("unknown", ALL_VERSIONS, {"avoid-record-streams", "upgrade", "async-wait", "not-expandable"}),
    "user-code": ("user code", ALL_VERSIONS, {"async-wait", "not-expandable"}),
    "fsdp-before-2.8-or-unknown": ("fsdp", NOT_MODERN_VERSIONS,
                                   {"avoid-record-streams", "upgrade", "limit-all-gathers", "not-expandable"}),
    "fsdp-from-2.8": ("fsdp", MODERN_VERSIONS,
                      {"avoid-record-streams", "upgrade", "limit-all-gathers", "async-wait", "not-expandable"}),
    "p2p-before-2.8-or-unknown": ("point-to-point", NOT_MODERN_VERSIONS, {"p2p-wait", "not-expandable"}),
    "p2p-from-2.8": ("point-to-point", MODERN_VERSIONS, {"async-wait", "p2p-wait", "not-expandable"}),
}


@pytest.mark.parametrize("owner,versions,expected", list(OFFERED.values()), ids=list(OFFERED))
def test_which_fixes_each_owner_is_offered_by_version(owner, versions, expected):
    for version in versions:
        assert set(_fixes_by_id(owner, version)) == expected, (owner, version)


# TORCH_NCCL_AVOID_RECORD_STREAMS is for 2.1-2.7 (PRs #89880, #97053, as the module cites them); 2.8 made its behaviour
# the default. A lower bound of 2.8 settles "not applicable"; a lower bound of 2.5 settles nothing.
AVOID_APPLIES = {"2.0": False, "2.1": True, "2.7": True, "2.8": False, "2.11": False, "unknown": None,
                 ">=2.8": False, ">=2.5": None}
# the upgrade is needed below 2.8
UPGRADE_APPLIES = {"2.0": True, "2.1": True, "2.7": True, "2.8": False, "2.11": False, "unknown": None,
                   ">=2.8": False, ">=2.5": None}


@pytest.mark.parametrize("owner", ["collective", "fsdp", "unknown"])
@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_avoid_record_streams_applies_only_from_2_1_to_2_7(owner, version):
    fix = _fixes_by_id(owner, version)["avoid-record-streams"]
    assert fix.applies is AVOID_APPLIES[version]
    assert (fix.kind, fix.setting, fix.versions) == ("env", "TORCH_NCCL_AVOID_RECORD_STREAMS=1", "2.1-2.7")
    # its versions label and its decision agree (context.applies reads "2.1-2.7" with both ends included)
    assert fix.applies is applies(fix.versions, VERSIONS[version])
    assert fix.what_if == {"deferred_frees": "immediate"}


@pytest.mark.parametrize("owner", ["collective", "fsdp", "unknown"])
@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_upgrade_applies_below_2_8(owner, version):
    fix = _fixes_by_id(owner, version)["upgrade"]
    assert fix.applies is UPGRADE_APPLIES[version]
    assert (fix.kind, fix.setting, fix.versions) == ("upgrade", None, ">=2.8")
    assert fix.what_if == {"deferred_frees": "immediate"}


# async_op=True + wait(): sure to apply when the user's code calls record_stream, or once collectives no longer do
# (>= 2.8); for a collective or an unknown owner on an older or unknown version it may be ProcessGroupNCCL's doing.
ASYNC_APPLIES = [
    ("user code", v, True) for v in ALL_VERSIONS
] + [
    (o, v, True) for o in ("collective", "unknown", "fsdp", "point-to-point") for v in MODERN_VERSIONS
] + [
    (o, v, None) for o in ("collective", "unknown") for v in NOT_MODERN_VERSIONS
]


@pytest.mark.parametrize("owner,version,expected", ASYNC_APPLIES)
def test_async_op_and_wait_applies_to_user_code_and_from_2_8(owner, version, expected):
    fix = _fixes_by_id(owner, version)["async-wait"]
    assert fix.applies is expected
    assert (fix.kind, fix.setting, fix.versions) == ("code", None, "all")
    assert fix.what_if == {"deferred_frees": "immediate"}


@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_limit_all_gathers_is_for_fsdp_and_leaves_applicability_open(version):
    fix = _fixes_by_id("fsdp", version)["limit-all-gathers"]
    # FSDP1 or FSDP2 is not in the snapshot: whether it applies is not told
    assert fix.applies is None
    assert (fix.kind, fix.setting) == ("config", "limit_all_gathers=True")
    assert fix.versions.startswith(">=2.1") and "(FSDP2 >= 2.4)" in fix.versions
    assert fix.what_if is None  # the simulator cannot replay it


@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_point_to_point_fix_applies_in_every_version(version):
    fix = _fixes_by_id("point-to-point", version)["p2p-wait"]
    assert fix.applies is True
    assert (fix.kind, fix.setting, fix.versions) == ("code", None, "all")
    assert fix.what_if is None


@pytest.mark.parametrize("owner", ["collective", "fsdp", "unknown", "user code", "point-to-point"])
@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_expandable_segments_is_said_not_to_help_for_every_owner(owner, version):
    fix = _fixes_by_id(owner, version)["not-expandable"]
    assert fix.applies is True
    assert (fix.kind, fix.setting, fix.versions) == ("config", None, "all")
    # replayed with expandable segments on, to show it does not cure the held memory
    assert fix.what_if == {"config": "expandable_segments:True"}  # its measured numbers: test_words_findings


# the PRs and issues each fix cites (module docstring)
CITED_NUMBERS = {
    "avoid-record-streams": ["89880", "97053", "124260"],
    "upgrade": ["148590", "150398"],
    "limit-all-gathers": ["83666", "83917"],
    "async-wait": ["124260"],
    "p2p-wait": [],
    "not-expandable": [],
}

# the forms a citation of public material takes: a pytorch/pytorch PR or issue, a doc page of a pytorch repository,
# an API's documentation, a function of PyTorch's source, or a measurement on the recorded snapshots
CITATION = re.compile(
    r"(pytorch/pytorch )?(PRs?|issue) #\d+(, #\d+)*( \(relanded as #\d+\))?( \([a-z]+\))?"
    r"|github\.com/pytorch/[a-z]+/blob/main/[a-z/]+\.md"
    r"|torch\.Tensor\.[a-z_]+ docs"
    r"|ProcessGroupNCCL\.cpp [a-z][A-Za-z]+"
    r"|measured on H200 GPUs with PyTorch 2\.11: .+"
)


def _all_fixes():
    return [f for o in ("collective", "fsdp", "point-to-point") for f in deferred_free._fixes(o, VERSIONS["2.11"])]


def test_each_fix_cites_public_material():
    seen = set()
    for fix in _all_fixes():
        fid = _fix_id(fix)
        seen.add(fid)
        for citation in fix.source.split("; "):
            assert CITATION.fullmatch(citation), (fid, citation)
        assert re.findall(r"#(\d+)", fix.source) == CITED_NUMBERS[fid], fid
    assert seen == set(FIX_IDS.values())


def test_specific_citations():
    fixes = {_fix_id(f): f for f in _all_fixes()}
    assert fixes["avoid-record-streams"].source.startswith("pytorch/pytorch PR #89880")
    assert fixes["upgrade"].source.startswith("pytorch/pytorch PR #148590")
    assert "github.com/pytorch/torchtitan/blob/main/docs/fsdp.md" in fixes["limit-all-gathers"].source
    assert fixes["async-wait"].source.startswith("torch.Tensor.record_stream docs")
    assert fixes["p2p-wait"].source == "ProcessGroupNCCL.cpp pointToPoint"
    # the tp-allreduce snapshots: 2 ranks, an all-reduce after each of 8 layers, legacy record_stream,
    # legacy + expandable segments, and plain all_reduce on 2.11
    m = fixes["not-expandable"].source
    assert m.startswith("measured on H200 GPUs with PyTorch 2.11: a two-rank tensor-parallel job that all-reduces "
                        "after each of 8 layers")
    assert "with its inputs record_stream-ed" in m and ", with expandable segments too," in m
    assert m.endswith("and with a plain all_reduce")


# ---------------------------------------------------------------------------------------------------------------
# _detect_final_state
# ---------------------------------------------------------------------------------------------------------------


def final_state(tmp_path, pending, allocated=(), reserved=1024 * MiB, torch="2.6.0+cu124", rank=3):
    """A snapshot without history: one segment of ``reserved`` bytes holding ``pending`` blocks (size, frames)
    freed by Python but pending, and ``allocated`` blocks."""
    b = SnapBuilder()
    s = b.segment(reserved, record=False)
    off = 0
    for size, fr in pending:
        x = b.alloc(s, off, size, fr=fr, record=False)
        b.free(x, deferred=True)
        off += size
    for size in allocated:
        b.alloc(s, off, size, record=False)
        off += size
    snap = b.snapshot()
    snap["device_traces"] = [[]]
    path = tmp_path / f"rank{rank}.pickle"
    path.write_bytes(pickle.dumps(snap))
    meta = {"rank": rank}
    if torch:
        meta["torch_version"] = torch
    (tmp_path / f"rank{rank}.meta.json").write_text(json.dumps(meta))
    a = analyze(load(path))
    assert a.num_events == 0
    return a, Context([a])


def _final(tmp_path, *args, **kw):
    a, ctx = final_state(tmp_path, *args, **kw)
    return deferred_free.detect(ctx)


def test_final_state_threshold_is_inclusive_at_the_minimum_bytes(tmp_path):
    m = deferred_free.MIN_HELD_BYTES
    (f,) = _final(tmp_path, [(m // 2, USER2), (m // 2, USER2)], reserved=1024 * MiB)
    assert f.bytes == m
    assert _final(tmp_path, [(m // 2, USER2), (m // 2 - MiB, USER2)], reserved=1024 * MiB) == []


def test_final_state_threshold_grows_with_reserved_memory(tmp_path):
    # 5% of 5 GiB is 256 MiB: 257 MiB pending is a finding, 255 MiB is not
    reserved = 5 * GiB
    assert deferred_free.MIN_HELD_FRACTION * reserved == pytest.approx(256 * MiB)
    (f,) = _final(tmp_path, [(257 * MiB, USER2)], reserved=reserved)
    assert f.bytes == 257 * MiB
    assert _final(tmp_path, [(255 * MiB, USER2)], reserved=reserved) == []


@pytest.mark.parametrize("held_mib,severity", [(512, "high"), (256, "high"), (255, "medium"), (200, "medium")])
def test_final_state_severity_is_high_from_a_quarter_of_reserved(tmp_path, held_mib, severity):
    (f,) = _final(tmp_path, [(held_mib * MiB, USER2)], reserved=1024 * MiB)
    assert f.severity == severity


OWNER_CASES = [
    ("fsdp", [FSDP, FSDP]),
    ("point-to-point", [PIPELINING, PIPELINING]),
    ("point-to-point", [ISEND, ISEND]),
    ("point-to-point", [PIPELINING, ISEND]),
    ("unknown", [ALL_REDUCE, ALL_REDUCE]),  # a collective's frames in distributed_c10d.py are not point-to-point
    ("unknown", [USER2, USER2]),
    ("unknown", [FSDP, USER2]),  # every pending block must be FSDP's
    ("unknown", [PIPELINING, USER2]),
    ("unknown", [FSDP, PIPELINING]),
]


@pytest.mark.parametrize("owner,stacks", OWNER_CASES,
                         ids=[f"{o}-{i}" for i, (o, _) in enumerate(OWNER_CASES)])
def test_final_state_owner_from_the_pending_blocks_stacks(tmp_path, owner, stacks):
    (f,) = _final(tmp_path, [(128 * MiB, fr) for fr in stacks], reserved=1024 * MiB, torch="2.6.0")
    assert f.evidence.owner == owner
    # the fixes are the owner's (pinned above): FSDP gets limit_all_gathers, point-to-point its own
    settings = {x.setting for x in f.fixes}
    assert ("limit_all_gathers=True" in settings) is (owner == "fsdp")
    ids = [x.id for x in f.fixes]
    assert ("point-to-point-wait" in ids) is (owner == "point-to-point")
    assert ("avoid-record-streams" in ids) is (owner != "point-to-point")


def test_final_state_finding_numbers(tmp_path):
    a, ctx = final_state(tmp_path, [(128 * MiB, FSDP), (192 * MiB, FSDP)], allocated=[64 * MiB, 32 * MiB],
                         reserved=1024 * MiB, torch="2.6.0+cu124", rank=3)
    (f,) = deferred_free.detect(ctx)
    held = 320 * MiB
    assert f.id == "deferred-free"
    assert f.bytes == held and f.ranks == [3] and f.per_rank_bytes == {3: held}
    assert f.severity == "high"  # 320 MiB >= 256 MiB, a quarter of 1 GiB
    ev = f.evidence
    assert ev.held_at_end_bytes == held
    assert ev.blocks_pending_at_end == 2
    assert ev.reserved_bytes == 1024 * MiB
    assert ev.allocated_bytes == 96 * MiB
    assert ev.owner == "fsdp"
    assert ev.torch_version == "2.6.0+cu124"
    assert f.sites == []  # a list, as Finding.sites is; no history to group sites from
    # 2.6 is in 2.1-2.7: the env var applies
    (env,) = [x for x in f.fixes if x.kind == "env"]
    assert env.applies is True
    assert f.variant == "final-state"  # its words, with these numbers: test_words_findings


def test_final_state_title_is_the_detectors_title(tmp_path):
    (f,) = _final(tmp_path, [(256 * MiB, USER2)])
    (g,) = deferred_free.detect(history_ctx(tmp_path / "h"))
    assert (f.variant, g.variant) == ("final-state", "at-peak")  # one title for both: test_words_findings


# ---------------------------------------------------------------------------------------------------------------
# _owners
# ---------------------------------------------------------------------------------------------------------------


def _ctx(tmp_path, b: SnapBuilder, snap: dict | None = None, name="rank0"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    snap = snap if snap is not None else b.snapshot()
    path = tmp_path / f"{name}.pickle"
    path.write_bytes(pickle.dumps(snap))
    # the recording kept the stacks of frees (context="all"), so a free's stack is its own
    (tmp_path / f"{name}.meta.json").write_text(json.dumps({"rank": 0, "recording": {"context": "all"}}))
    return Context([analyze(load(path))])


def history_ctx(tmp_path):
    b = SnapBuilder()
    s = b.segment(1024 * MiB)
    x = b.alloc(s, 0, 256 * MiB)
    b.free(x, deferred=True)
    b.alloc(s, 256 * MiB, 64 * MiB)
    b.complete(x)
    return _ctx(tmp_path, b)


def owners_by_addr(ctx) -> dict[int, str]:
    a = ctx.analyses[0]
    rows = np.flatnonzero(a.lifetimes.deferred)
    owners = deferred_free._owners(a, rows)
    return {int(a.lifetimes.addr[r]): o for r, o in zip(rows.tolist(), owners.tolist())}


def test_owner_from_the_allocation_or_the_free_stack(tmp_path):
    b = SnapBuilder()
    s = b.segment(1024 * MiB)
    spec = {
        "user": (None, USER2, "user code"),
        "fsdp-alloc": (FSDP, USER2, "fsdp"),
        "fsdp-free": (None, FSDP, "fsdp"),
        "pipelining-alloc": (PIPELINING, USER2, "point-to-point"),
        "isend-free": (None, ISEND, "point-to-point"),
        "isend-alloc": (ISEND, USER2, "point-to-point"),
        "all-reduce-alloc": (ALL_REDUCE, USER2, "user code"),  # no nccl:* scope recorded: nothing says collective
        "fsdp-over-p2p": (FSDP, PIPELINING, "fsdp"),
        "fsdp-over-p2p-2": (PIPELINING, FSDP, "fsdp"),
    }
    addr = {}
    for i, (key, (fa, ff, _)) in enumerate(spec.items()):
        addr[key] = b.alloc(s, i * 32 * MiB, 32 * MiB, fr=fa)
        b.free(addr[key], deferred=True, fr=ff)
    b.alloc(s, 512 * MiB, 32 * MiB)  # an event after the last free: every free above waits (deferred)
    got = owners_by_addr(_ctx(tmp_path, b))
    assert {k: got[addr[k]] for k in spec} == {k: v[2] for k, v in spec.items()}


def test_collective_is_an_nccl_scope_starting_while_the_block_is_allocated(tmp_path):
    b = SnapBuilder()
    s = b.segment(1024 * MiB)
    before = b.alloc(s, 0, 32 * MiB)
    b.free(before, deferred=True)  # freed before any collective starts
    c = b.alloc(s, 32 * MiB, 32 * MiB)
    pp = b.alloc(s, 64 * MiB, 32 * MiB, fr=PIPELINING)
    b.annotate("nccl:all_reduce", "START")
    b.free(c, deferred=True)
    b.free(pp, deferred=True)
    after = b.alloc(s, 96 * MiB, 32 * MiB)  # allocated after that start
    b.annotate("nccl:all_reduce", "END")  # an end is not a start
    b.annotate("record_param_comms", "START")  # nor is a start of another name
    b.free(after, deferred=True)
    b.alloc(s, 512 * MiB, 32 * MiB)
    got = owners_by_addr(_ctx(tmp_path, b))
    assert got[before] == "user code"
    assert got[c] == "collective"
    assert got[pp] == "point-to-point"  # its stack names the owner before the timing does
    assert got[after] == "user code"


def test_a_start_in_the_same_microsecond_as_the_alloc_or_the_free_counts(tmp_path):
    """The interval is closed: the clock cannot order a start and an event stamped with the same microsecond."""
    b = SnapBuilder()
    s = b.segment(1024 * MiB)
    e1 = b.alloc(s, 0, 32 * MiB)
    b.free(e1, deferred=True)
    e2 = b.alloc(s, 32 * MiB, 32 * MiB)
    b.free(e2, deferred=True)
    b.alloc(s, 512 * MiB, 32 * MiB)
    snap = b.snapshot()
    ev = snap["device_traces"][0]
    t_free_e1 = next(e["time_us"] for e in ev if e["action"] == "free_requested" and e["addr"] == e1)
    t_alloc_e2 = next(e["time_us"] for e in ev if e["action"] == "alloc" and e["addr"] == e2)
    assert t_free_e1 < t_alloc_e2
    snap["external_annotations"] = [
        {"name": "nccl:all_reduce", "stage": "START", "device": 0, "time_us": t_free_e1},
        {"name": "nccl:all_reduce", "stage": "START", "device": 0, "time_us": t_alloc_e2},
    ]
    got = owners_by_addr(_ctx(tmp_path, b, snap))
    assert got[e1] == "collective"
    assert got[e2] == "collective"


def test_a_free_requested_as_the_first_event_uses_its_own_stack_and_time(tmp_path):
    """The ring buffer dropped the allocations: the first event is a free_requested (index 0)."""
    b = SnapBuilder()
    s = b.segment(1024 * MiB)
    x = b.alloc(s, 0, 32 * MiB)
    y = b.alloc(s, 32 * MiB, 32 * MiB)
    b.free(x, deferred=True, fr=FSDP)  # event 0 once the first three are dropped
    b.free(y, deferred=True, fr=USER2)  # event 1
    b.alloc(s, 512 * MiB, 32 * MiB)
    got = owners_by_addr(_ctx(tmp_path, b, b.snapshot(drop_first=3)))
    assert got[x] == "fsdp"
    assert got[y] == "user code"


def test_allocated_before_the_trace_counts_from_its_first_event(tmp_path):
    """Blocks whose allocation was dropped are taken as allocated from the first event on."""
    b = SnapBuilder()
    s = b.segment(1024 * MiB)
    x = b.alloc(s, 0, 32 * MiB)
    w = b.alloc(s, 32 * MiB, 32 * MiB)
    b.free(x, deferred=True)  # event 0: freed in the first microsecond of the trace
    b.annotate("nccl:all_reduce", "START")  # between events 0 and 1
    b.alloc(s, 512 * MiB, 32 * MiB)  # event 1
    b.free(w, deferred=True)  # event 2: allocated through that start
    b.alloc(s, 600 * MiB, 32 * MiB)
    got = owners_by_addr(_ctx(tmp_path, b, b.snapshot(drop_first=3)))
    assert got[x] == "user code"  # freed before the start
    assert got[w] == "collective"


def test_allocated_as_the_first_event_counts_from_it(tmp_path):
    b = SnapBuilder()
    s = b.segment(1024 * MiB)
    v = b.alloc(s, 0, 32 * MiB)  # event 0 once the segment's event is dropped
    b.annotate("nccl:all_reduce", "START")
    b.alloc(s, 512 * MiB, 32 * MiB)
    b.free(v, deferred=True)
    b.alloc(s, 600 * MiB, 32 * MiB)
    got = owners_by_addr(_ctx(tmp_path, b, b.snapshot(drop_first=1)))
    assert got[v] == "collective"


def test_a_block_pending_at_the_start_is_not_given_another_blocks_stack(tmp_path):
    """A free_completed whose alloc and request were dropped: no stack of its own (not FSDP's, interned next),
    and its free was requested before the trace: unknown."""
    b = SnapBuilder()
    s = b.segment(1024 * MiB)
    p = b.alloc(s, 0, 32 * MiB)
    b.free(p, deferred=True)
    b.alloc(s, 32 * MiB, 32 * MiB, fr=USER2)
    b.alloc(s, 64 * MiB, 32 * MiB, fr=FSDP)
    b.complete(p)
    b.alloc(s, 96 * MiB, 32 * MiB, fr=FSDP)
    snap = b.snapshot(drop_first=3)
    a = _ctx(tmp_path, b, snap).analyses[0]
    # FSDP's stack is interned as stack 1, where a fallback of +1 instead of -1 would land
    assert any("/fsdp/" in fr[0] for fr in a.trace.stacks.stack_frames(1))
    got = owners_by_addr(Context([a]))
    assert got[p] == "unknown"


def test_bytes_held_at_the_peak_by_owner(tmp_path):
    b = SnapBuilder()
    segs = [b.segment(256 * MiB) for _ in range(4)]
    f = b.alloc(segs[0], 0, 256 * MiB, fr=FSDP)
    p = b.alloc(segs[1], 0, 128 * MiB, fr=PIPELINING)
    u1 = b.alloc(segs[1], 128 * MiB, 64 * MiB)
    u2 = b.alloc(segs[2], 0, 32 * MiB)
    for x in (f, p, u1, u2):
        b.free(x, deferred=True)
    b.alloc(segs[3], 0, 256 * MiB)  # the last segment sets the peak of reserved while all four are held
    for x in (f, p, u1, u2):
        b.complete(x)
    (fd,) = deferred_free.detect(_ctx(tmp_path, b))
    assert fd.evidence.held_at_peak_by_owner == {"fsdp": 256 * MiB, "point-to-point": 128 * MiB,
                                                    "user code": 96 * MiB}
    assert fd.evidence.owner == "fsdp"
    assert fd.evidence.owners_all == {"fsdp": 1, "point-to-point": 1, "user code": 2}
    # in name order, as the JSON writes them: a set's order follows the string hash seed of the process
    assert list(fd.evidence.held_at_peak_by_owner) == list(fd.evidence.owners_all) == ["fsdp", "point-to-point",
                                                                                        "user code"]
    assert fd.bytes == 480 * MiB


def test_a_block_pending_since_before_the_trace_is_nobody_s_it_can_tell(tmp_path):
    """A block whose free was requested before the trace started (only its free_completed is recorded) is held
    from the first event to its completion. What held it ran before the trace: an ``nccl:*`` start inside the
    trace says nothing about it, so its owner is unknown, not a collective's (and not the user's)."""
    b = SnapBuilder()
    s = b.segment(1024 * MiB)
    p = b.alloc(s, 0, 256 * MiB)
    b.free(p, deferred=True)  # dropped with the two events before it
    b.alloc(s, 256 * MiB, 32 * MiB)
    b.alloc(s, 288 * MiB, 32 * MiB)
    b.annotate("nccl:all_reduce", "START")
    b.alloc(s, 320 * MiB, 32 * MiB)
    b.complete(p)
    b.alloc(s, 400 * MiB, 32 * MiB)
    (f,) = deferred_free.detect(_ctx(tmp_path, b, b.snapshot(drop_first=3)))
    assert f.evidence.held_at_peak_bytes == 256 * MiB
    assert f.evidence.held_at_peak_by_owner == {"unknown": 256 * MiB}
    assert f.evidence.owner == "unknown"


def test_the_expandable_segments_warning_carries_the_runs_it_cites():
    """Issue 52: its words cite runs measured on H200 GPUs (shared/snapshots/tp-allreduce/stats.jsonl, peak reserved
    of rank 0 and rank 1): the numbers are the fix's data (the JSON has them), not only words."""
    fixes = deferred_free._fixes("collective", VERSIONS["2.11"])
    (fx,) = [f for f in fixes if f.id == "expandable-segments-no-help"]
    assert fx.measured == {"record_stream": [2_449_473_536, 3_053_453_312],
                           "expandable_segments": [2_390_753_280, 2_663_383_040],
                           "without_record_stream": [1_308_622_848, 1_308_622_848]}
    assert all(f.measured is None for f in fixes if f is not fx)
