"""``oomdoctor preflight -- python train.py ...``: the user's own script, run in this process under fake
tensors on the CPU, its GPU allocations traced (issue 42; ``docs/preflight.md``, "A script").

What changes for the script while it runs (:func:`trace_script`), and nothing else:

- ``torch.cuda`` says a GPU is there (:func:`cuda_patches`: ``is_available()`` True, one device with the
  GPU's name, total memory and compute capability; ``set_device``, ``synchronize``, ``empty_cache``,
  ``manual_seed``, the memory counters and ``_record_memory_history`` do nothing or answer 0; no stream is
  capturing a CUDA graph), and so does ``torch.accelerator`` (the current accelerator is CUDA, device 0, its
  stream never capturing: what the optimizers ask before a step, on a CUDA build of torch as on a CPU one);
- ``.cuda()``, ``.to("cuda")``, ``Module.cuda()`` / ``.to("cuda")`` and factories given ``device="cuda"``
  (also through ``with torch.device("cuda")``) make **fake CPU tensors that are on the GPU** for the
  tracer (:class:`CudaDevices`): the tracer records only those and the outputs of ops that read one
  (``AllocationTracer(gpu_only=True)``); ``.cpu()`` / ``.to("cpu")`` of one makes a host copy;
- ``torch.autocast("cuda", ...)`` (and ``torch.cuda.amp.autocast``) runs as CPU autocast with CUDA's lists
  (:class:`.tracer.CudaAutocastPolicy`), dtype fp16 when none is given, as on CUDA;
- every ``torch.optim`` optimizer's step is a step marker (global step hooks,
  ``torch/optim/optimizer.py`` ``register_optimizer_step_post_hook``): after it the parameters, gradients
  and optimizer state it holds are noted, and after ``max_steps`` steps the script is stopped (the trace
  ends there, as a snapshot dumped then does: the script's objects still alive);
- with ``world_size > 1``, ``torch.distributed.init_process_group`` joins a fake process group
  (``torch.testing._internal.distributed.fake_pg``: every collective returns at once, nothing moves) as
  rank 0 of ``world_size``, and ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` are set as ``torchrun`` sets them:
  one rank is traced, its collectives faked.

What cannot be traced ends with :class:`~.steps.PreflightError`, one line naming the script's line and
the reason: a value read from a tensor (``.item()``, ``bool(tensor)``, ``print`` of one, a data-dependent
shape), a collective's result used as data, data loader workers (fake tensors do not pickle), a CUDA
API not listed here (streams, events, CUDA graphs), ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from ..plan.gpus import gpu_sms
from ._private import PreflightError, require
from .target import target_gpu
from .tracer import AllocationTracer, TraceRecord, gpu_device_property, run_traced
from .values import SHADOW_LIMIT


@dataclass(frozen=True)
class ScriptJob:
    """A script and its arguments (``argv[0]`` the ``.py`` file, or ``-m`` and a module), the optimizer steps
    traced, and the world size (> 1: rank 0 of a fake process group); ``torchrun``: launched by ``torchrun`` (its
    variables set, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``..., also for one process: ``--nproc-per-node 1``)."""

    argv: tuple[str, ...]
    max_steps: int = 2
    world_size: int = 1
    rank: int = 0  # the rank traced (torchrun's RANK and LOCAL_RANK; one node)
    torchrun: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"script": list(self.argv), "max_steps": self.max_steps, "world_size": self.world_size,
                "ranks_traced": [self.rank], "collectives": "faked (fake process group)" if self.world_size > 1 else None,
                "ddp_if_used": "modelled: gradient buckets from construction, output clones with find_unused_parameters; "
                       "the all-reduces not traced",
                "step": "the script's own, to its optimizer's step number max_steps"}


class _Stop(BaseException):
    """Raised from the optimizer's step hook after the last traced step (not an Exception: the script's
    ``except Exception`` does not catch it)."""


def _is_cuda(d: Any) -> bool:
    if isinstance(d, str):
        return d == "cuda" or d.startswith("cuda:")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return False


def _is_cpu(d: Any) -> bool:
    if isinstance(d, str):
        return d == "cpu" or d.startswith("cpu:")
    if isinstance(d, torch.device):
        return d.type == "cpu"
    return False


def _storage(t: Any) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (AttributeError, NotImplementedError, RuntimeError):
        return None


class CudaDevices(TorchFunctionMode):
    """``device="cuda"`` as the fake CPU device, the tensors made so on the GPU for ``tracer``."""

    def __init__(self, tracer: AllocationTracer) -> None:
        super().__init__()
        self.tracer = tracer

    def _target(self, func: Any, args: tuple, kwargs: dict) -> tuple[str | None, tuple, dict]:
        """``("cuda" | "cpu" | None, args, kwargs)`` with every device argument the CPU."""
        where = None
        if func in (torch.Tensor.cuda,):
            return "cuda", args[:1], {}
        if func in (torch.Tensor.cpu,):
            return "cpu", args[:1], {}
        new_args = list(args)
        for i, a in enumerate(args):
            if i == 0 or func is not torch.Tensor.to:  # positional devices: Tensor.to's only
                continue
            if _is_cuda(a) or (isinstance(a, int) and not isinstance(a, bool) and i == 1):
                where, new_args[i] = "cuda", "cpu"
            elif _is_cpu(a):
                where = "cpu"
            elif i == 1 and isinstance(a, torch.Tensor):
                where = "cuda" if self.tracer.is_gpu(a) else "cpu"
                new_args[i] = a.dtype
        kw = dict(kwargs)
        d = kw.get("device")
        if _is_cuda(d):
            where, kw["device"] = "cuda", "cpu"
        elif _is_cpu(d) and func in (torch.Tensor.to,):
            where = "cpu"
        return where, tuple(new_args), kw

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is not None and owner in _GPU_ATTRS and args and _is_fake(args[0]):
            return _GPU_ATTRS[owner]  # a fake tensor is the GPU's: device cuda:0, is_cuda True
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.get_device and args and _is_fake(args[0]):
            return 0
        if func is torch.Tensor.record_stream:
            _note("cuda_streams")
            return None
        read = _READS.get(func)
        if read is not None and args and _is_fake(args[0]):
            return self._read(func, read, args, kwargs)
        where, args, kwargs = self._target(func, args, kwargs)
        if where is None:
            return func(*args, **kwargs)
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        moving = func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu)
        if moving and src is not None and self.tracer.is_gpu(src) == (where == "cuda"):
            if func in (torch.Tensor.cuda, torch.Tensor.cpu):
                return src
            return func(*args, **kwargs)  # already there: a dtype change at most
        if moving and src is not None and where == "cpu" and func is torch.Tensor.to and _from_torch():
            # torch's own code moving to a device it read in C++ (``_group_tensors_by_device_and_dtype`` says
            # cpu for a fake tensor): the GPU's tensor stays where it is, as it would on CUDA
            return func(*args, **kwargs)
        if moving and src is not None and where == "cpu":  # the GPU's values to the host: stand-ins
            out = self._host_copy(src, "cpu")
            dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
            return out.to(dtype) if dtype is not None else out
        with self.tracer.on_gpu(where == "cuda"):
            if func in (torch.Tensor.cuda, torch.Tensor.cpu):
                assert src is not None  # Tensor.cuda / Tensor.cpu: called on a tensor
                out = src.clone()
            else:
                out = func(*args, **kwargs)
                if moving and src is not None and _storage(out) == _storage(src):
                    out = out.clone()  # a copy to the other device, never an alias
        if moving and where == "cuda":  # a host tensor copied in: its values are known (one value, or a small one)
            self.tracer.values.from_host(out, src)
        elif where == "cuda" and func in _FROM_DATA and isinstance(out, torch.Tensor) and out.numel() <= SHADOW_LIMIT:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily(), self.tracer.on_gpu(False):  # the same data on the host: its values
                host = func(*args, **kwargs)
            self.tracer.values.from_host(out, host)
        return out

    # -- values read from the GPU (values.py: the policy)
    def _host_copy(self, t: torch.Tensor, read: str) -> torch.Tensor:
        """A real host tensor of ``t``'s shape and dtype holding the stand-in value (a broadcast view beyond
        2**24 elements: no host memory for a large one)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        values = self.tracer.values
        values.read = read
        try:
            v = values.value_of(t)
        finally:
            values.read = "item"
        with unset_fake_temporarily(), self.tracer.on_gpu(False):
            if isinstance(v, torch.Tensor):  # known one by one (values.py: a host copy, a position range)
                return v.to(t.dtype).reshape(tuple(t.shape))
            if t.numel() <= 1 << 24:
                return torch.full(tuple(t.shape), v, dtype=t.dtype)
            return torch.full((), v, dtype=t.dtype).expand(tuple(t.shape))

    def _read(self, func: Any, read: str, args: tuple, kwargs: dict) -> Any:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        values = self.tracer.values
        t = args[0]
        if read in ("numpy", "tolist", "print") and (read != "print" or t.dim() > 0 or func is torch.Tensor.__repr__):
            host = self._host_copy(t, read)
            with unset_fake_temporarily(), self.tracer.on_gpu(False):  # the host copy's values, not a fake's
                if read == "numpy":
                    return host.numpy()
                if read == "tolist":
                    return host.tolist()
                text = repr(host)
            return text[:-1] + ", device='cuda:0')" if text.endswith(")") else text
        values.read = read
        try:
            if func is torch.Tensor.__format__:  # a 0-dim tensor in an f-string: its value, formatted
                return format(t.item(), *args[1:])
            return func(*args, **kwargs)  # reaches _local_scalar_dense: the tracer's stand-in
        finally:
            values.read = "item"


