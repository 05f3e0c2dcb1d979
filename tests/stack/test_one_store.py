"""One MLflow store for everything, and no run left RUNNING, against a real MLflow server.

`paperline stack up` serves the embedded store (`.paperline/mlflow/mlflow.db`): what a plain run
logged before `up` is in its UI, and what is logged through it stays in the file after `down`.
A parent run whose close does not reach MLflow (the server is down at the end of the execution)
is closed when the gap is replayed, by `paperline tracking sync` through the stack's server that
came back; a stage killed mid-run left its run RUNNING: closing the parent marks it (and its
method runs) KILLED.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from flows import cli, stack
from stages.core import tracking

pytestmark = [pytest.mark.stack, pytest.mark.timeout(300)]


def _repo(path: Path) -> Path:
    (path / ".dvc").mkdir(parents=True)
    (path / "params.yaml").write_text("profile: smoke\n")
    return path


def test_the_stack_serves_the_embedded_store_and_closes_every_run(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    root = _repo(tmp_path / "repo")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("PAPERLINE_ROOT", str(root))
    for key, value in {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",  # a dead server: fail fast
                       "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}.items():
        monkeypatch.setenv(key, value)

    # what `make run` leaves: a finished run in the embedded store, no server anywhere
    embedded = tracking.embedded_uri(root, create=True)
    local = MlflowClient(tracking_uri=embedded, registry_uri=embedded)
    exp = tracking.experiment_id(root, "p", local)
    before = local.create_run(exp, run_name="before-the-stack").info.run_id
    local.log_metric(before, "acc", 0.5)
    local.set_terminated(before)
    assert stack.tracking_uri(root) == embedded

    stack.up(root, mlflow_port=stack.free_port(), components=("mlflow",), timeout=120,
             quiet=True)
    try:
        url = stack.mlflow_url(root)
        assert url and stack.tracking_uri(root) == url  # the running stack, as `repro` uses it
        assert tracking.store_of(root, url) == embedded
        server = MlflowClient(tracking_uri=url, registry_uri=url)
        assert server.get_run(before).data.metrics == {"acc": 0.5}  # in the stack's UI
        kind = server.get_experiment(exp).tags.get("mlflow.experimentKind")
        assert kind == "custom_model_development"  # the classic view, not GenAI

        # an experiment made through the server keeps its artifacts beside the same file
        exp_q = tracking.experiment_id(root, "q", server)
        run_q = server.create_run(exp_q).info.run_id
        (tmp_path / "table.md").write_text("| a |\n")
        server.log_artifact(run_q, str(tmp_path / "table.md"))
        server.set_terminated(run_q)
        assert list((root / ".paperline" / "mlflow" / "artifacts" / "q").rglob("table.md"))

        # an execution: a parent run, a stage killed mid-run (its run and method run RUNNING)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        parent = tracking.start_parent_run(root, "p")
        stage = server.create_run(exp, run_name="train",
                                  tags={"mlflow.parentRunId": parent}).info.run_id
        method = server.create_run(exp, tags={"mlflow.parentRunId": stage}).info.run_id
        done = server.create_run(exp, run_name="tasks",
                                 tags={"mlflow.parentRunId": parent}).info.run_id
        server.set_terminated(done)

        # MLflow goes down before the execution ends: the close is recorded, not lost
        assert stack._stop(root, "mlflow", 20) in ("stopped", "killed")
        t0 = int(time.time() * 1000)
        tracking.end_parent_run(root, parent, ok=False)
        gaps = tracking.list_gaps(root)
        assert [g["failed_at"] for _, g in gaps] == ["end_parent_run"]
        assert gaps[0][1]["store"] == embedded

        # MLflow back; `paperline tracking sync` with no MLFLOW_TRACKING_URI finds the stack
        stack.up(root, components=("mlflow",), timeout=120, quiet=True)
        monkeypatch.delenv("MLFLOW_TRACKING_URI")
        assert cli.main(["tracking", "sync"]) == 0
        assert tracking.list_gaps(root) == []
        assert os.environ.get("MLFLOW_TRACKING_URI") == url
        closed = server.get_run(parent).info
        assert closed.status == "FAILED" and t0 <= closed.end_time <= time.time() * 1000
        assert server.get_run(stage).info.status == "KILLED"
        assert server.get_run(method).info.status == "KILLED"
        assert server.get_run(done).info.status == "FINISHED"
    finally:
        stack.down(root, quiet=True)
        os.environ.pop("MLFLOW_TRACKING_URI", None)

    # the stack is down: the file holds all of it
    statuses = {r.info.run_id: r.info.status for r in local.search_runs([exp])}
    assert statuses[parent] == "FAILED" and statuses[stage] == "KILLED"
    assert local.get_run(run_q).info.status == "FINISHED"
