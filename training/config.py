"""One typed, validated experiment config.

Every process (island, merge, eval, the Airflow DAG's Params form) builds an `ExperimentConfig`
from the same fields; `diloco init` writes it as `config.json` next to the run. Models are frozen
and reject unknown keys, so a typo in a config file or a DAG trigger is an error, not a default.

Length: one schema read in one sitting with the rules that need all of it (overrides, `--set`,
the join); past 500 lines because every field carries its description.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from training.hardware import chips_of_hardware
from training.names import validate_name

MAX_ROUND_S = 86400.0  # the longest clock-round period (outer.round_s, control/rounds.json)

OuterMethod = Literal["sync", "nesterov", "delayed_nesterov", "decoupled"]
"""The merger's methods (`training.merge_rules`). Data-parallel is no merge method: the benchmarks'
``dp`` is `training.baseline`, which uses no merger."""
Codec = Literal["fp32", "bf16", "int8", "int4", "int2"]
Backend = Literal["local", "tpu_vm", "gke"]


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line naming the problem."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# (d_model, n_layers, n_heads, d_ff, vocab_size, max_seq_len): the "gpt" family
PRESETS: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (128, 2, 4, 512, 256, 64),
    "small": (384, 8, 6, 1536, 256, 256),
    "125m": (768, 12, 12, 3072, 50304, 1024),
    "1b": (2048, 18, 16, 8192, 50304, 2048),
    "12b": (5120, 38, 40, 20480, 50304, 4096),
}
# (d_model, n_layers, n_heads, n_kv_heads, d_ff, vocab_size, max_seq_len): the "gemma" family
# (training/gemma.py): the gpt sizes with a gated MLP of d_ff = 3 x d_model (three matrices, so
# about the gpt MLP's 8 d^2) and grouped-query attention with head_dim = d_model / n_heads
GEMMA_PRESETS: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "gemma-tiny": (128, 2, 4, 2, 384, 256, 64),
    "gemma-small": (384, 8, 6, 2, 1152, 256, 256),
    "gemma-125m": (768, 12, 12, 4, 2304, 50304, 1024),
    "gemma-1b": (2048, 18, 16, 4, 6144, 50304, 2048),
    "gemma-12b": (5120, 38, 40, 8, 15360, 50304, 4096),
}
ComputeDtype = Literal["auto", "float32", "bfloat16"]


class ModelConfig(_Frozen):
    """A decoder-only transformer; `preset` sets every size, explicit fields override it.

    The preset names the family too: ``tiny`` .. ``12b`` are the "gpt" family
    (training/model.py), ``gemma-tiny`` .. ``gemma-12b`` the "gemma" family (training/gemma.py).
    With `factory` set, the model is the user's (docs/MODELS.md); the sizes are still resolved
    here and handed to the factory in this config.
    """

    preset: Literal[
        "tiny",
        "small",
        "125m",
        "1b",
        "12b",
        "gemma-tiny",
        "gemma-small",
        "gemma-125m",
        "gemma-1b",
        "gemma-12b",
    ] = Field(
        "tiny",
        description="model size preset (PRESETS: tiny .. 12b, a GPT with learned positions and "
        "a GELU MLP; GEMMA_PRESETS: gemma-tiny .. gemma-12b, rotary positions, GeGLU MLP, "
        "grouped-query attention, QK-norm); the fields below override it",
    )
    d_model: int | None = Field(None, gt=0, description="width; default: the preset's")
    n_layers: int | None = Field(
        None, gt=0, description="transformer blocks; default: the preset's"
    )
    n_heads: int | None = Field(
        None, gt=0, description="attention heads (divide d_model); default: the preset's"
    )
    d_ff: int | None = Field(None, gt=0, description="MLP hidden width; default: the preset's")
    vocab_size: int | None = Field(
        None, gt=1, description="vocabulary (tokenizer) size; default: the preset's"
    )
    max_seq_len: int | None = Field(
        None, gt=0, description="longest sequence (position embeddings); default: the preset's"
    )
    n_kv_heads: int | None = Field(
        None,
        gt=0,
        description="gemma family: key/value heads of grouped-query attention (divide "
        "n_heads); default: the preset's; the gpt family has n_heads",
    )
    compute_dtype: ComputeDtype = Field(
        "auto",
        description="dtype of the forward and backward pass; parameters, gradients, optimizer "
        "state and pseudo-gradients stay float32 (master weights) and the loss is float32; "
        "auto: bfloat16 on accelerators (GPU, TPU), float32 on CPU "
        "(training.model.compute_dtype)",
    )
    factory: str | None = Field(
        None,
        description="bring your own Flax NNX model: 'package.module:function', called as "
        "function(model_config, rngs) and returning an nnx.Module whose __call__ maps int32 "
        "tokens (batch, seq) to logits (batch, seq, vocab_size), or a (module, loss_fn) pair "
        "with loss_fn(module, inputs, targets) -> mean loss per token; parameters are its "
        "float32 nnx.Params (docs/MODELS.md); null: the preset's model",
    )

    @field_validator("factory")
    @classmethod
    def _factory_spec(cls, v: str | None) -> str | None:
        if v is None:
            return v
        module, sep, attr = v.partition(":")
        parts = module.split(".") + [attr]
        if not sep or not all(p.isidentifier() for p in parts):
            raise ValueError(f"factory {v!r}: expected 'package.module:function'")
        return v

    @property
    def family(self) -> Literal["gpt", "gemma"]:
        """The built-in model family the preset names (training.model builds it)."""
        return "gemma" if self.preset in GEMMA_PRESETS else "gpt"

    def dims(self) -> dict[str, int]:
        if self.family == "gemma":
            d, n_layers, heads, kv, ff, vocab, seq = GEMMA_PRESETS[self.preset]
        else:
            d, n_layers, heads, ff, vocab, seq = PRESETS[self.preset]
            kv = self.n_heads or heads
            if self.n_kv_heads is not None and self.n_kv_heads != kv:
                raise ConfigError(
                    f"model: n_kv_heads {self.n_kv_heads} needs a gemma preset (the gpt family "
                    f"has n_kv_heads = n_heads = {kv})"
                )
        out = dict(
            d_model=self.d_model or d,
            n_layers=self.n_layers or n_layers,
            n_heads=self.n_heads or heads,
            d_ff=self.d_ff or ff,
            vocab_size=self.vocab_size or vocab,
            max_seq_len=self.max_seq_len or seq,
            n_kv_heads=self.n_kv_heads or kv,
        )
        if out["d_model"] % out["n_heads"]:
            raise ConfigError(
                f"model: d_model {out['d_model']} is not divisible by n_heads {out['n_heads']}"
            )
        if out["n_heads"] % out["n_kv_heads"]:
            raise ConfigError(
                f"model: n_heads {out['n_heads']} is not divisible by n_kv_heads "
                f"{out['n_kv_heads']}"
            )
        if self.family == "gemma" and (out["d_model"] // out["n_heads"]) % 2:
            raise ConfigError(
                f"model: rotary positions need an even head dimension, got d_model / n_heads "
                f"= {out['d_model'] // out['n_heads']}"
            )
        return out

    def param_count(self) -> int:
        """Exact parameter count of the preset family's model for these dims (tied head):
        `training.model.Transformer` (gpt) or `training.gemma.Gemma`. A `factory` model's
        count is `training.model.abstract_params`'s, not this."""
        m = self.dims()
        d, f, L, vocab = m["d_model"], m["d_ff"], m["n_layers"], m["vocab_size"]
        if self.family == "gemma":
            hd = d // m["n_heads"]
            # q + out, k + v, gate + up + down, two RMSNorm scales, q-norm and k-norm scales
            per_layer = 2 * d * d + 2 * d * m["n_kv_heads"] * hd + 3 * d * f + 2 * d + 2 * hd
            return vocab * d + L * per_layer + d
        per_layer = 4 * d * d + 2 * d * f + 2 * d  # qkv + out, mlp up + down, two RMSNorm scales
        return vocab * d + m["max_seq_len"] * d + L * per_layer + d


