"""CLI messages that agreed with nothing, or cut themselves short (issue 37's list): each fixed, each checked here."""

from __future__ import annotations

import json
import pickle

from oomdoctor.cli.main import main


def test_a_directory_of_broken_files_names_every_one_on_one_line(tmp_path, capsys):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "rank0.pickle").write_bytes(b"")
    (d / "rank1.pickle").write_bytes(b"\x80\x04garbage")
    (d / "rank2.pickle").write_bytes(pickle.dumps({"segments": []})[:-3])  # cut before its STOP
    (d / "rank3.pickle").write_bytes(pickle.dumps([1, 2, 3]))
    assert main(["diagnose", str(d)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "none of the 4 files in this directory is a snapshot that loads" in err
    for i in range(4):
        assert f"rank{i}.pickle: " in err
    assert "is empty" in err and "truncated" in err and err.count(" | ") == 3  # one file from the next


def test_all_ranks_help_says_the_rank_count_the_text_groups_above(capsys):
    from oomdoctor.render.text import GROUPED_RANKS

    assert main(["diagnose", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"above {GROUPED_RANKS} ranks, alike ranks are grouped" in out and GROUPED_RANKS == 4


def test_plan_help_lists_its_commands_uncut(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    listed = out.split("Commands:")[1].splitlines()
    assert len([x for x in listed if x.strip()]) == 3 and all("..." not in x and len(x) <= 80 for x in listed)


def test_plan_search_names_one_allocator_variable_and_prints_gib(capsys, monkeypatch):
    from oomdoctor.plan.search import alloc_conf_env

    monkeypatch.setenv("COLUMNS", "200")
    assert main(["plan", "search", "--model", "llama3-8b", "--gpus", "16", "--seq", "8192", "--gbs", "64",
                 "--sharding", "fsdp", "--framework", "torch"]) == 0
    out = capsys.readouterr().out
    env = alloc_conf_env()
    other = {"PYTORCH_ALLOC_CONF": "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF": "PYTORCH_ALLOC_CONF"}[env]
    assert out.count(f"{env}=expandable_segments:True") == 2 and other not in out
    assert " GB" not in out and "GiB = 2^30 bytes" in out and "96.9 GiB" in out


def test_the_allocator_variable_follows_the_installed_torch(monkeypatch):
    from importlib import metadata

    from oomdoctor.plan.search import alloc_conf_env

    for version, name in (("2.8.1", "PYTORCH_CUDA_ALLOC_CONF"), ("2.9.0", "PYTORCH_ALLOC_CONF"),
                          ("2.13.0+cpu", "PYTORCH_ALLOC_CONF"), (None, "PYTORCH_CUDA_ALLOC_CONF")):
        def fake(dist, v=version):
            if v is None:
                raise metadata.PackageNotFoundError(dist)
            return v
        monkeypatch.setattr(metadata, "version", fake)
        assert alloc_conf_env() == name, version


def _one_gpu_run(path, size_mib: int):
    from builder import SnapBuilder

    from oomdoctor.units import MiB

    b = SnapBuilder()
    s = b.segment(64 * MiB)
    x = b.alloc(s, 0, size_mib * MiB)
    b.free(x)
    return b.write(path)


def test_a_directory_of_unrelated_snapshots_naming_no_rank_is_refused(tmp_path, capsys):
    d = tmp_path / "two-jobs"
    d.mkdir()
    a, b = _one_gpu_run(d / "bert.pickle", 8), _one_gpu_run(d / "resnet.pickle", 32)
    for argv in (["diagnose", str(d)], ["diagnose", "--jobs", "1", "--format", "json", str(d)]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert "2 snapshots here give no rank" in err and "bert.pickle, resnet.pickle" in err
    # the same files named one by one are the user's own grouping: numbered in path order, each with a warning
    assert main(["diagnose", "--format", "json", str(a), str(b)]) == 0
    assert [r["rank"] for r in json.loads(capsys.readouterr().out)["ranks"]] == [0, 1]
    # and a directory whose files name their ranks is read as ranks
    (d / "bert.pickle").rename(d / "rank0.pickle")
    (d / "resnet.pickle").rename(d / "rank1.pickle")
    assert main(["diagnose", "--format", "json", str(d)]) == 0
    assert [r["rank"] for r in json.loads(capsys.readouterr().out)["ranks"]] == [0, 1]


def test_the_library_refuses_the_same_directory(tmp_path):
    import pytest

    from oomdoctor.errors import SnapshotError
    from oomdoctor.trace import load_ranks

    d = tmp_path / "two-jobs"
    d.mkdir()
    _one_gpu_run(d / "a.pickle", 8)
    _one_gpu_run(d / "b.pickle", 16)
    with pytest.raises(SnapshotError, match="2 snapshots here give no rank"):
        load_ranks([str(d)], skipped=[])
