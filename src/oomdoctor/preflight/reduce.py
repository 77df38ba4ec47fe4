"""The global-memory staging buffers of CUDA's reductions (``sum``, ``mean``): what
``aten/src/ATen/native/cuda/Reduce.cuh`` allocates from the caching allocator when it splits a reduction's input
across thread blocks.

``gpu_reduce_kernel`` asks ``setReduceConfig`` for a launch configuration; when it splits the input across
blocks (``should_global_reduce``), it allocates ``global_memory_size()`` bytes of partial results and
``semaphore_size()`` bytes of counters, and frees both when it returns. A linear layer's bias gradient is such a
reduction (``grad.sum(0)`` over the batch's rows): on an H200, ViT-S/16 at batch 64 allocated 116,195,328 B and
36 B for its qkv layer's bias (1152 columns), 138,412,032 B and 48 B for fc1's (1536), 38,731,776 B and 12 B for
proj's and fc2's (384), in every block's backward (``docs/preflight.md``, "Round 15"); :func:`staging_bytes`
gives exactly these.

:func:`staging_bytes` follows ``setReduceConfig`` (the version with ``output_vec_size`` and input vectorization,
torch 2.x) for a contiguous input: ``TensorIterator`` drops size-1 dimensions, coalesces adjacent dimensions that
are both reduced or both kept, and puts the reduced ones first (``reorder_dimensions``); then the block shape, the
split across lanes, warps and blocks, and the two sizes. Inputs that are not contiguous are left out (an empty
list): their iterator's order depends on the strides in ways not modelled.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .target import current

#: ``mnt_wrapper<T>::MAX_NUM_THREADS`` (512; 256 for complex double, not traced)
MAX_NUM_THREADS = 512
WARP_SIZE = 32
#: ``setReduceConfig``'s bounds on the values one thread sums
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256
#: ``gpu_reduce_kernel``'s default ``vt0`` and ``input_vec_size`` (``sum_functor``, ``mean`` use the defaults)
VT0 = 4
INPUT_VEC_SIZE = VT0


def _div_up(a: int, b: int) -> int:
    return (a + b - 1) // b


def _last_pow2(n: int) -> int:
    """``last_pow2``: the largest power of two at most ``n`` (at least 1)."""
    return max(1, 1 << (max(n, 1).bit_length() - 1))


def _acc_bytes(dtype: torch.dtype) -> int | None:
    """``sizeof(arg_t)``: the accumulator of a floating sum or mean (``opmath_type``)."""
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return 4
    if dtype == torch.float64:
        return 8
    return None


def staging_bytes(x: torch.Tensor, dims: Sequence[int] | int | None) -> list[int]:
    """``[partial results, semaphores]`` in bytes that CUDA's reduction of ``x`` over ``dims`` (None or empty: all)
    allocates and frees, or ``[]`` when it reduces within blocks (or for a case not modelled: a non-contiguous or
    non-floating input). The GPU's SM count is the trace's target (:mod:`.target`)."""
    acc = _acc_bytes(x.dtype)
    if acc is None or x.numel() == 0 or not x.is_contiguous():
        return []
    nd = x.dim()
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        reduced = set(range(nd))
    else:
        reduced = {d % nd for d in ([dims] if isinstance(dims, int) else dims)} if nd else set()
    # TensorIterator: size-1 dimensions dropped, runs of reduced or kept dimensions coalesced (contiguous input)
    groups: list[list] = []  # [is_reduced, size, stride in elements], slowest first
    stride = 1
    for d in reversed(range(nd)):
        n = int(x.shape[d])
        if n == 1:
            continue
        r = d in reduced
        if groups and groups[-1][0] == r:
            groups[-1][1] *= n
        else:
            groups.append([r, n, stride])
        stride *= n
    # reorder_dimensions: reduced dimensions first, each kind by input stride, smallest first
    order = sorted((g for g in groups if g[0]), key=lambda g: g[2]) + sorted((g for g in groups if not g[0]),
                                                                            key=lambda g: g[2])
    ndim = len(order)
    n_red = sum(1 for g in order if g[0])
    num_outputs = 1
    for g in order[n_red:]:
        num_outputs *= g[1]
    inputs_per_output = x.numel() // num_outputs
    if ndim == 0:
        on_fastest, dim0, dim1, fastest_stride = True, 1, 1, 1
    else:
        on_fastest = n_red == ndim or order[0][2] < order[n_red][2]
        if on_fastest:
            dim0, dim1, fastest_stride = inputs_per_output, num_outputs, order[0][2]
        else:
            dim0, dim1, fastest_stride = num_outputs, inputs_per_output, order[n_red][2]
    output_vec_size = 1
    if fastest_stride == 1:
        if on_fastest and dim0 > 128 and n_red == 1 and VT0 >= INPUT_VEC_SIZE:
            dim0 //= INPUT_VEC_SIZE  # vectorize along the input
        elif not on_fastest:  # get_output_vec_size
            vec = 4
            for v in [x.storage_offset(), order[n_red][1]] + [g[2] for i, g in enumerate(order) if i != n_red]:
                while v % vec:
                    vec //= 2
            output_vec_size = vec
            dim0 //= output_vec_size
    # set_block_dimension
    max_threads = MAX_NUM_THREADS // output_vec_size
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_width = min(dim0_pow2, WARP_SIZE)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    num_threads = block_width * block_height
    step_input = step_output = 1
    block_x_reduce = ndim == 0 or on_fastest
    if block_x_reduce:
        step_input *= block_width
    else:
        step_output *= block_width
    vpt = _div_up(inputs_per_output, step_input)
    split_warps = vpt >= min(block_height * 16, MAX_VALUES_PER_THREAD)
    if split_warps:
        step_input *= block_height
    else:
        step_output *= block_height
    t = current()
    target_grid = t.sms * (t.max_threads_per_sm // num_threads)
    grid_x = _div_up(num_outputs // output_vec_size, step_output)
    vpt = _div_up(inputs_per_output, step_input)
    if not (split_warps and vpt >= MAX_VALUES_PER_THREAD and grid_x <= target_grid):
        return []
    ctas = max(min(_div_up(target_grid, grid_x), _div_up(vpt, MIN_VALUES_PER_THREAD)),
               _div_up(vpt, MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return []
    size = acc * num_outputs * ctas
    if not block_x_reduce:
        size *= block_width * output_vec_size
    return [size, 4 * grid_x]
