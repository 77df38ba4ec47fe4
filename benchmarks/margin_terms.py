"""The measurements every term of a claim's margin and every deciding constant of ``report/margin.py``,
``report/fits.py``, ``simulate/capacity.py`` and ``analysis/jobpeak.py`` are derived from (issue 49, item 2), on
the corpus's real runs (docs/corpus/, H200, torch 2.11) and the shared snapshots' H100 allocator traces.

    python benchmarks/margin_terms.py [--corpus DIR] [--json docs/margin_terms.json]

``--corpus``: the corpus unpacked (each ``docs/corpus/*.tar.xz`` extracted into DIR); without it, each archive is
unpacked into a temporary directory. Writes, per measurement:

- ``outside``: per OOM run (rank), the memory outside the caching allocator read at its OOM (GPU total - the OOM's
  ``cudaMemGetInfo`` free bytes - reserved bytes then) and at a dump of a run of the same job that completed (same
  world size and rank; sidecar free bytes + ``memory_stats`` reserved), and whether the OOM came after the job's
  work had run once in full (``report/margin.py`` ``step_ran_before``: an optimizer step ended, or an earlier pass of
  the same inference loop): the *growth* of that memory after the room was read, the ``outside_bytes`` term of a
  claim;
- ``outside_all``: the outside memory of every run, by world size: the planner constants' error
  (``plan/terms.py`` ``CUDA_CONTEXT_BYTES``, ``NCCL_FIRST_COMMUNICATOR_BYTES``) where the room is estimated from them,
  and the largest outside share of the GPU (``DEVICE_LIMIT_SHARE``);
- ``self_replay``: the self-replay's largest reserved difference on every run (``model_error_bytes``);
- ``setting_error``: the replay of a recording under another allocator setting against a recording of the same
  job made with that setting (what the self-replay does not measure; said in docs/diagnose.md, not in the margin);
- ``steps``: per run with two complete steps or more, the spread (max - min) of the per-step peak reserved and of
  the per-step peak allocated;
- ``reserved_over_allocated``: ``max_memory_reserved / max_memory_allocated`` of every completed eager training
  run of the sweeps at its largest micro-batch (``UNSEEN_FRAGMENTATION``).
"""

from __future__ import annotations

import argparse
import json
import tarfile
import tempfile
from pathlib import Path

from oomdoctor.analysis.device import analyze
from oomdoctor.report.margin import step_peaks, step_ran_before
from oomdoctor.simulate.capacity import infer_capacity
from oomdoctor.simulate.config import parse_config
from oomdoctor.simulate.replay import SimulationError, prepare, replay
from oomdoctor.trace import load, load_ranks

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "docs" / "corpus"
SHARED = Path("/work/shared/snapshots")

#: OOM run -> a run of the same job (same script, world size and ranks) that completed, read at its dump
COMPLETED_PAIR = {
    "trainer-ddp-gpt2-b96": "trainer-ddp-gpt2-b92",
    "trainer-ddp-gpt2-eval-accumulate": "trainer-ddp-gpt2-b92",
    "first-forward-trainer-ddp-gpt2-b160": "trainer-ddp-gpt2-b92",
    "trainer-fsdp2-gpt2-b116": "trainer-fsdp2-gpt2-b112",
    "trainer-fsdp2-gpt2-b120": "trainer-fsdp2-gpt2-b112",
    "accelerate-ddp-llama-b76": "accelerate-ddp-llama-b72",
    "first-forward-accelerate-ddp-llama-b128": "accelerate-ddp-llama-b72",
    "compiled-lm-b152": "compiled-lm-b144",
    "compiled-lm-b160": "compiled-lm-b144",
    "deepspeed-z1-gpt2-b120": "deepspeed-z1-gpt2-b112",
    "deepspeed-z2-gpt2-b120": "deepspeed-z2-gpt2-b112",
    "generate-mha-b3584": "generate-mha-b3328",
    "generate-gqa-b11264": "generate-gqa-b10752",
    "pipelining-1f1b-b32": "pipelining-1f1b-b28",
    "pipeline-gpipe-b32": "pipeline-gpipe-b28",
}


def _outside_at_oom(a) -> int | None:
    total = a.trace.meta.get("gpu_total_memory_bytes")
    if not a.oom_events.size or not isinstance(total, int):
        return None
    k = int(a.oom_events[-1])
    free = int(a.device.events["device_free"][k])
    return total - free - int(a.timeline.reserved[k]) if free >= 0 else None


