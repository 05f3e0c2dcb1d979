"""The `bis` pipeline end to end at `smoke` through real `dvc repro` (after the shared stages)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from stages.core import io, stats
from tests.conftest import dvc, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

ARMS = ["full", "random_25", "bis_25", "mixed_25"]  # the smoke profile's arms
P = Path("pipelines/bis")


@pytest.fixture(scope="module")
def bis_repo(smoke_repo: Path) -> Path:
    proc = paperline(smoke_repo, "repro", "bis", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return smoke_repo


def test_rollouts_carry_exact_and_monte_carlo_step_labels(bis_repo: Path):
    train = pl.read_parquet(bis_repo / P / "data/mc_labels/train.parquet")
    made = json.loads((bis_repo / P / "details/rollouts.json").read_text())
    assert train.height + made["train_dropped_no_steps"] == 24 * 2  # 24 problems x 2 rollouts
    assert train.height > 0
    for r in train.iter_rows(named=True):
        n = len(r["steps"])
        assert len(r["mc_scores"]) == len(r["mc_labels"]) == len(r["step_correct"]) == n
        assert all(s * 4 == round(s * 4) for s in r["mc_scores"])        # K = 4: s in {0,.25,..}
        assert r["mc_labels"] == [s > 0 for s in r["mc_scores"]]
        assert r["source"] == f"d{r['difficulty']}"
    m = json.loads((bis_repo / P / "details/mc_annotate.json").read_text())
    assert 0.0 <= m["label_agreement"] <= 1.0 and m["continuations"] > 0


def test_subsets_keep_their_share_of_every_source(bis_repo: Path):
    pool = pl.read_parquet(bis_repo / P / "data/mc_labels/train.parquet")
    subsets = pl.read_parquet(bis_repo / P / "data/subsets/subsets.parquet")
    sizes = pool.group_by("source").len()
    expected = sum(max(1, int(n * 0.25)) for n in sizes["len"].to_list())
    for arm in ARMS:
        for seed in (0, 1):
            got = subsets.filter((pl.col("arm") == arm) & (pl.col("seed") == seed)).height
            assert got == (pool.height if arm == "full" else expected), (arm, seed)
    bis0 = subsets.filter((pl.col("arm") == "bis_25") & (pl.col("seed") == 0))["rollout_id"]
    bis1 = subsets.filter((pl.col("arm") == "bis_25") & (pl.col("seed") == 1))["rollout_id"]
    assert bis0.to_list() == bis1.to_list()  # a deterministic rule repeats its subset


def test_every_arm_trains_a_prm_per_seed_at_the_budget_rule(bis_repo: Path):
    base = load_file(str(next((bis_repo / "models/base").glob("*.safetensors"))))
    budget = json.loads((bis_repo / P / "prms/budget.json").read_text())
    assert budget["passes"] == 1 and budget["batch_size"] == 4
    curves = pl.read_parquet(bis_repo / P / "prms/curves.parquet")
    subsets = pl.read_parquet(bis_repo / P / "data/subsets/subsets.parquet")
    for arm in ARMS:
        for seed in (0, 1):
            n = subsets.filter((pl.col("arm") == arm) & (pl.col("seed") == seed)).height
            c = curves.filter((pl.col("arm") == arm) & (pl.col("seed") == seed))
            assert c["step"].max() == -(-n // 4)                      # one pass: ceil(n / 4)
            after = load_file(str(bis_repo / P / "prms" / arm / f"seed{seed}"
                                  / "model.safetensors"))
            assert after["score.weight"].shape[0] == 2                # the 2-way step head
            moved = [k for k in after if k in base and not torch.equal(after[k], base[k])]
            assert moved, f"{arm}/seed{seed}: training left the backbone unchanged"


def test_compare_metrics_readme_and_registry(bis_repo: Path):
    m = io.read_metrics(bis_repo / P / "details/compare.json")   # every number (NaN: null)
    for arm in ARMS:
        assert 0.0 <= m[f"{arm}/f1_mean"] <= 1.0 and m[f"{arm}/f1_std"] >= 0.0
        assert 0.0 <= m[f"{arm}/best_of_n_mean"] <= 1.0
    assert m["bis_25/train_steps"] < m["full/train_steps"]
    assert m["bon_random"] <= m["bon_oracle"]
    assert "bis_25/gain_vs_random" in m and "mixed_25/gain_vs_full" in m
    assert (bis_repo / P / "report/val_f1_curves.png").stat().st_size > 1000
    readme = (bis_repo / P / "README.md").read_text()
    block = readme.split("<!-- results:start")[1].split("<!-- results:end")[0]
    assert "| bis_25 |" in block and f"{m['bis_25/f1_mean']:.3f}" in block
    # the smoke profile's claims, paired over the 2 seeds by the claim rule (no boolean keys)
    assert not any(k.startswith("claim_") for k in m)
    for prefix in ("claim/bis_25_vs_random_25/f1", "claim/bis_25_vs_mixed_25/f1",
                   "claim/bis_25_vs_full/best_of_n"):
        c = stats.read_claim(m, prefix)
        assert c is not None and c.n == 2 and c.sentence() in block
    assert m["claim/bis_25_vs_random_25/f1/paper_effect"] == 0.0209

    proc = paperline(bis_repo, "compare", "bis")
    assert proc.returncode == 0, proc.stderr[-2000:]
    client = mlflow_client(bis_repo)
    rm = client.get_registered_model("bis-prm")
    assert set(rm.aliases) == {"bis-25", "full"}
    v = client.get_model_version_by_alias("bis-prm", "bis-25")
    assert v.tags["paperline.subset"] == "bis_25"
    # the version carries its test scores (tagged by the evaluate stage)
    seed = int(v.tags["paperline.seed"])
    scores = pl.read_parquet(bis_repo / P / "data/prm_eval/evaluation.parquet").filter(
        (pl.col("arm") == "bis_25") & (pl.col("seed") == seed))
    assert float(v.tags["metric.test_f1"]) == pytest.approx(scores["f1"][0], abs=1e-5)
    assert {"metric.best_of_n", "metric.val_f1"} <= set(v.tags)


def test_second_repro_of_the_pipeline_does_nothing(bis_repo: Path):
    out = dvc(bis_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]
