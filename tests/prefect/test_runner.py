"""The Prefect runner on a small synthetic DVC repo, against a real Prefect server.

DAG of pipeline `base` (root dvc.yaml): a_1 -> a_2 -> join <- b_1 (two independent branches).
Pipeline `flaky` (pipelines/flaky/dvc.yaml) depends on the shared stage a_1: `retry_me` fails on
its first attempt, `broken` always fails, `after_broken` depends on it. Pipeline `gpu`: two
independent stages with `meta: {gpus: 1}` and a single GPU slot.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from flows import stack
from flows.runner import load_plan, run_pipeline
from tests.conftest import drain_prefect
from stages.core.config import UnknownNameError

pytestmark = pytest.mark.timeout(300)

STEP = '''
import hashlib, json, os, sys, time
from pathlib import Path
import yaml

name, out, *deps = sys.argv[1:]
params = yaml.safe_load(open("params.yaml"))
timing = os.environ.get("SYN_TIMING_DIR")
started = time.time()
if name == "retry_me" and not Path(params["marker"]).exists():
    Path(params["marker"]).write_text("first attempt failed\\n")
    sys.exit("retry_me: first attempt fails on purpose")
if name == "broken":
    sys.exit("broken: fails every time")
time.sleep(params.get("sleep", 0))
h = hashlib.sha256(f"{name}:{params.get(name)}".encode())
for d in deps:
    h.update(Path(d).read_bytes())
print(f"stage {name} says hello on stdout", flush=True)
print(f"stage {name} says hello on stderr", file=sys.stderr, flush=True)
Path(out).parent.mkdir(parents=True, exist_ok=True)
Path(out).write_text(h.hexdigest() + "\\n")
Path("metrics").mkdir(exist_ok=True)
Path(f"metrics/{name}.json").write_text(json.dumps({"value": int(h.hexdigest()[:6], 16)}))
if timing:
    Path(timing, f"{name}.json").write_text(json.dumps([started, time.time()]))
if os.environ.get("SYN_MLFLOW") and os.environ.get("PAPERLINE_PARENT_RUN_ID"):
    from mlflow import MlflowClient  # a child run per stage, as the real stages log

    client, parent = MlflowClient(), os.environ["PAPERLINE_PARENT_RUN_ID"]
    run = client.create_run(client.get_run(parent).info.experiment_id, run_name=name,
                            tags={"mlflow.parentRunId": parent, "paperline.stage": name})
    client.set_terminated(run.info.run_id)
'''


def _stage(name: str, out: str, deps: list[str], params: list[str], step: str = "src/step.py",
           meta: str = "") -> str:
    return textwrap.dedent(f"""\
      {name}:
        cmd: python {step} {name} {out} {' '.join(deps)}
        deps: [{', '.join([step, *deps])}]
        params: [{', '.join(params)}]
        outs: [{out}]
        metrics: [{{metrics/{name}.json: {{cache: false}}}}]
    """) + (f"  meta: {meta}\n" if meta else "")


def make_repo(dest: Path, sleep: float = 0.3) -> Path:
    """A committed git + DVC repo with the three pipelines described in the module docstring."""
    dest.mkdir(parents=True)
    (dest / "src").mkdir()
    (dest / "src" / "step.py").write_text(STEP)
    (dest / "params.yaml").write_text(f"sleep: {sleep}\na_1: 1\na_2: 2\nb_1: 3\njoin: 4\n")
    stages = [_stage("a_1", "out/a_1.txt", [], ["a_1", "sleep"]),
              _stage("a_2", "out/a_2.txt", ["out/a_1.txt"], ["a_2", "sleep"]),
              _stage("b_1", "out/b_1.txt", [], ["b_1", "sleep"]),
              _stage("join", "out/join.txt", ["out/a_2.txt", "out/b_1.txt"], ["join"])]
    (dest / "dvc.yaml").write_text("stages:\n" + textwrap.indent("".join(stages), "  "))
    flaky = dest / "pipelines" / "flaky"
    flaky.mkdir(parents=True)
    (flaky / "params.yaml").write_text(
        f"marker: {dest.parent / 'retry_me.marker'}\nretry_me: 1\nbroken: 1\nafter_broken: 1\n")
    step = "../../src/step.py"
    stages = [_stage("retry_me", "out/retry_me.txt", ["../../out/a_1.txt"], ["retry_me"], step),
              _stage("broken", "out/broken.txt", [], ["broken"], step),
              _stage("after_broken", "out/after.txt", ["out/broken.txt"], ["after_broken"], step)]
    (flaky / "dvc.yaml").write_text("stages:\n" + textwrap.indent("".join(stages), "  "))
    gpu = dest / "pipelines" / "gpu"
    gpu.mkdir(parents=True)
    (gpu / "params.yaml").write_text("sleep: 1.0\ng_1: 1\ng_2: 2\n")
    stages = [_stage(n, f"out/{n}.txt", [], [n, "sleep"], step, meta="{gpus: 1}")
              for n in ("g_1", "g_2")]
    (gpu / "dvc.yaml").write_text("stages:\n" + textwrap.indent("".join(stages), "  "))
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "init", "-q"], [_dvc(), "init", "-q"], ["git", "add", "-A"],
                ["git", "commit", "-qm", "synthetic"]):
        subprocess.run(cmd, cwd=dest, check=True, env=env, capture_output=True, timeout=60)
    return dest


def _dvc() -> str:
    return str(Path(sys.executable).with_name("dvc"))


def _lock(repo: Path) -> dict:
    """dvc.lock as data: the order of its stage entries is the order DVC happened to run them,
    which differs even between two sequential `dvc repro` (hash-seeded graph order)."""
    return yaml.safe_load((repo / "dvc.lock").read_text())


def _hashes(repo: Path, *dirs: str) -> dict[str, str]:
    return {str(p.relative_to(repo)): hashlib.md5(p.read_bytes()).hexdigest()
            for d in dirs for p in sorted((repo / d).rglob("*")) if p.is_file()
            and p.name != ".gitignore"}


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory):
    """A real Prefect server of our own (SQLite in tmp) for this module's flow runs."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path_factory.mktemp("prefect-server")
    stack.up(home, prefect_port=stack.free_port(), components=("prefect",), timeout=120,
             quiet=True)
    try:
        with temporary_settings(updates={PREFECT_API_URL: stack.prefect_api_url(home)}):
            yield stack.prefect_api_url(home)
    finally:
        try:
            drain_prefect()  # send queued logs and events while the server is still there
        finally:
            stack.down(home, quiet=True)


