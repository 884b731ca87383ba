"""One typed, validated experiment config.

Every process (island, merge, eval, the Airflow DAG's Params form) builds an `ExperimentConfig`
from the same fields; `diloco init` writes it as `config.json` next to the run. Models are frozen
and reject unknown keys, so a typo in a config file or a DAG trigger is an error, not a default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from training.names import validate_name

OuterMethod = Literal["dp", "sync", "nesterov", "delayed_nesterov", "decoupled"]
Codec = Literal["fp32", "bf16", "int8", "int4", "int2"]
Backend = Literal["local", "tpu_vm", "gke"]


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line naming the problem."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# (d_model, n_layers, n_heads, d_ff, vocab_size, max_seq_len)
PRESETS: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (128, 2, 4, 512, 256, 64),
    "small": (384, 8, 6, 1536, 256, 256),
    "125m": (768, 12, 12, 3072, 50304, 1024),
    "1b": (2048, 18, 16, 8192, 50304, 2048),
    "12b": (5120, 38, 40, 20480, 50304, 4096),
}


class ModelConfig(_Frozen):
    """A decoder-only transformer; `preset` sets every size, explicit fields override it."""

    preset: Literal["tiny", "small", "125m", "1b", "12b"] = "tiny"
    d_model: int | None = Field(None, gt=0)
    n_layers: int | None = Field(None, gt=0)
    n_heads: int | None = Field(None, gt=0)
    d_ff: int | None = Field(None, gt=0)
    vocab_size: int | None = Field(None, gt=1)
    max_seq_len: int | None = Field(None, gt=0)

    def dims(self) -> dict[str, int]:
        d, n_layers, heads, ff, vocab, seq = PRESETS[self.preset]
        out = dict(
            d_model=self.d_model or d,
            n_layers=self.n_layers or n_layers,
            n_heads=self.n_heads or heads,
            d_ff=self.d_ff or ff,
            vocab_size=self.vocab_size or vocab,
            max_seq_len=self.max_seq_len or seq,
        )
        if out["d_model"] % out["n_heads"]:
            raise ConfigError(
                f"model: d_model {out['d_model']} is not divisible by n_heads {out['n_heads']}"
            )
        return out

    def param_count(self) -> int:
        """Exact parameter count of `training.model.Transformer` for these dims (tied head)."""
        m = self.dims()
        d, f = m["d_model"], m["d_ff"]
        per_layer = 4 * d * d + 2 * d * f + 2 * d  # qkv + out, mlp up + down, two RMSNorm scales
        return m["vocab_size"] * d + m["max_seq_len"] * d + m["n_layers"] * per_layer + d


class DataConfig(_Frozen):
    source: str = "builtin:pydoc"
    seq_len: int = Field(64, gt=0)
    batch_size: int = Field(16, gt=0)
    eval_fraction: float = Field(0.05, gt=0, lt=0.5)
    eval_batches: int = Field(8, gt=0)
    num_shards: int | None = Field(None, gt=0, description="default: number of islands")


class InnerConfig(_Frozen):
    """AdamW on each island; H inner steps between publishes of a fragment."""

    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    b1: float = Field(0.9, gt=0, lt=1)
    b2: float = Field(0.95, gt=0, lt=1)
    grad_clip: float = Field(1.0, gt=0)
    H: int = Field(32, gt=0)
    dylu: bool = True
    tau: int = Field(1, ge=0, description="overlap steps between publish and adopting the merge")
    alpha: float = Field(0.0, ge=0, lt=1, description="blend: theta <- a*theta + (1-a)*global")
    shard_params: bool = Field(
        False, description="also split parameters and AdamW moments over the island's devices"
    )
    keep_overlap: bool = Field(
        True, description="on adopting a merge, keep the steps trained since publishing"
    )


class OuterConfig(_Frozen):
    method: OuterMethod = "decoupled"
    lr: float = Field(0.7, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    delay_period: int | None = Field(None, gt=0, description="Delayed Nesterov N; default M")
    quorum: int = Field(1, gt=0, description="K: minimum islands per fragment merge")
    grace_gamma: float = Field(0.5, ge=0, lt=1)
    max_grace_s: float = Field(30.0, ge=0)
    max_staleness: int = Field(16, gt=0, description="drop contributions older than this")
    rda: bool = True
    token_weighting: bool = True
    staleness_decay: bool = Field(True, description="decoupled: weight / (1 + staleness in rounds)")
    partial_scaling: bool = Field(
        True,
        description="decoupled: scale a merge of n of M active islands by n/M, so momentum "
        "sees one full round per M single-island merges (as Delayed Nesterov's g/N)",
    )
    clip_multiplier: float = Field(5.0, gt=1, description="clip norms above k x running median")


class FragmentConfig(_Frozen):
    count: int = Field(1, gt=0)
    strategy: Literal["strided", "balanced", "tensors"] = Field(
        "strided", description="strided layers, balanced layer groups, or balanced single tensors"
    )


class SyncerConfig(_Frozen):
    """The syncer (merger) as it runs on Airflow: `training/syncer.py`, docs/AIRFLOW.md."""

    shards: int = Field(
        1,
        gt=0,
        description="merge shards S: fragment p is merged by shard p % S, each shard a mapped "
        "Airflow task of the experiment's run (at most fragments.count)",
    )
    idle_s: float = Field(
        300.0,
        gt=0,
        description="a shard keeps merging in its task process and goes back to its "
        "deferrable trigger (no process, no executor slot) after this many seconds without a "
        "merge; waking up again costs a task start and about 15 s",
    )
    poll_s: float = Field(
        1.0,
        gt=0,
        description="seconds between looks for new pseudo-gradients, while merging and "
        "while deferred",
    )
    eval_every_s: float = Field(
        30.0,
        gt=0,
        description="evaluate the current global model at most this often while it changes "
        "(a task of its own: never delays a merge); a final eval ends the run",
    )
    lease_s: float = Field(
        60.0,
        gt=0,
        description="a shard's lease in the store (control/syncer/shard-S.json) lasts this long "
        "past its last renewal: a second run joining the experiment starts no second syncer "
        "for the shard while the lease lives",
    )


class CheckpointConfig(_Frozen):
    """When an island writes its checkpoint (training/checkpointing.py, docs/STORE.md).

    A checkpoint is also always written on SIGTERM and when the island finishes. Loss bound: a
    SIGKILLed island resumes from its last committed checkpoint, so it loses at most the steps
    since then. A checkpoint is due after `every_rounds` publish rounds or `every_s` seconds
    (whichever comes first) and is written in the background; a checkpoint that falls due
    while the previous one is still being written waits for it. So the steps lost are at most
    those of two policy intervals (k publish rounds: 2k * H / P steps with P staggered
    fragments; or 2 * every_s seconds plus one step), and, while a write takes less than one
    interval, at most one interval plus the steps during one write.
    """

    every_rounds: int = Field(
        1,
        ge=0,
        description="checkpoint after every k-th publish round (a step that published at "
        "least one fragment); 0: never by rounds",
    )
    every_s: float | None = Field(
        None,
        gt=0,
        description="also checkpoint when this many seconds (island clock) have passed since "
        "the last checkpoint, checked between steps; null: never by time",
    )


class IslandConfig(_Frozen):
    name: str
    speed: float = Field(1.0, gt=0, description="relative speed (DyLU; virtual clock in benches)")
    backend: Backend = "local"
    hardware: dict[str, Any] = Field(default_factory=dict)
    shard: int | None = Field(None, ge=0)
    max_tokens: int | None = Field(None, gt=0)

    _name = field_validator("name")(lambda cls, v: validate_name("island", v))


# training/faults.py points a merge process passes (chaos.kill_merge_at)
MERGE_FAULT_POINTS = (
    "merge.after-read",
    "global.payload-written",
    "global.before-cas",
    "global.after-cas",
    "ledger.partial",
)


class ChaosConfig(_Frozen):
    """Fault injection (training/chaos.py); everything off by default. Every injected event is
    recorded in the store's metrics ("chaos")."""

    kill_mtbi_s: float | None = Field(None, gt=0, description="SIGKILL islands, mean seconds")
    max_kills: int = Field(0, ge=0, description="kills at most (0: no limit)")
    stall_island: str | None = None
    stall_after_s: float = Field(30.0, ge=0)
    slow_island: str | None = None
    slow_factor: float = Field(1.0, ge=1)
    storage_error_rate: float = Field(0.0, ge=0, lt=1)
    storage_latency_s: float = Field(0.0, ge=0)
    kill_merge_at: str | None = Field(None, description="merge fault point, 'point' or 'point@n'")
    seed: int = 0

    @field_validator("kill_merge_at")
    @classmethod
    def _merge_point(cls, v: str | None) -> str | None:
        if v is None:
            return v
        point, _, nth = v.partition("@")
        if point not in MERGE_FAULT_POINTS or (nth and not (nth.isdigit() and int(nth) > 0)):
            raise ValueError(
                f"kill_merge_at {v!r}: expected one of {', '.join(MERGE_FAULT_POINTS)}, "
                "optionally with @n (n >= 1)"
            )
        return v


