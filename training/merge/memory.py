"""What a merge shard keeps in memory, and how much of it stays resident between merges.

A merger holds, for each fragment it owns, the state of the version it published last
(params, outer state and the broadcast shadow: `state_bytes`) so that its next merge of that
fragment reads nothing back and replays nothing ("warm"). One merge needs beside that state a
working set (`working_bytes`): the float32 accumulator (kept from merge to merge:
merge_stream.Arena; made only when a merge's votes are not all quantized codes or pass
FOLD_BYTES, else the outer step folds them as it goes: counted all the same, the bound holds
for every merge), the contribution payloads held for one fold (one per island, up to
combine.FOLD_BYTES) and fetched ahead, one
fragment-sized float32 array (an island's summed vote, or the shadow made from params) and
the update it encodes. So a shard with memory M keeps warm at most M - working_bytes of
state (`warm_limit`): every fragment when that covers them all, else the most recently merged
ones (the others start cold: replayed from their promotion or full version). A shard whose M
cannot hold one fragment's state and working set refuses to start (`check_fits`), naming the
numbers.

Pure functions of the config, and `available_bytes()`: what this machine (or its cgroup) has.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from training.codecs import host as codecs
from training.config.experiment import ExperimentConfig
from training.merge.combine import FOLD_BYTES
from training.protocol import broadcast

GiB = 2**30

log = logging.getLogger("diloco.merge")


@dataclass(frozen=True)
class FragmentMemory:
    """Bytes of one fragment's merge: `state` resident between merges, `working` during one."""

    fragment: int
    state: int
    working: int

    @property
    def peak(self) -> int:
        return self.state + self.working


def state_tensors(cfg: ExperimentConfig) -> int:
    """float32 copies of a fragment's params a merger keeps: the params, the outer momentum
    (none with outer.momentum 0), the Delayed Nesterov buffer, the broadcast shadow."""
    outer = cfg.outer
    momentum = outer.momentum > 0 or outer.method == "delayed_nesterov"
    return 1 + int(momentum) + int(outer.method == "delayed_nesterov") + int(broadcast.enabled(cfg))


def fragment_memory(
    cfg: ExperimentConfig, fragment: int, shapes: Mapping[str, tuple[int, ...]]
) -> FragmentMemory:
    """The bytes of one merge of `fragment` (its tensor `shapes`)."""
    elems = sum(math.prod(s) for s in shapes.values())
    payload = codecs.payload_limits(shapes, cfg.codec)[0]
    fetched = cfg.syncer.fetch_concurrency * payload  # downloads ahead of the votes held
    # the votes held for one fold (combine.Combiner: up to FOLD_BYTES, one per island)
    held = min(len(cfg.islands) * payload, FOLD_BYTES + payload)
    # accumulator + one fragment-sized float32 array + the payloads + the encoded update
    working = 2 * 4 * elems + fetched + held + payload
    return FragmentMemory(fragment, state_tensors(cfg) * 4 * elems, working)


def shard_memory(
    cfg: ExperimentConfig, fragments: Sequence[int], shapes: Sequence[Mapping]
) -> list[FragmentMemory]:
    return [fragment_memory(cfg, p, shapes[p]) for p in fragments]


def check_fits(frags: Sequence[FragmentMemory], memory: int, shard: str = "this shard") -> None:
    """ValueError in one line when `memory` cannot hold one merge of the largest fragment."""
    if not frags:
        return
    big = max(frags, key=lambda f: f.peak)
    if big.peak > memory:
        raise ValueError(
            f"{shard} cannot merge fragment {big.fragment} in {size(memory)}: one merge needs "
            f"{size(big.peak)} (state {size(big.state)}, working set {size(big.working)}); give "
            "the syncer more memory (syncer.memory_gib, a bigger worker) or more fragments "
            "(fragments.count) so each is smaller"
        )


def size(nbytes: int) -> str:
    """Bytes as GiB (MiB below one GiB), one decimal."""
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.1f} MiB"


def warm_limit(frags: Sequence[FragmentMemory], memory: int) -> int:
    """The state bytes a shard keeps resident between merges: `memory` less the largest
    working set, and never more than all its fragments' state."""
    if not frags:
        return 0
    room = memory - max(f.working for f in frags)
    return max(0, min(room, sum(f.state for f in frags)))


def available_bytes() -> int:
    """The memory this process may use: MemAvailable from /proc/meminfo, capped by the
    cgroup's limit less its usage (a container); 16 GiB where neither can be read."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                found.append(max(0, int(limit) - int(f.read().strip())))
    except (OSError, ValueError):
        pass
    return min(found) if found else 16 * GiB


def shard_budget(cfg: ExperimentConfig) -> int:
    """syncer.memory_gib in bytes, else what the machine has available now."""
    gib = cfg.syncer.memory_gib
    return int(gib * GiB) if gib is not None else available_bytes()


def shard_warm_limit(
    cfg: ExperimentConfig,
    fragments: Sequence[int],
    shapes: Sequence[Mapping[str, tuple[int, ...]]],
) -> int:
    """The warm limit of a merge shard of `fragments` on this machine (`shard_budget`): all of
    their state when the shard's memory holds it, else what is left beside the working set
    (logged: the others start cold). ValueError (`check_fits`) when it cannot hold one."""
    frags = shard_memory(cfg, fragments, shapes)
    budget = shard_budget(cfg)
    check_fits(frags, budget, f"merge shard of fragments {fragments}")
    limit = warm_limit(frags, budget)
    if limit < sum(f.state for f in frags):
        log.warning(
            "%s keeps %s of the %s of state of fragments %s resident: the others "
            "start cold (syncer.memory_gib, docs/AIRFLOW.md)",
            size(budget),
            size(limit),
            size(sum(f.state for f in frags)),
            fragments,
        )
    return limit
