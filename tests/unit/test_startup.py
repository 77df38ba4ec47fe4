"""Start-up: a command imports what it uses (docs/benchmarks.md). A healthy diagnosis replays nothing, so it imports
no planner (``oomdoctor.plan``) and no allocator model (``oomdoctor.simulate``), nor a process pool, zip or
decompression modules for a plain pickle. Checked in a fresh interpreter, where nothing was imported before."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from builder import SnapBuilder

from oomdoctor.units import MiB

PROBE = """
import contextlib, io, json, sys
from oomdoctor.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "first": out.getvalue().splitlines()[0], "modules": sorted(sys.modules)}))
"""
HEAVY = ("oomdoctor.plan", "oomdoctor.simulate", "oomdoctor.views.visual", "multiprocessing", "concurrent.futures",
         "zipfile", "pickletools", "lzma", "bz2", "gzip", "jinja2", "rich.progress", "oomdoctor.capture.recorder",
         "oomdoctor.capture.metadata", "socket", "secrets", "hashlib", "numpy.ma.core", "pathlib")


def _healthy(tmp_path):
    b = SnapBuilder()
    s = b.segment(64 * MiB)
    for _ in range(6):  # the same block made and freed: no growth, no fragmentation, nothing held
        x = b.alloc(s, 0, 16 * MiB)
        b.free(x)
    return b.write(tmp_path / "rank0.pickle")


def _modules(*argv: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, check=True,
                         env=dict(os.environ))
    return json.loads(out.stdout.splitlines()[-1])


def test_a_healthy_diagnosis_imports_no_planner_and_no_replay(tmp_path):
    got = _modules("diagnose", "--jobs", "1", str(_healthy(tmp_path)))
    assert got["rc"] == 0 and "healthy" in got["first"]
    assert [m for m in got["modules"] if m.startswith(HEAVY)] == []


def test_the_probe_sees_the_replay_where_one_runs(tmp_path):
    """The check can fail: asked what micro-batch fits, the same diagnosis replays, and the modules show it."""
    got = _modules("diagnose", "--jobs", "1", "--micro-batch", "4", str(_healthy(tmp_path)))
    assert got["rc"] == 0 and "oomdoctor.simulate.replay" in got["modules"]


def test_a_real_diagnosis_imports_no_masked_arrays(snapshots):
    """NumPy 2.x's ``np.unique`` without returned indices imports ``numpy.ma`` (about 30-80 ms): accounting's
    forward pass on a real trace must use ``analysis.arrays.distinct`` (8f56470 imported it here)."""
    got = _modules("diagnose", "--jobs", "1", str(snapshots / "ddp-clean" / "rank0.pickle"))
    assert got["rc"] == 0
    assert "numpy.ma.core" not in got["modules"] and "numpy" in got["modules"]


def test_read_only_commands_get_one_blas_thread_unless_the_user_set_one():
    from oomdoctor.cli.main import BLAS_THREADS, one_blas_thread

    env: dict = {}
    one_blas_thread(["diagnose", "large.pickle"], env)
    assert env == dict.fromkeys(BLAS_THREADS, "1")
    env = {"OMP_NUM_THREADS": "8"}
    one_blas_thread(["--jobs", "simulate", "x.pickle"], env)  # the first word that is not an option is the command
    assert env["OMP_NUM_THREADS"] == "8" and env["OPENBLAS_NUM_THREADS"] == "1"
    for argv in (["run", "torchrun", "train.py"], ["preflight", "m.py"], ["fit", "x"], ["--help"], []):
        env = {}
        one_blas_thread(argv, env)
        assert env == {}, argv  # the user's job (run, fit, verify) and torch (preflight) see the environment as is


def test_the_entry_point_sets_them_before_numpy_loads():
    """The console script's :func:`entry` sets them before anything imports NumPy (OpenBLAS reads them when it
    loads): ``main`` is replaced by a probe that reports what it finds."""
    probe = ("import os, sys; sys.argv = ['oomdoctor', 'diagnose', 'x.pickle']\n"
             "import oomdoctor.cli.main as m\n"
             "m.main = lambda: print(os.environ.get('OPENBLAS_NUM_THREADS'), 'numpy' in sys.modules) or 0\n"
             "m.entry()")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.split() == ["1", "False"]


def _entry(probe: str, *argv: str) -> subprocess.CompletedProcess:
    code = f"import sys; sys.argv = ['oomdoctor', *{list(argv)!r}]\nimport oomdoctor.cli.main as m\n{probe}\nm.entry()"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))


def test_a_diagnosis_ends_at_once_after_its_exit_handlers_and_keeps_the_decoded_entries(tmp_path, snapshots):
    """``entry`` ends a read-only command with ``os._exit`` (no teardown): the ``atexit`` handlers still run, the
    report is written in full, the exit code is the command's, and the decoded snapshot was kept (one), its objects
    frozen out of the collector's reach."""
    path = str(_healthy(tmp_path))
    probe = ("import atexit, gc\n"
             "atexit.register(lambda: print('kept', len(sys.modules['oomdoctor.trace.load']._kept),\n"
             "                              gc.get_freeze_count() > 0, file=sys.stderr))")
    out = _entry(probe, "diagnose", "--jobs", "1", path)
    assert out.returncode == 0 and "healthy" in out.stdout.splitlines()[0], out.stderr
    assert out.stderr.split() == ["kept", "1", "True"]
    same = subprocess.run([sys.executable, "-c", PROBE, "diagnose", "--jobs", "1", path], capture_output=True,
                          text=True, env=dict(os.environ))
    assert json.loads(same.stdout.splitlines()[-1])["first"] == out.stdout.splitlines()[0]
    oom = str(snapshots / "fragmentation-oom" / "default-oom.pickle")
    gated = _entry("", "diagnose", "--jobs", "1", "--fail-on", "unhealthy", oom)
    assert gated.returncode == 1 and "OOM" in gated.stdout  # --fail-on's code, the report written first


