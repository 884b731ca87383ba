"""The Kubernetes manifests of an island on GKE TPU node pools, and their validation.

The backend that applies them is `gke.py`.

- :func:`build_pod` -- a single-host island: one Pod on one TPU VM node.
- :func:`build_jobset` -- a multi-host island: a JobSet (``jobset.x-k8s.io/v1alpha2``) with one
  replicated job of ``hosts`` pods (an Indexed Job), one per TPU VM of the slice.

Both select TPU nodes with ``cloud.google.com/gke-tpu-accelerator`` and
``cloud.google.com/gke-tpu-topology`` and ask for ``google.com/tpu: chips_per_host`` (requests equal
to limits). ``restartPolicy: Never`` and ``backoffLimit: 0`` / ``failurePolicy.maxRestarts: 0``:
Airflow retries islands, Kubernetes does not. ``activeDeadlineSeconds`` enforces the spec's TTL.
On GKE, ``jax.distributed.initialize()`` auto-detects the multi-host setup (GKE injects the TPU
worker hostnames and ids into JobSet / Indexed Job pods). A JobSet's pods also get
``DILOCO_PROCESS_ID`` (the pod's completion index) and ``DILOCO_COORDINATOR`` (pod 0's JobSet
DNS name, port 8476), the defaults of ``diloco island``'s multi-host flags; with
``hardware["coordinator_flags"] = True`` the container command also passes them as
``--coordinator $(DILOCO_COORDINATOR) --num-processes $(DILOCO_NUM_PROCESSES) --process-id
$(DILOCO_PROCESS_ID)`` (Kubernetes expands ``$(VAR)`` from the container's env).

:func:`validate_k8s` checks a manifest against the ``kubernetes`` client's models: unknown fields
(at any depth) and wrong types or missing required fields are errors. JobSet is a CRD the client
has no model for: its outer part is checked by hand and its job template against
``V1JobTemplateSpec``.
"""

from __future__ import annotations

import re
from typing import Any

from training.config.hardware import gke_tpu_slice

from .base import IslandSpec, resource_id
from .common import island_env

JOBSET_GROUP = "jobset.x-k8s.io"
JOBSET_VERSION = "v1alpha2"
JOBSET_PLURAL = "jobsets"
JOBSET_API_VERSION = f"{JOBSET_GROUP}/{JOBSET_VERSION}"
REPLICATED_JOB = "island"
CONTAINER = "island"
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
SPOT_LABEL = "cloud.google.com/gke-spot"
TPU_RESOURCE = "google.com/tpu"
NAME_MAX_LEN = 40  # JobSet pods are named <jobset>-<job>-<i>-<j>-<rand>: leave room
DEFAULT_NAMESPACE = "default"

_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


# ---------------------------------------------------------------------- slice shape
tpu_slice = (
    gke_tpu_slice  # the catalogue's rule (training.config.hardware), under its old name here
)


def k8s_name(spec: IslandSpec) -> str:
    """The Pod / JobSet name of an island (deterministic, short enough for JobSet pod names)."""
    return resource_id(spec.experiment, spec.island, spec.attempt_key, max_len=NAME_MAX_LEN)


def _ttl_seconds(spec: IslandSpec) -> int:
    return max(1, int(spec.ttl_hours * 3600))


def _metadata(spec: IslandSpec, name: str, namespace: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": {
            **spec.labels,
            "app.kubernetes.io/name": "diloco-island",
            "app.kubernetes.io/managed-by": "diloco-airflow",
        },
    }


COORDINATOR_PORT = 8476
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
COORDINATOR_FLAGS = [
    "--coordinator",
    "$(DILOCO_COORDINATOR)",
    "--num-processes",
    "$(DILOCO_NUM_PROCESSES)",
    "--process-id",
    "$(DILOCO_PROCESS_ID)",
]
"""`diloco island`'s multi-host flags, expanded by Kubernetes from the container's env."""


