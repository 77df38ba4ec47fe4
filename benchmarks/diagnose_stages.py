"""Where the CPU seconds of ``oomdoctor diagnose FILE`` go, stage by stage, in one process (``time.process_time``
and wall between stages; the interpreter's own start is before the first mark). The stages are those of
``report.job.rank_result`` (``report/pipeline.py``: ``analysis/device.py`` analyze, ``report/detect.py`` detect,
``report/decide.py`` decide) and ``cli/diagnose.py``, called one by one. Usage::

    python benchmarks/diagnose_stages.py SNAPSHOT.pickle        # PYTHONPATH picks the source tree
    python benchmarks/diagnose_stages.py SNAPSHOT.pickle STAGE  # end (os._exit) after the stage named STAGE...

The second form is for instruction counts per stage: run it under ``valgrind --tool=cachegrind`` once per stage and
subtract (round 11 in docs/benchmarks.md).

Run it a few times: on a shared machine the numbers move by 10-30%.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import time

marks: list[tuple[str, float, float]] = []


def mark(name: str) -> None:
    marks.append((name, time.process_time(), time.perf_counter()))
    if len(sys.argv) > 2 and name.startswith(sys.argv[2]):
        os._exit(0)


def main() -> None:
    mark("start")
    importlib.import_module("oomdoctor.cli.main")
    mark("import cli.main")
    importlib.import_module("oomdoctor.cli.diagnose")
    mark("import cli.diagnose")
    from oomdoctor.analysis.device import analyze
    from oomdoctor.detectors import rank_imbalance
    from oomdoctor.detectors.materiality import Materiality
    from oomdoctor.render.text import render_text_plain
    from oomdoctor.report.decide import decide
    from oomdoctor.report.detect import detect
    from oomdoctor.report.job import RankResult, RankTask, gather, job_report
    from oomdoctor.trace import build, reader
    importlib.import_module("oomdoctor.trace.load")
    mark("import the rest")
    path = sys.argv[1]
    gc.disable()  # as trace/load.py does from the first entry to the last column
    data = reader.read_file(path)
    mark("read_file")
    obj = reader.decode(path, data)
    del data
    mark("unpickle")
    trace = build.build_trace(path, obj)  # and the stackless steps matched, as load does
    mark("build_trace (columns)")
    del obj
    mark("drop the entries")
    gc.enable()
    trace.meta["rank"] = 0
    mark("after load")
    a = analyze(trace)
    mark("analyze (lifetimes, timeline, phases, accounting)")
    predictors: dict = {}
    findings = detect([a], predictors)
    mark("detect (detectors, predictions)")
    rep = decide([a], findings, predictors, micro_batch=None, rule=Materiality())
    mark("decide (breakdowns, verdict)")
    prof = rank_imbalance.profile(a)
    report = job_report(gather([RankResult(RankTask(path, None, True), rank=a.rank, report=rep, profile=prof)], []))
    mark("job_report")
    render_text_plain(report)
    mark("render text")
    for (_, c0, w0), (name, c1, w1) in zip(marks, marks[1:]):
        print(f"{name:32s} cpu {c1 - c0:.3f} s  wall {w1 - w0:.3f} s")
    print(f"{'total (process CPU so far)':32s} cpu {marks[-1][1]:.3f} s")


if __name__ == "__main__":
    main()
