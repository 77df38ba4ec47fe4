"""``diagnose --gpu-memory``: the GPU's size for a snapshot that does not say it (a plain
``_record_memory_history`` recording with no OOM), and never over a size the snapshot gives."""

from __future__ import annotations

import json

from builder import MiB, SnapBuilder

from oomdoctor.cli.main import main
from oomdoctor.plan.terms import CUDA_CONTEXT_BYTES


def snapshot(tmp_path, sidecar: dict | None = None) -> str:
    b = SnapBuilder()
    s = b.segment(64 * MiB)
    for i in range(4):
        b.alloc(s, i * 8 * MiB, 8 * MiB)
    path = b.write(tmp_path / "rank0.pickle")
    if sidecar is not None:
        (tmp_path / "rank0.meta.json").write_text(json.dumps(sidecar))
    return str(path)


def fits_of(args, capsys) -> dict:
    assert main(["diagnose", "--format", "json", *args]) == 0
    return json.loads(capsys.readouterr().out)["ranks"][0]["fits"]


def test_without_the_size_the_room_is_unknown_and_with_it_the_room_is_it_less_the_context(tmp_path, capsys):
    path = snapshot(tmp_path)
    assert fits_of([path], capsys)["room_bytes"] is None
    f = fits_of(["--gpu-memory", "80GiB", path], capsys)
    assert f["room_bytes"] == 80 * 1024 * MiB - CUDA_CONTEXT_BYTES
    assert "given with --gpu-memory" in f["room_source"]


def test_a_size_the_sidecar_gives_wins(tmp_path, capsys):
    path = snapshot(tmp_path, {"gpu_total_memory_bytes": 40 * 1024 * MiB})
    f = fits_of(["--gpu-memory", "80GiB", path], capsys)
    assert f["room_bytes"] == 40 * 1024 * MiB - CUDA_CONTEXT_BYTES and "--gpu-memory" not in f["room_source"]


def test_a_size_that_does_not_read_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["diagnose", "--gpu-memory", "12XB", snapshot(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot read '12XB' as a size" in err and len(err.strip().splitlines()) == 1
