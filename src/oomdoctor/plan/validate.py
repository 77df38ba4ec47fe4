"""Checking the estimator against Megatron-LM's CI memory goldens.

The CSV (schema of ``shared/megatron_ci/golden_memory_train.csv``) has one row per functional test and
golden file: the test's key arguments and ``max_allocated_peak_bytes``, Megatron's
``mem-max-allocated-bytes``, logged only on the last rank (``world_size − 1``: the last pipeline stage;
``shared/reference/memory_estimation.md`` §4.1). Rows are mapped to specs with Megatron's defaults
(``megatron/training/arguments.py``): 8 GPUs (the H100 recipe ``tests/test_utils/recipes/h100/gpt.yaml``),
GPT-2 BPE vocabulary 50257 when none is given, ``ffn = 4h`` (``int(8h/3 / 64) · 64`` with SwiGLU),
dropout 0.1, fp32 main grads, Transformer Engine's fused (flash) attention, the local implementation's
unfused attention. Only GPT rows are estimated; the others (BERT, T5, MoE, multimodal) get
``predicted_bytes: null``.
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, overload

from .estimate import estimate
from .specs import MAX_SIZE_FIELD, ModelSpec, ParallelPlan, PlanError, TrainingSpec

WORLD_SIZE = 8
GPT2_VOCAB = 50257
REQUIRED_COLUMNS = ("test_dir", "golden_file", "max_allocated_peak_bytes", "num-layers", "hidden-size",
                    "num-attention-heads", "seq-length", "micro-batch-size", "global-batch-size",
                    "tensor-model-parallel-size", "pipeline-model-parallel-size")


#: Columns that are not configuration: the test's name and files, and what was measured.
CONFIG_EXCLUDED = ("test_dir", "golden_file", "max_allocated_peak_bytes", "allocated_current_last_bytes")


@dataclass
class Row:
    test_dir: str
    golden_file: str
    predicted_bytes: int | None
    measured_bytes: int
    reason: str = ""  # why not supported
    config: tuple = ()  # the configuration columns' values, in file order

    @property
    def relative_error(self) -> float | None:
        if self.predicted_bytes is None or self.measured_bytes <= 0:
            return None
        return abs(self.predicted_bytes - self.measured_bytes) / self.measured_bytes


@dataclass
class Validation:
    rows: list[Row]

    @property
    def gpt_rows(self) -> list[Row]:
        return [r for r in self.rows if "/gpt/" in r.test_dir]

    def errors(self) -> list[float]:
        return sorted(e for r in self.gpt_rows if (e := r.relative_error) is not None)

    @property
    def covered(self) -> int:
        """GPT rows with a prediction."""
        return sum(r.predicted_bytes is not None for r in self.gpt_rows)

    @property
    def coverage(self) -> float:
        g = self.gpt_rows
        return self.covered / len(g) if g else 0.0

    @property
    def median_error(self) -> float | None:
        return _median(self.errors())

    @property
    def p90_error(self) -> float | None:
        return _p90(self.errors())

    def refused(self) -> dict[str, int]:
        """GPT rows without a prediction, counted by reason (excluded from the error statistics)."""
        out: dict[str, int] = {}
        for r in self.gpt_rows:
            if r.predicted_bytes is None:
                key = _reason_class(r.reason)
                out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def floor_errors(self) -> list[float]:
        """The least error any estimator reading only the configuration columns can reach on each estimated
        row: rows that share every configuration column (:data:`CONFIG_EXCLUDED` aside) but measure
        differently can at best all be predicted by their group's median. Sorted."""
        groups: dict[tuple, list[Row]] = {}
        for r in self.gpt_rows:
            if r.predicted_bytes is not None and r.measured_bytes > 0:
                groups.setdefault(r.config, []).append(r)
        out = []
        for rows in groups.values():
            mid = statistics.median(r.measured_bytes for r in rows)
            out += [abs(mid - r.measured_bytes) / r.measured_bytes for r in rows]
        return sorted(out)

    @property
    def floor_median(self) -> float | None:
        return _median(self.floor_errors())

    @property
    def floor_p90(self) -> float | None:
        return _p90(self.floor_errors())


