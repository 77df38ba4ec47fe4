"""What ``-o`` names is written to, never replaced (issue 40): every command that writes a file, with a link to a
file, a FIFO read by another thread or process, ``/dev/null``, ``-`` and a path whose directory is missing; the
link, the FIFO and ``/dev/null`` stay what they were, and the bytes that arrive are those the same command writes
to a regular file. ``oomdoctor run --out`` writes a directory: a link to one is followed, a device, a FIFO and
``-`` are refused with one line.

fit, verify, tune and preflight are in the table too, run on this machine without a GPU in a second or so each: fit and
verify with the stand-in job (``tests/standin_job.py``, ``--allow-no-gpu``), tune by the cost model (``--no-run``) on a
tiny script traced on the CPU, preflight on a tiny script; their seconds are the clock's, held still while they run, so
that they write the same bytes every run. preflight's ``-o`` is its traced snapshot (README), its answer goes to
``--report-output``: both pass the same tests.

The commands run in this process through :func:`oomdoctor.cli.main.main` (``os.replace`` guarded, so that a
regression fails here instead of renaming a file over ``/dev/null`` of the machine running the tests), and in
subprocesses where a descriptor of their own is the target (``/proc/self/fd/1``, ``| head -3``,
``>(gzip > x.gz)``).
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import pytest

from oomdoctor.capture.files import (
    FILE,
    STREAM,
    OutputError,
    resolve_target,
    sidecar_for,
    target_kind,
    write_target,
)
from oomdoctor.cli.diagnose import demo_path
from oomdoctor.cli.main import main

DEMO = demo_path()
GOLDEN = str(Path(__file__).resolve().parents[1] / "data" / "golden_memory_sample.csv")
STANDIN = str(Path(__file__).resolve().parents[1] / "standin_job.py")
_PLAN = ["--model", "llama3-8b", "--gpus", "8"]
#: where the long commands' scripts, trial directories and temporary files are, the same for every test ("{work}")
WORK = Path(tempfile.gettempdir()) / f"oomdoctor-output-targets-{os.getpid()}"  # made by the fixture work()
_FIT = ["fit", "--allow-no-gpu", "--high", "4", "--out", "{work}/fit"]
_VERIFY = ["verify", "--allow-no-gpu", "--setting", "expandable_segments:True", "--out", "{work}/verify"]
_TUNE = ["tune", "--no-run", "-j", "1", "--knob", "mb=1,2", "--allocator", "defaults"]
_TUNE_JOB = ["--", sys.executable, "{work}/tune.py", "--bs", "{mb}"]
_STEP = ["--", sys.executable, "{work}/step.py"]
SCRIPTS = {
    "tune.py": "import argparse, torch\np = argparse.ArgumentParser(); p.add_argument('--bs', type=int)\n"
               "a = p.parse_args()\nm = torch.nn.Linear(64, 64).cuda()\nopt = torch.optim.AdamW(m.parameters())\n"
               "for _ in range(1000):\n    m(torch.randn(a.bs, 64, device='cuda')).sum().backward()\n"
               "    opt.step(); opt.zero_grad()\n",
    "step.py": "import torch\nm = torch.nn.Linear(64, 64).cuda()\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
               "for _ in range(3):\n    m(torch.randn(8, 64, device='cuda')).sum().backward()\n"
               "    opt.step(); opt.zero_grad()\n",
}

#: every command that writes what -o names, in each of its formats (-j 1: the ranks read in this process)
COMMANDS = {
    "diagnose text": ["diagnose", DEMO, "-j", "1"],
    "diagnose json": ["diagnose", DEMO, "-j", "1", "--format", "json"],
    "diagnose html": ["diagnose", DEMO, "-j", "1", "--format", "html"],
    "report": ["report", DEMO, "-j", "1"],
    "export perfetto": ["export", DEMO, "-j", "1"],
    "export folded": ["export", DEMO, "--format", "folded"],
    "simulate text": ["simulate", DEMO],
    "simulate json": ["simulate", DEMO, "--format", "json"],
    "plan estimate text": ["plan", "estimate", *_PLAN],
    "plan estimate json": ["plan", "estimate", *_PLAN, "--format", "json"],
    "plan search text": ["plan", "search", *_PLAN],
    "plan search json": ["plan", "search", *_PLAN, "--format", "json"],
    "plan validate text": ["plan", "validate", GOLDEN],
    "plan validate json": ["plan", "validate", GOLDEN, "--format", "json"],
    "slice": ["slice", DEMO, "--end", "100"],
    "diff text": ["diff", DEMO, DEMO, "-j", "1"],
    "diff json": ["diff", DEMO, DEMO, "-j", "1", "--format", "json"],
    "diff html": ["diff", DEMO, DEMO, "-j", "1", "--format", "html"],
    "schema": ["schema", "diagnose"],
    "fit text": [*_FIT, "--", sys.executable, STANDIN, "--mb", "{mb}"],
    "fit json": [*_FIT, "--format", "json", "--", sys.executable, STANDIN, "--mb", "{mb}"],
    "verify text": [*_VERIFY, "--", sys.executable, STANDIN],
    "verify json": [*_VERIFY, "--format", "json", "--", sys.executable, STANDIN],
    "tune text": [*_TUNE, *_TUNE_JOB],
    "tune json": [*_TUNE, "--format", "json", *_TUNE_JOB],
    "preflight text": ["preflight", *_STEP],
    "preflight json": ["preflight", "--format", "json", *_STEP],
    "preflight snapshot": ["preflight", "--report-output", "/dev/null", *_STEP],
}
IDS = list(COMMANDS)
#: the option that names the output, where it is not -o: preflight's answer (its -o is the snapshot)
OPTION = {"preflight text": "--report-output", "preflight json": "--report-output"}
#: what writes a sidecar beside a regular file (a snapshot)
SIDECAR = {"slice", "preflight snapshot"}
#: what runs a job or traces a script: its seconds are the clock's, held still (:func:`_still_clock`)
STILL = {n for n in COMMANDS if n.split()[0] in ("fit", "verify", "tune", "preflight")}


def argv(name: str, out: str) -> list[str]:
    """``name``'s command line writing to ``out`` (the option before a job's ``--``)."""
    args = [a.replace("{work}", str(WORK)) for a in COMMANDS[name]]
    at = args.index("--") if "--" in args else len(args)
    return [*args[:at], OPTION.get(name, "-o"), out, *args[at:]]


@contextlib.contextmanager
def _still_clock():
    """The clocks the commands read stand still (the trials' and traces' seconds are 0.0, the traces' times the same),
    and their temporary files (preflight's traces) are in WORK, not in a test's directory, which some tests expect to
    hold only what -o wrote."""
    with mock.patch.multiple(time, monotonic=lambda: 1000.0, perf_counter=lambda: 1000.0, time=lambda: 1.7e9,
                             time_ns=lambda: 1_700_000_000_000_000_000), \
            mock.patch.object(tempfile, "tempdir", str(WORK / "tmp")):
        yield


@pytest.fixture(scope="module", autouse=True)
def work():
    """The scripts of the long commands, and the directory of their temporary files."""
    (WORK / "tmp").mkdir(parents=True, exist_ok=True)
    for name, text in SCRIPTS.items():
        (WORK / name).write_text(text)
    yield WORK
    shutil.rmtree(WORK, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_rename_outside(tmp_path, monkeypatch):
    """``os.replace`` may rename only inside the test's own directory: never over /dev/null, a FIFO's name..."""
    real = os.replace
    roots = (str(tmp_path) + os.sep, str(WORK) + os.sep)

    def guarded(src, dst, *a, **kw):
        assert os.path.abspath(dst).startswith(roots), f"renamed over {dst}"
        assert not os.path.islink(dst) and (not os.path.exists(dst) or os.path.isfile(dst)), f"renamed over {dst}"
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", guarded)


def _run(name: str, out: str, capsysbinary) -> tuple[int, bytes, str]:
    capsysbinary.readouterr()
    with _still_clock() if name in STILL else contextlib.nullcontext():
        code = main(argv(name, out))
    got = capsysbinary.readouterr()
    return code, got.out, got.err.decode()


_REFERENCE: dict[str, bytes] = {}


def reference(name: str, tmp_path: Path, capsysbinary) -> bytes:
    """What ``name`` writes to a new regular file (deterministic: the same bytes every run)."""
    if name not in _REFERENCE:
        p = tmp_path / "reference.out"
        code, _, err = _run(name, str(p), capsysbinary)
        assert code == 0, err
        _REFERENCE[name] = p.read_bytes()
        p.unlink()
        Path(sidecar_for(str(p))).unlink(missing_ok=True)
    assert len(_REFERENCE[name]) > 100
    return _REFERENCE[name]


@pytest.mark.parametrize("name", IDS)
def test_a_link_to_a_file_writes_the_target_and_stays_a_link(name, tmp_path, capsysbinary):
    want = reference(name, tmp_path, capsysbinary)
    target = tmp_path / "data" / "target.out"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link = tmp_path / "link.out"
    link.symlink_to(target)
    code, stdout, err = _run(name, str(link), capsysbinary)
    assert code == 0, err
    assert os.path.islink(link) and os.readlink(link) == str(target)
    assert target.read_bytes() == want and stdout == b""
    assert sorted(p.name for p in target.parent.iterdir()) == ["target.out"]  # no temporary left
    if name in SIDECAR:  # the sidecar goes beside the name given, as a regular file
        side = Path(sidecar_for(str(link)))
        assert side == tmp_path / "link.out.meta.json" and side.is_file() and not side.is_symlink()


@pytest.mark.parametrize("name", IDS)
def test_a_fifo_is_written_as_a_stream_and_stays_a_fifo(name, tmp_path, capsysbinary):
    want = reference(name, tmp_path, capsysbinary)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    try:
        code, stdout, err = _run(name, str(fifo), capsysbinary)
    finally:
        _release(fifo, reader)
    assert code == 0, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert got == [want] and stdout == b""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]  # no sidecar, no temporary
    if name == "slice":
        assert "no sidecar (fifo.meta.json) was written" in err


def _release(fifo: Path, reader: threading.Thread) -> None:
    """A reader still waiting for a writer (the command failed before opening the FIFO) is let go."""
    reader.join(timeout=30)
    if reader.is_alive():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        reader.join(timeout=5)


@pytest.mark.parametrize("name", IDS)
def test_dev_null_stays_a_character_device(name, tmp_path, capsysbinary):
    before = os.stat("/dev/null")
    code, stdout, err = _run(name, "/dev/null", capsysbinary)
    assert code == 0, err
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    assert not os.path.exists("/dev/null.meta.json") and stdout == b""
    if name == "slice":
        assert "/dev/null is not a regular file: no sidecar" in err


@pytest.mark.parametrize("name", IDS)
def test_dash_is_standard_output_with_the_bytes_of_a_file(name, tmp_path, capsysbinary, monkeypatch):
    want = reference(name, tmp_path, capsysbinary)
    monkeypatch.chdir(tmp_path)
    code, stdout, err = _run(name, "-", capsysbinary)
    assert code == 0, err
    assert stdout == want
    assert list(tmp_path.iterdir()) == []  # no file called "-", no sidecar
    if name == "slice":
        assert "standard output is not a regular file: no sidecar was written" in err


@pytest.mark.parametrize("name", IDS)
def test_a_missing_directory_is_one_line_and_exit_2(name, tmp_path, capsysbinary):
    out = tmp_path / "no" / "such" / "x.out"
    code, stdout, err = _run(name, str(out), capsysbinary)
    assert code == 2
    assert err.strip().splitlines() == [f"oomdoctor: error: {out}: the directory {out.parent} does not exist; "
                                        "create it first"]
    assert not (tmp_path / "no").exists() and stdout == b""


@pytest.mark.parametrize("name", IDS)
def test_a_directory_is_refused_with_one_line_and_exit_2(name, tmp_path, capsysbinary):
    d = tmp_path / "adir"
    d.mkdir()
    code, stdout, err = _run(name, str(d), capsysbinary)
    assert code == 2
    assert err.strip().splitlines() == [f"oomdoctor: error: {d}: is a directory; give a file name"]
    assert d.is_dir() and list(d.iterdir()) == [] and stdout == b""


@pytest.mark.parametrize("name", IDS)
def test_an_overwritten_file_keeps_its_permissions(name, tmp_path, capsysbinary):
    want = reference(name, tmp_path, capsysbinary)
    out = tmp_path / "kept.out"
    out.write_bytes(b"old")
    out.chmod(0o640)
    code, _, err = _run(name, str(out), capsysbinary)
    assert code == 0, err
    assert out.read_bytes() == want and stat.S_IMODE(out.stat().st_mode) == 0o640


def test_a_link_to_a_link_to_a_new_name_creates_the_final_target(tmp_path, capsysbinary):
    want = reference("schema", tmp_path, capsysbinary)
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to("c.json")  # relative: beside b
    code, _, err = _run("schema", str(tmp_path / "a"), capsysbinary)
    assert code == 0, err
    assert (tmp_path / "a").is_symlink() and (tmp_path / "b").is_symlink()
    assert (tmp_path / "c.json").read_bytes() == want


def test_a_link_into_a_missing_directory_is_one_line(tmp_path, capsysbinary):
    (tmp_path / "l").symlink_to(tmp_path / "gone" / "x")
    code, _, err = _run("schema", str(tmp_path / "l"), capsysbinary)
    assert code == 2
    assert err.strip().splitlines() == [f"oomdoctor: error: {tmp_path / 'l'}: links to {tmp_path / 'gone' / 'x'}, "
                                        "whose directory does not exist"]


def test_slice_refuses_to_write_over_its_input_through_a_link(tmp_path, capsysbinary):
    src = tmp_path / "in.pickle"
    shutil.copy(DEMO, src)
    (tmp_path / "alias.pickle").symlink_to(src)
    capsysbinary.readouterr()
    code = main(["slice", str(src), "--end", "100", "-o", str(tmp_path / "alias.pickle")])
    assert code == 2 and "would overwrite the input snapshot" in capsysbinary.readouterr().err.decode()
    assert src.read_bytes() == Path(DEMO).read_bytes()


# --- descriptors of the command's own process: subprocesses ---------------------------------------------------

def _oomdoctor(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oomdoctor", *args], timeout=300, **kw)


@pytest.mark.parametrize("name", ["slice", "report", "diagnose json", "export perfetto"])
def test_a_link_to_proc_self_fd_1_writes_standard_output_and_stays_a_link(name, tmp_path, capsysbinary):
    """The issue's reproduction: ``ln -s /proc/self/fd/1 out; oomdoctor slice SNAPSHOT -o out``."""
    want = reference(name, tmp_path, capsysbinary)
    link = tmp_path / "out"
    link.symlink_to("/proc/self/fd/1")
    into = tmp_path / "stdout.bin"
    with open(into, "wb") as f:
        f.write(b"first line\n")
        f.flush()
        p = _oomdoctor(*argv(name, str(link)), stdout=f, stderr=subprocess.PIPE, text=True)
    assert p.returncode == 0, p.stderr
    assert os.path.islink(link) and os.readlink(link) == "/proc/self/fd/1"
    assert into.read_bytes() == b"first line\n" + want  # written through the descriptor: nothing before is lost
    assert not (tmp_path / "out.meta.json").exists()


def test_report_to_dev_stdout_into_head_exits_0():
    """``oomdoctor report --demo -o /dev/stdout | head -3``: head leaves after 3 lines of a 0.2 MiB page."""
    p = subprocess.run(["bash", "-c", f"'{sys.executable}' -m oomdoctor report --demo -o /dev/stdout | head -3; "
                                      "echo \"exit ${PIPESTATUS[0]}\" >&2"],
                       capture_output=True, text=True, timeout=300)
    assert p.stdout.splitlines()[0] == "<!DOCTYPE html>" and len(p.stdout.splitlines()) == 3
    assert p.stderr.strip().splitlines()[-1] == "exit 0", p.stderr
    assert "Traceback" not in p.stderr and "Error" not in p.stderr, p.stderr


def test_process_substitution_is_a_stream(tmp_path, capsysbinary):
    """``-o >(gzip > x.gz)``: bash hands the command /dev/fd/63, a pipe into gzip."""
    want = reference("export perfetto", tmp_path, capsysbinary)
    gz = tmp_path / "x.gz"
    p = subprocess.run(["bash", "-c", f"'{sys.executable}' -m oomdoctor export '{DEMO}' -j 1 -o >(gzip > '{gz}'); "
                                      "wait $!"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert gzip.decompress(gz.read_bytes()) == want


@pytest.mark.parametrize("name", ["slice", "report"])
def test_a_fifo_read_by_another_process(name, tmp_path, capsysbinary):
    want = reference(name, tmp_path, capsysbinary)
    fifo, into = tmp_path / "fifo", tmp_path / "read.bin"
    os.mkfifo(fifo)
    with open(into, "wb") as f:
        cat = subprocess.Popen(["cat", str(fifo)], stdout=f)
        p = _oomdoctor(*argv(name, str(fifo)), capture_output=True, text=True)
        assert cat.wait(timeout=60) == 0
    assert p.returncode == 0, p.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and into.read_bytes() == want


def test_a_fifo_whose_reader_leaves_ends_quietly(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    head = subprocess.Popen(["head", "-c", "10", str(fifo)], stdout=subprocess.PIPE)
    p = _oomdoctor("report", "--demo", "-j", "1", "-o", str(fifo), capture_output=True, text=True)
    assert head.communicate(timeout=60)[0] == b"<!DOCTYPE "
    assert p.returncode == 0 and p.stderr == "", p.stderr


# --- oomdoctor run --out: a directory -------------------------------------------------------------------------

_WRITE_IN_OUT = ("import json, os; d = json.loads(os.environ['OOMDOCTOR_RUN_CONFIG'])['out']; "
                 "open(os.path.join(d, 'from-the-job.txt'), 'w').write('hi')")


def test_run_follows_a_link_to_a_directory(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    p = _oomdoctor("run", "--out", str(tmp_path / "link"), "--no-diagnose", "--", sys.executable, "-c", _WRITE_IN_OUT,
                   capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "link").is_symlink() and (real / "from-the-job.txt").read_text() == "hi"


def test_run_creates_a_missing_directory_as_before(tmp_path):
    out = tmp_path / "a" / "b"
    p = _oomdoctor("run", "--out", str(out), "--no-diagnose", "--", sys.executable, "-c", _WRITE_IN_OUT,
                   capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert (out / "from-the-job.txt").read_text() == "hi"


def test_run_follows_a_dangling_link_and_creates_its_target(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "made")
    p = _oomdoctor("run", "--out", str(tmp_path / "link"), "--no-diagnose", "--", sys.executable, "-c",
                   _WRITE_IN_OUT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "link").is_symlink() and (tmp_path / "made" / "from-the-job.txt").is_file()


@pytest.mark.parametrize("what", ["fifo", "/dev/null", "file", "-"])
def test_run_refuses_what_is_not_a_directory_with_one_line(what, tmp_path, capsys):
    out = {"fifo": str(tmp_path / "fifo"), "file": str(tmp_path / "f"), "/dev/null": "/dev/null", "-": "-"}[what]
    if what == "fifo":
        os.mkfifo(out)
    elif what == "file":
        Path(out).write_text("keep")
    code = main(["run", "--out", out, "--", "true"])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("oomdoctor: error: "), err
    assert ("standard output cannot hold" in err) if what == "-" else ("exists and is not a directory" in err)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    if what == "fifo":
        assert stat.S_ISFIFO(os.lstat(out).st_mode)
    if what == "file":
        assert Path(out).read_text() == "keep"
    assert not Path("-").exists()


# --- the helper itself ----------------------------------------------------------------------------------------

def test_resolve_target_names_this_process_descriptors():
    assert resolve_target("/dev/stdout")[1] == 1
    assert resolve_target("/dev/fd/2")[1] == 2
    assert resolve_target("/proc/self/fd/0") == (f"/proc/{os.getpid()}/fd/0", 0)
    assert resolve_target("/dev/null") == ("/dev/null", None)
    assert target_kind("/dev/null") == target_kind("/dev/stdout") == STREAM


def test_write_target_kinds_and_loops(tmp_path):
    assert write_target(str(tmp_path / "new"), b"x") == FILE and (tmp_path / "new").read_bytes() == b"x"
    assert write_target("/dev/null", b"x") == STREAM
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    with pytest.raises(OSError, match="symbolic links"):
        write_target(str(tmp_path / "loop1"), b"x")
    with pytest.raises(OutputError, match="is a directory"):
        write_target(str(tmp_path), b"x")


def test_a_new_file_honours_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        write_target(str(tmp_path / "n"), b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "n").stat().st_mode) == 0o640


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes any file")
def test_a_read_only_file_is_refused_and_kept(tmp_path):
    p = tmp_path / "ro"
    p.write_bytes(b"keep")
    p.chmod(0o444)
    with pytest.raises(OutputError, match="permission denied"):
        write_target(str(p), b"new")
    assert p.read_bytes() == b"keep"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in any directory")
def test_a_writable_file_in_a_closed_directory_is_written_in_place(tmp_path):
    d = tmp_path / "closed"
    d.mkdir()
    (d / "f").write_bytes(b"old")
    d.chmod(0o555)
    try:
        assert write_target(str(d / "f"), b"new") == FILE
        assert (d / "f").read_bytes() == b"new"
    finally:
        d.chmod(0o755)


# --- the reader of standard output gone before the first write -----------------------------------------------

@pytest.mark.parametrize("out", ["-", "/dev/stdout"])
@pytest.mark.parametrize("name", ["report", "slice", "diagnose json", "simulate text", "plan search text", "schema"])
def test_a_closed_standard_output_is_exit_0_and_quiet(name, out, tmp_path):
    """As ``tests/unit/test_pipes.py`` for the outputs without -o: the pipe's read end closed before the start."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = _oomdoctor(*argv(name, out), stdout=w, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    finally:
        os.close(w)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr and "error" not in p.stderr, p.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_descriptor_of_another_process_is_opened_by_name_and_truncated_if_a_file(tmp_path):
    f = tmp_path / "theirs.txt"
    f.write_bytes(b"a longer old content\n")
    with open(f, "r+b") as held:
        other = subprocess.Popen(["sleep", "30"], stdout=held)
    try:
        name = f"/proc/{other.pid}/fd/1"
        assert resolve_target(name) == (name, -1)
        assert write_target(name, b"new\n") == STREAM
    finally:
        other.kill()
        other.wait()
    assert f.read_bytes() == b"new\n" and not f.is_symlink()


#: the commands that run a job or trace a script before they write (issue 53 item 4): their -o is refused as every
#: command's is, and at once, before any trial or trace runs (the job would have written RAN)
LONG = {
    "fit": ["fit", "--allow-no-gpu", "--", sys.executable, "-c", "open('RAN','w') # {mb}"],
    "verify": ["verify", "--allow-no-gpu", "--", sys.executable, "-c", "open('RAN','w')"],
    "tune": ["tune", "--no-run", "--", sys.executable, "-c", "open('RAN','w') # {mb}"],
    "preflight": ["preflight", "--", sys.executable, "ran.py"],
    "preflight answer": ["preflight", "--", sys.executable, "ran.py"],
}
#: the option of LONG's output, where it is not -o
LONG_OPTION = {"preflight answer": "--report-output"}


def _run_long(name: str, out: str, tmp_path, capsysbinary, monkeypatch) -> tuple[int, bytes, str]:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ran.py").write_text("open('RAN', 'w')\n")
    args = LONG[name]
    code = main([args[0], LONG_OPTION.get(name, "-o"), out, *args[1:]])
    cap = capsysbinary.readouterr()
    assert not (tmp_path / "RAN").exists(), "the job ran before -o was checked"
    return code, cap.out, cap.err.decode()


@pytest.mark.parametrize("name", list(LONG))
def test_a_long_command_refuses_a_directory_before_it_runs(name, tmp_path, capsysbinary, monkeypatch):
    d = tmp_path / "adir"
    d.mkdir()
    code, stdout, err = _run_long(name, str(d), tmp_path, capsysbinary, monkeypatch)
    assert code == 2 and stdout == b""
    assert err.strip().splitlines() == [f"oomdoctor: error: {d}: is a directory; give a file name"]


@pytest.mark.parametrize("name", list(LONG))
def test_a_long_command_refuses_a_missing_directory_before_it_runs(name, tmp_path, capsysbinary, monkeypatch):
    out = tmp_path / "no" / "x.out"
    code, stdout, err = _run_long(name, str(out), tmp_path, capsysbinary, monkeypatch)
    assert code == 2 and stdout == b""
    assert err.strip().splitlines() == [f"oomdoctor: error: {out}: the directory {out.parent} does not exist; "
                                        "create it first"]


@pytest.mark.parametrize("report", [None, "-"])
def test_preflight_refuses_its_snapshot_and_its_answer_both_on_standard_output(report, tmp_path, capsysbinary,
                                                                              monkeypatch):
    """``preflight -o -``: the snapshot on standard output needs the answer elsewhere (``--report-output FILE``)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ran.py").write_text("open('RAN', 'w')\n")
    code = main(["preflight", "-o", "-", *(["--report-output", report] if report else []), "--", sys.executable,
                 "ran.py"])
    cap = capsysbinary.readouterr()
    assert code == 2 and cap.out == b"" and not (tmp_path / "RAN").exists()
    assert cap.err.decode().strip().splitlines() == [
        "oomdoctor: error: preflight -o -: the answer goes to standard output; give a file for the snapshot, or "
        "--report-output FILE for the answer"]
