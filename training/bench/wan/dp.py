"""Data-parallel over the emulated WAN: one process per region, a gradient all-reduce every step.

    python -m training.bench.wan.dp --config cfg.json --process-id I --num-processes N \\
        --coordinator 10.213.0.2:PORT --address 10.213.I.2 --out DIR [--max-steps K]

Each process is one region: `jax.distributed` over gloo (PLATFORM.md), one CPU device per
process, a `Mesh` over all of them. Every step, each process computes the gradient of its own
batch (its region's data shard, the same `BatchLoader` stream the island of that region reads),
casts it to bfloat16, and the processes all-reduce it (`psum` inside `shard_map`) across the
shaped links; the mean gradient then goes through the same AdamW as an island's inner step
(`training.model.inner.inner_optimizer`). bf16 is the gradient precision assumed for the 12B model
(training/bench/wan/model12b.py); the bytes on the wire are counted by the harness, not here.

gloo binds to the address of the machine's hostname, which inside a namespace is loopback: the
process hands gloo `--address` (its region's address) instead, through the collectives factory
that jax calls when it creates the CPU client (`xla_bridge._jax.make_gloo_tcp_collectives`).

Output (process 0 only; every process trains identically): `DIR/steps.json` with the wall time
(`time.time()`) at the start of training and at the end of every step (time spent saving
snapshots left out), and parameter snapshots `DIR/params-{step:06d}.npz` every `--save-every`
steps and at the end, for the held-out evaluation done afterwards by the bench. Training runs
for the config's `token_budget` tokens (all processes) or `--max-steps` steps. Then come
`--probe-phases` phases of `--probe-steps` steps each (their step times in `probes`): before
phase j (after writing the budget phase's record to `DIR/main.json`), process 0 creates
`DIR/ready-{j}` and waits for `DIR/go-{j}`, which the bench creates once it has reshaped the
links.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path


def _use_address(address: str) -> None:
    from jax._src import xla_bridge

    make = xla_bridge._jax.make_gloo_tcp_collectives

    def with_address(distributed_client, **_):
        return make(distributed_client=distributed_client, hostname=address)

    xla_bridge._jax.make_gloo_tcp_collectives = with_address


def allreduce_bf16(flat, axis: str, n: int):
    """Sum of a float32 vector over `axis`, sent as bfloat16: a reduce-scatter (all-to-all of
    1/n chunks) then an all-gather of the summed chunks, i.e. a ring all-reduce's bytes,
    2 (n - 1) / n x 2 bytes per element per process. XLA's CPU all-reduce would promote bf16 to
    float32, so the chunks travel as their uint16 bit patterns and are summed in float32."""
    import jax
    import jax.numpy as jnp

    size = flat.shape[0]
    padded = jnp.pad(flat, (0, -size % n)).astype(jnp.bfloat16).reshape(n, -1)
    bits = jax.lax.bitcast_convert_type(padded, jnp.uint16)
    parts = jax.lax.all_to_all(bits, axis, split_axis=0, concat_axis=0)
    mine = jax.lax.bitcast_convert_type(parts, jnp.bfloat16).astype(jnp.float32).sum(axis=0)
    mine = jax.lax.bitcast_convert_type(mine.astype(jnp.bfloat16), jnp.uint16)
    whole = jax.lax.all_gather(mine, axis, tiled=True)
    return jax.lax.bitcast_convert_type(whole, jnp.bfloat16).astype(jnp.float32)[:size]


def build_step(cfg, mesh):
    """The jitted data-parallel step: (params, opt_state, x, y) -> (params, opt_state, loss)."""
    import jax
    import optax
    from jax.flatten_util import ravel_pytree
    from jax.sharding import PartitionSpec as P

    from training.model import definition as model
    from training.model.inner import inner_optimizer

    tx = inner_optimizer(cfg.inner, cfg.inner_decay_steps())
    n = mesh.devices.size

    def local(params, x, y):
        loss, grads = jax.value_and_grad(functools.partial(model.loss_fn, cfg.model))(params, x, y)
        flat, unravel = ravel_pytree(grads)
        return jax.lax.psum(loss, "data") / n, unravel(allreduce_bf16(flat, "data", n) / n)

    grad_fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P("data"), P("data")),
        out_specs=(P(), P()),
        check_vma=False,  # the gradients inside are per process; we all-reduce them ourselves
    )

    def step(params, opt_state, x, y):
        loss, grads = grad_fn(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return tx, jax.jit(step, donate_argnums=(0, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.bench.wan.dp")
    parser.add_argument("--config", required=True, help="ExperimentConfig JSON")
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--coordinator", required=True, help="host:port of process 0")
    parser.add_argument("--address", required=True, help="this process's address for gloo")
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument(
        "--probe-steps", type=int, default=0, help="steps per probe phase after the budget"
    )
    parser.add_argument("--probe-phases", type=int, default=0)
    parser.add_argument(
        "--step-pad-s",
        type=float,
        default=0.0,
        help="idle seconds after every step (a slower chip)",
    )
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _use_address(args.address)
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=120,
    )
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from training.config.experiment import load_config
    from training.data.batches import BatchLoader, shard_tokens
    from training.model import definition as model
    from training.model.runtime import corpus_for

    cfg = load_config(args.config)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P("data", None))
    tx, step = build_step(cfg, mesh)
    shard = args.process_id  # region i reads island i's shard (cfg.shard_of of the i-th island)
    loader = BatchLoader(
        shard_tokens(corpus_for(cfg).train, shard, args.num_processes),
        cfg.data.batch_size,
        cfg.data.seq_len,
        seed=cfg.seed * 1000 + shard,
    )
    host = {k: np.asarray(v, np.float32) for k, v in model.init_params(cfg.model, cfg.seed).items()}
    params = jax.device_put(host, replicated)
    opt_state = jax.jit(tx.init, out_shardings=replicated)(params)
    per_step = cfg.data.batch_size * cfg.data.seq_len * args.num_processes
    max_steps = -(-cfg.token_budget // per_step)
    if args.max_steps is not None:
        max_steps = min(max_steps, args.max_steps)
    out = Path(args.out)
    lead = args.process_id == 0

    def save(step_no: int) -> None:
        if lead:
            arrays = {k: np.asarray(jax.device_get(v)) for k, v in params.items()}
            np.savez(out / f"params-{step_no:06d}.npz", **arrays)

    def train(steps: int, save_every: int | None) -> list[float]:
        nonlocal params, opt_state
        paused = 0.0  # time spent saving snapshots, left out of the step times
        times = [time.time()]
        for i in range(1, steps + 1):
            x, y = loader.next_batch()
            gx = jax.make_array_from_process_local_data(batch_sharding, x)
            gy = jax.make_array_from_process_local_data(batch_sharding, y)
            params, opt_state, loss = step(params, opt_state, gx, gy)
            loss.block_until_ready()
            if args.step_pad_s:
                time.sleep(args.step_pad_s)
            times.append(time.time() - paused)
            if save_every and (i % save_every == 0 or i == steps):
                t = time.time()
                save(i)
                paused += time.time() - t
        return times

    record = dict(
        tokens_per_step=per_step, steps=max_steps, times=train(max_steps, args.save_every)
    )
    if lead:
        (out / "main.json").write_text(json.dumps(record))
    probes = []
    for j in range(args.probe_phases):
        if lead:  # the bench reshapes the links between phases; the other processes wait in
            (out / f"ready-{j}").touch()  # the next all-reduce
            while not (out / f"go-{j}").exists():
                time.sleep(0.01)
        probes.append(train(args.probe_steps, None))
    record["probes"] = probes
    if lead:
        (out / "steps.json").write_text(json.dumps(record))
    from jax._src import distributed

    from training.island import multihost  # the shutdown that cannot abort process 0

    client = distributed.global_state.client
    multihost.finish(multihost.ProcessGroup(jax.process_index(), jax.process_count(), client))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