def _from_torch() -> bool:
    """Whether the call being handled comes from torch's own Python code (not the script's, nor a library's)."""
    f = sys._getframe(2)
    while f is not None and "oomdoctor/preflight/" in f.f_code.co_filename:
        f = f.f_back
    return f is not None and "/torch/" in f.f_code.co_filename


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


#: attributes a fake (GPU) tensor answers as a CUDA tensor does (getset descriptors of ``torch._C.TensorBase``)
_GPU_ATTRS = {torch._C.TensorBase.device: torch.device("cuda", 0), torch._C.TensorBase.is_cuda: True,
              torch._C.TensorBase.is_cpu: False}
#: factories of a tensor from host data (``torch.tensor([...], device="cuda")``): its values are the data's
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
#: how a value is read from a tensor, by the function that reads it
_READS = {torch.Tensor.item: "item", torch.Tensor.__bool__: "bool", torch.Tensor.__float__: "float",
          torch.Tensor.__int__: "int", torch.Tensor.__index__: "index", torch.Tensor.tolist: "tolist",
          torch.Tensor.__format__: "print", torch.Tensor.__repr__: "print", torch.Tensor.numpy: "numpy"}


def _device_properties(name: str, total: int, sm_major: int) -> Any:
    return types.SimpleNamespace(name=name, total_memory=total, major=sm_major, minor=0, multi_processor_count=132,
                                 is_integrated=False, is_multi_gpu_board=False, L2_cache_size=50 << 20,
                                 gcnArchName="", uuid="preflight")


