"""One typed, validated experiment config.

Every process (island, merge, eval, the Airflow DAG's Params form) builds an `ExperimentConfig`
from the same fields; `diloco init` writes it as `config.json` next to the run. Its sections
(model, data, inner, outer, fragments, syncer, checkpoint, islands, chaos) live in
training/config/sections.py and are re-exported here: import every config name from this module.
This module holds the whole experiment and the rules that need all of it (overrides, `--set`, the
join, the budget check).
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from training.config.hardware import chips_of_hardware
from training.config.names import validate_name
from training.config.sections import (  # noqa: F401 (re-exported: import config names from here)
    GEMMA_PRESETS,
    MAX_ROUND_S,
    MERGE_FAULT_POINTS,
    PRESETS,
    Backend,
    ChaosConfig,
    CheckpointConfig,
    Codec,
    ComputeDtype,
    ConfigError,
    DataConfig,
    FragmentConfig,
    InnerConfig,
    IslandConfig,
    ModelConfig,
    OuterConfig,
    OuterMethod,
    SyncerConfig,
    TensorBoardConfig,
    _Frozen,
)


class ExperimentConfig(_Frozen):
    name: str = Field(description="the experiment's name (lowercase letters, digits, '-')")
    store_url: str = Field(
        "file://./runs/store", description="the bucket: file:///abs/path, gs://bucket/prefix"
    )
    seed: int = Field(0, description="seed of initialization and data order")
    model: ModelConfig = Field(ModelConfig(), description="the model")
    data: DataConfig = Field(DataConfig(), description="the training data and its shards")
    inner: InnerConfig = Field(InnerConfig(), description="each island's inner optimizer")
    outer: OuterConfig = Field(OuterConfig(), description="the merge and the outer optimizer")
    fragments: FragmentConfig = Field(FragmentConfig(), description="parameter fragments")
    codec: Codec = Field("int8", description="pseudo-gradient codec on the wire")
    error_feedback: bool = Field(
        True, description="islands carry the codec's rounding error into the next publish"
    )
    islands: tuple[IslandConfig, ...] = Field(
        (IslandConfig(name="island-0"), IslandConfig(name="island-1")),
        description="the islands (joiners are appended by a join)",
    )
    token_budget: int = Field(2_000_000, gt=0, description="total tokens merged, all islands")
    heartbeat_s: float = Field(2.0, gt=0, description="seconds between an island's heartbeats")
    syncer: SyncerConfig = Field(SyncerConfig(), description="the syncer on Airflow")
    checkpoint: CheckpointConfig = Field(
        CheckpointConfig(), description="when islands checkpoint (training/island/checkpoint.py)"
    )
    chaos: ChaosConfig = Field(ChaosConfig(), description="fault injection (off by default)")
    tensorboard: TensorBoardConfig = Field(
        TensorBoardConfig(), description="TensorBoard event files under tb/ (docs/METRICS.md)"
    )

    _name = field_validator("name")(lambda cls, v: validate_name("experiment", v))

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentConfig:
        names = [i.name for i in self.islands]
        if not names:
            raise ValueError("islands: at least one island is required")
        if len(set(names)) != len(names):
            raise ValueError(f"islands: duplicate names {sorted(names)}")
        for field_name in ("stall_island", "slow_island"):
            target = getattr(self.chaos, field_name)
            if target is not None and target not in names:
                raise ValueError(f"chaos.{field_name}: {target!r} is not an island")
        # sizes bounded wherever a config enters (a config file, init's --set, a stored
        # config.json an island or merger reads): ModelConfig.bounded_dims, the one rule
        dims = self.model.bounded_dims()
        if self.data.seq_len > dims["max_seq_len"]:
            raise ValueError(
                f"data.seq_len {self.data.seq_len} exceeds the model's max_seq_len "
                f"{dims['max_seq_len']}"
            )
        if self.fragments.strategy == "strided" and self.fragments.count > dims["n_layers"]:
            raise ValueError(
                f"fragments.count {self.fragments.count} exceeds the model's "
                f"{dims['n_layers']} transformer blocks (strided; 'balanced' or 'tensors' "
                "allow more)"
            )
        for isl in self.islands:
            _check_island_hardware(isl, self.data.batch_size)
        if self.syncer.shards > self.fragments.count:
            # a shard beyond the P fragments would merge nothing: S is at most P (the default
            # S = 2 on one fragment is one shard)
            syncer = self.syncer.model_copy(update={"shards": self.fragments.count})
            object.__setattr__(self, "syncer", syncer)
        return self

    @property
    def num_shards(self) -> int:
        return self.data.num_shards or len(self.islands)

    def island(self, name: str) -> IslandConfig:
        for isl in self.islands:
            if isl.name == name:
                return isl
        raise ConfigError(f"island {name!r} is not in experiment {self.name!r}")

    def shard_of(self, name: str) -> int:
        isl = self.island(name)
        shard = isl.shard if isl.shard is not None else [i.name for i in self.islands].index(name)
        if shard >= self.num_shards:
            raise ConfigError(f"island {name!r}: shard {shard} >= num_shards {self.num_shards}")
        return shard

    def batch_size(self, name: str) -> int:
        """Sequences per inner step of this island (its own, else data.batch_size)."""
        return self.island(name).batch_size or self.data.batch_size

    def tokens_per_step(self, name: str) -> int:
        """Tokens one inner step of this island trains: its batch x data.seq_len."""
        return self.batch_size(name) * self.data.seq_len

    def step_rate(self, name: str) -> float:
        """Inner steps per unit of time: `speed` is throughput (tokens per unit, 1 = one
        data.batch_size batch), so an island with twice the batch at the same speed steps at
        half the rate. Equals `speed` while every island has data.batch_size."""
        return self.island(name).speed * self.data.batch_size / self.batch_size(name)

    def inner_steps(self, name: str) -> int:
        """H for this island: DyLU scales it with the island's step rate,
        `H_m = floor(H * rate_m / max_j rate_j)`, so every island's round takes about the same
        time whatever its hardware and batch (and, with token weighting, an island's vote
        counts what it trained: tokens = H_m x its batch x seq_len). The synchronous baseline
        (`outer.method = "sync"`) ignores DyLU: each of its rounds waits for every island, and
        every island trains H steps in it. The one rule of an island's H, for the island (its
        publish cadence) and the syncer (the round clock's period)."""
        if not self.inner.dylu or self.outer.method == "sync":
            return self.inner.H
        top = max(self.step_rate(i.name) for i in self.islands)
        return max(1, int(self.inner.H * self.step_rate(name) / top))

    def inner_decay_steps(self, name: str | None = None) -> int | None:
        """The steps over which `name`'s cosine schedule decays (None: no decay). An island
        trains about its throughput's share of the budget, `speed_m / sum(speed)`, in steps of
        its own batch; `name=None` is the data-parallel baseline, one step on every island's
        data.batch_size batch together. Assumes the configured islands train the whole run (an
        island that joins late decays over the same steps, from its first)."""
        if self.inner.schedule == "constant":
            return None
        if name is None:
            per_step = len(self.islands) * self.data.batch_size * self.data.seq_len
            return max(1, math.ceil(self.token_budget / per_step))
        share = self.island(name).speed / sum(i.speed for i in self.islands)
        return max(1, math.ceil(self.token_budget * share / self.tokens_per_step(name)))

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True)


