"""Islands on Cloud TPU VMs, through queued resources (``google-cloud-tpu``, ``tpu_v2``).

One island = one queued resource with one node (a TPU slice, single- or multi-host); both carry
the deterministic :func:`~.base.resource_id`, so a retried ``provision`` finds what an earlier try
created instead of creating a second slice.

The island process is started by the node's ``startup-script`` metadata (it runs on every host of
the slice at boot, and again after a reboot): no SSH, no extra launch step. The script installs
nothing from the internet unless the spec asks (``hardware["install"]`` or ``env["DILOCO_INSTALL"]``:
a pip requirement spec); it assumes the runtime image has the project. It runs the island command
under ``setsid nohup`` with the spec's environment, logging to ``/var/log/diloco-island.log``, and
when the command ends publishes its exit code (and the log's tail) as guest attributes
``diloco/exitcode`` and ``diloco/tail`` of that host, which :meth:`TpuVmBackend.status` reads to tell
SUCCEEDED from FAILED while the slice itself stays ACTIVE.

Multi-host slices (``v5p-64``, ``v4-32``, ``v5litepod-16``, ...): the same script runs on every
host. ``jax.distributed.initialize()`` with no arguments auto-detects the coordinator, the number
of processes and the process id on Cloud TPU (from the TPU metadata), so the island needs nothing
extra. For logs and tools the script still exports ``DILOCO_PROCESS_ID`` (the host's
``agent-worker-number``), ``DILOCO_NUM_PROCESSES`` and ``DILOCO_COORDINATOR`` (host 0's IP from
``worker-network-endpoints``, port 8476); with ``hardware["coordinator_flags"] = True`` it also
appends ``--coordinator ... --num-processes ... --process-id ...`` to the island command.

Queued-resource state -> island state: CREATING / ACCEPTED / WAITING_FOR_RESOURCES / PROVISIONING
-> PROVISIONING; ACTIVE -> RUNNING (or PREEMPTED if the node is, or SUCCEEDED / FAILED once every
host has published its exit code); FAILED -> FAILED with the cloud's message; SUSPENDING /
SUSPENDED -> PREEMPTED (spot); DELETING or not found -> GONE.

Length: just past 500 lines: the queued-resource lifecycle in one place (its startup script is
in tpu_startup.py, the shared retry rules in common.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import uuid
from typing import Any

from google.api_core import exceptions as gexc
from google.cloud import tpu_v2
from google.protobuf import duration_pb2

from diloco_airflow import knobs
from training.config.hardware import tpu_hosts

from .base import (
    LABEL_EXPERIMENT,
    LABEL_ISLAND,
    LABEL_TTL,
    BackendError,
    BackendStatus,
    IslandBackend,
    IslandSpec,
    ResourceState,
)
from .common import says_retryable, wait_gone
from .tpu_startup import GUEST_NAMESPACE, startup_script

__all__ = ["TpuVmBackend", "build_queued_resource", "map_error", "startup_script", "tpu_hosts"]

_REQUEST_NS = uuid.UUID("6f1c2b0e-3c55-4d0b-9a53-5f0f3c7f6a11")

_QR = tpu_v2.QueuedResourceState.State
_NODE = tpu_v2.Node.State

_PROVISIONING_STATES = {
    _QR.STATE_UNSPECIFIED,
    _QR.CREATING,
    _QR.ACCEPTED,
    _QR.WAITING_FOR_RESOURCES,
    _QR.PROVISIONING,
}
_STALE_STATES = {_QR.FAILED, _QR.SUSPENDING, _QR.SUSPENDED}

# error classes where trying again later can help (capacity, quota, transient server trouble)
_RETRYABLE_ERRORS: tuple[type[BaseException], ...] = (
    gexc.TooManyRequests,  # 429, includes ResourceExhausted
    gexc.ServiceUnavailable,
    gexc.InternalServerError,
    gexc.GatewayTimeout,
    gexc.DeadlineExceeded,
    gexc.Aborted,
    gexc.RetryError,
    concurrent.futures.TimeoutError,
    TimeoutError,
    ConnectionError,
)


def map_error(exc: BaseException, what: str) -> BackendError:
    """A cloud exception as a :class:`BackendError` carrying the cloud's own message."""
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    text = f"{what}: {type(exc).__name__}: {message}"
    retryable = isinstance(exc, _RETRYABLE_ERRORS) or says_retryable(message)
    return BackendError(text, retryable=retryable)


