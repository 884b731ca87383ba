"""TpuVmBackend against a local fake of the Cloud TPU v2 REST API, through the real client."""

from __future__ import annotations

import json
import time

import pytest
from diloco_airflow.backends import BackendError, IslandSpec, ResourceState, get_backend
from diloco_airflow.backends.tpu_vm import TpuVmBackend, startup_script, tpu_hosts
from google.auth.credentials import AnonymousCredentials

from tests.fake_tpu_api import FakeTpuApi

PROJECT, ZONE = "proj", "us-east5-a"
PARENT = f"projects/{PROJECT}/locations/{ZONE}"


@pytest.fixture(scope="module")
def fake():
    with FakeTpuApi() as f:
        yield f


@pytest.fixture
def backend(fake) -> TpuVmBackend:
    b = get_backend(
        "tpu_vm",
        api_endpoint=fake.url,
        credentials=AnonymousCredentials(),
        transport="rest",
        operation_timeout_s=10,
        poll_s=0.01,
    )
    assert isinstance(b, TpuVmBackend)
    return b


def _spec(island: str, accelerator: str = "v5p-8", **hw) -> IslandSpec:
    return IslandSpec(
        experiment="exp1",
        island=island,
        store_url="gs://bucket/exp1",
        command=["diloco", "island", "--store", "gs://bucket/exp1", "--island", island],
        env={"DILOCO_LOG_LEVEL": "info", "WANDB_MODE": "it's off"},
        hardware={
            "project": PROJECT,
            "zone": ZONE,
            "accelerator_type": accelerator,
            "runtime_version": "v2-alpha-tpuv5",
            "spot": True,
            **hw,
        },
    )


def test_provision_is_idempotent_with_labels_and_startup_script(backend, fake):
    spec = _spec("a0")
    h1 = backend.provision(spec)
    h2 = backend.provision(_spec("a0"))  # an Airflow retry builds its spec anew
    h3 = backend.provision(spec)  # a repeat of the very same request
    json.dumps(h1)
    assert h1["name"] == h2["name"] == h3["name"] == f"{PARENT}/queuedResources/{spec.resource_id}"
    # the retry's create met 409 ALREADY_EXISTS; the repeat was deduplicated by its request id
    assert h1["created"] is True and h2["created"] is False
    assert h3["request_id"] == h1["request_id"] != h2["request_id"]
    # exactly one queued resource
    qrs = [n for n in fake._state.queued_resources if n.endswith(spec.resource_id)]
    assert len(qrs) == 1
    creates = fake.creates(spec.resource_id)
    assert len(creates) == 3
    assert creates[0].query["requestId"] == creates[2].query["requestId"]  # deterministic

    body = creates[0].body
    assert body["spot"] == {}
    node_spec = body["tpu"]["nodeSpec"][0]
    assert node_spec["parent"] == PARENT and node_spec["nodeId"] == spec.resource_id
    node = node_spec["node"]
    assert node["acceleratorType"] == "v5p-8"
    assert node["labels"]["diloco-experiment"] == "exp1"
    assert node["labels"]["diloco-island"] == "a0"
    assert int(node["labels"]["diloco-ttl"]) > time.time()
    script = node["metadata"]["startup-script"]
    assert "diloco island --store gs://bucket/exp1 --island a0" in script
    assert "export DILOCO_LOG_LEVEL=info" in script
    assert "export WANDB_MODE='it'\"'\"'s off'" in script  # shell-quoted
    assert "setsid nohup" in script and "/var/log/diloco-island.log" in script
    assert "pip install" in script and "DILOCO_INSTALL=''" in script  # no install by default
    assert node["metadata"]["enable-guest-attributes"] == "TRUE"


def test_startup_script_multi_host_and_install():
    spec = _spec("m0", "v5p-64", install="decoupled-diloco==0.1.0", coordinator_flags=True)
    assert tpu_hosts("v5p-64") == 8
    assert tpu_hosts("v4-8") == 1 and tpu_hosts("v5litepod-16") == 4 and tpu_hosts("v6e-8") == 1
    script = startup_script(spec)
    assert "export DILOCO_NUM_PROCESSES=8" in script
    assert "agent-worker-number" in script and "worker-network-endpoints" in script
    assert '--coordinator "$DILOCO_COORDINATOR"' in script
    assert "export DILOCO_INSTALL=decoupled-diloco==0.1.0" in script
    single = startup_script(_spec("s0", "v5p-8", coordinator_flags=True))
    assert "--coordinator" not in single  # only multi-host slices need hints


