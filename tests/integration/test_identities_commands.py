"""One number, said the same wherever it is said (issue 52), across commands, on every shared snapshot.

Each identity is a pair of places that say the same number of the same snapshot: ``diagnose``'s JSON and its text,
``simulate``'s JSON, ``diff``'s JSON (a snapshot against itself, and pairs of runs), ``export --format folded`` and
``--format perfetto``, and ``report``'s HTML page. Every command runs as a user runs it (``oomdoctor.cli.main``, in
this process), once per snapshot. A pair that does not apply to a snapshot (no OOM, no finding with a replayed fix)
is skipped with its reason. Preflight's own pairs (its events, breakdown and steps against ``diagnose`` of the
snapshot it writes) are in ``tests/unit/test_preflight_numbers.py``; the pairs inside one ``diagnose`` that issue 52
found apart are in ``test_identities.py``.

Skipped without the shared snapshots (``OOMDOCTOR_SHARED``), as the other integration tests are.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import pytest

from oomdoctor.cli.main import main
from oomdoctor.render.format import format_bytes

#: every snapshot of shared/snapshots (test_every_shared_snapshot_is_covered holds the list to the directory)
NAMES = (
    "allgather/list-rank0.pickle", "allgather/tensor-rank0.pickle",
    "ddp-clean/rank0.pickle", "ddp-clean/rank1.pickle", "ddp-imbalance/rank0.pickle", "ddp-imbalance/rank1.pickle",
    "fragmentation-oom/default-oom.pickle", "fragmentation-oom/expandable-end.pickle",
    "fsdp2-gpt2/rank0.pickle", "fsdp2-gpt2/rank1.pickle",
    "large/fsdp2-gpt2-60steps-rank0.pickle.xz",
    "pp-microbatch/no-return-outputs-rank0.pickle", "pp-microbatch/no-return-outputs-rank1.pickle",
    "pp-microbatch/return-outputs-rank0.pickle", "pp-microbatch/return-outputs-rank1.pickle",
    "tp-allreduce/legacy-cppstacks-rank0.pickle", "tp-allreduce/legacy-expandable-rank0.pickle",
    "tp-allreduce/legacy-rank0.pickle", "tp-allreduce/legacy-rank1.pickle", "tp-allreduce/modern-rank0.pickle",
    "tp-allreduce/noallreduce-rank0.pickle",
)


def _run(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(list(argv))
    assert rc in (0, 1), (argv, rc)
    return out.getvalue()


def _folded_total(text: str) -> int:
    return sum(int(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.strip())


@lru_cache(maxsize=None)
def outputs(root: Path, name: str) -> dict[str, Any]:
    """Every command's output on one snapshot (``root / name``), made once."""
    path = str(root / name)
    d = json.loads(_run("diagnose", path, "--format", "json", "-j", "1"))
    out: dict[str, Any] = {
        "diagnose": d, "rank": d["ranks"][0],
        "text": _text(path),
        "simulate": json.loads(_run("simulate", path, "--format", "json")),
        "folded_peak": _folded_total(_run("export", path, "--format", "folded", "-j", "1")),
        "perfetto": json.loads(_run("export", path, "--format", "perfetto", "-j", "1")),
        "diff_self": json.loads(_run("diff", path, path, "--format", "json", "-j", "1")),
        "html": _run("report", path, "-o", "-", "-j", "1"),
    }
    if d["ranks"][0]["oom"]:
        out["folded_oom"] = _folded_total(_run("export", path, "--format", "folded", "--at", "oom", "-j", "1"))
    out["replays"] = {}
    for f in d["findings"]:
        for fx in f["fixes"]:
            p = fx.get("prediction")
            if p is None:
                continue
            key = (p["config"], p["deferred_frees"])
            if key not in out["replays"]:
                args = ["simulate", path, "--format", "json"] + (["--config", p["config"]] if p["config"] else [])
                args += ["--immediate-frees"] if p["deferred_frees"] == "immediate" else []
                # the replay asked for is the last (results[0] replays the recorded settings; a setting that is
                # the recorded one is that replay again)
                out["replays"][key] = json.loads(_run(*args))["results"][-1]
    return out


def _text(path: str) -> str:
    """diagnose's text, wide enough that no number wraps"""
    import os

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "250"
    try:
        return _run("diagnose", path, "-j", "1", "--all-ranks")
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


# --------------------------------------------------------------------------- the pairs, one number each