def build_queued_resource(spec: IslandSpec, *, project: str, zone: str) -> tpu_v2.QueuedResource:
    """The queued resource (one node) for an island."""
    hw = spec.hardware
    accelerator_type = hw.get("accelerator_type")
    runtime_version = hw.get("runtime_version")
    if not accelerator_type or not runtime_version:
        raise BackendError(
            "tpu_vm hardware needs 'accelerator_type' and 'runtime_version'", retryable=False
        )
    hosts = int(hw.get("hosts") or tpu_hosts(accelerator_type))
    parent = f"projects/{project}/locations/{zone}"
    metadata = {
        "startup-script": startup_script(spec, hosts),
        "enable-guest-attributes": "TRUE",
        "diloco-experiment": spec.experiment,
        "diloco-island": spec.island,
        "diloco-store-url": spec.store_url,
        "diloco-num-hosts": str(hosts),
    }
    metadata.update({str(k): str(v) for k, v in (hw.get("metadata") or {}).items()})
    node = tpu_v2.Node(
        accelerator_type=accelerator_type,
        runtime_version=runtime_version,
        labels={**(hw.get("labels") or {}), **spec.labels},
        metadata=metadata,
        description=f"diloco island {spec.experiment}/{spec.island}",
    )
    if hw.get("network") or hw.get("subnetwork") or "external_ips" in hw:
        node.network_config = tpu_v2.NetworkConfig(
            network=hw.get("network", ""),
            subnetwork=hw.get("subnetwork", ""),
            enable_external_ips=bool(hw.get("external_ips", True)),
        )
    if hw.get("service_account"):
        node.service_account = tpu_v2.ServiceAccount(
            email=hw["service_account"], scope=["https://www.googleapis.com/auth/cloud-platform"]
        )
    if hw.get("tags"):
        node.tags = list(hw["tags"])
    if hw.get("reserved") or hw.get("preemptible"):
        node.scheduling_config = tpu_v2.SchedulingConfig(
            reserved=bool(hw.get("reserved")), preemptible=bool(hw.get("preemptible"))
        )
    qr = tpu_v2.QueuedResource(
        tpu=tpu_v2.QueuedResource.Tpu(
            node_spec=[
                tpu_v2.QueuedResource.Tpu.NodeSpec(
                    parent=parent, node_id=spec.resource_id, node=node
                )
            ]
        )
    )
    if hw.get("spot"):
        qr.spot = tpu_v2.QueuedResource.Spot()
    elif not hw.get("preemptible"):  # preemptible: the node's scheduling, no guaranteed tier
        qr.guaranteed = tpu_v2.QueuedResource.Guaranteed()
    if hw.get("reservation_name"):
        qr.reservation_name = hw["reservation_name"]
    if hw.get("valid_until_hours"):
        qr.queueing_policy = tpu_v2.QueuedResource.QueueingPolicy(
            valid_until_duration=duration_pb2.Duration(
                seconds=int(float(hw["valid_until_hours"]) * 3600)
            )
        )
    return qr


def _labels_of(qr: tpu_v2.QueuedResource) -> dict[str, str]:
    labels: dict[str, str] = {}
    for node_spec in qr.tpu.node_spec:
        labels.update(dict(node_spec.node.labels))
    return labels


API_ENDPOINT_ENV = knobs.TPU_API_ENDPOINT.name


