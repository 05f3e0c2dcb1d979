"""Deployments take parameters: the run form (the deployment's parameter schema, read over
Prefect's REST API as the UI reads it) offers `profile`, `force` and a pick list of the
pipeline's stages, `pipeline` is fixed; a flow run with a profile writes it to params.yaml and
publishes its tables as a markdown artifact. A real Prefect server, the synthetic DAG of
test_runner.py."""

from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import pytest

from flows.deploy import apply_profile, deploy_all
from flows.runner import pipeline_flow
from stages.core.config import UnknownNameError
from tests.prefect.test_runner import make_repo, prefect_server  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(300)


def test_run_form_and_results_artifact(prefect_server, tmp_path):  # noqa: F811
    repo = make_repo(tmp_path / "repo", sleep=0.0)
    params = repo / "params.yaml"
    params.write_text("# the profile\nprofile: cpu  # smoke | cpu | gpu\n" + params.read_text())

    assert deploy_all(repo, pipelines=["base"]) == ["paperline/paperline-base"]
    with httpx.Client(base_url=prefect_server, timeout=30) as client:
        dep = client.get("/deployments/name/paperline/paperline-base").json()
    form = dep["parameter_openapi_schema"]["properties"]
    assert form["pipeline"]["readOnly"] and form["pipeline"]["enum"] == ["base"]
    assert dep["parameters"]["pipeline"] == "base"
    assert form["force"]["type"] == "boolean" and form["force"]["default"] is False
    assert {"enum": ["smoke", "cpu", "gpu"], "type": "string"} in form["profile"]["anyOf"]
    stages = [v for v in form["targets"]["anyOf"] if v.get("type") == "array"][0]["items"]
    assert stages["enum"] == ["a_1", "a_2", "b_1", "join"]
    assert "recompute" in form["force"]["description"]

    with pytest.raises(UnknownNameError, match="smoke"):
        apply_profile(repo, "smoek")

    state = pipeline_flow(pipeline="base", root=str(repo), profile="smoke", targets=["a_2"],
                          return_state=True)
    assert state.is_completed(), state.message
    flow_run_id = str(state.state_details.flow_run_id)
    text = params.read_text()
    assert "profile: smoke  # smoke | cpu | gpu" in text and text.startswith("# the profile")

    with httpx.Client(base_url=prefect_server, timeout=30) as client:
        found = client.post("/artifacts/filter", json={
            "artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}).json()
    assert [a["key"] for a in found] == ["base-results"] and found[0]["type"] == "markdown"
    # the run's stage table (the results part below it may name any section of the toy params)
    table = found[0]["data"].split("## Stages of this run", 1)[1].split("```")[1]
    assert "a_1" in table and "a_2" in table and "ran" in table and "join" not in table


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


# CI installs chromium (.ci/run): there a missing browser is a failure, not a skip
@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="needs Debian's chromium (apt-get install chromium)")
def test_run_form_renders_in_a_browser(prefect_server, tmp_path):  # noqa: F811
    """The run form as a person opens it: the UI asks `/ui-settings` where the API is, so a
    server on any port but 4200 showed only "Can't connect to Server API" until the stack set
    the UI's API URL (flows/stack.py)."""
    repo = make_repo(tmp_path / "repo", sleep=0.0)
    deploy_all(repo, pipelines=["base"])
    base = prefect_server.removesuffix("/api")
    with httpx.Client(base_url=base, timeout=30) as client:
        dep = client.get("/api/deployments/name/paperline/paperline-base").json()
        api = httpx.URL(base + "/").join(client.get("/ui-settings").json()["api_url"])
        assert client.get(f"{api}/health").json() is True, api  # where the UI will send requests
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,1900",
         "--virtual-time-budget=30000", "--dump-dom",
         f"{base}/v2/deployments/deployment/{dep['id']}/run"],
        capture_output=True, text=True, timeout=180)
    dom = proc.stdout
    assert "connect to Server API" not in dom and "Something went wrong" not in dom, dom[-2000:]
    for label in ("profile (Optional)", "force (Optional)", "targets (Optional)", "Submit"):
        assert label in dom, (label, proc.stderr[-2000:])