def test_state_mapping(backend, fake):
    spec = _spec("a1")
    h = backend.provision(spec)
    qr_id = spec.resource_id
    assert backend.status(spec, h).state == ResourceState.PROVISIONING  # ACCEPTED
    for state in ("WAITING_FOR_RESOURCES", "PROVISIONING"):
        fake.set_state(qr_id, state)
        assert backend.status(spec, h).state == ResourceState.PROVISIONING
    fake.set_state(qr_id, "ACTIVE")
    assert backend.status(spec, {}).state == ResourceState.RUNNING  # works without a handle
    # every host published exit code 0 -> SUCCEEDED
    fake.set_guest_attribute(qr_id, "exitcode", "0")
    st = backend.status(spec, h)
    assert st.state == ResourceState.SUCCEEDED, st.message
    fake.set_guest_attribute(qr_id, "exitcode", "1")
    fake.set_guest_attribute(qr_id, "tail", "Traceback: boom")
    st = backend.status(spec, h)
    assert st.state == ResourceState.FAILED and "code 1" in st.message and "boom" in st.message
    fake.set_state(
        qr_id, "FAILED", error_message="There is no more capacity in the zone us-east5-a"
    )
    st = backend.status(spec, h)
    assert st.state == ResourceState.FAILED
    assert "no more capacity" in st.message and st.retryable
    fake.set_state(qr_id, "DELETING")
    assert backend.status(spec, h).state == ResourceState.GONE
    backend.teardown(spec, h)
    assert backend.status(spec, h).state == ResourceState.GONE


def test_multi_host_success_needs_every_host(backend, fake):
    spec = _spec("mh", "v4-32")
    h = backend.provision(spec)
    assert h["hosts"] == 4
    fake.set_state(spec.resource_id, "ACTIVE")
    for worker in range(3):
        fake.set_guest_attribute(spec.resource_id, "exitcode", "0", worker=worker)
    assert backend.status(spec, h).state == ResourceState.RUNNING
    fake.set_guest_attribute(spec.resource_id, "exitcode", "0", worker=3)
    assert backend.status(spec, h).state == ResourceState.SUCCEEDED
    backend.teardown(spec, h)


def test_preemption_teardown_and_retry(backend, fake):
    spec = _spec("a2")
    h = backend.launch(spec, backend.provision(spec))
    fake.set_state(spec.resource_id, "ACTIVE")
    assert backend.status(spec, h).state == ResourceState.RUNNING

    # node preempted while the queued resource still says ACTIVE
    fake.preempt(spec.resource_id, suspend=False)
    st = backend.status(spec, h)
    assert st.state == ResourceState.PREEMPTED and st.retryable
    # then the queued resource is suspended (spot)
    fake.preempt(spec.resource_id)
    st = backend.status(spec, h)
    assert st.state == ResourceState.PREEMPTED and st.retryable

    backend.teardown(spec, h)
    assert not fake.exists(spec.resource_id)
    delete = fake.deletes()[-1]
    assert delete.query.get("force") == "true"
    backend.teardown(spec, h)  # idempotent: NotFound is fine
    assert backend.status(spec, h).state == ResourceState.GONE

    # the retried island: same spec object (so the same request id, which the server
    # deduplicates against the deleted incarnation) -> the backend still creates it anew
    n_before = len(fake.creates(spec.resource_id))
    h2 = backend.provision(spec)
    assert h2["created"] is True
    assert fake.exists(spec.resource_id)
    assert fake.queued_resource(spec.resource_id)["state"]["state"] == "ACCEPTED"
    assert len(fake.creates(spec.resource_id)) == n_before + 2
    # and a fresh spec (a new Airflow try) creates with a single request
    backend.teardown(spec, h2)
    retry_spec = _spec("a2")
    n_before = len(fake.creates(spec.resource_id))
    assert backend.provision(retry_spec)["created"] is True
    assert len(fake.creates(spec.resource_id)) == n_before + 1
    backend.teardown(retry_spec, {})