def _peak_reserved(o):
    r, s = o["rank"], o["simulate"]
    return [("diagnose json", r["peak_reserved_bytes"]), ("simulate recorded", s["recorded"]["peak_reserved_bytes"]),
            ("simulate self-replay", s["results"][0]["peak_reserved_bytes"]),
            ("diff before", o["diff_self"]["ranks"][0]["before_peak_reserved_bytes"]),
            ("diff after", o["diff_self"]["ranks"][0]["after_peak_reserved_bytes"]),
            ("anatomy at its peak", r["anatomy_at_peak"]["reserved_bytes"] if r["anatomy_at_peak"] else None),
            ("perfetto counter", _counter_max(o["perfetto"], "CUDA reserved bytes")),
            ("perfetto instant", _instant(o["perfetto"], "peak reserved"))]


def _peak_allocated(o):
    r, s = o["rank"], o["simulate"]
    bd = next(b for b in r["breakdowns"] if b["at"] == "peak_allocated")
    return [("diagnose json", r["peak_allocated_bytes"]), ("simulate recorded", s["recorded"]["peak_allocated_bytes"]),
            ("diff before", o["diff_self"]["ranks"][0]["before_peak_allocated_bytes"]),
            ("breakdown at the peak", bd["allocated_bytes"]),
            ("breakdown's lines", sum(bd["categories"].values())),
            ("folded stacks at the peak", o["folded_peak"]),
            ("perfetto counter", _counter_max(o["perfetto"], "CUDA allocated bytes")),
            ("perfetto instant", _instant(o["perfetto"], "peak allocated"))]


def _events(o):
    return [("diagnose json", o["rank"]["events"]), ("simulate", o["simulate"]["num_events"]),
            ("simulate self-replay", o["simulate"]["results"][0]["events_replayed"])]


def _oom_event(o):
    if not o["rank"]["oom"]:
        pytest.skip("no OOM in this snapshot")
    return [("diagnose json", o["rank"]["oom"]["event_index"]), ("simulate recorded", o["simulate"]["recorded"]
                                                                 ["oom_event_index"]),
            ("simulate self-replay", (o["simulate"]["results"][0]["oom"] or {}).get("event_index"))]


def _allocated_at_the_oom(o):
    if not o["rank"]["oom"]:
        pytest.skip("no OOM in this snapshot")
    bd = next(b for b in o["rank"]["breakdowns"] if b["at"] == "oom")
    return [("breakdown at the OOM", bd["allocated_bytes"]), ("breakdown's lines", sum(bd["categories"].values())),
            ("folded stacks at the OOM", o["folded_oom"])]


def _anatomy(o):
    an = o["rank"]["anatomy_at_peak"]
    if an is None:
        pytest.skip("no segments to lay out")
    parts = ("requested_bytes", "rounding_waste_bytes", "pending_free_bytes", "free_in_used_segments_bytes",
             "free_segments_bytes", "unattributed_bytes")
    before = o["diff_self"]["ranks"][0]["before_anatomy"]
    return [("diagnose: its parts added", sum(an[k] for k in parts)), ("diagnose: reserved", an["reserved_bytes"]),
            ("diff: its parts added", sum(before[k] for k in parts))]


def _pending_free(o):
    an = o["rank"]["anatomy_at_peak"]
    return [("diagnose anatomy", an["pending_free_bytes"] if an else None),
            ("diff anatomy", (o["diff_self"]["ranks"][0]["before_anatomy"] or {}).get("pending_free_bytes"))]


def _findings_bytes(o):
    """Each finding's bytes at stake: the JSON, the text (as the text says them), and diff against itself."""
    d = o["diagnose"]
    if not d["findings"]:
        pytest.skip("no finding")
    diff = {f["id"]: f for f in o["diff_self"]["findings"]}
    out = [("diagnose json", [(f["id"], f["bytes"]) for f in d["findings"]]),
           ("diff unchanged", [(f["id"], diff[f["id"]]["before_bytes"] if diff[f["id"]]["status"] == "unchanged"
                                else None) for f in d["findings"]]),
           ("diagnose text", [(f["id"], f["bytes"] if _said(o["text"], f) else None) for f in d["findings"]])]
    return out


def _said(text: str, f: dict) -> bool:
    """``text`` says finding ``f`` with its bytes: in its own box (headed 'N. id', issue 52), the line
    'rank(s) R · X at stake'; or a LOW line '[id] X · title'."""
    b = format_bytes(f["bytes"])
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "╭" in line and re.search(rf"\d+\. {re.escape(f['id'])}\s", line):
            box = lines[i + 1:next((j for j in range(i + 1, len(lines)) if "╰" in lines[j]), len(lines))]
            return any(re.search(rf"\branks? [\d,]+ · {re.escape(b)} at stake", x) for x in box)
    return any(x.strip().startswith(f"[{f['id']}] {b} · ") for x in lines)


