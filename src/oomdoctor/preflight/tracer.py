"""Trace the allocations a training step would ask of the CUDA caching allocator, on a CPU, with no memory.

The model and its step run under ``torch._subclasses.fake_tensor.FakeTensorMode`` on **fake CPU tensors**
(fake CUDA tensors abort the process at the first op with a device guard on a CPU-only build:
``embedding`` in GPT-2's forward, "PyTorch is not linked with support for cuda devices", measured with
torch 2.13.0+cpu; see ``docs/preflight.md``). What CUDA would do differently is applied on top:

- **autocast**: CPU autocast runs with :class:`CudaAutocastPolicy` over it, which applies the CUDA lists
  where they differ from CPU's (``aten/src/ATen/autocast_mode.cpp``: ``pow``, ``exp``, ``softmax``,
  ``layer_norm``... run in fp32 on CUDA; ``einsum``, ``addmv``, ``mv`` in the low precision);
- **attention**: ``F.scaled_dot_product_attention`` is sent to the kernel CUDA picks
  (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``): flash attention for fp16/bf16 without a
  mask, memory-efficient attention otherwise; both save the log-sum-exp (``b × h × s`` fp32), never the
  ``b × h × s × s`` matrix. The flash backward's own buffers (``dq_accum``, ``softmax_d``, allocated with
  ``torch::empty`` inside the kernel wrapper, ``flash_api.cpp`` ``mha_bwd``) are added;
- **optimizers**: the foreach and fused kernels are chosen as on CUDA (``torch/optim/optimizer.py``
  ``_default_to_fused_or_foreach`` lists CUDA only), so their temporaries are the CUDA ones.

:class:`AllocationTracer` is a ``TorchDispatchMode`` above the fake mode: every storage an op returns
that it has not seen is an ``alloc`` of ``untyped_storage().nbytes()`` bytes (what the caching allocator
is asked; the allocator model rounds), with the Python stack; before every allocation, storages that died
(``StorageWeakRef.expired()``) are ``free_requested`` + ``free_completed``. Addresses are never reused
(the replay lays blocks out itself). Backward runs on the calling thread on a CPU; on CUDA it runs on the
autograd engine's device thread, so an allocation made inside backward keeps only the frames of Python
code the engine called (hooks, checkpoint recomputation), as a CUDA snapshot shows it. All on stream 0.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import DynamicOutputShapeException as _DynamicOutputShape
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
from torch._subclasses.fake_tensor import unset_fake_temporarily as _unset_fake
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ._private import require
from .attention import CUDNN_WORKSPACE_EXTRA, sdpa_as_cuda
from .reduce import staging_bytes
from .values import StandIns


def _is_fake(t: Any) -> bool:
    return isinstance(t, _FakeTensor)


def _tensors(x: Any, out: list) -> list:
    """The tensors in ``x`` (an op's arguments or outputs: tensors, lists, tuples, dicts of them): a plain walk,
    several times cheaper than ``tree_leaves`` on every op."""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _tensors(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _tensors(y, out)
    return out

BASE_ADDR = 0x7F0000000000
ALIGN = 512
#: files whose frames are the tracer's or the fake mode's own, dropped from stacks
_SKIP = ("oomdoctor/preflight/tracer.py", "oomdoctor/preflight/script.py", "oomdoctor/preflight/attention.py",
         "torch/utils/_python_dispatch.py", "torch/_subclasses/",
         "torch/overrides.py", "torch/_ops.py", "torch/utils/_stats.py", "contextlib.py",
         "torch/_dynamo/", "torch/_compile.py")
#: the frame through which Python enters the autograd engine (``torch/autograd/graph.py``)
_ENGINE_ENTRY = ("_engine_run_backward",)
_MAX_FRAMES = 48
#: the file of the frame through which preflight runs a script (``runpy``'s ``_run_code``): it and the frames below
#: it (the CLI's, or a test's that called it) are not the job's; ``python train.py`` on a GPU has the script's
#: ``<module>`` outermost
_SCRIPT_ENTRY = ("runpy.py", "<frozen runpy>")
_KEEP, _DROP, _ENTRY_FILE = 0, 1, 2
#: filename -> its frames kept, dropped (``_SKIP``) or runpy's (``_SCRIPT_ENTRY``), decided once per file
_SKIPPED: dict[str, int] = {}


def _frames(skip_to_engine: bool) -> list[dict[str, Any]]:
    """The Python stack, innermost first, as snapshot ``frames`` (``filename``, ``line``, ``name``), down to the
    script's own outermost frame where preflight runs a script (:data:`_SCRIPT_ENTRY`): the same stack whoever
    called preflight (the CLI, a test). Inside backward (``skip_to_engine``), only the frames the engine called:
    those inner to its entry."""
    out: list[dict[str, Any]] = []
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if skip_to_engine and code.co_name in _ENGINE_ENTRY:
            return out
        fn = code.co_filename
        kind = _SKIPPED.get(fn)
        if kind is None:
            kind = _SKIPPED[fn] = (_DROP if any(s in fn for s in _SKIP)
                                   else _ENTRY_FILE if fn.endswith(_SCRIPT_ENTRY) else _KEEP)
        if kind == _ENTRY_FILE and code.co_name == "_run_code":
            break
        if kind != _DROP:
            out.append({"filename": fn, "line": f.f_lineno or 0, "name": code.co_name})
        f = f.f_back
    return [] if skip_to_engine else out[:_MAX_FRAMES]


@dataclass
class _Live:
    ref: StorageWeakRef
    addr: int
    size: int
    weak: int  # ref.cdata


@dataclass
class TraceRecord:
    """What the tracer saw. ``events``: snapshot trace entries in order (``action``, ``addr``, ``size``
    bytes, ``stream``, ``time_us``, ``frames``); ``backward_events``: how many allocations were made
    inside backward (on CUDA, the autograd engine's thread); ``step_markers`` / ``phase_markers`` /
    ``tensors``: sidecar facts (:mod:`oomdoctor.capture.metadata`, :mod:`oomdoctor.capture.facts`)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    backward_events: int = 0
    step_markers: list[dict[str, int]] = field(default_factory=list)
    phase_markers: list[dict[str, Any]] = field(default_factory=list)
    tensors: list[dict[str, Any]] = field(default_factory=list)
    #: the sidecar's ``modules`` records (:meth:`AllocationTracer.note_modules`)
    modules: list[dict[str, Any]] = field(default_factory=list)
    extra_allocations: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    #: every kernel the step would launch on the GPU, in order: ``(time_us, flops, bytes)``, ``time_us`` on the
    #: events' clock (phase markers split them), ``flops`` by ``torch.utils.flop_counter``'s formulas (matrix
    #: multiplies, convolutions, attention; 0 for the others), ``bytes`` the tensors it reads and writes
    #: (inputs' and outputs' elements times their size). Views, ``empty*`` and the collectives are not kernels here
    #: (``oomdoctor tune``'s cost model reads them, :mod:`oomdoctor.report.tune`)
    op_costs: list[tuple[int, int, int]] = field(default_factory=list)
    #: the collectives the step issues (the fake process group's, FSDP2's): ``(time_us, op name, bytes)``, bytes
    #: the largest tensor it moves (an all-gather's output, a reduce-scatter's input)
    collectives: list[tuple[int, str, int]] = field(default_factory=list)
    #: stand-in values given for reads of the GPU's values (:mod:`.values`): file, line, kind, read, count
    invented_values: list[dict[str, Any]] = field(default_factory=list)
    #: ids of what the script used that is traced in a stated way (``cuda_streams``, ``cuda_graph``,
    #: ``torch_compile``: :mod:`.script`)
    notes: list[str] = field(default_factory=list)


class AllocationTracer(TorchDispatchMode):
    """Records every storage created and freed under it (see the module doc). Use inside a
    ``FakeTensorMode``; :meth:`mark_step`, :meth:`mark_phase` and :meth:`note_facts` add sidecar facts.
    ``cublas_workspace_bytes``: allocated (and kept, as PyTorch keeps it for the handle and stream) at the
    first matrix multiply of each thread (the main thread and the autograd engine's), 0 to leave out."""

    def __init__(self, *, start_us: int | None = None, cublas_workspace_bytes: int = 0,
                 gpu_only: bool = False) -> None:
        super().__init__()
        #: record only the storages on the GPU (a user's script, :mod:`.script`): those made while
        #: :meth:`on_gpu` is active (``.cuda()``, ``device="cuda"``), and the outputs of ops that read one
        self.gpu_only = gpu_only
        self._gpu_depth = 0
        self._host_depth = 0
        #: ops being dispatched under this mode (torch's own code runs there: a fake tensor's device is its own)
        self.dispatch_depth = 0
        self.record = TraceRecord()
        self._live: dict[int, _Live] = {}
        self._weak: dict[int, int] = {}  # storage key -> weak reference handle, for collect()
        #: storages of the GPU resized to 0 bytes in place (:meth:`resized`), by key: given bytes again, they allocate
        self._emptied: dict[int, StorageWeakRef] = {}
        self._next = BASE_ADDR
        self._t = start_us if start_us is not None else time.time_ns() // 1000
        self._cublas = cublas_workspace_bytes
        self._cublas_threads: set[Any] = set()
        #: private builtins, each behind a check (:mod:`._private`): the one under StorageWeakRef.expired, called
        #: per live storage per op, and the autograd engine's current node (inside backward or not)
        self._expired = require("torch._C.StorageBase._expired")
        self._autograd_node = require("torch._C._current_autograd_node")
        self._accumulate_grad = require("torch._C._functions.AccumulateGrad")
        #: the values read from the GPU, by the policy of :mod:`.values`, and where
        self.values = StandIns()
        #: set by :meth:`stop`: the trace has ended (a script stopped at its last step); ops still run, unrecorded
        self.stopped = False
        #: autograd nodes being applied, one counter per engine run (a nested backward, reentrant checkpointing,
        #: starts its own): between two applies the engine only accumulates gradients (:meth:`_accumulate`)
        self.applying: list[int] = []

    # -- clock and events
    def _tick(self) -> int:
        self._t += 1
        return self._t

    def _event(self, action: str, addr: int, size: int, frames: list) -> None:
        self.record.events.append({"action": action, "addr": addr, "size": size, "stream": 0,
                                   "time_us": self._tick(), "compile_context": "N/A", "user_metadata": "",
                                   "frames": frames})

    def _alloc(self, size: int, backward: bool) -> int:
        # the frees of storages that died since the last allocation come first: collected here, not before every op
        # (an op that allocates nothing needs no frees recorded before it; the order of allocations and frees is
        # the same, and most ops are views, in-place updates or reads)
        self.collect()
        addr = self._next
        self._next += (size + ALIGN - 1) // ALIGN * ALIGN or ALIGN
        self._event("alloc", addr, size, _frames(backward))
        if backward:
            self.record.backward_events += 1
        return addr

    def _free(self, addr: int, size: int) -> None:
        self._event("free_requested", addr, size, [])
        self._event("free_completed", addr, size, [])

    def stop(self) -> None:
        """End the trace here: what runs after (a framework's teardown catching the stop, moving the model to the
        host) is not recorded, as a snapshot dumped at this point does not hold it."""
        self.collect()
        self.stopped = True

    def collect(self) -> None:
        """Record the frees of every storage that died since the last call."""
        if self.stopped:
            return
        expired = self._expired
        if not any(map(expired, self._weak.values())):  # a C loop: most ops free nothing
            return
        for k in [k for k, w in self._weak.items() if expired(w)]:
            self._forget(k, self._live[k])

    def _track(self, st: torch.UntypedStorage, n: int, backward: bool) -> int:
        """Record the allocation of ``n`` bytes for the live storage ``st``, kept until it dies or is resized."""
        addr = self._alloc(n, backward)
        ref = StorageWeakRef(st)
        self._live[st._cdata] = _Live(ref, addr, n, ref.cdata)
        self._weak[st._cdata] = ref.cdata
        return addr

    def _forget(self, key: int, live: _Live) -> None:
        """Record the free of the storage ``key`` holds (``live``), which is no longer tracked."""
        del self._live[key]
        self._weak.pop(key, None)
        self._free(live.addr, live.size)

    def see(self, t: torch.Tensor, backward: bool = False) -> int | None:
        """The address of ``t``'s storage, recording its allocation when new (None: no bytes)."""
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse, nested: no plain storage
            return None
        n = int(st.nbytes())
        if n == 0:
            return None
        key = st._cdata
        live = self._live.get(key)
        if live is not None and not live.ref.expired():
            return live.addr
        if live is not None:  # the address of a dead storage reused before we looked
            self._forget(key, live)
        return self._track(st, n, backward)

    def resized(self, st: torch.UntypedStorage, nbytes: int) -> None:
        """``st`` resized in place to ``nbytes`` (``UntypedStorage.resize_``): on the GPU its block is freed and, for
        a size other than 0, a block of the new size allocated (``StorageImpl`` ``resize_bytes_cuda``: a new data
        pointer, the old one freed). FSDP2 frees each unsharded parameter's storage this way after its forward
        (``reshard_after_forward``) and gives it back before backward (``_fsdp_param.py`` ``free_storage``,
        ``alloc_storage``): the same tensors, so without this the trace kept every gathered parameter alive to the
        step's end (measured on an H200: ``tests/data/preflight_scripts/fsdp2_reset.py``). A storage this trace has
        not seen (the host's) is left alone."""
        if self.stopped:
            return
        key = st._cdata
        live = self._live.get(key)
        if live is not None and not live.ref.expired():
            if nbytes == live.size:
                return
            self._forget(key, live)
        else:
            emptied = self._emptied.pop(key, None)
            if emptied is None or emptied.expired():
                return
        if nbytes == 0:
            self._emptied[key] = StorageWeakRef(st)
            return
        self._track(st, nbytes, self._autograd_node() is not None)

    def addr_of(self, t: torch.Tensor) -> tuple[int, int] | None:
        """``(address, nbytes)`` of a live storage seen before, else None."""
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return None
        live = self._live.get(st._cdata)
        return (live.addr, live.size) if live is not None and not live.ref.expired() else None

    def temporary(self, size: int, backward: bool, keep: bool = False) -> int:
        """An allocation no tensor output shows (a kernel's own buffer), freed at once unless ``keep``."""
        addr = self._alloc(size, backward)
        if not keep:
            self._free(addr, size)
        return addr

    # -- GPU or host (gpu_only)
    @contextlib.contextmanager
    def on_gpu(self, gpu: bool = True) -> Iterator[None]:
        """While active, the storages ops make are on the GPU (``gpu``) or on the host (not recorded)."""
        if gpu:
            self._gpu_depth += 1
        else:
            self._host_depth += 1
        try:
            yield
        finally:
            if gpu:
                self._gpu_depth -= 1
            else:
                self._host_depth -= 1

    def is_gpu(self, t: Any) -> bool:
        """Whether ``t``'s storage is a live one on the GPU (always, unless ``gpu_only``)."""
        t = getattr(t, "_local_tensor", t)  # a DTensor (FSDP2, tensor parallel): its shard on this rank
        if not self.gpu_only:
            return True
        if isinstance(t, torch.device):  # a factory's device=: a fake CUDA tensor (made where no
            return t.type == "cuda"      # TorchFunctionMode runs: hooks in the autograd engine)
        return _is_fake(t)  # the host is real: every fake tensor is the GPU's

    # -- markers and facts
    def mark_step(self, step: int) -> None:
        self.collect()
        self.record.step_markers.append({"step": step, "time_us": self._tick()})

    def mark_phase(self, phase: str) -> None:
        """From here on ``phase``. The marker takes a tick of its own: an op that allocates nothing (fused AdamW's
        step) is noted at the clock's time, which is then the marker's, not the phase's before it."""
        self.collect()
        self.record.phase_markers.append({"phase": phase, "time_us": self._tick()})

    def note_modules(self, step: int) -> None:
        """The sidecar's ``modules`` record (:mod:`oomdoctor.capture.facts`, as the recorder notes it at the end of
        the first optimizer step): every root ``nn.Module``'s parameters (trained, untouched, frozen), gradients and
        buffers on the fake GPU, at this tracer's addresses. LoRA's frozen base, a teacher, an EMA's copy and a
        registered queue are then named by their module, as on a GPU (issue 54)."""
        import gc

        from ..capture.facts import module_record, module_roots

        self.collect()
        objects = gc.get_objects()
        try:
            roots = module_roots(objects, torch.nn.Module)
        finally:
            del objects

        def where(t: Any) -> tuple[int, int] | None:
            return self.addr_of(getattr(t, "_local_tensor", t)) if isinstance(t, torch.Tensor) else None

        self.record.modules.append({"step": step, "time_us": self._t, "roots": module_record(roots, 0, storage=where)})

    def note_facts(self, step: int, kinds: Mapping[str, Sequence[torch.Tensor]]) -> None:
        """The sidecar's ``tensors`` record (:mod:`oomdoctor.capture.facts`): the storages of each kind."""
        self.collect()
        rec: dict[str, Any] = {"step": step, "time_us": self._t}
        for kind in ("parameters", "gradients", "optimizer_state"):
            seen = {a for t in kinds.get(kind, ()) if (a := self.addr_of(t)) is not None}
            rec[kind] = sorted([a, n] for a, n in seen)
        self.record.tensors.append(rec)

    # -- the dispatch hook
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.dispatch_depth += 1  # inside, a fake tensor's device is the fake CPU one (gpu_device_property)
        try:
            return self._dispatch(func, args, kwargs or {})
        finally:
            self.dispatch_depth -= 1

    def _dispatch(self, func, args, kwargs):
        if func is _aten._unsafe_view.default:
            # below autograd (where this mode runs) it is view: the same aliasing; the fake mode's cache refuses it
            # ("unsafe view") and its uncached path cost ~6 ms a call, once in every matmul of a batched input
            func = _aten.view.default
        if self.stopped:
            return func(*args, **kwargs)
        if self.gpu_only and isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type == "cuda":
            kwargs = {**kwargs, "device": _CPU}  # a factory given a GPU tensor's device: the fake CPU one
            with self.on_gpu(True):
                return self._dispatch(func, args, kwargs)
        if func in _VALUE_READS and _is_fake(args[0]):  # a value read from the GPU: a stand-in (values.py)
            if func is _aten.equal.default:
                return self.values.equal(args[0], args[1])
            return self.values.scalar(args[0])
        backward = self._autograd_node() is not None
        if backward and func is _aten.add.Tensor and self.applying and not self.applying[-1] \
                and not isinstance(self._autograd_node(), self._accumulate_grad):
            out = self._accumulate(args, kwargs)
            if out is not None:
                return out
        leaves = _tensors(kwargs, _tensors(args, []))
        if self.gpu_only and not self._gpu_depth:
            if self._host_depth or not any(self.is_gpu(t) for t in leaves):
                with _unset_fake():  # the host's: run for real, not the caching allocator's
                    return func(*args, **kwargs)
        if self._cublas and backward not in self._cublas_threads and func in _MATMULS:
            self._cublas_threads.add(backward)
            addr = self.temporary(self._cublas, backward, keep=True)
            self.record.extra_allocations.append({"what": "cublas_workspace", "addr": addr, "bytes": self._cublas,
                                                  "backward": backward})
        if self._cublas and ("lt", backward) not in self._cublas_threads and func in _LT_MATMULS:
            self._cublas_threads.add(("lt", backward))
            addr = self.temporary(CUBLASLT_WORKSPACE_BYTES, backward, keep=True)
            self.record.extra_allocations.append({"what": "cublaslt_workspace", "addr": addr,
                                                  "bytes": CUBLASLT_WORKSPACE_BYTES, "backward": backward})
        if func is _aten.convolution.default and torch.backends.cudnn.benchmark \
                and "cudnn_benchmark" not in self.record.notes:
            # cuDNN's autotuner runs on a new convolution shape: its workspace is sized by cuDNN (Conv_v8.cpp)
            self.record.notes.append("cudnn_benchmark")
        copies: list[int] = []
        if self.gpu_only and not self._gpu_depth:  # host tensors a device op reads are copied in (index tensors)
            # (a DTensor is the GPU's when its shard is: FSDP2's optimizer steps on them, in place)
            copies = [t.untyped_storage().nbytes() for t in leaves if t.dim() > 0 and not self.is_gpu(t)]
        copied = [self.temporary(n, backward, keep=True) for n in copies]
        try:
            if func is _aten.sparse_mask.default and _is_fake(args[1]) and args[1].is_sparse:
                out = _sparse_mask(args[0], args[1])
            elif func in _RANDOM_IN_PLACE and _is_dtensor(args[0]):
                out = _random_on_shard(func, args, kwargs)
            else:
                out = func(*args, **kwargs)
        except _DynamicOutputShape:
            out = self.values.upper_bound(func, args, kwargs)  # a data-dependent shape: its largest size
            if out is None:
                raise
        for t in _tensors(out, []):
            # a DTensor's shard is made by its own dispatch, below this mode: seen here
            t = getattr(t, "_local_tensor", t)
            if t.layout is torch.sparse_coo:  # no storage of its own: its indices and values have theirs
                self.see(t._indices(), backward)
                self.see(t._values(), backward)
            else:
                self.see(t, backward)
        # a kernel's own buffers come after its outputs, as on the GPU (the H200's snapshots: a reduction's output,
        # then its staging buffer and semaphores; cuDNN attention's dq, dk, dv, then its workspace; flash's too)
        extra = _kernel_buffers(func, args)
        buffers = [self.temporary(n, backward, keep=True) for n in extra]
        for a, n in [*zip(buffers, extra), *zip(copied, copies)]:
            self._free(a, n)
        self._cost(func, args, kwargs, out)
        if self.gpu_only:
            self.values.propagate(func, args, kwargs, out, leaves)
        return out

    def _accumulate(self, args: Any, kwargs: Any) -> Any:
        """The autograd engine adding a second gradient into an input's buffer (``input_buffer.cpp``
        ``accumulate``), as it does with no dispatch mode: in place into the buffer's tensor, else into the new one,
        when that one is dense and not overlapping (``can_accumulate_inplace``); no new storage. Under a dispatch
        mode (this tracer) the engine adds out of place (``isTensorSubclassLike`` is true for every tensor then),
        which allocated one gradient-sized tensor per accumulation that a GPU never makes (measured on CPU tensors:
        ``aten::add_`` without a mode, ``aten::add`` under one; minGPT's GELU, two per block). None: the add is
        left as it is (grad mode on: ``create_graph``; a scaled add; neither operand in place-able)."""
        if torch.is_grad_enabled() or kwargs.get("alpha", 1) != 1 or len(args) != 2:
            return None
        a, b = args
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype:
            return None
        for dst, src in ((a, b), (b, a)):
            if dst.shape == torch.broadcast_shapes(a.shape, b.shape) and _dense(dst) and not dst._is_view():
                return dst.add_(src)
        return None

    def _cost(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Note the op as a kernel (:attr:`TraceRecord.op_costs`) or a collective (:attr:`TraceRecord.collectives`).
        Facts for a cost model only: nothing here changes what is allocated."""
        ns = func.namespace
        if ns in _COLLECTIVE_NAMESPACES:
            size = max((_nbytes(t) for t in _tensors((args, kwargs, out), [])), default=0)
            self.record.collectives.append((self._t, func.__name__, size))
            return
        if ns not in _KERNEL_NAMESPACES or func.is_view or func in _NOT_KERNELS:
            return
        moved = sum(_nbytes(t) for t in _tensors((args, kwargs, out), []))
        flops = 0
        formula = _flop_registry().get(func._overloadpacket)
        if formula is not None:
            try:
                flops = int(formula(*args, **(kwargs or {}), out_val=out))
            except Exception:  # noqa: BLE001 - a formula that does not take these arguments: no FLOPs counted
                flops = 0
        self.record.op_costs.append((self._t, flops, moved))


_aten = torch.ops.aten
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
#: namespaces whose ops run a kernel on the device (``prim``, ``profiler``: bookkeeping, no kernel)
_KERNEL_NAMESPACES = frozenset({"aten", "fsdp"})
#: allocations without a kernel
_NOT_KERNELS = frozenset({_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                          _aten.lift_fresh.default, _aten._local_scalar_dense.default})


def _nbytes(t: torch.Tensor) -> int:
    t = getattr(t, "_local_tensor", t)
    try:
        return int(t.numel()) * t.element_size()
    except (NotImplementedError, RuntimeError):
        return 0


_FLOPS: dict[Any, Any] = {}


def _flop_registry() -> dict[Any, Any]:
    """``torch.utils.flop_counter``'s FLOP formulas by op (matmuls ``2·m·n·k``, convolutions, attention forward and
    backward), loaded once."""
    if not _FLOPS:
        from torch.utils.flop_counter import flop_registry

        _FLOPS.update(flop_registry)
    return _FLOPS


_CPU = torch.device("cpu")
#: ops that read a value from a tensor (``.item()``, ``bool()``, ``float()``, ``tolist()``, ``torch.equal``)
_VALUE_READS = {_aten._local_scalar_dense.default, _aten.equal.default}
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
#: GEMMs with a bias epilogue, which go through cuBLASLt and its own workspace
_LT_MATMULS = {_aten.addmm.default}
CUBLASLT_WORKSPACE_BYTES = 1 << 20
"""cuBLASLt's workspace (``CUDABlas.cpp`` ``_getLtWorkspaceSize``, 1024 KiB): one 1 MiB block right after
the first cuBLAS workspace of the main thread in the real Trainer snapshot of the corpus (
``trainer-ddp-gpt2-b88``, event 281); none on the backward thread, whose GEMMs have no bias epilogue."""


#: reductions through ``gpu_reduce_kernel`` (``Reduce.cuh``), the dims argument second in those of the second set
_REDUCTIONS_DIM = {_aten.sum.dim_IntList, _aten.mean.dim}
_REDUCTIONS = _REDUCTIONS_DIM | {_aten.sum.default, _aten.mean.default}


def _dense(t: torch.Tensor) -> bool:
    """``is_non_overlapping_and_dense`` (``c10/core/TensorImpl``): the elements, in some order of the dimensions,
    fill their span exactly once (sizes of 1 aside)."""
    if not t.numel():
        return False
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


_RANDOM_IN_PLACE = frozenset(getattr(_aten, name).default for name in (
    "uniform_", "normal_", "exponential_", "log_normal_", "cauchy_", "geometric_"))


def _is_dtensor(t: Any) -> bool:
    """``t`` is a ``torch.distributed.tensor.DTensor`` (a class check; its module imported only when the script has
    made one)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def _random_on_shard(func: Any, args: Any, kwargs: Any) -> Any:
    """An in-place random fill of a DTensor (``nn.init`` on FSDP2's sharded parameters, ``reset_parameters`` after
    ``to_empty``), done on its shard: on the GPU it writes the shard in place and allocates nothing. DTensor's own
    path (``_dispatch.py``) moves the GPU generator's Philox offset (``_random.py``) and propagates the sharding on
    fake arguments of the mesh's device, ``cuda``, whose default generator a CPU build of torch does not have."""
    func(args[0]._local_tensor, *args[1:], **kwargs)
    return args[0]


def _sparse_mask(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``aten::sparse_mask`` of ``t`` (dense or sparse) by a sparse COO ``mask`` on the fake GPU: the mask's
    indices, copied, and ``t``'s values at them, ``nnz(mask)`` of ``t``'s dense dimensions (``SparseTensor.cpp``
    ``sparse_mask``: ``t.mul(mask_template)``, a new sparse tensor with the mask's indices). The fake mode has no
    values to intersect, and gives it none (nnz 0); the backward of a tensor built by ``torch.sparse_coo_tensor``
    from a trained vector (peft's SHiRA adapters, ``get_delta_weight``) is such a mask of the dense gradient, and
    autograd then refuses a gradient of 0 values for a vector of nnz (``validate_outputs``)."""
    values = _aten.empty.memory_format([mask._nnz(), *t.shape[mask.sparse_dim():]], dtype=t.dtype, device=t.device)
    indices = _aten.clone.default(mask._indices())
    return _aten._sparse_coo_tensor_with_dims_and_tensors.default(
        mask.sparse_dim(), mask.dense_dim(), list(t.shape), indices, values, dtype=t.dtype, layout=torch.sparse_coo,
        device=t.device, is_coalesced=mask.is_coalesced())


def _kernel_buffers(func, args) -> list[int]:
    """Bytes a CUDA kernel wrapper allocates for itself and frees before it returns (not outputs).

    Flash attention v2 backward (``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``
    ``mha_bwd``): ``softmax_d`` of ``b × h × round_up(s_q, 128)`` fp32 and ``dq_accum`` of
    ``b × round_up(s_q, 128) × h × d`` fp32 (one split; ``deterministic=False``). cuDNN attention: 256 B in the
    forward, ``b × h × s_q × (d + 1) × 4 + 256`` in the backward (measured on an H200, :mod:`.attention`). A sum or
    mean split across thread blocks: its partial results and semaphores (``Reduce.cuh``, :mod:`.reduce`)."""
    if func is _aten._safe_softmax.default:
        # CompositeExplicitAutograd (attention.cpp ``_safe_softmax``): softmax, then ``self.eq(-inf)`` (bool, one
        # byte an element), ``all`` over the dim (bool, one a row) and a 0-dim zero, freed when it returns; the fake
        # mode computes the output only. Seen on the H200 in T5's math attention (64 MiB, 128 KiB, 4 B a call).
        x, dim = args[0], args[1]
        n = x.numel()
        return [n, n // max(int(x.shape[dim]), 1), 4] if n else []
    if func in _REDUCTIONS:
        # Reduce.cuh's staging buffers when the input is split across blocks (a linear layer's bias gradient)
        return staging_bytes(args[0], args[1] if len(args) > 1 and func in _REDUCTIONS_DIM else None)
    if func is _aten._scaled_dot_product_cudnn_attention.default:
        return [CUDNN_WORKSPACE_EXTRA]  # the forward's workspace (measured, attention.py's module doc)
    if func is _aten._scaled_dot_product_cudnn_attention_backward.default:
        q = args[1]  # (grad_out, query, key, value, out, logsumexp, ...), query is b × h × s × d
        b, h, s, d = (int(x) for x in q.shape)
        return [b * h * s * (d + 1) * 4 + CUDNN_WORKSPACE_EXTRA]
    if func is _aten._scaled_dot_product_flash_attention_backward.default:
        q = args[1]  # (grad_out, query, key, value, out, logsumexp, ...), query is b × h × s × d
        b, h, s, d = (int(x) for x in q.shape)
        s_r = (s + 127) // 128 * 128
        return [b * h * s_r * 4, b * s_r * h * d * 4]
    return []


# -- CUDA autocast applied over CPU autocast -------------------------------------------------------------

#: ops CUDA autocast runs in fp32 that CPU autocast leaves alone (``autocast_mode.cpp``, ``KERNEL_CUDA``
#: ``fp32`` list)
_FP32_FUNCS = {
    torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.exp, torch.Tensor.exp, torch.log, torch.Tensor.log,
    torch.log1p, torch.expm1, torch.rsqrt, torch.Tensor.rsqrt, torch.reciprocal, torch.Tensor.reciprocal,
    torch.acos, torch.asin, torch.cosh, torch.sinh, torch.tan, torch.erfinv, torch.log2, torch.log10,
    F.layer_norm, F.group_norm, F.softplus, torch.layer_norm, torch.group_norm, torch.logsumexp,
    torch.Tensor.logsumexp, F.cosine_similarity, torch.cdist, torch.dist, torch.renorm, F.kl_div, F.l1_loss,
    F.smooth_l1_loss, F.huber_loss, F.mse_loss, F.nll_loss, F.binary_cross_entropy_with_logits,
}
#: ops CUDA autocast runs in fp32 by passing ``dtype=torch.float32`` (``fp32_set_opt_dtype``): no copy of
#: the input, an fp32 output
_FP32_DTYPE_FUNCS = {
    F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax,
    torch.cumsum, torch.Tensor.cumsum, torch.cumprod, torch.Tensor.cumprod, torch.prod, torch.Tensor.prod,
}
#: ops CUDA autocast runs in the low precision that CPU autocast does not cast
_LOW_FUNCS = {torch.einsum, torch.addmv, torch.mv, torch.Tensor.mv, torch.addr, torch.chain_matmul,
              torch.linalg.multi_dot}


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


class CudaAutocastPolicy(TorchFunctionMode):
    """CUDA's autocast lists where they differ from CPU's, and the attention kernel CUDA would pick.
    Active while CPU autocast is (``torch.is_autocast_enabled("cpu")``); attention always."""

    def __init__(self, tracer: AllocationTracer | None = None) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _F_DROPOUT:
            out = _dropout(*args, **kwargs)
            if out is not NotImplemented:
                return out
            return func(*args, **kwargs)
        if func is F.cross_entropy and torch.is_autocast_enabled("cpu"):
            out = _cross_entropy(*args, **kwargs)
            if out is not NotImplemented:
                return out
            return func(*args, **kwargs)
        if func is _F_SDPA:
            return _sdpa(*args, **kwargs)
        if not torch.is_autocast_enabled("cpu"):
            return func(*args, **kwargs)
        low = torch.get_autocast_dtype("cpu")
        if func in _FP32_FUNCS:
            with torch.autocast("cpu", enabled=False):
                return func(*_cast(args, torch.float32), **kwargs)
        if func in _FP32_DTYPE_FUNCS and kwargs.get("dtype") is None:
            x = args[0] if args else kwargs.get("input")
            if isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16):
                kwargs = {**kwargs, "dtype": torch.float32}
            return func(*args, **kwargs)
        if func in _LOW_FUNCS:
            with torch.autocast("cpu", enabled=False):
                return func(*_cast(args, low), **kwargs)
        return func(*args, **kwargs)


#: ``torch.nn.functional``'s own functions, kept before :func:`composites_as_cuda` rebinds the names
_F_SDPA = F.scaled_dot_product_attention
_F_DROPOUT = F.dropout


def _sdpa_entry(*args: Any, **kwargs: Any) -> Any:
    return _sdpa(*args, **kwargs)


def _dropout_entry(*args: Any, **kwargs: Any) -> Any:
    out = _dropout(*args, **kwargs)
    return _F_DROPOUT(*args, **kwargs) if out is NotImplemented else out


@contextlib.contextmanager
def composites_as_cuda() -> Iterator[None]:
    """While active, ``torch.nn.functional``'s names ``scaled_dot_product_attention`` and ``dropout`` run CUDA's kernel
    choice (:func:`_sdpa`, :func:`_dropout`) wherever they are called from. A ``TorchFunctionMode`` does not see the
    torch functions that a Python-implemented torch function calls (the mode is off while it handles the outer
    one): ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, ``nn.Transformer``) called SDPA and dropout
    past :class:`CudaAutocastPolicy`, so they ran CPU's kernels (measured on Lightning's ``nn.Transformer`` example:
    CPU's attention with its ``b × h × s × s`` scores, 2.4% over the H200's peak). Its body looks them up in
    ``torch.nn.functional``'s namespace at each call; rebinding the names there reaches it. A call through another
    binding still meets :class:`CudaAutocastPolicy`."""
    saved = (F.scaled_dot_product_attention, F.dropout)
    F.scaled_dot_product_attention, F.dropout = _sdpa_entry, _dropout_entry
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.dropout = saved


def _dropout(input, p=0.5, training=True, inplace=False):
    """Dropout as CUDA runs it: ``native_dropout``, whose mask is ``bool`` (1 byte an element); CPU's
    ``_dropout_impl`` saves a noise tensor of the input's dtype instead (``aten/src/ATen/native/Dropout.cpp``
    ``is_fused_kernel_acceptable``: CUDA, XPU, lazy and privateuse1 only). NotImplemented where CUDA would
    not take the fused kernel either."""
    if not training or inplace or not 0 < p < 1 or input.numel() == 0:
        return NotImplemented
    return _aten.native_dropout(input, p, True)[0]


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    """Cross-entropy of a low-precision input as CUDA autocast runs it: ``cross_entropy_loss`` is on CPU autocast's
    fp32 list (the input cast to fp32, then an fp32 log-softmax) but on none of CUDA's, so on CUDA its
    CompositeImplicit body runs (``LossNLL.cpp``): ``log_softmax(self, class_dim, self.scalar_type())`` keeps the
    low precision (a dtype is given: ``fp32_set_opt_dtype`` leaves it), then ``nll_loss`` (CUDA's fp32 list) casts
    the log-probabilities to fp32, a copy ``nll_loss``'s backward keeps. Measured on an H200 (T5, bf16 logits of 32 x
    128 x 32,128): 263 MB bf16 then 526 MB fp32, where CPU's lists give 526 + 526 MB. NotImplemented (CPU's
    path) for label smoothing, probability targets and the legacy ``size_average``/``reduce``."""
    if (size_average is not None or reduce is not None or label_smoothing or not isinstance(input, torch.Tensor)
            or input.dtype not in (torch.float16, torch.bfloat16) or target.is_floating_point()):
        return NotImplemented
    class_dim = 0 if input.dim() == 1 else 1
    with torch.autocast("cpu", enabled=False):
        logp = torch.log_softmax(input, class_dim, dtype=input.dtype)
        return F.nll_loss(logp.float(), target, _cast(weight, torch.float32), ignore_index=ignore_index,
                          reduction=reduction)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Scaled dot-product attention through the kernel CUDA picks (:mod:`.attention`), after CUDA autocast's cast."""
    if torch.is_autocast_enabled("cpu"):
        # CUDA autocast's lower-precision list casts every floating argument of scaled_dot_product_attention,
        # the attention mask too (autocast_mode.cpp, KERNEL_CUDA(scaled_dot_product_attention, lower_precision_fp)):
        # T5's fp32 position bias becomes a low-precision copy
        low = torch.get_autocast_dtype("cpu")
        query, key, value = (_cast(x, low) for x in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = _cast(attn_mask, low)
    with torch.autocast("cpu", enabled=False):
        return sdpa_as_cuda(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


# -- optimizers as on CUDA ---------------------------------------------------------------------------------

@contextlib.contextmanager
def cuda_optimizer_defaults() -> Iterator[None]:
    """While active, ``torch.optim`` picks foreach and fused kernels for CPU tensors as it does for CUDA
    ones (``_get_foreach_kernels_supported_devices`` / ``_get_fused_kernels_supported_devices``)."""
    import torch.optim.optimizer as opt
    import torch.utils._foreach_utils as fu
    from torch._subclasses.fake_tensor import FakeTensor

    for name in ("torch.optim.optimizer._get_foreach_kernels_supported_devices",
                 "torch.optim.optimizer._get_fused_kernels_supported_devices",
                 "torch.optim.optimizer._foreach_supported_types",
                 "torch.utils._foreach_utils._get_foreach_kernels_supported_devices",
                 "torch.utils._foreach_utils._get_fused_kernels_supported_devices"):
        require(name)
    saved = (opt._get_foreach_kernels_supported_devices, opt._get_fused_kernels_supported_devices,
             fu._get_foreach_kernels_supported_devices, fu._get_fused_kernels_supported_devices)
    types = list(opt._foreach_supported_types)
    opt._foreach_supported_types[:] = types + [FakeTensor]  # the type check of _default_to_fused_or_foreach

    def foreach() -> list[str]:
        return ["cuda", "cpu"]

    def fused() -> list[str]:
        return ["cuda", "cpu"]

    opt._get_foreach_kernels_supported_devices = foreach
    opt._get_fused_kernels_supported_devices = fused
    fu._get_foreach_kernels_supported_devices = foreach
    fu._get_fused_kernels_supported_devices = fused
    try:
        yield
    finally:
        opt._foreach_supported_types[:] = types
        (opt._get_foreach_kernels_supported_devices, opt._get_fused_kernels_supported_devices,
         fu._get_foreach_kernels_supported_devices, fu._get_fused_kernels_supported_devices) = saved


@contextlib.contextmanager
def traced(tracer: AllocationTracer) -> Iterator[Any]:
    """``FakeTensorMode`` (fake CPU tensors), the CUDA policies, and ``tracer`` over them. Yields the
    fake mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake, cuda_optimizer_defaults(), tracer, CudaAutocastPolicy(tracer), composites_as_cuda(), \
            engine_applies(tracer):
        yield fake
    tracer.collect()


@contextlib.contextmanager
def engine_applies(tracer: AllocationTracer) -> Iterator[None]:
    """While active, every backward run (``torch.autograd.graph._engine_run_backward``, the engine's entry from
    Python) marks in ``tracer.applying`` when a node of its graph is being applied: a pre-hook and a post-hook on
    each node (``Node.register_prehook`` / ``register_hook``, removed when the run ends), so the engine's gradient
    accumulation, which happens between a node's post-hooks and the next node's pre-hooks, is told apart from the
    nodes' own ops (:meth:`AllocationTracer._accumulate`)."""
    graph = torch.autograd.graph
    orig = require("torch.autograd.graph._engine_run_backward")

    def run(t_outputs: Any, *a: Any, **k: Any) -> Any:
        tracer.applying.append(0)
        slot = len(tracer.applying) - 1  # this run's counter: a nested run (reentrant checkpointing) has its own

        def pre(*_: Any) -> None:
            tracer.applying[slot] += 1

        def post(*_: Any) -> None:
            tracer.applying[slot] -= 1

        handles = []
        seen: set[int] = set()
        roots = t_outputs if isinstance(t_outputs, (list, tuple)) else [t_outputs]
        todo = [getattr(t, "grad_fn", None) for t in roots]
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if not isinstance(node, tracer._accumulate_grad):  # its own apply: .grad's accumulation, traced as is
                handles += [node.register_prehook(pre), node.register_hook(post)]
            todo.extend(n for n, _ in node.next_functions)
        try:
            return orig(t_outputs, *a, **k)
        finally:
            tracer.applying.pop()
            for h in handles:
                h.remove()

    patches = [(graph, "_engine_run_backward"), (torch.autograd, "_engine_run_backward")]
    saved = [(m, n, getattr(m, n)) for m, n in patches if hasattr(m, n)]
    for m, n, _ in saved:
        setattr(m, n, run)
    try:
        yield
    finally:
        for m, n, v in saved:
            setattr(m, n, v)


def run_traced(fn: Callable[[AllocationTracer], Any], **tracer_kw: Any) -> TraceRecord:
    """Run ``fn(tracer)`` under :func:`traced`; the record, with its wall time (s). What ``fn`` returns
    (the model, the optimizer) is held until the record is closed, so the trace ends, as a snapshot
    dumped after training does, with it still allocated."""
    t0 = time.perf_counter()
    tracer = AllocationTracer(**tracer_kw)
    with traced(tracer):
        kept = fn(tracer)
    tracer.collect()
    del kept
    tracer.record.wall_s = time.perf_counter() - t0
    tracer.record.invented_values = tracer.values.as_list()
    return tracer.record



@contextlib.contextmanager
def gpu_device_property(tracer: AllocationTracer) -> Iterator[None]:
    """While active, a fake tensor answers ``.device`` as ``cuda:0`` to the traced program's Python code (the
    host is real, only the GPU's tensors are fake: ``torch.zeros(n, device=x.device)`` then makes a GPU tensor,
    and ``x.device.type == "cuda"`` holds), and its own fake CPU device inside the ops ``tracer`` dispatches
    (``FakeTensorMode`` computes its outputs' device from it: a fake CUDA tensor would abort on a CPU build).
    ``FakeTensor.device`` is a Python property (``torch/_subclasses/fake_tensor.py``), replaced for the while."""
    cuda0 = torch.device("cuda", 0)
    meta = torch.device("meta")
    orig = _FakeTensor.__dict__["device"]

    def device(self: Any) -> torch.device:
        if self.fake_mode.in_kernel_invocation:
            return meta
        return cuda0 if tracer.dispatch_depth == 0 else self.fake_device

    _FakeTensor.device = property(device, orig.fset)  # pyright: ignore[reportAttributeAccessIssue] (torch private: FakeTensor's device patched)
    try:
        yield
    finally:
        _FakeTensor.device = orig
