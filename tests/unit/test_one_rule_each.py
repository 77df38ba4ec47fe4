"""Rules that had copies (issue 53 item 7) now have one definition each; their callers agree with it."""

from __future__ import annotations

import pytest

from oomdoctor.errors import UsageError
from oomdoctor.plan.gpus import GPUS, gpu_by_name, resolve_gpu
from oomdoctor.plan.terms import CUDA_CONTEXT_BYTES, NCCL_FIRST_COMMUNICATOR_BYTES, outside_allocator_bytes
from oomdoctor.report.pairing import pair_by_rank


def test_ranks_pair_by_number_and_a_rank_in_one_run_only_is_noted():
    before = [(0, "b0"), (1, "b1"), (3, "b3")]
    after = [(2, "a2"), (1, "a1"), (0, "a0")]
    pairs, notes = pair_by_rank(before, after, lambda x: x[0], lambda x: x[1])
    assert pairs == [((0, "b0"), (0, "a0")), ((1, "b1"), (1, "a1"))]
    assert notes == ["rank 3 is only in the before run (b3)", "rank 2 is only in the after run (a2)"]


def test_one_file_a_side_pairs_whatever_the_ranks():
    assert pair_by_rank([(0, "b")], [(5, "a")], lambda x: x[0], lambda x: x[1]) == ([((0, "b"), (5, "a"))], [])


def test_the_memory_outside_the_allocator_has_nccl_only_with_several_ranks():
    assert outside_allocator_bytes(1) == CUDA_CONTEXT_BYTES == 740 * 10**6
    assert outside_allocator_bytes(2) == outside_allocator_bytes(512) == CUDA_CONTEXT_BYTES + NCCL_FIRST_COMMUNICATOR_BYTES


def test_a_gpu_by_name_by_size_or_the_default():
    assert resolve_gpu(None) == ("H100-80GB", 81559 * 2**20, 9)
    assert resolve_gpu("h200") == ("H200", int(139.8 * 2**30), 9)
    assert resolve_gpu("a100-40gb")[1:] == (40960 * 2**20, 8)
    assert resolve_gpu(None, "80GiB") == (None, 80 * 2**30, 9)
    assert resolve_gpu(12345) == (None, 12345, 9)
    assert resolve_gpu("24GiB") == (None, 24 * 2**30, 9)  # a size where no GPU has the name
    assert gpu_by_name("B200").sm_major == 10 and set(GPUS) == {"H100-80GB", "H200", "A100-80GB", "A100-40GB", "B200"}


@pytest.mark.parametrize("gpu, memory, words", [
    ("H200", "80GiB", "give --gpu or --gpu-memory, not both"),
    ("V100", None, "--gpu 'V100': neither a known GPU"),
    (None, "lots", "--gpu-memory 'lots': not a size"),
])
def test_a_bad_gpu_is_one_line_naming_the_option(gpu, memory, words):
    with pytest.raises(UsageError) as e:
        resolve_gpu(gpu, memory)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_planner_and_preflight_read_the_same_table():
    from oomdoctor.cli.plan import GPUS as plan_gpus
    from oomdoctor.plan.terms import CUBLAS_WORKSPACE_BYTES
    from oomdoctor.preflight.snapshot import GPUS as preflight_gpus
    from oomdoctor.preflight.snapshot import cublas_workspace_bytes

    assert plan_gpus is preflight_gpus is GPUS
    assert cublas_workspace_bytes(9) == CUBLAS_WORKSPACE_BYTES == 32 << 20  # the planner's and the tracer's
