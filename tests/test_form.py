"""The trigger form explains itself and refuses what cannot work (issue 12, items 3 and 4):
titles and descriptions on every field, the library's defaults, the chaos and hardware keys
listed, store URLs and chaos keys checked by the schema; the offered backends (DILOCO_BACKENDS)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from airflow.sdk.definitions.param import ParamValidationError
from diloco_airflow import params as form
from diloco_airflow.backends.base import HARDWARE_KEYS
from diloco_airflow.backends.registry import BACKENDS, enabled_backends

from training.config.experiment import ChaosConfig
from training.config.hardware import gke_tpu_slice

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def params():
    return form.experiment_params()


def test_every_field_has_a_title_and_a_description(params):
    missing = [n for n, p in params.items() if not p.schema.get("title") or not p.description]
    assert missing == []


def test_the_forms_defaults_are_the_librarys_but_for_its_own(params):
    """The form's defaults make the config the library makes by default but for the form's own
    (FORM_DEFAULTS: the name, the store, three islands and the demo's measured settings)."""
    values = {k: p.value for k, p in params.items()} | {"experiment_name": "t"}
    cfg = form.config_from_params(values)
    own = {k: v for k, v in form.FORM_DEFAULTS.items() if v is not None and k in form.FIELD_MAP}
    library = form.config_from_params(
        {"experiment_name": cfg.name, "store_url": cfg.store_url, "islands": values["islands"]}
        | own
    )
    assert cfg == library


def test_the_form_defaults_to_the_demos_measured_setup(params):
    """H 20, S 2, three islands: docs/BENCHMARKS.md "The demo"; P the library's (4 tensor
    fragments, issue 26)."""
    cfg = form.config_from_params(form.run_params(form.form_values(), "r"))
    assert (cfg.inner.H, cfg.fragments.count, cfg.syncer.shards, len(cfg.islands)) == (20, 4, 2, 3)
    assert (cfg.fragments.strategy, cfg.outer.quorum) == ("tensors", "auto")


def test_the_demo_triggers_the_forms_defaults():
    """One source of truth: the demo's conf is the form's but for name, store, budget and the
    islands' backend (local)."""
    from devtools.demo import demo_conf

    conf = demo_conf("d", "file:///tmp/d", budget=123)
    values = form.form_values()
    changed = {k for k in values if conf[k] != values[k]}
    assert changed <= {"experiment_name", "store_url", "token_budget", "islands"}
    assert [i["name"] for i in conf["islands"]] == [i["name"] for i in values["islands"]]


def test_chaos_lists_every_chaos_key(params):
    text = params["chaos"].description
    assert [k for k in ChaosConfig.model_fields if f"{k}:" not in text] == []


def test_islands_list_every_hardware_key_of_the_offered_backends(params):
    text = params["islands"].description
    missing = [f"{b}.{k}" for b in form.BACKENDS for k in HARDWARE_KEYS[b] if f"{k}:" not in text]
    assert missing == []


def test_the_documented_hardware_keys_are_the_ones_the_backends_read():
    """HARDWARE_KEYS cannot drift from the code: every key read from `hw` / `hardware` in the
    backends is listed for its backend, and every listed key is read."""
    read = re.compile(
        r"""(?:hw|hardware)(?:\.get\(|\[)\s*["']([a-z_]+)["']|["']([a-z_]+)["'] in hw"""
    )
    sources = {
        "tpu_vm": ["backends/tpu_vm.py", "backends/tpu_startup.py"],
        "gke": ["backends/gke.py", "backends/k8s_manifests.py"],
    }
    shared = inspect.getsource(gke_tpu_slice)  # the gke slice's shape, read in training/
    for backend, files in sources.items():
        text = "".join((ROOT / "plugins/diloco_airflow" / f).read_text() for f in files)
        keys = {a or b for a, b in read.findall(text)}
        if backend == "gke":  # gke_tpu_slice (training.config.hardware) reads the slice's shape
            keys |= {a or b for a, b in read.findall(shared)}
        assert keys - set(HARDWARE_KEYS[backend]) == set(), backend
        assert set(HARDWARE_KEYS[backend]) - keys == set(), backend


@pytest.mark.parametrize(
    "url", ["s3://nope/x", "file://relative/path", "http://x", "/abs/path", "gs://", ""]
)
def test_the_schema_refuses_a_store_url_that_cannot_work(params, url):
    with pytest.raises(ParamValidationError):
        params["store_url"].resolve(url)


@pytest.mark.parametrize("url", ["file:///tmp/store", "gs://my-bucket", "gs://my-bucket/a/b"])
def test_the_schema_accepts_file_and_gs_urls(params, url):
    assert params["store_url"].resolve(url) == url


def test_the_store_default_says_what_to_change_for_composer(params):
    assert "Composer" in params["store_url"].description
    assert "gs://" in params["store_url"].description


def test_the_schema_refuses_an_unknown_chaos_key_and_a_bad_value(params):
    with pytest.raises(ParamValidationError):
        params["chaos"].resolve({"kill_every": 3})
    with pytest.raises(ParamValidationError):
        params["chaos"].resolve({"kill_mtbi_s": -1})
    assert params["chaos"].resolve({"kill_mtbi_s": 20, "max_kills": 2})["max_kills"] == 2


def test_the_schema_refuses_a_negative_budget(params):
    with pytest.raises(ParamValidationError):
        params["token_budget"].resolve(-5)


def test_enabled_backends_reads_the_setting_in_the_configs_order():
    assert enabled_backends("") == BACKENDS
    assert enabled_backends("gke, local") == ("local", "gke")
    with pytest.raises(ValueError, match="DILOCO_BACKENDS"):
        enabled_backends("local,slurm")


def test_no_number_field_has_a_bound_the_form_would_clamp(params):
    """Airflow's form turns `minimum` / `maximum` into the input's min / max, which rewrite
    what was typed (H 0 became 1 on blur): the form's number fields use exclusive bounds."""
    clamping = [
        n
        for n, p in params.items()
        if p.schema.get("type") in ("integer", "number") and {"minimum", "maximum"} & set(p.schema)
    ]
    assert clamping == []


@pytest.mark.parametrize("field", ["H", "fragments", "quorum", "token_budget"])
def test_the_api_refuses_zero_where_the_config_needs_one(params, field):
    with pytest.raises(ParamValidationError, match="minimum of 0"):
        params[field].resolve(0)


def test_the_quorum_is_a_number_or_auto(params):
    assert params["quorum"].resolve("auto") == "auto"  # the default: the syncer chooses K
    assert params["quorum"].resolve(2) == 2
    with pytest.raises(ParamValidationError, match="does not match"):
        params["quorum"].resolve("two")
    cfg = form.config_from_params(form.run_params({**form.form_values(), "quorum": 2}, "r"))
    assert cfg.outer.quorum == 2


@pytest.mark.parametrize(
    "run_id, name",
    [
        ("scheduled__2026-12-03T20:03:00+00:00", "diloco-scheduled-20261203t200300"),
        ("manual__2026-12-03T20:03:00.5+00:00_AbCd1234", "diloco-manual-20261203t2003005-abcd1234"),
        ("My run!", "diloco-my-run-f55e95fc"),  # sha1("My run!")[:8]
    ],
)
def test_a_run_without_a_name_trains_a_new_experiment_named_after_it(run_id, name):
    assert form.experiment_of({"experiment_name": None}, run_id) == name


def test_a_named_run_trains_that_experiment():
    assert form.experiment_of({"experiment_name": "exp1"}, "scheduled__x") == "exp1"


def test_the_form_leaves_the_name_empty_so_each_run_gets_its_own(params):
    assert params["experiment_name"].value is None
    assert params["experiment_name"].resolve(None) is None
    with pytest.raises(ParamValidationError):
        params["experiment_name"].resolve("Bad Name")


def test_descriptions_name_no_environment_variable_or_code_path(params):
    code = re.compile(r"DILOCO_|\.py\b|diloco_airflow\.|training\.|control/|[A-Z]+_PRESETS")
    assert {
        n: code.findall(p.description) for n, p in params.items() if code.search(p.description)
    } == {}


def test_no_description_says_a_sentence_twice(params):
    """The form's own text replaces the field's (token_budget said "total tokens merged, all
    islands" twice)."""
    twice = {}
    for n, p in params.items():
        parts = [s.strip().lower() for s in re.split(r"[.;]", p.description) if len(s.strip()) > 15]
        if len(parts) != len(set(parts)):
            twice[n] = p.description
    assert twice == {}
    assert params["token_budget"].description.count("all islands") == 1


def test_only_optional_fields_lack_the_required_mark(params):
    """Airflow's form marks a field required unless its type allows null."""
    optional = {n for n, p in params.items() if "null" in (p.schema.get("type") or [])}
    assert optional == {"experiment_name", "chaos", "overrides", "syncer_memory_gib"}


def test_the_retired_eval_every_versions_is_not_in_the_form(params):
    assert not [n for n in params if "versions" in n]


def test_the_preset_points_at_where_its_dimensions_change(params):
    text = params["model_preset"].description
    assert "fields below" not in text and "Other config fields" in text


def test_a_deployment_sets_the_forms_defaults(monkeypatch):
    """DILOCO_FORM_DEFAULTS: what an untouched form, and so a scheduled run, trains."""
    monkeypatch.setenv("DILOCO_FORM_DEFAULTS", '{"token_budget": 1024, "H": 4}')
    values = form.form_values()
    assert (values["token_budget"], values["H"], values["syncer_shards"]) == (1024, 4, 2)


@pytest.mark.parametrize("setting", ['{"tokens": 5}', '{"H": 0}', "[1]"])
def test_a_bad_deployment_default_fails_the_dag_with_the_reason(monkeypatch, setting):
    monkeypatch.setenv("DILOCO_FORM_DEFAULTS", setting)
    with pytest.raises((ValueError, ParamValidationError)):
        form.experiment_params()


def test_every_fields_default_passes_its_own_schema(params):
    # a trigger with an untouched form must start: a boolean config field once became a
    # "number" param whose default True the API refused (HTTP 400 on `make demo`)
    for name, p in params.items():
        assert p.resolve(p.value) == p.value, name


def test_a_boolean_syncer_field_is_a_boolean_and_an_integers_bounds_are_exclusive(params):
    assert params["syncer_full_in_background"].schema["type"] == "boolean"
    assert params["syncer_full_in_background"].value is True
    # full_every: 1 <= k <= 10000 in the config; exclusive 0 and 10001 in the form
    schema = params["syncer_full_every"].schema
    assert (schema["exclusiveMinimum"], schema["exclusiveMaximum"]) == (0, 10_001)


def test_the_preset_says_which_presets_export_to_transformers(params):
    # the default (tiny, gpt family) cannot be exported with --format hf: the form says so
    assert "Only the gemma presets export to Hugging Face transformers" in (
        params["model_preset"].description
    )
