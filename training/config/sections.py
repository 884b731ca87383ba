"""The sections of the experiment config: the model, data, inner and outer optimizers, fragments,
syncer, checkpoints, islands and fault injection (training/config/experiment.py assembles them into
`ExperimentConfig` and holds the rules that need all of it).

Models are frozen and reject unknown keys, so a typo in a config file or a DAG trigger is an
error, not a default. Every field carries a description: the trigger form and `field_docs` show it.
Past 500 lines on purpose: ten sections whose fields are mostly their descriptions and bounds
(what the form shows), one class per section in the order a config file lists them; cut in two, a
reader would look for a section in two places.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from training.config.names import validate_name

MAX_ROUND_S = 86400.0  # the longest clock-round period (outer.round_s, control/rounds.json)

OuterMethod = Literal["sync", "nesterov", "delayed_nesterov", "decoupled"]
"""The merger's methods (`training.merge.selection.select`). Data-parallel is no merge method: the benchmarks'
``dp`` is `training.model.baseline`, which uses no merger."""
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
# (training/model/gemma.py): the gpt sizes with a gated MLP of d_ff = 3 x d_model (three matrices, so
# about the gpt MLP's 8 d^2) and grouped-query attention with head_dim = d_model / n_heads
GEMMA_PRESETS: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "gemma-tiny": (128, 2, 4, 2, 384, 256, 64),
    "gemma-small": (384, 8, 6, 2, 1152, 256, 256),
    "gemma-125m": (768, 12, 12, 4, 2304, 50304, 1024),
    "gemma-1b": (2048, 18, 16, 4, 6144, 50304, 2048),
    "gemma-12b": (5120, 38, 40, 8, 15360, 50304, 4096),
}
ComputeDtype = Literal["auto", "float32", "bfloat16"]
# The largest model a reader of an untrusted model section builds (ModelConfig.bounded_dims):
# far above every preset (12b: d_model 5120, 38 layers, 4096 positions), far below what
# would hang or exhaust a host before a check of the tensors could refuse it.
MODEL_LIMITS = {
    "d_model": 2**16,
    "n_layers": 2**12,
    "n_heads": 2**12,
    "n_kv_heads": 2**12,
    "d_ff": 2**20,
    "vocab_size": 2**22,
    "max_seq_len": 2**20,
}
MAX_PARAMS = 2**40


class ModelConfig(_Frozen):
    """A decoder-only transformer; `preset` sets every size, explicit fields override it.

    The preset names the family too: ``tiny`` .. ``12b`` are the "gpt" family
    (training/model/definition.py), ``gemma-tiny`` .. ``gemma-12b`` the "gemma" family (training/model/gemma.py).
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
        "grouped-query attention, QK-norm; only these export to transformers, diloco export "
        "--format hf); the fields below override it",
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
        "(training.model.definition.compute_dtype)",
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
        """The built-in model family the preset names (training.model.definition builds it)."""
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

    def bounded_dims(self) -> dict[str, int]:
        """`dims()`, once every size is within MODEL_LIMITS and the parameter count within
        MAX_PARAMS; ConfigError (one line) naming the first that is not. For a reader of a
        model section it did not write (an export's config.json, a stored config): checked
        before anything is built from it, so a claimed 2^40 layers is refused, not built."""
        out = self.dims()
        for name, limit in MODEL_LIMITS.items():
            if out[name] > limit:
                raise ConfigError(f"model: {name} {out[name]:,} is over the limit {limit:,}")
        count = self.param_count()
        if count > MAX_PARAMS:
            raise ConfigError(f"model: {count:,} parameters, over the limit {MAX_PARAMS:,}")
        return out

    def param_count(self) -> int:
        """Exact parameter count of the preset family's model for these dims (tied head):
        `training.model.definition.Transformer` (gpt) or `training.model.gemma.Gemma`. A `factory` model's
        count is `training.model.definition.abstract_params`'s, not this."""
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
    tokenizer: str = Field(
        "byte",
        description="byte (UTF-8), or a path / fsspec URL of a Hugging Face tokenizer.json or a "
        "SentencePiece .model (never a hub); a file tokenizer sets an unset model.vocab_size",
    )
    tokenizer_sha256: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 of the tokenizer file: init records it, every process checks it",
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

    # the defaults (inner lr, H; outer lr and momentum; heartbeat and syncer timing): one set
    # for `diloco init` and the trigger form, measured in docs/BENCHMARKS.md "One set of
    # defaults" (issue 36): the outer 0.7 / 0.9 of the papers diverged on the docs' small runs
    lr: float = Field(2e-3, gt=0, description="AdamW peak learning rate")
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
    H: int = Field(20, gt=0, description="inner steps between publishes (the fastest island's)")
    dylu: bool = Field(
        True,
        description="DyLU: an island's H scales with its speed relative to the fastest "
        "(outer.method sync ignores it)",
    )
    tau: int = Field(1, ge=0, description="overlap steps between publish and adopting the merge")
    alpha: float = Field(0.0, ge=0, lt=1, description="blend: theta <- a*theta + (1-a)*global")
    shard_params: bool = Field(
        False, description="also split parameters and AdamW moments over the island's devices"
    )
    keep_overlap: bool = Field(
        True, description="on adopting a merge, keep the steps trained since publishing"
    )

    @model_validator(mode="after")
    def _alpha_needs_blending(self) -> InnerConfig:
        if self.alpha and self.keep_overlap:
            raise ValueError(
                f"inner.alpha {self.alpha} blends only when adoption does not keep the overlap "
                "steps: set inner.keep_overlap = false with it (or alpha = 0)"
            )
        return self


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
                "(training.model.baseline, `diloco bench quality`)"
            )
        return value

    lr: float = Field(0.5, gt=0, description="outer learning rate")
    lr_warmup: int = Field(
        0,
        ge=0,
        description="outer learning-rate warm-up: a fragment's first W outer steps use lr x "
        "k / W (k = 1..W); 0: none",
    )
    momentum: float = Field(0.8, ge=0, lt=1, description="outer momentum (0: plain SGD)")
    nesterov: bool = Field(True, description="Nesterov momentum in the outer step")
    delay_period: int | None = Field(None, gt=0, description="Delayed Nesterov N; default M")
    quorum: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        "auto",
        description='K: minimum islands per fragment merge; "auto": the syncer chooses K per '
        "fragment merge from the islands' heartbeats (live islands, download time per "
        "version) and the round period, so that the new versions fit half a round of the "
        "slowest downlink, never waiting for a dead island nor more than a round",
    )
    grace_gamma: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="adaptive grace window: wait gamma x (tau x step time - time to quorum - "
        "sync time) for more islands after the quorum",
    )
    grace_min_steps: float = Field(
        2.0,
        ge=0,
        description="decoupled: the grace window is at least this many inner steps (the "
        "group's median step time): islands that publish at the same clock boundary a step or "
        "two apart merge in one outer step even when the syncer is slower than tau steps; "
        "0: the adaptive window alone",
    )
    max_grace_s: float = Field(30.0, ge=0, description="the grace window's cap, seconds")
    max_staleness: int = Field(16, gt=0, description="drop contributions older than this")
    end_max_staleness: int | None = Field(
        2,
        ge=0,
        description="once the run ends (control/STOP: the budget merged, or a user's stop), "
        "hold back a contribution staler than this many fragment versions (quarantined with "
        "the reason) instead of merging it: no later merge and no eval follow a step taken "
        "from an old base at the end; null: merge them as during the run",
    )
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
    fractional_momentum: bool = Field(
        False,
        description="decoupled, with partial_scaling: a merge of n of M islands is n/M of an "
        "outer step for the momentum too (decay beta^(n/M), Nesterov look-ahead x n/M), so "
        "out-of-phase partial merges do not each re-apply the whole momentum",
    )
    anchor: Literal["base", "now"] = Field(
        "base",
        description="where a stale contribution's outer gradient is anchored: base, "
        "Theta(base) - theta_m as the island published it (the others' progress since its base "
        "is kept); now, Theta(now) - theta_m (the paper's appendix D.2): the merger adds the "
        "fragment's change since the contribution's base version. The same at staleness 0",
    )
    staleness: Literal["none", "momentum", "age"] = Field(
        "none",
        description="staleness-aware outer update, applied to each stale contribution (staleness "
        "> 0) before islands are combined (training/merge/staleness.py): none; "
        "momentum, HeLoCo's correction (arXiv 2606.00271): per tensor, a contribution that "
        "conflicts with the outer momentum loses part of the conflicting component, a weakly "
        "aligned one is turned toward it; age, CGAD's scale (arXiv 2605.09126): the contribution "
        "x exp(-rate x staleness) x a cosine gate that reaches 0 just past max_staleness. Unlike "
        "staleness_decay (a vote weight among the islands of one merge), both change the step",
    )
    staleness_rate: float = Field(
        0.1,
        ge=0,
        description="outer.staleness = age: the decay rate per fragment version of staleness "
        "(CGAD's alpha)",
    )
    clip_multiplier: float = Field(5.0, gt=1, description="clip norms above k x running median")
    rounds: Literal["steps", "clock"] = Field(
        "clock",
        description="when an island's rounds end: every H_m of its own steps, or on a clock "
        "shared by all islands (training/protocol/rounds.py), which brings an island back in phase after "
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
        "pseudo-gradient codec (training/protocol/broadcast.py: about 8x fewer bytes with int4), and "
        "the whole float32 shadow only when too far behind (with codec fp32: as fp32)",
    )

    @model_validator(mode="after")
    def _staleness_needs_momentum(self) -> OuterConfig:
        if self.staleness == "momentum" and not self.momentum:
            raise ValueError(
                "outer.staleness = momentum corrects stale contributions with the outer "
                "momentum: set outer.momentum > 0 (or outer.staleness none / age)"
            )
        return self

    @model_validator(mode="after")
    def _fractional_needs_shares(self) -> OuterConfig:
        if self.fractional_momentum and not self.partial_scaling:
            raise ValueError(
                "outer.fractional_momentum scales the momentum by a partial merge's share, "
                "which only outer.partial_scaling computes: set it true too"
            )
        return self


