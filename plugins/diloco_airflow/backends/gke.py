"""Islands on GKE TPU node pools: the backend that applies an island's manifest
(`k8s_manifests.py`: a Pod for a single-host slice, a JobSet for a multi-host one), and the island
state of a Pod or JobSet read back (`pod_status`, `jobset_status`).
"""

from __future__ import annotations

import re
import time
from typing import Any

from training.config.hardware import GKE_TPU_ACCELERATORS

from .base import BackendError, BackendStatus, IslandBackend, IslandSpec, ResourceState
from .common import RETRYABLE_HTTP_STATUS, says_retryable, wait_gone
from .k8s_manifests import (
    ACCELERATOR_LABEL,
    JOBSET_GROUP,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    TOPOLOGY_LABEL,
    build_jobset,
    build_manifest,
    build_pod,
    k8s_name,
    tpu_slice,
    validate_jobset,
    validate_k8s,
    validate_manifest,
)

__all__ = [
    "ACCELERATOR_LABEL",
    "GKE_TPU_ACCELERATORS",
    "TOPOLOGY_LABEL",
    "GkeBackend",
    "build_jobset",
    "build_manifest",
    "build_pod",
    "jobset_status",
    "k8s_name",
    "pod_status",
    "tpu_slice",
    "validate_jobset",
    "validate_k8s",
    "validate_manifest",
]


# ---------------------------------------------------------------------- the backend
def _api_status(exc: BaseException) -> int | None:
    return getattr(exc, "status", None)


def _k8s_error(exc: BaseException, what: str) -> BackendError:
    status = _api_status(exc)
    reason = getattr(exc, "reason", "") or ""
    body = getattr(exc, "body", "") or ""
    message = f"{what}: {status} {reason} {body}".strip() if status else f"{what}: {exc}"
    retryable = (
        status is None or status in RETRYABLE_HTTP_STATUS or says_retryable(f"{reason} {body}")
    )
    return BackendError(message, retryable=retryable)


class GkeBackend(IslandBackend):
    """Islands as Pods / JobSets on a GKE cluster with TPU node pools.

    The TPU node pools are managed outside (or by GKE node auto-provisioning, from the node
    selectors): ``provision`` only validates the manifest and returns the handle; ``launch``
    creates the Pod or JobSet (replacing one an earlier try left); ``status`` reads it back;
    ``teardown`` deletes it (foreground propagation, so its pods go with it).

    Args:
        namespace: default namespace (``hardware["namespace"]`` wins).
        api_client: a ready ``kubernetes.client.ApiClient``; otherwise in-cluster config, then
            the kubeconfig (``kubeconfig`` / ``context``), loaded on first use.
        core_api / custom_api: ready ``CoreV1Api`` / ``CustomObjectsApi`` (tests).
    """

    name = "gke"

    def __init__(
        self,
        namespace: str | None = None,
        *,
        api_client: Any = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        core_api: Any = None,
        custom_api: Any = None,
        delete_timeout_s: float = 300.0,
        poll_s: float = 2.0,
    ) -> None:
        self.namespace = namespace
        self._api_client = api_client
        self._kubeconfig = kubeconfig
        self._context = context
        self._core = core_api
        self._custom = custom_api
        self.delete_timeout_s = float(delete_timeout_s)
        self.poll_s = float(poll_s)

    # ------------------------------------------------------------------ plumbing
    def _client(self) -> Any:
        if self._api_client is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config(config_file=self._kubeconfig, context=self._context)
            self._api_client = client.ApiClient()
        return self._api_client

    @property
    def core(self) -> Any:
        if self._core is None:
            from kubernetes import client

            self._core = client.CoreV1Api(self._client())
        return self._core

    @property
    def custom(self) -> Any:
        if self._custom is None:
            from kubernetes import client

            self._custom = client.CustomObjectsApi(self._client())
        return self._custom

    def _spec_with_namespace(self, spec: IslandSpec) -> IslandSpec:
        if spec.hardware.get("namespace") or not self.namespace:
            return spec
        data = spec.to_dict()
        data["hardware"] = {**spec.hardware, "namespace": self.namespace}
        return IslandSpec.from_dict(data)

    def _handle(self, spec: IslandSpec, handle: dict | None = None) -> dict[str, Any]:
        if handle and handle.get("name") and handle.get("kind"):
            return handle
        try:
            manifest = build_manifest(self._spec_with_namespace(spec))
        except ValueError as exc:
            raise BackendError(str(exc), retryable=False) from exc
        return {
            "backend": self.name,
            "kind": manifest["kind"],
            "name": manifest["metadata"]["name"],
            "namespace": manifest["metadata"]["namespace"],
            "resource_id": spec.resource_id,
        }

    def _read(self, h: dict) -> Any:
        """The live object (a V1Pod or a JobSet dict), None if it does not exist."""
        try:
            if h["kind"] == "Pod":
                return self.core.read_namespaced_pod(name=h["name"], namespace=h["namespace"])
            return self.custom.get_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, h["namespace"], JOBSET_PLURAL, h["name"]
            )
        except Exception as exc:
            if _api_status(exc) == 404:
                return None
            raise _k8s_error(exc, f"read {h['kind']} {h['namespace']}/{h['name']}") from exc

    def _delete(self, h: dict, wait: bool) -> None:
        try:
            if h["kind"] == "Pod":
                self.core.delete_namespaced_pod(
                    name=h["name"], namespace=h["namespace"], propagation_policy="Foreground"
                )
            else:
                self.custom.delete_namespaced_custom_object(
                    JOBSET_GROUP,
                    JOBSET_VERSION,
                    h["namespace"],
                    JOBSET_PLURAL,
                    h["name"],
                    propagation_policy="Foreground",
                )
        except Exception as exc:
            if _api_status(exc) != 404:
                raise _k8s_error(exc, f"delete {h['kind']} {h['namespace']}/{h['name']}") from exc
        if wait:
            wait_gone(
                lambda: self._read(h) is not None,
                f"{h['kind']} {h['name']}",
                timeout_s=self.delete_timeout_s,
                poll_s=self.poll_s,
            )

    def _create(self, h: dict, manifest: dict) -> Any:
        if h["kind"] == "Pod":
            return self.core.create_namespaced_pod(namespace=h["namespace"], body=manifest)
        return self.custom.create_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, h["namespace"], JOBSET_PLURAL, manifest
        )

    # ------------------------------------------------------------------ interface
    def provision(self, spec: IslandSpec) -> dict:
        return self._handle(spec)

    def launch(self, spec: IslandSpec, handle: dict) -> dict:
        spec = self._spec_with_namespace(spec)
        h = dict(self._handle(spec, handle))
        manifest = build_manifest(spec)
        try:
            self._create(h, manifest)
        except Exception as exc:
            if _api_status(exc) != 409:
                raise _k8s_error(exc, f"create {h['kind']} {h['namespace']}/{h['name']}") from exc
            # an earlier try's copy: never run two, replace it
            self._delete(h, wait=True)
            try:
                self._create(h, manifest)
            except Exception as exc2:
                raise _k8s_error(exc2, f"create {h['kind']} {h['name']}") from exc2
        h["launched_at"] = time.time()
        return h

    def status(self, spec: IslandSpec, handle: dict) -> BackendStatus:
        h = self._handle(spec, handle)
        obj = self._read(h)
        if obj is None:
            return BackendStatus(ResourceState.GONE, f"{h['kind']} {h['name']} not found")
        if h["kind"] == "Pod":
            return pod_status(obj)
        return jobset_status(obj)

    def teardown(self, spec: IslandSpec, handle: dict) -> None:
        try:
            h = self._handle(spec, handle)
        except BackendError:
            return  # an invalid spec never created anything
        self._delete(h, wait=False)


