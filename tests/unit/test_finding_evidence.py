"""The typed evidence of the findings (issue 53, item 3): one dataclass per finding kind, beside its detector
(:class:`oomdoctor.detectors.finding.Evidence`).

- every detector declares its classes (``EVIDENCE``), each names its detector's id and the variants it is the evidence
  of, and every ``(id, variant)`` the words know has exactly one class (:data:`oomdoctor.detectors.registry.EVIDENCE`);
- every field has a description (the docstring under it, its JSON-schema description) that says its unit;
- every field a title or summary template names (``{key}``, ``{key:bytes}``, ...) is a field of the class of that
  finding kind: a typo in a template key fails here, not in front of a user;
- ``as_dict`` is the JSON's mapping: the kind's fields in order, then the materiality rule's; a field declared
  ``absent()`` is left out while None; a report's plain-data round trip (the in-job summary) gives the typed
  evidence back.
"""

from __future__ import annotations

import dataclasses
import json
import string

import pytest

from oomdoctor.detectors import registry
from oomdoctor.detectors.deferred_free import DeferredFreeEvidence
from oomdoctor.detectors.finding import Evidence, Finding
from oomdoctor.detectors.materiality import apply
from oomdoctor.detectors.output_accumulation import OutputAccumulationEvidence
from oomdoctor.detectors.rank_imbalance import ExtraSite, RankImbalanceEvidence
from oomdoctor.render import schema as S
from oomdoctor.render.words import findings as words
from oomdoctor.report.model import Report
from oomdoctor.report.serial import report_from_plain, report_to_plain
from oomdoctor.units import GiB, MiB

CLASSES = list(dict.fromkeys(registry.EVIDENCE.values()))
SPECIAL = {"owner_words": words.DEFERRED_OWNERS, "growth_words": None}
"""Template fields :func:`oomdoctor.render.words.findings.summary_template` replaces with words of their own (checked
below with the class of the template that holds them)."""


def template_fields(template: str) -> set[str]:
    """The evidence fields a template names (``{a}``, ``{a:bytes}``, ``{a[b]}`` -> ``a``)."""
    out = set()
    for _, name, _, _ in string.Formatter().parse(template):
        if name:
            out.add(name.split("[")[0].split(".")[0])
    return out


def unknown_fields(template: str, cls: type) -> set[str]:
    """The fields ``template`` names that ``cls`` lacks (the words' own placeholders aside)."""
    return template_fields(template) - {f.name for f in dataclasses.fields(cls)} - set(SPECIAL)


def test_every_detector_declares_its_evidence_classes():
    for det in registry.DETECTORS:
        assert det.EVIDENCE, det.__name__
        for cls in det.EVIDENCE:
            assert issubclass(cls, Evidence) and cls is not Evidence
            assert cls.FINDING == det.ID and cls.__module__ == det.__name__  # beside its detector
            assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    assert len(CLASSES) == 12
    assert registry.evidence_class("fragmentation", "oom").__name__ == "FragmentationOomEvidence"
    assert registry.evidence_class("no-such-detector", "") is Evidence
    with pytest.raises(KeyError):
        registry.evidence_class("fragmentation", "no-such-variant")


def test_every_finding_kind_with_words_has_one_evidence_class_and_the_other_way_round():
    assert set(registry.EVIDENCE) == set(words.TITLES) == set(words.SUMMARIES)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_field_has_a_description_with_its_unit(cls):
    got = S.generated(cls, "x")  # raises KeyError on a field without its docstring
    assert set(got["properties"]) == {f.name for f in dataclasses.fields(cls)}
    for name, p in got["properties"].items():
        d = p.get("description", "")
        assert d.strip(), f"{cls.__name__}.{name}"
        if name.endswith("_bytes"):
            assert "bytes" in d, f"{cls.__name__}.{name}: {d}"
        if name.endswith("_us"):
            assert "µs" in d, f"{cls.__name__}.{name}: {d}"


@pytest.mark.parametrize("key", sorted(registry.EVIDENCE), ids=lambda k: ":".join(k))
def test_the_words_name_only_fields_of_their_kind(key):
    cls = registry.EVIDENCE[key]
    for template in (words.TITLES[key], words.SUMMARIES[key]):
        assert unknown_fields(template, cls) == set(), key
    if "{owner_words}" in words.SUMMARIES[key]:
        for owner_words in words.DEFERRED_OWNERS.values():
            assert unknown_fields(owner_words, cls) == set(), (key, owner_words)
    if "{growth_words}" in words.SUMMARIES[key]:
        for growth_words in words.KEPT_GROWTH.values():
            assert unknown_fields(growth_words, cls) == set(), (key, growth_words)


def test_a_misspelt_template_key_is_caught():
    assert unknown_fields("{held_at_peek_bytes:bytes} at the peak, {owner_words}", DeferredFreeEvidence) == {
        "held_at_peek_bytes"}
    assert unknown_fields("{held_at_peak_bytes:bytes} at the peak", DeferredFreeEvidence) == set()


def _imbalance(**kw) -> RankImbalanceEvidence:
    return RankImbalanceEvidence(
        rank=1, peak_allocated_bytes=3 * GiB, others_median_peak_allocated_bytes=2 * GiB, excess_bytes=GiB,
        peak_reserved_bytes=4 * GiB, end_allocated_bytes=GiB, others_median_end_allocated_bytes=0, ranks_compared=2,
        per_rank_peak_allocated_bytes={0: 2 * GiB, 1: 3 * GiB},
        extra_at_end=[ExtraSite(site="/w/a.py:1 in f", bytes=GiB, others_bytes=0, blocks=2)], **kw)


