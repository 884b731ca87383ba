"""What the cloud backends share: when an error is worth a retry, deleting and waiting for a
resource to go, and the environment an island process gets.

Standard library only (and `base`): the backends import their cloud clients themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .base import BackendError, IslandSpec

RETRYABLE_HTTP_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
"""HTTP statuses where trying again later can help (timeouts, conflicts, rate limits, servers)."""

RETRYABLE_WORDS = (
    "quota",
    "stockout",
    "capacity",
    "resource_exhausted",
    "exhausted",
    "exceeded",
    "insufficient",
    "try again",
)
"""Words of a cloud's message that mean "not now" (capacity, quota) rather than "never"."""


def says_retryable(text: str) -> bool:
    """Whether a cloud's message says that trying again later can help (`RETRYABLE_WORDS`)."""
    text = str(text).lower()
    return any(w in text for w in RETRYABLE_WORDS)


def wait_gone(
    exists: Callable[[], bool],
    what: str,
    *,
    timeout_s: float,
    poll_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Poll `exists()` every `poll_s` until it is False; after `timeout_s` raise a retryable
    BackendError saying that `what` is still being deleted."""
    deadline = clock() + timeout_s
    while exists():
        if clock() > deadline:
            raise BackendError(f"{what} is still being deleted", retryable=True)
        sleep(poll_s)


def island_env(spec: IslandSpec, hosts: int) -> dict[str, str]:
    """The environment of an island process: the spec's, then the island's identity
    (`diloco_airflow.knobs.ISLAND_ENV`; they win over the spec's)."""
    return {
        **dict(sorted(spec.env.items())),
        "DILOCO_EXPERIMENT": spec.experiment,
        "DILOCO_ISLAND": spec.island,
        "DILOCO_STORE_URL": spec.store_url,
        "DILOCO_NUM_PROCESSES": str(hosts),
    }