def _get(obj: Any, *path: str) -> Any:
    """Walk attributes (client models) or keys (dicts), None when missing."""
    for key in path:
        if obj is None:
            return None
        if isinstance(obj, dict):
            camel = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), key)
            obj = obj.get(key, obj.get(camel))
        else:
            obj = getattr(obj, key, None)
    return obj


_PREEMPTION_REASONS = ("preempt", "evict", "nodeshutdown", "terminated", "disruption", "shutdown")


def pod_status(pod: Any) -> BackendStatus:
    """Island state of a Pod (client model or dict)."""
    phase = _get(pod, "status", "phase") or "Pending"
    reason = _get(pod, "status", "reason") or ""
    message = _get(pod, "status", "message") or ""
    conditions = _get(pod, "status", "conditions") or []
    disrupted = [
        c
        for c in conditions
        if _get(c, "type") == "DisruptionTarget" and str(_get(c, "status")) == "True"
    ]
    if phase == "Pending":
        unschedulable = [c for c in conditions if _get(c, "reason") == "Unschedulable"]
        text = _get(unschedulable[0], "message") if unschedulable else "pod Pending"
        return BackendStatus(ResourceState.PROVISIONING, text or "pod Pending")
    if phase == "Running":
        return BackendStatus(ResourceState.RUNNING, "pod Running")
    if phase == "Succeeded":
        return BackendStatus(ResourceState.SUCCEEDED, "pod Succeeded")
    if disrupted or any(w in reason.lower() for w in _PREEMPTION_REASONS):
        why = _get(disrupted[0], "message") if disrupted else f"{reason}: {message}"
        return BackendStatus(ResourceState.PREEMPTED, f"pod preempted: {why}")
    for cs in _get(pod, "status", "container_statuses") or []:
        term = _get(cs, "state", "terminated")
        if term is not None:
            code = _get(term, "exit_code")
            text = _get(term, "message") or _get(term, "reason") or ""
            message = f"exit code {code}: {text}".strip().rstrip(":")
            break
    if reason == "DeadlineExceeded":
        return BackendStatus(
            ResourceState.FAILED, f"pod passed its TTL: {message}", retryable=False
        )
    return BackendStatus(ResourceState.FAILED, f"pod {phase}: {reason} {message}".strip())


def jobset_status(jobset: dict) -> BackendStatus:
    """Island state of a JobSet (the custom object dict)."""
    conditions = {c.get("type"): c for c in (jobset.get("status") or {}).get("conditions") or []}

    def on(kind: str) -> dict | None:
        c = conditions.get(kind)
        return c if c and str(c.get("status")) == "True" else None

    if on("Completed"):
        return BackendStatus(ResourceState.SUCCEEDED, on("Completed").get("message") or "Completed")
    if on("Failed"):
        c = on("Failed")
        text = f"{c.get('reason', '')}: {c.get('message', '')}".strip(": ")
        if any(w in text.lower() for w in _PREEMPTION_REASONS):
            return BackendStatus(ResourceState.PREEMPTED, f"JobSet failed: {text}")
        return BackendStatus(ResourceState.FAILED, f"JobSet failed: {text}")
    if on("Suspended"):
        return BackendStatus(ResourceState.PENDING, "JobSet suspended")
    jobs = (jobset.get("status") or {}).get("replicatedJobsStatus") or []
    # "ready": child jobs whose pods are all ready (or done); "active": jobs not finished yet,
    # which includes pods still waiting for TPU nodes
    if any((j.get("ready") or 0) > 0 for j in jobs):
        return BackendStatus(ResourceState.RUNNING, "JobSet running")
    return BackendStatus(ResourceState.PROVISIONING, "JobSet waiting for its pods to be ready")