def _reason_class(reason: str) -> str:
    """A refusal's class, without the row's own numbers."""
    if "every model chunk needs the same number of layers" in reason:
        return "uneven pipeline stages (num_layers not divisible by pp x vpp)"
    return reason.split(":")[0] or "unknown"


def _median(e: list[float]) -> float | None:
    return statistics.median(e) if e else None


def _p90(e: list[float]) -> float | None:
    return e[min(len(e) - 1, int(round(0.9 * (len(e) - 1))))] if e else None


@overload
def _int(row: dict[str, str], key: str, default: int, least_one: bool = False) -> int: ...
@overload
def _int(row: dict[str, str], key: str, default: None = None, *, least_one: Literal[True]) -> int: ...
@overload
def _int(row: dict[str, str], key: str, default: None = None, least_one: bool = False) -> int | None: ...
def _int(row: dict[str, str], key: str, default: int | None = None, least_one: bool = False) -> int | None:
    """The column as an integer; ``default`` when blank. Raises :class:`PlanError` (naming the column)
    for text that is not a whole number in range (``least_one``: blank is an error too, and 0 is)."""
    v = (row.get(key) or "").strip()
    if not v:
        if least_one:
            raise PlanError(f"{key} is blank")
        return default
    try:
        x = float(v)
    except ValueError:
        raise PlanError(f"{key} is not a number: {v!r}") from None
    top = 1 << 62 if least_one else MAX_SIZE_FIELD  # bytes may be large; sizes may not
    if x != x or x in (float("inf"), float("-inf")) or x != int(x) or not int(least_one) <= x <= top:
        raise PlanError(f"{key} is not a whole number in [{int(least_one)}, {top}]: {v!r}")
    return int(x)


#: Test names of reinforcement-learning (GRPO) jobs: their memory also holds an inference engine (generation
#: with its own KV cache and weights), which the estimator does not model.
_RL_MARKERS = ("grpo", "rlhf", "_rl_", "/rl/")


def _flag(row: dict[str, str], key: str) -> bool:
    return (row.get(key) or "").strip().lower() in ("true", "1", "yes")


