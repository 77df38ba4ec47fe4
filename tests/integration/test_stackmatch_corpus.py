"""Stack-less steps matched on real jobs of the corpus (Hugging Face Trainer DDP, DeepSpeed ZeRO-1, Lightning FSDP,
recorded with stacks at every step on H200s): each snapshot is rewritten as ``--stack-steps K/N`` would have
recorded it (the allocations of the other steps, the frees of their blocks, their segment events and their
blocks in the final state without frames; ``stack_markers`` in the sidecar), then diagnosed. The report must
name the same holders and top sites, with the same bytes, as the original; the steps must match in full."""

from __future__ import annotations

import copy
import json
import pickle
import tarfile
from pathlib import Path

import pytest

from oomdoctor.capture.recorder import stacked_step
from oomdoctor.render.json import render_json
from oomdoctor.report import build_report
from oomdoctor.trace.load import from_snapshot

CORPUS = Path(__file__).resolve().parents[2] / "docs" / "corpus"
STACKLESS_ACTIONS = ("alloc", "segment_alloc", "segment_map", "oom")


def without_stacks(snap: dict, meta: dict, plan: tuple[int, int]) -> tuple[dict, dict]:
    """``snap``/``meta`` as the recorder with ``stack_steps=plan`` writes them (``context=None`` outside
    the plan's steps: no frames on what those steps record, nor on the frees of their blocks)."""
    snap, meta = copy.deepcopy(snap), copy.deepcopy(meta)
    marks = sorted(meta["step_markers"], key=lambda m: m["step"])

    def step_of(t: int) -> int:
        return max([m["step"] for m in marks if m["time_us"] <= t], default=0)

    bare: set[int] = set()
    for e in snap["device_traces"][meta.get("device", 0)]:
        off = not stacked_step(plan, step_of(e["time_us"]))
        if e["action"] in STACKLESS_ACTIONS:
            if off:
                e["frames"] = []
            if e["action"] == "alloc":
                (bare.add if off else bare.discard)(e["addr"])
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in bare:
            e["frames"] = []
            if e["action"] == "free_completed":
                bare.discard(e["addr"])
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["address"] in bare and b["state"] != "inactive":
                b["frames"] = []
    meta["stack_markers"], prev = [], None
    for m in marks:
        if stacked_step(plan, m["step"]) != prev:
            prev = stacked_step(plan, m["step"])
            meta["stack_markers"].append({"step": m["step"], "stacks": prev, "time_us": m["time_us"]})
    meta["recording"]["stack_steps"] = list(plan)
    return snap, meta


def rank_report(snap: dict, meta: dict, path: str) -> dict:
    rep = json.loads(render_json(build_report([from_snapshot(snap, path, copy.deepcopy(meta))])))
    return rep["ranks"][0]


@pytest.mark.parametrize("plan", [(2, 0), (1, 2)], ids=["stacks-in-steps-0-1", "stacks-in-steps-0-2"])
@pytest.mark.parametrize("name", ["trainer-ddp-gpt2-b88", "deepspeed-z1-gpt2-b112", "lightning-fsdp-gpt2-b96"])
def test_real_steps_match_and_name_the_same_sites(tmp_path, name, plan):
    with tarfile.open(CORPUS / f"{name}.tar.xz") as tar:
        tar.extractall(tmp_path, filter="data")
    path = tmp_path / name / "rank0.pickle"
    snap = pickle.loads(path.read_bytes())
    meta = json.loads((tmp_path / name / "rank0.meta.json").read_text())
    full = rank_report(snap, meta, str(path))
    part = rank_report(*without_stacks(snap, meta, plan), str(path))
    assert full["stack_matches"] is None
    assert [(h["label"], h["bytes"]) for h in part["holders"]] == [(h["label"], h["bytes"]) for h in full["holders"]]
    assert [(s["label"], s["bytes"]) for s in part["top_sites"]] == \
        [(s["label"], s["bytes"]) for s in full["top_sites"]]
    assert part["peak_allocated_bytes"] == full["peak_allocated_bytes"]
    sm = part["stack_matches"]
    complete = [e for e in sm["steps"] if e["step"] < len(meta["step_markers"]) - 1]  # the last is the tail
    assert complete and all(e["unmatched"] == 0 and e["from_step"] is not None for e in complete)
    # a steady step repeats the reference's sequence in full: as many allocations as a stacked steady step
    assert len({e["allocations"] for e in complete}) == 1 and sm["matched"] > 0
    if plan == (1, 2) and name == "trainer-ddp-gpt2-b88":  # the peak falls in step 1, recorded without stacks
        assert all(h["matched_bytes"] == h["bytes"] for h in part["holders"][:5])
