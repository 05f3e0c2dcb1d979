"""Replaying MLflow tracking gaps: order, redaction, several models of one name from one run,
and weights that changed since the stage ran (a real MLflow SQLite store in tmp_path)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stages.core import tracking

REPO = Path(__file__).resolve().parents[2]


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

    # once registered, a repeated replay needs no files (its snapshot may be removed since)
    for d in arms.values():
        (d / "config.json").unlink()
    tracking._replay(client, gap)
    assert len(client.search_model_versions("name = 'router'")) == 2

    # a first replay of weights that changed since the stage ran is refused
    late = client.create_run(exp, tags={"paperline.stage_run_id": "s2"}).info.run_id
    d = _model_dir(tmp_path / "late", '{"arm": "late"}')
    op = dict(ops[0], local_dir=str(d), tags={"paperline.model_sha": tracking.model_fingerprint(d)})
    (d / "config.json").write_text('{"arm": "retrained"}')
    with pytest.raises(tracking.GapNotReady, match="gone or changed"):
        tracking._replay(client, dict(gap, run_id=late, stage_run_id="s2", ops=[op]))


def test_a_single_file_registers_as_the_one_file_of_its_version(tmp_path, client):
    """A fitted profile JSON (stage profile_engine) is registered as it is, also on replay, from
    the snapshot a tracking gap keeps of it."""
    exp = client.create_experiment("f", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(exp, tags={"paperline.stage_run_id": "f1"}).info.run_id
    prof = tmp_path / "data" / "profile.json"
    prof.parent.mkdir()
    prof.write_text('{"name": "tiny-cpu"}')
    snap = tracking.snapshot(prof, tmp_path, "f1", 0)
    assert Path(snap).is_file() and Path(snap).name == "profile.json"
    op = {"op": "register_model", "local_dir": snap, "name": "serving-profile",
          "aliases": ["champion"], "artifact_path": "profile",
          "tags": {"paperline.model_sha": tracking.model_fingerprint(prof)}}
    gap = {"run_id": run_id, "stage_run_id": "f1", "experiment": "f", "run_name": "profile",
           "failed_at": "register_model", "tags": {}, "ops": [op, {"op": "end",
                                                                  "status": "FINISHED"}]}
    tracking._replay(client, gap)
    v = client.get_model_version_by_alias("serving-profile", "champion")
    assert v.run_id == run_id and v.source.endswith("/profile")
    assert [f.path for f in client.list_artifacts(run_id, "profile")] == ["profile/profile.json"]
    got = client.download_artifacts(run_id, "profile/profile.json", str(tmp_path / "dl"))
    assert Path(got).read_text() == '{"name": "tiny-cpu"}'


def test_replay_does_not_overwrite_a_retry_that_finished_the_run(tmp_path, client):
    exp = client.create_experiment("q")
    run_id = client.create_run(exp, tags={"paperline.stage_run_id": "retry"}).info.run_id
    client.set_terminated(run_id, status="FINISHED")
    gap = {"run_id": run_id, "stage_run_id": "first", "experiment": "q", "run_name": "s",
           "failed_at": "log_metrics", "tags": {}, "ops": [{"op": "end", "status": "FAILED"}]}
    tracking._replay(client, gap)
    assert client.get_run(run_id).info.status == "FINISHED"


def test_replay_of_a_method_run_completes_the_params_of_a_run_made_part_way(client):
    """A replay that created the method run and died before all its params were logged: the
    next replay finds that run (no second one) and logs the params it lacks."""
    exp = client.create_experiment("m")
    parent = client.create_run(exp).info.run_id
    gap = {"stage_run_id": "sr1", "experiment": "m", "run_name": "arms", "tags": {}}
    key = "sr1/arms/grpo/0"
    made = client.create_run(exp, tags={"paperline.method_run_key": key}).info.run_id
    client.log_param(made, "beta", "0.0")  # the first of two params, then the replay died
    op = {"group": "arms", "method": "grpo", "seed": 0, "params": {"beta": 0.0, "lr": 0.001},
          "metrics": [{"metrics": {"acc": 0.5}, "timestamp": 1, "step": 0}]}
    tracking._replay_method_run(client, parent, gap, op)
    tracking._replay_method_run(client, parent, gap, op)  # again: nothing added twice
    runs = client.search_runs([exp], f"tags.`paperline.method_run_key` = '{key}'")
    assert [r.info.run_id for r in runs] == [made]
    assert runs[0].data.params == {"beta": "0.0", "lr": "0.001"}
    assert [m.value for m in client.get_metric_history(made, "acc")] == [0.5]


# ---------------------------------------------------------------------------------------------
# Spooled tracking (`PAPERLINE_TRACKING=spool`, what `paperline repro` gives its stages)

SPOOL_STAGE = r'''
import json, sys
from pathlib import Path
from types import SimpleNamespace
from pydantic import BaseModel
from stages.core.tracking import StageTracker

class Cfg(BaseModel):
    lr: float = 0.1

root = Path(sys.argv[1])
ctx = SimpleNamespace(root=root, pipeline_dir=root, pipeline="p", stage=sys.argv[2],
                      profile="smoke", seed=0)
with StageTracker(ctx, Cfg()) as t:
    t.log_metrics({"acc": 0.5})
    with t.method_run("arms", "grpo", 1, {"beta": 0.0}) as run:
        run.log_metrics({"acc": 0.25}, step=3)
print(json.dumps({"mlflow_imported": "mlflow" in sys.modules, "gap": str(t.gap_file)}))
'''


def _spooled_stage(root: Path, stage: str, parent: str) -> dict:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PAPERLINE_TRACKING": "spool", "PAPERLINE_PARENT_RUN_ID": parent,
           "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", SPOOL_STAGE, str(root), stage], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(autouse=True)
def _mlflow_uris_restored():
    """`sync_gaps` points mlflow's process-wide tracking and registry URIs at its store (as a
    `paperline` command should); a test must not leave them at its temporary store for the
    next test of this worker."""
    import mlflow.tracking._model_registry.utils as registry
    import mlflow.tracking._tracking_service.utils as tracking_service

    saved = tracking_service._tracking_uri, registry._registry_uri
    yield
    tracking_service._tracking_uri, registry._registry_uri = saved


def test_spooled_stages_touch_no_mlflow_and_replay_under_one_parent(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    token = tracking.spool_parent(tmp_path, "p", tags={"paperline.executor": "test"})
    assert token.startswith(tracking.SPOOL_PARENT)
    stages = [_spooled_stage(tmp_path, s, token) for s in ("train", "evaluate")]
    assert not any(s["mlflow_imported"] for s in stages)  # the whole point: no MLflow start-up
    assert len(tracking.list_gaps(tmp_path)) == 2

    tracking.finish_spooled_parent(tmp_path, token, ok=True)
    assert tracking.list_gaps(tmp_path) == []
    assert not tracking._parent_file(tmp_path, token).exists()
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("p")
    parents = client.search_runs([exp.experiment_id], "tags.`paperline.kind` = 'pipeline'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert parents[0].data.tags["paperline.executor"] == "test"
    children = client.search_runs([exp.experiment_id], "tags.mlflow.parentRunId = "
                                                       f"'{parents[0].info.run_id}'")
    assert sorted(c.info.run_name for c in children) == ["evaluate", "train"]
    for c in children:
        assert c.info.status == "FINISHED" and c.data.metrics["acc"] == 0.5
        assert c.data.params["lr"] == "0.1"
        assert c.info.start_time <= c.info.end_time  # the stage's own times, not the replay's
        assert c.info.end_time <= parents[0].info.end_time
        assert "paperline.tracking_gap" not in c.data.tags  # not an outage
        method = client.search_runs([exp.experiment_id], "tags.mlflow.parentRunId = "
                                                         f"'{c.info.run_id}'")
        assert [m.data.tags["paperline.method"] for m in method] == ["grpo"]
        assert method[0].data.metrics["acc"] == 0.25

    # the same stage again under the same execution (a retry): the same run, attempt 2
    again = tracking.spool_parent(tmp_path, "p")
    first = _spooled_stage(tmp_path, "train", again)
    second = _spooled_stage(tmp_path, "train", again)
    assert first["gap"] != second["gap"]
    tracking.finish_spooled_parent(tmp_path, again, ok=True)
    runs = client.search_runs([exp.experiment_id], "attributes.run_name = 'train'")
    mine = [r for r in runs if r.data.tags.get("paperline.attempts")]
    assert len(runs) == 2 and len(mine) == 1 and mine[0].data.tags["paperline.attempts"] == "2"


def test_an_execution_where_nothing_ran_creates_no_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'never.db'}")
    token = tracking.spool_parent(tmp_path, "p")
    assert tracking._parent_file(tmp_path, token).is_file()
    assert tracking.finish_spooled_parent(tmp_path, token, ok=True) == {"replayed": 0, "left": 0}
    assert not tracking._parent_file(tmp_path, token).exists()
    assert not (tmp_path / "never.db").exists()  # MLflow was never opened


def test_warming_for_the_replay_waits_for_a_spooled_stage(tmp_path):
    """`paperline repro` warms MLflow while dvc runs, but only once a stage has spooled: a repro
    with nothing to run never imports it (a fresh interpreter, so the import is observable)."""
    import subprocess
    import sys

    script = """
