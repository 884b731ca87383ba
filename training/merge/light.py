"""Light or full: how a merge writes its new fragment version (docs/STORE.md, "Light
versions"). Pure functions: the merger gathers the facts (the version's number, the fragment's
tokens merged, the last drain, control/STOP, the full ancestor's age) and writes what `plan`
says.

A light version leaves out the outer state and the broadcast shadow (and, under update
broadcast, its params); every `syncer.full_every`-th version is full, and so is every version of
a run's end. With `syncer.full_in_background` a periodic full version is written light by the
merge and promoted beside it in the background (training/merge/promote.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from training.config.experiment import ExperimentConfig


class VersionPlan(NamedTuple):
    """How the merge writes its new version."""

    light: bool  # without outer state and shadow (its full ancestor named)
    background: bool  # a due full version, written light now and promoted in the background
    params_kept: bool  # the params written (else their checksum only: an update carries them)


def ending(cfg: ExperimentConfig, tokens: int, last_drain: bool, stopped: bool) -> bool:
    """Whether this merge is one of a run's end: the syncer's last drain, control/STOP, or the
    fragment's `tokens` merged at the token budget (the merge that reaches it and every one
    after it)."""
    return last_drain or stopped or tokens >= cfg.token_budget


def full_due(
    cfg: ExperimentConfig,
    version: int,
    tokens: int,
    last_drain: bool,
    stopped: bool,
    full_age_s: Callable[[], float],
) -> bool:
    """Whether the new `version` is written full: always with syncer.full_every = 1; else every
    full_every-th version, once full_every_s passed since the full ancestor was written
    (`full_age_s`, asked only then), in the syncer's last drain, once control/STOP exists, and
    once the fragment's `tokens` merged reach the token budget."""
    every, every_s = cfg.syncer.full_every, cfg.syncer.full_every_s
    if every == 1 or version % every == 0 or last_drain:
        return True
    if tokens >= cfg.token_budget:
        return True
    if every_s > 0 and full_age_s() >= every_s:
        return True
    return stopped


def full_later(cfg: ExperimentConfig, tokens: int, last_drain: bool, stopped: bool) -> bool:
    """Whether a due full version is written in the background (syncer.full_in_background,
    full_every > 1), not by the merge: never for the run's ending merges (`ending`)."""
    syncer = cfg.syncer
    return (
        syncer.full_in_background
        and syncer.full_every > 1
        and not ending(cfg, tokens, last_drain, stopped)
    )


def plan(
    cfg: ExperimentConfig,
    version: int,
    tokens: int,
    last_drain: bool,
    stopped: bool,
    full_age_s: Callable[[], float],
    update: bool,
) -> VersionPlan:
    """How the new `version` is written (`update`: it carries an update broadcast payload). A
    periodic full version goes light now and is promoted in the background (the ending ones
    are written full by the merge: a run ends on full versions). A light version with an update
    leaves its params out (their checksum recorded), unless stale votes read base versions'
    params (outer.anchor "now")."""
    due = full_due(cfg, version, tokens, last_drain, stopped, full_age_s)
    later = due and full_later(cfg, tokens, last_drain, stopped)
    light = not due or later
    kept = not light or not update or cfg.outer.anchor == "now"
    return VersionPlan(light, later, kept)
