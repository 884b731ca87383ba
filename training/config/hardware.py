"""The hardware catalogue: what an island's ``hardware`` settings say about its TPU slice.

One place for TPU knowledge, read by the goodput accounting (chips per island), the TPU VM backend
(hosts per accelerator type) and the GKE backend (accelerators, topologies, chips per node):

- Cloud TPU VM accelerator types ``<family>-<size>`` (``v4-32``, ``v5p-64``, ``v5litepod-16``,
  ``v6e-8``): for v5litepod / v5e / v6e the size counts chips (up to 8 on one host, 4 chips per
  host beyond); for v2 / v3 / v4 / v5p it counts TensorCores (2 per chip, 8 per host).
- GKE TPU accelerators (node label ``cloud.google.com/gke-tpu-accelerator``) with their topology
  dimensions (``2x2x1`` or ``2x4``) and the chip counts one TPU VM node can have.

Pure functions, standard library only.
"""

from __future__ import annotations

import math
import re
from typing import Any

TPU_VM_TYPE_RE = re.compile(r"^(v\d+[a-z]*|v5litepod)-(\d+)$")
"""A Cloud TPU VM accelerator type: family, size."""

CHIP_SIZED_FAMILIES = ("v5litepod", "v5e", "v6e")
"""Families whose accelerator-type size counts chips (the others count TensorCores)."""

TOPOLOGY_RE = re.compile(r"^[1-9]\d*(x[1-9]\d*)+$")
"""A slice topology, e.g. ``2x4`` or ``2x2x1``."""

GKE_TPU_ACCELERATORS: dict[str, dict[str, Any]] = {
    "tpu-v4-podslice": {"dims": 3, "chips_per_host": (4,)},
    "tpu-v5p-slice": {"dims": 3, "chips_per_host": (4,)},
    "tpu-v5-lite-podslice": {"dims": 2, "chips_per_host": (1, 4, 8)},
    "tpu-v5-lite-device": {"dims": 2, "chips_per_host": (1, 4, 8), "single_host_only": True},
    "tpu-v6e-slice": {"dims": 2, "chips_per_host": (1, 4, 8)},
}
"""GKE TPU accelerators: topology dimensions and the chips one TPU VM node can have."""


def parse_tpu_vm_type(accelerator_type: str) -> tuple[str, int] | None:
    """``("v4", 32)`` for ``v4-32``; None when it is not an accelerator type."""
    m = TPU_VM_TYPE_RE.match(accelerator_type or "")
    return (m.group(1), int(m.group(2))) if m else None


def tpu_hosts(accelerator_type: str) -> int:
    """Number of TPU VM hosts of an accelerator type (``v4-32`` -> 4, ``v5litepod-16`` -> 4).

    Raises ValueError for a string that is not an accelerator type."""
    parsed = parse_tpu_vm_type(accelerator_type)
    if parsed is None:
        raise ValueError(
            f"cannot tell the host count of accelerator type {accelerator_type!r}; "
            "expected e.g. v4-8, v5p-64, v5litepod-16, v6e-8, or give hardware['hosts']"
        )
    family, size = parsed
    if family in CHIP_SIZED_FAMILIES:
        return 1 if size <= 8 else size // 4  # size counts chips; 4 chips per host past 8
    return max(1, size // 8)  # v2, v3, v4, v5p: size counts TensorCores, 8 per host


def tpu_vm_chips(accelerator_type: str) -> int | None:
    """Chips of an accelerator type (``v6e-8`` -> 8, ``v4-32`` -> 16); None when not one."""
    parsed = parse_tpu_vm_type(accelerator_type)
    if parsed is None:
        return None
    family, size = parsed
    return size if family in CHIP_SIZED_FAMILIES else max(1, size // 2)


def topology_chips(topology: str) -> int | None:
    """Chips of a topology (``2x4`` -> 8); None when it is not a topology."""
    if not TOPOLOGY_RE.match(topology or ""):
        return None
    return math.prod(int(d) for d in topology.split("x"))


def chips_of_hardware(hw: dict[str, Any] | None) -> int:
    """Chips of an island from its hardware settings; 1 when they do not say.

    ``hw["chips"]`` if given; a GKE ``topology`` ("2x4" -> 8); a TPU VM ``accelerator_type``.
    """
    hw = hw or {}
    if isinstance(hw.get("chips"), int) and hw["chips"] > 0:
        return hw["chips"]
    chips = topology_chips(str(hw.get("topology") or ""))
    if chips is not None:
        return chips
    chips = tpu_vm_chips(str(hw.get("accelerator_type") or ""))
    return 1 if chips is None else chips


def gke_tpu_slice(hardware: dict) -> dict[str, Any]:
    """Validate a GKE TPU request; return ``{accelerator, topology, chips, chips_per_host, hosts}``.

    Raises ValueError, saying what is wrong and what would be valid, for an unknown accelerator,
    a topology of the wrong shape, or chips_per_host / hosts that do not fit the topology.
    """
    accelerator = hardware.get("accelerator")
    if accelerator not in GKE_TPU_ACCELERATORS:
        raise ValueError(
            f"unknown GKE TPU accelerator {accelerator!r}; expected one of "
            f"{sorted(GKE_TPU_ACCELERATORS)}"
        )
    info = GKE_TPU_ACCELERATORS[accelerator]
    topology = str(hardware.get("topology") or "")
    dims = info["dims"]
    chips = topology_chips(topology)
    if chips is None or len(topology.split("x")) != dims:
        example = "2x2x1" if dims == 3 else "2x4"
        raise ValueError(
            f"topology {topology!r} does not fit {accelerator}: it needs {dims} dimensions "
            f"like {example!r}"
        )
    allowed = info["chips_per_host"]
    chips_per_host = hardware.get("chips_per_host")
    if chips_per_host is None:
        chips_per_host = chips if chips in allowed else max(c for c in allowed if c <= 4)
    chips_per_host = int(chips_per_host)
    if chips_per_host not in allowed:
        raise ValueError(
            f"chips_per_host={chips_per_host} is not possible on {accelerator}; "
            f"its nodes have {list(allowed)} chips"
        )
    if chips < chips_per_host or chips % chips_per_host:
        raise ValueError(
            f"topology {topology} ({chips} chips) of {accelerator} cannot be split into hosts "
            f"of {chips_per_host} chips"
        )
    hosts = chips // chips_per_host
    if hosts > 1 and chips_per_host != 4:
        raise ValueError(
            f"topology {topology} ({chips} chips) of {accelerator} is multi-host, and multi-host "
            f"slices have 4 chips per host, not {chips_per_host}"
        )
    if hosts > 1 and info.get("single_host_only"):
        raise ValueError(
            f"{accelerator} is single-host only; topology {topology} needs {hosts} hosts"
        )
    given = hardware.get("hosts")
    if given is not None and int(given) != hosts:
        raise ValueError(
            f"topology {topology} of {accelerator} with {chips_per_host} chips per host is "
            f"{hosts} host(s), not hosts={given}"
        )
    return {
        "accelerator": accelerator,
        "topology": topology,
        "chips": chips,
        "chips_per_host": chips_per_host,
        "hosts": hosts,
    }
