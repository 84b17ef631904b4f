"""The Kubernetes manifests of deploy/kubernetes: every object is valid against the
Kubernetes API schema, and the pieces agree with one another and with the flags of the two
programs they run. A mismatched label, port or flag would otherwise show only in a cluster,
as a router that finds no worker or a rolling restart that cuts requests off."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from asyncinfer.cli import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
KUSTOMIZATION = "kustomization.yaml"
# A Kubernetes release whose schema kubernetes-validate bundles; the manifests use nothing
# newer, so they apply to clusters from this release on.
KUBERNETES_VERSION = "1.30.0"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
# Objects of custom resources, whose schemas are a CRD's, not the Kubernetes API's: checked
# in tests/test_deploy_inference_pool.py against schemas of their own.
CUSTOM_GROUPS = ("inference.networking.k8s.io/", "gateway.networking.k8s.io/")

Manifest = dict[str, Any]


def manifest_files() -> list[Path]:
    """The files of Kubernetes objects, in every folder (the kustomizations are kustomize's,
    not the API's)."""
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != KUSTOMIZATION)


def kustomized(folder: Path) -> list[Manifest]:
    """The objects ``kubectl apply -k folder`` applies: its files' and, recursively, its
    folders' (before kustomize sets the namespace)."""
    found: list[Manifest] = []
    for resource in yaml.safe_load((folder / KUSTOMIZATION).read_text())["resources"]:
        path = (folder / resource).resolve()
        if path.is_dir():
            found += kustomized(path)
        else:
            with path.open() as stream:
                found += [doc for doc in yaml.safe_load_all(stream) if doc]
    return found


def manifests() -> list[tuple[str, Manifest]]:
    """Every object of every file, with the file's name."""
    found = []
    for path in manifest_files():
        with path.open() as stream:
            found += [(str(path.relative_to(DEPLOY)), doc)
                      for doc in yaml.safe_load_all(stream) if doc]
    return found


def find(kind: str, name: str) -> Manifest:
    """The one object of this kind and name."""
    matches = [doc for _, doc in manifests()
               if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(matches) == 1, f"{len(matches)} {kind} objects named {name}"
    return matches[0]


def worker() -> Manifest:
    return find("Deployment", "asyncinfer-worker")


def router() -> Manifest:
    return find("Deployment", "asyncinfer-router")


def container(deployment: Manifest) -> Manifest:
    """The Deployment's only container (both run exactly one)."""
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: Manifest = containers[0]
    return container


def pod_labels(deployment: Manifest) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def container_port(item: Manifest, name: str) -> int:
    """The number of the container port called ``name``."""
    numbers = [p["containerPort"] for p in item["ports"] if p.get("name") == name]
    assert len(numbers) == 1, f"no single port named {name!r}"
    number: int = numbers[0]
    return number


def worker_args() -> argparse.Namespace:
    """The worker's command line as ``asyncinfer`` itself parses it (an unknown flag or a
    bad value fails here, as it would in the pod)."""
    item = container(worker())
    assert item["command"][0] == "asyncinfer"
    try:
        return build_parser().parse_args([*item["command"][1:], *item["args"]])
    except SystemExit:  # argparse has printed why on stderr
        pytest.fail(f"asyncinfer rejects the worker's arguments {item['args']}")


def router_flags() -> dict[str, list[str]]:
    """The router's flags: ``--flag=value``, ``--flag v1 v2`` or a bare ``--flag`` (no
    values), by name."""
    flags: dict[str, list[str]] = {}
    current: list[str] = []
    for arg in container(router())["args"]:
        if arg.startswith("--"):
            name, equals, value = arg.partition("=")
            assert name not in flags, f"{name} given twice"
            current = flags[name] = [value] if equals else []
        else:
            current.append(arg)
    return flags


def router_flag(name: str) -> str:
    values = router_flags()[name]
    assert len(values) == 1, f"{name}: {values}"
    return values[0]


API_OBJECTS = [(f, d) for f, d in manifests() if not d["apiVersion"].startswith(CUSTOM_GROUPS)]


@pytest.mark.parametrize(("path", "manifest"), API_OBJECTS,
                         ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in API_OBJECTS])
