"""Issue 52, "Words and hints": each item a new user met on a fresh clone, as a test that failed before its fix.

The headline that carries its assumptions is in ``tests/integration/test_headline_assumptions.py`` (it reads a corpus
run); the README's numbers in ``tests/unit/test_readme_numbers.py``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from oomdoctor.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def _run(capsys, monkeypatch, argv: list[str], code: int | None = 0) -> tuple[str, str]:
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("OOMDOCTOR_STRICT_TEMPLATES", raising=False)
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    if code is not None:
        assert rc == code, (argv, err[-500:])
    return out, err


# --- install hints that work ---------------------------------------------------------------------------------

def _texts() -> list[tuple[str, str]]:
    """Every file a user reads that can give an install hint: the sources, the README and the docs."""
    files = [*(ROOT / "src").rglob("*.py"), ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    return [(str(f.relative_to(ROOT)), f.read_text(encoding="utf-8")) for f in files]


def test_no_install_hint_names_the_package_oomdoctor_on_an_index():
    """``pip install 'oomdoctor[preflight]'`` fails: oomdoctor is installed from its repository."""
    bad = [f"{name}: {m.group(0)}" for name, text in _texts()
           for m in re.finditer(r"pip install ['\"]?oomdoctor\[\w+\]", text)]
    assert bad == []


def test_the_install_hints_say_what_works(monkeypatch, capsys):
    import tomllib

    from oomdoctor.errors import EXTRAS, install_hint

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, packages in EXTRAS.items():  # the hint names the extra's own packages
        assert packages.split() == [re.split(r"[<>=!~\[ ]", p)[0] for p in extras[name]]
    from oomdoctor.report.job import DASK_MISSING

    assert install_hint("preflight") == ("pip install torch transformers (from a checkout of oomdoctor: "
                                         "pip install '.[preflight]')")
    assert "pip install distributed" in DASK_MISSING and "'.[dask]'" in DASK_MISSING
    monkeypatch.setitem(sys.modules, "torch", None)  # as where torch is not installed
    assert main(["preflight", "--hf-config", "x.json", "--micro-batch", "1", "--seq-len", "8"]) == 2
    assert install_hint("preflight") in capsys.readouterr().err


# --- run directories and output ------------------------------------------------------------------------------

def test_run_leaves_no_empty_directory_when_nothing_was_recorded(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--", sys.executable, "-c", "print('no cuda here')"]) == 0
    assert list(tmp_path.iterdir()) == []  # no oomdoctor-run-<time>/ left behind
    assert "no snapshot was written" in capsys.readouterr().err
    # --out a new directory: created for the run, removed when it stays empty
    assert main(["run", "--out", "mem", "--", sys.executable, "-c", "pass"]) == 0
    assert not (tmp_path / "mem").exists()
    (tmp_path / "mine").mkdir()  # the user's own directory stays
    assert main(["run", "--out", "mine", "--", sys.executable, "-c", "pass"]) == 0
    assert (tmp_path / "mine").is_dir()


def test_schema_run_prints_the_diagnose_schema_run_writes(capsys, monkeypatch):
    out, _ = _run(capsys, monkeypatch, ["schema", "run"])
    diag, _ = _run(capsys, monkeypatch, ["schema", "diagnose"])
    assert json.loads(out)["properties"] == json.loads(diag)["properties"]


# --- internal words in user text -----------------------------------------------------------------------------

def test_the_demo_says_no_internal_word(capsys, monkeypatch):
    out, _ = _run(capsys, monkeypatch, ["diagnose", "--demo"])
    assert "material finding" not in out
    assert "the rest read from the trace" not in out
    assert "snapshot has 'user_metadata'" not in out and ">= 2.10" not in out
    assert "PyTorch 2.10 or later" in out


def test_a_healthy_report_says_no_material_finding_in_plain_words(snapshots, capsys, monkeypatch):
    out, _ = _run(capsys, monkeypatch, ["diagnose", str(snapshots / "fsdp2-gpt2" / "rank0.pickle")])
    assert "material" not in out
    assert "outputs kept 4 B" not in out
    # the breakdown still adds up: the categories under 1 MiB are summed on one term, named
    line = " ".join(x.strip() for x in out.split("at the peak of allocated memory")[1].split("largest holders")[0]
                    .splitlines())
    assert "12.81 KiB in allocator rounding and outputs kept" in line, line  # 12.80 KiB + 4 B


def test_a_healthy_headline_names_a_high_finding(snapshots, capsys, monkeypatch):
    """A new user read "healthy on ranks 0–1" and missed the HIGH ``pipeline-output-cache`` finding 80 lines down (the
    last stage keeps every micro-batch's outputs): the first line names it. A healthy job without one says nothing
    more."""
    pp = snapshots / "pp-microbatch"
    out, _ = _run(capsys, monkeypatch, ["diagnose", str(pp / "return-outputs-rank0.pickle"),
                                        str(pp / "return-outputs-rank1.pickle")])
    head = " ".join(out.split("┏")[0].split())
    from oomdoctor import __version__

    assert head == f"oomdoctor {__version__}: healthy on ranks 0–1; 1 HIGH finding: pipeline-output-cache; 2 ranks read"
    out, _ = _run(capsys, monkeypatch, ["diagnose", str(snapshots / "fsdp2-gpt2" / "rank0.pickle")])
    assert "finding" not in out.splitlines()[0]


# --- grammar ------------------------------------------------------------------------------------------------

def test_counts_of_one_take_the_singular(capsys, monkeypatch):
    out, _ = _run(capsys, monkeypatch, ["plan", "estimate", "--model", "gpt2", "--framework", "hf", "--loop",
                                        "trainer", "--sharding", "none", "--gpus", "2", "--gpu", "h200", "--seq",
                                        "1024", "--mbs", "8", "--gbs", "16"])
    assert "1 micro-batches" not in out and "1 micro-batch of 8 x 1024 tokens" in out
    from oomdoctor.render.format import count

    assert [count(n, "trial") for n in (0, 1, 2)] == ["0 trials", "1 trial", "2 trials"]
    assert count(1, "micro-batch") == "1 micro-batch" and count(16, "micro-batch") == "16 micro-batches"
    assert count(2, "pass") == "2 passes"


def test_the_fit_summary_counts_one_trial_in_the_singular():
    from oomdoctor.render.loop import fit_text
    from oomdoctor.report.loop import FitOutcome, Trial

    one = Trial(micro_batch=8, outcome="oom", evidence="num-ooms", seconds=3.0, exit_code=1, recorded=True, stopped=False,
                timed_out=False, measured_peak_reserved_bytes=None, log="t.log")
    fit = FitOutcome(command=["train", "{mb}"], steps=2, low=8, high=64, start=8, snapshot=True, guide="none",
                     predicted_micro_batch=None, largest_micro_batch=None, smallest_oom_micro_batch=8, trials=[one],
                     seconds=3.5, analysis_seconds=0.5)
    text = fit_text(fit)
    assert "1 trials" not in text and "1 trial of 2 optimizer steps" in text


# --- slice ----------------------------------------------------------------------------------------------------

def test_slice_says_a_reversed_window_is_reversed(snapshots, tmp_path, capsys, monkeypatch):
    f = str(snapshots / "ddp-clean" / "rank0.pickle")
    _, err = _run(capsys, monkeypatch, ["slice", f, "--by", "step", "--start", "5", "--end", "3", "-o",
                                        str(tmp_path / "s.pickle")], code=2)
    assert "outside" not in err and "reversed" in err and "--start 5" in err and "--end 3" in err


def test_slice_echoes_a_time_as_it_was_given(snapshots, tmp_path, capsys, monkeypatch):
    f = str(snapshots / "ddp-clean" / "rank0.pickle")
    _, err = _run(capsys, monkeypatch, ["slice", f, "--by", "time", "--start", "20s", "-o",
                                        str(tmp_path / "s.pickle")], code=2)
    assert "20000000" not in err and "20 s" in err and "1.6 s" in err  # the trace lasts 1.6 s
    _, err = _run(capsys, monkeypatch, ["slice", f, "--by", "time", "--start", "1s", "--end", "500ms", "-o",
                                        str(tmp_path / "s.pickle")], code=2)
    assert "reversed" in err


# --- first lines that answer ----------------------------------------------------------------------------------

def test_simulate_answers_on_its_first_line_whatever_the_path(snapshots, capsys, monkeypatch):
    f = str(snapshots / "fragmentation-oom" / "default-oom.pickle")  # an absolute path
    out, _ = _run(capsys, monkeypatch, ["simulate", f, "--config", "expandable_segments:True"])
    first = out.splitlines()[0]
    assert first != "oomdoctor simulate:" and "replays exactly" in first
    assert "expandable_segments:True" in out.split("\n\n")[0] and f in out


def test_diff_says_its_units_and_answers_first(snapshots, capsys, monkeypatch):
    out, _ = _run(capsys, monkeypatch, ["diff", str(snapshots / "ddp-imbalance"), str(snapshots / "ddp-clean"),
                                        "-j", "1"])
    first = out.splitlines()[0]
    assert "in bytes" not in out
    assert "peak reserved 7.51 GiB → 5.97 GiB on rank 0" in first


def test_plan_estimate_answers_on_its_first_line(capsys, monkeypatch):
    out, _ = _run(capsys, monkeypatch, ["plan", "estimate", "--model", "llama3-70b", "--gpus", "32", "--seq", "4096",
                                        "--gbs", "32", "--tp", "4", "--pp", "4", "--vpp", "5"])
    assert out.splitlines()[0].startswith("llama3-70b: does NOT fit: worst stage 0 needs 85.3 GiB of 79.6 GiB")


# --- plan search prefers the plan that fits as it is --------------------------------------------------------

def test_plan_search_prefers_a_plan_that_fits_without_expandable_segments_unless_the_gain_is_material():
    import importlib

    S = importlib.import_module("oomdoctor.plan.search")

    args = ["plan", "search", "--model", "llama3-8b", "--gpus", "16", "--seq", "8192", "--gbs", "64", "--sharding",
            "fsdp", "--framework", "torch", "--format", "json"]
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(args) == 0
    cands = json.loads(buf.getvalue())["candidates"]
    first = cands[0]
    assert first["fits"] == "yes" and first["label"] == "TP2 PP2 VPP8 DP4 SP FSDP"
    faster = [c for c in cands if c["relative_throughput"] > first["relative_throughput"] and c["fits"] != "no"]
    assert faster and all(c["fits"] == "with expandable_segments" for c in faster)
    assert all(c["relative_throughput"] < first["relative_throughput"] * (1 + S.PREFER_GAIN) for c in faster)
    top = max(faster, key=lambda c: c["relative_throughput"])  # the trade, said on the plan preferred
    gain = 100 * (top["relative_throughput"] / first["relative_throughput"] - 1)
    assert any(f"ranked above {top['label']}, modelled {gain:.1f}% faster" in w and "expandable_segments" in w
               for w in first["why"]), first["why"]


# --- finding boxes ------------------------------------------------------------------------------------------

def test_every_finding_box_is_headed_by_its_id_and_opens_with_its_title(snapshots, capsys, monkeypatch):
    """The box's heading was the title where it was short (rank-imbalance) and the id where it was long
    (pipeline-output-cache, memory-growth): now always the id, and the title opens the box."""
    from oomdoctor.detectors.registry import DETECTORS

    ids = {d.ID for d in DETECTORS}
    heads = []
    for job in (["ddp-imbalance"], ["pp-microbatch/return-outputs-rank1.pickle"]):
        out, _ = _run(capsys, monkeypatch, ["diagnose", *(str(snapshots / j) for j in job), "-j", "1"])
        lines = out.splitlines()
        for i, ln in enumerate(lines):
            m = re.match(r"╭─  (LOW|MEDIUM|HIGH|CRITICAL)  \d+\. (.+?)  ─", ln)
            if m:
                heads.append(m.group(2))
                assert not lines[i + 1].strip("│ ").startswith("["), lines[i + 1]  # the title, then the id line
    assert "rank-imbalance" in heads and "pipeline-output-cache" in heads
    assert set(heads) <= ids, heads


def test_the_readme_table_lists_every_finding():
    from oomdoctor.detectors.registry import DETECTORS

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("## What it finds")[1].split("\n\n")[1]
    ids = set(re.findall(r"^\| `([\w-]+)` \|", table, re.M))
    assert ids == {d.ID for d in DETECTORS}, ids ^ {d.ID for d in DETECTORS}



def test_fit_leaves_only_what_its_output_names(tmp_path, monkeypatch, capsys):
    """A failed search left ``oomdoctor-fit-<time>/`` with an empty ``mb1/``; a command not found, that and an empty
    log."""
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--allow-no-gpu", "--", sys.executable, "-c", "import sys; print('bad flag'); sys.exit(3)", "{mb}"]) == 2
    [made] = list(tmp_path.iterdir())
    assert [p.name for p in made.iterdir()] == ["mb1.log"]  # the failed trial's log, which the output names
    assert str(made / "mb1.log") in capsys.readouterr().out
    for p in made.iterdir():
        p.unlink()
    made.rmdir()
    assert main(["fit", "--allow-no-gpu", "--", str(tmp_path / "no-such-command"), "{mb}"]) == 127
    assert list(tmp_path.iterdir()) == []


# --- the README's quoted outputs are what the commands print --------------------------------------------------

def _flat(text: str) -> str:
    """Text without box borders and line breaks: what a quote of it reads."""
    return " ".join(line.strip("│┃ ").strip() for line in text.splitlines() if line.strip("│┃ ").strip())


def test_the_readmes_quotes_are_what_the_commands_print(snapshots, capsys, monkeypatch):
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    quote = re.search(r'\("(simulated: this recording replayed with expandable_segments:True on rank 0: [^"]+)"\)', readme).group(1)
    out, _ = _run(capsys, monkeypatch, ["diagnose", str(snapshots / "fragmentation-oom" / "default-oom.pickle")])
    said = re.sub(r"\s+", " ", _flat(out))
    assert quote in said, quote
    out, _ = _run(capsys, monkeypatch, ["diff", str(snapshots / "tp-allreduce" / "legacy-rank0.pickle"),
                                        str(snapshots / "tp-allreduce" / "modern-rank0.pickle"), "--format", "json"])
    d = json.loads(out)
    [f] = d["findings"]
    claim = (f"`{f['id']}` {f['status']}, {f['peak_reserved_saved_bytes']:,} bytes (1.62 GiB) of peak reserved saved")
    assert claim in readme, claim


def test_findings_on_the_same_tensors_are_linked(snapshots, capsys, monkeypatch):
    """A new user saw the ddp-imbalance bug as three unlinked findings (rank-imbalance, memory-growth,
    output-accumulation, all at one allocation site): each names the others, in JSON (``related``) and in the text;
    a finding alone at its sites names none."""
    out, _ = _run(capsys, monkeypatch, ["diagnose", str(snapshots / "ddp-imbalance"), "--format", "json"])
    fs = {f["id"]: f for f in json.loads(out)["findings"]}
    assert fs["rank-imbalance"]["related"] == ["memory-growth", "output-accumulation"]
    assert fs["output-accumulation"]["related"] == ["rank-imbalance", "memory-growth"]
    out, _ = _run(capsys, monkeypatch, ["diagnose", str(snapshots / "ddp-imbalance")])
    assert "the same allocation sites as: memory-growth, output-accumulation" in out
    out, _ = _run(capsys, monkeypatch, ["diagnose", "--demo", "--format", "json"])
    assert all(f["related"] == [] for f in json.loads(out)["findings"])
