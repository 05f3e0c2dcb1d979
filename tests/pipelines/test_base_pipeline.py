"""The `base` pipeline through real `dvc repro` at the smoke profile, in a fresh copy of the repo."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import dvc, paperline, set_params

pytestmark = pytest.mark.slow

STAGES = ["tasks", "tokenizer", "base", "evaluate"]


def ran(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


def mlflow_client(repo: Path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{repo / '.paperline' / 'mlflow' / 'mlflow.db'}"
    # the registry too: MlflowClient falls back to mlflow's process-wide registry URI, which an
    # earlier test in this worker may have pointed at its own store
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def test_repro_builds_every_output(smoke_repo: Path):
    lock = yaml.safe_load((smoke_repo / "dvc.lock").read_text())
    assert set(lock["stages"]) == set(STAGES)
    for split in ("train", "val", "test"):
        assert (smoke_repo / "data/tasks/arith" / f"{split}.parquet").is_file()
    assert (smoke_repo / "models/base/config.json").is_file()
    assert list((smoke_repo / "models/base").glob("*.safetensors"))
    metrics = json.loads((smoke_repo / "metrics/evaluate.json").read_text())
    assert 0.0 <= metrics["greedy_acc"] <= 1.0
    assert (smoke_repo / "plots/base_accuracy.csv").is_file()


def test_second_repro_does_nothing(smoke_repo: Path):
    out = dvc(smoke_repo, "repro", "dvc.yaml").stdout
    assert ran(out) == set(), out
    assert "up to date" in dvc(smoke_repo, "status", "dvc.yaml").stdout


def test_saved_model_reloads_and_generates(smoke_repo: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smoke_repo / "models/base"
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("Q: 1+2=? A:", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_stage_runs_are_tracked_and_model_registered(smoke_repo: Path):
    client = mlflow_client(smoke_repo)
    exp = client.get_experiment_by_name("base")
    runs = client.search_runs([exp.experiment_id])
    stages = {r.data.tags.get("paperline.stage") for r in runs}
    assert set(STAGES) <= stages
    assert all(r.data.tags.get("dvc.stage_key") for r in runs if r.data.tags.get("paperline.stage"))
    champion = client.get_model_version_by_alias("base-arith", "champion")
    assert champion.run_id in {r.info.run_id for r in runs}
    # The evaluation stage attached its scores to the registered version.
    assert "metric.greedy_acc" in champion.tags


def test_stage_runs_hang_under_one_parent_run(smoke_repo: Path):
    client = mlflow_client(smoke_repo)
    exp = client.get_experiment_by_name("base")
    parents = client.search_runs([exp.experiment_id], "tags.`paperline.kind` = 'pipeline'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = client.search_runs([exp.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
    assert {c.data.tags["paperline.stage"] for c in children} == set(STAGES)


def test_compare_and_report(smoke_repo: Path):
    proc = paperline(smoke_repo, "compare", "base")
    assert proc.returncode == 0, proc.stderr
    assert "base-arith" in proc.stdout and "champion" in proc.stdout
    assert "greedy_acc" in proc.stdout
    assert (smoke_repo / "reports/base/compare.png").stat().st_size > 1000
    assert paperline(smoke_repo, "compare", "bsae").returncode == 2
    readme = smoke_repo / "pipelines/base/README.md"
    readme.write_text(readme.read_text().replace("_No metrics yet: run the pipeline._", "stale"))
    assert paperline(smoke_repo, "report", "base").returncode == 0
    text = readme.read_text()
    assert "stale" not in text
    acc = json.loads((smoke_repo / "details/evaluate.json").read_text())["greedy_acc_d2"]
    assert f"| 2 | {100 * acc:.1f}%" in text  # rendered from the metrics file, not typed


def test_restored_stage_creates_no_duplicate_run(smoke_repo: Path):
    client = mlflow_client(smoke_repo)
    exp = client.get_experiment_by_name("base")
    before = len(client.search_runs([exp.experiment_id]))
    import shutil

    shutil.rmtree(smoke_repo / "models/base")
    out = dvc(smoke_repo, "repro", "dvc.yaml").stdout
    assert (smoke_repo / "models/base/config.json").is_file()
    assert ran(out) == set(), out  # restored from the run-cache: no stage process ran
    assert len(client.search_runs([exp.experiment_id])) == before


def test_param_change_reruns_only_dependents(smoke_copy: Path):
    assert "up to date" in dvc(smoke_copy, "status", "dvc.yaml").stdout
    # the leaf, and a value that costs no more than the committed one (batch 7 split the
    # smoke evaluation into 12 generate calls: 33 s of a loaded CI box)
    set_params(smoke_copy, **{"profiles.smoke.evaluate.temperature": 0.7})
    status = dvc(smoke_copy, "status", "dvc.yaml").stdout
    changed = {s for s in STAGES if re.search(rf"^{s}:", status, re.M)}
    assert changed == {"evaluate"}, status
    out = dvc(smoke_copy, "repro", "dvc.yaml").stdout
    assert ran(out) == {"evaluate"}, out


def test_exp_run_switches_profile(repo_copy: Path):
    set_params(repo_copy, profile="cpu")
    subprocess.run(["git", "commit", "-qam", "cpu"], cwd=repo_copy, check=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})
    out = dvc(repo_copy, "exp", "run", "-S", "profile=smoke", "tasks").stdout
    assert "Running stage 'tasks'" in out
    lock = yaml.safe_load((repo_copy / "dvc.lock").read_text())
    tracked = lock["stages"]["tasks"]["params"]["params.yaml"]
    assert "profiles.smoke.tasks" in tracked and "profiles.cpu.tasks" not in tracked
    assert json.loads((repo_copy / "metrics/tasks.json").read_text())["arith_train_rows"] == 200


def test_bad_params_fail_before_compute(repo_copy: Path):
    set_params(repo_copy, **{"profiles.smoke.base.learning_rat": 0.1})
    proc = dvc(repo_copy, "repro", "dvc.yaml", check=False)
    assert proc.returncode != 0
    err = proc.stdout + proc.stderr
    assert "base.learning_rat" in err and "unknown key" in err
    assert not (repo_copy / "data").exists()  # the first stage refused too: nothing computed


def test_out_of_range_param_names_key_value_and_bound(repo_copy: Path):
    set_params(repo_copy, **{"profiles.smoke.tasks.n_train": -5})
    proc = subprocess.run([sys.executable, "-m", "stages", "base", "tasks"], cwd=repo_copy,
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "tasks.n_train = -5" in proc.stderr and "greater than or equal to 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_stage_gets_a_suggestion(repo_copy: Path):
    proc = subprocess.run([sys.executable, "-m", "stages", "base", "tokeniser"], cwd=repo_copy,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Did you mean 'tokenizer'" in proc.stderr


def test_corrupt_data_fails_at_the_stage_boundary(repo_copy: Path):
    dvc(repo_copy, "repro", "tasks")
    train = repo_copy / "data/tasks/arith/train.parquet"
    import polars as pl

    pl.read_parquet(train).drop("target").write_parquet(train)
    proc = dvc(repo_copy, "repro", "--downstream", "tokenizer", check=False)
    assert proc.returncode != 0
    err = proc.stdout + proc.stderr
    assert "train.parquet" in err and "'target'" in err and "rule 'column exists'" in err
    assert "Traceback" not in err
    assert not (repo_copy / "models").exists()  # neither tokenizer nor base ran


def test_killed_stage_leaves_no_half_written_output(smoke_copy: Path):
    # base trains again (forced) on the built smoke repo, and is killed while it runs
    proc = subprocess.Popen([str(Path(sys.executable).parent / "dvc"), "repro", "-f", "-s",
                             "base"], cwd=smoke_copy, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 300
    for line in proc.stdout:  # wait until training has started, then kill the whole group
        if "Running stage 'base'" in line or time.time() > deadline:
            time.sleep(3)
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    model = smoke_copy / "models/base"
    assert not model.exists() or (model / "config.json").is_file() and list(model.glob("*.safetensors"))
    leftovers = [p.name for p in (smoke_copy / "models").iterdir() if ".tmp-" in p.name]
    # The copy was built before: its cache holds the last good model, so DVC may restore that
    # (the killed forced run never wrote the lock) or run base again; either way whole.
    out = dvc(smoke_copy, "repro", "--no-run-cache", "dvc.yaml").stdout
    assert "base" in ran(out) or "Stage 'base' is cached" in out, out
    assert (smoke_copy / "models/base/config.json").is_file()
    assert "up to date" in dvc(smoke_copy, "status", "dvc.yaml").stdout
    # Temporaries of the killed run are cleaned by the rerun.
    assert not [p for p in (smoke_copy / "models").iterdir() if ".tmp-" in p.name], leftovers
