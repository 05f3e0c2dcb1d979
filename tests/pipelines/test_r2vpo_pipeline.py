"""The `r2vpo` pipeline end to end at `smoke` through real `dvc repro` (after the shared stages)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import polars as pl
import pytest
import yaml
from safetensors.torch import load_file

from stages.core import io
from tests.conftest import dvc, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

ARMS = ["grpo", "grpo_replay", "r2vpo", "r2vpo_fixed_lambda", "r2vpo_no_replay"]
P = Path("pipelines/r2vpo")
SMOKE = yaml.safe_load((Path(__file__).resolve().parents[2] / P / "params.yaml").read_text())[
    "profiles"]["smoke"]


@pytest.fixture(scope="module")
def r2vpo_repo(smoke_repo: Path) -> Path:
    proc = paperline(smoke_repo, "repro", "r2vpo", timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return smoke_repo


def test_every_arm_trains_every_seed(r2vpo_repo: Path):
    """Every arm ran its optimizer steps on every seed and saved a loadable policy.

    Whether the weights move is tested in tests/unit/test_grpo.py on a policy that solves some
    prompts: the smoke base model (20 SFT steps) solves none, so every GRPO reward here is 0,
    every advantage is 0 and the policies equal the base model, as they should.
    """
    base = load_file(str(next((r2vpo_repo / "models/base").glob("*.safetensors"))))
    for arm in ARMS:
        folder = r2vpo_repo / P / "runs" / arm
        curve = pl.read_parquet(folder / "curve.parquet")
        assert sorted(curve["seed"].unique().to_list()) == [0, 1]
        for seed in (0, 1):
            after = load_file(str(folder / f"seed{seed}" / "model.safetensors"))
            assert {k: v.shape for k, v in after.items()} == {k: v.shape for k, v in base.items()}
            state = json.loads((folder / f"seed{seed}" / "policy_state.json").read_text())
            g = SMOKE["grpo"]["num_generations"]  # smoke budget: 2 rounds of 2 steps, 2 prompts
            assert state["steps"] == 2 * 1 * 2 and state["rollouts"] == 2 * 2 * g
        state = json.loads((folder / "seed0" / "policy_state.json").read_text())
        assert state["policy_loss"] == ("clip" if arm.startswith("grpo") else "r2vpo")
        budget = json.loads((folder / "budget.json").read_text())
        assert budget["replay_batches"] == (0 if arm in ("grpo", "r2vpo_no_replay") else 2)
    fixed = json.loads((r2vpo_repo / P / "runs/r2vpo_fixed_lambda/seed0/policy_state.json")
                       .read_text())
    assert fixed["dual"]["lam"] == 0.04 and fixed["dual"]["rule"] == "fixed"


def test_compare_metrics_readme_and_control(r2vpo_repo: Path):
    m = io.read_metrics(r2vpo_repo / P / "details/compare.json")
    for arm in ARMS:
        assert 0.0 <= m[f"{arm}/final_acc_mean"] <= 1.0 and m[f"{arm}/seeds"] == 2.0
    for env in ("Pendulum-v1", "sparse_Pendulum-v1"):
        for arm in ("ppo", "r2vpo"):
            assert f"control/{env}/{arm}/return_last10_mean" in m
    assert (r2vpo_repo / P / "report/acc_vs_rollouts.png").stat().st_size > 1000
    readme = (r2vpo_repo / P / "README.md").read_text()
    block = readme.split("<!-- results:start")[1].split("<!-- results:end")[0]
    assert "| r2vpo_fixed_lambda |" in block and "Not run yet" not in block
    assert f"{m['grpo/final_acc_mean']:.3f}" in block  # the table is the metrics, rendered
    # every claim: a verdict over the 2 smoke seeds, rendered with its sentence
    for prefix in ("final_acc/r2vpo_vs_grpo", "rollouts_to_reach/r2vpo_vs_grpo",
                   "control/Pendulum-v1/r2vpo_vs_ppo", "control/sparse_Pendulum-v1/r2vpo_vs_ppo",
                   "control_sparse_gap/sparse_Pendulum-v1/r2vpo_vs_ppo"):
        assert m[f"claim/{prefix}/verdict"] in (-1.0, 0.0, 1.0)
        assert m[f"claim/{prefix}/pairs"] == 2.0
    assert m["claim/final_acc/r2vpo_vs_grpo/paper_effect"] == 0.17
    assert "| r2vpo vs grpo: final accuracy, change relative to grpo (paper: higher) | **" in block


def test_mlflow_shows_arms_side_by_side_and_registers_each_arm(r2vpo_repo: Path):
    proc = paperline(r2vpo_repo, "compare", "r2vpo")
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (r2vpo_repo / "reports/r2vpo/compare.md").read_text()
    header = next(line for line in table.splitlines()
                  if line.startswith("| metric |") and "grpo_replay" in line)
    assert all(arm in header for arm in ARMS)
    assert "### stage `control/Pendulum-v1`" in table
    assert not re.search(r"### stage `grpo`", table)  # per-arm stage runs are aggregates
    client = mlflow_client(r2vpo_repo)
    rm = client.get_registered_model("r2vpo-policy")
    assert set(rm.aliases) == {a.replace("_", "-") for a in ARMS}
    v = client.get_model_version_by_alias("r2vpo-policy", "r2vpo")
    assert v.tags["paperline.method"] == "r2vpo" and "metric.final_acc" in v.tags


def test_second_repro_of_the_pipeline_does_nothing(r2vpo_repo: Path):
    out = dvc(r2vpo_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]