def _flow_logs(flow_run_id: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                                limit=200)
    return [log.message for log in logs]


def test_parallel_run_equals_sequential_repro_then_skips(prefect_server, tmp_path, monkeypatch):
    timing = tmp_path / "timing"
    timing.mkdir()
    monkeypatch.setenv("SYN_TIMING_DIR", str(timing))
    repo = make_repo(tmp_path / "prefect", sleep=1.0)
    sequential = make_repo(tmp_path / "sequential", sleep=1.0)
    subprocess.run([_dvc(), "repro", "dvc.yaml"], cwd=sequential, check=True, capture_output=True,
                   timeout=120)

    summary = run_pipeline(repo, "base", max_parallel=2)
    assert {k: v["state"] for k, v in summary.items()} == {
        "a_1": "ran", "a_2": "ran", "b_1": "ran", "join": "ran"}
    assert _lock(repo) == _lock(sequential)
    assert _hashes(repo, "out", "metrics") == _hashes(sequential, "out", "metrics")
    assert len(_hashes(repo, "out", "metrics")) == 8
    status = subprocess.run([_dvc(), "status", "dvc.yaml"], cwd=repo, capture_output=True,
                            text=True, timeout=60)
    assert "up to date" in status.stdout, status.stdout

    # the two branches ran at the same time (each stage sleeps 1 s inside)
    spans = {n: json.loads((timing / f"{n}.json").read_text()) for n in ("a_1", "b_1")}
    assert spans["a_1"][0] < spans["b_1"][1] and spans["b_1"][0] < spans["a_1"][1], spans

    # every stage's stdout and stderr reached the flow run's logs
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        logs = "\n".join(_flow_logs(summary.flow_run_id))
        if all(f"stage {n} says hello on {s}" in logs
               for n in summary for s in ("stdout", "stderr")):
            break
        time.sleep(1)
    for n in summary:
        assert f"stage {n} says hello on stdout" in logs
        assert f"stage {n} says hello on stderr" in logs

    # MLflow: a parent run tagged with the flow run (stages here do not log child runs)
    from mlflow import MlflowClient

    from stages.core.tracking import tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = MlflowClient(tracking_uri(repo)).get_run(summary.parent_run_id)
    assert run.data.tags["prefect.flow_run_id"] == summary.flow_run_id

    again = run_pipeline(repo, "base")
    assert {v["state"] for v in again.values()} == {"skipped"}
    assert again.parent_run_id is None  # nothing to run: no MLflow parent run at all

    # a params change reruns exactly the changed branch and what depends on it
    params = (repo / "params.yaml").read_text().replace("b_1: 3", "b_1: 30")
    (repo / "params.yaml").write_text(params)
    third = run_pipeline(repo, "base", targets=["join"])
    assert {k: v["state"] for k, v in third.items()} == {
        "a_1": "skipped", "a_2": "skipped", "b_1": "ran", "join": "ran"}
    (sequential / "params.yaml").write_text(params)
    subprocess.run([_dvc(), "repro"], cwd=sequential, check=True, capture_output=True, timeout=120)
    assert _lock(repo) == _lock(sequential)
    assert _hashes(repo, "out", "metrics") == _hashes(sequential, "out", "metrics")


