"""A local fake of the Cloud TPU v2 REST API, enough for the real ``google-cloud-tpu`` client.

Serves plain HTTP on 127.0.0.1 (random port) from a thread. Point the client at it with
``tpu_v2.TpuClient(credentials=AnonymousCredentials(), transport="rest",
client_options={"api_endpoint": fake.url})``.

Paths served (the ones the client library's REST transport sends, checked by running it):

- ``POST   /v2/projects/P/locations/Z/queuedResources?queuedResourceId=ID[&requestId=R]``
- ``GET    /v2/projects/P/locations/Z/queuedResources[?pageSize=&pageToken=]``
- ``GET    /v2/projects/P/locations/Z/queuedResources/ID``
- ``DELETE /v2/projects/P/locations/Z/queuedResources/ID[?force=true]``
- ``GET    /v2/projects/P/locations/Z/nodes/ID``
- ``POST   /v2/projects/P/locations/Z/nodes/ID:getGuestAttributes``
- ``GET    /v2/projects/P/locations/Z/operations/OP``

Long-running operations come back already done (``done: true`` with the ``response`` or
``error``). Errors follow Google's JSON error format ``{"error": {"code", "message", "status"}}``.

The test drives the cloud side: :meth:`FakeTpuApi.set_state`, :meth:`FakeTpuApi.preempt`,
:meth:`FakeTpuApi.fail_next_create`, :meth:`FakeTpuApi.set_guest_attribute`. Every request is
recorded in :attr:`FakeTpuApi.requests`.

Like the real API, a create that repeats a ``requestId`` already seen returns the original
operation and creates nothing (AIP-155 request deduplication), even if that resource has since been
deleted.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

QR_TYPE = "type.googleapis.com/google.cloud.tpu.v2.QueuedResource"
EMPTY_TYPE = "type.googleapis.com/google.protobuf.Empty"
METADATA_TYPE = "type.googleapis.com/google.cloud.tpu.v2.OperationMetadata"

HTTP_FOR_STATUS = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,
    "INTERNAL": 500,
    "UNKNOWN": 500,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
RPC_CODE = {
    "CANCELLED": 1,
    "UNKNOWN": 2,
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "ABORTED": 10,
    "OUT_OF_RANGE": 11,
    "UNIMPLEMENTED": 12,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
    "UNAUTHENTICATED": 16,
}

QR_STATES = {
    "CREATING",
    "ACCEPTED",
    "PROVISIONING",
    "FAILED",
    "DELETING",
    "ACTIVE",
    "SUSPENDING",
    "SUSPENDED",
    "WAITING_FOR_RESOURCES",
}
ID_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
ACCELERATOR_RE = re.compile(
    r"^(?:(?:v2|v3|v4|v5p)-(?:8|16|32|64|128|256|512|1024|2048|4096)"
    r"|(?:v5litepod|v6e)-(?:1|4|8|16|32|64|128|256))$"
)
LABEL_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")

_PARENT = r"projects/(?P<project>[^/]+)/locations/(?P<zone>[^/]+)"
ROUTES = [
    ("POST", re.compile(rf"^/v2/{_PARENT}/queuedResources$"), "create_qr"),
    ("GET", re.compile(rf"^/v2/{_PARENT}/queuedResources$"), "list_qr"),
    ("GET", re.compile(rf"^/v2/{_PARENT}/queuedResources/(?P<id>[^/:]+)$"), "get_qr"),
    ("DELETE", re.compile(rf"^/v2/{_PARENT}/queuedResources/(?P<id>[^/:]+)$"), "delete_qr"),
    ("GET", re.compile(rf"^/v2/{_PARENT}/nodes/(?P<id>[^/:]+)$"), "get_node"),
    (
        "POST",
        re.compile(rf"^/v2/{_PARENT}/nodes/(?P<id>[^/:]+):getGuestAttributes$"),
        "guest_attributes",
    ),
    ("GET", re.compile(rf"^/v2/{_PARENT}/operations/(?P<id>[^/:]+)$"), "get_operation"),
]


class ApiError(Exception):
    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> dict:
        return {
            "error": {
                "code": HTTP_FOR_STATUS[self.status],
                "message": self.message,
                "status": self.status,
            }
        }


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: Any = None


@dataclass
class _State:
    queued_resources: dict[str, dict] = field(default_factory=dict)
    nodes: dict[str, dict] = field(default_factory=dict)
    operations: dict[str, dict] = field(default_factory=dict)
    request_ids: dict[str, dict] = field(default_factory=dict)
    guest_attributes: dict[str, dict[int, dict[tuple[str, str], str]]] = field(default_factory=dict)
    fail_next: list[tuple[str, str]] = field(default_factory=list)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _hosts(accelerator_type: str) -> int:
    family, _, size = accelerator_type.partition("-")
    n = int(size)
    if family in ("v5litepod", "v6e"):
        return 1 if n <= 8 else n // 4
    return max(1, n // 8)


class FakeTpuApi:
    """The fake server. Use as a context manager, or call :meth:`start` / :meth:`stop`."""

    def __init__(self, host: str = "127.0.0.1", page_size: int = 50) -> None:
        self.host = host
        self.page_size = page_size
        self.requests: list[Request] = []
        self._state = _State()
        self._lock = threading.RLock()
        self._op_ids = itertools.count(1)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> FakeTpuApi:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # else each reply waits ~40 ms for a delayed ACK

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _handle(self) -> None:
                fake._dispatch(self)

            do_GET = do_POST = do_DELETE = do_PATCH = _handle

        self._server = ThreadingHTTPServer((self.host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="fake-tpu-api",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeTpuApi:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        return f"http://{self.host}:{self._server.server_address[1]}"

    # ------------------------------------------------------------------ test controls
    def _qr_name(self, id_or_name: str) -> str:
        with self._lock:
            if id_or_name in self._state.queued_resources:
                return id_or_name
            matches = [
                n
                for n in self._state.queued_resources
                if n.endswith(f"/queuedResources/{id_or_name}")
            ]
        if len(matches) != 1:
            raise KeyError(f"no (unique) queued resource {id_or_name!r}")
        return matches[0]

    def exists(self, id_or_name: str) -> bool:
        try:
            self._qr_name(id_or_name)
        except KeyError:
            return False
        return True

    def queued_resource(self, id_or_name: str) -> dict:
        with self._lock:
            return json.loads(json.dumps(self._state.queued_resources[self._qr_name(id_or_name)]))

    def node(self, node_id_or_name: str) -> dict | None:
        with self._lock:
            for name, node in self._state.nodes.items():
                if name == node_id_or_name or name.endswith(f"/nodes/{node_id_or_name}"):
                    return json.loads(json.dumps(node))
        return None

    def set_state(
        self, id_or_name: str, state: str, *, error_message: str = "", error_status: str = ""
    ) -> None:
        """Move a queued resource to ``state``; ACTIVE creates its nodes (READY)."""
        if state not in QR_STATES:
            raise ValueError(f"unknown queued resource state {state}")
        with self._lock:
            qr = self._state.queued_resources[self._qr_name(id_or_name)]
            qr["state"] = {"state": state}
            if state == "FAILED":
                code = RPC_CODE[error_status or "RESOURCE_EXHAUSTED"]
                qr["state"]["failedData"] = {
                    "error": {"code": code, "message": error_message or "failed"}
                }
            for spec in qr["tpu"]["nodeSpec"]:
                node_name = f"{spec['parent']}/nodes/{spec['nodeId']}"
                if state == "ACTIVE":
                    node = self._state.nodes.get(node_name)
                    if node is None or node["state"] in ("PREEMPTED", "TERMINATED"):
                        self._state.nodes[node_name] = self._make_node(qr, spec, node_name)
                    else:
                        node["state"] = "READY"
                elif state in ("SUSPENDING", "SUSPENDED"):
                    if node_name in self._state.nodes:
                        self._state.nodes[node_name]["state"] = "PREEMPTED"
                elif state in ("DELETING", "FAILED", "ACCEPTED", "WAITING_FOR_RESOURCES"):
                    self._state.nodes.pop(node_name, None)

    def preempt(self, id_or_name: str, *, suspend: bool = True) -> None:
        """Spot preemption: nodes PREEMPTED and (by default) the queued resource SUSPENDED."""
        with self._lock:
            qr = self._state.queued_resources[self._qr_name(id_or_name)]
            for spec in qr["tpu"]["nodeSpec"]:
                node = self._state.nodes.get(f"{spec['parent']}/nodes/{spec['nodeId']}")
                if node is not None:
                    node["state"] = "PREEMPTED"
            if suspend:
                qr["state"] = {"state": "SUSPENDED", "stateInitiator": "SERVICE"}

    def fail_next_create(self, status: str, message: str) -> None:
        """Make the next create answer with this error (``RESOURCE_EXHAUSTED`` -> HTTP 429)."""
        if status not in HTTP_FOR_STATUS:
            raise ValueError(f"unknown status {status}")
        with self._lock:
            self._state.fail_next.append((status, message))

    def set_guest_attribute(
        self, node_id: str, key: str, value: str, *, worker: int = 0, namespace: str = "diloco"
    ) -> None:
        """What a startup script does with ``PUT .../guest-attributes/<namespace>/<key>``."""
        with self._lock:
            node = self.node(node_id)
            if node is None:
                raise KeyError(f"no node {node_id}")
            per_worker = self._state.guest_attributes.setdefault(node["name"], {})
            per_worker.setdefault(worker, {})[(namespace, key)] = value

    def add_queued_resource(self, project: str, zone: str, qr_id: str, body: dict) -> dict:
        """Insert a queued resource directly (as if created by someone else)."""
        with self._lock:
            return self._insert_qr(project, zone, qr_id, body)

    def creates(self, qr_id: str | None = None) -> list[Request]:
        """The create requests received (optionally only those for one id)."""
        return [
            r
            for r in list(self.requests)
            if r.method == "POST"
            and r.path.endswith("/queuedResources")
            and (qr_id is None or r.query.get("queuedResourceId") == qr_id)
        ]

    def deletes(self) -> list[Request]:
        return [r for r in list(self.requests) if r.method == "DELETE"]

    # ------------------------------------------------------------------ HTTP plumbing
    def _dispatch(self, h: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(h.path)
        path = unquote(parts.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        with self._lock:
            self.requests.append(Request(h.command, path, query, body))
        try:
            if raw and body is None:
                raise ApiError("INVALID_ARGUMENT", "request body is not valid JSON")
            for method, pattern, action in ROUTES:
                m = pattern.match(path)
                if m and method == h.command:
                    with self._lock:
                        code, payload = getattr(self, f"_api_{action}")(m, query, body)
                    break
            else:
                raise ApiError("NOT_FOUND", f"no route for {h.command} {path}")
        except ApiError as exc:
            code, payload = HTTP_FOR_STATUS[exc.status], exc.body()
        data = json.dumps(payload).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json; charset=UTF-8")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _operation(self, project: str, zone: str, verb: str, target: str, response: dict) -> dict:
        name = f"projects/{project}/locations/{zone}/operations/operation-{next(self._op_ids)}"
        op = {
            "name": name,
            "metadata": {
                "@type": METADATA_TYPE,
                "createTime": _now(),
                "endTime": _now(),
                "target": target,
                "verb": verb,
                "apiVersion": "v2",
            },
            "done": True,
            "response": response,
        }
        self._state.operations[name] = op
        return op

    # ------------------------------------------------------------------ the API
    def _insert_qr(self, project: str, zone: str, qr_id: str, body: dict) -> dict:
        parent = f"projects/{project}/locations/{zone}"
        name = f"{parent}/queuedResources/{qr_id}"
        qr = json.loads(json.dumps(body))
        qr["name"] = name
        qr["createTime"] = _now()
        qr["state"] = {"state": "ACCEPTED"}
        self._state.queued_resources[name] = qr
        return qr

    def _api_create_qr(self, m: re.Match, query: dict, body: Any) -> tuple[int, dict]:
        project, zone = m["project"], m["zone"]
        qr_id = query.get("queuedResourceId", "")
        request_id = query.get("requestId", "")
        if request_id and request_id in self._state.request_ids:
            return 200, self._state.request_ids[request_id]
        if self._state.fail_next:
            status, message = self._state.fail_next.pop(0)
            raise ApiError(status, message)
        if not ID_RE.match(qr_id):
            raise ApiError("INVALID_ARGUMENT", f"Invalid queued resource id {qr_id!r}")
        if not isinstance(body, dict):
            raise ApiError("INVALID_ARGUMENT", "missing queued resource")
        node_specs = (body.get("tpu") or {}).get("nodeSpec") or []
        if not node_specs:
            raise ApiError("INVALID_ARGUMENT", "tpu.node_spec must not be empty")
        for spec in node_specs:
            node = spec.get("node") or {}
            if spec.get("parent") != f"projects/{project}/locations/{zone}":
                raise ApiError("INVALID_ARGUMENT", f"node_spec parent {spec.get('parent')!r}")
            if not ID_RE.match(spec.get("nodeId", "")):
                raise ApiError("INVALID_ARGUMENT", f"Invalid node id {spec.get('nodeId')!r}")
            acc = node.get("acceleratorType", "")
            if not ACCELERATOR_RE.match(acc):
                raise ApiError(
                    "INVALID_ARGUMENT",
                    f"Invalid value for field 'node.accelerator_type': '{acc}'. "
                    f"Accelerator type {acc} is not available in zone {zone}.",
                )
            if not node.get("runtimeVersion"):
                raise ApiError("INVALID_ARGUMENT", "node.runtime_version is required")
            for key, value in (node.get("labels") or {}).items():
                if not LABEL_KEY_RE.match(key) or not LABEL_VALUE_RE.match(str(value)):
                    raise ApiError("INVALID_ARGUMENT", f"Invalid label {key}={value!r}")
        name = f"projects/{project}/locations/{zone}/queuedResources/{qr_id}"
        if name in self._state.queued_resources:
            raise ApiError("ALREADY_EXISTS", f"Resource '{name}' already exists")
        qr = self._insert_qr(project, zone, qr_id, body)
        op = self._operation(project, zone, "create", name, {"@type": QR_TYPE, **qr})
        if request_id:
            self._state.request_ids[request_id] = op
        return 200, op

    def _api_get_qr(self, m: re.Match, query: dict, body: Any) -> tuple[int, dict]:
        name = f"projects/{m['project']}/locations/{m['zone']}/queuedResources/{m['id']}"
        qr = self._state.queued_resources.get(name)
        if qr is None:
            raise ApiError("NOT_FOUND", f"Resource '{name}' was not found")
        return 200, qr

    def _api_list_qr(self, m: re.Match, query: dict, body: Any) -> tuple[int, dict]:
        prefix = f"projects/{m['project']}/locations/{m['zone']}/queuedResources/"
        items = [
            qr for n, qr in sorted(self._state.queued_resources.items()) if n.startswith(prefix)
        ]
        size = int(query.get("pageSize") or self.page_size)
        start = int(query.get("pageToken") or 0)
        page = {"queuedResources": items[start : start + size]}
        if start + size < len(items):
            page["nextPageToken"] = str(start + size)
        return 200, page

    def _api_delete_qr(self, m: re.Match, query: dict, body: Any) -> tuple[int, dict]:
        project, zone = m["project"], m["zone"]
        name = f"projects/{project}/locations/{zone}/queuedResources/{m['id']}"
        qr = self._state.queued_resources.get(name)
        if qr is None:
            raise ApiError("NOT_FOUND", f"Resource '{name}' was not found")
        node_names = [f"{s['parent']}/nodes/{s['nodeId']}" for s in qr["tpu"]["nodeSpec"]]
        force = query.get("force", "").lower() in ("true", "1")
        if not force and any(n in self._state.nodes for n in node_names):
            raise ApiError(
                "FAILED_PRECONDITION",
                f"Queued resource '{name}' has nodes; delete them first or use force",
            )
        for n in node_names:
            self._state.nodes.pop(n, None)
            self._state.guest_attributes.pop(n, None)
        del self._state.queued_resources[name]
        return 200, self._operation(project, zone, "delete", name, {"@type": EMPTY_TYPE})

    def _api_get_node(self, m: re.Match, query: dict, body: Any) -> tuple[int, dict]:
        name = f"projects/{m['project']}/locations/{m['zone']}/nodes/{m['id']}"
        node = self._state.nodes.get(name)
        if node is None:
            raise ApiError("NOT_FOUND", f"Resource '{name}' was not found")
        return 200, node

    def _api_guest_attributes(self, m: re.Match, query: dict, body: Any) -> tuple[int, dict]:
        name = f"projects/{m['project']}/locations/{m['zone']}/nodes/{m['id']}"
        node = self._state.nodes.get(name)
        if node is None:
            raise ApiError("NOT_FOUND", f"Resource '{name}' was not found")
        query_path = (body or {}).get("queryPath", "")
        namespace = query_path.rstrip("/").split("/")[0] if query_path else ""
        wanted = {int(w) for w in (body or {}).get("workerIds") or []}
        per_worker = self._state.guest_attributes.get(name, {})
        out = []
        for worker in range(_hosts(node.get("acceleratorType", "v2-8"))):
            if wanted and worker not in wanted:
                continue
            items = [
                {"namespace": ns, "key": key, "value": value}
                for (ns, key), value in sorted(per_worker.get(worker, {}).items())
                if not namespace or ns == namespace
            ]
            out.append({"queryPath": query_path, "queryValue": {"items": items}})
        return 200, {"guestAttributes": out}

    def _api_get_operation(self, m: re.Match, query: dict, body: Any) -> tuple[int, dict]:
        name = f"projects/{m['project']}/locations/{m['zone']}/operations/{m['id']}"
        op = self._state.operations.get(name)
        if op is None:
            raise ApiError("NOT_FOUND", f"Operation '{name}' was not found")
        return 200, op

    def _make_node(self, qr: dict, spec: dict, node_name: str) -> dict:
        node = json.loads(json.dumps(spec.get("node") or {}))
        hosts = _hosts(node.get("acceleratorType", "v2-8"))
        node.update(
            {
                "name": node_name,
                "state": "READY",
                "health": "HEALTHY",
                "createTime": _now(),
                "queuedResource": qr["name"],
                "apiVersion": "V2",
                "networkEndpoints": [
                    {"ipAddress": f"10.0.0.{i + 2}", "port": 8470} for i in range(hosts)
                ],
            }
        )
        return node