class FragmentConfig(_Frozen):
    count: int = Field(4, gt=0, description="P: fragments, each published and merged apart")
    strategy: Literal["strided", "balanced", "tensors"] = Field(
        "tensors", description="strided layers, balanced layer groups, or balanced single tensors"
    )


class SyncerConfig(_Frozen):
    """The syncer (merger) as it runs on Airflow: `training/merge/syncer.py`, docs/AIRFLOW.md."""

    shards: int = Field(
        2,
        gt=0,
        description="merge shards S: fragment p is merged by shard p % S, each shard a mapped "
        "Airflow task of the experiment's run; at most P, the fragments (more are cut to P: a "
        "shard beyond them would merge nothing)",
    )
    idle_s: float = Field(
        300.0,
        gt=0,
        description="a shard keeps merging in its task process and goes back to its "
        "deferrable trigger (no process, no executor slot) after this many seconds without a "
        "merge; waking up again costs a task start and about 15 s",
    )
    poll_s: float = Field(
        0.2,
        gt=0,
        description="seconds between looks for new pseudo-gradients, while merging and "
        "while deferred",
    )
    eval_every_s: float = Field(
        10.0,
        gt=0,
        description="evaluate the current global model at most this often while it changes "
        "(a task of its own: never delays a merge); a final eval ends the run",
    )
    final_evals: int = Field(
        4,
        ge=0,
        le=64,
        description="at the end of a run, finalize also evaluates up to this many of the last "
        "models the merges made since the last eval (one per merge), so that a worse final "
        "model is replaced by the best merge, not by an older eval's snapshot",
    )
    fetch_concurrency: int = Field(
        1,
        ge=1,
        le=64,
        description="contribution payloads a merge downloads at once, ahead of the one it "
        "sums (summed in a fixed order all the same: same bits); the merge holds at most this "
        "many besides the current one (k/8 of the fragment's float32 bytes at int4); 1: one "
        "after another (no gain measured on a local fake-gcs-server: docs/BENCHMARKS.md)",
    )
    threads: int = Field(
        1,
        ge=1,
        le=256,
        description="threads one merge shard runs its C loops on (decode, norms, folds, the "
        "outer step), each over its own chunks: the same bits on any count (docs/BENCHMARKS.md, "
        '"Merge at the real size"); 1: one core, as the syncer sizing assumes',
    )
    memory_gib: float | None = Field(
        None,
        gt=0,
        le=65536,
        description="the memory one merge shard may use, GiB: it keeps each of its fragments' "
        "state (params, outer state, broadcast shadow) resident between merges within it, less "
        "one merge's working memory (docs/AIRFLOW.md, 'What a shard needs'); a shard that "
        "cannot fit one merge refuses to start. None: the "
        "memory the machine (or its container) has available when the shard starts",
    )
    lease_s: float = Field(
        60.0,
        gt=0,
        description="a shard's lease in the store lasts this long past its last renewal: a second run joining the experiment starts no second syncer "
        "for the shard while the lease lives",
    )
    full_every: int = Field(
        8,
        ge=1,
        le=10_000,
        description="a merge writes a full version of its fragment (parameters, outer "
        "optimizer state, broadcast shadow) every this many versions, and a light one "
        "(parameters and the broadcast update, no outer state or shadow) in between; a syncer "
        "that starts cold rebuilds the state by re-applying the merges since the last full "
        "version. 1: every version full (layout 2 as it was)",
    )
    full_every_s: float = Field(
        600.0,
        ge=0,
        description="also write a full version when this many seconds passed since the "
        "fragment's last full one (bounds a cold start's replay in time); 0: by count only. "
        "Only matters when full_every is above 1",
    )
    full_in_background: bool = Field(
        True,
        description="write a due full version's state after its merge, beside the light "
        "version the merge publishes, while the next merges go on (the fragment's next merge "
        "waits for it); later versions replay from it once it is written. Off: the merge "
        "writes the full version itself before publishing it. The last merges of a run are "
        "always written full by the merge",
    )


