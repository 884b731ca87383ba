"""The island backend interface: provision, launch, status, teardown.

An *island* is one independent training job (a TPU slice, a GPU host, a CPU process). Airflow
tasks drive it through an :class:`IslandBackend`; the backend only manages the infrastructure and
the process, never the training state (that lives in the store, so a retried island resumes).

Rules every backend follows:

- ``provision`` is idempotent: resource names are deterministic (:func:`resource_id`), so a retried
  task finds the resource it (or an earlier try) created instead of creating a second one.
- Handles are JSON-serializable dicts (they travel through XCom). XComs of a failed try are
  cleared on retry, so every method also accepts an empty handle and derives what it needs from
  the spec.
- ``teardown`` is always safe: on a resource that never existed or is already gone it does nothing.
- Errors from the cloud become :class:`BackendError` carrying the cloud's own message and whether a
  retry can help (quota, stockout: yes; a bad accelerator type: no).

This module imports nothing heavy (no jax, no cloud clients): it runs in Airflow workers and at
DAG parse time. The registry of backends by name is `registry.py`; the helpers the cloud backends
share are in `common.py`.
"""

from __future__ import annotations

import hashlib
import re
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from training.config.names import NAME_PATTERN

NAME_RE = NAME_PATTERN
"""Experiment and island names: `training.config.names`'s one rule."""

LABEL_EXPERIMENT = "diloco-experiment"
LABEL_ISLAND = "diloco-island"
LABEL_TTL = "diloco-ttl"

_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")


class ResourceState(StrEnum):
    """Where an island's resource (process, VM, pod) is in its life, as far as the infrastructure
    can tell (not the island's training state: that is `training.island.state.IslandState`)."""

    PENDING = "PENDING"  # nothing asked for yet / not launched
    PROVISIONING = "PROVISIONING"  # waiting for capacity, booting
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    PREEMPTED = "PREEMPTED"  # taken away by the platform (spot), the island can be retried
    GONE = "GONE"  # the resource does not exist (deleted, never created)

    @property
    def terminal(self) -> bool:
        return self in (
            ResourceState.SUCCEEDED,
            ResourceState.FAILED,
            ResourceState.PREEMPTED,
            ResourceState.GONE,
        )


def _check_name(kind: str, value: str) -> None:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise ValueError(f"{kind} name {value!r} must match {NAME_RE.pattern}")


HARDWARE_KEYS: dict[str, dict[str, str]] = {
    "local": {},
    "tpu_vm": {
        "accelerator_type": "required: e.g. v5litepod-8, v5p-64",
        "runtime_version": "required: the TPU VM image, e.g. v2-alpha-tpuv5-lite",
        "project": "GCP project (default: the backend's)",
        "zone": "e.g. us-west4-a (default: the backend's)",
        "spot": "true: a spot slice",
        "preemptible": "true: a preemptible slice (no guaranteed tier; scavenging)",
        "reserved": "true: use a reservation",
        "reservation_name": "that reservation",
        "valid_until_hours": "the queued resource expires after this",
        "network": "VPC network",
        "subnetwork": "subnetwork",
        "external_ips": "false: no external IPs",
        "service_account": "the nodes' service account email",
        "tags": "network tags",
        "labels": "extra cloud labels",
        "metadata": "extra node metadata",
        "hosts": "hosts of the slice (default: from accelerator_type)",
        "install": "a pip requirement spec the startup script installs first",
        "coordinator_flags": "true: pass --coordinator/--num-processes/--process-id",
        "workdir": "directory the island command runs in",
    },
    "gke": {
        "image": "required: a container image with the project",
        "accelerator": "GKE TPU accelerator, e.g. tpu-v5-lite-podslice",
        "topology": "e.g. 2x4",
        "chips_per_host": "chips per node (default: the accelerator's)",
        "hosts": "nodes of the slice (default: from the topology)",
        "namespace": "Kubernetes namespace",
        "kind": "auto | pod | jobset",
        "spot": "true: spot nodes",
        "service_account": "Kubernetes service account",
        "image_pull_policy": "the container's imagePullPolicy",
        "termination_grace_s": "seconds between SIGTERM and SIGKILL (default 30)",
        "ttl_after_finished_s": "a JobSet is deleted this long after it ends (default 3600)",
        "coordinator_flags": "true: also pass --coordinator/--num-processes/--process-id "
        "(every pod's environment already sets them)",
    },
}
"""The ``hardware`` keys each backend reads (what the trigger form's island field lists)."""


