"""The Kubernetes manifests (deploy/containers/k8s/) against Kubernetes' own JSON schemas
(kubernetes-validate, strict: an unknown field is an error), and the shape of the sidecar
deployment: brokers reached by clients only through their sidecars. No cluster runs them
here; this is what is checked of them."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from deploy.containers.engine import K8S_DIR, KAFKA_IMAGE, PROXY_IMAGE, REDIS_IMAGE

pytestmark = pytest.mark.unit

# The oldest Kubernetes release the manifests are meant for, and the newest the validator
# knows.
VERSIONS = ["1.29", kubernetes_validate.utils.latest_version()]
PROXY_PORTS = {9190, 9192, 9193, 9194, 9195}


def documents() -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for doc in documents() if doc["kind"] == kind]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid(version: str) -> None:
    docs = documents()
    assert docs
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(part) for part in exc.path)
            pytest.fail(f"{name} against {version}: {path}: {exc.message}")


def test_each_kafka_pod_has_a_proxy_sidecar() -> None:
    (statefulset,) = by_kind("StatefulSet")
    pod = statefulset["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert containers["kafka"]["image"] == KAFKA_IMAGE
    assert containers["proxy"]["image"] == PROXY_IMAGE
    env = {e["name"]: e.get("value") for e in containers["proxy"]["env"]}
    assert env["DEDUP_PROXY_UPSTREAM"] == "127.0.0.1:9092", "the pod's own broker"
    assert env["DEDUP_PROXY_ADVERTISED_HOST"].startswith("$(POD_NAME)."), "its own Service"
    assert env["DEDUP_PROXY_INSTANCE_ID"] == "$(POD_NAME)"
    assert statefulset["spec"]["replicas"] == 3
    # The drain (30 s) fits in the grace period.
    assert pod["terminationGracePeriodSeconds"] > 30
    (redis,) = by_kind("Deployment")
    assert redis["spec"]["template"]["spec"]["containers"][0]["image"] == REDIS_IMAGE


def test_clients_reach_the_brokers_only_through_sidecars() -> None:
    services = {doc["metadata"]["name"]: doc for doc in by_kind("Service")}
    for ordinal in range(3):
        service = services[f"kafka-{ordinal}"]["spec"]
        assert service["selector"]["statefulset.kubernetes.io/pod-name"] == f"kafka-{ordinal}"
        assert {port["port"] for port in service["ports"]} == PROXY_PORTS
    # The brokers' own ports: only the headless Service the pods use among themselves.
    headless = services["kafka-headless"]["spec"]
    assert headless["clusterIP"] == "None"
    exposing_brokers = {
        name
        for name, doc in services.items()
        if {p["port"] for p in doc["spec"]["ports"]} & {9092, 9093}
    }
    assert exposing_brokers == {"kafka-headless"}
    policies = {doc["metadata"]["name"]: doc["spec"] for doc in by_kind("NetworkPolicy")}
    (rule,) = policies["kafka-brokers"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kafka"}}}]