def _swap_or_set(orig: Any) -> Any:
    """``torch.utils.swap_tensors`` as ``Module._apply`` uses it while a script is traced (with
    ``torch.__future__``'s swap on: :func:`trace_script`), so that a parameter moved to the GPU stays **the same
    Python object**, as CUDA's ``param.data = param.cuda()`` keeps it. Without the swap, ``_apply`` makes a new
    ``Parameter`` for every host parameter whose moved copy is a FakeTensor (``compute_should_use_set_data`` is
    False for a FakeTensor: ``torch/nn/modules/module.py``), and an optimizer built before the move (Fabric's
    ``setup(model, optimizer)``, accelerate's ``prepare``) kept the host parameters: its step ran on the host and
    its state was never traced (measured on Lightning's ``train_fabric.py``: no Adadelta state, 12% low).

    ``swap_tensors`` refuses a tensor with a weak reference, which the fake mode's converter keeps for every tensor
    it converted or memoized: those entries are dropped first (the converted tensor is replaced by the swap). Two host
    tensors (``model.half()`` on the host, ``load_state_dict``) are set in place (``.data =``), torch's default."""
    def forget(t: Any, mode: Any) -> None:
        conv = mode.fake_tensor_converter
        lookup = conv.meta_converter.describer.lookup_tensor
        if t in lookup:
            del lookup[t]
        for memo in (conv.tensor_memo, conv.meta_converter.tensor_memo):
            for k in [k for k, v in list(memo.items()) if v is t]:
                del memo[k]

    def swap(t1: Any, t2: Any) -> None:
        # a DTensor (FSDP2's ``to_empty`` after ``fully_shard``) is fake where its shard is
        fake = next((getattr(t, "_local_tensor", t) for t in (t2, t1) if _is_fake(getattr(t, "_local_tensor", t))),
                    None)
        if fake is None:
            t1.data = t2.data
            return
        try:
            forget(t1, fake.fake_mode)
            forget(t2, fake.fake_mode)
        except (AttributeError, TypeError):  # pragma: no cover - a fake mode without these memos: swap as is
            pass
        try:
            orig(t1, t2)
        except RuntimeError:  # swap_tensors' use-count check: a reference an old graph holds
            _swap_held(t1, t2)

    return swap


def _swap_held(t1: Any, t2: Any) -> None:
    """``swap_tensors`` without its use-count check, for a parameter an old autograd graph still references
    (``nn.utils.weight_norm``: the weight computed at construction saved ``weight_v`` and ``weight_g``; DINO's head).
    The old graph keeps the host tensor it saved, and is never run (the hook computes the weight again at the next
    forward). Before, ``t1.data = t2.data`` made the parameter a meta tensor, and the next forward failed ("its data
    is not allocated yet")."""
    import copyreg

    swap_impl = require("torch._C._swap_tensor_impl")
    slots = set(copyreg._slotnames(t1.__class__))  # type: ignore[attr-defined]
    if slots != set(copyreg._slotnames(t2.__class__)):  # type: ignore[attr-defined]
        t1.data = t2.data
        return
    for name in ("__class__", "__dict__"):
        a, b = getattr(t1, name), getattr(t2, name)
        setattr(t1, name, b)
        setattr(t2, name, a)
    for slot in slots:
        a, b = getattr(t1, slot, _MISSING), getattr(t2, slot, _MISSING)
        for t, v in ((t1, b), (t2, a)):
            if v is _MISSING:
                if hasattr(t, slot):
                    delattr(t, slot)
            else:
                setattr(t, slot, v)
    swap_impl(t1, t2)


_MISSING = object()


def ddp_stand_in(tracer: AllocationTracer) -> type:
    """A stand-in for ``DistributedDataParallel`` (DDP's C++ side reads tensor data, which fake tensors do
    not have: ``_verify_params_across_processes`` fails with "The tensor has a non-zero number of elements,
    but its data is not allocated yet", measured with torch 2.13). It keeps DDP's memory, as the Hugging
    Face path models it (:func:`.steps.ddp_buckets`, :func:`.steps._ddp_sink`): the gradient buckets
    (every parameter's bytes once, 25 MiB buckets) on the GPU from construction, and a clone of the outputs
    when ``find_unused_parameters`` is set; the all-reduces (in place on the buckets) are not traced. With
    ``gradient_as_bucket_view=True`` the gradients are views of the buckets: the buckets are then not
    added (the gradients the engine makes are their bytes)."""
    from .steps import _ddp_sink, ddp_buckets

    class DistributedDataParallel(torch.nn.Module):
        def __init__(self, module: torch.nn.Module, device_ids: Any = None, output_device: Any = None, dim: int = 0,
                     broadcast_buffers: bool = True, process_group: Any = None, bucket_cap_mb: Any = None,
                     find_unused_parameters: bool = False, check_reduction: bool = False,
                     gradient_as_bucket_view: bool = False, static_graph: bool = False, **kwargs: Any) -> None:
            super().__init__()
            self.module = module
            self.find_unused_parameters = find_unused_parameters
            params = [p for p in module.parameters() if p.requires_grad]
            with tracer.on_gpu(True):
                self._oomdoctor_buckets = [] if gradient_as_bucket_view else [
                    torch.empty(n, dtype=torch.uint8) for n in ddp_buckets(params)]
            for b in self._oomdoctor_buckets:
                a = tracer.addr_of(b)
                tracer.record.extra_allocations.append({"what": "ddp_gradient_bucket", "addr": a[0] if a else None,
                                                        "bytes": b.numel(), "backward": False})

        def forward(self, *a: Any, **k: Any) -> Any:
            out = self.module(*a, **k)
            return _ddp_sink(out) if self.find_unused_parameters else out

        @contextlib.contextmanager
        def no_sync(self) -> Iterator[None]:
            yield

    return DistributedDataParallel


