"""Every simulated claim ``diagnose`` makes about a run that ran out of memory, against the same job rerun on
the GPU with that setting (docs/corpus/reruns.jsonl, expandable-and-eval-runs.jsonl).

A claim is a prediction (a finding's fix, or the verdict's replay with the fragmentation fix) with its reach
(``report/predict.py``): ``step-completed`` says the job gets through its step, so the rerun must complete;
``step-ran-out`` and a prefix that still runs out say it does not, so the rerun must fail; a prefix that
``gets past the recorded OOM`` says nothing of the rest of the step, so any rerun agrees with it (and the
table says so). A claim with no rerun is listed as not checked.

    python benchmarks/claims_vs_reruns.py [--half tuning ...] [--json docs/claims_vs_reruns.json]
"""

from __future__ import annotations

import argparse
import json
import tarfile
import tempfile
from pathlib import Path

from oomdoctor.render.json import report_dict
from oomdoctor.report import build_report
from oomdoctor.trace import load_ranks

CORPUS = Path(__file__).resolve().parents[1] / "docs" / "corpus"


def reruns() -> dict[tuple[str, str], int]:
    """(run, PYTORCH_ALLOC_CONF) -> exit code of the rerun."""
    out = {}
    for ln in (CORPUS / "reruns.jsonl").read_text().splitlines():
        r = json.loads(ln)
        out[(r["rerun_of"], r["alloc_conf"])] = r["exit_code"]
    for ln in (CORPUS / "expandable-and-eval-runs.jsonl").read_text().splitlines():
        r = json.loads(ln)
        if r["run"].endswith("-expandable"):
            out[(r["run"][: -len("-expandable")], r["alloc_conf"])] = r["exit_code"]
    return out


def expectation(pred: dict) -> str | None:
    """What a prediction says the real job does under its setting: "completes", "runs out", "at the edge"
    (it gets through with less spare room than its margin: it may still run out, issue 35), or None (the
    recorded prefix gets through, the rest was not recorded: it says nothing of the job)."""
    if pred.get("at_edge"):
        return "at the edge"
    if pred["reach"] in ("step-completed", "complete") and pred.get("oom") is None:
        return "completes"
    if pred["reach"] == "step-ran-out" or pred.get("oom") is not None:
        return "runs out"
    return None


def claims(report, rerun_configs: list[str]) -> list[dict]:
    """The claims of a report: every fix's prediction, the verdict's, and for a capacity verdict its "no
    allocator setting helps" against every setting the job was rerun with."""
    d = report_dict(report)
    out = []
    for f in d["findings"]:
        for fx in f["fixes"]:
            p = fx.get("prediction")
            if p:
                out.append({"from": f["id"], "config": p["config"], "reach": p["reach"], "outcome": p["outcome"],
                            "says": expectation(p)})
    ev = d["verdict"]["evidence"] if d["verdict"] else {}
    if "defragmented_config" in ev:
        p = {k[len("fix_"):]: v for k, v in ev.items() if k.startswith("fix_")}
        out.append({"from": "verdict", "config": p["config"], "reach": p["reach"], "outcome": d["verdict"]["summary"],
                    "says": expectation(p)})
    if d["verdict"] and d["verdict"]["kind"] == "capacity":
        # a capacity verdict whose fix got through inside its margin says the job is at the edge, not that every
        # setting runs out
        says = "at the edge" if ev.get("fix_at_edge") else "runs out"
        out += [{"from": "verdict (capacity)", "config": conf, "reach": "-", "outcome": d["verdict"]["summary"],
                 "says": says} for conf in rerun_configs if not any(c["config"] == conf for c in out)]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--half", action="append", choices=("in-sample", "tuning", "held-out"))
    a = p.parse_args()
    runs = json.loads((CORPUS / "runs.json").read_text())
    done = reruns()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in runs.items():
            if a.half and spec.get("half", "in-sample") not in a.half:
                continue
            with tarfile.open(CORPUS / f"{name}.tar.xz") as tar:
                tar.extractall(tmp, filter="data")
            traces = load_ranks([Path(tmp) / name], skipped=[])
            if not any(t.primary.num_events and (t.primary.events["action"] == 8).any() for t in traces):
                continue  # no OOM: nothing to rerun
            for c in claims(build_report(traces), [conf for run, conf in done if run == name]):
                code = done.get((name, c["config"]))
                real = None if code is None else ("completes" if code == 0 else "runs out")
                c.update(run=name, half=spec.get("half", "in-sample"), rerun=real,
                         agrees=None if real is None else (c["says"] in (None, "at the edge") or c["says"] == real))
                rows.append(c)
    print("| run | half | claim from | setting | reach | says | rerun | agrees |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['half']} | {r['from']} | {r['config']} | {r['reach']} | {r['says'] or 'nothing past the OOM'} "
              f"| {r['rerun'] or 'not rerun'} | {'-' if r['agrees'] is None else ('yes' if r['agrees'] else 'NO')} |")
    checked = [r for r in rows if r["agrees"] is not None]
    print(f"\n{sum(r['agrees'] for r in checked)} of {len(checked)} rerun claims agree; {len(rows) - len(checked)} "
          "claims without a rerun")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
