"""``torch.backends.cudnn.benchmark`` in a traced job: cuDNN's autotuner sizes its workspace at run time (up to the
free memory, halved until it fits: ``aten/src/ATen/native/cudnn/Conv_v8.cpp``), so the trace cannot; it says so,
by the note ``cudnn_benchmark``, when a convolution runs with the flag on. Measured on the corpus's H200 runs
(``docs/preflight.md``): DCGAN's peak was 3.05x the traced one, torchvision's ResNet-50 2.50x."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from oomdoctor.preflight.tracer import run_traced  # noqa: E402
from oomdoctor.render.preflight import NOT_TRACED_TEXT  # noqa: E402


def _conv_step(tr) -> None:
    conv = torch.nn.Conv2d(3, 8, 3)
    conv(torch.randn(2, 3, 16, 16)).sum().backward()


@pytest.mark.parametrize("benchmark", [True, False])
def test_a_convolution_under_cudnn_benchmark_is_noted(benchmark):
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = benchmark
    try:
        rec = run_traced(_conv_step)
    finally:
        torch.backends.cudnn.benchmark = before
    assert ("cudnn_benchmark" in rec.notes) is benchmark
    assert rec.notes.count("cudnn_benchmark") <= 1


def test_the_note_has_words():
    assert "autotuner" in NOT_TRACED_TEXT["cudnn_benchmark"]