def _verdict_bytes(o):
    """The verdict's bytes are its finding's; a fragmentation verdict's are the free bytes, which its words split
    into the finding's (reserved but not allocated, less the deferred frees among them) and those not yet reserved
    under the room (issue 52 met issue 49 on default-oom: 7.99 GiB free, 7.67 GiB at stake, nothing said how)."""
    v = o["diagnose"]["verdict"]
    if not v.get("finding"):
        pytest.skip("the verdict names no finding")
    (f,) = [f for f in o["diagnose"]["findings"] if f["id"] == v["finding"]]
    if v["kind"] != "fragmentation":
        return [("verdict", v["bytes"]), ("its finding", f["bytes"])]
    ev = v["evidence"]
    said = f"{format_bytes(f['bytes'])} reserved but not allocated" in v["summary"]
    return [("its finding", f["bytes"]), ("verdict's reserved but not allocated", ev["reserved_unallocated_bytes"]),
            ("verdict's words", f["bytes"] if said else None),
            ("verdict's bytes less those not yet reserved, deferred frees added",
             v["bytes"] - ev["unreserved_bytes"] + ev["pending_free_bytes"])]


def _predictions(o):
    """Each fix's replay in diagnose is simulate's replay of the same setting, on the same capacity."""
    preds = [fx["prediction"] for f in o["diagnose"]["findings"] for fx in f["fixes"] if fx.get("prediction")]
    if not preds:
        pytest.skip("no fix replayed")
    got = [(p["config"], p["deferred_frees"], p["peak_reserved_bytes"], (p["oom"] or {}).get("event_index"),
            p["recorded_peak_reserved_bytes"], p["capacity_bytes"]) for p in preds]
    sim = [(p["config"], p["deferred_frees"], o["replays"][(p["config"], p["deferred_frees"])]["peak_reserved_bytes"],
            (o["replays"][(p["config"], p["deferred_frees"])]["oom"] or {}).get("event_index"),
            o["simulate"]["recorded"]["peak_reserved_bytes"], o["simulate"]["capacity"]["limit_bytes"]) for p in preds]
    return [("diagnose predictions", got), ("simulate --config / --immediate-frees", sim)]


def _text_peaks(o):
    """The ranks table and the timeline lines say diagnose's peaks, as format_bytes writes them."""
    r = o["rank"]
    row = next(x for x in o["text"].splitlines() if re.match(rf"\s+{r['rank']}\s+[\d,]+\s", x))
    cells = re.findall(r"[\d.]+ [KMG]iB|\d+ B", row)
    return [("diagnose json", [format_bytes(r["peak_allocated_bytes"]), format_bytes(r["peak_reserved_bytes"])]),
            ("ranks table", cells[:2]),
            ("timeline lines", [_timeline(o["text"], "allocated"), _timeline(o["text"], "reserved")])]


def _timeline(text: str, what: str) -> str | None:
    m = re.search(rf"^\s+{what}\s+\S+\s+peak ([\d.]+ [KMG]iB|\d+ B)", text, re.M)
    return m.group(1) if m else None


def _text_events(o):
    m = re.search(r"over ([\d,]+) events", o["text"])
    row = next(x for x in o["text"].splitlines() if re.match(rf"\s+{o['rank']['rank']}\s+[\d,]+\s", x))
    return [("diagnose json", o["rank"]["events"]), ("timeline line", int(m.group(1).replace(",", "")) if m else None),
            ("ranks table", int(row.split()[1].replace(",", "")))]


def _html_peaks(o):
    r = o["rank"]
    return [("diagnose json", [format_bytes(r["peak_reserved_bytes"]), format_bytes(r["peak_allocated_bytes"])]),
            ("report html", [x if x in o["html"] else None for x in (format_bytes(r["peak_reserved_bytes"]),
                                                                     format_bytes(r["peak_allocated_bytes"]))])]


def _headroom(o):
    v, r = o["diagnose"]["verdict"], o["rank"]
    if v.get("headroom_bytes") is None:
        pytest.skip("the room is not known")
    return [("verdict", v["headroom_bytes"]), ("room less the peak judged",
                                                r["fits"]["room_bytes"] - v["evidence"]["peak_reserved_bytes"])]