def test_each_object_is_valid_against_the_kubernetes_schema(path: str,
                                                            manifest: Manifest) -> None:
    """Strict validation also rejects fields the schema does not know (a misspelled
    ``readinesProbe`` would otherwise be dropped silently by an older kubectl)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def test_strict_validation_rejects_an_unknown_field() -> None:
    """The check above is not vacuous: the same worker with one misspelled field fails."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    broken = worker()
    item = container(broken)
    item["readinesProbe"] = item.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_no_two_objects_share_a_kind_and_name() -> None:
    """``kubectl apply`` lets a later object replace an earlier one of the same kind and name
    without a word; each object the other tests need is found by ``find`` (exactly one)."""
    keys = [(doc["kind"], doc["metadata"]["name"]) for _, doc in manifests()]
    assert keys and len(keys) == len(set(keys)), keys


@pytest.mark.parametrize("folder", sorted(p.parent for p in DEPLOY.rglob(KUSTOMIZATION)),
                         ids=lambda p: str(p.relative_to(DEPLOY)) or ".")
def test_each_kustomization_lists_every_file_of_its_folder(folder: Path) -> None:
    """``kubectl apply -k`` applies only the listed files: a new file must be added there,
    and a listed folder must be a kustomization itself."""
    resources = yaml.safe_load((folder / KUSTOMIZATION).read_text())["resources"]
    files = [r for r in resources if not (folder / r).is_dir()]
    assert sorted(files) == sorted(p.name for p in folder.glob("*.yaml")
                                   if p.name != KUSTOMIZATION)
    for sub in set(resources) - set(files):
        assert (folder / sub / KUSTOMIZATION).is_file(), sub


def test_every_file_is_applied_by_some_kustomization() -> None:
    """No manifest is left out of both deployments: each object is applied by the
    sglang-router kustomization or the Inference Extension's."""
    applied = [kustomized(p.parent) for p in DEPLOY.rglob(KUSTOMIZATION)]
    for _, doc in manifests():
        assert any(doc in objects for objects in applied), doc["metadata"]["name"]


@pytest.mark.parametrize("name", ["asyncinfer-worker", "asyncinfer-router"])
def test_each_deployment_selects_its_own_pods(name: str) -> None:
    """A selector that does not match the template's labels is rejected by the API server."""
    deployment = find("Deployment", name)
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector and selector.items() <= pod_labels(deployment).items()


