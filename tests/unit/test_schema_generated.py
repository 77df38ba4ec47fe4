"""Issue 37 (item 1): the JSON schema generated from the dataclasses. First, pydantic's raw
``TypeAdapter(...).json_schema`` against the schema :mod:`oomdoctor.render.schema` serves (generated itself, with
what the renderers add or leave out), for every document kind built from dataclasses: the same keys, the same required keys (``dataclasses.asdict`` writes every field), the
same JSON types and nullability, at every depth. What the renderers add to a dataclass's fields (a derived byte count)
or leave free-form is listed in :data:`RENDERED`; any other difference fails. ``fits`` and a rank's ``oom`` are
generated already (:func:`oomdoctor.render.schema.generated`: their descriptions are the docstrings under the fields
of ``Fits`` and ``OomInfo``; ``oomdoctor
schema`` wrote the same bytes before and after, for every command, and docs/json.md did not change); so is every
other object since, the verdict, a finding and a fix last (their words made, their ids dropped)."""

from __future__ import annotations

import pytest

from oomdoctor.detectors.finding import Finding
from oomdoctor.render import schema as S
from oomdoctor.report.diff import FindingChange, RankDiff
from oomdoctor.report.groups import RankGroups
from oomdoctor.report.model import RankSummary
from oomdoctor.report.verdict import Verdict

pydantic = pytest.importorskip("pydantic", reason="pydantic (the test extra) generates the schema from dataclasses")

#: what render/json.py writes beyond a dataclass's fields, or as a free-form map: path -> why
RENDERED = {
    "$.anatomy_at_peak+allocated_bytes": "render/json.py anatomy_dict: requested + rounding waste (a property)",
    "$.before_anatomy+allocated_bytes": "the same, diff",
    "$.after_anatomy+allocated_bytes": "the same, diff",
    "$+peak_reserved_saved_bytes": "render/json.py diff_dict: before - after (a property of RankDiff)",
    "$+peak_allocated_saved_bytes": "the same",
    "$.sites[]+saved_bytes": "render/json.py diff_dict: before - after (a property of SiteDelta)",
    "$.sites[]+delta_bytes": "render/json.py diff_dict: after - before (a property of SiteDelta, for schema 1.3)",
    "$.prediction~free": "a finding's prediction: a dict the schema spells out (report/predict.py Prediction)",
    "$.fixes[].prediction~free": "the same, per fix",
    "$+summary": "render/json.py verdict_dict / finding_dict: a verdict's or a finding's summary in words (render/words/)",
    "$+actions": "the same, its actions in words",
    "$.verdict+summary": "the same, a rank's verdict",
    "$.verdict+actions": "the same",
    "$+assumptions": "render/json.py verdict_dict: what a verdict's estimate of what fits rests on, in words (issue 52)",
    "$.verdict+assumptions": "the same, a rank's verdict",
    "$+title": "render/json.py finding_dict: the finding's title in words (render/words/findings.py, id + variant)",
    "$.fixes[]+text": "the same: the fix's text (render/words/findings.py, by fix id)",
    "$-variant": "the finding's wording, in the JSON as its title and summary (the contract is unchanged)",
    "$.fixes[]-id": "the fix's id, in the JSON as its text (the contract is unchanged)",
    "$.fixes[]-framework": "the framework whose knob a fix names, in the JSON as its text",
    "$.title:string vs array": "diff: a finding's title as data (FindingTitle), rendered in words",
    "$.to_do[].fix:null|string vs null|object": "render/json.py verdict_dict: a finding-fix action's Fix, in the JSON "
                                                "as the fix's id",
    "$.verdict.to_do[].fix:null|string vs null|object": "the same, a rank's verdict",
}

KINDS = {  # document kind: (the hand-written schema of the object, the dataclass asdict writes it from)
    "diagnose.ranks[]": (S.rank_schema, RankSummary),
    "diagnose.findings[]": (S.finding_schema, Finding),
    "diagnose.verdict": (lambda: S.verdict_schema(""), Verdict),
    "diagnose.groups": (lambda: S.diagnose_schema()["properties"]["groups"], RankGroups),
    "diff.ranks[]": (lambda: S.diff_schema()["properties"]["ranks"]["items"], RankDiff),
    "diff.findings[]": (lambda: S.diff_schema()["properties"]["findings"]["items"], FindingChange),
}


