"""Replaying MLflow tracking gaps: order, redaction, several models of one name from one run,
and weights that changed since the stage ran (a real MLflow SQLite store in tmp_path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.core import tracking


def test_error_text_loses_credentials_of_the_tracking_uri():
    msg = "API request to https://alice:s3cr3t@mlflow.example:5000/api/2.0/runs failed"
    assert tracking._redact(msg) == "API request to https://mlflow.example:5000/api/2.0/runs failed"
    assert "s3cr3t" not in tracking._redact(msg)


def test_gaps_replay_in_recording_order(tmp_path: Path):
    d = tracking.gaps_dir(tmp_path)
    d.mkdir(parents=True)
    # file names sort the other way round: evaluate < train
    (d / "p.evaluate.1.json").write_text(json.dumps({"recorded": "2026-12-04T10:00:05Z"}))
    (d / "p.train.2.json").write_text(json.dumps({"recorded": "2026-12-04T10:00:01Z"}))
    assert [p.name for p, _ in tracking.list_gaps(tmp_path)] == ["p.train.2.json",
                                                                "p.evaluate.1.json"]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    """One store for the module: creating an MLflow SQLite schema takes seconds."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _model_dir(path: Path, content: str) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(content)
    return path


def test_replay_registers_every_arm_once_and_refuses_changed_weights(tmp_path, client):
    exp = client.create_experiment("p", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(exp, tags={"paperline.stage_run_id": "s1"}).info.run_id
    arms = {a: _model_dir(tmp_path / a, f'{{"arm": "{a}"}}') for a in ("erm", "racer")}
    ops = [{"op": "register_model", "local_dir": str(d), "name": "router", "aliases": [a],
            "artifact_path": f"model/{a}",
            "tags": {"paperline.model_sha": tracking.model_fingerprint(d)}}
           for a, d in arms.items()]
    gap = {"run_id": run_id, "stage_run_id": "s1", "experiment": "p", "run_name": "train",
           "failed_at": "register_model", "tags": {}, "ops": ops + [{"op": "end",
                                                                     "status": "FINISHED"}]}
    for _ in range(2):  # a second replay adds nothing
        tracking._replay(client, gap)
        versions = client.search_model_versions("name = 'router'")
        assert sorted(v.source.rsplit("/", 1)[-1] for v in versions) == ["erm", "racer"]
    assert client.get_model_version_by_alias("router", "racer").run_id == run_id

    (arms["erm"] / "config.json").write_text('{"arm": "retrained"}')
    with pytest.raises(tracking.GapNotReady, match="gone or changed"):
        tracking._replay(client, gap)


def test_replay_does_not_overwrite_a_retry_that_finished_the_run(tmp_path, client):
    exp = client.create_experiment("q")
    run_id = client.create_run(exp, tags={"paperline.stage_run_id": "retry"}).info.run_id
    client.set_terminated(run_id, status="FINISHED")
    gap = {"run_id": run_id, "stage_run_id": "first", "experiment": "q", "run_name": "s",
           "failed_at": "log_metrics", "tags": {}, "ops": [{"op": "end", "status": "FAILED"}]}
    tracking._replay(client, gap)
    assert client.get_run(run_id).info.status == "FINISHED"
