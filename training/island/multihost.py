"""An island over several processes, one per host: `jax.distributed`, one writer, one mind.

A multi-host island (a TPU slice of several hosts, several GPU hosts; here: several CPU
processes over gloo) is one data-parallel job: every process runs the same `Island` code on a
mesh over the devices of all of them (training/model/runtime.py), and every jitted computation on
those global arrays (train step, adopt, device encoder, checkpoint copy) is dispatched by every
process in the same order. Two rules keep the processes one island:

1. **One writer.** Process 0 writes everything that is per island: pseudo-gradients,
   heartbeats, the done marker, the checkpoint. The other processes get a `ReadOnlyStore`
   (a write raises), so a store holds one set of objects whatever the host count.
2. **One mind.** Whatever an island decides from the store or a clock (which global versions
   to adopt and when, clock rounds, a checkpoint due by time, stop markers, the token budget,
   a SIGTERM) is decided by process 0 and handed to the others through the `jax.distributed`
   coordination service's key-value store (`ProcessGroup.agree`): a few small JSON values per
   step, no device collective, no host sync of the device queue. Decisions that follow from
   the step count alone (step rounds, adopt due steps, `max_tokens`) need no agreement.
   Global versions are immutable, so each process reads the agreed version's parameters
   itself (in its I/O thread, as a single-process island does); one that read a newer version
   than process 0 chose reads the chosen one again.

Checkpoints: multi-host islands keep parameters and AdamW moments replicated over the mesh
(`inner.shard_params = false`; a sharded multi-host island is refused at start), so process 0
holds every value and writes the checkpoint alone. The only per-host state, the data cursor,
is the same on every host: each host draws the island's whole batch from the same loader
(same seed, same cursor) and `jax.device_put` places its own rows. A checkpoint therefore
resumes on any host count.

A follower's SIGTERM reaches process 0 through the same store (key `STOP_KEY/<index>`), which
stops the island at the next step boundary: all processes checkpoint-and-exit together. A host
that dies outright takes the island down (the coordination service ends the others); the
backend reports it failed and Airflow relaunches it, which resumes from the checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

log = logging.getLogger("diloco.multihost")

T = TypeVar("T")

AGREE_KEY = "diloco/agree"
STOP_KEY = "diloco/stop"
KEEP_AGREED = 4096
"""Agreed values process 0 keeps before deleting the oldest: a follower is never that far
behind (the train step's all-reduce keeps hosts within a few steps of each other)."""
AGREE_TIMEOUT_MS = 600_000


@dataclass
class ProcessGroup:
    """The processes of one island: `index` of `count`; `client` is the coordination
    service's client (None for a single process, where `agree` just decides)."""

    index: int = 0
    count: int = 1
    client: Any = None
    timeout_ms: int = AGREE_TIMEOUT_MS
    _calls: int = field(default=0, repr=False)

    @property
    def single(self) -> bool:
        return self.count == 1

    @property
    def writer(self) -> bool:
        """Whether this process writes the island's objects (process 0)."""
        return self.index == 0

    def agree(self, decide: Callable[[], T]) -> T:
        """Process 0's `decide()`, on every process. Every process must call `agree` the same
        number of times in the same order; `decide` runs on process 0 only and must return a
        JSON value (what every process gets back is that value after a JSON round trip)."""
        if self.single:
            return decide()
        n, self._calls = self._calls, self._calls + 1
        key = f"{AGREE_KEY}/{n}"
        if self.writer:
            text = json.dumps(decide())
            self.client.key_value_set(key, text)
            if n >= KEEP_AGREED:
                self.client.key_value_delete(f"{AGREE_KEY}/{n - KEEP_AGREED}")
        else:
            text = self.client.blocking_key_value_get(key, self.timeout_ms)
        return json.loads(text)

    def announce_stop(self) -> None:
        """A follower got SIGTERM: tell process 0 (which stops the island for all)."""
        if not self.single and not self.writer:
            self.client.key_value_set(f"{STOP_KEY}/{self.index}", "1")

    def peer_stopping(self) -> bool:
        """Process 0: whether some other process announced a stop."""
        if self.single:
            return False
        return bool(self.client.key_value_dir_get(f"{STOP_KEY}/"))


COORDINATOR_ENV = "DILOCO_COORDINATOR"
NUM_PROCESSES_ENV = "DILOCO_NUM_PROCESSES"
PROCESS_ID_ENV = "DILOCO_PROCESS_ID"


def flag_defaults(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The defaults of `diloco island`'s multi-host flags, from the environment the tpu_vm
    and gke backends give an island (diloco_airflow.knobs.ISLAND_ENV), as strings for
    argparse to convert: coordinator (None: unset), num_processes ("1"), process_id ("":
    left to jax.distributed)."""
    env = os.environ if environ is None else environ
    return {
        "coordinator": env.get(COORDINATOR_ENV) or None,
        "num_processes": env.get(NUM_PROCESSES_ENV) or "1",
        "process_id": env.get(PROCESS_ID_ENV, ""),
    }


def initialize(
    coordinator: str | None, num_processes: int | None, process_id: int | None
) -> ProcessGroup:
    """Join this process to its island's `jax.distributed` job and return its group; a single
    process (`num_processes` None or 1) initializes nothing. Call before anything touches a
    device. An empty or None `coordinator` (and process id) is left to JAX to detect (Cloud
    TPU metadata, GKE JobSet). CPU collectives use gloo (docs/PLATFORM: verified on loopback)."""
    if not num_processes or num_processes <= 1:
        return ProcessGroup()
    import jax
    from jax._src import distributed

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator or None,
        num_processes=num_processes,
        process_id=process_id,
    )
    group = ProcessGroup(jax.process_index(), jax.process_count(), distributed.global_state.client)
    log.info("island process %d of %d", group.index, group.count)
    return group


def finish(group: ProcessGroup) -> None:
    """End a multi-host island's `jax.distributed` job in an order that cannot crash; call
    after the island's result is printed. Nothing for a single process.

    Every process shuts its coordination client down (the service holds each shutdown until
    all processes have asked: a barrier). JAX's own exit hook would then destroy process 0's
    coordination service, whose gRPC server aborts the process (SIGABRT, `Check failed:
    queue.Pop() == nullptr` in ~RealRequestMatcher) when a follower's last call is still in
    flight: a finished island exiting -6 at random (seen in CI). So process 0 never destroys
    it: after its client is shut down it flushes its output and leaves with `os._exit(0)`,
    and the operating system closes the server's sockets. A follower whose shutdown call
    cannot complete because process 0 already left logs one line and exits 0: the island's
    work was done and written by process 0 before any of this."""
    if group.single:
        return
    import sys

    from jax._src import distributed

    state = distributed.global_state
    try:
        if state.preemption_sync_manager is not None:
            state.preemption_sync_manager.shutdown()
            state.preemption_sync_manager = None
        if state.client is not None:
            client, state.client = state.client, None
            client.shutdown()
    except Exception as err:  # noqa: BLE001 - jaxlib's error type is private; one line, exit 0
        log.warning("island process %d: coordination shutdown: %s", group.index, err)
    if state.service is None:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


WRITES = frozenset(
    {
        "publish_pseudograd",
        "write_heartbeat",
        "write_events",
        "mark_done",
        "save_checkpoint",
        "append_metric",
        "write_config",
        "update_config",
        "request_stop",
        "clear_stop",
        "create_round_clock",
        "record_applied",
        "settle_ledger",
        "rewrite_ledger_entry",
        "ledger_conflicts",
        "quarantine",
    }
)
"""ExperimentStore methods that write (refused on followers)."""


class ReadOnlyStore:
    """An ExperimentStore for a follower process: reads pass through, the island's writes
    raise (only process 0 writes; a write here is a bug that would duplicate objects)."""

    def __init__(self, store: Any):
        self._store = store

    def __getattr__(self, name: str) -> Any:
        if name in WRITES:
            raise RuntimeError(f"store.{name}: only process 0 of a multi-host island writes")
        return getattr(self._store, name)
