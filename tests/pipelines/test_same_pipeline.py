"""The `same` pipeline end to end at `smoke` through real `dvc repro`, on the `vlm` pipeline's smoke
checkpoints (repro'd first, outside the timed part): five tasks drawn and verified, every arm
over every (seed, order) run with its accuracy matrix, usage and probe, adapters saved and
registered per arm, the gate and the claims, the README block generated from the metrics."""

from __future__ import annotations

import json
import time
from pathlib import Path

import polars as pl
import pytest

from tests.conftest import assert_bad_param_rejected, dvc, method_runs, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

P = Path("pipelines/same")
ARMS = {"lora", "moe_lora", "spectral", "curvature", "same"}


@pytest.fixture(scope="module")
def same_repo(vision_repo: Path) -> Path:
    repo = vision_repo
    started = time.perf_counter()
    proc = paperline(repo, "repro", "same", timeout=900)
    print(f"paperline repro same at smoke: {time.perf_counter() - started:.1f} s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return repo


def test_tasks_runs_matrix_and_adapters(same_repo: Path):
    tasks = json.loads((same_repo / P / "details/tasks.json").read_text())
    assert tasks["tasks"] == 5 and tasks["many/test_rows"] == 8
    runs = pl.read_parquet(same_repo / P / "data/runs/runs.parquet")
    assert set(runs["arm"]) == ARMS and runs.height == 5             # 1 seed x 1 order
    matrix = pl.read_parquet(same_repo / P / "data/runs/matrix.parquet")
    assert matrix.height == 5 * 15                     # a[i][j], j <= i, 5 tasks, per arm
    assert matrix["acc"].is_between(0, 1).all()
    # the smoke profile's order (reversed) is the one applied
    firsts = matrix.filter((pl.col("after") == 0) & (pl.col("position") == 0))
    assert set(firsts["task"]) == {"two"}
    assert matrix.filter(pl.col("after") == 4).sort("arm", "position")["task"].to_list()[:5] \
        == ["two", "one", "same_colour", "many", "colour"]
    lora = runs.filter(pl.col("arm") == "lora")
    assert lora["router_js"].is_nan().all() and lora["probe_acc"].is_nan().all()
    moe = runs.filter(pl.col("arm") != "lora")
    assert moe["router_js"].is_finite().all() and moe["probe_acc"].is_finite().all()
    assert (runs.filter(pl.col("arm") == "same")["frozen_share"] > 0).all()
    assert (runs.filter(pl.col("arm") == "curvature")["frozen_share"] == 0).all()
    usage = pl.read_parquet(same_repo / P / "data/runs/usage.parquet")
    sums = usage.group_by("arm", "seed", "order", "when", "layer").agg(pl.col("usage").sum())
    assert ((sums["usage"] - 1).abs() < 1e-4).all()                  # distributions
    for arm in ARMS:
        folder = same_repo / P / "models/adapters" / arm / "seed0-order0"
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["adapter"]["experts"] == (1 if arm == "lora" else 5)
        assert (folder / "adapter.safetensors").stat().st_size > 1000


def test_compare_gate_claims_readme_and_registry(same_repo: Path):
    details = json.loads((same_repo / P / "details/compare.json").read_text())
    head = json.loads((same_repo / P / "metrics/compare.json").read_text())
    assert details["runs"] == 1 and "gate/lora_bwt/ci_low" in details
    verdicts = sum(head[k] for k in ("reproduced", "inconclusive", "contradicted"))
    # the headline counts the paper's claims only; the gate is its own key
    assert head["gate"] == details["gate_forgetting"]
    if details["gate_forgetting"]:     # 7 claims, each with a verdict
        assert verdicts == 7
    else:            # the gate fails: the claims keep their numbers, without a verdict
        assert verdicts == 0
        assert "untested/spectral_step/diff" in details
    assert (same_repo / P / "report/accuracy_matrix.png").stat().st_size > 1000
    assert paperline(same_repo, "report", "same").returncode == 0
    block = (same_repo / P / "README.md").read_text().split("<!-- results:start")[1]
    block = block.split("<!-- results:end")[0]
    assert "+ spectral router beats MoE-LoRA" in block and "**Gate**" in block
    client = mlflow_client(same_repo)
    aliases = set(client.get_registered_model("same-adapter").aliases)
    assert aliases == {"lora", "moe-lora", "spectral", "curvature", "same", "champion"}
    runs = method_runs(client, "same")
    assert {(r.data.params.get("arm"), r.data.params.get("order")) for r in runs} >= \
        {(a, "0") for a in ARMS}


def test_bad_params_rejected_before_compute(same_repo: Path):
    untouched = same_repo / P / "data/runs/runs.parquet"
    assert_bad_param_rejected(same_repo / P, "same", "train", "train.method.delta", 1.5,
                              "less than or equal to 1", untouched)


def test_second_repro_does_nothing(same_repo: Path):
    out = dvc(same_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]