def test_provision_replaces_a_stale_suspended_resource(backend, fake):
    spec = _spec("a3")
    backend.provision(spec)
    fake.set_state(spec.resource_id, "ACTIVE")
    fake.preempt(spec.resource_id)  # SUSPENDED, and the teardown never ran
    h = backend.provision(_spec("a3"))  # the retry
    assert h["created"] is True
    assert fake.queued_resource(spec.resource_id)["state"]["state"] == "ACCEPTED"
    assert len([n for n in fake._state.queued_resources if n.endswith(spec.resource_id)]) == 1
    backend.teardown(spec, h)


def test_quota_error_is_retryable_with_cloud_message(backend, fake):
    message = "Quota 'TPUV5PPerProjectPerZoneForTPUAPI' exhausted. Limit 8 in zone us-east5-a"
    fake.fail_next_create("RESOURCE_EXHAUSTED", message)
    spec = _spec("a4")
    with pytest.raises(BackendError) as info:
        backend.provision(spec)
    assert info.value.retryable is True
    assert message in str(info.value)
    assert not fake.exists(spec.resource_id)
    # a stockout reported as 503 is retryable too
    fake.fail_next_create("UNAVAILABLE", "The zone does not have enough resources (stockout)")
    with pytest.raises(BackendError) as info:
        backend.provision(spec)
    assert info.value.retryable is True and "stockout" in str(info.value)


def test_bad_accelerator_is_permanent(backend, fake):
    spec = _spec("a5", "v9-8", hosts=1)
    with pytest.raises(BackendError) as info:
        backend.provision(spec)
    assert info.value.retryable is False
    assert "Accelerator type v9-8 is not available" in str(info.value)
    # without a host count the backend itself cannot make sense of it: permanent as well
    with pytest.raises(BackendError) as info:
        backend.provision(_spec("a5", "v9-8"))
    assert info.value.retryable is False and "v9-8" in str(info.value)
    assert not fake.exists(spec.resource_id)


def test_expired_resources(backend, fake):
    now = time.time()
    old = IslandSpec(
        experiment="expold",
        island="i0",
        store_url="gs://b/old",
        command=["diloco", "island"],
        hardware=_spec("x").hardware,
        ttl_hours=1,
        created_at=now - 7200,
    )
    fresh = _spec("a6")
    backend.provision(old)
    backend.provision(fresh)
    fake.add_queued_resource(  # not ours: no diloco labels
        PROJECT, ZONE, "someone-else", {"tpu": {"nodeSpec": []}}
    )
    fake.page_size = 2  # exercise paging through the client
    try:
        expired = backend.expired_resources(PROJECT, ZONE, now=now)
    finally:
        fake.page_size = 50
    assert [e["resource_id"] for e in expired] == [old.resource_id]
    assert expired[0]["experiment"] == "expold" and expired[0]["ttl"] < now
    json.dumps(expired)
    backend.delete_resource(expired[0]["name"])
    assert not fake.exists(old.resource_id)
    assert backend.expired_resources(PROJECT, ZONE, now=now + 48 * 3600)  # fresh one, later
    backend.teardown(fresh, {})


def test_request_paths_the_client_sends(backend, fake):
    spec = _spec("a7")
    start = len(fake.requests)
    h = backend.provision(spec)
    fake.set_state(spec.resource_id, "ACTIVE")
    backend.status(spec, h)
    backend.teardown(spec, h)
    seen = [(r.method, r.path) for r in fake.requests[start:]]
    qr = f"/v2/{PARENT}/queuedResources/{spec.resource_id}"
    node = f"/v2/{PARENT}/nodes/{spec.resource_id}"
    assert seen == [
        ("POST", f"/v2/{PARENT}/queuedResources"),
        ("GET", qr),
        ("GET", qr),
        ("GET", node),
        ("POST", f"{node}:getGuestAttributes"),
        ("DELETE", qr),
    ]
    assert fake.requests[start].query["queuedResourceId"] == spec.resource_id