def island_devices(isl: IslandConfig) -> int | None:
    """The device count an island's batch must divide over: `devices`, else the chips its
    hardware names (training/config/hardware.py: one JAX device per chip from TPU v4 on; None when it
    names none). At run time the island's mesh spans `devices` devices if set, else every
    device its processes see (training/model/runtime.py)."""
    if isl.devices is not None:
        return isl.devices
    hw = isl.hardware or {}
    if any(hw.get(k) for k in ("chips", "topology", "accelerator_type")):
        return chips_of_hardware(hw)
    return None


def _check_island_hardware(isl: IslandConfig, default_batch: int) -> None:
    """What an island's hardware forces on its settings: its batch splits evenly over its
    devices (one slice of the batch per device, training/model/inner.py)."""
    devices = island_devices(isl)
    batch = isl.batch_size or default_batch
    if devices is not None and batch % devices:
        where = "batch_size" if isl.batch_size else "data.batch_size"
        raise ValueError(
            f"island {isl.name!r}: {where} {batch} does not divide over its {devices} devices "
            f"(set islands[].batch_size to a multiple of {devices})"
        )


RETIRED_FIELDS = ("eval_every_versions",)
"""Top-level fields the config had and no longer has. The config forbids unknown keys, so a
config.json stored before a field was removed would no longer parse: the store drops these keys
when it reads config.json back (`without_retired_fields`); a config given by hand must not
carry them. eval_every_versions: unused since the syncer evaluates on a time cadence
(syncer.eval_every_s)."""