def _real_mesh(orig: Any) -> Any:
    """``DeviceMesh.__init__`` outside the fake mode, its mesh of ranks a real tensor: it reads the rank map's
    values (``tolist()``), which a fake tensor has none of (measured: FSDP2's ``fully_shard`` failed there)."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    def real(x: Any) -> Any:
        # the mesh of ranks: init_device_mesh's torch.arange(world).view(shape), made under the fake mode
        return torch.arange(x.numel(), dtype=x.dtype).view(tuple(x.shape)) if isinstance(x, FakeTensor) else x

    def init(self: Any, *a: Any, **k: Any) -> None:
        with unset_fake_temporarily():
            orig(self, *[real(x) for x in a], **{n: real(x) for n, x in k.items()})

    return init


def _local(t: Any) -> Any:
    """A DTensor's shard on this rank (FSDP2's parameters, gradients and optimizer state), else ``t``."""
    return getattr(t, "_local_tensor", t)


def _backward_on_gpu(orig: Any, tracer: AllocationTracer) -> Any:
    """The autograd engine's entry (``torch/autograd/graph.py`` ``_engine_run_backward``) with every
    allocation on the GPU: backward, its hooks and the engine's final callbacks (FSDP2's last
    reduce-scatter) run where no ``TorchFunctionMode`` does, and make their tensors on the module's
    device, which is the fake CPU one here."""
    def run(*a: Any, **k: Any) -> Any:
        with tracer.on_gpu(True):
            return orig(*a, **k)

    return run


def _load_location(map_location: Any, location: str) -> str:
    """Where ``torch.load`` puts a storage saved at ``location`` under ``map_location`` (a device string, a
    ``torch.device``, a dict of locations, or None: where it was saved); a callable's answer is not asked for (it
    could move a real storage to a GPU this host lacks): the host."""
    if map_location is None:
        return location
    if isinstance(map_location, (str, torch.device)):
        return str(map_location)
    if isinstance(map_location, dict):
        return str(map_location.get(location, location))
    return "cpu"


def _torch_load(orig: Any, tracer: AllocationTracer) -> Any:
    """``torch.load`` on the real host: the file read into host tensors outside the fake mode (before, its storages
    were made under it as meta tensors, and ``load_state_dict`` into a host model failed: "Cannot copy out of meta
    tensor", torchvision's pretrained weights among them); then each tensor whose storage ``torch.load`` would have
    put on a GPU (``map_location``, else where it was saved) is moved there through the script's device layer, a
    fake GPU tensor whose copy is traced."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._pytree import tree_map

    def load(f: Any, map_location: Any = None, *a: Any, **k: Any) -> Any:
        gpu: set[int] = set()

        def locate(storage: Any, location: str) -> Any:
            if _load_location(map_location, location).startswith("cuda"):
                gpu.add(storage.data_ptr())
            return storage  # on the host

        with unset_fake_temporarily(), tracer.on_gpu(False):
            obj = orig(f, locate, *a, **k)
        if not gpu:
            return obj

        def place(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not _is_fake(x) and x.untyped_storage().data_ptr() in gpu:
                return x.cuda()
            return x

        return tree_map(place, obj)

    return load


def _loader_iter_init(orig: Any) -> Any:
    """``torch.utils.data``'s ``_BaseDataLoaderIter.__init__`` outside the fake mode: it draws the loader's
    seed with ``torch.empty((), dtype=torch.int64).random_().item()`` (and shares it over the process group,
    ``_share_dist_seed``), which a fake tensor cannot answer (measured: every ``for batch in loader`` failed
    there). The batches (``__next__``) stay fake."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def init(self: Any, *a: Any, **k: Any) -> None:
        with unset_fake_temporarily():
            orig(self, *a, **k)

    return init


@contextlib.contextmanager
def _policies(tracer: AllocationTracer, inner: Any = None) -> Iterator[None]:
    """The script's torch-function layers (CUDA's devices, autocast lists and attention kernel) entered again,
    then ``inner``: the autograd engine runs checkpoint recomputation without the caller's ``TorchFunctionMode``
    (measured on the ``--hf-config`` path: CPU's math attention and dropout; on a script, non-reentrant
    checkpointing then failed with ``CheckpointError``, "a different number of tensors was saved")."""
    from .tracer import CudaAutocastPolicy

    with CudaDevices(tracer), CudaAutocastPolicy(tracer), (inner if inner is not None else contextlib.nullcontext()):
        yield


def _checkpoint_recomputed_as_traced(orig: Any, tracer: AllocationTracer) -> Any:
    """``torch.utils.checkpoint``'s non-reentrant generator with the script's policies in the recomputation
    (its ``context_fn``'s second context, the user's own kept inside)."""
    from torch.utils.checkpoint import noop_context_fn

    def gen(fn: Any, preserve_rng_state: bool = True, context_fn: Any = noop_context_fn, *a: Any, **k: Any) -> Any:
        def ctx() -> tuple[Any, Any]:
            fwd, rec = context_fn()
            return fwd, _policies(tracer, rec)
        return orig(fn, preserve_rng_state, ctx, *a, **k)

    return gen


def _reentrant_backward(orig: Any, tracer: AllocationTracer) -> Any:
    """``CheckpointFunction.backward`` (reentrant checkpointing) with the script's policies in its
    recomputation."""
    def backward(ctx: Any, *args: Any) -> Any:
        with _policies(tracer):
            return orig(ctx, *args)

    return staticmethod(backward)


def _none(*a: Any, **k: Any) -> None:
    return None


def _storage_resize(orig: Any, tracer: AllocationTracer) -> Any:
    """``UntypedStorage.resize_`` that tells the tracer (:meth:`AllocationTracer.resized`) after resizing."""
    def resize_(self: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        out = orig(self, size)
        tracer.resized(self, int(size))
        return out
    return resize_


class _CudaRngState:
    """The fake GPU's generator state, as ``torch.cuda.get_rng_state`` gives a GPU's: 16 bytes on the host, the
    Philox seed then the offset (``CUDAGeneratorImpl::get_state``: ``seed_ + offset_``, each 8 bytes). A CPU build of
    torch has no GPU generator (``torch.cuda.default_generators`` is empty): DTensor's random ops
    (``torch.distributed.tensor._random``, FSDP2's ``reset_parameters`` on a mesh) read this state, move its offset
    and set it back. Every GPU of the node shares it."""

    def __init__(self) -> None:
        self.state = torch.zeros(16, dtype=torch.uint8)

    def get(self, device: Any = "cuda") -> torch.Tensor:
        return self.state.clone()

    def set(self, new_state: torch.Tensor, device: Any = "cuda") -> None:
        self.state = new_state.detach().to("cpu", torch.uint8).clone()

    def set_all(self, new_states: Any) -> None:
        for st in new_states:
            self.set(st)


def _zero(*a: Any, **k: Any) -> int:
    return 0


@contextlib.contextmanager
def _patched(targets: list[tuple[Any, str, Any]]) -> Iterator[None]:
    saved = [(obj, name, getattr(obj, name, None), hasattr(obj, name)) for obj, name, _ in targets]
    for obj, name, value in targets:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value, had in reversed(saved):
            if had:
                setattr(obj, name, value)
            else:
                delattr(obj, name)


def cuda_patches(gpu_name: str, gpu_total_bytes: int, sm_major: int, gpus: int = 1) -> list[tuple[Any, str, Any]]:
    """The ``torch.cuda`` functions a script sees while traced (the module doc); ``gpus``: the GPUs of the node
    (``torch.cuda.device_count()``, ``torch.accelerator.device_count()``): a ``torchrun --nproc-per-node N`` job
    sees N (measured: pytorch/examples' tensor-parallel example exits before any step when fewer than 2)."""
    import torch.cuda.memory as mem

    props = _device_properties(gpu_name, gpu_total_bytes, sm_major)
    c = torch.cuda
    out: list[tuple[Any, str, Any]] = [
        (c, "is_available", lambda: True), (c, "device_count", lambda: gpus), (c, "current_device", lambda: 0),
        (c, "is_initialized", lambda: True), (c, "init", _none), (c, "_lazy_init", _none),
        (c, "set_device", _none), (c, "synchronize", _none), (c, "empty_cache", _none),
        (c, "manual_seed", _none), (c, "manual_seed_all", _none), (c, "seed", _none), (c, "seed_all", _none),
        (c, "get_device_name", lambda *a, **k: gpu_name), (c, "get_device_properties", lambda *a, **k: props),
        (c, "get_device_capability", lambda *a, **k: (sm_major, 0)), (c, "is_bf16_supported", lambda *a, **k: True),
        (c, "mem_get_info", lambda *a, **k: (gpu_total_bytes, gpu_total_bytes)),
        (c, "memory_stats", lambda *a, **k: {}), (c, "reset_peak_memory_stats", _none),
        (c, "reset_max_memory_allocated", _none), (c, "reset_accumulated_memory_stats", _none),
    ]
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        out.append((c, name, _zero))
    # the GPU's generator state (DTensor's random ops read and set it around each one: _random.py _distribute_region)
    rng = _CudaRngState()
    for m in (c, c.random):
        out += [(m, "get_rng_state", rng.get), (m, "set_rng_state", rng.set),
                (m, "get_rng_state_all", lambda: [rng.get()] * gpus), (m, "set_rng_state_all", rng.set_all)]
    out.append((c, "is_current_stream_capturing", lambda: False))
    out += [(c, "Stream", _Stream), (c, "Event", _Event), (c, "stream", _stream_context),
            (c, "current_stream", lambda *a, **k: _DEFAULT_STREAM), (c, "default_stream", lambda *a, **k: _DEFAULT_STREAM),
            (c, "set_stream", _none), (c, "CUDAGraph", _Graph), (c, "graph", _graph),
            (c, "make_graphed_callables", lambda callables, *a, **k: callables),
            (c, "graph_pool_handle", lambda: (0, 0)), (c, "device", _DeviceContext),
            (torch, "compile", _compile),
            # the build's accelerator, which FSDP2's default mesh reads (_fsdp_init._init_default_mesh)
            (torch._C, "_get_accelerator", lambda *a, **k: torch.device("cuda")),
            # Module.to(rank) with a plain index (the DDP tutorial's ``model.to(self.gpu_id)``): C's parser resolves
            # an index to the current accelerator, which a CPU build has none of
            (torch._C._nn, "_parse_to", _parse_to_index_as_cuda(torch._C._nn._parse_to)),  # pyright: ignore[reportAttributeAccessIssue] (torch private, not in its stubs)
            # nn.DataParallel's scatter of its inputs (torch.nn.parallel.comm.scatter), which a CPU build lacks
            (torch._C, "_scatter", _scatter)]
    acc = getattr(torch, "accelerator", None)
    if acc is not None:  # PyTorch >= 2.6: what the optimizers ask before step() (below)
        out += [(acc, "current_accelerator", lambda check_available=False: torch.device("cuda")),
                (acc, "current_device_index", lambda: 0), (acc, "current_device_idx", lambda: 0),
                (acc, "is_available", lambda: True), (acc, "device_count", lambda: gpus),
                (acc, "set_device_index", _none), (acc, "set_device_idx", _none), (acc, "synchronize", _none),
                (acc, "current_stream", lambda *a, **k: _NOT_CAPTURING)]
    out += [(mem, "_record_memory_history", _none), (mem, "_dump_snapshot", _none),
            (mem, "empty_cache", _none)]
    return out


def _scatter(tensor: Any, devices: list[int], chunk_sizes: Any, dim: int, streams: Any) -> tuple[Any, ...]:
    """``torch._C._scatter`` (``nn.DataParallel``'s inputs, ``torch/csrc/cuda/comm.cpp``): ``tensor`` cut along
    ``dim`` into one chunk per device (``chunk_sizes``, else as equal as ``torch.chunk`` makes them), each copied to
    its GPU. One GPU traced: every chunk goes to the fake one."""
    if len(devices) == 1:
        return (tensor.to("cuda"),)
    parts = tensor.split(list(chunk_sizes), dim) if chunk_sizes else tensor.chunk(len(devices), dim)
    return tuple(p.contiguous().to("cuda") for p in parts)


def _parse_to_index_as_cuda(orig: Any) -> Any:
    """``torch._C._nn._parse_to`` (``Module.to``'s argument parser) with a device given as an index (``.to(0)``,
    ``.to(device=1)``) read as ``cuda:<index>``, as on a CUDA machine; every other argument as before."""
    def parse(*args: Any, **kwargs: Any) -> Any:
        def idx(x: Any) -> Any:
            return torch.device("cuda", x) if isinstance(x, int) and not isinstance(x, bool) else x

        if args:
            args = (idx(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs = {**kwargs, "device": idx(kwargs["device"])}
        return orig(*args, **kwargs)
    return parse


class _DeviceContext:
    """``torch.cuda.device(i)`` while traced: one GPU, nothing to switch."""

    def __init__(self, device: Any = None) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class _NotCapturing:
    """The stream ``torch.accelerator.current_stream()`` answers while a script is traced. Adam's and AdamW's
    ``step`` asks it whether a CUDA graph is being captured (``torch/optim/optimizer.py``,
    ``_accelerator_graph_capture_health_check``: ``current_accelerator(check_available=True)``, which asks the
    patched ``torch.cuda.is_available``, then ``current_stream().is_capturing()``): on a CUDA build of torch with
    no visible device the real stream fails ("no CUDA-capable device is detected"). Nothing is ever captured."""

    device = property(lambda self: torch.device("cuda", 0))

    def is_capturing(self) -> bool:
        return False

    def synchronize(self) -> None:
        return None


_NOT_CAPTURING = _NotCapturing()


class _Event:
    """``torch.cuda.Event`` while traced: recording and waiting do nothing (one stream is traced);
    ``elapsed_time`` answers 0.0 ms."""

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        _note("cuda_streams")

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: Any) -> float:
        return 0.0


class _Stream:
    """``torch.cuda.Stream`` while traced: every kernel is traced on stream 0 (``docs/preflight.md``), so a side
    stream is the same stream: waits and syncs do nothing."""

    device = property(lambda self: torch.device("cuda", 0))
    cuda_stream = 0
    priority = 0

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        _note("cuda_streams")

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def is_capturing(self) -> bool:
        return False

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_DEFAULT_STREAM = _Stream()


class _Graph:
    """``torch.cuda.CUDAGraph`` while traced: what is captured runs once, eagerly (its tensors traced as any);
    ``replay`` does nothing. The graph's private memory pool is not modelled."""

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def capture_begin(self, *a: Any, **k: Any) -> None:
        _note("cuda_graph")

    def capture_end(self) -> None:
        return None

    def replay(self) -> None:
        return None

    def reset(self) -> None:
        return None

    def pool(self) -> tuple[int, int]:
        return (0, 0)


@contextlib.contextmanager
def _graph(cuda_graph: Any, pool: Any = None, stream: Any = None, **k: Any) -> Iterator[None]:
    _note("cuda_graph")
    yield


@contextlib.contextmanager
def _stream_context(stream: Any) -> Iterator[None]:
    _note("cuda_streams")
    yield


#: what was met while tracing that the trace treats in a stated way (ids; the CLI words them): "cuda_streams"
#: (side streams traced on stream 0), "cuda_graph" (captured work run once eagerly), "torch_compile" (eager)
_NOTES: set[str] = set()


def _note(what: str) -> None:
    _NOTES.add(what)


def _compile(model: Any = None, *a: Any, **k: Any) -> Any:
    """``torch.compile`` while traced: the eager module or function (``torch._dynamo`` cannot trace a fake
    tensor's dispatch here); its memory is the eager one's, which the output says."""
    _note("torch_compile")
    if model is None:
        return lambda m: m
    return model


def _autocast_init(orig: Any) -> Any:
    def init(self: Any, device_type: str, dtype: Any = None, enabled: bool = True, cache_enabled: Any = None) -> None:
        if device_type == "cuda":  # CPU autocast, CUDA's lists (CudaAutocastPolicy) and CUDA's default dtype
            device_type, dtype = "cpu", dtype if dtype is not None else torch.float16
        orig(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    return init


def _cuda_amp_autocast_init(self: Any, enabled: bool = True, dtype: Any = torch.float16,
                            cache_enabled: bool = True) -> None:
    torch.amp.autocast_mode.autocast.__init__(self, "cpu", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


def _not_a_fake_tensor(x: Any) -> bool:
    return False


#: library functions that tell a FakeTensor from a GPU tensor, answered as the GPU's tensor would be, by module:
#: transformers' ``is_tracing(tensor)`` counts a FakeTensor as tracing (``utils/import_utils.py`` ``is_fake_tensor``),
#: and then builds the masks it skips on the GPU and ignores padding checks (measured: a T5 Trainer job traced a
#: ``b × 1 × s × s`` mask and a ``b × h × s × s`` fp32 position-bias mask per layer the H200 never made)
LIBRARY_PATCHES: dict[str, list[tuple[str, Any]]] = {
    "transformers.utils.import_utils": [("is_fake_tensor", _not_a_fake_tensor)],
}


class _LibraryHooks:
    """A ``sys.meta_path`` finder that applies :data:`LIBRARY_PATCHES` to a module when it is imported while a script
    is traced (and at once to one already imported); :meth:`restore` undoes them."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any]] = []

    def apply(self, module: Any) -> None:
        for name, value in LIBRARY_PATCHES.get(getattr(module, "__name__", ""), []):
            if hasattr(module, name):
                self.saved.append((module, name, getattr(module, name)))
                setattr(module, name, value)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in LIBRARY_PATCHES:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module
        hooks = self

        class _Loader(type(loader)):  # type: ignore[misc]
            def exec_module(self, module: Any) -> None:
                exec_module(module)
                hooks.apply(module)

        loader.__class__ = _Loader
        return spec

    def restore(self) -> None:
        for module, name, value in reversed(self.saved):
            setattr(module, name, value)
        self.saved.clear()


@contextlib.contextmanager
def _library_hooks() -> Iterator[None]:
    hooks = _LibraryHooks()
    for name in LIBRARY_PATCHES:
        if name in sys.modules:
            hooks.apply(sys.modules[name])
    sys.meta_path.insert(0, hooks)  # type: ignore[arg-type]
    try:
        yield
    finally:
        sys.meta_path.remove(hooks)  # type: ignore[arg-type]
        hooks.restore()


@contextlib.contextmanager
def _fake_process_group(world_size: int, rank: int = 0, torchrun: bool = False) -> Iterator[None]:
    """``init_process_group`` joins a fake process group as ``rank`` of ``world_size`` (the module doc). The
    launcher's variables are set as ``torchrun`` sets them when it launched the script (``torchrun``, or more than
    one process). With one process and no launcher (no ``--nproc-per-node``) they are not, as ``python train.py`` has
    none: a
    script that starts a process group of one by itself (DINO's ``init_distributed_mode``: NCCL, rank 0 of 1, which
    a CPU build of torch lacks) gets the fake one; the others never call it."""
    import torch.distributed as dist

    FakeStore = require("torch.testing._internal.distributed.fake_pg.FakeStore")

    orig = dist.init_process_group

    def init_process_group(*a: Any, **k: Any) -> None:
        orig(backend="fake", store=FakeStore(), rank=rank, world_size=world_size)

    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "GROUP_RANK": "0", "ROLE_RANK": "0"} \
        if torchrun or world_size > 1 else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # every module holding torch's function: torch.distributed, distributed_c10d, device_mesh (init_device_mesh
    # calls it from there; measured: the tensor-parallel example then waited for rank 1 in a TCP store forever)
    holders: list[Any] = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("torch") and getattr(m, "init_process_group", None) is orig]
    for m in holders:
        m.init_process_group = init_process_group
    try:
        yield
    finally:
        for m in holders:
            m.init_process_group = orig
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _where(exc: BaseException, script: str) -> str:
    """``file:line`` of the innermost frame of the script (else of the innermost frame outside torch)."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if os.path.abspath(f.filename) == os.path.abspath(script)]
    f = (mine or [f for f in frames if "/torch/" not in f.filename] or frames or [None])[-1]
    return f"{f.filename}:{f.lineno}" if f is not None else script


def _own_error(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by the script's (or a library's) own Python code, not inside torch or preflight:
    its innermost frame is outside them and it is not one of the fake mode's exceptions (minGPT's chargpt samples
    from a character table the generated corpus lacks: KeyError ',' at its line, on the H200 as here)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException, RuntimeError, NotImplementedError)):
        return False  # RuntimeError: torch's C++ errors surface as it, from any frame
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    inner = frames[-1].filename.replace(os.sep, "/")
    return "/torch/" not in inner and "/oomdoctor/" not in inner


def _reason(exc: BaseException) -> str:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException)) or "data-dependent" in str(exc) \
            or "item()" in str(exc):
        return ("reads a value from a tensor (.item(), bool(), print of a tensor, a data-dependent shape): "
                "fake tensors have no values")
    first = (str(exc).strip().splitlines() or [""])[0][:160]
    hint = " (a torchrun script: give --nproc-per-node N)" if "rendezvous" in first or "RANK" in first else ""
    return f"{type(exc).__name__}: {first}{hint}"


