"""The `racer` pipeline end to end at `smoke` through real `dvc repro` (after the shared stages)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from tests.conftest import dvc, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

P = Path("pipelines/racer")


@pytest.fixture(scope="module")
def racer_repo(smoke_repo: Path) -> Path:
    proc = paperline(smoke_repo, "repro", "racer", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return smoke_repo


def test_outcomes_features_and_routers(racer_repo: Path):
    out = pl.read_parquet(racer_repo / P / "data/outcomes/train.parquet")
    assert out.height == 64
    for judge in ("direct", "reasoning"):
        # a malformed output is counted and scored wrong, never a crash
        assert not (out[f"{judge}_malformed"] & out[f"{judge}_correct"]).any()
        assert (out[f"{judge}_tokens"] >= 1).all()
    m = json.loads((racer_repo / P / "details/judge_outcomes.json").read_text())
    assert m["direct/malformed"] == float(sum(
        pl.read_parquet(racer_repo / P / f"data/outcomes/{s}.parquet")["direct_malformed"].sum()
        for s in ("train", "val", "test_iid", "test_hard")))
    hard = pl.read_parquet(racer_repo / P / "data/items/test_hard.parquet")["difficulty"].mean()
    easy = pl.read_parquet(racer_repo / P / "data/items/train.parquet")["difficulty"].mean()
    assert hard > easy                                     # the shift: harder test mix
    x = np.load(racer_repo / P / "data/features/train.npy")
    assert x.shape == (64, 384) and np.isfinite(x).all()   # MiniLM, offline
    for arm in ("erm", "racer"):
        for c in ("C1.3", "C1.5"):
            for seed in (0, 1):
                assert (racer_repo / P / "routers" / arm / c / f"seed{seed}"
                        / "model.safetensors").is_file()


def test_solver_check_matches_cvxpy(racer_repo: Path):
    s = json.loads((racer_repo / P / "details/solver_check.json").read_text())
    assert s["max_abs_dp"] < 1e-2
    assert s["max_rate"] < 1.0
    # the default constraint (Algorithm 1's tilted mean) names the metrics and is certified by
    # the KL-ball convex program
    assert "tilted_mean/racer/beta0.1/abs_dlambda" in s
    assert s["max_ball_abs_dp"] < 1e-2


def test_evaluate_readme_and_registry(racer_repo: Path):
    m = json.loads((racer_repo / P / "details/evaluate.json").read_text())
    # DVC's view: the verdict counts only (every number above is in details/)
    head = json.loads((racer_repo / P / "metrics/evaluate.json").read_text())
    assert set(head) == {"reproduced", "inconclusive", "contradicted"}
    assert sum(head.values()) == sum(1 for k in m if k.endswith("/verdict"))
    for method in ("erm", "racer", "random", "threshold"):
        for split in ("test_iid", "test_hard"):
            assert 0.0 <= m[f"{method}/C1.3/{split}/acc_mean"] <= 1.0
            assert 0.0 <= m[f"{method}/C1.3/{split}/violation_rate"] <= 1.0
    assert m["always_reasoning/test_hard/cost_mean"] > m["always_direct/test_hard/cost_mean"]
    # every claim through the house rule: a verdict, a CI, the MDE and the pairs (budget x seed)
    for name in ("reasoning_gain", "erm_overspends", "racer_within_budget", "racer_acc_vs_erm",
                 "racer_acc_vs_threshold", "racer_acc_vs_always_reasoning"):
        assert m[f"claim/{name}/verdict"] in (-1.0, 0.0, 1.0)
    assert m["claim/racer_acc_vs_erm/pairs"] == 4                # smoke: 2 budgets x 2 seeds
    assert m["claim/reasoning_gain/pairs"] == 32                 # test_hard items
    assert m["claim/racer_acc_vs_threshold/paper_effect"] == 0.011
    assert not any(k.startswith("claim_") for k in m)
    readme = (racer_repo / P / "README.md").read_text()
    block = readme.split("<!-- results:start")[1].split("<!-- results:end")[0]
    assert "| racer |" in block and f"{m['racer/C1.3/test_hard/acc_mean']:.3f}" in block
    assert "ERM (ACER) breaks the budget under the shift (cost - C > 0): **" in block

    proc = paperline(racer_repo, "compare", "racer")
    assert proc.returncode == 0, proc.stderr[-2000:]
    client = mlflow_client(racer_repo)
    rm = client.get_registered_model("racer-router")
    assert {"racer", "erm"} <= set(rm.aliases)
    # each registered router carries its test scores (evaluate tags the version)
    racer = client.get_model_version_by_alias("racer-router", "racer")
    for split in ("test_iid", "test_hard"):
        for col in ("acc", "cost"):
            assert f"metric.{split}/{col}" in racer.tags, racer.tags
    registered = json.loads((racer_repo / P / "routers/registered.json").read_text())
    key = next(k for k in registered if k.startswith("racer/"))   # racer/C<b>/seed<k>
    budget, seed = float(key.split("/")[1][1:]), int(key.split("/")[2][4:])
    rows = pl.read_parquet(racer_repo / P / "report/results.parquet").filter(
        (pl.col("method") == "racer") & (pl.col("budget") == budget) & (pl.col("seed") == seed)
        & (pl.col("split") == "test_hard"))
    assert float(racer.tags["metric.test_hard/acc"]) == pytest.approx(rows["acc"][0], abs=1e-5)


def test_second_repro_of_the_pipeline_does_nothing(racer_repo: Path):
    out = dvc(racer_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]


def test_methods_side_by_side_in_mlflow(racer_repo: Path):
    """MLflow's own Compare view: a run per (method, budget, seed) with the same metric set and
    the method's params; the parent run carries the results table, plots and metrics."""
    client = mlflow_client(racer_repo)
    exp = client.get_experiment_by_name("racer")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # not GenAI
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    methods = [r for r in runs if r.data.tags.get("paperline.stage") == "evaluate"
               and r.data.tags.get("paperline.method")]
    common = {"test_iid/acc", "test_iid/cost", "test_hard/acc", "test_hard/cost"}
    assert methods and all(set(r.data.metrics) == common for r in methods)
    erm = [r for r in methods if r.data.params["method"] == "erm"]
    assert sorted((r.data.params["budget"], r.data.params["seed"]) for r in erm) == [
        (b, s) for b in ("1.3", "1.5") for s in ("0", "1")]  # smoke: 2 budgets x 2 seeds
    assert all("tau_r" in r.data.params for r in erm)
    assert {r.data.params["method"] for r in methods} >= {"always_direct", "random",
                                                          "threshold", "racer", "erm"}
    parent = [r for r in runs if r.data.tags.get("paperline.kind") == "pipeline"]
    assert parent, "no parent run"
    latest = max(parent, key=lambda r: r.info.start_time)
    # the parent's metrics: the headline `dvc metrics show` prints, no wall time
    assert "evaluate/contradicted" in latest.data.metrics
    assert not any("seconds" in k or k.endswith("per_s") for k in latest.data.metrics)
    files = {f.path for f in client.list_artifacts(latest.info.run_id)}
    assert {"results.md", "plots", "details"} <= files, files
    # wall times are in MLflow: the stage runs keep them
    train = [r for r in runs if r.data.tags.get("paperline.stage") == "train_router"
             and not r.data.tags.get("paperline.method")]
    assert train and "train_seconds" in train[0].data.metrics
