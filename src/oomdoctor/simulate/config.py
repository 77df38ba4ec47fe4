"""The caching allocator's settings, parsed from the strings users write.

Syntax of ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` (2.9+): comma-separated ``key:value``
pairs, list values in ``[...]``, whitespace ignored. Parsing follows
``c10/core/AllocatorConfig.cpp`` (``ConfigTokenizer``, ``AcceleratorAllocatorConfig::parseArgs`` and
its ``parse*`` helpers) and ``c10/cuda/CUDAAllocatorConfig.cpp`` for the CUDA-only keys; errors carry
PyTorch's own messages. See ``shared/reference/caching_allocator_spec.md`` §1.3 and §3.

Semantics kept from PyTorch (2.9+ / 2026 main, the version of the shared snapshots):

- ``max_split_size_mb`` must be ``>= 20`` (``kLargeBuffer / kMB``); values are MiB.
- ``roundup_power2_divisions:N`` fills all 16 intervals; the list form ``[K:v,...,>:v]`` sets
  ``table[clamp(log2 K, 0, 15)]``, the first key also fills every lower interval, and ``>`` fills from
  the interval after the last key to the end. Keys must be powers of two, values 0 or powers of two.
- ``garbage_collection_threshold`` must be in ``(0, 1)``.
- An unknown key is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, cast

from ..analysis.rounding import K_LARGE_BUFFER, MAX_DIVISIONS, N_INTERVALS
from ..errors import OomdoctorError
from ..units import MiB

# Keys accepted by PyTorch 2.11 (generic + CUDA + HIP spellings) that do not change the device
# allocator's behaviour in a trace replay (host/pinned memory, locking, graph capture).
_NO_EFFECT_KEYS = frozenset({
    "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb", "pinned_free_catch_all", "graph_capture_record_stream_reuse",
    "throw_on_cudamalloc_oom", "expandable_segments_reserve", "expandable_segments_reserve_by_class",
})


class ConfigError(OomdoctorError):
    """An allocator config string PyTorch would reject; the message is PyTorch's, with the string."""

    exit_code = 2


@dataclass(frozen=True)
class AllocatorConfig:
    """The settings that change where the caching allocator puts memory. Sizes in bytes.

    ``max_split_size`` None means unlimited (PyTorch's ``SIZE_MAX``; a snapshot shows ``-1``).
    ``roundup_power2_divisions`` is the 16-entry table indexed by ``clamp(floor(log2 size) - 20, 0,
    15)``. ``per_process_memory_fraction`` 1.0 means no fraction limit.
    """

    expandable_segments: bool = False
    max_split_size: int | None = None
    max_non_split_rounding: int = K_LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = (0,) * N_INTERVALS
    garbage_collection_threshold: float = 0.0
    per_process_memory_fraction: float = 1.0
    backend: str = "native"
    ignored: tuple[str, ...] = field(default=(), compare=False)

    def to_string(self) -> str:
        """The shortest ``PYTORCH_CUDA_ALLOC_CONF`` string giving this config ("" for the defaults)."""
        parts: list[str] = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // MiB}")
        if self.max_non_split_rounding != K_LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding // MiB}")
        table = self.roundup_power2_divisions
        if any(table):
            if len(set(table)) == 1:
                parts.append(f"roundup_power2_divisions:{table[0]}")
            else:
                items = [f"{1 << i}:{v}" for i, v in enumerate(table)]  # gaps do not carry values over
                parts.append("roundup_power2_divisions:[" + ",".join(items) + "]")
        if self.garbage_collection_threshold > 0:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        if self.per_process_memory_fraction < 1.0:
            parts.append(f"per_process_memory_fraction:{self.per_process_memory_fraction:g}")
        if self.backend != "native":
            parts.append(f"backend:{self.backend}")
        return ",".join(parts)

    def __str__(self) -> str:
        return self.to_string() or "(defaults)"


DEFAULT = AllocatorConfig()