def without_retired_fields(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (a stored config.json's top level) without the `RETIRED_FIELDS` (a new dict)."""
    return {k: v for k, v in data.items() if k not in RETIRED_FIELDS}


def field_docs(model: type[BaseModel] = None, prefix: str = "") -> dict[str, str]:
    """Every config field by dotted name (``outer.lr``; island fields as ``islands[].name``)
    with its description: what the trigger form and `diloco init --help` show."""
    model = ExperimentConfig if model is None else model
    out: dict[str, str] = {}
    for name, info in model.model_fields.items():
        out[prefix + name] = info.description or ""
        sub = info.annotation
        if name == "islands":
            out.update(field_docs(IslandConfig, f"{prefix}islands[]."))
        elif isinstance(sub, type) and issubclass(sub, BaseModel):
            out.update(field_docs(sub, f"{prefix}{name}."))
    return out


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "config"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = f"unknown field{did_you_mean(first['loc'])}"
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{loc}: {msg}{more}"


def did_you_mean(loc: Sequence[Any]) -> str:
    """ " (did you mean 'outer.lr'?)" for an unknown field at `loc` (a pydantic error's
    location, or a dotted name split on dots) that is close to a known one; "" otherwise."""
    dotted = ".".join("[]" if isinstance(p, int) or str(p).isdigit() else str(p) for p in loc)
    dotted = dotted.replace(".[]", "[]")
    known = list(field_docs())
    close = difflib.get_close_matches(dotted, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_config(data: dict[str, Any]) -> ExperimentConfig:
    """Validate a dict; raise ConfigError with one line naming the first problem."""
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"invalid config: {_one_line(err)}") from None
    except ValueError as err:
        raise ConfigError(f"invalid config: {err}") from None


def load_config(path: str | Path, **fields: Any) -> ExperimentConfig:
    """The config in JSON file `path`; `fields` (e.g. `diloco init`'s --name and --store) are
    set over the file's before validating, so the file need not name them."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"config {path} is not valid JSON: {err}") from None
    if fields and isinstance(data, dict):
        data = {**data, **fields}
    return parse_config(data)


def with_overrides(cfg: ExperimentConfig, overrides: dict[str, Any]) -> ExperimentConfig:
    """Apply dotted overrides (`{"outer.lr": 0.5, "islands": [...]}`) and re-validate."""
    data = cfg.model_dump(mode="json")
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            if not isinstance(node.get(key), dict):
                raise ConfigError(
                    f"invalid config: unknown field {dotted!r}{did_you_mean(dotted.split('.'))}"
                )
            node = node[key]
        node[leaf] = value
    return parse_config(data)


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items as dotted overrides (for `with_overrides`): each value is JSON
    when it parses as JSON (``0.5``, ``true``, ``[1, 2]``), else the plain string. Raises
    ConfigError for an item without ``=``."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


# -- joining a running experiment: the one rule (docs/STORE.md, "Joining and leaving") ---------
# 1. every setting but the island list must equal the stored config's (`check_same_settings`);
# 2. the islands are joined by `join_islands` (`training.usecases.create.add_islands` applies it
#    to config.json by compare-and-swap: the store stores, it does not decide).


def check_same_settings(existing: dict[str, Any], new: dict[str, Any]) -> None:
    """Raise ConfigError naming the first field (in sorted order) other than ``islands`` whose
    value differs between two config dicts; a joiner must ask for the same experiment."""
    for key in sorted(set(existing) | set(new)):
        if key == "islands":
            continue
        if existing.get(key) != new.get(key):
            raise ConfigError(
                f"experiment {existing.get('name')!r} exists with a different {key!r}: "
                f"{json.dumps(existing.get(key))[:120]} != {json.dumps(new.get(key))[:120]}"
            )


def join_islands(existing: dict[str, Any], islands: list[dict[str, Any]]) -> dict[str, Any]:
    """The config of a running experiment with `islands` joined (docs/STORE.md, "Joining").

    Only the island list changes: joiners are appended (existing islands keep their position,
    hence their default shard), and `data.num_shards` stays fixed so that no shard moves. A
    joiner therefore needs a free shard: its explicit `shard` (below `data.num_shards`, used by
    no other island), else the lowest free one, written into its entry. An experiment whose
    `data.num_shards` is unset has exactly one shard per island and none to spare: create
    experiments that islands may join with `data.num_shards` above the number of islands.
    An island already in the config must be asked for with the same settings (a `shard` left
    unset matches any); asking again is a no-op. Raises ConfigError (one line).
    """
    cfg = parse_config(existing)
    out = list(existing.get("islands") or [])
    current = {i.name: i for i in cfg.islands}
    used = {cfg.shard_of(i.name) for i in cfg.islands}
    joiners: list[IslandConfig] = []
    for raw in islands:
        try:
            isl = IslandConfig.model_validate(raw)
        except ValidationError as err:
            raise ConfigError(f"invalid island: {_one_line(err)}") from None
        known = current.get(isl.name)
        if known is not None:
            mine, theirs = isl.model_dump(mode="json"), known.model_dump(mode="json")
            if mine["shard"] is None:
                mine["shard"] = theirs["shard"]
            diff = sorted(k for k in mine if mine[k] != theirs[k])
            if diff:
                raise ConfigError(
                    f"island {isl.name!r} is in experiment {cfg.name!r} with another {diff[0]!r}: "
                    f"{json.dumps(theirs[diff[0]])} != {json.dumps(mine[diff[0]])}; "
                    "join under a new island name"
                )
            continue
        if any(j.name == isl.name for j in joiners):
            raise ConfigError(f"island {isl.name!r} is listed twice")
        joiners.append(isl)
    if not joiners:
        return existing
    shards = cfg.data.num_shards
    if shards is None:
        raise ConfigError(
            f"experiment {cfg.name!r} has no free data shard for {[j.name for j in joiners]}: "
            f"data.num_shards is unset, so its {len(cfg.islands)} islands hold every shard "
            "(create experiments that islands may join with data.num_shards > islands)"
        )
    for isl in joiners:
        if isl.shard is not None:
            if isl.shard >= shards:
                raise ConfigError(
                    f"island {isl.name!r}: shard {isl.shard} >= data.num_shards {shards}"
                )
            if isl.shard in used:
                raise ConfigError(f"island {isl.name!r}: shard {isl.shard} is taken")
            shard = isl.shard
        else:
            free = [s for s in range(shards) if s not in used]
            if not free:
                raise ConfigError(
                    f"experiment {cfg.name!r} has no free data shard for {isl.name!r}: "
                    f"all {shards} (data.num_shards) are taken"
                )
            shard = free[0]
        used.add(shard)
        out.append(isl.model_copy(update={"shard": shard}).model_dump(mode="json"))
    joined = {**existing, "islands": out}
    parse_config(joined)  # still a valid config (names unique, ...)
    return joined


def check_budget(cfg: ExperimentConfig) -> None:
    """Raise ConfigError unless the token budget holds at least one batch per island (a
    smaller budget ends the run before any island has published)."""
    batch = cfg.data.batch_size * cfg.data.seq_len
    need = batch * len(cfg.islands)
    if cfg.token_budget < need:
        raise ConfigError(
            f"invalid config: token_budget {cfg.token_budget:,} is less than one batch per "
            f"island ({len(cfg.islands)} x {cfg.data.batch_size} x {cfg.data.seq_len} = "
            f"{need:,} tokens)"
        )
