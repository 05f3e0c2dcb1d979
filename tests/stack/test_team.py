"""The team stack for real: `paperline stack up --team` starts PostgreSQL (as the `postgres` user
when we are root), a Prefect server and an MLflow server on it, MLflow proxying artifacts to a
real S3 store (SeaweedFS, the fixture of test_s3_storage.py). Then the faults a team meets: bad
S3 settings refused before anything starts, the MLflow server going down in the middle of a stage
(outputs land, the gap is recorded and replayed once, no duplicate run), and planted secrets (the
S3 secret, the database password) hunted in command lines, logs, MLflow runs, Prefect logs and
both databases.

The tests share one stack and run in file order; the last one scans what the others produced.
The work folder is inside the work tree (.paperline/test-state/...): the `postgres` user must be
able to reach its data folder, which a 0700 pytest tmp folder forbids.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml
from pydantic import BaseModel

from flows import postgres, stack
from stages.core import storage, tracking
from tests.conftest import STATE, drain_prefect
from tests.stack.test_s3_storage import (  # noqa: F401  (s3: a fixture, used by name)
    ACCESS_KEY,
    BUCKET,
    SECRET,
    S3Server,
    _env_as,
    s3,
)

pytestmark = [pytest.mark.stack, pytest.mark.timeout(240)]

PREFIX = "team"
SEEN: dict[str, str] = {}          # what the scan at the end looks at, filled by the tests


@pytest.fixture(scope="module")
def work():
    path = STATE / f"team-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _repo(path: Path, s3: S3Server, **storage_over: str) -> Path:
    path.mkdir()
    (path / ".dvc").mkdir()  # what find_root looks for
    (path / "params.yaml").write_text(yaml.safe_dump({"storage": {
        "endpoint_url": s3.endpoint, "bucket": BUCKET, "prefix": PREFIX, **storage_over}}))
    return path


def _family(pid: int | None) -> list[psutil.Process]:
    if not pid:
        return []
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.fixture(scope="module")
def team(work: Path, s3: S3Server):
    """The team stack (PostgreSQL, Prefect, MLflow; no worker) with the S3 secret planted in the
    environment it starts from."""
    root = _repo(work / "repo", s3)
    saved_uri = os.environ.pop("MLFLOW_TRACKING_URI", None)
    with _env_as(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET):
        t0 = time.monotonic()
        try:
            info = stack.up(root, team=True, components=("prefect", "mlflow"),
                            prefect_port=stack.free_port(), mlflow_port=stack.free_port(),
                            postgres_port=stack.free_port(), timeout=120, quiet=True)
            SEEN["up_seconds"] = f"{time.monotonic() - t0:.1f}"
            yield root, info
        finally:
            procs = [p for c in stack.TEAM_COMPONENTS
                     for p in _family(stack.status(root)[c]["pid"])]
            drain_prefect()
            result = stack.down(root, timeout=20, quiet=True)
            _, alive = psutil.wait_procs(procs, timeout=10)
            if saved_uri is not None:
                os.environ["MLFLOW_TRACKING_URI"] = saved_uri
    assert not alive, f"still alive after stack.down: {alive} ({result})"
    assert result["postgres"] in ("stopped", "killed")


def test_bad_s3_is_refused_before_anything_starts(work: Path, s3: S3Server, capsys):
    from flows import cli

    root = _repo(work / "bad-s3", s3)
    wrong = "WRONG-TEAM-SECRET-4c1d"
    with _env_as(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=wrong,
                 PAPERLINE_ROOT=str(root)):
        assert cli.main(["stack", "up", "--team"]) == 2
    err = capsys.readouterr().err
    assert "S3 rejected the credentials" in err and s3.endpoint in err, err
    assert wrong not in err and SECRET not in err
    dead = f"http://127.0.0.1:{stack.free_port()}"
    with _env_as(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET,
                 PAPERLINE_S3_ENDPOINT_URL=dead):
        with pytest.raises(storage.StorageError, match="S3 unreachable") as exc:
            stack.up(root, team=True, quiet=True)
    assert dead in str(exc.value) and SECRET not in str(exc.value)
    # nothing was started or initialised
    sdir = stack.stack_dir(root)
    assert not list(sdir.glob("*.pid")) and not (sdir / "postgres").exists()


def test_team_servers_run_on_postgres_bound_to_loopback(team):
    root, info = team
    sdir = stack.stack_dir(root)
    assert {c for c, i in info.items() if i["state"] == "alive"} == {"postgres", "prefect",
                                                                    "mlflow"}
    assert info["prefect"]["healthy"] and info["mlflow"]["healthy"]
    pg_pid = info["postgres"]["pid"]
    assert pg_pid == postgres.postmaster_pid(sdir / "postgres")
    if os.geteuid() == 0:  # postgres refuses root: it runs as the postgres system user
        assert psutil.Process(pg_pid).username() == postgres.SYSTEM_USER
    # no SQLite store anywhere: both servers keep their state in PostgreSQL
    assert not (sdir / "prefect.db").exists() and not (sdir / "mlflow.db").exists()
    server = postgres.Server(sdir / "postgres", sdir / "pgpass", "127.0.0.1",
                             stack.ports(root)["postgres"])
    for db, table in (("prefect", "flow_run"), ("mlflow", "experiments")):
        conn = postgres.connect(server, db)
        with conn, conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = %s",
                        (table,))
            assert cur.fetchone()[0] == 1, f"{table} missing in database {db}"
        conn.close()
    # every listening socket of every server process is on 127.0.0.1
    listening = {}
    for name in ("postgres", "prefect", "mlflow"):
        for p in _family(info[name]["pid"]):
            try:
                conns = p.net_connections(kind="inet")
            except psutil.NoSuchProcess:  # a postgres backend that just ended
                continue
            for c in conns:
                if c.status == psutil.CONN_LISTEN:
                    listening.setdefault(name, set()).add(c.laddr.ip)
    assert listening == {n: {"127.0.0.1"} for n in ("postgres", "prefect", "mlflow")}, listening
    # the password file: 0600, and the servers are told where it is, not what it holds
    assert stat.S_IMODE((sdir / "pgpass").stat().st_mode) == 0o600
    password = postgres.read_password(sdir / "pgpass")
    assert len(password) >= 24
    for name in ("prefect", "mlflow"):
        env = psutil.Process(info[name]["pid"]).environ()
        assert env.get("PGPASSFILE") == str(sdir / "pgpass")
        assert password not in json.dumps(env), f"the DB password is in {name}'s environment"
    assert SECRET not in json.dumps(psutil.Process(info["prefect"]["pid"]).environ())
    SEEN["password"] = password


def test_mlflow_artifacts_go_to_s3_and_prefect_logs_to_postgres(team, s3: S3Server, work: Path):
    from mlflow import MlflowClient

    root, info = team
    url = info["mlflow"]["url"]
    (work / "rows.txt").write_text("row 0\nrow 1\n")
    with _env_as():  # a client without any S3 credentials: the server proxies to S3
        client = MlflowClient(tracking_uri=url, registry_uri=url)
        exp = client.create_experiment("team-s3")
        run = client.create_run(exp, tags={"paperline.stage": "make"})
        client.log_param(run.info.run_id, "profile", "smoke")
        client.log_artifact(run.info.run_id, str(work / "rows.txt"), "out")
        client.set_terminated(run.info.run_id)
    stored = s3.keys(f"{PREFIX}/mlflow/")
    assert [k for k, v in stored.items() if k.endswith("out/rows.txt")
            and v == b"row 0\nrow 1\n"], sorted(stored)

    # a flow run on the team Prefect server, in this process (which holds the S3 secret), that
    # logs what `paperline remote check` prints about the store
    from prefect import flow, get_run_logger
    from prefect.settings import PREFECT_API_URL, temporary_settings

    @flow(name="team-hello", persist_result=False)
    def hello() -> str:
        settings = storage.require_settings(root)
        storage.preflight(settings)
        get_run_logger().info("hello from the team stack\n%s", storage.describe(root, settings))
        return storage.describe(root, settings)

    with temporary_settings(updates={PREFECT_API_URL: f"{info['prefect']['url']}/api"}):
        SEEN["flow_output"] = hello()
    assert s3.endpoint in SEEN["flow_output"]


class _Cfg(BaseModel):
    lr: float = 0.1
    steps: int = 3


def _ctx(root: Path, stage: str):
    from stages.core.context import Context

    return Context(root=root, pipeline="team-gap", stage=stage, pipeline_dir=root,
                   profile="smoke", seed=0, paths={"metrics": root / "metrics"})


def _runs(client, where: str = "") -> list:
    exp = client.get_experiment_by_name("team-gap")
    return client.search_runs([exp.experiment_id], where)


def test_mlflow_down_mid_stage_keeps_outputs_and_replays_the_gap_once(team, caplog):
    import mlflow
    from mlflow import MlflowClient

    from stages.core import io

    root, info = team
    url = info["mlflow"]["url"]
    caplog.set_level(logging.WARNING, logger="paperline.tracking")
    previous = (mlflow.get_tracking_uri(), mlflow.get_registry_uri())
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text('{"hidden": 8}\n')
    with _env_as(MLFLOW_TRACKING_URI=url, MLFLOW_HTTP_REQUEST_MAX_RETRIES="1",
                 MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR="0", MLFLOW_HTTP_REQUEST_TIMEOUT="5"):
        try:
            client = MlflowClient(tracking_uri=url, registry_uri=url)
            # a retry of a failed stage resumes its run: no second run for one stage execution
            ctx_r, cfg = _ctx(root, "retried"), _Cfg()
            with pytest.raises(RuntimeError):
                with tracking.StageTracker(ctx_r, cfg):
                    raise RuntimeError("stage crashed")
            with tracking.StageTracker(ctx_r, cfg) as again:
                again.log_metrics({"acc": 1.0})
            runs = _runs(client, "tags.`paperline.stage` = 'retried'")
            assert len(runs) == 1 and runs[0].info.status == "FINISHED", runs
            assert runs[0].data.tags["paperline.attempts"] == "2"

            # stage "a": the MLflow server crashes (SIGKILL) after the run started
            ctx_a = _ctx(root, "a")
            with tracking.StageTracker(ctx_a, cfg) as tr_a:
                assert tr_a.ok and tr_a.run_id
                tr_a.log_metrics({"loss": 2.0}, step=0)
                crashed = _family(stack.status(root)["mlflow"]["pid"])  # the server dies
                for proc in crashed:
                    proc.kill()
                psutil.wait_procs(crashed, timeout=10)
                assert stack.status(root)["mlflow"]["state"] == "dead"
                t0 = time.monotonic()
                tr_a.log_metrics({"loss": 1.0}, step=1)
                assert time.monotonic() - t0 < 20, "a dead server stalled the stage"
                assert not tr_a.ok
                with tr_a.method_run("arms", "ours", seed=0, params={"beta": 0.5}) as m:
                    m.log_metrics({"reward": 0.75}, step=0)
                tr_a.register_model(root / "model", "team-gap-policy", ["candidate"])
                out = io.write_json(root / "metrics" / "a.json", {"loss": 1.0})
                tr_a.log_metrics({"loss": 1.0, "stage_seconds": 0.1})
            assert out.is_file() and json.loads(out.read_text()) == {"loss": 1.0}
            assert tr_a.gap_file and tr_a.gap_file.is_file()
            warned = [r.getMessage() for r in caplog.records if "tracking gap" in r.getMessage()]
            assert warned and str(tr_a.gap_file) in warned[0] and "a finished" in warned[0]

            # stage "b": MLflow is down from the start
            ctx_b = _ctx(root, "b")
            with tracking.StageTracker(ctx_b, cfg) as tr_b:
                assert not tr_b.ok and tr_b.run_id is None
                tr_b.log_metrics({"acc": 0.5})
            assert tr_b.gap_file.is_file()
            gaps = tracking.list_gaps(root)
            assert {g["run_name"] for _, g in gaps} == {"a", "b"}
            assert tracking.sync_gaps(root, quiet=True) == {"replayed": 0, "left": 2}
            kept = {p.name: p.read_bytes() for p, _ in gaps}

            with _env_as(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET):
                stack.up(root, components=("mlflow",), timeout=120, quiet=True)  # team mode kept
            assert tracking.sync_gaps(root, quiet=True) == {"replayed": 2, "left": 0}
            assert tracking.list_gaps(root) == []
            # a replay repeated (say, interrupted before its file was removed) adds nothing
            for name, data in kept.items():
                (tracking.gaps_dir(root) / name).write_bytes(data)
            assert tracking.sync_gaps(root, quiet=True)["replayed"] == 2
        finally:
            mlflow.set_tracking_uri(previous[0])
            mlflow.set_registry_uri(previous[1])

    runs = _runs(client)
    stage_runs = [r for r in runs if not r.data.tags.get("paperline.method")
                  and r.data.tags["paperline.stage"] != "retried"]
    by_stage = {r.data.tags["paperline.stage"]: r for r in stage_runs}
    assert sorted(r.data.tags["paperline.stage"] for r in stage_runs) == ["a", "b"], stage_runs
    a, b = by_stage["a"], by_stage["b"]
    assert a.info.run_id == tr_a.run_id and a.info.status == "FINISHED"
    history = client.get_metric_history(a.info.run_id, "loss")
    # step 0 and 1 of the loop, and the stage's final metrics (step 0), each exactly once
    assert sorted((m.step, m.value) for m in history) == [(0, 1.0), (0, 2.0), (1, 1.0)]
    assert a.data.metrics["stage_seconds"] == 0.1
    method = [r for r in runs if r.data.tags.get("paperline.method") == "ours"]
    assert len(method) == 1 and method[0].data.metrics["reward"] == 0.75
    assert method[0].data.params == {"beta": "0.5"}
    versions = client.search_model_versions("name = 'team-gap-policy'")
    assert len(versions) == 1 and versions[0].run_id == a.info.run_id
    assert client.get_model_version_by_alias("team-gap-policy", "candidate").version == "1"
    assert b.info.status == "FINISHED" and b.data.metrics["acc"] == 0.5
    assert b.data.params["lr"] == "0.1" and b.data.tags["paperline.replayed"] == "true"
    SEEN["runs"] = repr([(r.data.params, r.data.tags) for r in runs])


def test_planted_secrets_appear_nowhere(team, work: Path, s3: S3Server):
    if not {"password", "flow_output", "runs"} <= set(SEEN):
        pytest.skip("scans what the other tests of this module produced: run the whole module")
    root, info = team
    secrets = {"S3 secret": SECRET, "DB password": SEEN["password"]}
    sdir = stack.stack_dir(root)

    # command lines of every server process (postgres backends included) and of everything now
    cmdlines = {}
    for n in ("postgres", "prefect", "mlflow"):
        for p in _family(stack.status(root)[n]["pid"]):
            try:
                cmdlines[f"{n} {p.pid}"] = " ".join(p.cmdline())
            except psutil.NoSuchProcess:
                pass
    assert len(cmdlines) >= 4
    ps = subprocess.run(["ps", "-eww", "-o", "args="], capture_output=True, text=True).stdout
    assert "prefect server start" in ps
    # Prefect logs, through the API of the team server
    import httpx

    with httpx.Client(base_url=f"{info['prefect']['url']}/api", timeout=30) as client:
        logs = client.post("/logs/filter", json={"limit": 200}).json()
    log_text = "\n".join(x["message"] for x in logs)
    assert "hello from the team stack" in log_text
    # both databases whole, as pg_dump sees them
    pg_dump = postgres._binary("pg_dump")
    dumps = {}
    for db in ("prefect", "mlflow"):
        proc = subprocess.run([pg_dump, "-h", "127.0.0.1", "-p", str(stack.ports(root)["postgres"]),
                               "-U", postgres.USER, db], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PGPASSFILE": str(sdir / "pgpass")})
        assert proc.returncode == 0, proc.stderr
        dumps[db] = proc.stdout
    assert "hello from the team stack" in dumps["prefect"] and "team-gap" in dumps["mlflow"]
    texts = {"ps": ps, "prefect logs": log_text, "flow output": SEEN["flow_output"],
             "mlflow runs": SEEN["runs"], **cmdlines, **{f"db {k}": v for k, v in dumps.items()}}
    for where, text in texts.items():
        for what, value in secrets.items():
            assert value not in text, f"{what} found in {where}"
    # files: stack logs, state, gap records, postgres data (scram hashes, no password);
    # not pgpass itself, nor the S3 server's own data folder
    scanned = 0
    for p in work.rglob("*"):
        if p.is_file() and p != sdir / "pgpass" and s3.data not in p.parents:
            data = p.read_bytes()
            scanned += 1
            for what, value in secrets.items():
                assert value.encode() not in data, f"{what} found in {p}"
    assert scanned > 100 and (sdir / "postgres.log").is_file()