def _resolve(x: dict, defs: dict) -> dict:
    while "$ref" in x:
        x = defs[x["$ref"].split("/")[-1]]
    return x


def _types(x: dict, defs: dict) -> set[str]:
    x = _resolve(x, defs)
    if "anyOf" in x:
        return set().union(*(_types(y, defs) for y in x["anyOf"]))
    t = x.get("type")
    if t is None:
        return {"object"} if "properties" in x else set()
    return set(t) if isinstance(t, list) else {t}


def _branch(x: dict, defs: dict, kind: str) -> dict:
    x = _resolve(x, defs)
    return next((_resolve(y, defs) for y in x.get("anyOf", [x]) if kind in _types(y, defs)), x)


def differences(hand: dict, gen: dict, defs: dict, path: str = "$") -> set[str]:
    """Where ``gen`` (pydantic's) and ``hand`` differ: ``path+key`` (a key only hand has), ``path-key`` (only gen),
    ``path!required``, ``path:types``, ``path~free`` (hand spells out what gen leaves free-form)."""
    out = set()
    th, tg = _types(hand, defs), _types(gen, defs)
    if th and tg and th != tg and not (th == {"number"} and tg == {"number", "integer"}):
        out.add(f"{path}:{'|'.join(sorted(th))} vs {'|'.join(sorted(tg))}")
    h, g = _branch(hand, defs, "object"), _branch(gen, defs, "object")
    if "properties" in h:
        if "properties" not in g:
            return out | {f"{path}~free"}
        hk, gk = set(h["properties"]), set(g["properties"])
        out |= {f"{path}+{k}" for k in hk - gk} | {f"{path}-{k}" for k in gk - hk}
        if set(h.get("required", [])) != hk:  # asdict writes every field: all are required
            out |= {f"{path}!{k}" for k in hk - set(h.get("required", [])) if k in gk}
        for k in sorted(hk & gk):
            out |= differences(h["properties"][k], g["properties"][k], defs, f"{path}.{k}")
    h, g = _branch(hand, defs, "array"), _branch(gen, defs, "array")
    if "items" in h and "items" in g:
        out |= differences(h["items"], g["items"], defs, f"{path}[]")
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_generated_shape_is_the_hand_written_one(kind):
    hand, cls = KINDS[kind]
    gen = pydantic.TypeAdapter(cls).json_schema(mode="serialization")
    got = differences(hand(), gen, gen.get("$defs", {}))
    # a verdict is nullable where it sits (a rank's, the job's); the dataclass is not
    got.discard("$:null|object vs object")
    assert got <= set(RENDERED), sorted(got - set(RENDERED))


def test_the_comparison_sees_a_field_the_schema_lacks():
    from dataclasses import make_dataclass

    cls = make_dataclass("X", [("a_bytes", int), ("b", "str | None")])
    gen = pydantic.TypeAdapter(cls).json_schema(mode="serialization")
    hand = S.obj({"a_bytes": S.b("a")}, "x")
    assert differences(hand, gen, {}) == {"$-b"}
    assert differences(S.obj({"a_bytes": S.s("a"), "b": S.null(S.s(""))}, "x"), gen, {}) == {"$.a_bytes:string vs integer"}


def test_every_rendered_exception_is_still_needed():
    seen = set()
    for hand, cls in KINDS.values():
        gen = pydantic.TypeAdapter(cls).json_schema(mode="serialization")
        seen |= differences(hand(), gen, gen.get("$defs", {}))
    assert set(RENDERED) <= seen


def test_fits_schema_is_generated_from_the_dataclass_with_every_unit():
    from dataclasses import fields

    from oomdoctor.report.fits import Fits

    got = S.fits_schema()
    assert list(got["properties"]) == [f.name for f in fields(Fits)] == got["required"]
    assert got["additionalProperties"] is False
    for name, x in got["properties"].items():
        assert x["description"] and "\n" not in x["description"]
        assert ("_bytes" in name) == x["description"].endswith("(bytes)"), name
    assert got["properties"]["room_bytes"]["type"] == ["integer", "null"]
    assert got["properties"]["batch_scale"]["type"] == ["number", "null"]
    assert got["properties"]["margin"]["additionalProperties"]["type"] == "integer"
    assert "unknown-before-window" in got["properties"]["peak_source"]["enum"]