def trace_script(job: ScriptJob, *, gpu_name: str, gpu_total_bytes: int, sm_major: int = 9,
                 cublas_workspace_bytes: int = 0) -> TraceRecord:
    """Run the script of ``job`` traced (the module doc). Raises :class:`PreflightError` (one line: the
    script's file and line, and what could not be traced) when the script fails, exits non-zero, or runs
    no optimizer step; a script that ends by itself before ``max_steps`` is traced to its end."""
    argv = list(job.argv)
    if not argv:
        raise PreflightError("preflight --: give the script to run (python train.py ...)")
    module = argv[1] if argv[0] == "-m" and len(argv) > 1 else None
    script = argv[0]
    if module is None:
        if not Path(script).is_file():
            raise PreflightError(f"{script}: no such script")
        sys_argv = [script, *argv[1:]]
    else:
        sys_argv = [module, *argv[2:]]
    steps = {"n": 0}

    def run(tracer: AllocationTracer) -> Any:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def pre(opt: Any, args: Any, kwargs: Any) -> None:
            tracer.mark_phase("optimizer")

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            params = [p for g in opt.param_groups for p in g["params"]]
            state = [v for s in opt.state.values() if isinstance(s, dict) for v in s.values()
                     if isinstance(v, torch.Tensor)]
            tracer.note_facts(steps["n"], {"parameters": [_local(p) for p in params],
                                           "gradients": [_local(p.grad) for p in params if p.grad is not None],
                                           "optimizer_state": [_local(v) for v in state]})
            if steps["n"] == 0:
                tracer.note_modules(1)  # as the recorder: once, at the end of the first optimizer step
            steps["n"] += 1
            if steps["n"] >= job.max_steps:
                tracer.stop()  # a framework catching BaseException tears down (Lightning: model.cpu()): unrecorded
                raise _Stop
            tracer.mark_step(steps["n"])
            tracer.mark_phase("train")

        import torch.nn.parallel as parallel
        import torch.nn.parallel.distributed as ddp_mod
        import torch.utils.checkpoint as ckpt
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.device_mesh import DeviceMesh
        from torch.utils.data._utils import pin_memory as pin_mod
        from torch.utils.data.dataloader import _BaseDataLoaderIter as loader_iter

        ddp_cls = ddp_stand_in(tracer)
        devices = CudaDevices(tracer)

        def tolist(t: Any) -> Any:
            """``FakeTensor.tolist`` reads element by element (``.item()`` each, in Python: no torch function
            layer sees it); while traced it is one read, answered as a host copy (values.py)."""
            return devices._read(torch.Tensor.tolist, "tolist", (t,), {})

        engine_entry = require("torch.autograd.graph._engine_run_backward")
        tracer.mark_step(0)
        tracer.mark_phase("train")
        autocast = torch.amp.autocast_mode.autocast
        patches = cuda_patches(gpu_name, gpu_total_bytes, sm_major, gpus=max(1, job.world_size)) + [
            (autocast, "__init__", _autocast_init(autocast.__init__)),
            (torch.cuda.amp.autocast, "__init__", _cuda_amp_autocast_init),
            (torch.utils, "swap_tensors", _swap_or_set(torch.utils.swap_tensors)),
            (torch.__future__, "_swap_module_params_on_conversion", True),
            (FakeTensor, "tolist", tolist),
            (DeviceMesh, "__init__", _real_mesh(DeviceMesh.__init__)),
            (ckpt, "_checkpoint_without_reentrant_generator",
             _checkpoint_recomputed_as_traced(require("torch.utils.checkpoint._checkpoint_without_reentrant_generator"),
                                              tracer)),
            (ckpt.CheckpointFunction, "backward", _reentrant_backward(ckpt.CheckpointFunction.backward, tracer)),
            (loader_iter, "__init__", _loader_iter_init(loader_iter.__init__)),
            # the loader's pin-memory thread (no torch-function mode there): host memory, not the GPU's
            (pin_mod, "pin_memory", lambda data, device=None: data),
            (torch.autograd, "_engine_run_backward", _backward_on_gpu(engine_entry, tracer)),
            (torch.autograd.graph, "_engine_run_backward", _backward_on_gpu(engine_entry, tracer)),
            (ddp_mod, "DistributedDataParallel", ddp_cls), (parallel, "DistributedDataParallel", ddp_cls),
            (torch, "load", _torch_load(torch.load, tracer)),
            (torch.UntypedStorage, "resize_", _storage_resize(torch.UntypedStorage.resize_, tracer)),
            (sys, "argv", sys_argv),
            (sys, "path", [str(Path(script).resolve().parent) if module is None else os.getcwd(), *sys.path]),
        ]
        h1, h2 = register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)
        kept: Any = None
        try:
            # the script's own prints go to standard error: standard output is preflight's answer
            with _patched(patches), _library_hooks(), _fake_process_group(max(1, job.world_size), job.rank, job.torchrun), devices, \
                    gpu_device_property(tracer), contextlib.redirect_stdout(sys.stderr):
                try:
                    if module is None:
                        kept = runpy.run_path(script, run_name="__main__")
                    else:
                        kept = runpy.run_module(module, run_name="__main__", alter_sys=True)
                except _Stop as e:
                    kept = e  # its traceback holds the script's frames: its objects live to the trace's end
                except SystemExit as e:
                    if e.code not in (None, 0):
                        raise PreflightError(f"{script}: exited with {e.code!r} while traced") from None
                except PreflightError:
                    raise
                except Exception as e:  # noqa: BLE001 - any failure of the user's script: one line
                    if _own_error(e):
                        raise PreflightError(
                            f"{_where(e, script)}: the script raised {_reason(e)} in its own code, not in torch "
                            f"(not a limit of tracing), after {steps['n']} optimizer step(s) traced") from None
                    raise PreflightError(f"{_where(e, script)}: cannot be traced under fake tensors: "
                                         f"{_reason(e)}") from None
        finally:
            h1.remove()
            h2.remove()
        if steps["n"] == 0:
            raise PreflightError(f"{script}: ran no optimizer step (torch.optim) while traced: nothing to "
                                 "measure a training step by")
        return kept

    _NOTES.clear()
    with target_gpu(sm_major, sms=gpu_sms(gpu_name)):
        rec = run_traced(run, cublas_workspace_bytes=cublas_workspace_bytes, gpu_only=True)
    rec.notes = sorted(_NOTES | set(rec.notes))
    return rec
