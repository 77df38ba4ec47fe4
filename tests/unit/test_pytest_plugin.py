"""The pytest plugin on CPU (loaded through its ``pytest11`` entry point): marker parsing, the skip without CUDA, the report option, the failure
message built from a real snapshot. Over and under a limit on a GPU: tests/gpu/test_integrations_gpu.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from oomdoctor.pytest_plugin import Usage, _holders, failure_message, parse_marker

GiB = 1 << 30


def _no_cuda():
    try:
        import torch
        return not torch.cuda.is_available()
    except ImportError:
        return True


class Marker:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


@pytest.mark.parametrize("args,kwargs,want", [
    (("2 GiB",), {}, (2 * GiB, "allocated", None)),
    ((1500,), {"measure": "reserved", "device": 1}, (1500, "reserved", 1)),
    (("500MB",), {}, (500 * 10**6, "allocated", None)),
])
def test_parse_marker(args, kwargs, want):
    assert parse_marker(Marker(*args, **kwargs)) == want


@pytest.mark.parametrize("args,kwargs,match", [
    ((), {}, "takes one limit"),
    (("lots",), {}, "cannot read 'lots' as a size"),
    (("0 GiB",), {}, "must be positive"),
    (("1 GiB",), {"measure": "active"}, "measure='active'"),
    (("1 GiB",), {"per_rank": True}, "unknown option"),
])
def test_parse_marker_rejects(args, kwargs, match):
    with pytest.raises(pytest.UsageError, match=match):
        parse_marker(Marker(*args, **kwargs))


@pytest.mark.skipif(not _no_cuda(), reason="checks the behaviour without a GPU")
def test_a_marked_test_is_skipped_without_cuda(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.limit_cuda_memory("1 GiB")
        def test_big():
            raise AssertionError("must not run")

        def test_plain():
            pass
    """)
    res = pytester.runpytest("-rs", "--cuda-memory-report")
    res.assert_outcomes(passed=1, skipped=1)
    res.stdout.fnmatch_lines(["*CUDA memory per test (oomdoctor)*", "no test ran with CUDA initialised",
                              "*limit_cuda_memory: no CUDA device*"])


def test_a_bad_limit_is_reported_as_a_usage_error(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.limit_cuda_memory("lots")
        def test_big():
            pass
    """)
    res = pytester.runpytest()
    assert res.ret != 0
    res.stdout.fnmatch_lines(["*cannot read 'lots' as a size*"])


def test_the_marker_is_registered(pytester):
    res = pytester.runpytest("--markers")
    res.stdout.fnmatch_lines(["@pytest.mark.limit_cuda_memory(limit, *, measure='allocated', device=None)*"])


def test_the_failure_names_the_holders_at_the_peak_and_the_snapshot(snapshots):
    path = str(snapshots / "tp-allreduce" / "legacy-rank0.pickle")
    u = Usage("t.py::test_x", 0, 256 << 20, 256 << 20, (256 << 20) + 3 * GiB // 2, 2 * GiB, limit=GiB)
    assert u.used == 3 * GiB // 2 and u.exceeded
    u.snapshot, u.holders = path, _holders(path)
    msg = failure_message(u)
    lines = msg.splitlines()
    assert lines[0].startswith("limit_cuda_memory: the test's peak allocated CUDA memory on cuda:0 exceeds its limit: "
                               "1.50 GiB > 1.00 GiB (peak 1.75 GiB less 256.00 MiB held when the test began)")
    assert lines[1].startswith("at the peak of ")
    assert lines[2] == "largest holders:" and any(".py:" in x for x in lines[3:-1])
    assert lines[-1] == f"snapshot: {path} (oomdoctor diagnose {path}; opens in pytorch.org/memory_viz)"
    reserved = Usage("t", 0, 0, GiB, 0, 2 * GiB, measure="reserved", limit=GiB)
    assert reserved.used == GiB and not reserved.exceeded


def test_loading_the_plugin_imports_no_torch():
    code = "import sys, oomdoctor.pytest_plugin; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
