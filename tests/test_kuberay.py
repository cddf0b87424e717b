"""deploy/kuberay/rayservice.yaml against KubeRay's RayService schema (vendored: tests/data/kuberay), offline: every
field it uses exists there with the right type, and it asks for what a GPU deployment needs (a GPU worker group,
probes, a grace period above the drain, the proxy's routing left to load)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "tests/data/kuberay/rayservice.v1.schema.json.gz"


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


def manifest() -> dict[str, Any]:
    return yaml.safe_load((REPO / "deploy/kuberay/rayservice.yaml").read_text())


def test_the_rayservice_manifest_follows_kuberays_schema() -> None:
    schema = json.loads(gzip.decompress(SCHEMA.read_bytes()))
    service = manifest()
    jsonschema.Draft4Validator(schema).validate(service)
    assert unknown_fields(service, schema) == []
    assert unknown_fields({"spec": {"rayClusterConfig": {"headGroupSpec": {"rayStartParms": {}}}}}, schema) == [
        ".spec.rayClusterConfig.headGroupSpec.rayStartParms"
    ]  # the check sees a misspelt field


def test_the_rayservice_runs_the_serve_app_on_gpu_workers_with_probes_and_a_drain_that_fits_its_grace() -> None:
    spec = manifest()["spec"]
    serve_config = yaml.safe_load(spec["serveConfigV2"])
    (application,) = serve_config["applications"]
    assert application["import_path"] == "orpheus_tts_plugin.server.ray:app"
    assert application["args"]["device"] == "cuda"
    (gpu,) = spec["rayClusterConfig"]["workerGroupSpecs"]
    pod = gpu["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["readinessProbe"] and container["livenessProbe"]
    assert pod["terminationGracePeriodSeconds"] > application["args"]["drain_timeout"]
