"""GKE island manifests (Pod / JobSet), validated against the kubernetes client's models."""

from __future__ import annotations

import copy
import json

import pytest
from diloco_airflow.backends import BackendError, IslandSpec, ResourceState, get_backend
from diloco_airflow.backends.gke import (
    ACCELERATOR_LABEL,
    TOPOLOGY_LABEL,
    GkeBackend,
    build_jobset,
    build_manifest,
    build_pod,
    jobset_status,
    k8s_name,
    pod_status,
    tpu_slice,
    validate_jobset,
    validate_k8s,
)


def _spec(island="g0", **hw) -> IslandSpec:
    hardware = {
        "accelerator": "tpu-v5p-slice",
        "topology": "2x2x1",
        "chips_per_host": 4,
        "hosts": 1,
        "image": "us-docker.pkg.dev/p/r/diloco:0.1",
        "namespace": "training",
        **hw,
    }
    return IslandSpec(
        experiment="exp1",
        island=island,
        store_url="gs://bucket/exp1",
        command=["diloco", "island", "--store", "gs://bucket/exp1", "--island", island],
        env={"DILOCO_LOG_LEVEL": "info"},
        hardware=hardware,
        ttl_hours=2,
    )


def test_pod_single_host():
    spec = _spec()
    pod = build_pod(spec)
    validate_k8s(pod, "V1Pod")
    json.dumps(pod)
    assert pod["metadata"]["name"] == k8s_name(spec)
    assert pod["metadata"]["namespace"] == "training"
    assert pod["metadata"]["labels"]["diloco-island"] == "g0"
    assert "diloco-ttl" in pod["metadata"]["labels"]
    ps = pod["spec"]
    assert ps["restartPolicy"] == "Never"
    assert ps["activeDeadlineSeconds"] == 2 * 3600
    assert ps["nodeSelector"] == {ACCELERATOR_LABEL: "tpu-v5p-slice", TOPOLOGY_LABEL: "2x2x1"}
    (c,) = ps["containers"]
    assert c["command"] == list(spec.command)
    assert c["resources"]["limits"] == {"google.com/tpu": "4"} == c["resources"]["requests"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["DILOCO_LOG_LEVEL"] == "info" and env["DILOCO_NUM_PROCESSES"] == "1"
    assert build_manifest(spec)["kind"] == "Pod"


def test_jobset_multi_host():
    spec = _spec("g1", topology="2x2x4", hosts=4, spot=True)
    js = build_jobset(spec)
    validate_jobset(js)
    json.dumps(js)
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and js["kind"] == "JobSet"
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 0}
    (rj,) = js["spec"]["replicatedJobs"]
    job = rj["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 4
    assert job["completionMode"] == "Indexed"
    assert job["backoffLimit"] == 0
    pod_spec = job["template"]["spec"]
    assert pod_spec["restartPolicy"] == "Never"
    assert pod_spec["nodeSelector"][TOPOLOGY_LABEL] == "2x2x4"
    assert pod_spec["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    assert pod_spec["containers"][0]["resources"]["limits"]["google.com/tpu"] == "4"
    # the JobSet's pod template, on its own, is a valid pod
    validate_k8s(job["template"], "V1PodTemplateSpec")
    validate_k8s({"metadata": {"name": "x"}, "spec": pod_spec}, "V1Pod")
    assert build_manifest(spec)["kind"] == "JobSet"
    assert len(k8s_name(spec)) <= 40
    with pytest.raises(ValueError, match="multi-host"):
        build_pod(spec)


def test_v5e_shapes():
    assert tpu_slice({"accelerator": "tpu-v5-lite-podslice", "topology": "2x4"})["hosts"] == 1
    shape = tpu_slice({"accelerator": "tpu-v6e-slice", "topology": "4x4"})
    assert shape == {
        "accelerator": "tpu-v6e-slice",
        "topology": "4x4",
        "chips": 16,
        "chips_per_host": 4,
        "hosts": 4,
    }
    pod = build_pod(
        _spec(accelerator="tpu-v5-lite-podslice", topology="2x4", chips_per_host=8, hosts=1)
    )
    assert pod["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] == "8"


@pytest.mark.parametrize(
    "hw, match",
    [
        ({"accelerator": "tpu-v9-slice"}, "unknown GKE TPU accelerator"),
        ({"topology": "2x2"}, "needs 3 dimensions"),
        ({"accelerator": "tpu-v5-lite-podslice", "topology": "2x2x1"}, "needs 2 dimensions"),
        ({"topology": "2x2x1", "chips_per_host": 8}, "not possible"),
        ({"topology": "2x2x2", "hosts": 1}, "2 host"),
        ({"topology": "1x1x1", "chips_per_host": 4}, "cannot be split"),
        (
            {"accelerator": "tpu-v5-lite-podslice", "topology": "4x4", "chips_per_host": 8},
            "multi-host",
        ),
        ({"accelerator": "tpu-v5-lite-device", "topology": "4x4", "hosts": 4}, "single-host"),
        ({"topology": "axb"}, "dimensions"),
        ({"image": ""}, "image"),
    ],
)
def test_bad_combinations_raise_clear_value_error(hw, match):
    spec = _spec(**hw)
    with pytest.raises(ValueError, match=match):
        build_manifest(spec)


def test_validator_catches_unknown_and_mistyped_fields():
    pod = build_pod(_spec())
    bad = copy.deepcopy(pod)
    bad["spec"]["containers"][0]["resourcez"] = {}
    with pytest.raises(ValueError, match=r"resourcez: unknown field of V1Container"):
        validate_k8s(bad, "V1Pod")
    bad = copy.deepcopy(pod)
    bad["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] = 4  # not a string
    with pytest.raises(ValueError, match="google.com/tpu"):
        validate_k8s(bad, "V1Pod")
    bad = copy.deepcopy(pod)
    del bad["spec"]["containers"][0]["name"]  # required
    with pytest.raises(ValueError, match="name"):
        validate_k8s(bad, "V1Pod")
    bad = copy.deepcopy(pod)
    bad["spec"]["activeDeadlineSeconds"] = "7200"
    with pytest.raises(ValueError, match="activeDeadlineSeconds|active_deadline_seconds"):
        validate_k8s(bad, "V1Pod")

    js = build_jobset(_spec("g2", topology="2x2x2", hosts=2))
    for mutate, match in [
        (lambda d: d.update(apiVersion="jobset.x-k8s.io/v1"), "apiVersion"),
        (lambda d: d["spec"].update(replicatedJob=[]), "unknown JobSet.spec"),
        (lambda d: d["spec"].update(replicatedJobs=[]), "non-empty"),
        (lambda d: d["spec"]["replicatedJobs"][0].update(replicas=0), "replicas"),
        (
            lambda d: d["spec"]["replicatedJobs"][0]["template"]["spec"].update(backofLimit=0),
            "backofLimit: unknown field of V1JobSpec",
        ),
        (
            lambda d: d["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"].update(
                restartPolicy="Always"
            ),
            "restartPolicy",
        ),
    ]:
        bad = copy.deepcopy(js)
        mutate(bad)
        with pytest.raises(ValueError, match=match):
            validate_jobset(bad)


class _ApiException(Exception):
    def __init__(self, status, reason=""):
        super().__init__(f"{status} {reason}")
        self.status, self.reason, self.body = status, reason, ""


class _FakeCustomApi:
    """Just enough of CustomObjectsApi for the JobSet lifecycle."""

    def __init__(self):
        self.objects: dict[tuple[str, str], dict] = {}
        self.calls: list[str] = []

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        self.calls.append("create")
        key = (namespace, body["metadata"]["name"])
        if key in self.objects:
            raise _ApiException(409, "AlreadyExists")
        self.objects[key] = copy.deepcopy(body)
        return body

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        if (namespace, name) not in self.objects:
            raise _ApiException(404, "NotFound")
        return self.objects[(namespace, name)]

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, **kw):
        self.calls.append("delete")
        if self.objects.pop((namespace, name), None) is None:
            raise _ApiException(404, "NotFound")


def test_backend_jobset_lifecycle_with_fake_api():
    api = _FakeCustomApi()
    backend = get_backend("gke", custom_api=api, poll_s=0)
    assert isinstance(backend, GkeBackend)
    spec = _spec("g3", topology="2x2x2", hosts=2)
    h = backend.provision(spec)
    assert h["kind"] == "JobSet" and h["namespace"] == "training"
    assert backend.status(spec, h).state == ResourceState.GONE
    h = backend.launch(spec, h)
    assert backend.status(spec, h).state == ResourceState.PROVISIONING
    obj = api.objects[("training", h["name"])]
    obj["status"] = {"replicatedJobsStatus": [{"name": "island", "ready": 1, "active": 1}]}
    assert backend.status(spec, {}).state == ResourceState.RUNNING
    # a retried launch replaces the earlier copy instead of running two
    backend.launch(spec, {})
    assert api.calls == ["create", "create", "delete", "create"]
    assert len(api.objects) == 1
    backend.teardown(spec, h)
    backend.teardown(spec, h)  # idempotent
    assert not api.objects
    with pytest.raises(BackendError) as info:
        backend.provision(_spec("g4", accelerator="tpu-v9"))
    assert info.value.retryable is False


def test_jobset_status_mapping():
    def cond(kind, **kw):
        return {"status": {"conditions": [{"type": kind, "status": "True", **kw}]}}

    assert jobset_status(cond("Completed")).state == ResourceState.SUCCEEDED
    st = jobset_status(cond("Failed", reason="FailedJobs", message="job island-0 failed"))
    assert st.state == ResourceState.FAILED and "island-0" in st.message
    assert jobset_status({}).state == ResourceState.PROVISIONING


def _v1pod(status: dict):
    """A `V1Pod`, as `CoreV1Api.read_namespaced_pod` returns it, from its JSON form."""
    from kubernetes.client import ApiClient

    return ApiClient()._ApiClient__deserialize(
        {"metadata": {"name": "p"}, "status": status}, "V1Pod"
    )


def _terminated(code: int, message: str) -> dict:
    return {
        "name": "island",
        "image": "img",
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "state": {"terminated": {"exitCode": code, "message": message}},
    }


def test_pod_status_mapping_of_real_v1pod_objects():
    assert pod_status(_v1pod({"phase": "Running"})).state == ResourceState.RUNNING
    assert pod_status(_v1pod({"phase": "Succeeded"})).state == ResourceState.SUCCEEDED
    disrupted = {"type": "DisruptionTarget", "status": "True", "message": "spot VM reclaimed"}
    preempted = _v1pod({"phase": "Failed", "conditions": [disrupted]})
    assert pod_status(preempted).state == ResourceState.PREEMPTED
    failed = _v1pod({"phase": "Failed", "containerStatuses": [_terminated(3, "loss went NaN")]})
    st = pod_status(failed)
    assert st.state == ResourceState.FAILED and "exit code 3" in st.message
    assert "loss went NaN" in st.message
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    pending = _v1pod({"phase": "Pending", "conditions": [{**unschedulable, "message": "0/3"}]})
    st = pod_status(pending)
    assert st.state == ResourceState.PROVISIONING and st.message == "0/3"


class _FakeCoreApi:
    """Just enough of CoreV1Api for the Pod lifecycle; it hands back `V1Pod` objects."""

    def __init__(self):
        self.pods: dict[tuple[str, str], dict] = {}
        self.calls: list[str] = []

    def create_namespaced_pod(self, namespace, body):
        self.calls.append("create")
        key = (namespace, body["metadata"]["name"])
        if key in self.pods:
            raise _ApiException(409, "AlreadyExists")
        self.pods[key] = {**copy.deepcopy(body), "status": {"phase": "Pending"}}
        return _v1pod(self.pods[key]["status"])

    def read_namespaced_pod(self, name, namespace):
        if (namespace, name) not in self.pods:
            raise _ApiException(404, "NotFound")
        return _v1pod(self.pods[(namespace, name)]["status"])

    def delete_namespaced_pod(self, name, namespace, **kw):
        self.calls.append("delete")
        if self.pods.pop((namespace, name), None) is None:
            raise _ApiException(404, "NotFound")


def test_backend_pod_lifecycle_with_fake_api():
    api = _FakeCoreApi()
    backend = get_backend("gke", core_api=api, poll_s=0)
    spec = _spec("g1")
    h = backend.provision(spec)
    assert h["kind"] == "Pod"
    assert backend.status(spec, h).state == ResourceState.GONE
    h = backend.launch(spec, h)
    assert backend.status(spec, h).state == ResourceState.PROVISIONING
    api.pods[("training", h["name"])]["status"] = {"phase": "Running"}
    assert backend.status(spec, {}).state == ResourceState.RUNNING
    backend.launch(spec, {})  # a retried launch replaces the earlier copy
    assert api.calls == ["create", "create", "delete", "create"] and len(api.pods) == 1
    backend.teardown(spec, h)
    backend.teardown(spec, h)  # idempotent
    assert not api.pods