class DataConfig(_Frozen):
    source: str = Field(
        "builtin:pydoc",
        description="training text: builtin:pydoc, text files or uint16/uint32 token shards "
        "on any fsspec URL",
    )
    seq_len: int = Field(64, gt=0, description="tokens per training sequence")
    batch_size: int = Field(16, gt=0, description="sequences per inner step on one island")
    eval_fraction: float = Field(
        0.05, gt=0, lt=0.5, description="fraction of the corpus held out for evaluation"
    )
    eval_batches: int = Field(8, gt=0, description="held-out batches of one evaluation")
    num_shards: int | None = Field(
        None,
        gt=0,
        description="shards of the training data (an island trains on one); default: number of "
        "islands; set it above that for experiments islands may join",
    )


class InnerConfig(_Frozen):
    """AdamW on each island; H inner steps between publishes of a fragment."""

    lr: float = Field(3e-3, gt=0, description="AdamW peak learning rate")
    warmup_steps: int = Field(20, ge=0, description="linear learning-rate warm-up steps")
    schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="after the warm-up: constant, or a cosine decay to lr x final_lr_frac that "
        "every island ends when the token budget is reached (each over the steps its share of "
        "the budget takes: ExperimentConfig.inner_decay_steps), so all decay together",
    )
    final_lr_frac: float = Field(
        0.1, ge=0, le=1, description="cosine schedule: the last learning rate, as a share of lr"
    )
    weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay")
    b1: float = Field(0.9, gt=0, lt=1, description="AdamW first-moment decay")
    b2: float = Field(0.95, gt=0, lt=1, description="AdamW second-moment decay")
    grad_clip: float = Field(1.0, gt=0, description="clip the gradient's global norm to this")
    H: int = Field(32, gt=0, description="inner steps between publishes (the fastest island's)")
    dylu: bool = Field(
        True, description="DyLU: an island's H scales with its speed relative to the fastest"
    )
    tau: int = Field(1, ge=0, description="overlap steps between publish and adopting the merge")
    alpha: float = Field(0.0, ge=0, lt=1, description="blend: theta <- a*theta + (1-a)*global")
    shard_params: bool = Field(
        False, description="also split parameters and AdamW moments over the island's devices"
    )
    keep_overlap: bool = Field(
        True, description="on adopting a merge, keep the steps trained since publishing"
    )