def specs_of_row(row: dict[str, str]) -> tuple[ModelSpec, TrainingSpec, ParallelPlan]:
    """The specs of one GPT row (see the module docstring for the defaults).

    Raises:
        PlanError: a configuration the estimator does not cover, or an inconsistent one.
    """
    name = row.get("test_dir", "").lower()
    if any(m in name for m in _RL_MARKERS):
        raise PlanError("reinforcement learning (GRPO): the memory holds an inference engine, not covered")
    if _int(row, "num-experts"):
        raise PlanError("MoE layers are not covered")
    if _flag(row, "optimizer-cpu-offload") or _flag(row, "cpu-offloading"):
        raise PlanError("CPU offloading is not covered")
    h = _int(row, "hidden-size")
    heads = _int(row, "num-attention-heads")
    layers = _int(row, "num-layers")
    if not (h and heads and layers):
        raise PlanError("missing model sizes")
    swiglu = _flag(row, "swiglu")
    ffn = _int(row, "ffn-hidden-size") or (int((4 * h * 2 / 3) / 64) * 64 if swiglu else 4 * h)
    tp = _int(row, "tensor-model-parallel-size", 1)
    pp = _int(row, "pipeline-model-parallel-size", 1)
    cp = _int(row, "context-parallel-size", 1)
    if WORLD_SIZE % (tp * pp * cp):
        raise PlanError(f"tp({tp}) * pp({pp}) * cp({cp}) does not divide {WORLD_SIZE} GPUs")
    dp = WORLD_SIZE // (tp * pp * cp)
    per_vp = _int(row, "num-layers-per-virtual-pipeline-stage")
    vpp = _int(row, "virtual-pipeline-model-parallel-size") or (layers // (pp * per_vp) if per_vp else 1)
    local = (row.get("transformer-impl") or "").strip() == "local"
    fp16 = _flag(row, "fp16")
    model = ModelSpec(name=row["test_dir"].rsplit("/", 1)[-1], num_layers=layers, hidden_size=h, ffn_hidden_size=ffn,
                      num_heads=heads, num_kv_heads=_int(row, "num-query-groups", heads),
                      vocab_size=_int(row, "vocab-size", GPT2_VOCAB),
                      tied_embeddings=not _flag(row, "untie-embeddings-and-output-weights"), gated_mlp=swiglu,
                      bias=True, norm="layernorm", learned_positions=0)
    seq, mbs = _int(row, "seq-length"), _int(row, "micro-batch-size")
    if not seq or not mbs:
        raise PlanError("missing " + " and ".join(k for k, v in (("seq-length", seq), ("micro-batch-size", mbs)) if not v))
    # a blank global batch is Megatron's default, micro-batch x data-parallel size (megatron/training/arguments.py)
    gbs = _int(row, "global-batch-size") or mbs * dp
    train = TrainingSpec(seq_len=seq, global_batch=gbs, micro_batch=mbs,
                         # fp16: fp16 grads plus fp32 main grads inside the optimizer (20 B / 4 + 16/d)
                         grad_bytes=2 if fp16 else 4, master_bytes=8 if fp16 else 4,
                         fp8=bool((row.get("fp8-format") or "").strip()), flash_attention=not local, dropout=True)
    sharding = "zero3" if (row.get("data-parallel-sharding-strategy") or "").strip() == "optim_grads_params" else (
        "zero1" if _flag(row, "use-distributed-optimizer") else "none")
    recompute = (row.get("recompute-granularity") or "").strip() or "none"
    plan = ParallelPlan(tp=tp, pp=pp, dp=dp, cp=cp, vpp=vpp, schedule="interleaved" if vpp > 1 else "1f1b",
                        sequence_parallel=_flag(row, "sequence-parallel") and tp > 1, dp_sharding=sharding,
                        recompute=recompute, framework="megatron")
    return model, train, plan


def predict_row(row: dict[str, str]) -> tuple[int | None, str]:
    """Predicted peak allocated bytes on the last rank, or ``(None, reason)``."""
    if "/gpt/" not in row.get("test_dir", ""):
        return None, "only GPT models are estimated"
    try:
        model, train, plan = specs_of_row(row)
        return estimate(model, train, plan).last.allocated_bytes, ""
    except (PlanError, ValueError, ZeroDivisionError) as e:
        return None, str(e)


def validate_csv(path: str | Path) -> Validation:
    """Predict every row of a golden CSV.

    A row whose ``max_allocated_peak_bytes`` is blank or not a positive number is kept, refused with that
    reason (``predicted_bytes`` None, out of the statistics).

    Raises:
        PlanError: the file cannot be read, is not UTF-8 text, or lacks a required column (named).
    """
    p = Path(path)
    try:
        with p.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise PlanError(f"{p}: missing column(s) {', '.join(missing)} (expected the schema of "
                                "golden_memory_train.csv)")
            raw = list(reader)
    except OSError as e:
        raise PlanError(f"{p}: cannot read ({e.strerror or e})") from None
    except csv.Error as e:
        raise PlanError(f"{p}: not a valid CSV ({e})") from None
    except UnicodeDecodeError as e:
        raise PlanError(f"{p}: not a UTF-8 text CSV ({e.reason} at byte {e.start})") from None
    rows = []
    for r in raw:
        config = tuple((k, (v or "").strip()) for k, v in r.items() if k not in CONFIG_EXCLUDED)
        try:
            measured = _int(r, "max_allocated_peak_bytes", least_one=True)
        except PlanError as e:  # the row has nothing to check against: refused with its reason
            rows.append(Row(r["test_dir"] or "", r["golden_file"] or "", None, 0, str(e), config))
            continue
        pred, reason = predict_row(r)
        rows.append(Row(r["test_dir"] or "", r["golden_file"] or "", pred, measured, reason, config))
    return Validation(rows)