def _multi_host_env(name: str) -> list[dict[str, Any]]:
    """A JobSet pod's process id (its completion index) and the coordinator (pod 0's DNS
    name: ``<jobset>-<replicated job>-<job index>-<pod index>.<jobset>``)."""
    return [
        {
            "name": "DILOCO_COORDINATOR",
            "value": f"{name}-{REPLICATED_JOB}-0-0.{name}:{COORDINATOR_PORT}",
        },
        {"name": "DILOCO_PROCESS_ID", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
    ]


def _pod_spec(spec: IslandSpec, shape: dict[str, Any], jobset: str | None = None) -> dict[str, Any]:
    """The pod of an island; `jobset`: the JobSet's name, for a pod of a multi-host slice."""
    hw = spec.hardware
    image = hw.get("image")
    if not image or not isinstance(image, str):
        raise ValueError("gke hardware needs an 'image' (a container image with the project)")
    env = island_env(spec, shape["hosts"])
    env_list = [{"name": k, "value": v} for k, v in sorted(env.items())]
    command = list(spec.command)
    if jobset is not None and shape["hosts"] > 1:
        env_list += _multi_host_env(jobset)
        if hw.get("coordinator_flags"):
            command += COORDINATOR_FLAGS
    chips = str(shape["chips_per_host"])
    node_selector = {
        ACCELERATOR_LABEL: shape["accelerator"],
        TOPOLOGY_LABEL: shape["topology"],
    }
    if hw.get("spot"):
        node_selector[SPOT_LABEL] = "true"
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "command": command,
        "env": env_list,
        "ports": [
            {"containerPort": 8471, "name": "tpu-ici"},  # TPU runtime
            {"containerPort": 8476, "name": "jax-coord"},  # jax.distributed coordinator
        ],
        "resources": {"limits": {TPU_RESOURCE: chips}, "requests": {TPU_RESOURCE: chips}},
    }
    if hw.get("image_pull_policy"):
        container["imagePullPolicy"] = hw["image_pull_policy"]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": _ttl_seconds(spec),
        "terminationGracePeriodSeconds": int(hw.get("termination_grace_s", 30)),
        "nodeSelector": node_selector,
        "tolerations": [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [container],
    }
    if hw.get("service_account"):
        pod_spec["serviceAccountName"] = hw["service_account"]
    return pod_spec


def build_pod(spec: IslandSpec) -> dict[str, Any]:
    """A single-host island as a Pod manifest (raises ValueError for a multi-host shape)."""
    shape = tpu_slice(spec.hardware)
    if shape["hosts"] != 1:
        raise ValueError(
            f"{shape['accelerator']} {shape['topology']} is {shape['hosts']} hosts: "
            "use build_jobset for multi-host slices"
        )
    namespace = spec.hardware.get("namespace") or DEFAULT_NAMESPACE
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _metadata(spec, k8s_name(spec), namespace),
        "spec": _pod_spec(spec, shape),
    }


def build_jobset(spec: IslandSpec) -> dict[str, Any]:
    """An island as a JobSet: one replicated job of ``hosts`` pods (Indexed, no retries)."""
    shape = tpu_slice(spec.hardware)
    hosts = shape["hosts"]
    namespace = spec.hardware.get("namespace") or DEFAULT_NAMESPACE
    metadata = _metadata(spec, k8s_name(spec), namespace)
    metadata["annotations"] = {
        # one island per node pool: all pods of the slice land on the same TPU slice
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
    }
    pod_labels = dict(metadata["labels"])
    return {
        "apiVersion": JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "failurePolicy": {"maxRestarts": 0},
            "ttlSecondsAfterFinished": int(spec.hardware.get("ttl_after_finished_s", 3600)),
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": 1,
                    "template": {
                        "metadata": {"labels": pod_labels},
                        "spec": {
                            "parallelism": hosts,
                            "completions": hosts,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,
                            "activeDeadlineSeconds": _ttl_seconds(spec),
                            "template": {
                                "metadata": {"labels": pod_labels},
                                "spec": _pod_spec(spec, shape, metadata["name"]),
                            },
                        },
                    },
                }
            ],
        },
    }


