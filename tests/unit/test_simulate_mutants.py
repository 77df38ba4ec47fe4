"""Tests written against surviving mutants of ``simulate/`` (issue 35 item 3): each asserts a fact of
PyTorch's allocator config (``c10/core/AllocatorConfig.cpp``) that a mutant changed and no test saw."""

import pytest

from oomdoctor.simulate.config import N_INTERVALS, ConfigError, parse_config


def test_divisions_greater_than_alone_fills_from_interval_1():
    # parseRoundUpPower2Divisions: last_index starts at 0, so ">:v" alone fills intervals 1..15 and
    # leaves interval 0 at 0 (kills config.x__parse_divisions__mutmut_29, last_index = 1).
    table = parse_config("roundup_power2_divisions:[>:4]").roundup_power2_divisions
    assert table == (0,) + (4,) * (N_INTERVALS - 1)


def test_backend_native_is_accepted():
    # "native" is a valid backend (kills config.x_parse_config__mutmut_163 and _164).
    assert parse_config("backend:native").backend == "native"
    assert parse_config("backend:cudaMallocAsync").backend == "cudaMallocAsync"


@pytest.mark.parametrize(("text", "message"), [
    # PyTorch's own words, which the tool repeats (the contract: a user greps them).
    ("max_split_size_mb:10", "CachingAllocator option max_split_size_mb too small, must be >= 20"),  # kills x_parse_config__mutmut_27 (">= 20.0")
    ("garbage_collection_threshold:1.5",
     "garbage_collect_threshold is invalid, set it in (0.0, 1.0)"),  # kills x_parse_config__mutmut_83
    ("roundup_power2_divisions:3", "For roundups, the divisions has to be power of 2 "),  # x__parse_divisions__mutmut_23
])
def test_pytorch_messages_exactly(text, message):
    with pytest.raises(ConfigError) as e:
        parse_config(text)
    # the whole line: "allocator config '<text>': <PyTorch's message>"
    assert str(e.value) == f"allocator config {text!r}: {message}"