def _outside_at_dump(meta: dict) -> int | None:
    total, free = meta.get("gpu_total_memory_bytes"), meta.get("device_free_bytes")
    reserved = (meta.get("memory_stats") or {}).get("reserved_bytes.all.current")
    if all(isinstance(x, int) for x in (total, free, reserved)):
        return total - free - reserved
    return None


def _runs(corpus: Path | None):
    runs = json.loads((CORPUS / "runs.json").read_text())
    tmp = None if corpus else tempfile.TemporaryDirectory()
    base = corpus or Path(tmp.name)
    for name in runs:
        if tmp is not None:
            with tarfile.open(CORPUS / f"{name}.tar.xz") as tar:
                tar.extractall(base, filter="data")
        yield name, runs[name], [analyze(t) for t in load_ranks([base / name], skipped=[])]
    if tmp is not None:
        tmp.cleanup()


def measure(corpus: Path | None) -> dict:
    per_run: dict[str, dict] = {}
    out = {"outside": [], "outside_all": [], "self_replay": [], "steps": []}
    for name, spec, analyses in _runs(corpus):
        for a in analyses:
            if not a.num_events:
                continue
            meta = a.trace.meta
            row = {"run": name, "rank": a.rank, "world_size": meta.get("world_size"), "half": spec.get("half")}
            o_oom, o_dump = _outside_at_oom(a), _outside_at_dump(meta)
            per_run[f"{name}/{a.rank}"] = {"oom": o_oom, "dump": o_dump}
            if o_oom is not None or o_dump is not None:
                out["outside_all"].append({**row, "outside_at_oom_bytes": o_oom, "outside_at_dump_bytes": o_dump,
                                           "gpu_total_memory_bytes": meta.get("gpu_total_memory_bytes")})
            if a.oom_events.size and o_oom is not None:
                out["outside"].append({**row, "outside_at_oom_bytes": o_oom,
                                       "after_a_step": step_ran_before(a)})
            try:
                p = prepare(a.trace, a.device, a.lifetimes)
                v = replay(p, capacity=infer_capacity(a.trace, a.device), validate=True).validation
                err = v.max_reserved_difference_bytes if v is not None else None
                private = bool(p.external or p.external_start)
            except SimulationError as e:
                err, private = f"refused: {e}"[:120], None
            out["self_replay"].append({**row, "max_reserved_difference_bytes": err, "private_pools": private})
            alloc, res = step_peaks(a)
            if len(res) >= 2:
                out["steps"].append({**row, "complete_steps": len(res), "reserved_spread_bytes": max(res) - min(res),
                                     "allocated_spread_bytes": max(alloc) - min(alloc)})
    for r in out["outside"]:
        pair = COMPLETED_PAIR.get(r["run"])
        done = per_run.get(f"{pair}/{r['rank']}", {}).get("dump") if pair else None
        r["completed_run"], r["outside_completed_bytes"] = pair, done
        r["growth_bytes"] = None if done is None else done - r["outside_at_oom_bytes"]
    out["setting_error"] = setting_errors()
    out["reserved_over_allocated"] = reserved_over_allocated()
    out["summary"] = summary(out)
    return out


def setting_errors() -> list[dict]:
    """The replay of a recording under another setting against the recording made with that setting."""
    rows = []
    at = SHARED.parent / "snapshots" if SHARED.exists() else None
    pairs = []
    traces = CORPUS / "allocator-traces.tar.xz"
    tmp = tempfile.TemporaryDirectory()
    with tarfile.open(traces) as tar:
        tar.extractall(tmp.name, filter="data")
    base = Path(tmp.name) / "allocator-traces"
    for rec in ("cap-default", "nocap-default"):
        for other in sorted(base.iterdir()):
            if other.name == rec or other.name.split("-")[0] != rec.split("-")[0] or not (other / "truth.json").exists():
                continue
            truth = json.loads((other / "truth.json").read_text())
            pairs.append((base / rec / "rank0.pickle", truth["alloc_conf"], truth["memory_stats"]["reserved_bytes.all.peak"],
                          f"allocator-traces/{rec}", f"allocator-traces/{other.name}"))
    if at is not None:
        frag = at / "fragmentation-oom"
        stats = [json.loads(ln) for ln in (frag / "stats.jsonl").read_text().splitlines()]
        exp = next(s for s in stats if s["tag"] == "frag-expandable")
        pairs.append((frag / "default-oom.pickle", "expandable_segments:True", exp["max_reserved"],
                      "fragmentation-oom/default-oom", "fragmentation-oom/expandable-end (30 steps)"))
    for path, conf, measured, rec, other in pairs:
        t = load(path)
        a = analyze(t)
        p = prepare(t, a.device, a.lifetimes)
        r = replay(p, parse_config(conf), capacity=infer_capacity(t, a.device))
        rows.append({"recording": rec, "setting": conf, "measured_in": other, "predicted_bytes": r.peak_reserved_bytes,
                     "measured_bytes": int(measured), "difference_bytes": r.peak_reserved_bytes - int(measured),
                     "predicted_oom": r.oom is not None})
    tmp.cleanup()
    return rows