# ---------------------------------------------------------------------- validation
def _model(name: str):
    import kubernetes.client.models as models

    cls = getattr(models, name, None)
    if cls is None or not hasattr(cls, "attribute_map"):
        return None
    return cls


def _walk(data: Any, type_str: str, path: str, errors: list[str]) -> None:
    type_str = type_str.strip()
    m = re.match(r"^Optional\[(.*)\]$", type_str)
    if m:
        if data is not None:
            _walk(data, m.group(1), path, errors)
        return
    m = re.match(r"^(?:List\[(.*)\]|list\[(.*)\])$", type_str)
    if m:
        if not isinstance(data, list):
            errors.append(f"{path}: expected a list, got {type(data).__name__}")
            return
        for i, item in enumerate(data):
            _walk(item, m.group(1) or m.group(2), f"{path}[{i}]", errors)
        return
    m = re.match(r"^(?:Dict\[([^,]*), (.*)\]|dict\(([^,]*), (.*)\))$", type_str)
    if m:
        if not isinstance(data, dict):
            errors.append(f"{path}: expected a mapping, got {type(data).__name__}")
            return
        value_type = m.group(2) or m.group(4)
        for key, value in data.items():
            if not isinstance(key, str):
                errors.append(f"{path}: key {key!r} is not a string")
            _walk(value, value_type, f"{path}.{key}", errors)
        return
    cls = _model(type_str)
    if cls is None:
        return  # a primitive: the model's own (strict) validation checks it
    if not isinstance(data, dict):
        errors.append(f"{path}: expected an object ({type_str}), got {type(data).__name__}")
        return
    json_to_attr = {json_name: attr for attr, json_name in cls.attribute_map.items()}
    for key, value in data.items():
        attr = json_to_attr.get(key)
        if attr is None:
            errors.append(f"{path}.{key}: unknown field of {type_str}")
            continue
        _walk(value, cls.openapi_types[attr], f"{path}.{key}", errors)


def validate_k8s(data: dict, kind: str, path: str = "") -> None:
    """Check a manifest (plain dict) against the ``kubernetes`` client model ``kind``.

    Raises ValueError listing every unknown field (recursively, by the model's ``attribute_map``)
    or, after that, the model's own complaint about types and required fields.
    """
    errors: list[str] = []
    _walk(data, kind, path or kind, errors)
    if errors:
        raise ValueError("invalid " + kind + ":\n  " + "\n  ".join(errors))
    from kubernetes.client import ApiClient

    try:
        ApiClient()._ApiClient__deserialize(data, kind)
    except Exception as exc:  # pydantic ValidationError / ValueError / TypeError
        raise ValueError(f"invalid {kind} at {path or kind}: {exc}") from exc


_JOBSET_SPEC_FIELDS = {
    "replicatedJobs",
    "network",
    "successPolicy",
    "failurePolicy",
    "startupPolicy",
    "suspend",
    "coordinator",
    "managedBy",
    "ttlSecondsAfterFinished",
}
_REPLICATED_JOB_FIELDS = {"name", "replicas", "template", "dependsOn", "groupName"}


