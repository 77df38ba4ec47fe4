"""Every command that reads a file, fed hostile and broken inputs (issue 17): at least 1,000 cases per run,
seeded, in about two minutes. Each case runs the CLI in process (``main(argv)``) and must hold the contract:

- nothing executed (a canary file the payloads would create stays absent);
- no traceback: ``main`` returns; exit 0 with a real result, or exit 2 with one line naming the file;
- bounded time per case (:data:`CASE_SECONDS`); the decompression and memory bombs run in a child process
  under an address-space limit (:data:`BOMB_MEMORY_BYTES`).

A failing case is written to ``tests/fuzz/regressions/`` (the message names the file); every file there is
replayed through every command on each run. ``OOMDOCTOR_FUZZ_SCALE=10`` runs ten times as many cases
(``benchmarks``-style long mode).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import io
import json
import os
import pickle
import random
import resource
import subprocess
import sys
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import cases  # noqa: E402

from oomdoctor.cli.main import main  # noqa: E402

# hypothesis warns that the failing example's repr (a mutated snapshot) is large: expected here
pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")

SCALE = int(os.environ.get("OOMDOCTOR_FUZZ_SCALE", "1"))
# OOMDOCTOR_FUZZ_SEED=N draws other cases: hypothesis runs seeded with N instead of derandomized, and the
# truncation points come from N. Unset, every run draws the same cases.
SEED = os.environ.get("OOMDOCTOR_FUZZ_SEED")
CASE_SECONDS = 20.0
BOMB_MEMORY_BYTES = 3 << 30
REGRESSIONS = Path(__file__).parent / "regressions"
BASES = ["tp-allreduce/legacy-rank0.pickle", "allgather/tensor-rank0.pickle"]
COMMANDS = [
    lambda p, o: ["diagnose", p],
    lambda p, o: ["diagnose", p, "--format", "json"],
    lambda p, o: ["simulate", p],
    lambda p, o: ["report", p, "-o", str(o / "r.html")],
    lambda p, o: ["diff", p, p],
    lambda p, o: ["slice", p, "--start", "0", "--end", "20", "-o", str(o / "s.pickle")],
    lambda p, o: ["export", p, "-o", str(o / "e.json")],
]
COUNT = {"cases": 0}


@pytest.fixture(scope="module")
def canary(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("canary") / "EXECUTED"


def save_regression(name: str, data: bytes, suffix: str) -> Path:
    REGRESSIONS.mkdir(exist_ok=True)
    path = REGRESSIONS / f"{hashlib.sha1(data).hexdigest()[:12]}{suffix}"
    path.write_bytes(data)
    return path


def seeded(test):
    """``hypothesis.seed(OOMDOCTOR_FUZZ_SEED)`` when that is set (see :data:`SEED`)."""
    return hypothesis.seed(int(SEED))(test) if SEED else test


LAST: dict[str, tuple] = {}  # the latest failing case of a hypothesis test: hypothesis replays the minimal one last


def saving_minimal(test):
    """For hypothesis tests: save only the failing case hypothesis ends on (its minimal example), not every
    example it tries while shrinking."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        LAST.clear()
        try:
            return test(*args, **kwargs)
        except BaseException:
            if LAST:
                print(f"minimal failing case saved as {save_regression(*LAST['case'])}")
            raise
    return wrapper