def test_main_alone_keeps_nothing_and_another_thread_gets_the_ordinary_exit(tmp_path):
    """Called as a library (``main``), nothing is kept; with a thread still running, ``entry`` leaves the exit to
    the interpreter, which waits for the thread (its line is printed last)."""
    path = str(_healthy(tmp_path))
    probe = ("import threading, time\n"
             "done = threading.Event()\n"
             "threading.Thread(target=lambda: (done.wait(), time.sleep(0.3), print('thread done'))).start()\n"
             "command = m.main\n"
             "m.main = lambda: (command(), done.set())[0]  # the thread is still alive when the command returns")
    out = _entry(probe, "diagnose", "--jobs", "1", path)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "thread done"
    lib = subprocess.run([sys.executable, "-c", PROBE + "print(sys.modules['oomdoctor.trace.load']._kept)",
                          "diagnose", "--jobs", "1", path], capture_output=True, text=True, env=dict(os.environ))
    assert lib.stdout.splitlines()[-1] == "None"


def _two_growing(tmp_path):
    b = SnapBuilder()
    s = b.segment(512 * MiB)
    for i in range(8):  # allocations that are never freed: memory grows step after step
        b.alloc(s, i * 32 * MiB, 32 * MiB)
    return b.write(tmp_path / "growing.pickle")


def test_keep_decoded_holds_the_last_file_only(tmp_path, monkeypatch):
    import importlib

    load = importlib.import_module("oomdoctor.trace.load")
    monkeypatch.setattr(load, "_kept", None)
    a, b = _healthy(tmp_path), _two_growing(tmp_path)
    plain = load.load(str(a))
    assert load._kept is None
    load.keep_decoded()
    try:
        kept = load.load(str(a))
        first = load._kept[0]
        load.load(str(b))
        assert len(load._kept) == 1 and load._kept[0] is not first and isinstance(first, dict)
        assert [d.events["size"].tolist() for d in kept.devices.values()] == \
            [d.events["size"].tolist() for d in plain.devices.values()]
    finally:
        import gc

        gc.unfreeze()