def _check_int(value: Any, where: str, minimum: int = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{where} must be an integer >= {minimum}, got {value!r}")


def validate_jobset(data: dict) -> None:
    """Check a JobSet manifest: the CRD's outer part by hand, each job template by the model."""
    if data.get("apiVersion") != JOBSET_API_VERSION:
        raise ValueError(f"JobSet apiVersion must be {JOBSET_API_VERSION!r}")
    if data.get("kind") != "JobSet":
        raise ValueError("kind must be 'JobSet'")
    unknown = set(data) - {"apiVersion", "kind", "metadata", "spec", "status"}
    if unknown:
        raise ValueError(f"unknown JobSet fields: {sorted(unknown)}")
    metadata = data.get("metadata")
    if not isinstance(metadata, dict):
        raise ValueError("JobSet.metadata must be an object")
    validate_k8s(metadata, "V1ObjectMeta", "JobSet.metadata")
    name = metadata.get("name", "")
    if not _DNS_LABEL_RE.match(name) or len(name) > NAME_MAX_LEN + 10:
        raise ValueError(f"JobSet name {name!r} must be a short DNS-1123 label")
    spec = data.get("spec")
    if not isinstance(spec, dict):
        raise ValueError("JobSet.spec must be an object")
    unknown = set(spec) - _JOBSET_SPEC_FIELDS
    if unknown:
        raise ValueError(f"unknown JobSet.spec fields: {sorted(unknown)}")
    if "ttlSecondsAfterFinished" in spec:
        _check_int(spec["ttlSecondsAfterFinished"], "JobSet.spec.ttlSecondsAfterFinished")
    failure = spec.get("failurePolicy", {})
    if not isinstance(failure, dict) or set(failure) - {"maxRestarts", "rules", "restartStrategy"}:
        raise ValueError(f"JobSet.spec.failurePolicy is malformed: {failure!r}")
    if "maxRestarts" in failure:
        _check_int(failure["maxRestarts"], "JobSet.spec.failurePolicy.maxRestarts")
    network = spec.get("network", {})
    if not isinstance(network, dict) or set(network) - {
        "enableDNSHostnames",
        "subdomain",
        "publishNotReadyAddresses",
    }:
        raise ValueError(f"JobSet.spec.network is malformed: {network!r}")
    jobs = spec.get("replicatedJobs")
    if not isinstance(jobs, list) or not jobs:
        raise ValueError("JobSet.spec.replicatedJobs must be a non-empty list")
    seen = set()
    for i, job in enumerate(jobs):
        where = f"JobSet.spec.replicatedJobs[{i}]"
        if not isinstance(job, dict):
            raise ValueError(f"{where} must be an object")
        unknown = set(job) - _REPLICATED_JOB_FIELDS
        if unknown:
            raise ValueError(f"unknown {where} fields: {sorted(unknown)}")
        job_name = job.get("name")
        if not isinstance(job_name, str) or not _DNS_LABEL_RE.match(job_name):
            raise ValueError(f"{where}.name must be a DNS-1123 label, got {job_name!r}")
        if job_name in seen:
            raise ValueError(f"{where}.name {job_name!r} is repeated")
        seen.add(job_name)
        _check_int(job.get("replicas", 1), f"{where}.replicas", 1)
        template = job.get("template")
        if not isinstance(template, dict) or not isinstance(template.get("spec"), dict):
            raise ValueError(f"{where}.template.spec is required")
        validate_k8s(template, "V1JobTemplateSpec", f"{where}.template")
        pod_template = template["spec"].get("template")
        if not isinstance(pod_template, dict) or not isinstance(pod_template.get("spec"), dict):
            raise ValueError(f"{where}.template.spec.template.spec (the pod spec) is required")
        if pod_template["spec"].get("restartPolicy") not in ("Never", "OnFailure"):
            raise ValueError(f"{where}: a Job's pods need restartPolicy Never or OnFailure")


def validate_manifest(manifest: dict) -> None:
    """Validate a Pod or JobSet manifest built here."""
    if manifest.get("kind") == "JobSet":
        validate_jobset(manifest)
    elif manifest.get("kind") == "Pod" and manifest.get("apiVersion") == "v1":
        validate_k8s(manifest, "V1Pod")
    else:
        raise ValueError(
            f"not a v1 Pod or JobSet: {manifest.get('apiVersion')}/{manifest.get('kind')}"
        )


def build_manifest(spec: IslandSpec) -> dict[str, Any]:
    """Pod for a single-host slice, JobSet for multi-host (``hardware["kind"]`` overrides)."""
    kind = spec.hardware.get("kind", "auto")
    if kind not in ("auto", "pod", "jobset"):
        raise ValueError(f"gke hardware kind must be auto, pod or jobset, not {kind!r}")
    shape = tpu_slice(spec.hardware)
    if kind == "pod" or (kind == "auto" and shape["hosts"] == 1):
        manifest = build_pod(spec)
    else:
        manifest = build_jobset(spec)
    validate_manifest(manifest)
    return manifest
