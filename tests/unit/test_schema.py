"""The JSON Schemas (render/schema.py, ``oomdoctor schema``) against real outputs: every output validates, every
field is described, a field the schema does not know fails, and docs/json.md is the schemas' own rendering."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import jsonschema
import pytest

from oomdoctor._version import SCHEMA_VERSION
from oomdoctor.cli.diagnose import demo_path
from oomdoctor.cli.main import main
from oomdoctor.render.schema import COMMANDS, markdown, schema

ROOT = Path(__file__).resolve().parents[2]
DEMO = demo_path()


def _validator(command: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(schema(command))


def _json_of(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_schema_is_a_valid_2020_12_schema_with_every_field_described(command):
    sch = schema(command)
    jsonschema.Draft202012Validator.check_schema(sch)
    assert sch["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert sch["properties"]["schema_version"]["const"] == SCHEMA_VERSION

    def walk(x, path):
        for name, p in x.get("properties", {}).items():
            assert (p.get("description") or "").strip(), f"{command}: {path}.{name} has no description"
            for sub in [p, *p.get("anyOf", []), *p.get("oneOf", [])]:
                walk(sub, f"{path}.{name}")
                if isinstance(sub.get("items"), dict):
                    walk(sub["items"], f"{path}.{name}[]")
    walk(sch, "")


def test_the_cli_prints_the_schema(capsys):
    assert _json_of(capsys, ["schema", "diagnose"]) == schema("diagnose")
    assert _json_of(capsys, ["schema", "plan", "search"]) == schema("plan search")
    assert main(["schema", "nothing"]) == 2


def test_the_demo_diagnosis_validates_and_an_unknown_field_does_not(capsys):
    doc = _json_of(capsys, ["diagnose", "--demo", "--format", "json"])
    assert doc["schema_version"] == SCHEMA_VERSION
    v = _validator("diagnose")
    assert list(v.iter_errors(doc)) == []
    doc["ranks"][0]["breakdown"]["surprise_bytes"] = 1  # a field added without its description
    assert any("surprise_bytes" in e.message for e in v.iter_errors(doc))
    doc["ranks"][0]["breakdown"].pop("surprise_bytes")
    doc["verdict"]["kind"] = "unwell"  # not a verdict kind
    assert list(v.iter_errors(doc))


def test_diff_simulate_and_plan_outputs_validate(capsys, tmp_path):
    assert not list(_validator("diff").iter_errors(_json_of(capsys, ["diff", DEMO, DEMO, "--format", "json"])))
    assert not list(_validator("simulate").iter_errors(
        _json_of(capsys, ["simulate", DEMO, "--search", "-j", "1", "--format", "json"])))
    est = _json_of(capsys, ["plan", "estimate", "--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4",
                            "--format", "json"])
    assert not list(_validator("plan estimate").iter_errors(est))
    search = _json_of(capsys, ["plan", "search", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-80gb",
                               "--format", "json"])
    assert search["candidates"] and not list(_validator("plan search").iter_errors(search))
    csv = ROOT / "tests" / "data" / "golden_memory_sample.csv"  # rows of Megatron-LM's golden-memory CSV
    val = _json_of(capsys, ["plan", "validate", str(csv), "--format", "json"])
    assert not list(_validator("plan validate").iter_errors(val))


CORPUS_RUNS = ["pipelining-1f1b-b32", "first-forward-trainer-ddp-gpt2-b160", "generate-gqa-b11264",
               "own-optimizer-lion", "deepspeed-z2-gpt2-b120"]


@pytest.mark.parametrize("name", CORPUS_RUNS)
def test_corpus_diagnoses_validate(capsys, tmp_path, name):
    """Runs of every kind (a pipeline stage's OOM with a replayed fix, a first-forward estimate, generate()'s KV
    cache, an optimizer outside torch.optim, DeepSpeed): their predictions, fits and breakdowns validate."""
    with tarfile.open(ROOT / "docs" / "corpus" / f"{name}.tar.xz") as tar:
        tar.extractall(tmp_path, filter="data")
    doc = _json_of(capsys, ["diagnose", str(tmp_path / name), "--format", "json"])
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in _validator("diagnose").iter_errors(doc)]
    assert errors == []


def test_shared_snapshots_validate(capsys, snapshots):
    for p in ["ddp-imbalance", "fsdp2-gpt2", "fragmentation-oom/default-oom.pickle", "allgather/list-rank0.pickle",
              "pp-microbatch/return-outputs-rank1.pickle"]:
        doc = _json_of(capsys, ["diagnose", str(snapshots / p), "--format", "json"])
        assert not list(_validator("diagnose").iter_errors(doc)), p
    d = _json_of(capsys, ["diff", str(snapshots / "ddp-imbalance"), str(snapshots / "ddp-clean"), "--format", "json"])
    assert not list(_validator("diff").iter_errors(d))


def test_docs_json_md_is_the_schemas_rendering():
    assert (ROOT / "docs" / "json.md").read_text() == markdown() + "\n", \
        "regenerate: python -m oomdoctor.render.schema > docs/json.md"
