"""The exit records (``capture/exits.py``): what the injected stop writes at the K-th optimizer step, and at the exit
of a process that stepped but never reached it; how they are read back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from oomdoctor.capture.exits import (
    KEPT_STATS,
    clear_exit_records,
    exit_record,
    read_exit_records,
    write_exit_record,
)


def test_a_record_keeps_the_counters_that_say_how_the_run_went(tmp_path):
    stats = {"num_ooms": 1, "num_alloc_retries": 3, "reserved_bytes.all.peak": 7 << 30,
             "allocated_bytes.all.peak": 6 << 30, "active_bytes.all.current": 5, "segment.all.freed": 9}
    rec = exit_record(stopped=False, steps=1, steps_asked=2, rank=3, pid=42, cuda=True, memory_stats=stats)
    assert rec["memory_stats"] == {k: stats[k] for k in KEPT_STATS}
    assert (rec["rank"], rec["pid"], rec["stopped"], rec["steps"], rec["steps_asked"]) == (3, 42, False, 1, 2)
    assert exit_record(stopped=True, steps=2, steps_asked=2, rank=0, pid=1, cuda=False,
                       memory_stats=None)["memory_stats"] is None


def test_records_are_read_back_and_cleared_and_nothing_else_is(tmp_path):
    d = tmp_path / "run.exits"
    for pid in (7, 12):
        write_exit_record(str(d), exit_record(stopped=pid == 7, steps=2, steps_asked=2, rank=0, pid=pid, cuda=False,
                                              memory_stats=None))
    (d / "notes.json").write_text(json.dumps({"stopped": True}))  # not a record's name
    (d / "pid99.json").write_text("{half")  # torn
    (d / "pid98.json").write_text(json.dumps({"stopped": "yes"}))  # not a record
    assert [(r["pid"], r["stopped"]) for r in read_exit_records(str(d))] == [(12, False), (7, True)]
    assert read_exit_records(str(tmp_path / "missing")) == []
    clear_exit_records(str(d))
    assert sorted(p.name for p in d.iterdir()) == ["notes.json"]


JOB = """
import sys, torch
from oomdoctor.capture import autorecord
autorecord.install_stop(torch, int(sys.argv[1]), exits=sys.argv[2])
m = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for step in range(int(sys.argv[3])):
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    print(f"loop step {step + 1}", flush=True)
"""


@pytest.mark.parametrize("asked,loop,expect", [
    (2, 9, [(True, 2, 2)]),      # the stop fired at the 2nd step
    (5, 1, [(False, 1, 5)]),     # it stepped once and ended: at exit, not stopped
    (5, 0, []),                  # no CUDA, no step: no record (a launcher, a data-loader worker)
])
def test_the_stop_and_the_exit_write_how_the_process_ended(tmp_path, asked, loop, expect):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    exits = tmp_path / "exits"
    p = subprocess.run([sys.executable, str(script), str(asked), str(exits), str(loop)], capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    recs = read_exit_records(str(exits))
    assert [(r["stopped"], r["steps"], r["steps_asked"]) for r in recs] == expect
    assert all(r["cuda"] is False and r["memory_stats"] is None for r in recs)  # no CUDA on this machine
