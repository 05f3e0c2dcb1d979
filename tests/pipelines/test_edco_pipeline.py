"""The `edco` pipeline end to end at `smoke` through real `dvc repro` (after the shared stages)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import torch
import yaml
from safetensors.torch import load_file

from stages.core import io
from tests.conftest import dvc, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

SFT_ARMS = ["sft_edco", "sft_edco_mean", "sft_loss", "sft_random", "sft_easy_to_hard", "sft_ppl"]
RL_ARMS = ["rl_edco", "rl_random"]
P = Path("pipelines/edco")
# The smoke sizes the assertions count with (from this pipeline's params.yaml)
SMOKE = yaml.safe_load((Path(__file__).resolve().parents[2] / P / "params.yaml").read_text())[
    "profiles"]["smoke"]


@pytest.fixture(scope="module")
def edco_repo(smoke_repo: Path) -> Path:
    proc = paperline(smoke_repo, "repro", "edco", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return smoke_repo


def _weights(folder: Path) -> dict:
    return load_file(str(next(folder.glob("*.safetensors"))))


def test_pool_is_new_domain_with_flagged_noise_and_clean_test(edco_repo: Path):
    pool = pl.read_parquet(edco_repo / P / "data/pool/pool.parquet")
    test = pl.read_parquet(edco_repo / P / "data/pool/test.parquet")
    n_pool = SMOKE["pool"]["n_pool"]
    assert pool.height == n_pool and test.height == SMOKE["pool"]["n_test"]
    assert pool["noisy"].sum() == round(0.05 * n_pool) and test["noisy"].sum() == 0
    assert pool["question"].str.contains("*", literal=True).any()
    shared = set(pl.read_parquet(edco_repo / "data/tasks/arith/train.parquet")["question"])
    assert not shared & set(pool["question"]) and not set(test["question"]) & set(pool["question"])


def test_estimator_reports_rank_correlation_and_token_reduction(edco_repo: Path):
    m = io.read_metrics(edco_repo / P / "details/entropy_estimate.json")
    for L in (2, 4):
        assert -1.0 <= m[f"L{L}/spearman"] <= 1.0
        assert 0.0 < m[f"L{L}/mean_tokens"] <= L
        assert m[f"L{L}/token_reduction"] == pytest.approx(
            1 - m[f"L{L}/mean_tokens"] / m["full_mean_tokens"])
        assert f"L{L}/seconds_per_item" not in m                # wall times: MLflow only
    scores = pl.read_parquet(edco_repo / P / "data/estimator/scores.parquet")
    assert scores.height == SMOKE["entropy_estimate"]["n_items"]
    assert {"full_top_frac", "L2_top_frac", "L4_mean"} <= set(scores.columns)


def test_every_arm_trains_every_seed_at_one_budget(edco_repo: Path):
    base = _weights(edco_repo / "models/base")
    for arm in SFT_ARMS + RL_ARMS:
        folder = edco_repo / P / "runs" / arm
        curve = pl.read_parquet(folder / "curve.parquet")
        assert sorted(curve["seed"].unique().to_list()) == [0, 1]
        assert sorted(curve["round"].unique().to_list()) == [0.0, 1.0, 2.0]
        picks = pl.read_parquet(folder / "selections.parquet")
        n = SMOKE[arm]["top_n"]
        assert picks.group_by(["seed", "round"]).len()["len"].to_list() == [n] * 4
        for seed in (0, 1):
            after = _weights(folder / f"seed{seed}")
            assert {k: v.shape for k, v in after.items()} == {k: v.shape for k, v in base.items()}
        if arm.startswith("sft"):  # SFT always has a gradient: the model moved
            assert any(not torch.equal(base[k], _weights(folder / "seed0")[k]) for k in base)
        budget = json.loads((folder / "budget.json").read_text())
        assert budget["rounds"] == 2 and budget["pool_size"] == SMOKE["pool"]["n_pool"]
    edco_scores = pl.read_parquet(edco_repo / P / "runs/sft_edco/selections.parquet")
    assert edco_scores["score"].is_not_nan().all()


def test_compare_metrics_readme_and_registry(edco_repo: Path):
    m = io.read_metrics(edco_repo / P / "details/compare.json")
    for arm in SFT_ARMS:
        assert 0.0 <= m[f"sft/{arm}/acc_mean"] <= 1.0 and m[f"sft/{arm}/seeds"] == 2.0
        assert 0.0 <= m[f"sft/{arm}/noisy_frac"] <= 1.0
    for arm in RL_ARMS:
        assert 0.0 <= m[f"rl/{arm}/acc_mean"] <= 1.0
    assert (edco_repo / P / "report/acc_by_round.png").stat().st_size > 1000
    readme = (edco_repo / P / "README.md").read_text()
    block = readme.split("<!-- results:start")[1].split("<!-- results:end")[0]
    assert "| sft_edco_mean |" in block and "| rl_random |" in block
    assert f"{m['sft/sft_edco/acc_mean']:.3f}" in block  # the table is the metrics, rendered
    for prefix in ("sft/acc/sft_edco_vs_sft_random", "sft/acc/sft_edco_vs_sft_ppl",
                   "sft/acc/sft_ppl_vs_sft_random", "rl/acc/rl_edco_vs_rl_random"):
        assert m[f"claim/{prefix}/verdict"] in (-1.0, 0.0, 1.0)
        assert m[f"claim/{prefix}/pairs"] == 2.0
    assert m["claim/rl/acc/rl_edco_vs_rl_random/paper_effect"] == 0.065
    assert "| RL: rl_edco above rl_random | **" in block

    proc = paperline(edco_repo, "compare", "edco")
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (edco_repo / "reports/edco/compare.md").read_text()
    header = next(line for line in table.splitlines()
                  if line.startswith("| metric |") and "sft_random" in line)
    assert all(arm in header for arm in SFT_ARMS)
    client = mlflow_client(edco_repo)
    rm = client.get_registered_model("edco-policy")
    assert set(rm.aliases) == {a.replace("_", "-") for a in SFT_ARMS + RL_ARMS}
    v = client.get_model_version_by_alias("edco-policy", "sft-edco")
    assert v.tags["edco.strategy"] == "edco" and "metric.final_acc" in v.tags
    assert client.get_model_version_by_alias("edco-policy", "sft-ppl").tags[
        "edco.strategy"] == "ppl"


def test_second_repro_of_the_pipeline_does_nothing(edco_repo: Path):
    out = dvc(edco_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]
