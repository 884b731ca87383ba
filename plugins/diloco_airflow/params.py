"""The `diloco_experiment` trigger form and its mapping onto `training.config.experiment.ExperimentConfig`.

Each Param maps one to one onto a config field (see `FIELD_MAP`); `overrides` takes any other
field in dotted form (``{"data.batch_size": 8}``). The JSON-schema checks here refuse obviously bad
input in the UI / REST API (400 with the reason); `config_from_params` then validates the whole
config with pydantic (`ConfigError`, one line) in the first task.

No number field has a ``minimum`` or ``maximum``: Airflow's form makes them the input's
``min``/``max``, which rewrite what the user typed on blur (H 0 became 1). Lower bounds are
``exclusiveMinimum`` (the API refuses with the reason, the input keeps the value), or left to
the config's validation in ``init`` (one line).

No jax import here (this module is imported at DAG parse time); `training.config.experiment` is pydantic only.
The syncer's fields (`syncer_*`) are derived from `training.config.experiment.SyncerConfig`: its defaults,
bounds, titles and descriptions.
"""

from __future__ import annotations

import copy
import hashlib
import re
import typing
from typing import Any, get_args

from airflow.sdk import Param
from annotated_types import Ge, Gt, Le
from pydantic import BaseModel

from diloco_airflow import knobs
from diloco_airflow.backends.base import HARDWARE_KEYS
from diloco_airflow.backends.registry import enabled_backends
from training.config.experiment import (
    ChaosConfig,
    Codec,
    ExperimentConfig,
    ModelConfig,
    OuterMethod,
    SyncerConfig,
    field_docs,
)
from training.config.names import NAME_PATTERN as _NAME_RE

# the form's enums are the config's types: they cannot drift
NAME_PATTERN = _NAME_RE.pattern
PRESETS = list(get_args(ModelConfig.model_fields["preset"].annotation))
CODECS = list(get_args(Codec))
OUTER_METHODS = ["decoupled", *(m for m in get_args(OuterMethod) if m != "decoupled")]
BACKENDS = list(enabled_backends())  # DILOCO_BACKENDS: the backends this DAG offers
STORE_PATTERN = r"^(file:///.+|gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/.*)?)$"
"""The store URLs a run can use: a local directory (this machine only) or a GCS bucket."""

DEFAULT_ISLANDS = [
    {"name": f"island-{i}", "speed": 1.0, "backend": BACKENDS[0], "hardware": {}} for i in range(3)
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
for _name, _prop in ISLAND_SCHEMA["properties"].items():
    _prop["description"] = field_docs().get(f"islands[].{_name}", "")

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
    "inner_lr": "inner.lr",
    "quorum": "outer.quorum",
    "token_budget": "token_budget",
    "heartbeat_s": "heartbeat_s",
    "chaos": "chaos",
}
FORM_DEFAULTS: dict[str, Any] = {
    "experiment_name": None,  # a new experiment per run: `experiment_of`
    "store_url": None,
    "islands": None,
}
"""Params whose default is the form's own, not the config's: the config has no default name;
its store default is a relative path (`DILOCO_DEFAULT_STORE` instead) and its islands default
has no backend choice (the form's: three islands, `DEFAULT_ISLANDS`, on the first backend
offered). Every training setting is the library's default (`diloco init` and the form start
the same experiment; issue 36), which is the configuration the demo measures
(docs/BENCHMARKS.md, "The demo")."""


RUN_PREFIX = "diloco"
"""The experiment of a run without a name is ``diloco-<the run, compacted>`` (`experiment_of`)."""

_RUN_ID = re.compile(
    r"(?P<kind>[a-z_]+)__(?P<date>\d{4}-\d\d-\d\d)T(?P<time>\d\d:\d\d:\d\d)"
    r"(?:\.(?P<frac>\d{1,6}))?(?:\+00:00|Z)?(?:_(?P<rand>[A-Za-z0-9]{1,16}))?"
)


def run_part(run_id: str) -> str:
    """A DAG run id as a name part, one to one for Airflow's own ids:
    ``scheduled__2026-12-03T20:03:00+00:00`` -> ``scheduled-20261203t200300`` (a manual run's
    random tail too: ``manual__...T20:03:00.5+00:00_Ab12`` -> ``manual-...t2003005-ab12``); any other id: its
    letters and digits (at most 40) and 8 hex digits of its SHA-1."""
    m = _RUN_ID.fullmatch(run_id)
    if m and len(m["kind"]) <= 20:
        stamp = (m["date"] + "t" + m["time"]).replace("-", "").replace(":", "")
        rand = f"-{m['rand'].lower()}" if m["rand"] else ""
        return f"{m['kind'].replace('_', '-')}-{stamp}{m['frac'] or ''}{rand}"
    slug = re.sub(r"[^a-z0-9]+", "-", run_id.lower()).strip("-")[:40].strip("-")
    digest = hashlib.sha1(run_id.encode()).hexdigest()[:8]
    return f"{slug}-{digest}" if slug else digest


