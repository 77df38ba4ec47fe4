"""The autograd engine's gradient accumulation, as a GPU runs it: in place (``input_buffer.cpp`` ``accumulate``,
``can_accumulate_inplace``). Under any dispatch mode, preflight's tracer included, the engine adds out of place
(``isTensorSubclassLike``), so before, each accumulation allocated a gradient-sized tensor a GPU never makes:
minGPT's GELU made 11 such tensors per block in the trace where the H200 made 9 (``docs/preflight.md``, "Round 15")."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from oomdoctor.preflight.tracer import run_traced  # noqa: E402

SHAPE = (64, 9, 96)
N = math.prod(SHAPE) * 4


def _gelu(x):
    """minGPT's NewGELU: ``x`` is used three times, so its gradient is accumulated twice."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _backward_allocs(f) -> list[int]:
    def fn(tr):
        x = torch.randn(*SHAPE, requires_grad=True)
        y = f(x * 1.0)
        y.backward(torch.ones_like(y))

    rec = run_traced(fn)
    return [e["size"] for e in rec.events if e["action"] == "alloc" and not e["frames"]]


def test_without_a_mode_the_engine_accumulates_in_place():
    """The fact the model rests on, on this machine's CPU: no dispatch mode, ``aten::add_`` twice."""
    from torch.profiler import profile

    x = torch.randn(*SHAPE, requires_grad=True)
    y = _gelu(x * 1.0)
    with profile() as p:
        y.backward(torch.ones_like(y))
    adds = [e.name for e in p.events() if e.name in ("aten::add", "aten::add_")]
    assert adds == ["aten::add_", "aten::add_"]


def test_accumulations_allocate_nothing_in_the_trace():
    """GELU's backward: 3 muls of the product rule and constant factors, tanh's backward, 2 constant factors, pow's
    backward (pow, mul by 3, mul by the gradient) and ``x * 1.0``'s: 10 gradient-sized tensors; the two accumulations
    none (12 before)."""
    assert _backward_allocs(_gelu).count(N) == 10


def test_a_residual_connection_accumulates_into_one_of_its_gradients():
    """``f(x) + x``: AddBackward hands one gradient to both branches; the branch's gradient and it are summed in
    place: no tensor beyond sin's backward (``x.cos()``, then its product with the gradient) and ``x * 1.0``'s (4
    before)."""
    assert _backward_allocs(lambda x: torch.sin(x) + x).count(N) == 3


def test_create_graph_keeps_the_out_of_place_add():
    """With ``create_graph`` grad mode is on during backward and the engine adds out of place, as traced."""
    def fn(tr):
        x = torch.randn(*SHAPE, requires_grad=True)
        y = _gelu(x * 1.0)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return g

    rec = run_traced(fn)
    assert rec.events  # it runs: no in-place add on a tensor the double-backward graph saved