def test_the_router_service_reaches_the_router() -> None:
    service = find("Service", "asyncinfer-router")
    assert service["spec"]["selector"].items() <= pod_labels(router()).items()
    declared = {p["name"] for p in container(router())["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in declared


def test_the_router_discovers_the_worker_pods() -> None:
    """The router's label selector picks the worker pods, it talks to the port the worker
    listens on, and it watches the namespace it runs in (the workers' one)."""
    flags = router_flags()
    assert flags["--service-discovery"] == []
    selector = dict(pair.split("=", 1) for pair in flags["--selector"])
    assert selector and selector.items() <= pod_labels(worker()).items()
    port = int(router_flag("--service-discovery-port"))
    assert port == container_port(container(worker()), "http") == worker_args().port
    assert worker_args().host == "0.0.0.0"
    assert router_flag("--service-discovery-namespace") == "$(POD_NAMESPACE)"
    env = {e["name"]: e for e in container(router())["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_sglang_router_reads_the_flags_the_same_way() -> None:
    """The router's own parser accepts its command line and reads the same selector and
    ports as the checks above."""
    launch_router = pytest.importorskip("sglang_router.launch_router")
    item = container(router())
    assert item["command"] == ["python", "-m", "sglang_router.launch_router"]
    parsed = launch_router.parse_router_args(item["args"])
    assert parsed.service_discovery
    assert parsed.selector.items() <= pod_labels(worker()).items()
    assert parsed.service_discovery_port == container_port(container(worker()), "http")
    assert parsed.port == container_port(item, "http")
    assert parsed.prometheus_port == container_port(item, "metrics")


@pytest.mark.parametrize("name", ["asyncinfer-worker", "asyncinfer-router"])
def test_every_probe_uses_a_declared_port(name: str) -> None:
    item = container(find("Deployment", name))
    declared = {p["containerPort"] for p in item["ports"]} | {p["name"] for p in item["ports"]}
    probes = [item[probe] for probe in PROBES if probe in item]
    assert len(probes) >= 2, "readiness and liveness at least"
    for probe in probes:
        assert probe["httpGet"]["port"] in declared


def test_the_worker_probes_fit_its_shutdown() -> None:
    """Every probe asks /health. Readiness notices SIGTERM's 503 before --shutdown-delay
    ends (the pod leaves the endpoints while it still serves); liveness tolerates one slow
    answer; startup allows minutes of loading."""
    item = container(worker())
    assert {item[probe]["httpGet"]["path"] for probe in PROBES} == {"/health"}
    readiness = item["readinessProbe"]
    assert readiness["periodSeconds"] * readiness["failureThreshold"] < worker_args().shutdown_delay
    assert item["livenessProbe"]["failureThreshold"] >= 3
    startup = item["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_the_router_takes_a_worker_out_before_its_drain() -> None:
    """The router's /health polling must mark a stopping worker unhealthy within the
    worker's --shutdown-delay, while it still serves: otherwise requests routed to it
    meanwhile are refused once the drain starts."""
    interval = float(router_flag("--health-check-interval-secs"))
    failures = int(router_flag("--health-failure-threshold"))
    assert interval * (failures + 1) <= worker_args().shutdown_delay


def test_the_worker_grace_period_covers_its_shutdown() -> None:
    """Kubernetes kills the container when the grace period runs out: it must last longer
    than the 503 phase plus the drain of requests in flight."""
    args = worker_args()
    grace = worker()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > args.shutdown_delay + args.shutdown_timeout


def test_the_worker_prestop_signals_the_server_and_waits() -> None:
    """The preStop hook sends SIGTERM to PID 1 and waits for it to exit; PID 1 is the
    server only when the command is exec-form ``asyncinfer`` (under ``sh -c`` the shell
    would get the signal)."""
    item = container(worker())
    assert item["command"][:2] == ["asyncinfer", "serve"]
    script = item["lifecycle"]["preStop"]["exec"]["command"]
    assert script[:2] == ["/bin/sh", "-c"]
    assert "kill -TERM 1" in script[2] and "while kill -0 1" in script[2]


def test_the_router_grace_period_covers_its_shutdown() -> None:
    spec = router()["spec"]["template"]["spec"]
    sleep = container(router())["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    grace = int(router_flag("--shutdown-grace-period-secs"))
    assert spec["terminationGracePeriodSeconds"] > int(sleep[1]) + grace


def test_the_worker_gets_a_gpu_per_rank_and_the_model_volume() -> None:
    """One GPU per tensor-parallel rank; the model directory inside the read-only mount of
    the asyncinfer-models claim."""
    args = worker_args()
    spec = worker()["spec"]["template"]["spec"]
    item = container(worker())
    assert args.device == "cuda"
    assert item["resources"]["limits"]["nvidia.com/gpu"] == args.tensor_parallel_size
    volumes = {v["name"]: v for v in spec["volumes"]}
    mount = next(m for m in item["volumeMounts"]
                 if volumes[m["name"]].get("persistentVolumeClaim", {}).get("claimName")
                 == "asyncinfer-models")
    assert mount["readOnly"]
    assert Path(args.model).parent == Path(mount["mountPath"])


def test_the_router_may_watch_pods_in_its_namespace() -> None:
    """Service discovery lists and watches pods: the router's ServiceAccount must be bound
    to a Role that allows it (the router logs API errors and finds no worker otherwise)."""
    account = router()["spec"]["template"]["spec"]["serviceAccountName"]
    find("ServiceAccount", account)
    bindings = [doc for _, doc in manifests() if doc["kind"] == "RoleBinding"
                and {"kind": "ServiceAccount", "name": account} in doc["subjects"]]
    assert bindings
    allowed: set[str] = set()
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role"
        role = find("Role", binding["roleRef"]["name"])
        for rule in role["rules"]:
            if "" in rule["apiGroups"] and "pods" in rule["resources"]:
                allowed |= set(rule["verbs"])
    assert {"get", "list", "watch"} <= allowed