def experiment_of(params: dict[str, Any], run_id: str) -> str:
    """The experiment DAG run `run_id` trains: the form's name when given (created, or joined
    when it exists), else a new one for this run, ``diloco-<run>`` (`run_part`): a schedule, or a
    trigger with the name left empty, starts a new experiment every run."""
    name = params.get("experiment_name")
    return name if name else f"{RUN_PREFIX}-{run_part(run_id)}"


def run_params(params: dict[str, Any], run_id: str) -> dict[str, Any]:
    """`params` with the run's experiment name filled in (`experiment_of`)."""
    return {**params, "experiment_name": experiment_of(params, run_id)}


def form_values() -> dict[str, Any]:
    """The form's default values, as a trigger with an untouched form sends them."""
    return {name: copy.deepcopy(p.value) for name, p in experiment_params().items()}


def config_default(dotted: str) -> Any:
    """The library's default of config field `dotted` (``inner.H``), JSON-shaped."""
    model: type[BaseModel] = ExperimentConfig
    *parents, leaf = dotted.split(".")
    for name in parents:
        model = model.model_fields[name].annotation
    info = model.model_fields[leaf]
    value = info.get_default(call_default_factory=True)
    return (
        value.model_dump(mode="json", exclude_defaults=True)
        if isinstance(value, BaseModel)
        else value
    )


def _syncer_params() -> dict[str, Param]:
    """One Param per `SyncerConfig` field, named ``syncer_<field>``."""
    out = {}
    for name, info in SyncerConfig.model_fields.items():
        # `X | None` (e.g. memory_gib): X or empty (null: the config's default, None)
        args = [a for a in typing.get_args(info.annotation) if a is not type(None)]
        optional = len(args) == 1 and len(typing.get_args(info.annotation)) == 2
        base = args[0] if optional else info.annotation
        kind = {int: "integer", bool: "boolean"}.get(base, "number")
        # the field's own bounds, exclusive (Airflow's form clamps what is typed to `minimum` /
        # `maximum`); a float's inclusive bound is left to the config's one-line refusal
        bounds = {}
        for meta in info.metadata:
            if isinstance(meta, Gt):
                bounds["exclusiveMinimum"] = meta.gt
            elif isinstance(meta, Ge) and kind == "integer":
                bounds["exclusiveMinimum"] = meta.ge - 1
            elif isinstance(meta, Le) and kind == "integer":
                bounds["exclusiveMaximum"] = meta.le + 1
        out[f"syncer_{name}"] = Param(
            FORM_DEFAULTS.get(f"syncer_{name}", info.default),
            type=[kind, "null"] if optional else kind,
            title="Syncer: " + re.sub(r"_s$", " (s)", name).replace("_", " "),
            description=info.description,
            **bounds,
        )
    return out


FIELD_MAP.update({f"syncer_{name}": f"syncer.{name}" for name in SyncerConfig.model_fields})


def _keys(fields: dict[str, str]) -> str:
    return "; ".join(f"{k}: {v}" for k, v in fields.items())


def chaos_description() -> str:
    """Every `ChaosConfig` key with its meaning (the form's chaos field)."""
    keys = {n: f.description or "" for n, f in ChaosConfig.model_fields.items()}
    return f"Fault injection, off when empty. Keys: {_keys(keys)}."


def hardware_description() -> str:
    """The island field's text: its keys and, per backend offered, its ``hardware`` keys."""
    out = [
        'A list of {"name", "speed", "backend", "hardware", "shard", "max_tokens"}: '
        + _keys({k: v["description"] for k, v in ISLAND_SCHEMA["properties"].items()})
        + f". Backends offered here: {', '.join(BACKENDS)}."
    ]
    for backend in BACKENDS:
        keys = HARDWARE_KEYS.get(backend) or {}
        out.append(f"hardware for {backend}: " + (_keys(keys) if keys else "{} (none)") + ".")
    return " ".join(out)


# the fields most runs leave alone: a collapsed section of the form, so that the form is short
# and the reason of a refused value (shown by Airflow at the top of the form) is in view
MORE_SECTION = "More settings"
MORE_FIELDS = {
    "codec",
    "outer_method",
    "outer_momentum",
    "quorum",
    "heartbeat_s",
    "chaos",
    "overrides",
}


def experiment_params() -> dict[str, Param]:
    """The trigger form. Defaults form a valid config, so the DAG also runs on a schedule.

    Every Param mapped onto a config field has that field's default (`_field`; except
    `FORM_DEFAULTS`) and its description, unless the form has its own text for it. A
    deployment's `DILOCO_FORM_DEFAULTS` (`knobs.FORM_DEFAULTS`) replaces defaults last: what
    an untouched form and every scheduled run train."""
    docs = field_docs()
    params = _form()
    deployment = knobs.FORM_DEFAULTS.get()
    unknown = sorted(set(deployment) - set(params))
    if unknown:
        raise ValueError(f"{knobs.FORM_DEFAULTS.name}: unknown form fields {unknown}")
    for name, param in params.items():
        # the form's own text replaces the field's (never both: no sentence twice)
        description = param.description or docs.get(FIELD_MAP.get(name, ""), "")
        value = copy.deepcopy(deployment[name]) if name in deployment else param.value
        section = (
            {"section": MORE_SECTION} if name in MORE_FIELDS or name.startswith("syncer_") else {}
        )
        params[name] = Param(value, description=description, **section, **param.schema)
        if name in deployment:
            params[name].resolve()  # the schema checks a deployment's default too
    return params


