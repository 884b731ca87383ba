"""The inner loop: a jitted AdamW step over all of an island's devices.

The step runs on a `jax.sharding.Mesh` with one axis, "data": the batch is split across devices
(data parallel) and, with `shard_params=True`, every parameter and its AdamW moments are split
along their first divisible dimension too (ZeRO-3 / FSDP style) for models that do not fit one
chip. The step is compiled once: shapes, dtypes and shardings never change between calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from training.config.experiment import InnerConfig, ModelConfig
from training.model import definition as model
from training.model.pytree import named_to_state, state_to_named

Params = dict[str, jax.Array]


def make_mesh(devices=None) -> Mesh:
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.array(devices), ("data",))


def inner_schedule(cfg: InnerConfig, decay_steps: int | None = None) -> optax.Schedule:
    """Linear warm-up from lr / warmup_steps to lr, then constant (`decay_steps` None) or a
    cosine decay reaching lr x final_lr_frac at step `decay_steps` (and staying there)."""
    start = cfg.lr / max(cfg.warmup_steps, 1)
    if decay_steps is None or cfg.schedule == "constant":
        return optax.linear_schedule(start, cfg.lr, cfg.warmup_steps)
    return optax.warmup_cosine_decay_schedule(
        start,
        cfg.lr,
        warmup_steps=min(cfg.warmup_steps, decay_steps - 1),
        decay_steps=max(decay_steps, 1),
        end_value=cfg.lr * cfg.final_lr_frac,
    )


def inner_optimizer(
    cfg: InnerConfig, decay_steps: int | None = None
) -> optax.GradientTransformation:
    """Clip, then AdamW on `inner_schedule`."""
    schedule = inner_schedule(cfg, decay_steps)
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )


def _param_spec(shape: tuple[int, ...], n: int, shard_params: bool) -> P:
    if shard_params and n > 1:
        for axis, size in enumerate(shape):
            if size % n == 0 and size >= n:
                spec = [None] * len(shape)
                spec[axis] = "data"
                return P(*spec)
    return P()


@dataclass
class InnerLoop:
    """Compiled train and eval steps for one model on one mesh."""

    model_cfg: ModelConfig
    inner_cfg: InnerConfig
    mesh: Mesh
    shard_params: bool = False
    # the cosine schedule's length (ExperimentConfig.inner_decay_steps); None: no decay
    decay_steps: int | None = None

    def __post_init__(self):
        self.tx = inner_optimizer(self.inner_cfg, self.decay_steps)
        shapes = model.abstract_params(self.model_cfg)
        n = self.mesh.devices.size
        self.param_sharding = {
            k: NamedSharding(self.mesh, _param_spec(v.shape, n, self.shard_params))
            for k, v in shapes.items()
        }
        self.batch_sharding = NamedSharding(self.mesh, P("data", None))
        opt_shapes = jax.eval_shape(self.tx.init, shapes)
        self.opt_sharding = optax.tree_map_params(
            self.tx,
            lambda _, spec: spec,
            opt_shapes,
            self.param_sharding,
            transform_non_params=lambda _: NamedSharding(self.mesh, P()),
        )
        self._opt_shapes = opt_shapes
        self.param_shapes = {k: tuple(v.shape) for k, v in shapes.items()}
        self.opt_leaf_shapes = {
            name: (tuple(x.shape), np.dtype(x.dtype))
            for name, x in state_to_named_abstract(opt_shapes).items()
        }
        self._copy = jax.jit(lambda tree: jax.tree_util.tree_map(jnp.copy, tree))
        replicated = NamedSharding(self.mesh, P())
        self._train = jax.jit(
            partial(_train_step, self.model_cfg, self.tx),
            in_shardings=(
                self.param_sharding,
                self.opt_sharding,
                self.batch_sharding,
                self.batch_sharding,
            ),
            out_shardings=(self.param_sharding, self.opt_sharding, replicated),
            donate_argnums=(0, 1),
        )
        self._eval = jax.jit(
            partial(model.loss_fn, self.model_cfg),
            in_shardings=(self.param_sharding, self.batch_sharding, self.batch_sharding),
            out_shardings=replicated,
        )

    def put_params(self, params: dict[str, np.ndarray]) -> Params:
        """Place host arrays on the mesh (copies: the step donates its inputs)."""
        return {k: jax.device_put(np.asarray(v), self.param_sharding[k]) for k, v in params.items()}

    def init_opt_state(self, params: Params):
        return jax.jit(self.tx.init, out_shardings=self.opt_sharding)(params)

    def step(self, params: Params, opt_state, inputs: np.ndarray, targets: np.ndarray):
        """One AdamW step; returns (params, opt_state, loss). Inputs are donated."""
        inputs = jax.device_put(inputs, self.batch_sharding)
        targets = jax.device_put(targets, self.batch_sharding)
        return self._train(params, opt_state, inputs, targets)

    def eval_loss(self, params: Params, batches) -> float:
        losses = [
            self._eval(
                params,
                jax.device_put(x, self.batch_sharding),
                jax.device_put(y, self.batch_sharding),
            )
            for x, y in batches
        ]
        return float(np.mean(jax.device_get(losses)))

    def compile_count(self) -> int:
        """How many times the train step was compiled (must stay 1)."""
        return self._train._cache_size()

    def opt_state_to_host(self, opt_state) -> dict[str, np.ndarray]:
        """Inner optimizer state as named host arrays, for the island checkpoint."""
        return state_to_named(opt_state)

    def opt_state_named(self, opt_state) -> dict[str, jax.Array]:
        """The optimizer state's leaves as named device arrays (the names of
        `opt_state_to_host`), without fetching anything."""
        return dict(state_to_named_abstract(opt_state))

    def copy(self, tree):
        """A device copy of a pytree of arrays (fresh buffers, one dispatch): what a
        background checkpoint holds while the next steps donate the originals."""
        return self._copy(tree)

    def opt_state_from_host(self, named: dict[str, np.ndarray]):
        return jax.device_put(named_to_state(named, self._opt_shapes), self.opt_sharding)


def state_to_named_abstract(state) -> dict:
    """Leaves of a pytree as `{"0000": leaf, ...}` in tree order, unconverted (the names of
    training/model/pytree.py's `state_to_named`)."""
    return {f"{i:04d}": x for i, x in enumerate(jax.tree_util.tree_leaves(state))}


def _train_step(model_cfg: ModelConfig, tx, params, opt_state, inputs, targets):
    loss, grads = jax.value_and_grad(partial(model.loss_fn, model_cfg))(params, inputs, targets)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def to_host(params: Params) -> dict[str, np.ndarray]:
    """Fetch a (possibly sharded) parameter dict as float32 numpy arrays."""
    return {k: np.asarray(jax.device_get(v), dtype=np.float32) for k, v in params.items()}