class OuterConfig(_Frozen):
    method: OuterMethod = Field(
        "decoupled",
        description="merge rule: sync (DiLoCo rounds), nesterov, delayed_nesterov, decoupled",
    )

    @field_validator("method", mode="before")
    @classmethod
    def _no_data_parallel(cls, value: Any) -> Any:
        if value == "dp":
            raise ValueError(
                "'dp' (data-parallel) is not a merge method: the merger implements "
                f"{list(get_args(OuterMethod))}; data-parallel is the benchmarks' baseline "
                "(training.baseline, `diloco bench quality`)"
            )
        return value

    lr: float = Field(0.7, gt=0, description="outer learning rate")
    lr_warmup: int = Field(
        0,
        ge=0,
        description="outer learning-rate warm-up: a fragment's first W outer steps use lr x "
        "k / W (k = 1..W); 0: none",
    )
    momentum: float = Field(0.9, ge=0, lt=1, description="outer momentum (0: plain SGD)")
    nesterov: bool = Field(True, description="Nesterov momentum in the outer step")
    delay_period: int | None = Field(None, gt=0, description="Delayed Nesterov N; default M")
    quorum: int = Field(1, gt=0, description="K: minimum islands per fragment merge")
    grace_gamma: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="adaptive grace window: wait gamma x (tau x step time - time to quorum - "
        "sync time) for more islands after the quorum",
    )
    max_grace_s: float = Field(30.0, ge=0, description="the grace window's cap, seconds")
    max_staleness: int = Field(16, gt=0, description="drop contributions older than this")
    rda: bool = Field(
        True, description="radial-directional averaging of non-embedding tensors (not sync)"
    )
    token_weighting: bool = Field(
        True, description="weight each island's contribution by tokens^2 / steps (else equal)"
    )
    staleness_decay: bool = Field(True, description="decoupled: weight / (1 + staleness in rounds)")
    partial_scaling: bool = Field(
        True,
        description="decoupled: scale a merge of n of M active islands by n/M, so momentum "
        "sees one full round per M single-island merges (as Delayed Nesterov's g/N)",
    )
    clip_multiplier: float = Field(5.0, gt=1, description="clip norms above k x running median")
    rounds: Literal["steps", "clock"] = Field(
        "clock",
        description="when an island's rounds end: every H_m of its own steps, or on a clock "
        "shared by all islands (training/rounds.py), which brings an island back in phase after "
        "a restart; the synchronous method always uses steps",
    )
    round_s: float | None = Field(
        None,
        gt=0,
        le=MAX_ROUND_S,
        description="clock rounds: the round period in seconds; default H x the first "
        "contributor's measured step time (DyLU sizes every island's H_m to it)",
    )
    broadcast: Literal["fp32", "codec"] = Field(
        "codec",
        description="how islands download a new fragment version: fp32 reads its parameters "
        "whole; codec reads the syncer's update from the version before, encoded in the "
        "pseudo-gradient codec (training/broadcast.py: about 8x fewer bytes with int4), and "
        "the whole float32 shadow only when too far behind (with codec fp32: as fp32)",
    )


