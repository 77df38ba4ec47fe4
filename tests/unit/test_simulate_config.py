"""Allocator config parsing, pinned to c10/core/AllocatorConfig.cpp (PyTorch 2.9+) semantics."""

import pytest

from oomdoctor.simulate.config import (
    DEFAULT,
    AllocatorConfig,
    ConfigError,
    config_from_settings,
    parse_config,
)

MiB = 1 << 20


def test_empty_is_default():
    assert parse_config("") == DEFAULT
    assert parse_config("  ") == DEFAULT
    assert DEFAULT.to_string() == ""


def test_common_options():
    c = parse_config("expandable_segments:True, max_split_size_mb:512,garbage_collection_threshold:0.8")
    assert c.expandable_segments is True
    assert c.max_split_size == 512 * MiB
    assert c.garbage_collection_threshold == 0.8
    assert c.to_string() == "expandable_segments:True,max_split_size_mb:512,garbage_collection_threshold:0.8"
    assert parse_config(c.to_string()) == c


def test_divisions_legacy_form_fills_all_intervals():
    assert parse_config("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16


def test_divisions_list_form_worked_example():
    # caching_allocator_spec.md 1.3 (torch_npu test of the same parser, 2.9+ '>' semantics):
    # [8:1,64:4,128:8,256:2,>:16] -> indices 0-3:1, 4-5:0, 6:4, 7:8, 8:2, 9-15:16
    t = parse_config("roundup_power2_divisions:[8:1,64:4,128:8,256:2,>:16]").roundup_power2_divisions
    assert t == (1, 1, 1, 1, 0, 0, 4, 8, 2) + (16,) * 7


def test_divisions_first_key_fills_lower_and_gaps_stay_zero():
    t = parse_config("roundup_power2_divisions:[256:1,1024:4]").roundup_power2_divisions
    assert t[:9] == (1,) * 9 and t[9] == 0 and t[10] == 4 and t[11:] == (0,) * 5


@pytest.mark.parametrize("text, message", [
    ("foo:1", "Unrecognized key 'foo'"),
    ("max_split_size_mb:19", "max_split_size_mb too small, must be >= 20"),
    ("max_non_split_rounding_mb:10", "max_non_split_rounding_mb too small"),
    ("garbage_collection_threshold:1.5", "set it in (0.0, 1.0)"),
    ("garbage_collection_threshold:0", "set it in (0.0, 1.0)"),
    ("roundup_power2_divisions:3", "divisions has to be power of 2"),
    ("roundup_power2_divisions:[3:4]", "intervals have to be power of 2"),
    ("roundup_power2_divisions:[256:3]", "power of 2 or 0"),
    ("expandable_segments:true", "Expected 'True' or 'False'"),
    ("max_split_size_mb", "a value is missing"),
    ("max_split_size_mb:abc", "unsigned integer"),
    ("expandable_segments:True;max_split_size_mb:100", "Expected 'True' or 'False'"),
    ("max_split_size_mb:100 expandable_segments:True", "expected ','"),
    ("per_process_memory_fraction:1.5", "[0.0, 1.0]"),
    ("backend:foo", "native or cudaMallocAsync"),
])
def test_invalid_strings_get_pytorch_messages(text, message):
    with pytest.raises(ConfigError) as e:
        parse_config(text)
    assert message in str(e.value)
    assert repr(text) in str(e.value)  # the message names the string
    assert e.value.exit_code == 2


def test_max_split_size_20_is_the_minimum():
    assert parse_config("max_split_size_mb:20").max_split_size == 20 * MiB


def test_keys_without_effect_are_accepted_and_listed():
    c = parse_config("release_lock_on_cudamalloc:True,pinned_num_register_threads:8,expandable_segments:False")
    assert c == DEFAULT
    assert c.ignored == ("release_lock_on_cudamalloc", "pinned_num_register_threads")


def test_from_snapshot_settings():
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "max_split_size": -1,
                "garbage_collection_threshold": 0.0, "expandable_segments": True,
                "roundup_power2_divisions": {str(1 << i): (4 if i >= 8 else 0) for i in range(16)}}
    c = config_from_settings(settings)
    assert c.expandable_segments and c.max_split_size is None
    assert c.roundup_power2_divisions == (0,) * 8 + (4,) * 8
    assert config_from_settings({"max_split_size": 256 * MiB}).max_split_size == 256 * MiB
    assert config_from_settings(None) == DEFAULT == config_from_settings({})


def test_to_string_round_trips_list_divisions():
    c = AllocatorConfig(roundup_power2_divisions=(1,) * 4 + (0,) * 2 + (4, 8, 2) + (16,) * 7)
    assert parse_config(c.to_string()) == c
