"""``oomdoctor tune``'s words: the answer (:class:`oomdoctor.report.tune.TuneOutcome`) as text and JSON, and the
winner as the user writes it (TrainingArguments and the launcher, or the script's command)."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .._version import SCHEMA_VERSION, __version__
from .format import format_bytes
from .words import tune as tune_words

if TYPE_CHECKING:
    from ..report.tune import Candidate, TuneOutcome

SUGGESTION_TEXT = {
    "fsdp2-full-shard": "FSDP2 full shard over {gpus} GPUs (fully_shard each decoder layer): about {per_gpu} a GPU",
    "more-gpus": "{gpus} GPUs with FSDP2 full shard: about {per_gpu} a GPU",
    "activation-checkpointing": "activation checkpointing (--checkpointing full) is not in the space: add it",
    "adamw8bit": "8-bit optimizer states (--allow-optimizer-change --optimizer adamw8bit): about {per_gpu} a GPU",
    "activations-exceed": "even the smallest configuration's memory besides the model state ({other}) leaves no "
                          "room: a shorter sequence or a smaller micro-batch",
}

_CONFIG_WORDS = {"micro_batch": "micro-batch", "grad_accum": "accum", "checkpointing": "checkpointing",
                 "optimizer": "optimizer", "sharding": "sharding", "allocator": "allocator"}


def tune_dict(t: "TuneOutcome") -> dict[str, Any]:
    """The ``--format json`` contract (``oomdoctor schema tune``): the outcome, with ``schema_version`` and
    ``oomdoctor_version``, and the winner as written (``best_as_written``)."""
    d = asdict(t)
    d["best_as_written"] = as_written(t, t.best) if t.best is not None else None
    return {"schema_version": SCHEMA_VERSION, "oomdoctor_version": __version__, **d}


def render_tune_json(t: "TuneOutcome") -> str:
    return json.dumps(tune_dict(t), indent=2, default=str) + "\n"


def _py(v: Any) -> str:
    return repr(v) if not isinstance(v, bool) else str(v)


def as_written(t: "TuneOutcome", c: "Candidate") -> list[str]:
    """The winner as the user writes it: TrainingArguments, the optimizer, the environment and the launcher
    (``--hf-config``), or the command with its knobs filled (a script)."""
    cfg = c.config
    alloc = cfg.get("allocator", "defaults")
    env = [] if alloc == "defaults" else [f"export PYTORCH_ALLOC_CONF={alloc}"]
    if t.space.get("mode") == "script":
        cmd = [a for a in t.job.get("command", [])]
        out = []
        for a in cmd:
            for k, v in cfg.items():
                a = a.replace("{" + k + "}", str(v))
            out.append(a)
        return env + [shlex.join(out)]
    ck = str(cfg.get("checkpointing", "none"))
    opt = str(cfg.get("optimizer", "fused"))
    kw = [f"per_device_train_batch_size={cfg['micro_batch']}", f"gradient_accumulation_steps={cfg['grad_accum']}"]
    dtype = t.job.get("dtype", "bf16")
    if dtype in ("bf16", "fp16"):
        kw.append(f"{dtype}=True")
    if ck != "none":
        gk: dict[str, Any] = {"use_reentrant": False}
        if ck.startswith("every-"):
            gk["every_n_layers"] = int(ck.removeprefix("every-"))
        kw += ["gradient_checkpointing=True", f"gradient_checkpointing_kwargs={gk!r}"]
    optim = {"fused": "adamw_torch_fused", "foreach": "adamw_torch", "for-loop": "adamw_torch",
             "adamw8bit": "adamw_bnb_8bit", "sgd": "sgd"}.get(opt, opt)
    kw.append(f"optim={optim!r}")
    lines = env + ["TrainingArguments(" + ", ".join(kw) + ")"]
    if opt == "for-loop":
        lines.append("Trainer(..., optimizers=(torch.optim.AdamW(model.parameters(), lr=args.learning_rate, "
                     "foreach=False), None))")
    n = int(t.space.get("world_size", 1))
    if n > 1:
        lines.append(f"torchrun --nproc_per_node={n} train.py")
    return lines


def _config_text(t: "TuneOutcome", cfg: dict[str, Any]) -> str:
    return ", ".join(f"{_CONFIG_WORDS.get(k, k)} {v}" for k, v in cfg.items()
                     if not (k == "sharding" and v == "none"))


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def render_tune_text(t: "TuneOutcome", rows: int = 20) -> str:
    job = t.job
    what = job.get("hf_config") or " ".join(job.get("command", []))
    sp = t.space
    n = int(sp.get("world_size", 1))
    head = f"oomdoctor tune: {what}"
    if job.get("seq_len"):
        head += f", sequence {job['seq_len']}"
    if sp.get("global_batch"):
        head += f", global batch {sp['global_batch']}"
    head += f", {n} GPU{'s' if n > 1 else ''}"
    lines = [head,
             f"on {t.gpu_name or 'the GPU'} ({format_bytes(t.gpu_total_bytes)}): {format_bytes(t.room_bytes)} for the "
             f"caching allocator, {format_bytes(t.margin_bytes)} of it kept free (preflight's margin)"]
    axes = "; ".join(f"{_CONFIG_WORDS.get(k, k)} {', '.join(str(v) for v in vals)}"
                     for k, vals in sp.get("axes", {}).items() if len(vals) > 1 or k != "sharding")
    lines.append(f"searched {len(t.candidates)} configurations ({axes}; allocator "
                 f"{', '.join(sp.get('allocators', []))})"
                 + (f"; micro-batches {', '.join(str(m) for m in t.dropped_micro_batches)} do not divide the global "
                    "batch" if t.dropped_micro_batches else ""))
    traced_n = len(t.traces)
    lines.append(f"memory: {traced_n} traces on the CPU under fake tensors in {t.trace_seconds:.1f} s; the other "
                 "configurations interpolated between the traced micro-batches of their class")
    if t.trials:
        steps = t.trials[0].steps_timed
        lines.append(f"measured: {len(t.trials)} runs on the GPU ({steps} optimizer steps timed each, after the "
                     f"warm-up), {t.gpu_seconds:.1f} s of GPU time")
    lines.append("")
    cols = [k for k in (sp.get("axes", {}) or {}) if k != "sharding" or n > 1]
    if sp.get("accum_axis") and sp["accum_axis"] not in cols:
        cols.insert(1 if cols else 0, sp["accum_axis"])
    cols.append("allocator")
    header = ["#"] + [_CONFIG_WORDS.get(c, c) for c in cols] + ["peak reserved + margin", "fits", "predicted/s",
                                                                 "measured/s", "memory"]
    body = []
    fit, seen = [], set()
    for c in t.candidates:  # one row per configuration: the allocator setting ranked first (the default where
        key = tuple((k, v) for k, v in c.config.items() if k != "allocator")  # it fits: the others run as fast)
        if c.fits and key not in seen:
            seen.add(key)
            fit.append(c)
    shown = fit[:rows]
    for c in shown:
        body.append([str(c.predicted_rank)] + [str(c.config.get(k, "")) for k in cols]
                    + [f"{format_bytes(c.predicted_peak_reserved_bytes)} + {format_bytes(c.margin_bytes)}",
                       "yes", _rate(c.predicted_samples_per_s), _rate(c.measured_samples_per_s), c.memory_basis])
    nofit = [c for c in t.candidates if not c.fits]
    for c in nofit[: max(0, min(3, rows - len(shown)))]:
        body.append(["-"] + [str(c.config.get(k, "")) for k in cols]
                    + [f"{format_bytes(c.predicted_peak_reserved_bytes)} + {format_bytes(c.margin_bytes)}",
                       "OOM" if c.oom else "no", _rate(c.predicted_samples_per_s), "-", c.memory_basis])
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    lines.append("  ".join(h.rjust(w) if i in (0,) else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths)))
                 .rstrip())
    lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
    for r in body:
        lines.append("  ".join(x.rjust(w) if i == 0 else x.ljust(w) for i, (x, w) in enumerate(zip(r, widths)))
                     .rstrip())
    more = len(fit) - len(shown)
    lines.append(f"{len(fit)} configurations fit (one row each, with the first allocator setting that does), "
                 f"{len(nofit)} do not" + (f"; {more} more rows" if more > 0 else "")
                 + ": --format json lists every one")
    lines.append("")
    if t.best is None:
        lines.append("nothing in the space fits on this GPU" + (":" if t.nothing_fits else "."))
        for s in t.nothing_fits:
            lines.append("  " + SUGGESTION_TEXT.get(s.id, s.id).format(
                gpus=s.gpus, per_gpu=format_bytes(s.per_gpu_bytes), other=format_bytes(s.other_bytes))
                + f" (model state {format_bytes(s.model_state_bytes)}, the rest {format_bytes(s.other_bytes)}, "
                  "estimated from the traces)")
    else:
        b = t.best
        how = (f"measured {_rate(b.measured_samples_per_s)} samples/s (predicted {_rate(b.predicted_samples_per_s)})"
               if t.measured else f"predicted {_rate(b.predicted_samples_per_s)} samples/s, not measured")
        ran = next((tr for tr in t.trials if tr.config == b.config and tr.measured_peak_reserved_bytes), None)
        peak = t.best_peak_reserved_bytes or b.predicted_peak_reserved_bytes
        measured = ran.measured_peak_reserved_bytes if ran else None
        held = (f"{format_bytes(measured)} measured, "
                f"{format_bytes(b.predicted_peak_reserved_bytes)} traced" if measured
                else f"{format_bytes(b.predicted_peak_reserved_bytes)} traced")
        lines.append(f"best: {_config_text(t, b.config)}: {how}; peak reserved {held}, "
                     f"{format_bytes(b.room_bytes - peak)} to spare")
        lines.append("as you write it:")
        lines += ["  " + x for x in as_written(t, b)]
    bad = [tr for tr in t.trials if tr.unpredicted_oom]
    if bad:
        lines.append(f"warning: {len(bad)} trial(s) ran out of memory though predicted to fit: "
                     + "; ".join(_config_text(t, tr.config) for tr in bad))
    over = [tr for tr in t.trials if tr.within_margin is False]
    if over:
        lines.append(f"warning: {len(over)} trial(s) reserved more than predicted plus the margin "
                     f"({format_bytes(t.margin_bytes)}): "
                     + "; ".join(f"{_config_text(t, tr.config)}: {format_bytes(tr.measured_peak_reserved_bytes or 0)} "
                                 f"measured, {format_bytes(tr.predicted_peak_reserved_bytes)} predicted"
                                 for tr in over))
    checked = [tr for tr in t.trials if tr.within_margin is not None]
    if checked and not over:
        lines.append(f"every run's measured peak reserved was within its prediction plus the margin "
                     f"({len(checked)} of {len(t.trials)} measured)")
    for tr in t.trials:
        if tr.outcome in ("failed", "ended-early"):
            what = "failed" if tr.outcome == "failed" else "ended before its timed steps"
            lines.append(f"a run {what} ({_config_text(t, tr.config)}): its output is in {tr.log}")
    if t.notes:
        lines.append("")
        lines += ["note: " + tune_words.note(x) for x in t.notes]
    return "\n".join(lines) + "\n"
