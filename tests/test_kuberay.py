"""deploy/kuberay/ against KubeRay's RayService schema (vendored: tests/data/kuberay), offline: every field it uses
exists in the CRD of the KubeRay release it names, with the right type, and none is one KubeRay ignores; and it asks
for what a GPU deployment needs (a GPU worker group, the weights from a secret and a volume, a preStop that drains
within the pod's grace, a Ray version inside the `ray` extra's range and equal to the image's)."""

from __future__ import annotations

import gzip
import json
import re
from importlib import metadata
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests/data/kuberay"
SCHEMA = DATA / "rayservice.v1.schema.json.gz"
MANIFEST = REPO / "deploy/kuberay/rayservice.yaml"
# Fields the CRD still declares but KubeRay no longer reads (rayservice_types.go at v1.7.0: "Deprecated: This field
# is not used anymore", kuberay#1685; the operator stopped using them in #1664 and #1665).
IGNORED = {".spec.serviceUnhealthySecondThreshold", ".spec.deploymentUnhealthySecondThreshold"}


def unknown_fields(value: Any, schema: dict[str, Any], where: str = "") -> list[str]:
    """The paths of fields `value` has that `schema` does not declare (Kubernetes would drop them silently)."""
    if isinstance(value, dict) and "properties" in schema:
        out = []
        for key, item in value.items():
            if key in schema["properties"]:
                out += unknown_fields(item, schema["properties"][key], f"{where}.{key}")
            elif not schema.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in schema:
                out.append(f"{where}.{key}")
        return out
    if isinstance(value, list) and "items" in schema:
        return [p for i, item in enumerate(value) for p in unknown_fields(item, schema["items"], f"{where}[{i}]")]
    return []


def paths(value: Any, where: str = "") -> set[str]:
    """Every field path in `value` (list items keep their index)."""
    if isinstance(value, dict):
        return {p for k, v in value.items() for p in {f"{where}.{k}"} | paths(v, f"{where}.{k}")}
    if isinstance(value, list):
        return {p for i, v in enumerate(value) for p in paths(v, f"{where}[{i}]")}
    return set()


def manifest() -> dict[str, Any]:
    return yaml.safe_load(MANIFEST.read_text())


def release(text: str) -> str:
    (found,) = set(re.findall(r"KubeRay[:\s]+(v\d+\.\d+\.\d+)", text))
    return found


def test_the_rayservice_manifest_follows_the_schema_of_the_kuberay_release_it_names_and_sets_nothing_ignored() -> None:
    assert release(MANIFEST.read_text()) == release((DATA / "README.md").read_text())  # the vendored CRD's release
    schema = json.loads(gzip.decompress(SCHEMA.read_bytes()))
    service = manifest()
    jsonschema.Draft4Validator(schema).validate(service)
    assert unknown_fields(service, schema) == []
    assert unknown_fields({"spec": {"rayClusterConfig": {"headGroupSpec": {"rayStartParms": {}}}}}, schema) == [
        ".spec.rayClusterConfig.headGroupSpec.rayStartParms"
    ]  # the check sees a misspelt field
    assert paths(service) & IGNORED == set()
    assert paths({"spec": {"serviceUnhealthySecondThreshold": 900}}) & IGNORED  # and an ignored one


def worker() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(the serve application's args, the GPU worker pod's spec, its Ray container)."""
    spec = manifest()["spec"]
    (application,) = yaml.safe_load(spec["serveConfigV2"])["applications"]
    (gpu,) = spec["rayClusterConfig"]["workerGroupSpecs"]
    pod = gpu["template"]["spec"]
    (container,) = pod["containers"]
    return application["args"], pod, container


def test_the_rayservice_runs_the_serve_app_on_gpu_workers_with_the_weights_from_a_secret_and_a_shared_volume() -> None:
    spec = manifest()["spec"]
    (application,) = yaml.safe_load(spec["serveConfigV2"])["applications"]
    assert application["import_path"] == "orpheus_tts_plugin.server.ray:app"
    args, pod, container = worker()
    assert args["device"] == "cuda" and container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    (mount,) = container["volumeMounts"]
    assert env["HF_HOME"]["value"].startswith(mount["mountPath"] + "/")  # the downloads land on the volume
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = yaml.safe_load((REPO / "deploy/kuberay/models-pvc.yaml").read_text())
    assert claim["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in claim["spec"]["accessModes"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_the_workers_prestop_drains_for_the_apps_drain_timeout_within_the_pods_grace() -> None:
    args, pod, container = worker()
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command == ["orpheus-ray-drain", str(args["drain_timeout"])]
    assert pod["terminationGracePeriodSeconds"] > args["drain_timeout"]
    recipe = (REPO / "docker/Dockerfile.ray").read_text()
    assert re.search(r"^COPY --chmod=0755 docker/ray-drain\.sh /usr/local/bin/orpheus-ray-drain$", recipe, re.M)


def test_the_rayservice_names_the_images_ray_inside_the_ray_extras_range() -> None:
    spec = manifest()["spec"]["rayClusterConfig"]
    version = spec["rayVersion"]
    recipe = (REPO / "docker/Dockerfile.ray").read_text()
    assert re.findall(r"^ARG RAY_VERSION=(\S+)$", recipe, re.M) == [version]
    images = {
        c["image"]
        for g in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        for c in g["template"]["spec"]["containers"]
    }
    assert images == {f"YOUR_REGISTRY/orpheus-tts-ray:{version}"}
    (ray,) = [
        r for r in map(Requirement, metadata.requires("orpheus-tts-plugin") or []) if r.name == "ray"
    ]  # the `ray` extra's, as installed (pyproject.toml)
    assert version in ray.specifier, (version, str(ray.specifier))
