"""The closed loop, its pure part: what ``oomdoctor verify`` and ``oomdoctor fit`` decide from the runs they start.

Running the job is the command's business (``cli/trials.py``); here are the facts and rules, no I/O:

- :func:`parse_setting`: a setting to verify, ``PYTORCH_ALLOC_CONF=expandable_segments:True``,
  ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` or a bare allocator option ``expandable_segments:True``, as the
  environment change it makes and the replay (``what_if``) that predicts it.
- :func:`proposed_settings`: the environment settings the diagnosis proposes (the fixes with a simulated
  prediction that apply to the recorded PyTorch version).
- :func:`predict` / :func:`judge`: the replayed claim for a setting over every rank, and the verdict of a rerun
  against it: ``confirmed`` or ``refuted`` (:data:`WHY`).
- :func:`fit_guess` and :class:`FitSearch`: the tightest rank's replayed answer is ``fit``'s first guided trial,
  then a short gallop from it and bisection, never more than :data:`EXTRA_TRIALS` trials beyond the doubling
  search from the same start (:func:`doubling_walk`: doubling up from a run, as Lightning's ``BatchSizeFinder``,
  halving down from an OOM, then bisection), which is the search without a guess.
- :func:`trial_outcome`: how a trial ended, from what PyTorch says first (the injection's exit records: the stop
  after K optimizer steps, ``memory_stats()["num_ooms"]``; the recorder's OOM dump), then the exit code and
  :func:`is_oom_output`, PyTorch's out-of-memory messages in the job's output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..analysis.device import DeviceAnalysis
from ..simulate.config import ConfigError, parse_config
from ..simulate.replay import RECORDED
from .model import Report
from .predict import Predictor, predictor

#: the allocator settings' environment variables (PyTorch >= 2.9 reads PYTORCH_ALLOC_CONF first)
ALLOC_ENVS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
#: settings that the allocator model replays as deferred frees completed at once
IMMEDIATE_FREE_ENVS = {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}

#: why a claim is confirmed or refuted, or why there is none
WHY = ("agrees", "oom-not-predicted", "ran-but-oom-predicted", "peak-above-margin", "peak-below-margin",
       "no-prediction", "failed", "ended-early")

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

    ``peak_reserved_bytes``: the replay's peak reserved (for a step extended past a recorded OOM whose continuation
    has a measured margin, the higher of the recorded events' and the extended step's, as the prediction's
    ``spare_bytes`` takes it; without one, the recorded events'); ``oom``: the replay ran out of memory (in the
    recorded events or in the extended step); ``margin_bytes``: the prediction's own ``margin_bytes``
    (:mod:`oomdoctor.report.margin`; None when it carries none: the peak is then not judged), plus its
    continuation's where it counts the extended step; ``lower_bound``: the peak is at least this, nothing more is
    committed: only the recorded events were replayed past a recorded OOM, or the rest of the step was replayed but
    no margin of it was measured; ``reach``: :data:`oomdoctor.report.predict.REACHES`."""

    rank: int
    peak_reserved_bytes: int
    oom: bool
    margin_bytes: int | None
    margin_source: str
    lower_bound: bool
    reach: str
    self_replay_exact: bool


MARGIN_SOURCES = ("prediction", "none")


def claim_of(prediction: Mapping[str, Any]) -> Claim:
    """A :class:`Claim` from a prediction (``Predictor.run``'s dict, as the JSON carries it)."""
    reach = prediction["reach"]
    peak = int(prediction["peak_reserved_bytes"])
    oom = prediction.get("oom") is not None or reach == "step-ran-out"
    m = prediction.get("margin_bytes")
    margin = int(m) if isinstance(m, int) and not isinstance(m, bool) and m >= 0 else None
    continuation: Mapping[str, Any] = prediction.get("continuation") or {}
    c = continuation.get("margin_bytes")
    cont = int(c) if isinstance(c, int) and not isinstance(c, bool) and c >= 0 else None
    lower_bound = reach == "recorded" and not oom
    if isinstance(prediction.get("extended_peak_reserved_bytes"), int):
        if cont is not None or oom:
            peak = max(peak, int(prediction["extended_peak_reserved_bytes"]))
        else:
            # the rest of the step, replayed as the previous step ran it, is what the recorded steps do not cover:
            # with no margin of it measured (fewer than two complete steps) it is a condition, not a number (issue
            # 49): the claim commits to the recorded events, which the rerun runs too, so its peak is at least theirs
            lower_bound = True
    if margin is not None:
        # a rerun measures the whole job: the recorded steps' margin and, where the job measured one, the margin of
        # what they do not cover (issue 49: report/predict.py's continuation)
        margin += cont or 0
    return Claim(rank=int(prediction["rank"]), peak_reserved_bytes=peak, oom=oom, margin_bytes=margin,
                 margin_source="none" if margin is None else "prediction", lower_bound=lower_bound, reach=reach,
                 self_replay_exact=bool(prediction.get("self_replay_exact")))