class TpuVmBackend(IslandBackend):
    """Cloud TPU queued resources.

    Args:
        project, zone: defaults for specs whose ``hardware`` does not name them.
        credentials: google-auth credentials (default: application default credentials, looked
            up when the first call is made, not at construction).
        transport: ``"grpc"`` (client default) or ``"rest"``.
        client_options / api_endpoint: e.g. ``api_endpoint="http://127.0.0.1:PORT"`` for a fake
            (or the environment variable ``DILOCO_TPU_API_ENDPOINT``, see ``API_ENDPOINT_ENV``).
        client: a ready ``tpu_v2.TpuClient`` (overrides the above).
        operation_timeout_s: how long to wait for a create / delete operation.
        poll_s: polling interval while waiting for a deleting queued resource to go.
        replace_stale: when ``provision`` finds the island's queued resource FAILED or SUSPENDED
            (left by an earlier try), delete it and create a fresh one (default) instead of
            returning a resource that will never run.
    """

    name = "tpu_vm"

    def __init__(
        self,
        project: str | None = None,
        zone: str | None = None,
        *,
        credentials: Any = None,
        transport: str | None = None,
        client_options: dict | None = None,
        api_endpoint: str | None = None,
        client: Any = None,
        operation_timeout_s: float = 600.0,
        poll_s: float = 10.0,
        replace_stale: bool = True,
    ) -> None:
        endpoint = knobs.TPU_API_ENDPOINT.get()
        if endpoint and not api_endpoint and client is None:  # a local fake of the TPU API
            api_endpoint, transport = endpoint, transport or "rest"
            if credentials is None:
                from google.auth.credentials import AnonymousCredentials

                credentials = AnonymousCredentials()
        self.project = project
        self.zone = zone
        self._credentials = credentials
        self._transport = transport
        self._client_options = dict(client_options or {})
        if api_endpoint:
            self._client_options["api_endpoint"] = api_endpoint
        self._client = client
        self.operation_timeout_s = float(operation_timeout_s)
        self.poll_s = float(poll_s)
        self.replace_stale = replace_stale

    # ------------------------------------------------------------------ plumbing
    @property
    def client(self) -> tpu_v2.TpuClient:
        if self._client is None:
            kwargs: dict[str, Any] = {}
            if self._credentials is not None:
                kwargs["credentials"] = self._credentials
            if self._transport:
                kwargs["transport"] = self._transport
            if self._client_options:
                kwargs["client_options"] = self._client_options
            self._client = tpu_v2.TpuClient(**kwargs)
        return self._client

    def _where(self, spec: IslandSpec, handle: dict | None = None) -> tuple[str, str]:
        handle = handle or {}
        project = handle.get("project") or spec.hardware.get("project") or self.project
        zone = handle.get("zone") or spec.hardware.get("zone") or self.zone
        if not project or not zone:
            raise BackendError("tpu_vm needs a project and a zone", retryable=False)
        return project, zone

    def _handle(self, spec: IslandSpec, handle: dict | None = None) -> dict[str, Any]:
        if handle and handle.get("name"):
            return handle
        project, zone = self._where(spec, handle)
        parent = f"projects/{project}/locations/{zone}"
        qr_id = spec.resource_id
        acc = spec.hardware.get("accelerator_type", "")
        try:
            hosts = int(spec.hardware.get("hosts") or tpu_hosts(acc))
        except ValueError:
            hosts = 1
        return {
            "backend": self.name,
            "project": project,
            "zone": zone,
            "parent": parent,
            "resource_id": qr_id,
            "name": f"{parent}/queuedResources/{qr_id}",
            "node_names": [f"{parent}/nodes/{qr_id}"],
            "accelerator_type": acc,
            "hosts": hosts,
        }

    @staticmethod
    def request_id(spec: IslandSpec, name: str, request_key: str = "") -> str:
        """A deterministic request id for creating ``name`` from ``spec``.

        The same spec (and key) gives the same id, so a create repeated after a lost reply is
        deduplicated by the server. It covers the spec's ``created_at``, so a new Airflow try
        (which builds a new spec) does not collide with an id the server remembers from a
        queued resource that has since been deleted; pass ``request_key`` (e.g. the try number)
        when the spec is reused across tries.
        """
        fingerprint = json.dumps(
            {
                "name": name,
                "key": request_key,
                "created_at": spec.created_at,
                "command": list(spec.command),
                "env": spec.env,
                "hardware": spec.hardware,
                "store_url": spec.store_url,
            },
            sort_keys=True,
            default=str,
        )
        return str(uuid.uuid5(_REQUEST_NS, fingerprint))

    def _get_qr(self, name: str) -> tpu_v2.QueuedResource | None:
        try:
            return self.client.get_queued_resource(name=name)
        except gexc.NotFound:
            return None
        except Exception as exc:
            raise map_error(exc, f"get queued resource {name}") from exc

    def _wait_gone(self, name: str) -> None:
        wait_gone(
            lambda: self._get_qr(name) is not None,
            f"queued resource {name}",
            timeout_s=self.operation_timeout_s,
            poll_s=self.poll_s,
        )

    def _create(self, spec: IslandSpec, h: dict, request_id: str) -> bool:
        """Create the queued resource; False if it already existed (409)."""
        try:
            qr = build_queued_resource(spec, project=h["project"], zone=h["zone"])
        except ValueError as exc:
            raise BackendError(f"invalid tpu_vm island spec: {exc}", retryable=False) from exc
        request = tpu_v2.CreateQueuedResourceRequest(
            parent=h["parent"],
            queued_resource_id=h["resource_id"],
            queued_resource=qr,
            request_id=request_id,
        )
        try:
            op = self.client.create_queued_resource(request=request)
            op.result(timeout=self.operation_timeout_s)
        except gexc.Conflict:  # 409 ALREADY_EXISTS: an earlier try created it
            return False
        except Exception as exc:
            raise map_error(exc, f"create queued resource {h['name']}") from exc
        return True

    # ------------------------------------------------------------------ interface
    def provision(self, spec: IslandSpec, request_key: str = "") -> dict:
        """Create the island's queued resource unless it exists; return the handle.

        A queued resource left FAILED or SUSPENDED by an earlier try is replaced (see
        ``replace_stale``); one being deleted is waited for, then created anew.
        """
        h = dict(self._handle(spec))
        name = h["name"]
        request_id = self.request_id(spec, name, request_key)
        created = self._create(spec, h, request_id)
        existing = self._get_qr(name)
        if not created and existing is not None:
            state = existing.state.state
            if state == _QR.DELETING or (self.replace_stale and state in _STALE_STATES):
                if state != _QR.DELETING:
                    self._delete(name)
                self._wait_gone(name)
                existing = None
        if existing is None:
            # Either the old one just went (replaced above, or it was being deleted when the
            # create met 409), or the server deduplicated our request id against an earlier
            # create of a queued resource that has since been deleted (AIP-155): create anew
            # with a fresh id, once.
            request_id = str(uuid.uuid5(_REQUEST_NS, f"{request_id}/{uuid.uuid4()}"))
            created = self._create(spec, h, request_id)
            if not created or self._get_qr(name) is None:
                raise BackendError(
                    f"queued resource {name} changed while provisioning it; try again",
                    retryable=True,
                )
        h["created"] = created
        h["request_id"] = request_id
        return h

    def launch(self, spec: IslandSpec, handle: dict) -> dict:
        # The node's startup script starts the island when the slice boots.
        return dict(self._handle(spec, handle))

    def status(self, spec: IslandSpec, handle: dict) -> BackendStatus:
        h = self._handle(spec, handle)
        qr = self._get_qr(h["name"])
        if qr is None:
            return BackendStatus(ResourceState.GONE, f"queued resource {h['name']} not found")
        state = qr.state.state
        label = _QR(state).name
        if state in _PROVISIONING_STATES:
            return BackendStatus(ResourceState.PROVISIONING, f"queued resource {label}")
        if state == _QR.FAILED:
            error = qr.state.failed_data.error
            message = error.message or "queued resource FAILED (no message)"
            # INVALID_ARGUMENT / PERMISSION_DENIED will fail again the same way
            return BackendStatus(
                ResourceState.FAILED,
                f"queued resource FAILED: {message}",
                retryable=error.code not in (3, 7),
            )
        if state in (_QR.SUSPENDING, _QR.SUSPENDED):
            return BackendStatus(
                ResourceState.PREEMPTED, f"queued resource {label} (spot preemption)", True
            )
        if state == _QR.DELETING:
            return BackendStatus(ResourceState.GONE, "queued resource DELETING")
        # ACTIVE: look at the node(s), then at what the island published
        node_names = h.get("node_names") or [
            f"{ns.parent}/nodes/{ns.node_id}" for ns in qr.tpu.node_spec
        ]
        for node_name in node_names:
            try:
                node = self.client.get_node(name=node_name)
            except gexc.NotFound:
                return BackendStatus(ResourceState.PROVISIONING, f"node {node_name} not there yet")
            except Exception as exc:
                raise map_error(exc, f"get node {node_name}") from exc
            node_state = _NODE(node.state)
            if node_state in (_NODE.PREEMPTED, _NODE.TERMINATED):
                return BackendStatus(
                    ResourceState.PREEMPTED, f"node {node_state.name}: {node.health_description}"
                )
            if node_state in (_NODE.STOPPED, _NODE.STOPPING, _NODE.HIDDEN, _NODE.HIDING):
                return BackendStatus(ResourceState.PREEMPTED, f"node {node_state.name}")
            if node_state == _NODE.DELETING:
                return BackendStatus(ResourceState.GONE, "node DELETING")
            if node_state != _NODE.READY:
                return BackendStatus(ResourceState.PROVISIONING, f"node {node_state.name}")
            done = self._island_exit(node_name, int(h.get("hosts") or 1))
            if done is not None:
                return done
        return BackendStatus(ResourceState.RUNNING, "queued resource ACTIVE, node READY")

    def _island_exit(self, node_name: str, hosts: int) -> BackendStatus | None:
        """SUCCEEDED / FAILED from the exit codes the hosts published, None while running."""
        try:
            resp = self.client.get_guest_attributes(
                request=tpu_v2.GetGuestAttributesRequest(
                    name=node_name, query_path=f"{GUEST_NAMESPACE}/"
                )
            )
        except gexc.GoogleAPICallError:  # none (yet): running, as far as we can tell
            return None
        codes: dict[int, int] = {}
        tails: dict[int, str] = {}
        for worker, attrs in enumerate(resp.guest_attributes):
            for item in attrs.query_value.items:
                if item.namespace != GUEST_NAMESPACE:
                    continue
                if item.key == "exitcode":
                    try:
                        codes[worker] = int(item.value.strip())
                    except ValueError:
                        codes[worker] = 1
                elif item.key == "tail":
                    tails[worker] = item.value
        failed = {w: c for w, c in codes.items() if c != 0}
        if failed:
            worker, code = sorted(failed.items())[0]
            tail = tails.get(worker, "")
            message = f"island exited with code {code} on host {worker}"
            return BackendStatus(
                ResourceState.FAILED, f"{message}; last log lines:\n{tail}" if tail else message
            )
        if codes and len(codes) >= hosts:
            return BackendStatus(ResourceState.SUCCEEDED, f"exit code 0 on all {hosts} host(s)")
        return None

    def _delete(self, name: str) -> None:
        request = tpu_v2.DeleteQueuedResourceRequest(name=name, force=True)
        try:
            op = self.client.delete_queued_resource(request=request)
            op.result(timeout=self.operation_timeout_s)
        except gexc.NotFound:
            return
        except gexc.FailedPrecondition:
            # typically: already being deleted; wait for it to go
            self._wait_gone(name)
        except Exception as exc:
            raise map_error(exc, f"delete queued resource {name}") from exc

    def teardown(self, spec: IslandSpec, handle: dict) -> None:
        self._delete(self._handle(spec, handle)["name"])

    # ------------------------------------------------------------------ maintenance
    def expired_resources(
        self, project: str | None = None, zone: str | None = None, now: float | None = None
    ) -> list[dict[str, Any]]:
        """Queued resources of diloco islands whose ``diloco-ttl`` label is in the past.

        Returns JSON-serializable dicts ``{"name", "resource_id", "state", "experiment",
        "island", "ttl"}`` (for a maintenance DAG to pass to :meth:`delete_resource`).
        """
        project = project or self.project
        zone = zone or self.zone
        if not project or not zone:
            raise BackendError("expired_resources needs a project and a zone", retryable=False)
        now = time.time() if now is None else now
        parent = f"projects/{project}/locations/{zone}"
        out = []
        try:
            for qr in self.client.list_queued_resources(parent=parent):
                labels = _labels_of(qr)
                try:
                    ttl = int(labels[LABEL_TTL])
                except (KeyError, ValueError):
                    continue
                if ttl < now:
                    out.append(
                        {
                            "name": qr.name,
                            "resource_id": qr.name.rsplit("/", 1)[-1],
                            "state": _QR(qr.state.state).name,
                            "experiment": labels.get(LABEL_EXPERIMENT, ""),
                            "island": labels.get(LABEL_ISLAND, ""),
                            "ttl": ttl,
                        }
                    )
        except BackendError:
            raise
        except Exception as exc:
            raise map_error(exc, f"list queued resources in {parent}") from exc
        return out

    def delete_resource(self, name: str) -> None:
        """Force-delete a queued resource by full name (NotFound is fine)."""
        self._delete(name)
