"""The `cotfsm` pipeline end to end at `smoke` through real `dvc repro` (it trains its own model:
no shared stage needed, so the repo is copied bare)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from tests.conftest import copy_repo, dvc, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

P = Path("pipelines/cotfsm")
ARMS = ("default", "greedy", "weighted", "qvalue")


@pytest.fixture(scope="module")
def cotfsm_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = copy_repo(tmp_path_factory.mktemp("cotfsm") / "repo")
    proc = paperline(repo, "repro", "cotfsm", timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return repo


def test_models_fits_and_results_are_well_formed(cotfsm_repo: Path):
    from transformers import AutoModelForCausalLM

    for seed in (0, 1):
        folder = cotfsm_repo / P / "models" / f"seed{seed}"
        assert (folder / "model.safetensors").is_file()
        AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
        fit = json.loads((cotfsm_repo / P / "fits" / f"seed{seed}" / "fsm.json").read_text())
        assert 1 <= fit["layer"] <= 2 and len(fit["Q"]) == 6 and len(fit["policy"]) == 6
    res = pl.read_parquet(cotfsm_repo / P / "results/results.parquet")
    # every arm at every budget on every (seed, problem): paired, at the same budget
    assert res.group_by(["arm", "budget"]).len()["len"].to_list() == [2 * 32] * 8
    assert (res["nfe"] <= res["budget"]).all()
    assert (res.filter(pl.col("arm") == "default")["interventions"] == 0).all()
    # greedy steers at every sentence end it reads (but where its transition was never seen:
    # no vector); Q-value only through its gates
    greedy = res.filter(pl.col("arm") == "greedy")
    assert (greedy["interventions"] <= greedy["probe_reads"]).all()
    assert greedy["interventions"].sum() >= 0.5 * greedy["probe_reads"].sum() > 0
    q = res.filter(pl.col("arm") == "qvalue")
    assert (q["interventions"] <= q["probe_reads"]).all()


def test_compare_claims_readme_and_metrics(cotfsm_repo: Path):
    m = json.loads((cotfsm_repo / P / "details/compare.json").read_text())
    head = json.loads((cotfsm_repo / P / "metrics/compare.json").read_text())
    assert set(head) == {"reproduced", "inconclusive", "contradicted"}
    for name in ("qvalue_vs_default", "qvalue_vs_greedy", "qvalue_vs_weighted",
                 "weighted_vs_greedy", "qvalue_fewer_interventions"):
        assert m[f"claim/{name}/verdict"] in (-1.0, 0.0, 1.0)
        assert m[f"claim/{name}/pairs"] == 64                    # 2 seeds x 32 problems
    assert 0 <= m["mcnemar/qvalue_vs_greedy/p"] <= 1
    s = json.loads((cotfsm_repo / P / "details/steer_eval.json").read_text())
    for arm in ARMS:
        for b in (48, 96):
            assert 0 <= s[f"{arm}/B{b}/acc_mean"] <= 1
    assert not any("seconds" in k for k in s)                    # wall times: MLflow only
    readme = (cotfsm_repo / P / "README.md").read_text()
    block = readme.split("<!-- results:start")[1].split("<!-- results:end")[0]
    assert f"| qvalue | {s['qvalue/B48/acc_mean']:.3f}" in block
    out = dvc(cotfsm_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]


def test_arms_side_by_side_in_mlflow_and_registered_models(cotfsm_repo: Path):
    client = mlflow_client(cotfsm_repo)
    exp = client.get_experiment_by_name("cotfsm")
    runs = client.search_runs([exp.experiment_id], max_results=500)
    arms = [r for r in runs if r.data.tags.get("paperline.stage") == "steer_eval"
            and r.data.tags.get("paperline.method")]
    assert sorted((r.data.params["arm"], r.data.params["seed"]) for r in arms) == sorted(
        (a, s) for a in ARMS for s in ("0", "1"))
    common = {f"B{b}/{k}" for b in (48, 96) for k in ("acc", "interventions", "nfe")}
    assert all(set(r.data.metrics) == common for r in arms)
    for seed in ("0", "1"):                                     # a version per training seed
        version = client.get_model_version_by_alias("cotfsm-lm", f"seed{seed}")
        assert version.tags["paperline.seed"] == seed
        assert version.source.endswith(f"model-seed{seed}")
