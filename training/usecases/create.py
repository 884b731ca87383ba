"""Create an experiment or join it: the one path of `diloco init` and the Airflow `init` task.

`create_or_join(cfg, estore)` checks the config (the token budget, the model, the caller's own
checks) before it touches the store, checks that the store answers, then creates config.json or,
when the experiment exists, joins `cfg`'s islands to it, creates version 0 of every fragment
(`initial_version`) and evaluates it (the first compile, the first eval record). The decisions
are the config's pure rules (`training.config.experiment`: `check_budget`, `check_same_settings`,
`join_islands`); the store only stores what they decided (`update_config`: compare-and-swap on
config.json). Every step may be repeated after a crash (docs/STORE.md, "What a retry may
repeat"): a repeat with the same config joins nothing and creates nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from training.config.experiment import (
    ConfigError,
    ExperimentConfig,
    check_budget,
    check_same_settings,
    join_islands,
    parse_config,
)
from training.data.corpus import check_source
from training.data.tokenizer import bind_tokenizer
from training.merge.merger import initial_version
from training.model.definition import definition
from training.model.evaluate import evaluate_current
from training.store.experiment import ExperimentExists, ExperimentStore
from training.store.objectstore import ObjectNotFound

log = logging.getLogger(__name__)

Check = Callable[[ExperimentConfig], None]


@dataclass(frozen=True)
class InitResult:
    """What `create_or_join` did, and what its caller hands on."""

    created: bool
    """This call created the experiment (config.json); False: it joined an existing one."""
    config: ExperimentConfig
    """The config in force: every island of the experiment, the joined ones included."""
    islands: tuple[str, ...]
    """The islands this call asked for (they run now; islands of earlier calls keep running)."""
    new_islands: tuple[str, ...]
    """Those of `islands` that were not in the experiment before this call."""
    created_version0: bool
    """This call created version 0 (or completed it after a crash: `initial_version`)."""
    initial_eval: dict[str, Any] | None
    """The eval record of version 0 (`evaluate_current`), when this call created it."""
    stop_requested: bool
    """The experiment has its experiment-wide stop marker: its islands stop at once."""

    @property
    def initial_loss(self) -> float | None:
        return None if self.initial_eval is None else self.initial_eval["loss"]

    @property
    def relaunched(self) -> tuple[str, ...]:
        """The islands asked for that were in the experiment already, sorted."""
        return tuple(sorted(set(self.islands) - set(self.new_islands)))


def validate(cfg: ExperimentConfig, checks: Sequence[Check] = ()) -> None:
    """Everything a config must pass before anything is written, in this order: the token
    budget (`check_budget`), the caller's `checks`, the model (`definition`: a model.factory
    that does not resolve), the data source (`check_source`: it exists and reads). Raises
    ConfigError (one line)."""
    check_budget(cfg)
    for check in checks:
        check(cfg)
    definition(cfg.model)
    try:
        check_source(cfg.data.source)
    except (OSError, ValueError) as err:
        raise ConfigError(f"data.source: {err}") from None


def add_islands(estore: ExperimentStore, islands: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Join `islands` to the experiment: the config's join rule (`join_islands`: appended, each
    on a free data shard; islands already in it must be asked for with the same settings)
    applied to config.json by compare-and-swap (`ExperimentStore.update_config`: racing joins
    all land, a repeat is a no-op). Returns the new config; ConfigError (one line) if refused."""
    wanted = [dict(i) for i in islands]
    return estore.update_config(lambda current: join_islands(current, wanted))


def create_or_join(
    cfg: ExperimentConfig, estore: ExperimentStore, checks: Sequence[Check] = ()
) -> InitResult:
    """Create experiment `cfg` in `estore`, or join `cfg.islands` to it if it exists; then make
    sure version 0 exists, and evaluate it if this call created it.

    `cfg` is first tied to its tokenizer (`bind_tokenizer`: the model's vocab_size follows a
    file tokenizer, whose sha256 config.json records), then `validate` runs (nothing is read or
    written when either fails), then the store's
    reachability check (`ObjectStore.check`). Joining: every setting but the island list must
    equal the stored config (`check_same_settings`), and the islands are added by `add_islands`.
    A concurrent creator in between (config.json appeared after our read) is joined the same
    way. ConfigError (one line) for a config or a join that is refused; StoreError as the store
    raises it.
    """
    cfg = bind_tokenizer(cfg)  # vocab_size and the tokenizer's sha256, before any check
    validate(cfg, checks)
    estore.store.check()  # unreachable bucket / missing credentials: fail now, with its message
    wanted = json.loads(cfg.to_json())
    try:
        existing = estore.read_config()
    except ObjectNotFound:
        existing = None
    created = False
    if existing is None:
        try:
            estore.write_config(wanted)
            created = True
        except ExperimentExists:  # created by a concurrent caller in between: join it
            existing = estore.read_config()
    asked = tuple(i.name for i in cfg.islands)
    stop = False
    if created:
        in_force, new = cfg, asked
    else:
        check_same_settings(existing, wanted)  # the same experiment, or a one-line ConfigError
        joined = add_islands(estore, wanted["islands"])
        known = {i.name for i in parse_config(existing).islands}
        in_force = parse_config(joined)
        new = tuple(n for n in asked if n not in known)
        log.info(
            "joining experiment %s: new islands %s, relaunching %s",
            cfg.name,
            list(new),
            sorted(known & set(asked)),
        )
        stop = estore.stop_requested(None)
        if stop:
            log.warning("experiment %s has a stop marker: its islands stop at once", cfg.name)
    try:
        version0 = initial_version(in_force, estore) == 0
        log.info("experiment %s: %s", cfg.name, "created version 0" if version0 else "exists")
        first = None
        if version0:
            first = evaluate_current(in_force, estore)
            log.info("initial eval: %s", first)
    except Exception:
        if created:  # a failed init leaves no experiment behind: what this call made goes
            log.warning("experiment %s: init failed, removing what it wrote", cfg.name)
            estore.delete_prefix("")
        raise
    return InitResult(
        created=created,
        config=in_force,
        islands=asked,
        new_islands=new,
        created_version0=version0,
        initial_eval=first,
        stop_requested=stop,
    )
