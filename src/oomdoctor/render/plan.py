"""``oomdoctor plan``'s output: per-stage estimates, the search table, validation errors (text, JSON)."""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .._version import SCHEMA_VERSION, __version__
from ..plan.estimate import Estimate, StageEstimate
from ..plan.search import SearchResult, alloc_conf_env
from ..plan.specs import ModelSpec, ParallelPlan, TrainingSpec
from ..plan.validate import Validation
from ..units import GiB
from .console import hang, plain_console
from .format import count


def _gb(n: int) -> str:
    """Bytes in GiB (2^30), as ``diagnose`` prints sizes."""
    return f"{n / GiB:.1f}"


_DOC = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

# The JSON documents of ``plan estimate``, ``plan search`` and ``plan validate``: dataclasses whose ``asdict`` is
# the JSON after ``schema_version`` and ``oomdoctor_version``. The docstring under each field is its description in
# the JSON schema (:mod:`.schema` generates it from them).


@dataclass
class EstimateDoc:
    """memory per pipeline stage of one plan"""

    __pydantic_config__ = _DOC

    model: ModelSpec
    """the model"""
    train: TrainingSpec
    """the training step"""
    plan: ParallelPlan
    """the parallel plan"""
    label: str
    """the plan in one line (TP2 PP4 DP8 ...)"""
    microbatches: int
    """micro-batches per step and pipeline"""
    vocab: int
    """the vocabulary, padded"""
    gpu_memory_bytes: int | None
    """the GPU's memory (bytes)"""
    fits: bool | None
    """the worst stage's device bytes fit the GPU (null: no GPU given)"""
    peak_stage: int
    """the stage with the most device bytes"""
    stages: list[StageEstimate]
    """per pipeline stage"""


def estimate_dict(e: Estimate) -> dict[str, Any]:
    """``plan estimate --format json``: :class:`EstimateDoc` after the versions."""
    doc = EstimateDoc(model=e.model, train=e.train, plan=e.plan, label=e.plan.label(), microbatches=e.microbatches,
                      vocab=e.vocab, gpu_memory_bytes=e.hardware.gpu_memory_bytes if e.hardware else None,
                      fits=e.fits, peak_stage=e.peak.stage, stages=e.stages)
    return {"schema_version": SCHEMA_VERSION, "oomdoctor_version": __version__, **asdict(doc)}


def render_estimate_text(e: Estimate, console: Console) -> None:
    """The answer first (fits or not: the worst stage's device bytes against the GPU's), then the plan, the stages
    term by term, and each stage's peak in ``diagnose``'s categories."""
    plan = (f"{e.plan.label()}, {e.plan.schedule}, {count(e.microbatches, 'micro-batch')} of {e.train.micro_batch} x "
            f"{e.train.seq_len} tokens; GiB = 2^30 bytes")
    if e.hardware is not None:
        p = e.peak
        verdict = "fits" if e.fits else "does NOT fit"
        console.print(Text(f"{e.model.name}: {verdict}: worst stage {p.stage} needs {_gb(p.device_bytes)} GiB of "
                           f"{_gb(e.hardware.gpu_memory_bytes)} GiB", style="bold green" if e.fits else "bold red"))
        console.print(Text(plan, style="bold"))
    else:
        console.print(Text(f"{e.model.name}: {plan}", style="bold"))
    console.print(Text("per stage, GiB at its peak (params: parameters on the stage; in flight: micro-batches "
                       "whose activations are held at once)", style="dim"))
    # no box: its column separators would take the columns past 80; the header row is bold instead
    t = Table(box=None, show_edge=False, pad_edge=False, header_style="bold underline")
    cols = ("stage", "params", "in\nflight", "weights\n+grads\n+opt", "activ-\nations", "logits\n+loss", "other",
            "allo-\ncated", "re-\nserved", "device")
    for c in cols:
        t.add_column(c, justify="right", no_wrap=True)
    for s in e.stages:
        b = s.breakdown
        t.add_row(str(s.stage), f"{s.parameters / 1e9:.2f}B", str(s.in_flight_chunks), _gb(b["model_states"]),
                  _gb(b["activations"]), _gb(b["logits_and_loss"]), _gb(b["other"]), _gb(s.allocated_bytes),
                  _gb(s.reserved_bytes), _gb(s.device_bytes))
    console.print(t)
    for s in e.stages:
        cats = ", ".join(f"{k.replace('_', ' ')} {_gb(v)}" for k, v in s.categories.items() if v)
        at = f" ({s.loss_moment})" if s.loss_moment else ""
        console.print(Text(f"stage {s.stage} at its peak{at}, in diagnose's categories (GiB): {cats}"))
    console.print(Text("at each stage's peak; other = FSDP buffers + DDP buckets + workspaces (+ optimizer-step "
                       "temporaries when the step is the peak); device = reserved + CUDA context + NCCL",
                       style="dim"))