def test_as_dict_is_the_jsons_mapping_in_its_order():
    ev = _imbalance()
    d = ev.as_dict()
    assert list(d) == ["rank", "peak_allocated_bytes", "others_median_peak_allocated_bytes", "excess_bytes",
                       "peak_reserved_bytes", "end_allocated_bytes", "others_median_end_allocated_bytes",
                       "ranks_compared", "per_rank_peak_allocated_bytes", "extra_at_end"]  # no top site: absent
    assert d["extra_at_end"] == [{"site": "/w/a.py:1 in f", "bytes": GiB, "others_bytes": 0, "blocks": 2}]
    with_top = _imbalance(top_site_extra_bytes=GiB, top_site_blocks=2, top_site="/w/a.py:1 in f").as_dict()
    assert list(with_top)[-3:] == ["top_site_extra_bytes", "top_site_blocks", "top_site"]
    # the materiality rule's fields come after the kind's own, in the rule's order
    f = Finding("rank-imbalance", "high", [1], 8 * GiB, ev)
    apply([f], {1: 4 * GiB})
    assert list(f.evidence.as_dict())[-1:] == ["claimed_bytes"] and f.evidence.claimed_bytes == 8 * GiB
    assert isinstance(f.evidence, RankImbalanceEvidence) and f.evidence.rank == 1  # still its kind
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.rank = 2  # type: ignore[misc]


def test_evidence_survives_the_reports_plain_round_trip():
    kept = OutputAccumulationEvidence(kept_bytes=384 * MiB, blocks=3, passes=3, allocated_bytes=641 * MiB,
                                      kept_fraction=0.599, at="the peak", phase="forward", sites_per_pass=1,
                                      kept_unit="batch", kept_at=[0, 1, 2], kept_every=1, regrown_passes=4)
    findings = [Finding("rank-imbalance", "high", [1], GiB, _imbalance(), variant="held-at-end"),
                Finding("output-accumulation", "medium", [0], 384 * MiB, kept, variant="regrown"),
                Finding("not-a-detector", "low", [0], 0)]
    apply(findings, {0: 100 * GiB, 1: 100 * GiB})
    report = Report(ranks=[], findings=findings, inputs=[], oomdoctor_version="test")
    back = report_from_plain(json.loads(json.dumps(report_to_plain(report), default=list)))
    assert [f.evidence for f in back.findings] == [f.evidence for f in report.findings]
    assert [type(f.evidence) for f in back.findings] == [type(f.evidence) for f in report.findings]
    assert back.findings[0].evidence.as_dict() == report.findings[0].evidence.as_dict()


# ------------------------------------------------------------------------------------------------ the schema

def test_the_schema_has_one_object_per_kind_generated_from_its_class():
    ev = S.finding_schema()["properties"]["evidence"]
    assert ev["description"].startswith("the numbers behind it, one object per finding kind")
    kinds = {k["title"]: k for k in ev["oneOf"]}
    assert len(kinds) == len(CLASSES) and "deferred-free: final-state" in kinds and "cache-flush" in kinds
    imbalance = kinds["rank-imbalance"]
    own = [f.name for f in dataclasses.fields(RankImbalanceEvidence) if f.name not in
           {g.name for g in dataclasses.fields(Evidence)}]
    assert list(imbalance["properties"])[:len(own)] == own  # the JSON's order: its own fields, then the rule's
    assert list(imbalance["properties"])[len(own):] == [f.name for f in dataclasses.fields(Evidence)]
    assert imbalance["additionalProperties"] is False and "rank" in imbalance["required"]
    for absent in ("top_site", "top_site_extra_bytes", "claimed_bytes", "severity_before_materiality"):
        assert absent not in imbalance["required"]  # left out while None ...
        assert "null" not in str(imbalance["properties"][absent].get("type"))  # ... and never null when there
    assert imbalance["properties"]["extra_at_end"]["items"]["properties"]["others_bytes"]["type"] == "integer"
    assert imbalance["properties"]["per_rank_peak_allocated_bytes"]["additionalProperties"]["type"] == "integer"


def test_real_evidence_matches_exactly_its_own_kind_and_a_misspelt_key_fails(capsys):
    import jsonschema

    from oomdoctor.cli.main import main

    assert main(["diagnose", "--demo", "--format", "json"]) == 0
    (f,) = [f for f in json.loads(capsys.readouterr().out)["findings"] if f["id"] == "deferred-free"]
    ev = S.finding_schema()["properties"]["evidence"]
    matching = [k["title"] for k in ev["oneOf"] if jsonschema.Draft202012Validator(k).is_valid(f["evidence"])]
    assert matching == ["deferred-free: at-peak"]
    assert jsonschema.Draft202012Validator(ev).is_valid(f["evidence"])
    bad = {**f["evidence"], "held_at_peek_bytes": 1}
    assert not jsonschema.Draft202012Validator(ev).is_valid(bad)
    missing = {k: x for k, x in f["evidence"].items() if k != "owner"}
    assert not jsonschema.Draft202012Validator(ev).is_valid(missing)