def test_a_field_without_its_docstring_is_refused():
    from dataclasses import make_dataclass

    cls = make_dataclass("Y", [("a_bytes", int)], namespace={"__pydantic_config__": {"use_attribute_docstrings": True}})
    with pytest.raises(KeyError, match="Y.a_bytes has no docstring"):
        S.generated(cls, "y")


def test_the_oom_object_is_generated_from_oominfo():
    from dataclasses import fields

    from oomdoctor.report.model import OomInfo

    oom = S.rank_schema()["properties"]["oom"]
    assert oom["type"] == ["object", "null"] or "anyOf" in oom
    got = oom["anyOf"][0] if "anyOf" in oom else oom
    assert list(got["properties"]) == [f.name for f in fields(OomInfo)] == got["required"]
    assert got["properties"]["cuda_malloc_bytes"] == {
        "type": "integer", "description": "the rounded size the allocator tried to cudaMalloc (bytes)"}


def test_a_derived_property_is_typed_by_its_annotation_and_described_by_its_docstring():
    from oomdoctor.report.diff import SiteDelta

    site = S.generated(SiteDelta, "a site", derived=("saved_bytes", "delta_bytes"))
    assert site["properties"]["saved_bytes"] == {
        "type": "integer",
        "description": "before minus after, as every saving of the diff (negative: the site holds more after) (bytes)"}
    assert site["properties"]["delta_bytes"] == {
        "type": "integer",
        "description": "after minus before, the opposite of saved_bytes (kept for readers of schema 1.3 and before) "
                       "(bytes)"}
    assert site["required"][-2:] == ["saved_bytes", "delta_bytes"] and site["additionalProperties"] is False
    rank = S.diff_schema()["properties"]["ranks"]["items"]
    assert list(rank["properties"])[-2:] == ["peak_reserved_saved_bytes", "peak_allocated_saved_bytes"]
    items = rank["properties"]["sites"]["items"]
    assert items == site | {"description": items["description"]} and items["description"]  # the class's doc
    assert rank["properties"]["before_anatomy"]["type"] == ["object", "null"]
    assert rank["properties"]["before_anatomy"]["properties"]["allocated_bytes"]["type"] == "integer"
    with pytest.raises(AttributeError):
        S.generated(SiteDelta, "x", derived=("no_such_property",))


def _properties(x: dict, path: str = "$"):
    """Every (path, name, property) of a schema, at every depth (nullable branches, array items, map values)."""
    for sub in [x, *x.get("anyOf", []), *x.get("oneOf", [])]:
        for name, p in sub.get("properties", {}).items():
            yield path, name, p
            yield from _properties(p, f"{path}.{name}")
        if isinstance(sub.get("items"), dict):
            yield from _properties(sub["items"], f"{path}[]")
        if isinstance(sub.get("additionalProperties"), dict):
            yield from _properties(sub["additionalProperties"], f"{path}.*")


@pytest.mark.parametrize("command", list(S.COMMANDS))
def test_every_byte_count_and_duration_says_its_unit(command):
    """Moved from tables into docstrings, every description still says its unit: ``*_bytes`` bytes, ``*_s`` seconds
    (``s`` or ``seconds``), ``*_us`` µs."""
    bad = []
    for path, name, p in _properties(S.schema(command)):
        d = p.get("description", "")
        if name.endswith("_bytes") and "bytes" not in d:
            bad.append(f"{path}.{name}: {d}")
        if name.endswith("_s") and "(s)" not in d and "seconds" not in d and "(s" not in d:
            bad.append(f"{path}.{name}: {d}")
        if name.endswith("_us") and "µs" not in d:
            bad.append(f"{path}.{name}: {d}")
    assert bad == []


def test_no_object_is_written_by_hand():
    """Issue 37: every object of every schema comes from a dataclass or TypedDict (counted by the generator), the
    verdict, a finding and a fix included; docs/json.md says the count."""
    md = S.markdown()
    assert not hasattr(S, "HAND_WRITTEN")
    assert {"RankSummary", "SimulationDoc", "EstimateDoc", "SearchDoc", "ValidateDoc", "FitOutcome", "VerifyOutcome",
            "PreflightAnswer", "DiagnoseDoc", "DiffDoc", "Prediction", "MarginParts", "Anatomy", "Breakdown",
            "HolderRef", "Capacity", "Validation", "StackMatches", "RankGroups", "Verdict", "Action", "Finding",
            "Fix", "SiteRef"} <= S.GENERATED
    assert f"The schemas of all {len(S.GENERATED)} kinds of object are generated" in md
    assert "written by hand" not in md.split("Before issue 37")[0]