def predict(analyses: list[DeviceAnalysis], setting: Setting,
            predictors: dict[int, Predictor | None] | None = None) -> Claim | None:
    """The claim for ``setting`` over every rank that can be replayed: the tightest rank's, the first predicted to
    run out of memory, else the one with the highest predicted peak (the rerun's measured peak is the highest
    of any rank: :func:`band` compares like with like). None when the setting has no replay or no rank can be
    replayed. ``predictors``: rank -> :class:`Predictor`, made on demand and kept."""
    if setting.what_if is None:
        return None
    predictors = predictors if predictors is not None else {}
    claims: list[Claim] = []
    for a in analyses:
        if a.rank not in predictors:
            predictors[a.rank] = predictor(a)
        p = predictors[a.rank]
        if p is not None:
            claims.append(claim_of(p.run({"deferred_frees": RECORDED, **setting.what_if})))
    if not claims:
        return None
    return max(claims, key=lambda c: (c.oom, c.peak_reserved_bytes))


def band(claim: Claim | None) -> tuple[int | None, int | None]:
    """The measured peaks reserved that confirm a claim that the setting runs: ``(low, high)`` bytes, both
    included; None for an open end. Derivation (``docs/verify.md``, "The band"):

    - both sides measure the same bytes: the replay's peak reserved is the caching allocator's reserved bytes, and
      the rerun's is ``memory_stats()["reserved_bytes.all.peak"]``, the same counter (memory outside the
      allocator is in neither); both are the tightest rank's (:func:`predict`; the measured peak is the highest of
      any rank);
    - the prediction's ``margin_bytes`` is the distance between a rerun's peak and the replay's that the prediction
      itself commits to (:mod:`oomdoctor.report.margin`: each term is a measured way for them to differ), taken as
      the JSON and the report carry it, on either side: ``[peak - margin, peak + margin]``;
    - a claim replayed only up to the recorded OOM, or extended by the rest of the step with no margin of it measured
      (``lower_bound``), says the peak is at least ``peak``: only ``peak - margin`` bounds it;
    - no band: a claim of an OOM (judged on the OOM alone: the measured peak is where the rerun stopped), or a
      prediction without a margin (the peak is not judged)."""
    if claim is None or claim.oom or claim.margin_bytes is None:
        return None, None
    low = max(claim.peak_reserved_bytes - claim.margin_bytes, 0)
    return low, None if claim.lower_bound else claim.peak_reserved_bytes + claim.margin_bytes


def judge(claim: Claim | None, measured_peak: int | None, oom: bool, failed: bool) -> tuple[bool | None, str]:
    """Confirmed (True), refuted (False) or no claim (None), and why (:data:`WHY`).

    Refuted: predicted to run but ran out of memory; predicted to run out but ran; or ran as predicted with a
    measured peak reserved outside the :func:`band`. ``failed``: the rerun did not end in a run or an OOM (a
    failure, or it ended before its K-th optimizer step): nothing is judged."""
    if failed:
        return None, "failed"
    if claim is None:
        return None, "no-prediction"
    if oom and not claim.oom:
        return False, "oom-not-predicted"
    if claim.oom and not oom:
        return False, "ran-but-oom-predicted"
    low, high = band(claim)
    if not oom and measured_peak is not None:
        if high is not None and measured_peak > high:
            return False, "peak-above-margin"
        if low is not None and measured_peak < low:
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