class FragmentConfig(_Frozen):
    count: int = Field(1, gt=0, description="P: fragments, each published and merged apart")
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
    name: str = Field(description="the island's name (lowercase letters, digits, '-')")
    speed: float = Field(
        1.0,
        gt=0,
        description="relative throughput, tokens per unit of time (1: one data.batch_size batch "
        "per unit); its inner steps per unit are speed x data.batch_size / its batch size "
        "(DyLU; virtual clock in benches)",
    )
    backend: Backend = Field("local", description="where it runs: local, tpu_vm or gke")
    hardware: dict[str, Any] = Field(
        default_factory=dict,
        description="backend-specific settings (diloco_airflow.backends.IslandSpec.hardware)",
    )
    shard: int | None = Field(
        None, ge=0, description="its data shard; default: its position in the island list"
    )
    max_tokens: int | None = Field(
        None, gt=0, description="the island leaves (marks itself done) after this many tokens"
    )
    batch_size: int | None = Field(
        None,
        gt=0,
        description="sequences per inner step on this island (over all its devices and hosts); "
        "default: data.batch_size",
    )
    devices: int | None = Field(
        None,
        gt=0,
        description="accelerators the island's data-parallel mesh spans (all its hosts); "
        "default: the hardware's chip count when it names one, else every device it sees; "
        "its batch must divide evenly over them",
    )

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
    stall_island: str | None = Field(
        None, description="this island stops stepping and heart-beating (once) ..."
    )
    stall_after_s: float = Field(
        30.0, ge=0, description="... this many seconds after its process starts"
    )
    slow_island: str | None = Field(None, description="this island runs slow_factor x slower")
    slow_factor: float = Field(1.0, ge=1, description="the slow island's step-time factor")
    storage_error_rate: float = Field(
        0.0, ge=0, lt=1, description="probability of an injected transient store error per call"
    )
    storage_latency_s: float = Field(0.0, ge=0, description="latency added to each store call")
    kill_merge_at: str | None = Field(None, description="merge fault point, 'point' or 'point@n'")
    seed: int = Field(0, description="seed of the kill times, victims and storage faults")

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
    eval_every_versions: int = Field(
        5,
        gt=0,
        description="unused: the syncer evaluates on a time cadence (syncer.eval_every_s); "
        "kept so that stored configs still parse",
    )
    heartbeat_s: float = Field(5.0, gt=0, description="seconds between an island's heartbeats")
    syncer: SyncerConfig = Field(SyncerConfig(), description="the syncer on Airflow")
    checkpoint: CheckpointConfig = Field(
        CheckpointConfig(), description="when islands checkpoint (training/checkpointing.py)"
    )
    chaos: ChaosConfig = Field(ChaosConfig(), description="fault injection (off by default)")

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
        for isl in self.islands:
            _check_island_hardware(isl, self.data.batch_size)
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
        counts what it trained: tokens = H_m x its batch x seq_len)."""
        if not self.inner.dylu:
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
    hardware names (training/hardware.py: one JAX device per chip from TPU v4 on; None when it
    names none). At run time the island's mesh spans `devices` devices if set, else every
    device its processes see (training/runtime.py)."""
    if isl.devices is not None:
        return isl.devices
    hw = isl.hardware or {}
    if any(hw.get(k) for k in ("chips", "topology", "accelerator_type")):
        return chips_of_hardware(hw)
    return None


def _check_island_hardware(isl: IslandConfig, default_batch: int) -> None:
    """What an island's hardware forces on its settings: its batch splits evenly over its
    devices (one slice of the batch per device, training/inner.py)."""
    devices = island_devices(isl)
    batch = isl.batch_size or default_batch
    if devices is not None and batch % devices:
        where = "batch_size" if isl.batch_size else "data.batch_size"
        raise ValueError(
            f"island {isl.name!r}: {where} {batch} does not divide over its {devices} devices "
            f"(set islands[].batch_size to a multiple of {devices})"
        )


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
# 2. the islands are joined by `join_islands` (ExperimentStore.add_islands applies it by CAS).


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
