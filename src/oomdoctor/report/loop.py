"""The closed loop, its pure part: what ``oomdoctor verify`` and ``oomdoctor fit`` decide from the runs they start.

Running the job is the command's business (``cli/trials.py``); here are the facts and rules, no I/O:

- :func:`parse_setting`: a setting to verify, ``PYTORCH_ALLOC_CONF=expandable_segments:True``,
  ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` or a bare allocator option ``expandable_segments:True``, as the
  environment change it makes and the replay (``what_if``) that predicts it.
- :func:`proposed_settings`: the environment settings the diagnosis proposes (the fixes with a simulated
  prediction that apply to the recorded PyTorch version).
- :func:`predict` / :func:`judge`: the replayed claim for a setting over every rank, and the verdict of a rerun
  against it: ``confirmed`` or ``refuted`` (:data:`WHY`).
- :func:`fit_guess` and :class:`FitSearch`: the first trial of ``fit`` at the replayed answer, then galloping
  from it (steps 1, 2, 4, ...; from a lower bound, doubling the micro-batch), then bisection between the largest micro-batch that ran and the smallest that
  ran out of memory. Unguided (no snapshot, no answer), the first trial is ``start`` and the gallop doubles the
  micro-batch (as Lightning's ``BatchSizeFinder`` does), and halves it down from an OOM (as Hugging Face's
  ``auto_find_batch_size`` does).
- :func:`is_oom_output`: PyTorch's out-of-memory messages in a job's output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..analysis.device import DeviceAnalysis
from ..simulate.config import ConfigError, parse_config
from ..simulate.replay import RECORDED
from .fits import job_margin
from .model import Report
from .predict import Predictor, predictor

#: the allocator settings' environment variables (PyTorch >= 2.9 reads PYTORCH_ALLOC_CONF first)
ALLOC_ENVS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
#: settings that the allocator model replays as deferred frees completed at once
IMMEDIATE_FREE_ENVS = {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}

#: why a claim is confirmed or refuted, or why there is none
WHY = ("agrees", "oom-not-predicted", "ran-but-oom-predicted", "peak-above-margin", "peak-below-margin",
       "no-prediction", "failed")

#: PyTorch's out-of-memory messages: ``c10/cuda/CUDACachingAllocator.cpp`` (``CUDA out of memory. Tried to
#: allocate ...``), the exception's name (``torch.OutOfMemoryError``, ``torch.cuda.OutOfMemoryError``), and
#: cuBLAS / cuDNN failures to get their workspace (``CUBLAS_STATUS_ALLOC_FAILED``, ``CUDNN_STATUS_ALLOC_FAILED``)
OOM_PATTERN = re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED"
                         r"|CUDA error: out of memory")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SettingError(ValueError):
    """A setting that is neither ``NAME=value`` nor an allocator option PyTorch accepts."""


def is_oom_output(text: str) -> bool:
    """Does a job's output (stdout and stderr) carry one of PyTorch's out-of-memory messages
    (:data:`OOM_PATTERN`)?"""
    return OOM_PATTERN.search(text) is not None


@dataclass(frozen=True)
class Setting:
    """A setting to try: ``text`` as the user or the diagnosis wrote it; ``env``: the variable it sets and its
    value (an allocator option is added to the options already in the environment, see :func:`apply_setting`);
    ``what_if``: the replay that predicts it (None: the allocator model cannot replay it)."""

    text: str
    env: str
    value: str
    what_if: dict[str, str] | None


def parse_setting(text: str) -> Setting:
    """``NAME=value`` or a bare allocator option (``expandable_segments:True``, taken as ``PYTORCH_ALLOC_CONF``).

    Raises:
        SettingError: empty, or an allocator option PyTorch would reject (its message).
    """
    t = text.strip()
    name, sep, value = t.partition("=")
    if sep and _ENV_NAME.match(name) and ":" not in name:
        env, val = name, value
    else:
        env, val = ALLOC_ENVS[0], t
    if not val and env not in IMMEDIATE_FREE_ENVS:
        raise SettingError(f"setting {text!r}: no value")
    if env in ALLOC_ENVS:
        try:
            parse_config(val)
        except ConfigError as e:
            raise SettingError(f"setting {text!r}: {e}") from None
        return Setting(t, env, val, {"config": val})
    if IMMEDIATE_FREE_ENVS.get(env) == val:
        return Setting(t, env, val, {"deferred_frees": "immediate"})
    return Setting(t, env, val, None)


def apply_setting(env: dict[str, str], setting: Setting) -> dict[str, str]:
    """``env`` with ``setting`` applied. An allocator option is appended to the options the job already has
    (PyTorch parses them left to right, a later key overriding an earlier one: ``CUDAAllocatorConfig::
    parseArgs``), in the variable the job already uses, so its other options stay."""
    out = dict(env)
    if setting.env in ALLOC_ENVS:
        var = next((v for v in ALLOC_ENVS if out.get(v)), setting.env)
        out[var] = ",".join(p for p in (out.get(var, ""), setting.value) if p)
    else:
        out[setting.env] = setting.value
    return out


def proposed_settings(report: Report) -> list[str]:
    """The settings the diagnosis proposes, in the order of its findings: every fix that is an environment
    setting, has a simulated prediction, and is not known not to apply to the recorded PyTorch version."""
    out: list[str] = []
    for f in report.findings:
        for fx in f.fixes:
            if fx.kind == "env" and fx.setting and fx.prediction is not None and fx.applies is not False \
                    and fx.setting not in out:
                out.append(fx.setting)
    return out


@dataclass
class Claim:
    """What the replay of the recorded run says a setting does, on the rank where it is tightest. Bytes.

    ``peak_reserved_bytes``: the replay's peak reserved (of the step extended past a recorded OOM when that was
    replayed); ``oom``: the replay ran out of memory (in the recorded events or in the extended step);
    ``margin_bytes``: the prediction's own margin when it carries one, else the job's step-to-step spread plus
    rounding (:func:`oomdoctor.report.fits.job_margin`); ``lower_bound``: only the recorded events were
    replayed past a recorded OOM, so the peak is at least this; ``reach``: :data:`oomdoctor.report.predict.REACHES`."""

    rank: int
    peak_reserved_bytes: int
    oom: bool
    margin_bytes: int
    margin_source: str
    lower_bound: bool
    reach: str
    self_replay_exact: bool


def claim_of(prediction: dict[str, Any], analysis: DeviceAnalysis) -> Claim:
    """A :class:`Claim` from a prediction (``Predictor.run``'s dict)."""
    reach = prediction["reach"]
    peak = int(prediction["peak_reserved_bytes"])
    if "extended_peak_reserved_bytes" in prediction:
        peak = max(peak, int(prediction["extended_peak_reserved_bytes"]))
    oom = prediction.get("oom") is not None or reach == "step-ran-out"
    if isinstance(prediction.get("margin_bytes"), int):
        # a rerun measures the whole job: the recorded steps' margin and, where the job measured one, the margin of
        # what they do not cover (issue 49: report/predict.py's continuation)
        cont = (prediction.get("continuation") or {}).get("margin_bytes")
        margin, source = int(prediction["margin_bytes"]) + int(cont or 0), "prediction"
    else:
        margin, source = job_margin(analysis)[0], "job-spread"
    return Claim(rank=int(prediction["rank"]), peak_reserved_bytes=peak, oom=oom, margin_bytes=margin,
                 margin_source=source, lower_bound=reach == "recorded" and not oom, reach=reach,
                 self_replay_exact=bool(prediction.get("self_replay_exact")))


def predict(analyses: list[DeviceAnalysis], setting: Setting,
            predictors: dict[int, Predictor | None] | None = None) -> Claim | None:
    """The claim for ``setting`` over every rank that can be replayed: the first rank predicted to run out of
    memory, else the rank with the highest predicted peak. None when the setting has no replay or no rank
    can be replayed. ``predictors``: rank -> :class:`Predictor`, made on demand and kept."""
    if setting.what_if is None:
        return None
    predictors = predictors if predictors is not None else {}
    claims = []
    for a in analyses:
        if a.rank not in predictors:
            predictors[a.rank] = predictor(a)
        p = predictors[a.rank]
        if p is not None:
            claims.append(claim_of(p.run({"deferred_frees": RECORDED, **setting.what_if}), a))
    if not claims:
        return None
    return max(claims, key=lambda c: (c.oom, c.peak_reserved_bytes))


def judge(claim: Claim | None, measured_peak: int | None, oom: bool, failed: bool) -> tuple[bool | None, str]:
    """Confirmed (True), refuted (False) or no claim (None), and why (:data:`WHY`).

    Refuted: predicted to run but ran out of memory; predicted to run out but ran; or ran as predicted with a
    measured peak reserved above the predicted peak plus the margin, or below it less the margin (not for a
    claim that is only a lower bound: a replay cut at the recorded OOM). A claim of an OOM is judged on the OOM
    alone (the measured peak is where the rerun stopped)."""
    if failed:
        return None, "failed"
    if claim is None:
        return None, "no-prediction"
    if oom and not claim.oom:
        return False, "oom-not-predicted"
    if claim.oom and not oom:
        return False, "ran-but-oom-predicted"
    if not oom and measured_peak is not None:
        if measured_peak > claim.peak_reserved_bytes + claim.margin_bytes and not claim.lower_bound:
            return False, "peak-above-margin"
        if measured_peak < claim.peak_reserved_bytes - claim.margin_bytes:
            return False, "peak-below-margin"
    return True, "agrees"


# ------------------------------------------------------------------------------------------------ fit

GUIDES = ("replayed", "lower-bound", "estimate", "none")


def fit_guess(report: Report) -> tuple[int | None, str]:
    """The micro-batch the replay says fits, over every rank (the smallest), and what it is (:data:`GUIDES`):
    ``replayed`` (``fits.largest_micro_batch``), ``lower-bound`` (the replay's search stopped at its upper
    limit: at least that fits), ``estimate`` (a trace cut in its first forward pass), ``none``."""
    best: list[tuple[int, str]] = []
    for r in report.ranks:
        f = r.fits
        if f is None:
            continue
        if f.largest_micro_batch is not None:
            best.append((f.largest_micro_batch, "lower-bound" if f.batch_scale_at_limit else "replayed"))
        elif f.estimated_largest_micro_batch is not None:
            best.append((f.estimated_largest_micro_batch, "estimate"))
    if not best:
        return None, "none"
    return min(best)


@dataclass
class FitSearch:
    """The search for the largest micro-batch in ``[low, high]`` that runs (see the module doc).

    Feed it with :meth:`record` (a trial's micro-batch and whether it ran); :meth:`propose` says the next
    micro-batch to try, None when the answer is known: ``largest_ran`` (None when ``low`` ran out of memory).
    A micro-batch that ran says every smaller one runs, and one that ran out of memory says every larger one
    does (memory grows with the micro-batch): the answer is never above a micro-batch that ran."""

    low: int
    high: int
    first: int
    guided: bool
    largest_ran: int | None = None
    smallest_oom: int | None = None
    tried: list[int] = field(default_factory=list)
    _anchor: int | None = None
    _step: int = 0
    _up: bool = True
    _galloping: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"micro-batch range [{self.low}, {self.high}] is empty")
        self.first = min(max(self.first, self.low), self.high)

    def record(self, micro_batch: int, ran: bool, anchor: bool = True) -> None:
        """A trial's outcome. ``anchor=False``: a run made before the search (the recorded run that gave the
        guess) bounds the answer but does not start the gallop."""
        self.tried.append(micro_batch)
        if ran:
            if self.largest_ran is None or micro_batch > self.largest_ran:
                self.largest_ran = micro_batch
        elif self.smallest_oom is None or micro_batch < self.smallest_oom:
            self.smallest_oom = micro_batch
        if not anchor:
            return
        if self._anchor is None:  # the gallop starts from the first trial
            self._anchor, self._up, self._step, self._galloping = micro_batch, ran, 1, True
        elif ran != self._up:  # the gallop crossed the edge: bisect from now on
            self._galloping = False
        else:
            self._step *= 2

    @property
    def done(self) -> bool:
        return self.propose() is None

    def _bounds(self) -> tuple[int, int]:
        """The open interval still unknown: (largest that ran or low-1, smallest OOM or high+1)."""
        lo = self.largest_ran if self.largest_ran is not None else self.low - 1
        hi = self.smallest_oom if self.smallest_oom is not None else self.high + 1
        return lo, hi

    def propose(self) -> int | None:
        lo, hi = self._bounds()
        if hi - lo <= 1:
            return None
        if self._anchor is None:
            return min(max(self.first, lo + 1), hi - 1)
        if not self._galloping:
            return (lo + hi) // 2  # bracketed: bisect
        if self._up:  # all ran so far: gallop up from the largest that ran
            nxt = min(self.largest_ran + self._step, self.high) if self.guided else \
                min(max(self.largest_ran * 2, self.largest_ran + 1), self.high)
        else:  # all ran out: gallop down from the smallest OOM
            nxt = max(self.smallest_oom - self._step, self.low) if self.guided else \
                max(self.smallest_oom // 2, self.low)
        return nxt if lo < nxt < hi else (lo + hi) // 2


# ------------------------------------------------------------------------------------------ outcomes

OUTCOMES = ("ran", "oom", "failed")


@dataclass
class Trial:
    """One real run of the command: ``micro_batch`` (fit) or None; ``outcome`` (:data:`OUTCOMES`);
    ``seconds`` of wall time; ``exit_code`` (negative: killed by that signal); ``recorded``: run under
    recording; ``stopped``: every process that stepped an optimizer ended itself after the steps asked;
    ``timed_out``: killed at the trial time limit; ``measured_peak_reserved_bytes``: the most reserved on
    any rank (``memory_stats`` ``reserved_bytes.all.peak`` in the recorder's sidecars; None without them);
    ``log``: the file holding its output.

    The docstring under each field is its description in the JSON schema (``oomdoctor schema fit``, ``verify``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    micro_batch: int | None
    """the micro-batch of this run (fit), null for verify's runs"""
    outcome: str
    """how the run ended: 'ran' (exit code 0), 'oom' (non-zero exit with PyTorch's out-of-memory message or an OOM
    dump), 'failed' (non-zero exit without one)"""
    seconds: float
    """wall time of the run (s)"""
    exit_code: int
    """the command's exit code (negative: killed by that signal)"""
    recorded: bool
    """run under recording (snapshots written)"""
    stopped: bool
    """the job ended itself after the optimizer steps asked"""
    timed_out: bool
    """killed at the trial time limit"""
    measured_peak_reserved_bytes: int | None
    """the most reserved on any rank: memory_stats reserved_bytes.all.peak in the recorder's sidecars (bytes)"""
    log: str
    """the file holding the run's output"""


@dataclass
class FitOutcome:
    """``oomdoctor fit``'s answer: ``largest_micro_batch`` that ran (None: even ``low`` ran out of memory, or a
    trial failed), ``smallest_oom_micro_batch``; ``guide`` (:data:`GUIDES`) and ``predicted_micro_batch``, the
    replayed answer of the recorded first trial that the search started from; ``snapshot``: a snapshot was
    recorded (False: no GPU, or the job died before CUDA was used; the search is then by trials alone);
    ``trials`` in the order run (the recorded one first); ``seconds``: all of it, analysis included;
    ``analysis_seconds``: the diagnosis and replays of the recorded trial; ``error``: why the search stopped
    short (``failed``: a trial failed without an OOM message, ``max-trials``), else None.

    The docstring under each field is its description in the JSON schema (``oomdoctor schema fit``, ``verify``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    command: list[str]
    """the command, with {mb} where the micro-batch goes"""
    steps: int
    """optimizer steps each trial runs"""
    low: int
    """the smallest micro-batch searched"""
    high: int
    """the largest micro-batch searched"""
    start: int
    """the micro-batch of the first, recorded trial"""
    snapshot: bool
    """a snapshot was recorded (false: no GPU, or the job ended before using CUDA: the search is by trials alone)"""
    guide: str
    """what the search started from: the replayed answer, a lower bound of it, an estimate, or none"""
    predicted_micro_batch: int | None
    """the micro-batch the replay of the recorded trial says fits"""
    largest_micro_batch: int | None
    """the largest micro-batch that ran (null: none did, or the search stopped)"""
    smallest_oom_micro_batch: int | None
    """the smallest micro-batch that ran out of memory"""
    trials: list[Trial]
    """every trial, in the order run (the recorded one first)"""
    seconds: float
    """wall time of the whole search, analysis included (s)"""
    analysis_seconds: float
    """wall time of the diagnosis and replays of the recorded trial (s)"""
    error: str | None = None
    """why the search stopped short: 'failed' (a trial failed without an OOM message) or 'max-trials'"""

    @property
    def trial_count(self) -> int:
        """trials run"""
        return len(self.trials)


@dataclass
class Verified:
    """One setting's rerun against its claim: ``config`` as given; ``env``: the variable and value the rerun
    had; ``predicted_*`` from the replay of the recorded first run (None: no claim), with ``margin_bytes`` and
    its ``margin_source`` (``prediction``: the prediction's own, ``job-spread``: the job's step-to-step spread
    plus rounding), ``predicted_peak_is_lower_bound`` (replayed only up to the recorded OOM) and ``reach``;
    ``measured_*`` and ``oom`` from the rerun; ``confirmed`` True / False / None (no claim, or the rerun failed)
    and ``why`` (:data:`WHY`).

    The docstring under each field is its description in the JSON schema (``oomdoctor schema fit``, ``verify``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    config: str
    """the setting as given or proposed (NAME=value, or an allocator option)"""
    env: dict[str, str]
    """the environment variables the rerun had set for it"""
    predicted_peak_reserved_bytes: int | None
    """the replay's peak reserved on the tightest rank (bytes)"""
    predicted_oom: bool | None
    """the replay ran out of memory (null: no claim)"""
    margin_bytes: int | None
    """the prediction's margin: the measured peak must be within it (bytes)"""
    margin_source: str | None
    """'prediction' (the prediction's own margin) or 'job-spread' (the job's step-to-step spread of its peak plus
    rounding)"""
    predicted_peak_is_lower_bound: bool
    """replayed only up to the recorded OOM: the peak is at least the prediction"""
    reach: str | None
    """how far the replay reaches"""
    predicted_rank: int | None
    """the rank the claim is for"""
    measured_peak_reserved_bytes: int | None
    """the rerun's most reserved on any rank (bytes)"""
    oom: bool
    """the rerun ran out of memory"""
    confirmed: bool | None
    """true: the rerun agrees with the claim; false: refuted; null: no claim, or the rerun failed"""
    why: str
    """why"""
    trial: Trial
    """the rerun"""


@dataclass
class VerifyOutcome:
    """``oomdoctor verify``'s answer: the ``baseline`` run (recorded, default settings), where the settings come
    from (``source``: ``given`` or ``diagnosis``), ``snapshot`` (a snapshot was recorded: claims exist),
    ``steps`` of the baseline and ``rerun_steps`` of each rerun (through the step where the baseline ran out of
    memory, which is as far as a claim replayed past that OOM reaches; else ``steps``), and each setting's result.

    The docstring under each field is its description in the JSON schema (``oomdoctor schema fit``, ``verify``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    command: list[str]
    """the command"""
    steps: int
    """optimizer steps of the recorded baseline run"""
    rerun_steps: int
    """optimizer steps of each rerun (through the step of the baseline's OOM, else steps)"""
    snapshot: bool
    """the baseline recorded a snapshot (false: no claims, the settings are only rerun)"""
    source: str
    """where the settings come from"""
    baseline: Trial
    """the recorded run with the settings as they are"""
    settings: list[Verified]
    """each setting's rerun"""
    seconds: float
    """wall time of everything (s)"""

    @property
    def refuted(self) -> int:
        """claims the reruns refuted (the exit code is 1 when any)"""
        return sum(1 for v in self.settings if v.confirmed is False)

    @property
    def failed(self) -> int:
        return sum(1 for v in self.settings if v.why == "failed")


def verified(setting: Setting, claim: Claim | None, trial: Trial, env: dict[str, str]) -> Verified:
    """Judge ``trial`` (the rerun with ``setting``) against ``claim``."""
    oom = trial.outcome == "oom"
    ok, why = judge(claim, trial.measured_peak_reserved_bytes, oom, trial.outcome == "failed")
    return Verified(config=setting.text, env=env, predicted_peak_reserved_bytes=None if claim is None
                    else claim.peak_reserved_bytes, predicted_oom=None if claim is None else claim.oom,
                    margin_bytes=None if claim is None else claim.margin_bytes,
                    margin_source=None if claim is None else claim.margin_source,
                    predicted_peak_is_lower_bound=bool(claim and claim.lower_bound),
                    reach=None if claim is None else claim.reach, predicted_rank=None if claim is None else claim.rank,
                    measured_peak_reserved_bytes=trial.measured_peak_reserved_bytes, oom=oom, confirmed=ok, why=why,
                    trial=trial)