def test_retry_failure_and_upstream_shared_stage(prefect_server, tmp_path):
    repo = make_repo(tmp_path / "repo")
    summary = run_pipeline(repo, "flaky", retries=1)
    states = {k: v["state"] for k, v in summary.items()}
    assert states == {"base:a_1": "ran", "retry_me": "ran", "broken": "failed",
                      "after_broken": "blocked"}
    assert (tmp_path / "retry_me.marker").exists()  # the first attempt did fail
    # what finished is in the main workspace and its lock files; the failed branch is not
    assert (repo / "pipelines/flaky/out/retry_me.txt").is_file()
    assert (repo / "out/a_1.txt").is_file()
    assert not (repo / "pipelines/flaky/out/broken.txt").exists()
    assert "retry_me" in (repo / "pipelines/flaky/dvc.lock").read_text()
    logs = "\n".join(_flow_logs(summary.flow_run_id))
    assert "first attempt fails on purpose" in logs

    again = run_pipeline(repo, "flaky", targets=["retry_me"], retries=0)
    assert {k: v["state"] for k, v in again.items()} == {"base:a_1": "skipped",
                                                         "retry_me": "skipped"}


def test_gpu_stages_share_the_gpu_limit(prefect_server, tmp_path, monkeypatch):
    from prefect.client.orchestration import get_client

    timing = tmp_path / "timing"
    timing.mkdir()
    monkeypatch.setenv("SYN_TIMING_DIR", str(timing))
    repo = make_repo(tmp_path / "repo")
    summary = run_pipeline(repo, "gpu", max_parallel=2, gpu_slots=1)
    assert {v["state"] for v in summary.values()} == {"ran"}
    (s1, e1), (s2, e2) = (json.loads((timing / f"{n}.json").read_text()) for n in ("g_1", "g_2"))
    assert e1 <= s2 or e2 <= s1, "two stages with gpus: 1 overlapped on a 1-slot limit"
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name("paperline-gpu").limit == 1


def test_unknown_names_suggest(tmp_path):
    repo = make_repo(tmp_path / "repo")
    with pytest.raises(UnknownNameError, match="did you mean 'a_2'|Did you mean 'a_2'"):
        load_plan(repo, "base", targets=["a2"])
    with pytest.raises(UnknownNameError, match="'flaky'"):
        run_pipeline(repo, "flaki")
    plan = load_plan(repo, "flaky", targets=["retry_me"])
    assert [(s.name, s.upstream) for s in plan] == [
        ("base:a_1", []), ("retry_me", ["dvc.yaml:a_1"])]
