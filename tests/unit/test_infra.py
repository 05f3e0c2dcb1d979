"""infra/: the files a team deploys, checked without docker or kubectl.

- compose.yaml parses, names every service infra/README.md documents, publishes ports on
  127.0.0.1 by default, and holds no credential: every secret is `${VAR}` from the environment.
- the Kubernetes work-pool base job template passes Prefect's own work-pool validation and renders
  through Prefect's own templating (`BaseJobConfiguration.from_template_and_values`) into a Job
  that requests `nvidia.com/gpu`, with S3 credentials from a Kubernetes Secret.
- gpu-workers.sh pins one GPU per worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml

INFRA = Path(__file__).resolve().parents[2] / "infra"
REPO = INFRA.parent
SECRET_KEYS = re.compile(r"SECRET|PASSWORD|ACCESS_KEY|TOKEN|BACKEND_STORE_URI")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((INFRA / "compose.yaml").read_text())


def _readme_services() -> set[str]:
    """Services listed in the README's table of the team deployment (first column, `name`)."""
    text = (INFRA / "README.md").read_text()
    section = text.split("## Team deployment", 1)[1]
    return set(re.findall(r"^\| `([a-z0-9-]+)` \|", section, flags=re.M))


def test_compose_names_every_documented_service(compose):
    services = set(compose["services"])
    documented = _readme_services()
    assert {"postgres", "prefect-server", "mlflow", "seaweedfs", "worker-gpu"} <= documented
    assert documented == services, (documented ^ services)