def reserved_over_allocated() -> list[dict]:
    """Completed eager training runs of the sweeps at their largest micro-batch that ran: reserved / allocated."""
    rows = []
    eager = ("trainer-ddp-gpt2", "trainer-fsdp2-gpt2", "lightning-fsdp-gpt2", "accelerate-ddp-llama",
             "deepspeed-z1-gpt2", "deepspeed-z2-gpt2", "pipeline-gpipe")
    for job in eager:
        ran = []
        for f in sorted(CORPUS.glob(f"{job}-sweep*.jsonl")):
            for ln in f.read_text().splitlines():
                r = json.loads(ln)
                if r.get("exit_code") == 0 and r.get("max_memory_reserved") and r.get("max_memory_allocated"):
                    ran.append(r)
        if ran:
            top = max(ran, key=lambda r: r["batch"])
            rows.append({"job": job, "batch": top["batch"], "max_memory_reserved": top["max_memory_reserved"],
                         "max_memory_allocated": top["max_memory_allocated"],
                         "ratio": round(top["max_memory_reserved"] / top["max_memory_allocated"], 4)})
    return rows


def summary(out: dict) -> dict:
    growth = [r for r in out["outside"] if r["growth_bytes"] is not None]
    before = [r["growth_bytes"] for r in growth if not r["after_a_step"]]
    after = [r["growth_bytes"] for r in growth if r["after_a_step"]]
    from oomdoctor.plan.terms import CUDA_CONTEXT_BYTES, NCCL_FIRST_COMMUNICATOR_BYTES

    const_err = {}
    share = []
    for r in out["outside_all"]:
        o = r["outside_at_dump_bytes"] if r["outside_at_dump_bytes"] is not None else r["outside_at_oom_bytes"]
        world = r["world_size"] or 1
        c = CUDA_CONTEXT_BYTES + (NCCL_FIRST_COMMUNICATOR_BYTES if world > 1 else 0)
        key = "world_1" if world == 1 else "world_gt_1"
        const_err[key] = max(const_err.get(key, 0), o - c)
        if r["gpu_total_memory_bytes"]:
            share.append(1 - max(r["outside_at_oom_bytes"] or 0, r["outside_at_dump_bytes"] or 0)
                         / r["gpu_total_memory_bytes"])
    errs = [r["max_reserved_difference_bytes"] for r in out["self_replay"] if isinstance(r["max_reserved_difference_bytes"], int)
            and not r["private_pools"]]
    ratios = [r["ratio"] for r in out["reserved_over_allocated"]]
    return {
        "outside_growth_before_a_step_max_bytes": max(before) if before else None,
        "outside_growth_before_a_step_pairs": len(before),
        "outside_growth_after_a_step_max_bytes": max(after) if after else None,
        "outside_growth_after_a_step_pairs": len(after),
        "planner_constants_shortfall_max_bytes": const_err,
        "smallest_device_share": round(min(share), 5) if share else None,
        "largest_outside_bytes": max(max(r["outside_at_oom_bytes"] or 0, r["outside_at_dump_bytes"] or 0)
                                     for r in out["outside_all"]),
        "self_replay_max_difference_bytes": max(errs) if errs else None,
        "self_replay_runs": len(errs),
        "self_replay_inexact": sum(1 for e in errs if e),
        "setting_error_largest_underprediction_bytes": min(min(r["difference_bytes"] for r in out["setting_error"]), 0),
        "reserved_over_allocated_max": max(ratios) if ratios else None,
        "reserved_over_allocated_min": min(ratios) if ratios else None,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", type=Path)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    out = measure(a.corpus)
    print(json.dumps(out["summary"], indent=1))
    for r in out["outside"]:
        print(f"{r['run']:45s} r{r['rank']} outside at OOM {r['outside_at_oom_bytes']:>14,} after a step "
              f"{str(r['after_a_step']):5s} completed {r['completed_run'] or '-':28s} growth {r['growth_bytes']}")
    for r in out["setting_error"]:
        print(f"{r['recording']:35s} {r['setting']:55s} {r['difference_bytes']:>+14,}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