def test_the_verdict_finding_and_fix_are_what_the_renderer_writes():
    """The three objects last written by hand, generated: the words render/json.py adds (made), the ids it says in
    words instead (dropped), each field described by its docstring."""
    from dataclasses import fields

    from oomdoctor.detectors.finding import Fix
    from oomdoctor.report.verdict import ACTIONS, REASONS, Action

    finding = S.finding_schema()
    assert set(finding["properties"]) == {f.name for f in fields(Finding)} - {"variant"} | {"title", "summary"}
    assert set(finding["required"]) == set(finding["properties"]) and finding["additionalProperties"] is False
    assert finding["properties"]["severity"]["enum"] == list(S.SEVERITIES)
    assert finding["properties"]["per_rank_bytes"]["additionalProperties"]["type"] == "integer"
    assert finding["properties"]["bytes"]["description"].endswith("(bytes)")
    pred = finding["properties"]["prediction"]
    assert pred["type"] == ["object", "null"] and "reach" in pred["properties"]
    assert pred["description"] == "the first fix's prediction"  # the field's docstring on a made schema
    fix = finding["properties"]["fixes"]["items"]
    assert set(fix["properties"]) == {f.name for f in fields(Fix)} - {"id", "framework"} | {"text"}
    assert fix["properties"]["kind"]["enum"] == list(S.FIX_KINDS)
    assert fix["properties"]["what_if"]["type"] == ["object", "null"]
    assert fix["properties"]["prediction"]["description"] == "the simulator's replay of the fix"
    verdict = S.verdict_schema("v")
    assert verdict["type"] == ["object", "null"] and verdict["description"] == "v"
    assert set(verdict["properties"]) == {f.name for f in fields(Verdict)} | {"summary", "actions", "assumptions"}
    assert verdict["properties"]["kind"]["enum"] == list(S.VERDICT_KINDS)
    assert verdict["properties"]["reasons"]["items"]["enum"] == list(REASONS)
    action = verdict["properties"]["to_do"]["items"]
    assert set(action["properties"]) == {f.name for f in fields(Action)}
    assert action["properties"]["id"]["enum"] == list(ACTIONS)
    assert action["properties"]["fix"]["type"] == ["string", "null"] and action["properties"]["fix"]["description"]
    assert S.rank_schema()["properties"]["verdict"]["properties"] == verdict["properties"]


def test_the_generated_verdict_finding_and_fix_list_their_keys_as_the_renderer_writes_them(capsys):
    """``after`` puts the words where render/json.py writes them: the schema's properties (and docs/json.md's rows)
    in the order of the demo diagnosis's keys, a verdict with a finding-fix action, a finding with 4 fixes."""
    import json

    from oomdoctor.cli.main import main

    assert main(["diagnose", "--demo", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    finding = doc["findings"][0]
    assert finding["fixes"] and doc["verdict"]["to_do"]
    sch = S.diagnose_schema()["properties"]
    assert list(sch["verdict"]["properties"]) == list(doc["verdict"]) == sch["verdict"]["required"]
    assert list(sch["verdict"]["properties"]["to_do"]["items"]["properties"]) == list(doc["verdict"]["to_do"][0])
    items = sch["findings"]["items"]
    assert list(items["properties"]) == list(finding) == items["required"]
    assert list(items["properties"]["fixes"]["items"]["properties"]) == list(finding["fixes"][0])


def test_a_dropped_field_must_exist():
    with pytest.raises(KeyError, match="Finding has no field no_such to drop"):
        S.generated(Finding, "x", dropped=("no_such",))


def test_a_typeddict_key_marked_not_required_is_optional_and_a_derived_property_is_required():
    from oomdoctor.report.predict import Prediction

    got = S.of(Prediction, "a prediction")
    assert "spare_bytes" in got["properties"] and "spare_bytes" not in got["required"]
    assert "reach" in got["required"] and got["properties"]["reach"]["enum"] == list(S.nested_options()[Prediction]
                                                                                      ["enums"]["reach"])
    fit = S.schema("fit")
    assert "trial_count" in fit["required"] and fit["properties"]["trial_count"]["type"] == "integer"
    assert S.schema("diagnose")["required"][-1] == "materiality"  # groups and extra are NotRequired
