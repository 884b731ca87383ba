"""Config validation: bad input gets one clear line."""

import json

import pytest

from training.config.experiment import (
    ConfigError,
    ExperimentConfig,
    load_config,
    parse_config,
    with_overrides,
)


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({"name": "../etc"}, "path separator"),
        ({"name": "a/b"}, "path separator"),
        ({"name": "Exp"}, "uppercase"),
        ({"name": "ok", "model": {"preset": "huge"}}, "model.preset"),
        ({"name": "ok", "outer": {"lr": -1}}, "outer.lr"),
        ({"name": "ok", "typo": 1}, "typo"),
        ({"name": "ok", "eval_every_versions": 5}, "eval_every_versions"),  # removed: refused
        ({"name": "ok", "islands": []}, "at least one island"),
        ({"name": "ok", "islands": [{"name": "a"}, {"name": "a"}]}, "duplicate"),
        ({"name": "ok", "data": {"seq_len": 4096}}, "max_seq_len"),
        ({"name": "ok", "fragments": {"count": 3, "strategy": "strided"}}, "fragments.count"),
        ({"name": "ok", "islands": [{"name": "x/y"}]}, "island name"),
    ],
)
def test_invalid_configs_fail_with_one_line(data, fragment):
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_round_trip_through_json(tmp_path):
    cfg = ExperimentConfig(name="exp-1")
    path = tmp_path / "c.json"
    path.write_text(cfg.to_json())
    assert load_config(path) == cfg


def test_unreadable_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)


def test_overrides_are_validated():
    cfg = ExperimentConfig(name="exp")
    assert with_overrides(cfg, {"outer.lr": 0.5}).outer.lr == 0.5
    with pytest.raises(ConfigError, match="unknown field"):
        with_overrides(cfg, {"nope.lr": 0.5})
    with pytest.raises(ConfigError, match="outer.momentum"):
        with_overrides(cfg, {"outer.momentum": 2})


def test_dylu_scales_inner_steps_with_speed():
    islands = [{"name": "fast", "speed": 1.0}, {"name": "slow", "speed": 0.25}]
    cfg = parse_config({"name": "e", "islands": islands, "inner": {"H": 40}})
    # H_m = floor(H * v_m / max v): 40 and 10
    assert cfg.inner_steps("fast") == 40 and cfg.inner_steps("slow") == 10
    no_dylu = with_overrides(cfg, {"inner.dylu": False})
    assert no_dylu.inner_steps("slow") == 40


def test_shards_default_to_island_order():
    cfg = parse_config({"name": "e", "islands": [{"name": "a"}, {"name": "b"}]})
    assert (cfg.shard_of("a"), cfg.shard_of("b"), cfg.num_shards) == (0, 1, 2)
    with pytest.raises(ConfigError):
        cfg.island("c")


def test_config_json_is_stable():
    cfg = ExperimentConfig(name="exp")
    assert json.loads(cfg.to_json())["outer"]["lr"] == 0.5


def test_the_form_and_the_library_start_the_same_experiment():
    """One set of defaults (issue 36): every training field the trigger form offers defaults
    to the library's (the form's own defaults are only its name, store and islands)."""
    from diloco_airflow import params

    from training.config.experiment import parse_config

    form = params.experiment_params()
    library = json.loads(ExperimentConfig(name="exp").to_json())
    for param, field in params.FIELD_MAP.items():
        if param in params.FORM_DEFAULTS:
            continue
        value = library
        for part in field.split("."):
            value = value[part]
        if param == "chaos":  # the form's {} is "no overrides": the library's chaos section
            assert parse_config({"name": "x", "chaos": form[param].value}).chaos == (
                ExperimentConfig(name="x").chaos
            )
            continue
        assert form[param].value == value, f"{param} ({field})"
    for name in ("shards", "poll_s", "eval_every_s"):
        assert form[f"syncer_{name}"].value == library["syncer"][name], name


def test_dp_is_refused_as_a_merge_method_with_the_reason():
    from training.config.experiment import ConfigError, parse_config

    with pytest.raises(ConfigError, match="'dp' .* is not a merge method"):
        parse_config({"name": "x", "outer": {"method": "dp"}})


def test_the_codec_lists_are_the_configs_codec_type():
    from typing import get_args

    from training.codecs import host as codecs
    from training.config.experiment import Codec
    from training.store import merge_records

    assert codecs.CODECS == merge_records.CODECS == get_args(Codec)


def test_parse_sets_reads_json_values_else_strings_and_refuses_an_item_without_equals():
    from training.config.experiment import ConfigError, parse_sets

    assert parse_sets(["outer.lr=0.5", "name=exp-1", "islands=[]"]) == {
        "outer.lr": 0.5,
        "name": "exp-1",
        "islands": [],
    }
    with pytest.raises(ConfigError, match="key=value"):
        parse_sets(["outer.lr"])


def test_every_config_field_has_a_description():
    """The descriptions feed the trigger form and `diloco init --help`: write one for a new
    field (training/config/experiment.py, `Field(..., description=...)`)."""
    from training.config.experiment import field_docs

    docs = field_docs()
    assert "outer.lr" in docs and "islands[].backend" in docs and "syncer.shards" in docs
    assert [name for name, doc in docs.items() if not doc.strip()] == []


def test_alpha_with_kept_overlap_is_refused_not_ignored():
    # adoption keeps the overlap steps by default and then never blends: alpha would do nothing
    with pytest.raises(ConfigError, match="inner.keep_overlap = false"):
        parse_config({"name": "e", "islands": [{"name": "a"}], "inner": {"alpha": 0.3}})


def test_fractional_momentum_without_partial_scaling_is_refused_not_ignored():
    # without partial_scaling every merge has share 1: fractional momentum would do nothing
    outer = {"fractional_momentum": True, "partial_scaling": False}
    with pytest.raises(ConfigError, match="outer.partial_scaling"):
        parse_config({"name": "e", "islands": [{"name": "a"}], "outer": outer})