def run(argv: list[str], path: Path, data: bytes, canary: Path, suffix: str = ".pickle", save: bool = True) -> int:
    """Run one command on one input and hold the contract (module doc). A failing case is saved as a
    regression (``save``), or kept in :data:`LAST` for :func:`saving_minimal`."""
    COUNT["cases"] += 1
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            rc = main(argv)
    except BaseException:  # noqa: BLE001 - the contract: nothing escapes main()
        saved = keep(path.name, data, suffix, save)
        pytest.fail(f"{argv[0]} raised on {path.name} ({saved}):\n{traceback.format_exc()[-3000:]}")
    elapsed = time.perf_counter() - t0
    problems = []
    if canary.exists():
        problems.append("the canary exists: a payload was executed")
    if rc == 0:
        written = [a for a in argv if a.endswith((".html", ".json", ".pickle")) and a != str(path)]
        if not (out.getvalue().strip() or any(Path(w).exists() and Path(w).stat().st_size for w in written)):
            problems.append("exit 0 without a result")
    elif rc == 2:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        if not lines or not lines[-1].startswith("oomdoctor: error:") or len(lines) > 2:
            problems.append(f"exit 2 without one error line: {err.getvalue()[-500:]!r}")
        elif str(path.parent) not in lines[-1]:  # the file, or its sidecar beside it
            problems.append(f"the error does not name the file: {lines[-1]!r}")
    else:
        problems.append(f"exit {rc}: {err.getvalue()[-500:]!r}")
    if elapsed > CASE_SECONDS:
        problems.append(f"took {elapsed:.1f} s")
    if problems:
        saved = keep(path.name, data, suffix, save)
        pytest.fail(f"{' '.join(argv)}: {'; '.join(problems)} ({saved})")
    return rc


def keep(name: str, data: bytes, suffix: str, save: bool) -> str:
    if save:
        return f"saved as {save_regression(name, data, suffix)}"
    LAST["case"] = (name, data, suffix)
    return "the minimal case is saved when hypothesis is done"


def write(tmp: Path, name: str, data: bytes) -> Path:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:60] or "case"
    p = tmp / (safe if "." in safe[-5:] else safe + ".pickle")
    p.write_bytes(data)
    return p


def test_malicious_pickles_execute_nothing_under_every_command(canary, tmp_path):
    for i, (name, data) in enumerate(cases.malicious(str(canary))):
        variants = [(name, data)] + (cases.compress_all(name, data) if i % 3 == 0 else [])
        for vname, vdata in variants:
            p = write(tmp_path, vname, vdata)
            for k, cmd in enumerate(COMMANDS):
                if (i + k) % 2 and vname != name:
                    continue  # compressed variants: half the commands each
                assert run(cmd(str(p), tmp_path), p, vdata, canary) == 2
    assert not canary.exists()


@pytest.mark.parametrize("base", BASES)
def test_truncated_and_compressed_snapshots(snapshots, canary, tmp_path, base):
    data = (snapshots / base).read_bytes()
    rng = random.Random(int(SEED) if SEED else 17)
    variants = cases.truncations("cut", data, rng, 60 * SCALE)
    for name, comp in cases.compress_all("whole", data):
        variants.append((name, comp))
        variants += cases.truncations(name, comp, rng, 10 * SCALE)
    for i, (name, vdata) in enumerate(variants):
        p = write(tmp_path, name, vdata)
        rc = run(COMMANDS[i % len(COMMANDS)](str(p), tmp_path), p, vdata, canary)
        if name.startswith("whole") and "[:" not in name:
            assert rc == 0  # the intact compressed snapshot is read


def test_bombs_are_refused_in_bounded_memory(tmp_path):
    """Run in a child under RLIMIT_AS: a bomb must end in exit 2, not a MemoryError traceback or a kill."""
    for name, data in cases.bombs():
        p = write(tmp_path, name, data)
        code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (%d, %d)); "
                "from oomdoctor.cli.main import main; sys.exit(main(['diagnose', %r]))") % (
                    BOMB_MEMORY_BYTES, BOMB_MEMORY_BYTES, str(p))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        COUNT["cases"] += 1
        assert proc.returncode == 2, (name, proc.returncode, proc.stderr[-2000:])
        assert proc.stderr.count("\n") == 1 and p.name in proc.stderr, (name, proc.stderr)
        assert time.perf_counter() - t0 < 60, name


# -- structure-aware mutants of real snapshots --------------------------------------------------------------

# sizes, addresses and times at the edges the reader checks: 2**48 (the largest size), 2**63 (signed 64-bit)
EDGE = st.sampled_from([0, 1, -1, 512, 2**20, 2**48 - 1, 2**48, 2**62, 2**63 - 1, 2**63, 2**64 - 2**21, 2**64,
                        -(2**63), -(2**63) - 1])
