"""The `diloco_experiment` trigger form and its mapping onto `training.config.ExperimentConfig`.

Each Param maps one to one onto a config field (see `FIELD_MAP`); `overrides` takes any other
field in dotted form (``{"data.batch_size": 8}``). The JSON-schema checks here refuse obviously bad
input in the UI / REST API (400 with the reason); `config_from_params` then validates the whole
config with pydantic (`ConfigError`, one line) in the first task.

No jax import here (this module is imported at DAG parse time); `training.config` is pydantic only.
The syncer's fields (`syncer_*`) are derived from `training.config.SyncerConfig`: its defaults,
bounds, titles and descriptions.
"""

from __future__ import annotations

import copy
from typing import Any, get_args

from airflow.sdk import Param
from annotated_types import Gt

from training.config import Backend, Codec, ModelConfig, OuterMethod, SyncerConfig, field_docs
from training.names import NAME_PATTERN as _NAME_RE

# the form's enums are the config's types: they cannot drift
NAME_PATTERN = _NAME_RE.pattern
PRESETS = list(get_args(ModelConfig.model_fields["preset"].annotation))
CODECS = list(get_args(Codec))
OUTER_METHODS = ["decoupled", *(m for m in get_args(OuterMethod) if m != "decoupled")]
BACKENDS = list(get_args(Backend))

DEFAULT_ISLANDS = [
    {"name": "island-0", "speed": 1.0, "backend": "local", "hardware": {}},
    {"name": "island-1", "speed": 1.0, "backend": "local", "hardware": {}},
]

ISLAND_SCHEMA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": NAME_PATTERN},
        "speed": {"type": "number", "exclusiveMinimum": 0},
        "backend": {"type": "string", "enum": BACKENDS},
        "hardware": {"type": "object"},
        "shard": {"type": ["integer", "null"], "minimum": 0},
        "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    },
    "additionalProperties": False,
}

# Param name -> dotted config field
FIELD_MAP: dict[str, str] = {
    "experiment_name": "name",
    "store_url": "store_url",
    "model_preset": "model.preset",
    "islands": "islands",
    "H": "inner.H",
    "fragments": "fragments.count",
    "codec": "codec",
    "outer_method": "outer.method",
    "outer_lr": "outer.lr",
    "outer_momentum": "outer.momentum",
    "quorum": "outer.quorum",
    "token_budget": "token_budget",
    "eval_every_versions": "eval_every_versions",
    "heartbeat_s": "heartbeat_s",
    "chaos": "chaos",
}


def _syncer_params() -> dict[str, Param]:
    """One Param per `SyncerConfig` field, named ``syncer_<field>``."""
    out = {}
    for name, info in SyncerConfig.model_fields.items():
        kind = "integer" if info.annotation is int else "number"
        gt = next((m.gt for m in info.metadata if isinstance(m, Gt)), None)
        bounds = {} if gt is None else {"exclusiveMinimum": gt}
        out[f"syncer_{name}"] = Param(
            info.default,
            type=kind,
            title=f"Syncer: {name}",
            description=info.description,
            **bounds,
        )
    return out


FIELD_MAP.update({f"syncer_{name}": f"syncer.{name}" for name in SyncerConfig.model_fields})


def experiment_params() -> dict[str, Param]:
    """The trigger form. Defaults form a valid config, so the DAG also runs on a schedule.

    A Param without a description of its own shows its config field's
    (`training.config.field_docs`)."""
    docs = field_docs()
    params = _form()
    for name, param in params.items():
        if not param.description and docs.get(FIELD_MAP.get(name, "")):
            params[name] = Param(param.value, description=docs[FIELD_MAP[name]], **param.schema)
    return params


def _form() -> dict[str, Param]:
    return {
        "experiment_name": Param(
            "diloco-demo",
            type="string",
            pattern=NAME_PATTERN,
            title="Experiment name",
            description="Lowercase letters, digits, '-'. Same name again = join the experiment.",
        ),
        "store_url": Param(
            "file:///tmp/diloco/store",
            type="string",
            minLength=1,
            title="Store URL",
            description="file:///abs/path or gs://bucket/prefix",
        ),
        "model_preset": Param("tiny", type="string", enum=PRESETS, title="Model preset"),
        "islands": Param(
            copy.deepcopy(DEFAULT_ISLANDS),
            type="array",
            minItems=1,
            items=ISLAND_SCHEMA,
            title="Islands",
            description='[{"name", "speed", "backend": local|tpu_vm|gke, "hardware": {...}}]',
        ),
        "H": Param(30, type="integer", minimum=1, title="H: inner steps per publish"),
        "fragments": Param(1, type="integer", minimum=1, title="Fragments (P)"),
        "codec": Param("int8", type="string", enum=CODECS, title="Pseudo-gradient codec"),
        "outer_method": Param("decoupled", type="string", enum=OUTER_METHODS, title="Outer method"),
        "outer_lr": Param(0.7, type="number", exclusiveMinimum=0, title="Outer learning rate"),
        "outer_momentum": Param(0.9, type="number", minimum=0, exclusiveMaximum=1),
        "quorum": Param(1, type="integer", minimum=1, title="Quorum K"),
        "token_budget": Param(2_000_000, type="integer", minimum=1, title="Token budget"),
        "eval_every_versions": Param(5, type="integer", minimum=1),
        "heartbeat_s": Param(5.0, type="number", exclusiveMinimum=0),
        **_syncer_params(),
        "chaos": Param({}, type="object", title="Chaos settings (training.config.ChaosConfig)"),
        "overrides": Param(
            {},
            type="object",
            title="Other config fields",
            description='Dotted overrides, e.g. {"data.batch_size": 8, "inner.lr": 0.003}',
        ),
    }


def config_dict_from_params(params: dict[str, Any]) -> dict[str, Any]:
    """Build the nested config dict (not yet validated) from the form values."""
    data: dict[str, Any] = {}

    def put(dotted: str, value: Any) -> None:
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {dotted!r} conflicts with another field")
        node[leaf] = value

    for pname, field in FIELD_MAP.items():
        if pname in params and params[pname] is not None:
            put(field, copy.deepcopy(params[pname]))
    for dotted, value in (params.get("overrides") or {}).items():
        put(dotted, copy.deepcopy(value))
    return data


def config_from_params(params: dict[str, Any]):
    """Validated `ExperimentConfig` (raises `training.config.ConfigError`, one line)."""
    from training.config import ConfigError, parse_config

    try:
        data = config_dict_from_params(params)
    except ValueError as err:
        raise ConfigError(f"invalid config: {err}") from None
    return parse_config(data)
