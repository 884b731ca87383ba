"""Island backends: where and how an island (one independent training job) runs.

``get_backend("local" | "tpu_vm" | "gke", **kwargs)`` builds one; the cloud backends' modules
(and their client libraries) are imported only when asked for.
"""

from .base import (
    LABEL_EXPERIMENT,
    LABEL_ISLAND,
    LABEL_TTL,
    BackendError,
    BackendStatus,
    IslandBackend,
    IslandSpec,
    ResourceState,
    resource_id,
)
from .registry import BACKENDS, get_backend

__all__ = [
    "BACKENDS",
    "LABEL_EXPERIMENT",
    "LABEL_ISLAND",
    "LABEL_TTL",
    "BackendError",
    "BackendStatus",
    "IslandBackend",
    "IslandSpec",
    "ResourceState",
    "get_backend",
    "resource_id",
]