ODD = st.one_of(st.none(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                st.text(max_size=4), st.binary(max_size=4), st.just([]), st.just({}), st.just([None]),
                st.lists(st.integers(-3, 3), max_size=3), st.just(-1), st.just(2**64), st.just(float("nan")),
                EDGE, st.booleans(), st.sampled_from(["START", "END", "alloc", "oom", "nccl:all_reduce",
                                                      "Optimizer.step#AdamW.step", "ProfilerStep#3"]))
ENTRY_KEYS = ["action", "addr", "size", "stream", "time_us", "frames", "compile_context", "user_metadata",
              "device_free", "pool_id"]
SEGMENT_KEYS = ["address", "total_size", "stream", "segment_type", "segment_pool_id", "is_expandable", "blocks",
                "allocated_size", "requested_size", "device"]
BLOCK_KEYS = ["address", "size", "requested_size", "state", "frames"]
FRAME_KEYS = ["filename", "line", "name"]
ANNOTATION_KEYS = ["device", "stage", "name", "time_us"]
MUTATION = st.tuples(st.sampled_from(["entry", "segment", "block", "frame", "settings", "top", "shuffle", "drop",
                                      "duplicate", "annotation", "annotations", "new_entry", "device_traces"]),
                     st.integers(0, 10**6),
                     st.sampled_from(ENTRY_KEYS + SEGMENT_KEYS + BLOCK_KEYS + FRAME_KEYS + ANNOTATION_KEYS),
                     st.booleans(), ODD)
ACTIONS = ["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "snapshot", "oom", "annotate", "unknown_action"]


def _trace_of(s: dict) -> list:
    traces = s.get("device_traces")
    lists = [t for t in traces if isinstance(t, list)] if isinstance(traces, list) else []
    return max(lists, key=len) if lists else []


def mutate(snap: dict, muts: list) -> dict:
    """Apply ``muts`` to a copy of ``snap``; a mutation whose target an earlier one removed is skipped."""
    s = copy.deepcopy(snap)
    for kind, n, key, delete, value in muts:
        trace = _trace_of(s)
        segments = s.get("segments") if isinstance(s.get("segments"), list) else []
        if kind in ("entry", "frame") and trace and not isinstance(trace[n % len(trace)], dict):
            continue
        if kind in ("segment", "block") and segments and not isinstance(segments[n % len(segments)], dict):
            continue
        if kind == "entry" and trace:
            target = trace[n % len(trace)]
        elif kind in ("segment", "block") and segments:
            seg = segments[n % len(segments)]
            blocks = seg.get("blocks")
            target = seg if kind == "segment" or not isinstance(blocks, list) or not blocks else blocks[n % len(blocks)]
        elif kind == "frame" and trace:
            e = trace[n % len(trace)]
            fl = e.get("frames")
            target = fl[n % len(fl)] if isinstance(fl, list) and fl else e
        elif kind == "settings":
            target = s.get("allocator_settings")
            key = ["max_split_size", "garbage_collection_threshold", "expandable_segments",
                   "roundup_power2_divisions", "PYTORCH_CUDA_ALLOC_CONF"][n % 5]
        elif kind == "top":
            target, key = s, ["segments", "device_traces", "allocator_settings", "external_annotations"][n % 4]
        elif kind == "shuffle" and trace:
            random.Random(n).shuffle(trace)
            continue
        elif kind == "drop" and trace:
            del trace[n % len(trace)]
            continue
        elif kind == "duplicate" and trace:
            trace.insert(n % len(trace), copy.deepcopy(trace[n % len(trace)]))
            continue
        elif kind in ("annotation", "annotations"):
            target, key = _annotation_target(s, kind, n, key, value)
            if target is None:
                continue
        elif kind == "new_entry" and trace:
            _new_entry(trace, n, key, value)
            continue
        elif kind == "device_traces" and isinstance(s.get("device_traces"), list):
            _reshape_device_traces(s["device_traces"], n, value)
            continue
        else:
            continue
        if not isinstance(target, dict):
            continue
        if delete:
            target.pop(key, None)
        else:
            target[key] = value
    return s


def _annotation_target(s: dict, kind: str, n: int, key: str, value) -> tuple[dict | None, str]:
    """An ``external_annotations`` record to mutate (``annotation``: one field of one record), or, for
    ``annotations``, the list itself reshaped: a record added at a recorded time, the list replaced by an odd
    value, or a record replaced by one."""
    anns = s.get("external_annotations")
    if kind == "annotations":
        trace = _trace_of(s)
        t = trace[n % len(trace)].get("time_us", 0) if trace and isinstance(trace[n % len(trace)], dict) else 0
        record = {"device": n % 3, "stage": ["START", "END"][n % 2],
                  "name": ["nccl:all_reduce", "Optimizer.step#AdamW.step", "ProfilerStep#1", "## forward ##"][n % 4],
                  "time_us": t}
        if n % 5 == 0:
            s["external_annotations"] = value
        elif isinstance(anns, list) and anns and n % 5 == 1:
            anns[n % len(anns)] = value
        elif isinstance(anns, list):
            anns.insert(n % (len(anns) + 1), record)
        else:
            s["external_annotations"] = [record]
        return None, key
    if not isinstance(anns, list) or not anns:
        return None, key
    return anns[n % len(anns)], ANNOTATION_KEYS[n % len(ANNOTATION_KEYS)] if key not in ANNOTATION_KEYS else key


def _new_entry(trace: list, n: int, key: str, value) -> None:
    """A trace entry of any action (one this version does not know among them), made from a recorded one
    so its other fields are plausible, with one field (``key`` when it is an entry field) set to ``value``."""
    near = trace[n % len(trace)]
    e = dict(near) if isinstance(near, dict) else {}
    e["action"] = ACTIONS[n % len(ACTIONS)]
    if key in ENTRY_KEYS:
        e[key] = value
    trace.insert((n // 7) % (len(trace) + 1), e)


def _reshape_device_traces(traces: list, n: int, value) -> None:
    """The list of per-device traces reshaped: a device added (empty, a copy of another, or an odd value),
    one dropped, or one replaced by an odd value."""
    choice = n % 5
    if choice == 0:
        traces.append([])
    elif choice == 1 and traces:
        traces.append(copy.deepcopy(traces[n % len(traces)]))
    elif choice == 2:
        traces.append(value)
    elif choice == 3 and traces:
        del traces[n % len(traces)]
    elif traces:
        traces[n % len(traces)] = [value] if not isinstance(value, list) else value


@pytest.fixture(scope="module")
def base_snapshots(snapshots) -> list[dict]:
    return [pickle.loads((snapshots / b).read_bytes()) for b in BASES]


@saving_minimal
@seeded
@settings(max_examples=500 * SCALE, derandomize=SEED is None, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_snapshots_hold_the_contract(base_snapshots, canary, tmp_path_factory, data):
    base = base_snapshots[data.draw(st.integers(0, len(base_snapshots) - 1))]
    muts = data.draw(st.lists(MUTATION, min_size=1, max_size=4))
    blob = pickle.dumps(mutate(base, muts), protocol=4)
    tmp = tmp_path_factory.mktemp("m")
    p = write(tmp, "mutant.pickle", blob)
    cmd = COMMANDS[data.draw(st.sampled_from([0, 1, 2, 5]))]
    run(cmd(str(p), tmp), p, blob, canary, save=False)


SIDECAR_KEYS = ["rank", "world_size", "step_markers", "phase_markers", "memory_cap_bytes", "memory_fraction",
                "gpu_total_memory_bytes", "micro_batch", "tensors", "memory_stats", "torch_version", "oom", "env",
                "recording", "device_free_bytes"]
JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**66), 2**66),
                                 st.floats(allow_nan=False), st.text(max_size=6)),
                       lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=6), kids,
                                                                                         max_size=4)),
                       max_leaves=12)