def _deferred_held(o):
    """deferred-free's blocks held at the peak of reserved are the anatomy's pending frees there (the demo: 1.62 GiB
    in both)."""
    f = [f for f in o["diagnose"]["findings"] if f["id"] == "deferred-free" and "held_at_peak_bytes" in f["evidence"]]
    if not f:
        pytest.skip("no deferred-free finding at a peak")
    return [("deferred-free", f[0]["evidence"]["held_at_peak_bytes"]),
            ("anatomy at the peak of reserved", o["rank"]["anatomy_at_peak"]["pending_free_bytes"])]


def _pipeline_outputs(o):
    """pipeline-output-cache's outputs kept are the holders' outputs kept at its site (8 and 3.92 GiB on the last
    stage; the breakdown said 7 before issue 52)."""
    f = [f for f in o["diagnose"]["findings"] if f["id"] == "pipeline-output-cache"]
    if not f:
        pytest.skip("no pipeline-output-cache")
    ev, site = f[0]["evidence"], f[0]["sites"][0]["label"]
    held = [(h["count"], h["bytes"]) for h in o["rank"]["holders"] if h["category"] == "outputs" and h["label"] == site]
    return [("pipeline-output-cache", [(ev["outputs_kept"], ev["kept_bytes"])]), ("holders", held)]


def _growth_steps(o):
    """output-accumulation's steps that kept outputs, inside the steps memory-growth counts, are memory-growth's steps
    that left memory (ddp-imbalance: 3, 6 and 9; 'one batch per step' before issue 52)."""
    by_id = {f["id"]: f["evidence"] for f in o["diagnose"]["findings"]}
    acc, growth = by_id.get("output-accumulation"), by_id.get("memory-growth")
    if acc is None or growth is None or acc["kept_unit"] != "step":
        pytest.skip("not both output-accumulation by steps and memory-growth")
    counted = range(growth["first_counted_step"], growth["last_counted_step"] + 1)
    return [("memory-growth", growth["leaking_steps"]), ("output-accumulation", [x for x in acc["kept_at"]
                                                                                if x in counted])]


def _counter_max(trace: dict, name: str) -> int:
    return max(e["args"]["bytes"] for e in trace["traceEvents"] if e.get("ph") == "C" and e["name"] == name)


def _instant(trace: dict, name: str) -> int:
    (e,) = [e for e in trace["traceEvents"] if e.get("ph") == "i" and e["name"] == name]
    return e["args"]["bytes"]


PAIRS: dict[str, Callable[[dict], list[tuple[str, Any]]]] = {
    "peak-reserved": _peak_reserved,
    "peak-allocated": _peak_allocated,
    "events": _events,
    "oom-event": _oom_event,
    "allocated-at-the-oom": _allocated_at_the_oom,
    "anatomy-adds-up": _anatomy,
    "pending-free": _pending_free,
    "finding-bytes": _findings_bytes,
    "verdict-bytes": _verdict_bytes,
    "predictions": _predictions,
    "text-peaks": _text_peaks,
    "text-events": _text_events,
    "html-peaks": _html_peaks,
    "headroom": _headroom,
    "deferred-free-held": _deferred_held,
    "pipeline-outputs": _pipeline_outputs,
    "growth-steps": _growth_steps,
}


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("name", NAMES)
def test_a_number_said_twice_is_the_same(snapshots, name, pair):
    places = PAIRS[pair](outputs(snapshots, name))
    first_place, first = places[0]
    for place, value in places[1:]:
        assert value == first, f"{name}: {pair}: {place} says {value!r}, {first_place} says {first!r}"


def test_every_shared_snapshot_is_covered(snapshots):
    found = sorted(str(p.relative_to(snapshots)) for p in snapshots.glob("*/*")
                   if p.name.endswith((".pickle", ".pickle.xz")))
    assert found == sorted(NAMES)


# --------------------------------------------------------------------------- runs of several ranks, and diffs

RUNS = {"ddp-clean": ["ddp-clean"], "ddp-imbalance": ["ddp-imbalance"], "fsdp2-gpt2": ["fsdp2-gpt2"],
        "pp-return-outputs": ["pp-microbatch/return-outputs-rank0.pickle", "pp-microbatch/return-outputs-rank1.pickle"],
        "tp-legacy": ["tp-allreduce/legacy-rank0.pickle", "tp-allreduce/legacy-rank1.pickle"]}


@lru_cache(maxsize=None)
def _job(root: Path, run: str) -> dict:
    return json.loads(_run("diagnose", *[str(root / p) for p in RUNS[run]], "--format", "json", "-j", "1"))


def _file_of(run: str, rank: int) -> str:
    parts = RUNS[run]
    return f"{parts[0]}/rank{rank}.pickle" if len(parts) == 1 else parts[rank]