class ExperimentConfig(_Frozen):
    name: str
    store_url: str = "file://./runs/store"
    seed: int = 0
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    inner: InnerConfig = InnerConfig()
    outer: OuterConfig = OuterConfig()
    fragments: FragmentConfig = FragmentConfig()
    codec: Codec = "int8"
    error_feedback: bool = True
    islands: tuple[IslandConfig, ...] = (
        IslandConfig(name="island-0"),
        IslandConfig(name="island-1"),
    )
    token_budget: int = Field(2_000_000, gt=0, description="total tokens merged, all islands")
    eval_every_versions: int = Field(5, gt=0)
    heartbeat_s: float = Field(5.0, gt=0)
    syncer: SyncerConfig = SyncerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    chaos: ChaosConfig = ChaosConfig()

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
        dims = self.model.dims()
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
        if self.syncer.shards > self.fragments.count:
            raise ValueError(
                f"syncer.shards {self.syncer.shards} exceeds fragments.count "
                f"{self.fragments.count}: a shard would own no fragment"
            )
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

    def inner_steps(self, name: str) -> int:
        """H for this island: DyLU scales it with the island's speed."""
        if not self.inner.dylu:
            return self.inner.H
        top = max(i.speed for i in self.islands)
        return max(1, int(self.inner.H * self.island(name).speed / top))

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True)


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "config"
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{loc}: {msg}{more}"


def parse_config(data: dict[str, Any]) -> ExperimentConfig:
    """Validate a dict; raise ConfigError with one line naming the first problem."""
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"invalid config: {_one_line(err)}") from None
    except ValueError as err:
        raise ConfigError(f"invalid config: {err}") from None


def load_config(path: str | Path) -> ExperimentConfig:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"config {path} is not valid JSON: {err}") from None
    return parse_config(data)


def with_overrides(cfg: ExperimentConfig, overrides: dict[str, Any]) -> ExperimentConfig:
    """Apply dotted overrides (`{"outer.lr": 0.5, "islands": [...]}`) and re-validate."""
    data = cfg.model_dump(mode="json")
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            if not isinstance(node.get(key), dict):
                raise ConfigError(f"invalid config: unknown field {dotted!r}")
            node = node[key]
        node[leaf] = value
    return parse_config(data)


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