@saving_minimal
@seeded
@settings(max_examples=150 * SCALE, derandomize=SEED is None, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(meta=st.dictionaries(st.sampled_from(SIDECAR_KEYS), JSONISH, max_size=6), raw=st.booleans())
def test_mutated_sidecars_hold_the_contract(snapshots, canary, tmp_path_factory, meta, raw):
    tmp = tmp_path_factory.mktemp("side")
    data = (snapshots / BASES[0]).read_bytes()
    p = write(tmp, "rank0.pickle", data)
    side = json.dumps(meta) if not raw else json.dumps(meta)[: max(1, len(json.dumps(meta)) // 2)]
    (tmp / "rank0.meta.json").write_text(side)
    run(["diagnose", str(p), "--format", "json"], p, (tmp / "rank0.meta.json").read_bytes(), canary,
        ".meta.json", save=False)  # a sidecar that cannot be read is named; the rest may be dropped


CONFIG_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "vocab_size", "n_embd", "n_layer", "n_head", "tie_word_embeddings", "model_type", "hidden_act"]


@saving_minimal
@seeded
@settings(max_examples=100 * SCALE, derandomize=SEED is None, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(cfg=st.dictionaries(st.sampled_from(CONFIG_KEYS), JSONISH, max_size=8))
def test_mutated_model_configs_hold_the_contract(canary, tmp_path_factory, cfg):
    tmp = tmp_path_factory.mktemp("cfg")
    p = tmp / "config.json"
    text = json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100, **cfg})
    p.write_text(text)
    run(["plan", "estimate", "--model", str(p), "--gpus", "8"], p, text.encode(), canary, ".config.json",
        save=False)


@pytest.fixture(scope="module")
def golden_rows() -> tuple[list[str], list[dict]]:
    import csv
    shared = Path(os.environ.get("OOMDOCTOR_SHARED", Path(__file__).resolve().parents[2].parent / "shared"))
    golden = shared / "megatron_ci" / "golden_memory_train.csv"
    if not golden.exists():
        pytest.skip(f"Megatron-LM's CI goldens not found at {golden} (set OOMDOCTOR_SHARED)")
    with golden.open(newline="") as f:
        r = csv.DictReader(f)
        return list(r.fieldnames), [row for row in r if "/gpt/" in row["test_dir"]][:12]


@saving_minimal
@seeded
@settings(max_examples=150 * SCALE, derandomize=SEED is None, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(cells=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 40),
                                st.one_of(st.just(""), st.text(max_size=5), st.integers(-5, 10**6).map(str),
                                          st.sampled_from(["nan", "inf", "-1", "1e30", "true", "0"]))),
                      min_size=1, max_size=6))
