"""Scavenging: extra islands join a running experiment for a time window, then leave.

Every rule of scavenging is here, as pure functions over plain values (the Airflow layer,
`plugins/diloco_airflow/scavenge.py`, only does the I/O):

- `ScavengeConfig`: the settings (the `diloco_scavenge` trigger form is derived from it).
- `slot_names` / `scavenged_islands`: which islands a window adds. Scavenged islands are
  *slots* with fixed names (``{prefix}-0``, ``{prefix}-1``, ...): the next window rejoins the
  same slots, which resume from their checkpoints on their own data shards, so windows never
  use up the experiment's free data shards (`training.config.experiment.join_islands`).
- `window`, `window_open`: when the window opens and closes.
- `experiment_running`: whether there is a running experiment to join.
- `watch_outcome`, `leave_reason`: what the wait on a scavenged island decides, and why it
  left ("window closed", "reclaimed", "finished", "failed"). Capacity taken back (spot or
  preemptible, or a local process told to go with SIGTERM) is a normal way to leave: no retry.
- `join_record` / `leave_record` / `scavenge_view`: the ``metrics/scavenge`` records that make
  joins and leaves visible (`diloco status`, the DiLoCo page).

A scavenged island leaves cleanly through the one stop mechanism there is: its stop marker
(``control/stop/{island}``, what `diloco stop` and the page's stop write). It then publishes
its last partial interval, checkpoints and writes its done marker; the merger counts it inactive
from the stop marker on. Rejoining a slot clears both markers first.

No jax, no Airflow: pydantic only (the form imports this at DAG parse time).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from training.config.experiment import Backend, ConfigError
from training.config.names import NAME_PATTERN, validate_name

METRIC = "scavenge"
"""The metric kind of join and leave records (``metrics/scavenge/``)."""

Capacity = Literal["spot", "preemptible", "on_demand"]
LEAVE_REASONS = ("window closed", "reclaimed", "finished", "failed")
MAX_SLOTS = 64


class ScavengeConfig(BaseModel):
    """The settings of one scavenging window (the `diloco_scavenge` DAG's Params)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    experiment: str = Field(
        "diloco-demo", description="the running experiment to join (its name in the store)"
    )
    store_url: str = Field(
        "file:///tmp/diloco/store",
        min_length=1,
        description="the experiment's store: file:///abs/path or gs://bucket/prefix",
    )
    islands: int = Field(
        1, gt=0, le=MAX_SLOTS, description="how many scavenged islands join for the window"
    )
    name_prefix: str = Field(
        "scav",
        description="scavenged islands are named <prefix>-0, <prefix>-1, ...; every window "
        "rejoins the same names (they resume from their checkpoints); a new prefix makes new "
        "islands (each needs a free data shard)",
    )
    backend: Backend = Field("local", description="where they run: local, tpu_vm or gke")
    speed: float = Field(1.0, gt=0, description="their relative speed (DyLU)")
    hardware: dict[str, Any] = Field(
        default_factory=dict,
        description="backend settings (diloco_airflow.backends.IslandSpec.hardware); the "
        "capacity flag is added to it",
    )
    capacity: Capacity = Field(
        "spot",
        description="tpu_vm / gke: spot (hardware.spot), preemptible (hardware.preemptible) "
        "or on_demand; ignored by local islands",
    )
    window_minutes: float = Field(
        60.0,
        gt=0,
        le=7 * 24 * 60,
        description="the window: the islands leave this many minutes after the run starts",
    )
    leave_timeout_s: float = Field(
        300.0,
        gt=0,
        description="after the stop marker, wait this long for the island's done marker (its "
        "last publish and checkpoint) before it is torn down",
    )
    poll_s: float = Field(5.0, gt=0, description="seconds between looks at a scavenged island")

    _experiment = field_validator("experiment")(lambda cls, v: validate_name("experiment", v))

    @field_validator("name_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        validate_name("island name prefix", v)
        if len(v) > 59:  # room for "-63"
            raise ValueError("island name prefix: at most 59 characters")
        return v


def parse_scavenge_config(data: Mapping[str, Any]) -> ScavengeConfig:
    """Validate; ConfigError with one line naming the first problem."""
    try:
        return ScavengeConfig.model_validate(dict(data))
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "scavenge"
        raise ConfigError(
            f"invalid scavenge settings: {loc}: {first['msg'].removeprefix('Value error, ')}"
        ) from None


# -- which islands ----------------------------------------------------------------------------
def slot_names(prefix: str, count: int) -> list[str]:
    """The scavenged islands' names: ``{prefix}-0`` .. ``{prefix}-{count-1}``."""
    names = [f"{prefix}-{k}" for k in range(count)]
    for n in names:
        validate_name("island", n)
    return names


def is_slot(name: str, prefix: str) -> bool:
    """Whether `name` is one of `prefix`'s slots."""
    head, sep, tail = name.rpartition("-")
    return bool(sep) and head == prefix and tail.isdigit() and str(int(tail)) == tail


def hardware_for(cfg: ScavengeConfig) -> dict[str, Any]:
    """The islands' hardware: the settings' plus the capacity flag for cloud backends."""
    hw = dict(cfg.hardware)
    if cfg.backend != "local":
        hw.pop("spot", None)
        hw.pop("preemptible", None)
        if cfg.capacity != "on_demand":
            hw[cfg.capacity] = True
    return hw


def scavenged_islands(cfg: ScavengeConfig) -> list[dict[str, Any]]:
    """The island configs a window joins (`training.usecases.create.add_islands` / the experiment
    form's ``islands``): the slots, with no shard (the join gives each the lowest free one, and
    a slot already in the experiment keeps its own)."""
    hw = hardware_for(cfg)
    return [
        {"name": n, "speed": cfg.speed, "backend": cfg.backend, "hardware": dict(hw)}
        for n in slot_names(cfg.name_prefix, cfg.islands)
    ]


def join_params(stored: Mapping[str, Any], islands: Sequence[Mapping[str, Any]]) -> dict:
    """The `diloco_experiment` form values that join `islands` to the experiment whose
    config.json is `stored` (every other setting equal to the stored one, as a join needs:
    `training.config.experiment.check_same_settings`), for `experiment_setup.init_experiment`."""
    rest = {k: v for k, v in stored.items() if k not in ("name", "store_url", "islands")}
    return {
        "experiment_name": stored["name"],
        "store_url": stored["store_url"],
        "islands": [dict(i) for i in islands],
        "overrides": rest,
    }


# -- the window ---------------------------------------------------------------------------------
def window(opened_at: float, cfg: ScavengeConfig) -> dict[str, float]:
    """``{"opens_at", "closes_at"}`` (unix seconds) of a window opened at `opened_at`."""
    return {"opens_at": float(opened_at), "closes_at": float(opened_at) + 60.0 * cfg.window_minutes}


def window_open(now: float, win: Mapping[str, float]) -> bool:
    """Whether `now` is inside the window (opens_at <= now < closes_at)."""
    return float(win["opens_at"]) <= now < float(win["closes_at"])


def experiment_running(
    has_config: bool, stop_all: bool, islands: Iterable[str], done: Iterable[str], prefix: str
) -> tuple[bool, str]:
    """(running, why): an experiment to join exists, has no experiment-wide stop marker, and
    at least one island that is not one of `prefix`'s slots is not done (otherwise nobody
    trains on and the experiment's syncer is over)."""
    if not has_config:
        return False, "no such experiment"
    if stop_all:
        return False, "the experiment has a stop marker (control/STOP): it is ending"
    base = [i for i in islands if not is_slot(i, prefix)]
    left = set(base) - set(done)
    if not left:
        return False, "every island of the experiment is done"
    return True, f"{len(left)} of its islands train"


# -- watching and leaving -----------------------------------------------------------------------
def watch_outcome(state: str, done: bool, now: float, closes_at: float) -> str | None:
    """What one look at a scavenged island decides (`state`: the backend's ResourceState value):

    - ``"finished"``: it wrote its done marker (its own limit, or the experiment ended);
    - ``"window closed"``: the window is over: it is asked to leave;
    - ``"reclaimed"``: the capacity was taken back (PREEMPTED or GONE: a spot / preemptible
      slice; SUCCEEDED without a done marker: a process that exited after SIGTERM, which is how
      a local or Kubernetes island is told to go). Not a failure: it is not relaunched;
    - None: nothing decided here (running, or a failure that the island wait's own rules
      handle: a crash is retried while the window is open, a stall stopped and retried).
    """
    if done:
        return "finished"
    if now >= closes_at:
        return "window closed"
    if state in ("PREEMPTED", "GONE", "SUCCEEDED"):
        return "reclaimed"
    return None


def leave_reason(outcome: str | None, done: bool, state: str, now: float, closes_at: float) -> str:
    """Why the island left, for its leave record: the wait's outcome when it ended with one,
    else what the store and the backend say now (a wait that failed is "failed")."""
    if outcome in LEAVE_REASONS:
        return outcome
    seen = watch_outcome(state, done, now, closes_at)
    return seen if seen is not None else "failed"


def needs_stop_wait(state: str, done: bool) -> bool:
    """Whether leaving waits for the done marker after the stop marker: only a running island
    can still write its last publish and checkpoint."""
    return not done and state == "RUNNING"


# -- records --------------------------------------------------------------------------------------
def join_record(
    island: str, backend: str, win: Mapping[str, float], run_id: str, at: float
) -> dict[str, Any]:
    """The ``metrics/scavenge`` record of a join."""
    return dict(
        event="join",
        island=island,
        backend=backend,
        opens_at=float(win["opens_at"]),
        closes_at=float(win["closes_at"]),
        run_id=run_id,
        at=float(at),
    )


def leave_record(
    island: str, reason: str, clean: bool, win: Mapping[str, float], run_id: str, at: float
) -> dict[str, Any]:
    """The ``metrics/scavenge`` record of a leave (`clean`: its done marker was written)."""
    if reason not in LEAVE_REASONS:
        raise ValueError(f"unknown leave reason {reason!r}")
    return dict(
        event="leave",
        island=island,
        reason=reason,
        clean=bool(clean),
        opens_at=float(win["opens_at"]),
        closes_at=float(win["closes_at"]),
        run_id=run_id,
        at=float(at),
    )


def scavenge_view(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """island -> ``{"state": "joined" | "left", "joined_at", "left_at", "reason", "clean",
    "closes_at", "windows"}`` from the ``metrics/scavenge`` records, oldest first (records are
    untrusted: anything without a string island and a known event is ignored)."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        island, event = r.get("island"), r.get("event")
        if not isinstance(island, str) or not NAME_PATTERN.match(island):
            continue
        if event == "join":
            prev = out.get(island, {})
            out[island] = dict(
                state="joined",
                joined_at=r.get("at"),
                left_at=None,
                reason=None,
                clean=None,
                closes_at=r.get("closes_at"),
                windows=int(prev.get("windows", 0)) + 1,
            )
        elif event == "leave" and island in out:
            out[island].update(
                state="left", left_at=r.get("at"), reason=r.get("reason"), clean=r.get("clean")
            )
    return out