@dataclass(frozen=True)
class IslandSpec:
    """Everything a backend needs to run one island.

    ``hardware`` is backend-specific:

    - local: ``{}``
    - tpu_vm: ``{"project", "zone", "accelerator_type", "runtime_version", "spot": bool, "preemptible": bool,
      "network", "subnetwork", "service_account", "reserved": bool, "hosts", "install",
      "coordinator_flags": bool, "valid_until_hours"}``
    - gke: ``{"accelerator", "topology", "chips_per_host", "hosts", "image", "namespace",
      "kind": "auto" | "pod" | "jobset", "spot": bool, "service_account",
      "coordinator_flags": bool}``

    ``attempt_key`` is folded into the resource name (:func:`resource_id`); leave it empty (the
    default) so Airflow retries of the same island reuse the same name, or set it to e.g. a DAG run
    id so that separate runs never collide.
    """

    experiment: str
    island: str
    store_url: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    hardware: dict = field(default_factory=dict)
    ttl_hours: float = 24
    attempt_key: str = ""
    created_at: float = field(default_factory=time.time, compare=False)

    def __post_init__(self) -> None:
        _check_name("experiment", self.experiment)
        _check_name("island", self.island)
        if (
            not isinstance(self.command, list | tuple)
            or not self.command
            or not all(isinstance(a, str) for a in self.command)
        ):
            raise ValueError(f"command must be a non-empty list of strings, got {self.command!r}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ValueError("env must map str to str")
        if not self.ttl_hours > 0:
            raise ValueError(f"ttl_hours must be > 0, got {self.ttl_hours}")
        if self.attempt_key and not re.match(r"^[A-Za-z0-9._:+-]{1,200}$", self.attempt_key):
            raise ValueError(f"attempt_key {self.attempt_key!r} has unsupported characters")

    @property
    def deadline(self) -> int:
        """Unix time after which a leftover resource of this island may be deleted."""
        return int(self.created_at + self.ttl_hours * 3600)

    @property
    def labels(self) -> dict[str, str]:
        """Cloud labels (GCP / Kubernetes label value rules: lowercase, <= 63 chars)."""
        labels = {
            LABEL_EXPERIMENT: self.experiment,
            LABEL_ISLAND: self.island,
            LABEL_TTL: str(self.deadline),
        }
        for key, value in labels.items():
            if not _LABEL_VALUE_RE.match(value):  # pragma: no cover - names are pre-validated
                raise ValueError(f"label {key}={value!r} is not a valid label value")
        return labels

    @property
    def resource_id(self) -> str:
        return resource_id(self.experiment, self.island, self.attempt_key)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (for XCom / trigger kwargs)."""
        d = asdict(self)
        d["command"] = list(self.command)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IslandSpec:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown IslandSpec fields: {sorted(unknown)}")
        return cls(**data)


@dataclass
class BackendStatus:
    """A backend's view of an island. ``message`` carries the cloud's / process's own text."""

    state: ResourceState
    message: str = ""
    retryable: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state.value, "message": self.message, "retryable": self.retryable}


class BackendError(Exception):
    """A backend operation failed. ``retryable``: whether trying again later can help."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable

    def __reduce__(self):  # keep picklable with the keyword-only argument
        return (_rebuild_backend_error, (self.message, self.retryable))


def _rebuild_backend_error(message: str, retryable: bool) -> BackendError:
    return BackendError(message, retryable=retryable)


class IslandBackend(ABC):
    """Runs islands somewhere. Subclasses: ``local``, ``tpu_vm``, ``gke``."""

    name: str = ""

    @abstractmethod
    def provision(self, spec: IslandSpec) -> dict:
        """Make sure the resources for the island exist; return a JSON-serializable handle.

        Idempotent: a retry never creates a second resource.
        """

    @abstractmethod
    def launch(self, spec: IslandSpec, handle: dict) -> dict:
        """Start the island on the provisioned resource; return the (updated) handle."""

    @abstractmethod
    def status(self, spec: IslandSpec, handle: dict) -> BackendStatus:
        """Report the island's state. Works with an empty handle (derived from the spec)."""

    @abstractmethod
    def teardown(self, spec: IslandSpec, handle: dict) -> None:
        """Stop the island and release its resources. Idempotent, always safe."""


_ID_PREFIX = "dl"


def resource_id(experiment: str, island: str, attempt_key: str = "", *, max_len: int = 63) -> str:
    """A deterministic resource name for an island, stable across Airflow retries.

    ``dl-<experiment>-<island>[-<attempt_key>]-<hash8>``, shortened to ``max_len`` (keeping the
    hash) when too long. The hash covers the exact (experiment, island, attempt_key) triple, so
    names that would read the same after joining with ``-`` (``a-b``/``c`` vs ``a``/``b-c``) still
    differ. The result is a valid TPU node / queued resource id and Kubernetes DNS-1123 label:
    lowercase letters, digits and ``-``, starting with a letter, not ending with ``-``.
    """
    _check_name("experiment", experiment)
    _check_name("island", island)
    if max_len < 16:
        raise ValueError("max_len must be >= 16")
    digest = hashlib.sha256(f"{experiment}\0{island}\0{attempt_key}".encode()).hexdigest()[:8]
    parts = [_ID_PREFIX, experiment, island]
    if attempt_key:
        parts.append(attempt_key)
    readable = re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")
    room = max_len - len(digest) - 1
    readable = readable[:room].rstrip("-")
    return f"{readable}-{digest}"