def test_mutated_validation_csvs_hold_the_contract(golden_rows, canary, tmp_path_factory, cells):
    import csv
    fields, rows = golden_rows
    rows = copy.deepcopy(rows)
    for r, c, v in cells:
        rows[r][fields[c % len(fields)]] = v
    tmp = tmp_path_factory.mktemp("csv")
    p = tmp / "goldens.csv"
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    run(["plan", "validate", str(p)], p, p.read_bytes(), canary, ".csv", save=False)


def test_regressions_replay(snapshots, canary, tmp_path):
    """Every saved failing case, through every command that reads its kind of file."""
    files = sorted(REGRESSIONS.glob("*"))
    assert files, "the known regressions are kept in tests/fuzz/regressions"
    for f in files:
        data = f.read_bytes()
        if f.name.endswith(".meta.json"):  # a sidecar, beside a good snapshot
            d = tmp_path / f.name.split(".")[0]
            d.mkdir()
            (d / "rank0.meta.json").write_bytes(data)
            p = d / "rank0.pickle"
            p.write_bytes((snapshots / BASES[0]).read_bytes())
            run(["diagnose", str(p), "--format", "json"], p, data, canary, ".meta.json")
            continue
        p = write(tmp_path, f.name, data)
        if f.suffix == ".csv":
            run(["plan", "validate", str(p)], p, data, canary, ".csv")
        elif f.suffix == ".json" and f.name.endswith(".config.json"):
            run(["plan", "estimate", "--model", str(p), "--gpus", "8"], p, data, canary, ".json")
        else:
            for cmd in COMMANDS:
                run(cmd(str(p), tmp_path), p, data, canary, f.suffix)


def test_zz_at_least_a_thousand_cases_ran():
    """Last in the file (pytest runs tests in file order): the cases above, counted."""
    if COUNT["cases"] == 0:
        pytest.skip("the other fuzz tests did not run in this session")
    assert COUNT["cases"] >= 1000, COUNT["cases"]
    print(f"fuzz cases: {COUNT['cases']} (resource peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss} KiB)")
