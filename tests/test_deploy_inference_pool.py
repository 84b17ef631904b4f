"""deploy/kubernetes/inference-extension: the workers behind the Gateway API Inference
Extension. The InferencePool and the HTTPRoute are valid against their APIs' schemas (tests/
schemas/, with unknown fields rejected), the pool selects the worker pods on their port and
names the endpoint picker's Service, the picker watches its pool and reads metrics that an
asyncinfer server exports, and the route sends the Gateway's traffic to the pool."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from asyncinfer.server import create_app
from tests.test_deploy import (
    DEPLOY,
    Manifest,
    container,
    container_port,
    find,
    kustomized,
    pod_labels,
    worker,
)
from tests.test_server import StubEngine

SCHEMAS = Path(__file__).resolve().parent / "schemas"
EXTENSION = DEPLOY / "inference-extension"
POOL_GROUP = "inference.networking.k8s.io"


def schema(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((SCHEMAS / name).read_text())
    return loaded


def validate(manifest: Manifest, name: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(manifest, schema(name), cls=jsonschema.Draft202012Validator)


def pool() -> Manifest:
    return find("InferencePool", "asyncinfer")


def picker() -> Manifest:
    return find("Deployment", "asyncinfer-epp")


def picker_flags() -> dict[str, str]:
    """The endpoint picker's ``--flag=value`` arguments, by name."""
    flags: dict[str, str] = {}
    for arg in container(picker())["args"]:
        name, equals, value = arg.partition("=")
        assert name.startswith("--") and equals, f"not --flag=value: {arg}"
        assert name not in flags, f"{name} given twice"
        flags[name] = value
    return flags


def test_the_pool_and_the_route_are_valid_against_their_schemas() -> None:
    validate(pool(), "inferencepool-v1.yaml")
    validate(find("HTTPRoute", "asyncinfer"), "httproute-v1.yaml")
    ports = [p["number"] for p in pool()["spec"]["targetPorts"]]
    assert len(ports) == len(set(ports)), "the CRD's rule: target ports are unique"
    ref = pool()["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref, (
        "the CRD's rule: a Service picker needs its port")


@pytest.mark.parametrize(("kind", "schema_name", "path"), [
    ("InferencePool", "inferencepool-v1.yaml", ("spec", "targetPort")),
    ("InferencePool", "inferencepool-v1.yaml", ("spec", "endpointPickerRef", "failureMod")),
    ("HTTPRoute", "httproute-v1.yaml", ("spec", "rules", 0, "backendRef"))])
def test_the_schemas_reject_a_misspelled_field(kind: str, schema_name: str,
                                               path: tuple[str | int, ...]) -> None:
    """The check above is not vacuous: one misspelled field fails it."""
    jsonschema = pytest.importorskip("jsonschema")
    broken = copy.deepcopy(find(kind, "asyncinfer"))
    parent: Any = broken
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = "typo"
    with pytest.raises(jsonschema.ValidationError, match="Additional properties"):
        jsonschema.validate(broken, schema(schema_name), cls=jsonschema.Draft202012Validator)


def test_the_pool_selects_the_worker_pods_on_their_port() -> None:
    spec = pool()["spec"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels(worker()).items()
    assert [p["number"] for p in spec["targetPorts"]] == [
        container_port(container(worker()), "http")]


def test_the_pool_names_the_pickers_service_and_its_ext_proc_port() -> None:
    """The Gateway reaches the picker through the Service the pool names, on a service port
    that targets the picker's gRPC port, and the picker serves that pool."""
    ref = pool()["spec"]["endpointPickerRef"]
    service = find("Service", ref["name"])
    assert service["spec"]["selector"].items() <= pod_labels(picker()).items()
    port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert port["appProtocol"] == "http2"
    assert port["targetPort"] == "grpc"
    flags = picker_flags()
    assert container_port(container(picker()), "grpc") == int(flags["--grpc-port"])
    assert flags["--pool-name"] == pool()["metadata"]["name"]
    assert flags["--pool-namespace"] == "$(POD_NAMESPACE)"
    env = {e["name"]: e for e in container(picker())["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_the_pickers_probes_ask_its_health_port() -> None:
    item = container(picker())
    health = int(picker_flags()["--grpc-health-port"])
    assert container_port(item, "grpc-health") == health
    for probe in ("readinessProbe", "livenessProbe"):
        assert item[probe]["grpc"]["port"] == health


def test_the_picker_may_watch_its_pool_and_the_pods() -> None:
    account = picker()["spec"]["template"]["spec"]["serviceAccountName"]
    find("ServiceAccount", account)
    allowed: dict[tuple[str, str], set[str]] = {}
    for doc in kustomized(EXTENSION):
        if doc["kind"] == "RoleBinding" and {"kind": "ServiceAccount",
                                             "name": account} in doc["subjects"]:
            for rule in find("Role", doc["roleRef"]["name"])["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        allowed.setdefault((group, resource), set()).update(rule["verbs"])
    for needed in ((POOL_GROUP, "inferencepools"), ("", "pods")):
        assert {"get", "list", "watch"} <= allowed.get(needed, set()), needed


def test_the_route_sends_the_gateways_traffic_to_the_pool() -> None:
    (rule,) = find("HTTPRoute", "asyncinfer")["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["backendRefs"] == [{"group": POOL_GROUP, "kind": "InferencePool",
                                    "name": pool()["metadata"]["name"]}]


def test_the_extension_applies_the_workers_and_not_the_sglang_router() -> None:
    objects = {(d["kind"], d["metadata"]["name"]) for d in kustomized(EXTENSION)}
    assert ("Deployment", "asyncinfer-worker") in objects
    assert ("InferencePool", "asyncinfer") in objects
    assert not any(name == "asyncinfer-router" for _, name in objects)


async def test_every_metric_the_picker_reads_is_served_by_an_asyncinfer_server() -> None:
    """The picker scores pods by metrics it scrapes by name: each name its flags give is a
    metric family of a running server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    async with TestClient(TestServer(create_app(StubEngine()))) as client:
        text = await (await client.get("/metrics")).text()
    served = {family.name for family in text_string_to_metric_families(text)}
    wanted = {value for name, value in picker_flags().items() if name.endswith("-metric")}
    assert len(wanted) == 5
    assert wanted <= served, wanted - served


def test_the_worker_pods_say_which_engines_metric_names_they_export() -> None:
    """The picker reads a pod's metrics under the names its engine-type label gives."""
    assert pod_labels(worker())["inference.networking.k8s.io/engine-type"] == "vllm"