def test_compose_wiring(compose):
    s = compose["services"]
    assert s["prefect-server"]["environment"]["PREFECT_SERVER_DATABASE_HOST"] == "postgres"
    assert "postgres" in s["prefect-server"]["depends_on"]
    mlflow_env = s["mlflow"]["environment"]
    assert mlflow_env["MLFLOW_ARTIFACTS_DESTINATION"].startswith("s3://")
    assert mlflow_env["MLFLOW_S3_ENDPOINT_URL"] == "http://seaweedfs:8333"
    assert "mlflow" in mlflow_env["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")
    assert s["seaweedfs"]["command"][0] == "mini"
    gpu = s["worker-gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert (REPO / gpu["build"]["dockerfile"]).is_file()
    assert "gpu-workers.sh run" in " ".join(gpu["command"])
    for name in ("worker-gpu", "worker-cpu"):
        env = s[name]["environment"]
        assert env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
        assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
        assert env["PAPERLINE_S3_ENDPOINT_URL"] == "http://seaweedfs:8333"
    for svc in s.values():  # bind mounts point at files that exist
        for vol in svc.get("volumes", []):
            src = vol.split(":", 1)[0]
            if src.startswith("."):
                assert (INFRA / src).exists(), src


def test_compose_binds_loopback_and_holds_no_secret(compose):
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert port.startswith("${PAPERLINE_BIND:-127.0.0.1}:"), (name, port)
        for key, value in (svc.get("environment") or {}).items():
            if SECRET_KEYS.search(key):
                assert re.search(r"\$\{[A-Z_]+:\?", str(value)), f"{name}.{key} is not from env"
        command = " ".join(svc.get("command", []) if isinstance(svc.get("command"), list)
                           else [svc.get("command", "")])
        assert not re.search(r"password|secret|postgresql://", command, re.I), (name, command)
    raw = "\n".join(line for line in (INFRA / "compose.yaml").read_text().splitlines()
                    if not line.lstrip().startswith("#"))
    # interpolation: every variable without a default must be named in the README
    required = set(re.findall(r"\$\{([A-Z_]+):\?", raw))
    assert required == {"POSTGRES_PASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    readme = (INFRA / "README.md").read_text()
    assert all(v in readme for v in required)


def test_worker_image_pins_the_projects_torch_and_ships_no_secrets():
    dockerfile = (INFRA / "worker.Dockerfile").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    torch_pin = re.search(r'"torch==([0-9.]+)"', pyproject).group(1)
    assert f"ARG TORCH_VERSION={torch_pin}" in dockerfile
    assert "torch==${TORCH_VERSION}" in dockerfile and "download.pytorch.org/whl/cu" in dockerfile
    assert "pip install -e ." in dockerfile
    assert not re.search(r"AWS_SECRET|PASSWORD", dockerfile.split("# No credentials")[0])
    ignored = (INFRA / "worker.Dockerfile.dockerignore").read_text().split()
    assert {".venv", ".dvc/config.local", ".paperline", ".dvc/cache"} <= set(ignored)


# ---------------------------------------------------------------------------------------------
# Kubernetes work pool: rendered by Prefect's own code


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return json.loads((INFRA / "k8s" / "gpu-work-pool.json").read_text())


def _render(template: dict[str, Any], values: dict[str, Any]):
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.base import BaseJobConfiguration

    class KubernetesJobConfiguration(BaseJobConfiguration):
        """The fields prefect-kubernetes' worker reads besides the base ones."""
        namespace: str
        job_manifest: dict[str, Any]
        job_watch_timeout_seconds: Optional[int] = None
        pod_watch_timeout_seconds: int = 60
        stream_output: bool = True

    # No block or variable references in the template: rendering never calls the API (an
    # address nothing listens on keeps Prefect from starting a temporary server).
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        return asyncio.run(KubernetesJobConfiguration.from_template_and_values(template, values))


def test_job_template_is_a_valid_work_pool_template(template):
    from prefect.server.schemas.actions import WorkPoolCreate
    from prefect.utilities.schema_tools.validation import is_valid_schema, validate

    pool = WorkPoolCreate(name="paperline-gpu-k8s", type="kubernetes", base_job_template=template)
    assert pool.base_job_template["variables"]["properties"]["gpus"]["default"] == 1
    is_valid_schema(template["variables"])
    variables = template["variables"]
    assert not validate({"gpus": 2, "image": "r/x:1"}, variables)
    assert validate({"gpus": -1}, variables)          # bounds are enforced on job variables
    assert validate({"image_pull_policy": "Sometimes"}, variables)
    broken = json.loads(json.dumps(template))
    del broken["variables"]["properties"]["gpus"]      # an undeclared placeholder is refused
    with pytest.raises(ValueError, match="gpus"):
        WorkPoolCreate(name="x", type="kubernetes", base_job_template=broken)


def test_job_template_renders_a_gpu_job(template):
    default = _render(template, {})
    spec = default.job_manifest["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert default.job_manifest["kind"] == "Job" and default.namespace == "paperline"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert container["envFrom"] == [{"secretRef": {"name": "paperline-s3"}}]
    assert default.env["PAPERLINE_S3_BUCKET"] == "paperline"
    assert not any(SECRET_KEYS.search(k) for k in default.env)   # secrets only via the Secret

    job = _render(template, {"gpus": 4, "image": "registry.example/paperline-worker:abc",
                             "memory": "80Gi", "env": {"PAPERLINE_S3_BUCKET": "team"},
                             "s3_secret_name": "team-s3"})
    container = job.job_manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 4, "memory": "80Gi"}
    assert container["image"] == "registry.example/paperline-worker:abc"
    assert container["envFrom"][0]["secretRef"]["name"] == "team-s3"
    assert job.env["PAPERLINE_S3_BUCKET"] == "team"           # deployment env merged over defaults
    assert job.env["MLFLOW_TRACKING_URI"].startswith("http://mlflow")


# ---------------------------------------------------------------------------------------------
# Process worker per GPU


def _script(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(INFRA / "gpu-workers.sh"), *args], capture_output=True,
                          text=True, timeout=30, env={**os.environ, **env})


def test_gpu_workers_recipe_pins_one_gpu_per_worker(tmp_path):
    assert subprocess.run(["bash", "-n", str(INFRA / "gpu-workers.sh")]).returncode == 0
    plan = _script("plan", GPUS="0, 3", POOL="paperline-gpu")
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.strip().splitlines()
    assert len(lines) == 2
    for gpu, line in zip(("0", "3"), lines):
        assert line.startswith(f"env CUDA_VISIBLE_DEVICES={gpu} ")
        assert "worker start --pool paperline-gpu --type process" in line
        assert line.endswith("--limit 1") and f"-gpu{gpu} " in line
    none = _script("plan", GPUS="", PATH="/usr/bin:/bin")  # no nvidia-smi, no GPUS
    assert none.returncode == 2 and "no GPUs found" in none.stderr
    assert _script("bogus").returncode == 2
