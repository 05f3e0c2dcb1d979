"""DVC used from inside a pipeline folder, as a person does: the profile switch documented in the
READMEs works there, and a typo in the paper's params stops `dvc repro` before the shared stages
compute anything."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml

from tests.conftest import dvc, set_params

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def test_profile_switch_from_a_pipeline_folder(repo_copy: Path):
    set_params(repo_copy, profile="cpu")
    subprocess.run(["git", "commit", "-qam", "cpu"], cwd=repo_copy, check=True,
                   env={**os.environ, **GIT_ENV})
    racer = repo_copy / "pipelines" / "racer"
    # what DVC's own hint leads to: -S edits the params.yaml of the folder it runs in
    plain = dvc(racer, "exp", "run", "-S", "profile=smoke", "../../dvc.yaml:tasks", check=False)
    assert plain.returncode != 0 and "not in struct" in plain.stderr
    # the documented command (README.md, pipelines/*/README.md), with the cheapest target
    out = dvc(racer, "exp", "run", "-S", "../../params.yaml:profile=smoke",
              "../../dvc.yaml:tasks").stdout
    assert "Running stage '../../dvc.yaml:tasks'" in out, out
    assert yaml.safe_load((repo_copy / "params.yaml").read_text())["profile"] == "smoke"
    assert "profile" not in yaml.safe_load((racer / "params.yaml").read_text())
    tracked = yaml.safe_load((repo_copy / "dvc.lock").read_text())["stages"]["tasks"]["params"]
    assert "profiles.smoke.tasks" in tracked["params.yaml"]
    assert json.loads((repo_copy / "metrics/tasks.json").read_text())["arith_train_rows"] == 200


def test_typo_in_a_papers_params_stops_repro_before_the_shared_stages(repo_copy: Path):
    racer = repo_copy / "pipelines" / "racer"
    params = yaml.safe_load((racer / "params.yaml").read_text())
    params["featuresX"] = params.pop("features")
    (racer / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    proc = dvc(racer, "repro", check=False)
    err = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "tasks" in err and "unknown section 'featuresX'. Did you mean 'features'" in err, err
    assert "pipelines/racer/params.yaml" in err
    assert not (repo_copy / "data").exists()  # tasks refused: nothing computed
