"""The `ddr` pipeline end to end at `smoke` through real `dvc repro` (after the shared stages)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from stages.core import io
from tests.conftest import assert_bad_param_rejected, dvc, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

P = Path("pipelines/ddr")
ARMS = ("learned", "breadth", "depth", "random", "reactive")


@pytest.fixture(scope="module")
def ddr_repo(smoke_repo: Path) -> Path:
    proc = paperline(smoke_repo, "repro", "ddr", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return smoke_repo


def test_databases_runs_and_scores_well_formed(ddr_repo: Path):
    from stages.agents.trajectories import read_rollouts

    d = io.read_metrics(ddr_repo / P / "details/databases.json")
    assert d["eval_entities"] == 6 and d["gold_sql_checked"] == d["eval_items"] + 30
    episodes, steps = read_rollouts(ddr_repo / P / "data/runs/rollouts")   # checked read
    assert set(episodes["agent"]) == set(ARMS) and episodes.height == 6 * len(ARMS)
    assert steps["step"].max() < 6                                          # the turn budget
    scores = pl.read_parquet(ddr_repo / P / "data/scores.parquet")
    # every arm judged at every budget on every item; the oracle at the largest only
    per = scores.group_by("arm", "budget").len()
    assert set(per.filter(pl.col("arm") != "oracle")["len"]) == {60}
    assert set(zip(per["arm"], per["budget"])) == {(a, b) for a in ARMS for b in (3, 6)} | \
        {("oracle", 6)}
    s = io.read_metrics(ddr_repo / P / "details/score.json")
    assert s["oracle/b6/acc_sample_m"] == 1.0 and s["oracle/b6/acc_item_t"] == 1.0
    assert s["reactive/b6/acc_sample_m"] == 1.0          # the checklist given: every fact found
    for a in ARMS:
        assert 0 <= s[f"{a}/b6/acc_sample_m"] <= 1 and 0 <= s[f"{a}/b6/entropy"] <= 1
    header = (ddr_repo / P / "plots/topk.csv").read_text().splitlines()
    assert header[0] == "k," + ",".join((*ARMS, "oracle")) and len(header) == 7


def test_compare_verdicts_readme_and_registered_explorer(ddr_repo: Path):
    c = io.read_metrics(ddr_repo / P / "details/compare.json")
    for name in ("reactive_vs_breadth", "breadth_vs_depth", "entropy_accuracy",
                 "learned_vs_random"):
        assert c[f"claim/{name}/verdict"] in (-1.0, 0.0, 1.0)
        assert c[f"claim/{name}/pairs"] == 2
    assert c["claim/reactive_vs_breadth/paper_effect"] == 0.106
    m = json.loads((ddr_repo / P / "metrics/compare.json").read_text())
    assert set(m) == {"reproduced", "inconclusive", "contradicted"}
    readme = (ddr_repo / P / "README.md").read_text()
    block = readme.split("<!-- results:start")[1].split("<!-- results:end")[0]
    assert "| reactive |" in block and "breadth-first > depth-first" in block
    client = mlflow_client(ddr_repo)
    v = client.get_model_version_by_alias("ddr-explorer", "learned")
    local = client.download_artifacts(v.run_id, "model", str(ddr_repo / "dl"))
    from stages.models.backend import LocalHFBackend

    backend = LocalHFBackend(local)                         # the real HF loading code
    assert backend.complete(["Task: Analyze patient 0\n"], max_new_tokens=4)[0][0].n_tokens >= 1


def test_arms_side_by_side_in_mlflow(ddr_repo: Path):
    client = mlflow_client(ddr_repo)
    exp = client.get_experiment_by_name("ddr")
    runs = [r for r in client.search_runs([exp.experiment_id], max_results=5000)
            if r.data.tags.get("paperline.source_stage") == "score"
            and r.data.tags.get("paperline.method")]
    assert {(r.data.params["arm"], r.data.params["seed"]) for r in runs} == \
        {(a, s) for a in (*ARMS, "oracle") for s in ("0", "1")}
    keys = {frozenset(r.data.metrics) for r in runs}
    assert len(keys) == 1 and "acc_sample_m" in next(iter(keys))


def test_bad_params_rejected_by_name_before_compute(ddr_repo: Path):
    assert_bad_param_rejected(ddr_repo / P, "ddr", "explore", "explore.arms",
                              ["breadth", "bredth"], "bredth", untouched=ddr_repo / P / "data/runs/insights.parquet")


def test_second_repro_of_the_pipeline_does_nothing(ddr_repo: Path):
    out = dvc(ddr_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]