import sys, time
from pathlib import Path
from stages.core import tracking
root = Path(sys.argv[1])
with tracking.warm_for_replay(root, poll_s=0.05):
    time.sleep(0.5)
print("idle", "mlflow" in sys.modules, (root / "warm.db").exists())
tracking.gaps_dir(root).mkdir(parents=True)
with tracking.warm_for_replay(root, poll_s=0.05):
    (tracking.gaps_dir(root) / "p.train.1.json").write_text("{}")
    deadline = time.monotonic() + 120   # a loaded machine: wait for the thread, not a set time
    while "mlflow" not in sys.modules and time.monotonic() < deadline:
        time.sleep(0.05)
print("spooled", "mlflow" in sys.modules, (root / "warm.db").exists())
"""
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'warm.db'}"}
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("idle", "spooled"))]
    assert lines == ["idle False False", "spooled True True"], out.stdout


def test_tracking_mode_is_checked():
    assert tracking.tracking_mode({}) == "on"
    assert tracking.tracking_mode({"PAPERLINE_TRACKING": "Spool"}) == "spool"
    with pytest.raises(ValueError, match="PAPERLINE_TRACKING"):
        tracking.tracking_mode({"PAPERLINE_TRACKING": "spooled"})


def test_configure_one_repo_does_not_steer_the_next(tmp_path, monkeypatch):
    """mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI; `configure` must not leave it set, or a
    process that runs two repos (a Prefect worker) logs the second into the first's store."""
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    saved = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    try:
        first = tracking.configure(tmp_path / "a")
        assert mlflow.get_tracking_uri() == first == tracking.embedded_uri(tmp_path / "a")
        assert "MLFLOW_TRACKING_URI" not in __import__("os").environ
        assert tracking.tracking_uri(tmp_path / "b") == tracking.embedded_uri(tmp_path / "b")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")  # the user's choice wins
        assert tracking.configure(tmp_path / "b") == "http://127.0.0.1:1"
        assert __import__("os").environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:1"
    finally:
        mlflow.set_tracking_uri(saved[0])
        mlflow.set_registry_uri(saved[1])


def test_several_models_of_one_run_get_artifact_paths_of_their_own(tmp_path):
    """Four arms registered by one stage run under the default path `model` would be logged into
    one artifact folder (files merged, every version's source the same folder): the second and
    later get the path suffixed with their name and aliases."""
    from types import SimpleNamespace

    ctx = SimpleNamespace(pipeline="p", profile="cpu", seed=0, root=tmp_path)
    tr = tracking.StageTracker(ctx, None)
    tr.ok, tr.gap = False, {"ops": []}      # recorded, not logged: the paths are what we check
    for arm in ("il", "sr/templated"):
        tr.register_model(_model_dir(tmp_path / arm.replace("/", "_"), arm), "policy", [arm])
    tr.register_model(_model_dir(tmp_path / "base", "b"), "base", ["seed0"],
                      artifact_path="model-base")
    assert [op["artifact_path"] for op in tr.gap["ops"]] == [
        "model", "model-policy-sr-templated", "model-base"]