@dataclass
class StepTimeDoc:
    """the modelled step time (:class:`~oomdoctor.plan.search.StepTime` with its total)"""

    __pydantic_config__ = _DOC

    compute_s: float
    """compute (seconds)"""
    tp_comm_s: float
    """tensor-parallel all-reduces (seconds)"""
    bubble_s: float
    """the pipeline bubble (seconds)"""
    dp_comm_s: float
    """exposed data-parallel communication (seconds)"""
    total_s: float
    """the step (seconds)"""


@dataclass
class CandidateDoc:
    """one plan"""

    __pydantic_config__ = _DOC

    label: str
    """the plan in one line"""
    plan: ParallelPlan
    """the parallel plan"""
    fits: str
    """yes, no, or a condition under which it fits"""
    relative_throughput: float
    """against the best plan (1.0)"""
    step_time_s: StepTimeDoc
    """the modelled step time (seconds)"""
    microbatches: int
    """micro-batches per step"""
    setting: str
    """the allocator setting the plan fits with ('' when none is needed or it does not fit)"""
    peak_stage: int
    """the stage with the most device bytes, under that setting"""
    peak_device_bytes: int
    """the worst stage's device bytes, under that setting (bytes)"""
    peak_allocated_bytes: int
    """the largest stage's allocated, under that setting (bytes)"""
    last_stage_allocated_bytes: int
    """the last stage's allocated, under that setting (bytes)"""
    why: list[str]
    """what decides its rank or its fit"""


@dataclass
class SearchDoc:
    """the parallel plans that fit"""

    __pydantic_config__ = _DOC

    model: str
    """the model"""
    gpus: int
    """GPUs"""
    gpu_memory_bytes: int
    """per GPU (bytes)"""
    rules: list[str]
    """the decision rules, in order"""
    rejected: int
    """plans rejected as invalid"""
    candidates: list[CandidateDoc]
    """valid plans, best first"""


def search_dict(r: SearchResult, limit: int | None = None) -> dict[str, Any]:
    """``plan search --format json``: :class:`SearchDoc` after the versions, the first ``limit`` candidates."""
    cands = r.candidates if limit is None else r.candidates[:limit]
    doc = SearchDoc(
        model=r.model.name, gpus=r.hardware.num_gpus, gpu_memory_bytes=r.hardware.gpu_memory_bytes, rules=r.rules,
        rejected=r.rejected,
        candidates=[CandidateDoc(
            label=c.plan.label(), plan=c.plan, fits=c.fits, relative_throughput=round(c.relative_throughput, 4),
            step_time_s=StepTimeDoc(c.step.compute_s, c.step.tp_comm_s, c.step.bubble_s, c.step.dp_comm_s,
                                    c.step.total_s),
            microbatches=c.estimate.microbatches, setting=c.setting, peak_stage=c.as_run.peak.stage,
            peak_device_bytes=c.as_run.peak.device_bytes,
            peak_allocated_bytes=max(s.allocated_bytes for s in c.as_run.stages),
            last_stage_allocated_bytes=c.as_run.last.allocated_bytes, why=c.why) for c in cands])
    return {"schema_version": SCHEMA_VERSION, "oomdoctor_version": __version__, **asdict(doc)}


_FITS_SHORT = {"with expandable_segments": "expandable"}