@pytest.mark.parametrize("run", sorted(RUNS))
def test_a_rank_read_with_the_others_says_what_it_says_alone(snapshots, run):
    """diagnose of a job's ranks together, and of each rank's file alone: the same peaks, events, OOM, anatomy and
    breakdown at the peak (the cross-rank findings differ by design: an imbalance needs the other ranks)."""
    keys = ("peak_reserved_bytes", "peak_allocated_bytes", "events", "oom", "anatomy_at_peak", "steps", "trace_kind")
    for r in _job(snapshots, run)["ranks"]:
        alone = outputs(snapshots, _file_of(run, r["rank"]))["rank"]
        assert {k: r[k] for k in keys} == {k: alone[k] for k in keys}, (run, r["rank"])
        assert r["breakdowns"] == alone["breakdowns"], (run, r["rank"])


DIFFS = [("ddp-imbalance", "ddp-clean"), ("tp-allreduce/legacy-rank0.pickle", "tp-allreduce/modern-rank0.pickle"),
         ("pp-microbatch/return-outputs-rank1.pickle", "pp-microbatch/no-return-outputs-rank1.pickle"),
         ("fragmentation-oom/default-oom.pickle", "fragmentation-oom/expandable-end.pickle"),
         ("allgather/list-rank0.pickle", "allgather/tensor-rank0.pickle")]


def _diagnosed(root: Path, p: str) -> dict:
    return _job(root, p) if p in RUNS else outputs(root, p)["diagnose"]


@pytest.mark.parametrize("before, after", DIFFS, ids=[f"{b}-vs-{a}" for b, a in DIFFS])
def test_diff_says_what_diagnose_says_of_each_run_and_each_saving_once(snapshots, before, after):
    d = json.loads(_run("diff", str(snapshots / before), str(snapshots / after), "--format", "json", "-j", "1"))
    b, a = _diagnosed(snapshots, before), _diagnosed(snapshots, after)
    for r in d["ranks"]:
        rb = next(x for x in b["ranks"] if x["rank"] == r["rank"] or len(b["ranks"]) == 1)
        ra = next(x for x in a["ranks"] if x["rank"] == r["rank"] or len(a["ranks"]) == 1)
        assert (r["before_peak_reserved_bytes"], r["after_peak_reserved_bytes"]) == (rb["peak_reserved_bytes"],
                                                                                     ra["peak_reserved_bytes"])
        assert (r["before_peak_allocated_bytes"], r["after_peak_allocated_bytes"]) == (rb["peak_allocated_bytes"],
                                                                                       ra["peak_allocated_bytes"])
        assert r["peak_reserved_saved_bytes"] == r["before_peak_reserved_bytes"] - r["after_peak_reserved_bytes"]
        assert r["before_anatomy"] == rb["anatomy_at_peak"] and r["after_anatomy"] == ra["anatomy_at_peak"]
        for s in r["sites"]:
            assert s["saved_bytes"] == s["before_bytes"] - s["after_bytes"] == -s["delta_bytes"]
    fb, fa = {f["id"]: f for f in b["findings"]}, {f["id"]: f for f in a["findings"]}
    saved = {r["rank"]: r["peak_reserved_saved_bytes"] for r in d["ranks"]}
    for f in d["findings"]:
        assert f["before_bytes"] == (fb[f["id"]]["bytes"] if f["id"] in fb else 0)
        assert f["after_bytes"] == (fa[f["id"]]["bytes"] if f["id"] in fa else 0)
        if f["same_bytes_as"] is not None:
            assert f["peak_reserved_saved_bytes"] == 0
            assert next(x for x in d["findings"] if x["id"] == f["same_bytes_as"])["same_bytes_as"] is None
    # each rank's saving attributed at most once: the findings' shares of it add up to no more than it, and of the
    # findings that point at one allocation site on a rank (the same blocks), one carries a saving
    credited = sum(f["peak_reserved_saved_bytes"] for f in d["findings"] if f["peak_reserved_saved_bytes"] > 0)
    assert credited <= sum(v for v in saved.values() if v > 0)
    carriers: dict[tuple[int, str], set[str]] = {}
    for f in d["findings"]:
        src = fb.get(f["id"]) or fa[f["id"]]
        if f["peak_reserved_saved_bytes"]:
            for r in src["ranks"]:
                for site in src["sites"]:
                    carriers.setdefault((r, site["label"]), set()).add(f["id"])
    assert all(len(ids) == 1 for ids in carriers.values()), carriers