class _Tokens:
    """``ConfigTokenizer``: keys, values and the special characters ``: , [ ]``; whitespace dropped."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[str] = []
        word = ""
        for ch in text:
            if ch in ",:[]":
                if word:
                    self.tokens.append(word)
                    word = ""
                self.tokens.append(ch)
            elif ch.isspace():
                if word:
                    self.tokens.append(word)
                    word = ""
            else:
                word += ch
        if word:
            self.tokens.append(word)

    def __len__(self) -> int:
        return len(self.tokens)

    def fail(self, message: str) -> ConfigError:
        return ConfigError(f"allocator config {self.text!r}: {message}")

    def get(self, i: int) -> str:
        if i >= len(self.tokens):
            raise self.fail("unexpected end of config (a value is missing)")
        return self.tokens[i]

    def expect(self, i: int, token: str) -> None:
        if self.get(i) != token:
            raise self.fail(f"Config tokenizer expected '{token}' at index {i} but got '{self.get(i)}'")

    def size_t(self, i: int) -> int:
        tok = self.get(i)
        if not tok.isdigit():
            raise self.fail(f"Expected an unsigned integer at index {i} but got '{tok}'")
        return int(tok)

    def double(self, i: int) -> float:
        tok = self.get(i)
        try:
            return float(tok)
        except ValueError:
            raise self.fail(f"Expected a number at index {i} but got '{tok}'") from None

    def boolean(self, i: int) -> bool:
        tok = self.get(i)
        if tok not in ("True", "False"):
            raise self.fail(f"Expected 'True' or 'False' at index {i} in ConfigTokenizer but got '{tok}'")
        return tok == "True"

    def skip_value(self, i: int) -> int:
        """Index of the last token of the value after key ``i`` (a word or a bracketed list)."""
        self.expect(i + 1, ":")
        i += 2
        if self.get(i) == "[":
            while self.get(i) != "]":
                i += 1
        return i


def _is_pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


def parse_config(text: str) -> AllocatorConfig:
    """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` string.

    Raises :class:`ConfigError` with PyTorch's message for what PyTorch would reject (unknown key,
    ``max_split_size_mb`` below 20, divisions not a power of two, a threshold outside (0, 1), ...).
    A ``backend:cudaMallocAsync`` config is parsed, but the simulator refuses it (a different allocator).
    """
    t = _Tokens(text)
    values: dict[str, Any] = {}
    ignored: list[str] = []
    i = 0
    while i < len(t):
        key = t.get(i)
        if key == "max_split_size_mb":
            t.expect(i + 1, ":")
            mb = t.size_t(i + 2)
            if mb < K_LARGE_BUFFER // MiB:
                raise t.fail(f"CachingAllocator option max_split_size_mb too small, must be >= {K_LARGE_BUFFER // MiB}")
            values["max_split_size"] = mb * MiB
            i += 2
        elif key == "max_non_split_rounding_mb":
            t.expect(i + 1, ":")
            mb = t.size_t(i + 2)
            if mb < K_LARGE_BUFFER // MiB:
                raise t.fail("CachingAllocator option max_non_split_rounding_mb too small, must be >= "
                             f"{K_LARGE_BUFFER // MiB}")
            values["max_non_split_rounding"] = mb * MiB
            i += 2
        elif key == "garbage_collection_threshold":
            t.expect(i + 1, ":")
            v = t.double(i + 2)
            if not 0.0 < v < 1.0:
                raise t.fail("garbage_collect_threshold is invalid, set it in (0.0, 1.0)")
            values["garbage_collection_threshold"] = v
            i += 2
        elif key == "roundup_power2_divisions":
            values["roundup_power2_divisions"], i = _parse_divisions(t, i)
        elif key == "expandable_segments":
            t.expect(i + 1, ":")
            values["expandable_segments"] = t.boolean(i + 2)
            i += 2
        elif key == "per_process_memory_fraction":
            t.expect(i + 1, ":")
            v = t.double(i + 2)
            if not 0.0 <= v <= 1.0:
                raise t.fail("per_process_memory_fraction is invalid, set it in [0.0, 1.0]")
            values["per_process_memory_fraction"] = v
            i += 2
        elif key == "backend":
            t.expect(i + 1, ":")
            v = t.get(i + 2)
            if v not in ("native", "cudaMallocAsync"):
                raise t.fail("Unknown allocator backend, options should be native or cudaMallocAsync")
            values["backend"] = v
            i += 2
        elif key in _NO_EFFECT_KEYS:
            i = t.skip_value(i)
            ignored.append(key)
        else:
            raise t.fail(f"Unrecognized key '{key}' in Accelerator allocator config.")
        if i + 1 < len(t):
            t.expect(i + 1, ",")
            i += 1
        i += 1
    return AllocatorConfig(**values, ignored=tuple(ignored))


def _parse_divisions(t: _Tokens, i: int) -> tuple[tuple[int, ...], int]:
    """``parseRoundUpPower2Divisions`` (``c10/core/AllocatorConfig.cpp``): returns the table and the
    index of the value's last token."""
    t.expect(i + 1, ":")
    i += 2
    table = [0] * N_INTERVALS
    if t.get(i) != "[":
        v = t.size_t(i)
        if not _is_pow2(v):
            raise t.fail("For roundups, the divisions has to be power of 2 ")
        return (v,) * N_INTERVALS, i
    first = True
    last_index = 0
    i += 1
    while t.get(i) != "]":
        key_tok = t.get(i)
        t.expect(i + 1, ":")
        v = t.size_t(i + 2)
        if v != 0 and not _is_pow2(v):
            raise t.fail("For roundups, the divisions has to be power of 2 or 0 to disable roundup ")
        if key_tok == ">":
            for j in range(last_index + 1, N_INTERVALS):
                table[j] = v
        else:
            boundary = t.size_t(i)
            if not _is_pow2(boundary):
                raise t.fail("For roundups, the intervals have to be power of 2 ")
            index = min(max(boundary.bit_length() - 1, 0), N_INTERVALS - 1)
            if first:
                for j in range(index):
                    table[j] = v
                first = False
            table[index] = v
            last_index = index
        i += 3
        if t.get(i) != "]":
            t.expect(i, ",")
            i += 1
    return tuple(table), i


def config_from_settings(settings: Mapping[str, Any] | None) -> AllocatorConfig:
    """The config a snapshot was recorded with, from its ``allocator_settings`` (PyTorch >= 2.3,
    PR #119404): the structured fields, which hold the effective values. ``DEFAULT`` when absent."""
    if not settings:
        return DEFAULT
    values: dict[str, Any] = {}
    if settings.get("expandable_segments") is True:
        values["expandable_segments"] = True
    mss = settings.get("max_split_size")
    if isinstance(mss, int) and not isinstance(mss, bool) and 0 < mss < (1 << 62):
        values["max_split_size"] = mss
    gc = settings.get("garbage_collection_threshold")
    if isinstance(gc, (int, float)) and not isinstance(gc, bool) and 0.0 < gc < 1.0:
        values["garbage_collection_threshold"] = float(gc)
    nsr = settings.get("max_non_split_rounding_size")
    if isinstance(nsr, int) and not isinstance(nsr, bool) and 0 < nsr < (1 << 62):
        values["max_non_split_rounding"] = nsr
    raw = settings.get("roundup_power2_divisions")
    if isinstance(raw, Mapping):
        table = [0] * N_INTERVALS
        entries = cast("Mapping[Any, Any]", raw)  # the snapshot's keys and values, of any type until read below
        for key, value in entries.items():
            try:
                k, v = int(key), int(value)
            except (TypeError, ValueError, OverflowError):
                continue
            if k > 0 and 0 <= v <= MAX_DIVISIONS:
                table[min(max(k.bit_length() - 1, 0), N_INTERVALS - 1)] = v
        values["roundup_power2_divisions"] = tuple(table)
    return AllocatorConfig(**values)

