"""Which frameworks a trace uses: frames of code that ran, never of a module being imported."""

from __future__ import annotations

from builder import stack_table

from oomdoctor.frameworks import detect_frameworks, running_files
from oomdoctor.trace.model import StackTable

GEN = "/venv/lib/python3.12/site-packages/transformers/generation/utils.py"
BOOT = "<frozen importlib._bootstrap>"
TRAIN = "/job/train.py"


def table(*stacks: list[tuple[str, int, str]]) -> StackTable:
    return stack_table(*stacks)[0]


def ids(t: StackTable) -> list[str]:
    return [fw.id for fw in detect_frameworks(running_files(t))]


def test_a_module_imported_is_no_framework_used():
    # torch.compile imports transformers.generation while it loads; the garbage collector frees a block meanwhile
    # (new-kinds-compiled-step: the only generation frames are such a free's)
    t = table([(GEN, 1, "<module>"), (BOOT, 1360, "_find_and_load"), (TRAIN, 3, "<module>")],
              [(TRAIN, 10, "step")])
    assert running_files(t) == {TRAIN}
    assert "generate" not in ids(t)


def test_generate_called_is_detected():
    t = table([(GEN, 2000, "generate"), (TRAIN, 12, "main")],
              [(GEN, 1, "<module>"), (BOOT, 1360, "_find_and_load"), (TRAIN, 3, "<module>")])
    assert running_files(t) == {GEN, TRAIN}
    assert "generate" in ids(t)


def test_a_frame_seen_in_an_import_and_in_a_run_counts():
    t = table([(GEN, 5, "f"), (BOOT, 1360, "_find_and_load")], [(GEN, 5, "f"), (TRAIN, 1, "main")])
    assert "generate" in ids(t)


def test_a_cpp_only_stack_is_named_by_its_autograd_node_never_by_the_unwinder():
    from oomdoctor.analysis.sites import SiteIndex

    unwind = ("??", 0, "torch::unwind::unwind()")
    alloc = ("CUDACachingAllocator.cpp", 0, "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc")
    op = ("??", 0, "at::_ops::nll_loss_backward::call(at::Tensor const&)")
    node = ("Functions.cpp", 0, "torch::autograd::generated::NllLossBackward0::apply(std::vector<at::Tensor>&&)")
    entry = ("engine.cpp", 0, "torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)")
    t = table([unwind, alloc, op, node, entry], [unwind, alloc, op, entry], [unwind, alloc, entry])
    idx = SiteIndex(t)
    assert [t.frames[idx.site(s)] for s in range(3)] == [node, op, entry]
    py = table([unwind, ("/venv/lib/python3.12/site-packages/torch/nn/functional.py", 3, "linear"), entry])
    assert py.frames[SiteIndex(py).site(0)][0].endswith("functional.py")  # a Python frame still wins