#: trials the guided search may run beyond the doubling search's from the same start, for any edge and any guess:
#: the guess, its neighbour and the gallop's next step. No search that tries a guess can promise none: where the
#: edge is the start itself, the doubling search needs one trial (the one above the start), which a guess
#: anywhere else cannot replace. 2 would leave a guess one below the edge, next to the start, to the doubling
#: search (88 ran, guess 93, edge 94: 9 trials where the gallop takes 5); docs/verify.md has the trade measured.
EXTRA_TRIALS = 3
#: the gallop's steps away from the guess: its neighbour (1), then ``2u`` and ``4u`` with ``u = max(1, guess //
#: GALLOP_UNIT)``: 1 + 6u micro-batches in all, about 9% of the guess. The replay's answers were 1.1-2.1% below the
#: largest that ran on the device (docs/verify.md, rounds 4, 12, 13) and issue 49 item 4 asks for at most 5% below:
#: the gallop brackets those; a guess further off is searched as the doubling search would.
GALLOP_STEPS = 3
GALLOP_UNIT = 64


def doubling_walk(low: int, high: int, start: int, largest_ran: int | None,
                  smallest_oom: int | None) -> tuple[int | None, int]:
    """The doubling search from ``start`` over ``[low, high]``, walked against what is known (every micro-batch up
    to ``largest_ran`` runs, every one from ``smallest_oom`` runs out): ``(its first trial whose outcome is not
    known, or None when it would be done; how many of its trials have a known outcome)``.

    The doubling search: ``start``; after a run, twice the largest that ran (``max(2x, x + 1)``, at most ``high``)
    until one runs out of memory (Lightning's ``BatchSizeFinder`` in ``binsearch`` mode); after an OOM at the start,
    half the smallest that ran out (at least ``low``) until one runs (as ``auto_find_batch_size`` did before
    accelerate 1.0); then bisection of its own bracket, ``(ran + oom) // 2``, until they are adjacent."""
    lr = low - 1 if largest_ran is None else largest_ran
    so = high + 1 if smallest_oom is None else smallest_oom
    dl, ds = low - 1, high + 1
    x, up, known = start, None, 0
    while True:
        if lr < x < so:
            return x, known
        known += 1
        ran = x <= lr
        if ran:
            dl = x
        else:
            ds = x
        up = ran if up is None else up
        if ds - dl <= 1:
            return None, known
        if up and ds > high:
            x = min(max(2 * dl, dl + 1), high)
        elif not up and dl < low:
            x = max(ds // 2, low)
        else:
            x = (dl + ds) // 2


@dataclass
class FitSearch:
    """The search for the largest micro-batch in ``[low, high]`` that runs.

    Feed it with :meth:`record` (a trial's micro-batch and whether it ran; the first is ``start``, the recorded
    trial); :meth:`propose` says the next micro-batch to try, None when the answer is known: ``largest_ran``
    (None when ``low`` ran out of memory), next to ``smallest_oom`` (or above ``high``). A micro-batch that ran
    says every smaller one runs, and one that ran out says every larger one does (memory grows with the
    micro-batch): the answer is never above a micro-batch that ran.

    - ``guide="none"``: the doubling search from ``start`` (:func:`doubling_walk`).
    - ``guide`` ``replayed`` / ``estimate``: the ``guess`` first; then a gallop away from it in the direction its
      outcome says (:data:`GALLOP_STEPS`: its neighbour, then steps growing by doubling); bisection of the bracket
      once both ends are known.
    - ``guide="lower-bound"``: the ``guess`` (at least that fits), then no gallop.
    - A guess the start contradicts (below a start that ran, or at or above one that ran out of memory) says
      nothing the start does not: ``guess_contradicted``, and the search is the doubling search's.
    - Every other trial, and every guided one the bound refuses, is the doubling search's own: its next trial whose
      outcome is not known yet (:func:`doubling_walk`; a guess that ran has answered each of its trials up to the
      guess, one that ran out each of its trials from the guess up).

    The bound: a guided trial that is not the doubling search's next is made only when, even if its outcome
    answers none of the doubling search's trials, the trials run do not exceed the doubling search's trials with a
    known outcome by more than :data:`EXTRA_TRIALS`. A trial of the doubling search's own adds one to both. At the
    end every trial of the doubling search has a known outcome, so for every edge the guided search has run at most
    :data:`EXTRA_TRIALS` trials more than the doubling search from the same start; a guess far below the edge
    answers many of them (ViT-B from 1, guessed 600, edge 2,135: 19 trials where the doubling search takes 24)."""

    low: int
    high: int
    start: int
    guess: int | None = None
    guide: str = "none"
    largest_ran: int | None = None
    smallest_oom: int | None = None
    tried: list[int] = field(default_factory=list[int])
    guess_contradicted: bool = False
    _guess_ran: bool | None = None
    _gallop: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"micro-batch range [{self.low}, {self.high}] is empty")
        if self.guide not in GUIDES:
            raise ValueError(f"unknown guide {self.guide!r}")
        self.start = min(max(self.start, self.low), self.high)
        if self.guess is None:
            self.guide = "none"

    def record(self, micro_batch: int, ran: bool) -> None:
        """A trial's outcome (the first: ``start``)."""
        proposed, kind = self._candidate() if self.tried and self.guide != "none" else (None, None)
        self.tried.append(micro_batch)
        if ran:
            if self.largest_ran is None or micro_batch > self.largest_ran:
                self.largest_ran = micro_batch
        elif self.smallest_oom is None or micro_batch < self.smallest_oom:
            self.smallest_oom = micro_batch
        if len(self.tried) == 1 and self.guess is not None and (self.guess < micro_batch if ran else
                                                                   self.guess >= micro_batch):
            self.guess_contradicted, self.guide = True, "none"
        if micro_batch != proposed:
            return
        if kind == "guess":
            self._guess_ran = ran
        elif kind == "gallop":
            self._gallop += 1

    @property
    def done(self) -> bool:
        return self.propose() is None

    def _bounds(self) -> tuple[int, int]:
        """The open interval still unknown: (largest that ran or low-1, smallest OOM or high+1)."""
        lo = self.largest_ran if self.largest_ran is not None else self.low - 1
        hi = self.smallest_oom if self.smallest_oom is not None else self.high + 1
        return lo, hi

    def _walk(self) -> tuple[int | None, int]:
        return doubling_walk(self.low, self.high, self.start, self.largest_ran, self.smallest_oom)

    def _candidate(self) -> tuple[int | None, str | None]:
        """The guided trial (see the class doc) and what it is (``guess``, ``gallop``, ``bisect``), or (None, None):
        the doubling search's next."""
        lo, hi = self._bounds()
        if self._guess_ran is None:
            return min(max(self.guess or lo + 1, lo + 1), hi - 1), "guess"
        if self.guide != "lower-bound" and self._gallop < GALLOP_STEPS:
            step = 1 if self._gallop == 0 else max(1, (self.guess or 0) // GALLOP_UNIT) << self._gallop
            x = lo + step if self._guess_ran else hi - step
            if lo < x < hi and self.low <= x <= self.high:
                return x, "gallop"
        if lo >= self.low and hi <= self.high:
            return (lo + hi) // 2, "bisect"
        return None, None

    def propose(self) -> int | None:
        lo, hi = self._bounds()
        if hi - lo <= 1:
            return None
        if not self.tried:
            return self.start
        walk, known = self._walk()
        if self.guide != "none":
            g = self._candidate()[0]
            if g is not None and lo < g < hi and len(self.tried) + 1 - known <= EXTRA_TRIALS:
                return g
        return walk if walk is not None else (lo + hi) // 2


# ------------------------------------------------------------------------------------------ outcomes

OUTCOMES = ("ran", "oom", "failed", "ended-early")
EVIDENCE = ("num-ooms", "oom-dump", "stop", "oom-message", "exit-code", "no-stop")
"""What says how a trial ended (:func:`trial_outcome`): an exit record's ``num_ooms``; the recorder's OOM dump; the
stop after K optimizer steps; PyTorch's out-of-memory message in the output; the exit code; exit code 0 without
the stop."""


def trial_outcome(exits: list[dict[str, Any]], exit_code: int, *, oom_dump: bool,
                  oom_message: bool) -> tuple[str, str]:
    """How a trial ended (:data:`OUTCOMES`) and what says so (:data:`EVIDENCE`): what PyTorch says first, the
    exit code and the output last.

    ``exits``: the exit records the injection wrote, one per process that used CUDA or stepped an optimizer
    (:mod:`oomdoctor.capture.exits`: ``stopped``, ``memory_stats``); ``oom_dump``: the recorder's OOM observer
    dumped during the trial; ``oom_message``: PyTorch's out-of-memory message is in the output
    (:func:`is_oom_output`).

    1. ``oom`` / ``num-ooms``: a process's ``memory_stats()["num_ooms"]`` is above 0. The caching allocator counts
       every out-of-memory error it raises (``c10/cuda/CUDACachingAllocator.cpp``, ``malloc``: ``stats.num_ooms +=
       1`` before ``TORCH_CHECK_WITH(OutOfMemoryError, ...)``), whether the job catches it or not: a job that
       catches its OOM and exits 0, or that goes on at a smaller batch, ran out of memory at this one.
    2. ``oom`` / ``oom-dump``: the recorder's OOM observer wrote ``rank{R}_oom.pickle`` during the trial.
    3. ``ran`` / ``stop``: the stop after K optimizer steps fired (an exit record says ``stopped``) and the command
       exited 0.
    4. ``oom`` / ``oom-message``: PyTorch's message in the output, with nothing above to say otherwise (a process
       without an exit record: killed, or no CUDA; cuBLAS / cuDNN failing to get their workspace).
    5. ``failed`` / ``exit-code``: any other non-zero exit.
    6. ``ended-early`` / ``no-stop``: exit code 0, but the stop never fired: the job ended before its K-th
       optimizer step (fewer steps than asked, no ``torch.optim`` optimizer, or it returned after an error). It is
       not counted as a run: nothing says it would have run K steps."""
    for e in exits:
        stats: Mapping[str, Any] = e.get("memory_stats") or {}
        n = stats.get("num_ooms")
        if isinstance(n, int) and n > 0:
            return "oom", "num-ooms"
    if oom_dump:
        return "oom", "oom-dump"
    if exit_code == 0 and any(e.get("stopped") is True for e in exits):
        return "ran", "stop"
    if oom_message:
        return "oom", "oom-message"
    if exit_code != 0:
        return "failed", "exit-code"
    return "ended-early", "no-stop"


@dataclass
class Trial:
    """One real run of the command: ``micro_batch`` (fit) or None; ``outcome`` (:data:`OUTCOMES`) and the
    ``evidence`` for it (:data:`EVIDENCE`, :func:`trial_outcome`); ``seconds`` of wall time; ``exit_code``
    (negative: killed by that signal); ``recorded``: run under recording; ``stopped``: a process ended itself
    after the optimizer steps asked (its exit record says so); ``timed_out``: killed at the trial time limit;
    ``measured_peak_reserved_bytes``: the most reserved on any rank (``memory_stats`` ``reserved_bytes.all.peak``
    in the recorder's sidecars and the exit records; None without them); ``log``: the file holding its output.

    The docstring under each field is its description in the JSON schema (``oomdoctor schema fit``, ``verify``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    micro_batch: int | None
    """the micro-batch of this run (fit), null for verify's runs"""
    outcome: str
    """how the run ended: 'ran' (the stop after the optimizer steps asked fired, exit code 0), 'oom' (PyTorch
    counted an out-of-memory error, the recorder dumped one, or its message is in the output), 'failed' (another
    non-zero exit), 'ended-early' (exit code 0 before the optimizer steps asked)"""
    evidence: str
    """what says so: 'num-ooms' (memory_stats num_ooms above 0), 'oom-dump', 'stop', 'oom-message', 'exit-code',
    'no-stop' (exit code 0 without the stop)"""
    seconds: float
    """wall time of the run (s)"""
    exit_code: int
    """the command's exit code (negative: killed by that signal)"""
    recorded: bool
    """run under recording (snapshots written)"""
    stopped: bool
    """a process ended itself after the optimizer steps asked (its exit record)"""
    timed_out: bool
    """killed at the trial time limit"""
    measured_peak_reserved_bytes: int | None
    """the most reserved on any rank: memory_stats reserved_bytes.all.peak in the recorder's sidecars and the exit
    records (bytes)"""
    log: str
    """the file holding the run's output"""


FIT_ERRORS = ("failed", "ended-early", "max-trials")


@dataclass
class FitOutcome:
    """``oomdoctor fit``'s answer: ``largest_micro_batch`` that ran (None: even ``low`` ran out of memory, or a
    trial failed), ``smallest_oom_micro_batch``; ``guide`` (:data:`GUIDES`) and ``predicted_micro_batch``, the
    replayed answer of the recorded first trial that the search started from; ``snapshot``: a snapshot was
    recorded (False: no GPU, or the job died before CUDA was used; the search is then by trials alone);
    ``trials`` in the order run (the recorded one first); ``seconds``: all of it, analysis included;
    ``analysis_seconds``: the diagnosis and replays of the recorded trial; ``error``: why the search stopped
    short (:data:`FIT_ERRORS`: a trial failed without an OOM, a trial ended before its K-th optimizer step, the
    trial limit), else None.

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
    """why the search stopped short: 'failed' (a trial failed without an OOM message), 'ended-early' (a trial
    exited 0 before the optimizer steps asked) or 'max-trials'"""
    guess_contradicted: bool = False
    """the recorded trial contradicted the replay's answer (it ran above it, or ran out of memory at or below it):
    the search did not use it and was the doubling search's"""

    @property
    def trial_count(self) -> int:
        """trials run"""
        return len(self.trials)


@dataclass
class Verified:
    """One setting's rerun against its claim: ``config`` as given; ``env``: the variable and value the rerun
    had; ``predicted_*`` from the replay of the recorded first run (None: no claim), with ``margin_bytes`` (the
    prediction's own, ``margin_source``) and the ``band_*`` of measured peaks that confirm it (:func:`band`),
    ``predicted_peak_is_lower_bound`` (only the recorded events are committed: :class:`Claim`) and ``reach``; ``measured_*`` and
    ``oom`` from the rerun; ``confirmed`` True / False / None (no claim, or the rerun failed or ended before its
    K-th optimizer step) and ``why`` (:data:`WHY`).

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
    """the prediction's own margin_bytes, as diagnose's JSON carries it (bytes; null: none)"""
    margin_source: str | None
    """'prediction' (the prediction's margin_bytes) or 'none' (the prediction carries no margin: the peak is not
    judged)"""
    band_low_bytes: int | None
    """the lowest measured peak reserved that confirms the claim: predicted peak - margin (bytes; null: no band)"""
    band_high_bytes: int | None
    """the highest measured peak reserved that confirms the claim: predicted peak + margin (bytes; null: no upper
    end, for a lower bound, or no band)"""
    predicted_peak_is_lower_bound: bool
    """replayed only up to the recorded OOM, or the rest of the step replayed with no margin of it measured: the peak
    is at least the prediction (the recorded events')"""
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
        """reruns that failed or ended before their K-th optimizer step (the exit code is 2 when any)"""
        return sum(1 for v in self.settings if v.why in ("failed", "ended-early"))


def verified(setting: Setting, claim: Claim | None, trial: Trial, env: dict[str, str]) -> Verified:
    """Judge ``trial`` (the rerun with ``setting``) against ``claim``."""
    oom = trial.outcome == "oom"
    ok, why = judge(claim, trial.measured_peak_reserved_bytes, oom, trial.outcome in ("failed", "ended-early"))
    if why == "failed" and trial.outcome == "ended-early":
        why = "ended-early"
    low, high = band(claim)
    return Verified(config=setting.text, env=env, predicted_peak_reserved_bytes=None if claim is None
                    else claim.peak_reserved_bytes, predicted_oom=None if claim is None else claim.oom,
                    margin_bytes=None if claim is None else claim.margin_bytes,
                    margin_source=None if claim is None else claim.margin_source,
                    band_low_bytes=low, band_high_bytes=high,
                    predicted_peak_is_lower_bound=bool(claim and claim.lower_bound),
                    reach=None if claim is None else claim.reach, predicted_rank=None if claim is None else claim.rank,
                    measured_peak_reserved_bytes=trial.measured_peak_reserved_bytes, oom=oom, confirmed=ok, why=why,
                    trial=trial)
