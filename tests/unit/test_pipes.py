"""Every command exits 0 when the reader of its standard output goes away (``oomdoctor ... | head -1``).

The pipe's read end is closed before the command starts, so its first write fails with EPIPE every time
(a real ``head`` races the writer). Before the fix rich's console and click's ``main`` both turned that into
exit code 1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from oomdoctor.cli.diagnose import demo_path

DEMO = demo_path()


def _closed_pipe_run(args: list[str], cwd: str | None = None) -> subprocess.CompletedProcess:
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "oomdoctor", *args], stdout=w, stderr=subprocess.PIPE,
                              text=True, cwd=cwd, timeout=300)
    finally:
        os.close(w)


COMMANDS = {
    "diagnose text": ["diagnose", "--demo"],
    "diagnose json": ["diagnose", "--demo", "--format", "json"],
    "diagnose html": ["diagnose", "--demo", "--format", "html"],
    "simulate": ["simulate", DEMO],
    "diff text": ["diff", DEMO, DEMO],
    "diff json": ["diff", DEMO, DEMO, "--format", "json"],
    "export perfetto": ["export", DEMO],
    "export folded": ["export", DEMO, "--format", "folded"],
    "plan estimate": ["plan", "estimate", "--model", "llama3-8b", "--gpus", "8"],
    "plan search": ["plan", "search", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-80gb"],
    "help": ["--help"],
    "command help": ["diagnose", "--help"],
    "version": ["--version"],
    "schema": ["schema", "diagnose"],
}


@pytest.mark.parametrize("args", list(COMMANDS.values()), ids=list(COMMANDS))
def test_a_closed_pipe_is_exit_0_and_nothing_on_stderr(args):
    p = _closed_pipe_run(args)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr


def test_slice_and_report_write_their_file_and_exit_0_with_stdout_closed(tmp_path):
    out = tmp_path / "window.pickle"
    p = _closed_pipe_run(["slice", DEMO, "--by", "event", "--start", "0", "--end", "100", "-o", str(out)])
    assert p.returncode == 0, p.stderr
    assert out.stat().st_size > 0
    page = tmp_path / "r.html"
    p = _closed_pipe_run(["report", DEMO, "-o", str(page)])
    assert p.returncode == 0, p.stderr
    assert page.stat().st_size > 0


def test_an_open_pipe_still_gets_everything():
    """The watch on standard output changes nothing when the reader stays."""
    full = subprocess.run([sys.executable, "-m", "oomdoctor", "diagnose", "--demo", "--format", "json"],
                          capture_output=True, text=True, check=True).stdout
    assert full.rstrip().endswith("}") and '"verdict"' in full


def test_a_real_error_is_still_an_error_with_stdout_closed(tmp_path):
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"not a pickle")
    p = _closed_pipe_run(["diagnose", str(bad)])
    assert p.returncode == 2 and "bad.pickle" in p.stderr
