"""The `diffureason` pipeline end to end at `smoke` through real `dvc repro` (it trains its own
models: no shared stage needed, so the repo is copied bare)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from tests.conftest import copy_repo, dvc, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

P = Path("pipelines/diffureason")
ARMS = {"vanilla", "best_of_n", "diffureason", "no_revise", "ar_mcts"}


@pytest.fixture(scope="module")
def dr_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = copy_repo(tmp_path_factory.mktemp("diffureason") / "repo")
    proc = paperline(repo, "repro", "diffureason", timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return repo


def test_every_arm_budget_problem_and_the_ledger(dr_repo: Path):
    res = pl.read_parquet(dr_repo / P / "data/search/results.parquet")
    assert set(res["arm"].unique()) == ARMS
    # every arm at every budget on every problem, paired
    assert res.group_by("seed", "arm", "mult").len()["len"].unique().to_list() == [12]
    assert (res["nfe"] <= res["budget"]).all() and (res["nfe"] > 0).all()
    assert set(res["mult"].unique()) == {1, 4}
    # at 1x the diffusion searches cannot pay a simulation: they ARE vanilla decoding
    one = res.filter(pl.col("mult") == 1).pivot(on="arm", index=["seed", "problem"],
                                                values="score")
    assert (one["diffureason"] == one["vanilla"]).all()
    assert (one["no_revise"] == one["vanilla"]).all()


def test_models_saved_registered_and_loadable(dr_repo: Path):
    from stages.models.generate import load_model
    from stages.models.mdlm import load_mdlm

    folder = dr_repo / P / "models/seed0"
    model, tok = load_mdlm(folder / "mdlm")
    assert model.config.model_type == "bert" and tok.mask_token == "<mask>"
    assert (folder / "mdlm/model.safetensors").is_file()
    ar, _ = load_model(folder / "ar", device="cpu")
    assert ar.config.num_hidden_layers == model.config.num_hidden_layers
    client = mlflow_client(dr_repo)
    for name in ("diffureason-mdlm", "diffureason-ar"):
        assert "seed0" in client.get_registered_model(name).aliases


def test_compare_verdicts_plot_and_mlflow_arms(dr_repo: Path):
    head = json.loads((dr_repo / P / "metrics/compare.json").read_text())
    assert set(head) == {"reproduced", "inconclusive", "contradicted"}
    d = json.loads((dr_repo / P / "details/compare.json").read_text())
    for name in ("dr_vs_vanilla/x4", "dr_vs_best_of_n/x4", "revise_helps/x4",
                 "dr_vs_ar_mcts/x4", "revise_helps_hard"):
        assert d[f"claim/{name}/verdict"] in (-1.0, 0.0, 1.0)
    assert sum(head.values()) == sum(1 for k in d if k.endswith("/verdict"))
    assert (dr_repo / P / "report/curve.png").stat().st_size > 1000
    csv = pl.read_csv(dr_repo / P / "plots/diffureason_curve.csv")
    assert set(csv.columns) == {"arm", "mult", "accuracy", "nfe"}
    client = mlflow_client(dr_repo)
    exp = client.get_experiment_by_name("diffureason")
    runs = [r for r in client.search_runs([exp.experiment_id], max_results=1000)
            if r.data.tags.get("paperline.method") and r.data.params.get("arm")]
    assert {r.data.params["arm"] for r in runs} == ARMS
    assert {frozenset(r.data.metrics) for r in runs} == {
        frozenset({"accuracy", "nfe", "generations", "wall_s_per_problem"})}


def test_second_repro_of_the_pipeline_does_nothing(dr_repo: Path):
    out = dvc(dr_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]
