"""Rank discovery, sidecars, and the CLI's contract: exit codes, one-line errors, JSON keys."""

import json
import pickle

import pytest
from builder import MiB, SnapBuilder

from oomdoctor import SnapshotError
from oomdoctor.cli.main import main
from oomdoctor.trace import discover, load, load_ranks, rank_from_name


@pytest.mark.parametrize("name, rank", [
    ("rank3.pickle", 3), ("rank_3.pickle", 3), ("rank-12_oom.pickle", 12), ("snapshot_oom_rank-5.pickle", 5),
    ("000007_step_20.pickle", 7), ("snapshot_4.pickle", 4), ("rank2.100.memory_snapshot.pickle", 2),
    ("legacy-rank1.pickle.xz", 1), ("memory.pickle", None), ("20240101_run.pickle", None),
])
def test_rank_from_name(name, rank):
    assert rank_from_name(name) == rank


def snap(tmp_path, name, size=4 * MiB):
    b = SnapBuilder()
    s = b.segment(64 * MiB)
    b.alloc(s, 0, size)
    return b.write(tmp_path / name)


def test_directory_is_ranks_sorted_and_sidecar_wins(tmp_path):
    snap(tmp_path, "rank1.pickle")
    snap(tmp_path, "rank0.pickle")
    snap(tmp_path, "x.pickle")
    (tmp_path / "x.meta.json").write_text(json.dumps({"rank": 5, "world_size": 6, "torch_version": "2.7.1"}))
    (tmp_path / "notes.txt").write_text("hi")
    traces = load_ranks([tmp_path])
    assert [t.rank for t in traces] == [0, 1, 5]
    assert traces[2].meta["world_size"] == 6
    assert discover([tmp_path]) == sorted(str(p) for p in tmp_path.glob("*.pickle"))


def test_two_files_claiming_one_rank(tmp_path):
    snap(tmp_path, "a-rank0.pickle")
    snap(tmp_path, "b-rank0.pickle")
    with pytest.raises(SnapshotError, match="claims rank 0"):
        load_ranks([tmp_path])


def test_bad_sidecar_is_named(tmp_path):
    p = snap(tmp_path, "rank0.pickle")
    (tmp_path / "rank0.meta.json").write_text("{not json")
    with pytest.raises(SnapshotError, match="rank0.meta.json: sidecar metadata is not valid JSON"):
        load(p)


def test_empty_directory(tmp_path):
    with pytest.raises(SnapshotError, match="holds no snapshot files"):
        load_ranks([tmp_path])


def test_cli_demo_json_contract(capsys):
    assert main(["diagnose", "--demo", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (r,) = out["ranks"]
    assert {"rank", "path", "peak_allocated_bytes", "peak_reserved_bytes", "oom"} <= set(r)
    assert r["peak_reserved_bytes"] == 3053453312 and r["oom"] is None
    (f,) = out["findings"]
    assert f["id"] == "deferred-free"
    assert {"id", "severity", "title", "ranks", "bytes", "evidence", "fixes"} <= set(f)
    assert all("text" in fx for fx in f["fixes"])
    assert "{" not in f["summary"]  # templates were filled


def test_cli_text_to_file(tmp_path, capsys):
    out = tmp_path / "report.txt"
    assert main(["diagnose", "--demo", "-o", str(out)]) == 0
    text = out.read_text()
    assert "deferred-free" in text and "TORCH_NCCL_AVOID_RECORD_STREAMS=1" in text
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("content", [b"", b"\x80\x04garbage", pickle.dumps({"segments": []})[:-3], b"\x00" * 64])
def test_cli_bad_input_one_line_exit_2(tmp_path, capsys, content):
    p = tmp_path / "rank0.pickle"
    p.write_bytes(content)
    assert main(["diagnose", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(p) in err and "Traceback" not in err


def test_cli_malicious_and_missing(tmp_path, capsys):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    p = tmp_path / "evil.pickle"
    p.write_bytes(pickle.dumps(Evil()))
    assert main(["diagnose", str(p)]) == 2
    captured = capsys.readouterr()
    assert "pwned" not in captured.out and "refused to unpickle global 'builtins.print'" in captured.err
    assert main(["diagnose", str(tmp_path / "missing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert main(["diagnose"]) == 2
    assert "no snapshot given" in capsys.readouterr().err


def test_cli_usage_error(capsys):
    assert main(["diagnose", "--format", "xml", "--demo"]) == 2
    assert main(["--version"]) == 0


def test_cli_unwritable_output(tmp_path, capsys):
    target = tmp_path / "no" / "such" / "dir" / "report.txt"
    assert main(["diagnose", "--demo", "-o", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"{target}: the directory {target.parent} does not exist" in err and err.count("\n") == 1


def test_cli_start_up_imports_no_command(tmp_path):
    """`oomdoctor --help` loads no command module, numpy, rich or jinja2 (start-up time: benchmarks/
    bench_startup.py); `import oomdoctor` loads no numpy either."""
    import subprocess
    import sys
    code = ("import sys; from oomdoctor.cli.main import main; rc = main(['--help']); "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'rich', 'jinja2') "
            "or m.startswith(('oomdoctor.cli.diagnose', 'oomdoctor.trace', 'oomdoctor.analysis'))); "
            "print(rc, heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "0 []"
    out = subprocess.run([sys.executable, "-c", "import sys, oomdoctor; print('numpy' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_every_lazy_command_is_the_command_it_names():
    import click

    from oomdoctor.cli.main import COMMANDS, cli
    ctx = click.Context(cli)
    for name in COMMANDS:
        assert cli.get_command(ctx, name).name == name
    assert cli.get_command(ctx, "nope") is None


def test_lazy_package_names_resolve_once_and_unknown_ones_raise():
    import oomdoctor
    import oomdoctor.report as report
    from oomdoctor.report.pipeline import build_report
    assert report.build_report is build_report and "build_report" in vars(report)  # cached in the package
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        oomdoctor.nope  # noqa: B018