def _field(name: str, **schema: Any) -> Param:
    """The Param `name` with the form's default (`FORM_DEFAULTS`), else its config field's
    (`config_default`)."""
    default = FORM_DEFAULTS[name] if name in FORM_DEFAULTS else config_default(FIELD_MAP[name])
    return Param(default, **schema)


def _form() -> dict[str, Param]:
    """The form's layout, titles and checks; defaults and descriptions: `experiment_params`."""
    return {
        "experiment_name": Param(
            FORM_DEFAULTS["experiment_name"],
            type=["null", "string"],
            pattern=NAME_PATTERN,
            title="Experiment name",
            description="Empty: a new experiment for this run, named diloco-<run> (every "
            "scheduled run starts its own). A name (lowercase letters, digits, '-'): that "
            "experiment, created when new; an existing one is continued with the islands "
            "listed here. The run's note says which.",
        ),
        "store_url": Param(
            knobs.DEFAULT_STORE.get(),
            type="string",
            pattern=STORE_PATTERN,
            title="Store URL",
            description="Where the experiment lives: file:///abs/path (this machine only) or "
            "gs://bucket/prefix. On Cloud Composer, or with islands on TPU VMs or GKE, use a "
            "gs:// bucket that the workers and islands can write to (the default is the "
            "deployment's).",
        ),
        "model_preset": _field(
            "model_preset",
            type="string",
            enum=PRESETS,
            title="Model preset",
            description="The model's size: tiny .. 12b (GPT: learned positions, GELU MLP) or "
            "gemma-tiny .. gemma-12b (rotary positions, GeGLU, grouped-query attention, "
            "QK-norm). Only the gemma presets export to Hugging Face transformers (diloco "
            "export --format hf); every preset exports as safetensors and Orbax. To change "
            'one dimension, add it to "Other config fields", e.g. {"model.n_layers": 4}.',
        ),
        "islands": Param(
            copy.deepcopy(DEFAULT_ISLANDS),
            type="array",
            minItems=1,
            items=ISLAND_SCHEMA,
            title="Islands",
            description=hardware_description(),
        ),
        "H": _field("H", type="integer", exclusiveMinimum=0, title="H: inner steps per publish"),
        "fragments": _field("fragments", type="integer", exclusiveMinimum=0, title="Fragments (P)"),
        "codec": _field("codec", type="string", enum=CODECS, title="Pseudo-gradient codec"),
        "outer_method": _field(
            "outer_method", type="string", enum=OUTER_METHODS, title="Outer method"
        ),
        "inner_lr": _field(
            "inner_lr", type="number", exclusiveMinimum=0, title="Inner learning rate"
        ),
        "outer_lr": _field(
            "outer_lr", type="number", exclusiveMinimum=0, title="Outer learning rate"
        ),
        "outer_momentum": _field(
            "outer_momentum", type="number", exclusiveMaximum=1, title="Outer momentum"
        ),
        # a number K, or "auto" (the config's default: the syncer chooses K); the form's input
        # for a field of two types reads 2 as the number and auto as the text
        "quorum": _field(
            "quorum",
            type=["integer", "string"],
            exclusiveMinimum=0,
            pattern="^auto$",
            title="Quorum K",
        ),
        "token_budget": _field(
            "token_budget",
            type="integer",
            exclusiveMinimum=0,
            title="Token budget (total)",
            description="Tokens merged into the global model, all islands together; the run "
            "ends there. At least one batch per island (data.batch_size x data.seq_len each).",
        ),
        "heartbeat_s": _field(
            "heartbeat_s", type="number", exclusiveMinimum=0, title="Heartbeat (s)"
        ),
        **_syncer_params(),
        "chaos": _field(
            "chaos",
            type=["null", "object"],
            title="Chaos (fault injection)",
            description=chaos_description(),
            properties=_chaos_properties(),
            additionalProperties=False,
        ),
        "overrides": Param(
            {},
            type=["null", "object"],
            title="Other config fields",
            description='Dotted overrides of any other config field, e.g. {"data.batch_size": '
            '8, "inner.lr": 0.003}; `diloco init --help` lists them all.',
        ),
    }


def _chaos_properties() -> dict[str, Any]:
    schema = ChaosConfig.model_json_schema()
    return {k: {**v, "title": k} for k, v in schema["properties"].items()}


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
    """Validated `ExperimentConfig` (raises `training.config.experiment.ConfigError`, one line)."""
    from training.config.experiment import ConfigError, parse_config

    try:
        data = config_dict_from_params(params)
    except ValueError as err:
        raise ConfigError(f"invalid config: {err}") from None
    return parse_config(data)
