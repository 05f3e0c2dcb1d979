"""The README's screenshots, taken as a person sees them: headless Chromium on the stack's MLflow
and Prefect UIs of a repo where `paperline repro racer` ran (any profile).

    python docs/img/screenshots.py [REPO]      # default: this repo; writes docs/img/*.png

Starts the stack's MLflow and Prefect servers if they are not up (and stops them again), opens
MLflow's own Compare page for the racer routers and baselines at one budget (seed 0), the
experiment's runs table, and Prefect's run form of deployment `paperline-racer` (created or
updated here). Needs Debian's chromium (`apt-get install chromium`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from flows import stack  # noqa: E402

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]


def shoot(url: str, out: Path, size: str = "1500,950") -> Path:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        raise SystemExit("chromium not found: apt-get install chromium")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", f"--window-size={size}",
                        "--virtual-time-budget=20000", f"--screenshot={out}", url],
                       check=True, capture_output=True, timeout=120)
    return out


def main(repo: Path) -> None:
    from mlflow import MlflowClient

    started = stack.mlflow_url(repo) is None
    if started:
        stack.up(repo, mlflow_port=stack.free_port(), components=("mlflow",), quiet=True)
    try:
        url = stack.mlflow_url(repo)
        client = MlflowClient(tracking_uri=url)
        exp = client.get_experiment_by_name("racer")
        if exp is None:
            raise SystemExit(f"no racer experiment in {repo}: run `paperline repro racer`")
        runs = client.search_runs([exp.experiment_id], "tags.`paperline.stage` = 'evaluate'",
                                  order_by=["attributes.start_time DESC"], max_results=500)
        methods = [r for r in runs if r.data.tags.get("paperline.method")
                   and r.data.params.get("seed") == "0"]
        budget = sorted({r.data.params["budget"] for r in methods} - {"none"})[0]
        latest: dict[str, str] = {}
        for r in methods:
            if r.data.params["budget"] in (budget, "none"):
                latest.setdefault(r.data.tags["paperline.method"], r.info.run_id)
        ids = list(latest.values())
        # MLflow 3.17 shows the view of its sidebar switch (GenAI | Model training; the browser
        # remembers a click, a new browser starts in GenAI); `workflowType` in the URL sets it,
        # and links from that page keep it (the URL `paperline stack up` prints).
        print(shoot(f"{url}/#/experiments/{exp.experiment_id}?workflowType=machine_learning",
                    HERE / "mlflow-runs.png", "1700,900"))
        page = (f"{url}/#/compare-runs?runs={quote(json.dumps(ids))}"
                f"&experiments={quote(json.dumps([exp.experiment_id]))}"
                "&workflowType=machine_learning")
        print(shoot(page, HERE / "mlflow-compare.png", "1700,2000"))
    finally:
        if started:
            stack.down(repo, quiet=True)
    prefect_run_form(repo)


def prefect_run_form(repo: Path) -> None:
    """Prefect's *Custom run* form of `paperline-racer`: what a person fills in to run it."""
    import httpx
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deploy import deploy_all

    started = stack.prefect_api_url(repo) is None
    if started:
        stack.up(repo, prefect_port=stack.free_port(), components=("prefect",), quiet=True)
    try:
        api = stack.prefect_api_url(repo)
        with temporary_settings(updates={PREFECT_API_URL: api}):
            deploy_all(repo, pipelines=["racer"])
        dep = httpx.get(f"{api}/deployments/name/paperline/paperline-racer", timeout=30).json()
        print(shoot(f"{api.removesuffix('/api')}/v2/deployments/deployment/{dep['id']}/run",
                    HERE / "prefect-run-form.png", "1400,1350"))
    finally:
        if started:
            stack.down(repo, quiet=True)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else HERE.parents[1]).resolve())
