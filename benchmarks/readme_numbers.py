"""The numbers README.md quotes, generated from the ``docs/*.json`` each comes from (issue 52).

``python benchmarks/readme_numbers.py`` checks that every claim below is in README.md once, with the numbers its JSON
gives, and prints each that is not (exit 1); ``--write`` rewrites the numbers in README.md (only the numbers: the
words and the line breaks around them stay). ``tests/unit/test_readme_numbers.py`` runs the check.

A claim is a sentence of the README as a template (``{name}`` where a number goes) and a function of ``docs/`` that
gives each number as the README writes it. A template's spaces match any run of spaces and line breaks, so the
README may wrap a claim anywhere. A function that finds its data contradicting the words around the numbers (a
claim says "none" where the JSON has one) raises :class:`Contradiction`, which the check reports.

Numbers of the README that no ``docs/*.json`` holds are not here: the fuzz suite's case count and time (its test
says them), the peak allocated against ``memory_stats()`` on the shared snapshots, the diff example's bytes (the
command prints them), and the corpus numbers whose grouping of runs is written in ``docs/diagnose.md`` only (model
state on the older runs, the held-out halves) or in ``docs/plan.md`` only (the plan's corpus accuracy).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
GIB = 1 << 30


class Contradiction(Exception):
    """The data contradicts the words of a claim (not only its numbers)."""


def _doc(name: str):
    return json.loads((DOCS / name).read_text(encoding="utf-8"))


def _pct(x: float, digits: int = 1) -> str:
    """A fraction as a percentage: ``0.0444`` -> ``4.4``."""
    return f"{100 * x:.{digits}f}"


@dataclass(frozen=True)
class Claim:
    """One sentence of the README with numbers: its ``source`` (the JSON under ``docs/``), its ``template`` and
    ``numbers()`` -> ``{name: text}``."""

    source: str
    template: str
    numbers: Callable[[], dict[str, str]]


def ranks_512() -> dict[str, str]:
    row = next(r for r in _doc("bench_ranks.json")["rows"] if r["ranks"] == 512)
    return {"ranks": f"{row['ranks']}", "gb": f"{row['bytes'] / 1e9:.2f}", "s": f"{row['default_s']:.1f}",
            "cpus": f"{row['cpus']}", "x": f"{row['speedup']:.1f}"}


def html_page() -> dict[str, str]:
    d = _doc("bench_html_report.json")
    return {"events": f"{_doc('bench_cli.json')['events']:,}", "mib": f"{d['page_mib']:.2f}",
            "s": f"{d['ready_ms_median'] / 1000:.2f}"}


def megatron() -> dict[str, str]:
    d = _doc("plan_validation.json")["megatron_ci"]
    tests = d["gpt3_7b_memory_tests"]
    h100 = [t["error"] for name, t in tests.items() if "h100" in name]
    return {"median": _pct(d["median_abs_rel_error"]), "p90": _pct(d["p90_abs_rel_error"], 0),
            "coverage": _pct(d["coverage"]), "h100": _pct(max(h100)), "all": _pct(max(t["error"] for t in tests.values()))}


def plan_gpu() -> dict[str, str]:
    d = _doc("plan_gpu.json")
    return {"reserved": _pct(d["median_abs_reserved_error"]), "largest": _pct(d["max_abs_reserved_error"], 0),
            "allocated": _pct(d["median_abs_allocated_error"])}


def what_if() -> dict[str, str]:
    w = next(x for x in _doc("accuracy_simulate.json")["what_if"]
             if x["recording"] == "fragmentation-oom/default-oom" and x["what_if"] == "expandable_segments:True")
    return {"gib": f"{w['measured_bytes'] / GIB:.2f}", "error": _pct(abs(w["relative_error"]), 2)}


def overhead() -> dict[str, str]:
    t = _doc("bench_trainer_overhead.json")
    plain, decomposed = t["run1_plain_vs_default"], t["run2_decomposition"]
    nostacks = decomposed["overhead_ratio_per_rep"]["oomdoctor-nostacks"]
    return {"lo": _pct(plain["overhead_ratio_median"] - 1), "hi": _pct(decomposed["overhead_ratio_median"]["oomdoctor"] - 1),
            "gpu": _pct(_doc("bench_capture_overhead.json")["overhead_ratio_median"] - 1, 2),
            "bare_lo": _pct(min(nostacks) - 1), "bare_hi": _pct(max(nostacks) - 1)}


def corpus_verdicts() -> dict[str, str]:
    runs = _doc("corpus_accuracy.json")
    right = sum(1 for r in runs if r["verdict"] == r["expected"])
    return {"runs": f"{len(runs)}", "right": f"{right}", "of": f"{len(runs)}"}


REFUTED = [("lightning-fsdp-gpt2-b100", "max_split_size_mb:1024")]
"""The claims that say "completes" where the rerun ran out, as the README names them (run, setting)."""


def claims() -> dict[str, str]:
    """Issue 49's calibration (``benchmarks/claims_vs_reruns.py``): each claim's row, ``covered`` when the rerun
    confirmed its outcome or measured a peak inside its margin, ``hedge`` when it says "at the edge"."""
    rows = _doc("claims_vs_reruns.json")["rows"]
    refuted = [(x["run"], x["setting"]) for x in rows if x["says"] == "completes" and x["rerun"] == "runs out"]
    if refuted != REFUTED:
        raise Contradiction(f"{len(refuted)} claim{'s say' if len(refuted) != 1 else ' says'} 'completes' where the "
                            f"rerun ran out ({', '.join(f'{s} on {r}' for r, s in refuted) or 'none'}); the README "
                            f"names {', '.join(f'{s} on {r}' for r, s in REFUTED)}")
    return {"covered": f"{sum(1 for x in rows if x['covered'])}", "claims": f"{len(rows)}",
            "edge": f"{sum(1 for x in rows if x['hedge'])}", "refuted": f"{len(refuted)}"}


def fits() -> dict[str, str]:
    runs = [r for r in _doc("corpus_accuracy.json") if r.get("measured_largest") is not None]
    answered = [r for r in runs if r["answer_kind"] in ("replayed", "lower bound")]
    if any(r["answer"] > r["measured_largest"] for r in answered):
        raise Contradiction("an answer of what fits is above the largest micro-batch that ran")
    replayed = [r for r in runs if r["answer_kind"] == "replayed"]
    low = [(r["measured_largest"] - r["answer"]) / r["measured_largest"] for r in replayed]
    wrapped = next(r for r in replayed if r["run"].startswith("wrapped-trainer"))
    first = {r["run"]: r for r in runs if r["run"].startswith("first-forward") and r["answer_kind"] == "lower bound"}
    trainer, accelerate = (next(r for n, r in first.items() if k in n) for k in ("trainer", "accelerate"))
    return {"within": f"{sum(1 for x in low if x <= 0.05)}", "replayed": f"{len(replayed)}",
            "wrapped": _pct((wrapped["measured_largest"] - wrapped["answer"]) / wrapped["measured_largest"]),
            "t_bound": f"{trainer['answer']}", "t_ran": f"{trainer['measured_largest']}",
            "a_bound": f"{accelerate['answer']}", "a_ran": f"{accelerate['measured_largest']}"}


def preflight() -> dict[str, str]:
    errors = []
    for r in _doc("preflight_corpus.json"):
        m, got = r["measured"], (r["preflight"].get("result") or {})
        if re.fullmatch(r"trainer-ddp-gpt2-b\d+", r["run"]) and m["exit_code"] == 0 and got:
            errors += [abs(got["peak_allocated_bytes"] / m["max_memory_allocated"] - 1),
                       abs(got["peak_reserved_bytes"] / m["max_memory_reserved"] - 1)]
    return {"error": _pct(max(errors), 2)}


CLAIMS = [
    Claim("bench_ranks.json", "On {ranks} ranks ({gb} GB) the default takes {s} s on {cpus} CPUs, {x}× faster than "
                              "`--jobs 1`", ranks_512),
    Claim("bench_html_report.json", "The {events}-event `large` snapshot gives a {mib} MiB page, interactive in {s} s "
                                    "in headless Chromium", html_page),
    Claim("plan_validation.json", "On Megatron-LM's CI goldens the estimate's median error is {median}% (p90 {p90}%, "
                                  "coverage {coverage}% of GPT rows); the two 7B memory tests are within {h100}% on "
                                  "H100 ({all}% on every GPU)", megatron),
    Claim("plan_gpu.json", "the median error of `max_reserved` is {reserved}% (largest {largest}%, GPipe's last stage) "
                           "and of `max_allocated` {allocated}%", plan_gpu),
    Claim("accuracy_simulate.json", "The real run with `expandable_segments:True` peaked at {gib} GiB over the same "
                                    "allocations ({error}% from the prediction)", what_if),
    Claim("bench_trainer_overhead.json", "+{lo}–{hi}% median step time on a CPU-bound Hugging Face Trainer GPT-2 job on "
                                         "2 H200s, and {gpu}% on a GPU-bound loop. `--stacks none` records every event "
                                         "without stacks for +{bare_lo}–{bare_hi}%", overhead),
    Claim("corpus_accuracy.json", "On the real-job corpus (`docs/corpus/`: {runs} runs recorded on H200s", corpus_verdicts),
    Claim("corpus_accuracy.json", "the verdict is right on {right} of {of}.", corpus_verdicts),
    Claim("claims_vs_reruns.json", "covered by its margin (the rerun confirmed its outcome, or measured a peak inside "
                                   "the margin) on {covered} of {claims} ({edge} at the edge; {refuted} says "
                                   "\"completes\" where the rerun ran out: `max_split_size_mb:1024` on "
                                   "`lightning-fsdp-gpt2-b100`", claims),
    Claim("corpus_accuracy.json", "at most 5% below it on {within} of the {replayed} replayed answers on swept jobs; the "
                                  "wrapped Trainer run is {wrapped}% low, and an OOM inside the first forward pass gets "
                                  "a lower bound, said as one ({t_bound} where {t_ran} ran, {a_bound} where {a_ran} "
                                  "ran)", fits),
    Claim("preflight_corpus.json", "On the corpus's Trainer DDP GPT-2 runs its peaks are within {error}% of the "
                                   "measured ones", preflight),
]

_FIELD = re.compile(r"\{(\w+)\}")
_NUMBER = r"-?[\d][\d,]*(?:\.\d+)?"


def pattern(template: str) -> re.Pattern:
    """The template as a regular expression: each ``{name}`` a number (a named group), each space any whitespace."""
    out, pos = [], 0
    for m in _FIELD.finditer(template):
        out.append(_literal(template[pos:m.start()]))
        out.append(f"(?P<{m.group(1)}>{_NUMBER})")
        pos = m.end()
    out.append(_literal(template[pos:]))
    return re.compile("".join(out))


def _literal(words: str) -> str:
    """Words of a template as a regular expression, each run of spaces any run of whitespace."""
    return r"\s+".join(re.escape(w) for w in re.split(r" +", words))


def check(text: str) -> tuple[list[str], str]:
    """The problems of ``text`` (README.md) against :data:`CLAIMS`, one line each, and the text with every number
    as its JSON gives it."""
    problems = []
    for c in CLAIMS:
        found = list(pattern(c.template).finditer(text))
        if len(found) != 1:
            problems.append(f"{c.source}: {'no' if not found else len(found)} place{'s' if found else ''} in "
                            f"README.md says {c.template!r}")
            continue
        try:
            want = c.numbers()
        except Contradiction as e:
            problems.append(f"{c.source}: {e}, against the README's {c.template!r}")
            continue
        m = found[0]
        for name in sorted(m.re.groupindex, key=lambda n: m.start(n), reverse=True):
            if m.group(name) != want[name]:
                problems.append(f"{c.source}: README.md says {name} = {m.group(name)}, the JSON gives {want[name]} "
                                f"({c.template!r})")
                text = text[:m.start(name)] + want[name] + text[m.end(name):]
    return problems, text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite README.md's numbers from docs/*.json")
    ns = ap.parse_args()
    text = README.read_text(encoding="utf-8")
    problems, fixed = check(text)
    for p in problems:
        print(p)
    if ns.write and fixed != text:
        README.write_text(fixed, encoding="utf-8")
        print("README.md rewritten")
    print(f"{len(CLAIMS)} claims, {len(problems)} problems")
    return 1 if problems and not ns.write else 0


if __name__ == "__main__":
    sys.exit(main())