def render_search_text(r: SearchResult, console: Console, limit: int = 15) -> None:
    console.print(Text(f"{r.model.name} on {r.hardware.num_gpus} x {_gb(r.hardware.gpu_memory_bytes)} GiB "
                       f"({r.hardware.name}): {len(r.candidates)} valid plans, best first", style="bold"))
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for c in ("#", "plan", "peak GiB\n(stage)", "last stage\nalloc. GiB", "fits", "rel.\nthroughput"):
        t.add_column(c, justify="left" if c in ("plan", "fits") else "right", no_wrap=c != "plan")
    shown = r.candidates[:limit]
    for i, c in enumerate(shown, 1):
        style = {"yes": "green", "no": "red"}.get(c.fits, "yellow")
        peak = c.as_run.peak
        t.add_row(str(i), c.plan.label(), f"{_gb(peak.device_bytes)} ({peak.stage})",
                  _gb(c.as_run.last.allocated_bytes), Text(_FITS_SHORT.get(c.fits, c.fits), style=style),
                  f"{c.relative_throughput:.3f}")
    console.print(t)
    for i, c in enumerate(shown, 1):
        if c.why:
            console.print(hang("; ".join(c.why), 2, f"{i:>2}. "))
    console.print()  # the legend is not one more item of the list above
    console.print(Text("peak = device memory of the worst stage (reserved + context + NCCL), under the setting "
                       f"that makes the plan fit; expandable: fits with {alloc_conf_env()}=expandable_segments:True "
                       "(its peak is shown with it); GiB = 2^30 bytes", style="dim"))
    console.print(Text("Decision rules:", style="bold"))
    for i, rule in enumerate(r.rules, 1):
        console.print(hang(rule, 2, f"{i}. "))


@dataclass
class ValidationRowDoc:
    """one row"""

    __pydantic_config__ = _DOC

    test_dir: str
    """the Megatron-LM functional test"""
    golden_file: str
    """its golden values file"""
    predicted_bytes: int | None
    """predicted peak (bytes)"""
    measured_bytes: int | None
    """measured peak (bytes)"""
    refused: str | None
    """why the row is not predicted"""


@dataclass
class ValidationSummaryDoc:
    """the summary"""

    __pydantic_config__ = _DOC

    gpt_rows: int
    """GPT rows"""
    covered: int
    """rows predicted"""
    coverage: float
    """covered / GPT rows"""
    median_abs_rel_error: float | None
    """median |predicted - measured| / measured"""
    p90_abs_rel_error: float | None
    """90th percentile of the same"""
    floor_median_abs_rel_error: float | None
    """the least median error the configuration columns allow"""
    floor_p90_abs_rel_error: float | None
    """the same at the 90th percentile"""
    refused: dict[str, int]
    """rows refused per reason"""


@dataclass
class ValidateDoc:
    """predictions against a Megatron-LM golden-memory CSV"""

    __pydantic_config__ = _DOC

    rows: list[ValidationRowDoc]
    """per CSV row"""
    summary: ValidationSummaryDoc
    """the summary"""


def validation_dict(v: Validation) -> dict[str, Any]:
    """``plan validate --format json``: :class:`ValidateDoc` after the versions. The floor is the least error the
    configuration columns allow (:meth:`~..plan.validate.Validation.floor_errors`)."""
    g = v.gpt_rows

    def r4(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    doc = ValidateDoc(
        rows=[ValidationRowDoc(r.test_dir, r.golden_file, r.predicted_bytes, r.measured_bytes, r.reason or None)
              for r in v.rows],
        summary=ValidationSummaryDoc(
            gpt_rows=len(g), covered=v.covered, coverage=round(v.coverage, 4), median_abs_rel_error=r4(v.median_error),
            p90_abs_rel_error=r4(v.p90_error), floor_median_abs_rel_error=r4(v.floor_median),
            floor_p90_abs_rel_error=r4(v.floor_p90), refused=v.refused()))
    return {"schema_version": SCHEMA_VERSION, "oomdoctor_version": __version__, **asdict(doc)}


def render_plan_json(obj: dict[str, Any]) -> str:
    return json.dumps(obj, indent=2) + "\n"


def render_validation_text(v: Validation) -> str:
    d = validation_dict(v)["summary"]
    buf = io.StringIO()
    c = plain_console(buf, 80)
    c.print(f"GPT rows: {d['gpt_rows']}, estimated: {d['covered']} ({100 * d['coverage']:.1f}%)")
    if d["median_abs_rel_error"] is not None:
        c.print(f"absolute relative error of peak allocated on the last rank: median "
                f"{100 * d['median_abs_rel_error']:.1f}%, p90 {100 * d['p90_abs_rel_error']:.1f}%")
        c.print(f"floor the data allows (rows with the same configuration columns measure differently): median "
                f"{100 * d['floor_median_abs_rel_error']:.1f}%, p90 {100 * d['floor_p90_abs_rel_error']:.1f}%")
    if d["refused"]:
        c.print(f"refused ({d['gpt_rows'] - d['covered']} GPT rows, not in the statistics): "
                + "; ".join(f"{reason} ({n})" for reason, n in d["refused"].items()))
    return buf.getvalue()