class CheckpointConfig(_Frozen):
    """When an island writes its checkpoint (training/island/checkpoint.py, docs/STORE.md).

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
        "(DyLU)",
    )
    backend: Backend = Field("local", description="where it runs: local, tpu_vm or gke")
    hardware: dict[str, Any] = Field(
        default_factory=dict,
        description="settings of its backend (each backend's keys: docs/AIRFLOW.md, the form)",
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


# training/faults/points.py points a merge process passes (chaos.kill_merge_at)
MERGE_FAULT_POINTS = (
    "merge.after-read",
    "global.payload-written",
    "global.before-cas",
    "global.after-cas",
    "ledger.partial",
    "light.before-manifest",
    "merge.cold-replay",
)


class ChaosConfig(_Frozen):
    """Fault injection (training/faults/chaos.py); everything off by default. Every injected event is
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


class TensorBoardConfig(_Frozen):
    """TensorBoard event files under the experiment's prefix, `tb/{run}/` (training/store/
    tensorboard.py, docs/METRICS.md): written by the islands, the merge and the evaluator,
    buffered and flushed as new objects; a failed write is counted and logged, never fatal."""

    enabled: bool = Field(True, description="write TensorBoard event files under tb/")
    flush_s: float = Field(
        30.0, gt=0, description="seconds between a process's flushes (one new object each)"
    )
