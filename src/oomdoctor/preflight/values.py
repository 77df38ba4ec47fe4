"""Values read from the fake GPU: the stand-ins preflight gives, by a stated policy, and where it gave them.

A fake tensor has a shape and no values. A training script reads some anyway: ``loss.item()`` to log,
``bool(torch.isnan(loss))`` to skip a step, GradScaler's ``found_inf``, ``x[mask]`` whose length is the number
of true elements. Each read gets a **stand-in** (issue 50, item 2; ``docs/preflight.md``, "Values read from the
GPU"):

- ``false``: a check (``isnan``, ``isinf``, a comparison, ``any``/``all`` of one, ``torch.equal``) is False;
  GradScaler's ``found_inf`` (written by ``_amp_foreach_non_finite_check_and_unscale_``) is 0, so every step
  runs; ``isfinite`` is True. These are carried as **constants** through the ops that combine them (``logical_or``,
  ``sum`` of the per-device ``found_inf``...): an op whose fake inputs are all small constants is computed on real
  tensors, and its output is a constant when uniform.
- ``finite``: a loss or metric read as a number (``.item()``, ``float()``, ``print``, an f-string) is finite:
  ``1 / (1 + k)`` at the ``k``-th read of the same line, positive and decreasing, so a loss "improves" at every
  read and early stopping on it never triggers (the longer path: the upper bound); an integer is 1.
- ``upper_bound``: a data-dependent shape (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``) takes
  its largest possible size, every element selected; the count of a boolean tensor (``mask.sum()``) is its size.
  The peak is never under-predicted by them.

Values preflight **knows** are not stand-ins: a host tensor copied to the GPU (``.to("cuda")``, ``.cuda()``) whose
elements are all equal (an all-ones attention mask, a constant label) keeps that value, as do ``zeros``/``ones``/
``full``, and ops on known values are computed. A read of one is exact and not listed. Measured: Hugging Face's
mask code asks ``attention_mask.all()`` to skip the mask of a batch without padding; answered False, a T5 trace
built a ``b × 1 × s × s`` mask and a ``b × h × s × s`` fp32 position-bias mask per layer that the GPU never made.
A known value stays known until its storage is written (by any view of it: each write bumps the storage's
generation, and a value tagged at an older generation is forgotten).

Every read is recorded with the script's (or library's) file and line, the kind, how it was read, and a count
(:attr:`StandIns.records`): the output lists them as ``invented_values`` and says that control flow depending on
them may differ from the GPU's.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any, cast

import torch

_aten = torch.ops.aten
#: the attribute a fake tensor's known value is kept in: (kind, value, origin, storage key, generation); kind
#: "const" (every element is the value), "real" (the value is a host tensor of the same shape holding every element)
#: or "bound" (each element at most it); origin "exact" (a constant of the program or a host copy) or "assumed"
#: (carried from a stand-in)
TAG = "_oomdoctor_value"
#: checks whose answer, on values preflight does not have, is False (isfinite: True)
_FALSE_CHECKS = {_aten.isnan.default, _aten.isinf.default, _aten.isneginf.default, _aten.isposinf.default}
_TRUE_CHECKS = {_aten.isfinite.default}
#: counts of a boolean tensor: at most its size (every element true)
_COUNTS = {_aten.sum.default, _aten.sum.dim_IntList, _aten.count_nonzero.default, _aten.count_nonzero.dim_IntList}
#: ops through which an upper bound stays one
_BOUND_KEEPS = {_aten.max.default, _aten.amax.default, _aten.clone.default, _aten.detach.default,
                _aten._to_copy.default, _aten.view.default, _aten.alias.default, _aten.squeeze.default,
                _aten.squeeze.dim, _aten.unsqueeze.default, _aten.select.int, _aten.lift_fresh.default}
#: indexing ops whose boolean-mask indices have a data-dependent number of elements
_INDEXING = {_aten.index.Tensor, _aten._unsafe_index.Tensor, _aten.index_put.default, _aten.index_put_.default,
             _aten._index_put_impl_.default}
#: constants are computed through an op only while every input is at most this many elements (a 64 x 4096
#: attention mask is 262,144)
_SMALL = 1 << 20
#: a host tensor copied to the GPU is checked for one value only up to this many elements
HOST_VALUE_LIMIT = 1 << 24
#: a known tensor that is not one value is kept as a host copy (``"real"``) up to this many elements (64 Ki: token
#: ids, masks and positions of a batch; labels to compute a data-dependent shape exactly)
SHADOW_LIMIT = 1 << 16
#: deterministic factories whose output is known without inputs (``empty`` and the random ones are not)
_FACTORIES = {_aten.arange.default, _aten.arange.start, _aten.arange.start_step, _aten.linspace.default,
              _aten.eye.default, _aten.eye.m, _aten.tril_indices.default, _aten.triu_indices.default}
#: frames of these files are not the line that read a value
_NOT_THE_READER = ("/torch/", "/oomdoctor/", "contextlib.py", "<frozen ", "/functools.py", "/_tensor_str.py")


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):  # sparse, nested: no plain storage
        return None


def reader_line() -> tuple[str, int]:
    """``(file, line)`` of the innermost frame that is neither torch's nor oomdoctor's: the line that read."""
    f = sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if not any(s in fn for s in _NOT_THE_READER):
            return fn, f.f_lineno or 0
        f = f.f_back
    return "<unknown>", 0


@dataclass
class StandIns:
    """The stand-in values of one trace, and where each was given (``records``: ``{(file, line, kind, read):
    count}``)."""

    records: dict[tuple[str, int, str, str], int] = field(default_factory=dict)
    #: how the value being read is read (``item``, ``bool``, ``float``, ``tolist``, ``print``, ``cpu``...): set by
    #: the script's torch-function layer around the read, ``item`` otherwise
    read: str = "item"
    _reads_at: dict[tuple[str, int], int] = field(default_factory=dict)
    #: storage key -> the clock at its last write (a known value tagged before it is forgotten)
    _gen: dict[int, int] = field(default_factory=dict)
    _clock: int = 0

    # -- known values, by storage generation
    def tag_of(self, t: Any) -> tuple[str, Any, str] | None:
        """``(kind, value, origin)`` known of ``t``, or None (unknown, or its storage written since)."""
        raw = getattr(t, TAG, None) if isinstance(t, torch.Tensor) else None
        if raw is None:
            return None
        kind, v, origin, key, gen = raw
        return (kind, v, origin) if key is not None and self._gen.get(key, 0) == gen else None

    def _set(self, t: Any, tag: tuple[str, Any, str] | None) -> None:
        if not isinstance(t, torch.Tensor):
            return
        key = _key(t)
        try:
            setattr(t, TAG, None if tag is None or key is None else (*tag, key, self._gen.get(key, 0)))
        except (AttributeError, RuntimeError):  # pragma: no cover - a tensor type without a __dict__
            pass

    def _wrote(self, t: Any) -> None:
        key = _key(t) if isinstance(t, torch.Tensor) else None
        if key is not None:
            self._clock += 1
            self._gen[key] = self._clock

    def from_host(self, out: Any, src: Any) -> None:
        """``out``, a GPU copy of the host tensor ``src``: known when every element of ``src`` is one value."""
        if not isinstance(src, torch.Tensor) or _is_fake(src) or not isinstance(out, torch.Tensor):
            return
        n = src.numel()
        if n == 0 or n > HOST_VALUE_LIMIT or src.is_complex():
            return
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            if n > SHADOW_LIMIT:  # one value, or unknown
                flat = src.reshape(-1)
                first = flat[0]
                if bool(flat[-1] != first) or bool(flat[n // 2] != first):  # most (random weights) end here
                    return
                if not bool((flat == first).all()):
                    return
                self._set(out, ("const", _typed(first.item(), out.dtype), "exact"))
                return
            tag = _as_tag(src.detach().to(out.dtype).reshape(tuple(out.shape)).clone())  # the host may reuse src
        if tag is not None:
            self._set(out, (*tag, "exact"))

    def known(self, t: Any) -> Any:
        """A host tensor holding ``t``'s known values (``t``'s shape and dtype), or None."""
        tag = self.tag_of(t)
        if tag is None or tag[0] == "bound":
            return None
        return _host(lambda: _real_of(t, tag))

    def note(self, kind: str, read: str | None = None, n: int = 1) -> None:
        file, line = reader_line()
        key = (file, line, kind, read or self.read)
        self.records[key] = self.records.get(key, 0) + n

    def as_list(self) -> list[dict[str, Any]]:
        """``invented_values``: one row per line, kind and read, in the order first seen."""
        return [{"file": f, "line": ln, "kind": k, "read": r, "count": c} for (f, ln, k, r), c in self.records.items()]

    # -- the value of one read
    def scalar(self, t: torch.Tensor) -> Any:
        """The Python number ``t.item()`` answers (``t`` a one-element fake tensor), by the policy."""
        tag = self.tag_of(t)
        if tag is not None and tag[0] == "real":
            if tag[2] != "exact":
                self.note("assumed")
            return _typed(_host(lambda: tag[1].reshape(-1)[0].item()), t.dtype)
        if tag is not None and tag[0] == "const":
            if tag[2] != "exact":  # a known value is not a stand-in: not listed
                self.note("false" if not tag[1] else "assumed")
            return _typed(tag[1], t.dtype)
        if tag is not None and tag[0] == "bound":
            self.note("upper_bound")
            return _typed(tag[1], t.dtype)
        if t.dtype == torch.bool:
            self.note("false")
            return False
        if t.dtype.is_floating_point or t.dtype.is_complex:
            file, line = reader_line()
            k = self._reads_at.get((file, line), 0)
            self._reads_at[(file, line)] = k + 1
            self.note("finite")
            return 1.0 / (1 + k)
        self.note("finite")
        return 1

    def equal(self, a: Any, b: Any) -> bool:
        """``torch.equal(a, b)``: exact when both values are known (a fake tensor's, or a host tensor's), else False
        (a check: the stand-in)."""
        ra = self.known(a) if _is_fake(a) else a
        rb = self.known(b) if _is_fake(b) else b
        if isinstance(ra, torch.Tensor) and isinstance(rb, torch.Tensor):
            return bool(_host(lambda: torch.equal(ra, rb)))
        self.note("false", "equal")
        return False

    def value_of(self, t: torch.Tensor) -> Any:
        """The value ``t`` is given when copied to the host (``.cpu()``, ``tolist()``): one number for every element,
        or a host tensor of ``t``'s shape when its values are known one by one."""
        tag = self.tag_of(t)
        if tag is not None and tag[0] == "real":
            if tag[2] != "exact":
                self.note("assumed")
            return _host(tag[1].clone)
        if tag is not None:
            if tag[0] == "bound" or tag[2] != "exact":
                self.note("false" if tag[0] == "const" and not tag[1] else
                          "upper_bound" if tag[0] == "bound" else "assumed")
            return _typed(tag[1], t.dtype)
        if t.dtype == torch.bool:
            self.note("false")
            return False
        self.note("finite")
        return 1.0 if t.dtype.is_floating_point else 1

    # -- data-dependent shapes at their upper bound
    def upper_bound(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The output of a data-dependent-shape op at its largest size (fake tensors, no values), or None when
        ``func`` is not one preflight bounds."""
        x = args[0]
        exact = self._exact_shape(func, args, kwargs)
        if exact is not None:
            return exact
        if func is _aten.nonzero.default or func is _aten.argwhere.default:
            self.note("upper_bound", func.__name__.split(".")[0])
            return torch.empty((x.numel(), x.dim()), dtype=torch.int64)
        if func is _aten.masked_select.default:
            n = torch.broadcast_shapes(x.shape, args[1].shape).numel()
            self.note("upper_bound", "masked_select")
            return torch.empty((n,), dtype=x.dtype)
        if func in _INDEXING:  # boolean-mask indices: every element selected, one long index per mask dim
            idx: list[Any] = []
            for i in args[1]:
                if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
                    idx += [torch.empty((i.numel(),), dtype=torch.int64) for _ in range(i.dim())]
                else:
                    idx.append(i)
            self.note("upper_bound", "mask index")
            return func(args[0], idx, *args[2:], **kwargs)
        if func in (_aten._unique2.default, _aten.unique_consecutive.default):
            self.note("upper_bound", "unique")
            n = x.numel()
            inverse = kwargs.get("return_inverse", args[2] if len(args) > 2 else False)
            counts = kwargs.get("return_counts", args[3] if len(args) > 3 else False)
            return (torch.empty((n,), dtype=x.dtype),
                    torch.empty(x.shape if inverse else (0,), dtype=torch.int64),
                    torch.empty((n,) if counts else (0,), dtype=torch.int64))
        return None

    def _exact_shape(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A data-dependent-shape op on known inputs: fake outputs of the real outputs' shapes, their values kept."""
        from torch.utils._pytree import tree_flatten, tree_unflatten

        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and _is_fake(t)]
        known = {id(t): self.tag_of(t) for t in leaves}
        if not leaves or any(v is None or v[0] == "bound" for v in known.values()):
            return None
        known = cast("dict[int, tuple[str, Any, str]]", known)  # every tag known (checked above)
        real = _run_real(func, args, kwargs, known)
        if real is None:
            return None
        flat, spec = tree_flatten(real)
        outs = []
        for r in flat:
            if isinstance(r, torch.Tensor):
                o = torch.empty_strided(tuple(r.shape), tuple(r.stride()), dtype=r.dtype)
                tag = _as_tag(r)
                if tag is not None:
                    self._set(o, (*tag, "exact" if all(v[2] == "exact" for v in known.values()) else "assumed"))
                outs.append(o)
            else:
                outs.append(r)
        return tree_unflatten(outs, spec)

    # -- constants carried through ops
    def propagate(self, func: Any, args: tuple, kwargs: dict, out: Any, leaves: list | None = None) -> None:
        """Tag ``out`` (and an in-place op's target) with the value it is known to hold, if any; every tensor the
        op writes has its storage's generation bumped first (its views' known values are forgotten). ``leaves``:
        ``tree_leaves((args, kwargs))`` when the caller has them."""
        from torch.utils._pytree import tree_leaves

        if leaves is None:
            leaves = tree_leaves((args, kwargs))
        leaves = [t for t in leaves if isinstance(t, torch.Tensor)]
        fakes = [t for t in leaves if _is_fake(t)]
        tags = [self.tag_of(t) for t in fakes]  # the inputs' values, read before the writes below
        written = _written(func, args, kwargs) if _writes(func) else []
        for t in written:
            self._wrote(t)
        if func not in _SPECIAL and (not fakes or None in tags):  # most ops: an unknown input, nothing known
            return
        target = written[0] if written else out
        if func in _FALSE_CHECKS or func in _TRUE_CHECKS:
            if tags and (tags[0] is None or tags[0][0] != "const"):
                self._set(out, ("const", func in _TRUE_CHECKS, "assumed"))
                return
        if func is _aten._amp_foreach_non_finite_check_and_unscale_.default:
            self._set(args[1], ("const", 0.0, "assumed"))  # found_inf: no gradient is inf or NaN, every step runs
            return
        if func in (_aten.full.default, _aten.full_like.default, _aten.fill_.Scalar, _aten.scalar_tensor.default):
            v = args[1] if func is not _aten.scalar_tensor.default else args[0]
            if isinstance(v, (int, float, bool)):
                self._set(target, ("const", v, "exact"))
            return
        if func in (_aten.zeros.default, _aten.zeros_like.default, _aten.zero_.default):
            self._set(target, ("const", 0, "exact"))
            return
        if func in (_aten.ones.default, _aten.ones_like.default):
            self._set(target, ("const", 1, "exact"))
            return
        if func in _FACTORIES and isinstance(out, torch.Tensor) and out.numel() <= SHADOW_LIMIT:
            real = _run_real(func, args, kwargs, {})
            tag = _as_tag(real) if isinstance(real, torch.Tensor) else None
            self._set(out, None if tag is None else (*tag, "exact"))
            return
        if not fakes or _NONDETERMINISTIC in getattr(func, "tags", ()) or func in _STRIDED:
            return
        if func in _COUNTS and tags[0] is None and fakes[0].dtype == torch.bool and isinstance(out, torch.Tensor):
            self._set(out, ("bound", fakes[0].numel() // max(out.numel(), 1), "assumed"))
            return
        if len(fakes) == 1 and tags[0] is not None and tags[0][0] == "bound" and func in _BOUND_KEEPS:
            self._set(out, tags[0])
            return
        if all(t is not None and t[0] != "bound" for t in tags) and all(t.numel() <= _SMALL for t in leaves):
            tags = cast("list[tuple[str, Any, str]]", tags)  # every tag known (checked above)
            known = {id(t): tag for t, tag in zip(fakes, tags)}
            real = _run_real(func, args, kwargs, known, copy={id(t) for t in written})
            origin = "exact" if all(t[2] == "exact" for t in tags) else "assumed"
            if written:  # an in-place op: its target holds the result
                outs, reals = [target], [real if isinstance(real, torch.Tensor) else None]
            else:  # every output (unbind, split, max.dim...) with its value
                outs, reals = tree_leaves(out), tree_leaves(real)
                if len(outs) != len(reals):
                    return
            for o, r in zip(outs, reals):
                if isinstance(o, torch.Tensor) and _is_fake(o):
                    tag = _as_tag(r) if isinstance(r, torch.Tensor) and tuple(r.shape) == tuple(o.shape) else None
                    self._set(o, None if tag is None else (*tag, origin))


@functools.lru_cache(maxsize=None)
def _writes(func: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of the arguments ``func`` writes (``Tensor(a!)`` in its schema)."""
    try:
        return tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                     if a.alias_info is not None and a.alias_info.is_write)
    except AttributeError:  # not an OpOverload
        return ()


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    out: list[torch.Tensor] = []
    for i, name in _writes(func):
        v = args[i] if i < len(args) else kwargs.get(name)
        out += [t for t in tree_leaves(v) if isinstance(t, torch.Tensor) and _is_fake(t)]
    return out


def _typed(v: Any, dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return bool(v)
    if dtype.is_floating_point:
        return float(v)
    return int(v)


_NONDETERMINISTIC = torch.Tag.nondeterministic_seeded
#: ops :meth:`StandIns.propagate` answers whatever their inputs are known to hold
_SPECIAL = {*_FALSE_CHECKS, *_TRUE_CHECKS, *_COUNTS, _aten._amp_foreach_non_finite_check_and_unscale_.default,
            _aten.full.default, _aten.full_like.default, _aten.fill_.Scalar, _aten.scalar_tensor.default,
            _aten.zeros.default, _aten.zeros_like.default, _aten.zero_.default, _aten.ones.default,
            _aten.ones_like.default, *_FACTORIES}
#: ops that read memory by strides: a known value is kept contiguous, so these are not computed on it
_STRIDED = {_aten.as_strided.default, _aten.as_strided_.default, _aten.as_strided_scatter.default}


def _host(fn: Any) -> Any:
    """``fn()`` with the fake mode off: host tensors stay host tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return fn()


def _real_of(t: torch.Tensor, tag: tuple[str, Any, str], copy: bool = True) -> torch.Tensor | None:
    """A host tensor of ``t``'s shape and dtype holding the values ``tag`` knows (a new one with ``copy``; else the
    kept one, which nothing may write)."""
    if tag[0] == "const":
        return torch.full(tuple(t.shape), tag[1], dtype=t.dtype)
    if tag[0] == "real" and tuple(tag[1].shape) == tuple(t.shape):
        return tag[1].clone() if copy else tag[1]
    return None


def _as_tag(real: Any) -> tuple[str, Any] | None:
    """The known value of a host tensor: ("const", v) when uniform, ("real", a contiguous copy) when small."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if not isinstance(real, torch.Tensor) or real.is_complex() or _is_fake(real):
        return None
    n = real.numel()
    if n == 0:
        return None
    with unset_fake_temporarily():
        if n <= SHADOW_LIMIT:  # kept as computed: the host tensors a value is computed from are never written
            return ("real", real.detach())
        flat = real.reshape(-1)
        if bool((flat == flat[0]).all()):
            return ("const", flat[0].item())
    return None


def _run_real(func: Any, args: tuple, kwargs: dict, known: dict[int, tuple[str, Any, str]],
              copy: set[int] | frozenset = frozenset()) -> Any:
    """``func`` run on host tensors holding the known values (``known``: by ``id`` of each fake input, its tag; the
    inputs in ``copy``, which it writes, are copies); None when it cannot run on them."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._pytree import tree_map

    def real(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and _is_fake(t):
            r = _real_of(t, known[id(t)], copy=id(t) in copy)
            if r is None:
                raise ValueError("no value")
            return r
        if isinstance(t, torch.device) and t.type != "cpu":
            return torch.device("cpu")
        return t

    try:
        with unset_fake_temporarily():
            return func(*tree_map(real, args), **tree_map(real, kwargs))
    except Exception:  # noqa: BLE001 - an op that cannot run on these values: its value stays unknown
        return None
