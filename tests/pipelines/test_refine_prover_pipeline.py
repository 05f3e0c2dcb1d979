"""The `refine_prover` pipeline end to end at `smoke` through real `dvc repro` (it reads no
shared stage's output, so it starts from a fresh copy, not the base smoke repo)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from tests.conftest import copy_repo, dvc, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

P = Path("pipelines/refine_prover")


@pytest.fixture(scope="module")
def prover_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = copy_repo(tmp_path_factory.mktemp("refine_prover") / "repo")
    proc = paperline(repo, "repro", "refine_prover", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return repo


def test_problems_certified_and_kernel_checked(prover_repo: Path):
    d = json.loads((prover_repo / P / "details/problems.json").read_text())
    assert d["z3_certified_share"] == 1.0 and d["tampered"] > 1000
    assert 0.99 <= d["tamper_rejected_share"] <= 1.0
    coq = json.loads((prover_repo / P / "data/problems/coq_cross_check.json").read_text())
    assert coq["ran"] == bool(d["coq_ran"])
    if coq["ran"]:
        assert coq["unexplained"] == 0 and d["coq_agreement"] == 1.0
    else:
        assert "coqc" in coq["reason"]


def test_every_arm_budget_problem_and_the_ledger(prover_repo: Path):
    res = pl.read_parquet(prover_repo / P / "data/search/results.parquet")
    arms = {"iid", "random_tree", "value_tree", "long_history", "base_refiner", "cold_refiner"}
    assert set(res["arm"].unique()) == arms
    assert res.group_by("seed", "arm", "budget").len()["len"].unique().to_list() == [8]
    # no problem spent past its budget; a solved problem spent at least one generation
    assert (res["generations"] <= res["budget"]).all()
    assert (res.filter(pl.col("score") == 1.0)["generations"] >= 1).all()
    # nested budgets: solved at B=2 stays solved at B=4, and costs never shrink
    wide = res.pivot(on="budget", index=["seed", "arm", "problem"], values="score")
    assert (wide["4"] >= wide["2"]).all()
    # refinement prompts are longer than base prompts: the tree arms read more per generation
    top = res.filter(pl.col("budget") == 4)
    per_gen = top.group_by("arm").agg((pl.col("input_tokens").sum()
                                       / pl.col("generations").sum()).alias("in_per_gen"))
    v = dict(per_gen.iter_rows())
    assert v["long_history"] > v["iid"] and v["random_tree"] > v["iid"]
    d = json.loads((prover_repo / P / "details/search.json").read_text())
    assert "iid_check/max_abs_z" in d and d["real_failures/wrong_proofs"] > 0


def test_models_registered_and_loadable(prover_repo: Path):
    from stages.models.generate import load_model

    for name in ("base", "refiner_cold", "refiner"):
        folder = prover_repo / P / "models/seed0" / name
        assert (folder / "model.safetensors").is_file()
        model, tok = load_model(folder, device="cpu")
        assert model.config.num_hidden_layers == 2
    client = mlflow_client(prover_repo)
    for name in ("refine-prover-base", "refine-prover-refiner"):
        assert "seed0" in client.get_registered_model(name).aliases


def test_compare_verdicts_readme_and_mlflow(prover_repo: Path):
    head = json.loads((prover_repo / P / "metrics/compare.json").read_text())
    assert set(head) == {"reproduced", "inconclusive", "contradicted"}
    d = json.loads((prover_repo / P / "details/compare.json").read_text())
    for name in ("value_vs_random/B4", "random_vs_iid/B4", "ei_vs_cold", "cold_vs_untrained",
                 "tokens_tree_vs_history"):
        assert d[f"claim/{name}/verdict"] in (-1.0, 0.0, 1.0)
    assert sum(head.values()) == sum(1 for k in d if k.endswith("/verdict"))
    assert (prover_repo / P / "report/curve.png").stat().st_size > 1000
    client = mlflow_client(prover_repo)
    exp = client.get_experiment_by_name("refine_prover")
    runs = [r for r in client.search_runs([exp.experiment_id], max_results=1000)
            if r.data.tags.get("paperline.method") and r.data.params.get("arm")]
    assert {r.data.params["arm"] for r in runs} >= {"iid", "random_tree", "value_tree"}
    assert {frozenset(r.data.metrics) for r in runs} == {
        frozenset({"solved", "output_tokens", "input_tokens", "generations"})}


def test_second_repro_of_the_pipeline_does_nothing(prover_repo: Path):
    out = dvc(prover_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]
