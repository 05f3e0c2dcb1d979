"""The `bridgevlm` pipeline end to end at `smoke` through real `dvc repro` (one repro, many
assertions): the SCM pairs and their checks, every arm trained and answering the test split on
every seed, the saved models reloading, the claims with their verdicts, the README block
generated from the metrics, MLflow's registered versions per arm, a bad param refused before
compute and a second repro doing nothing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import polars as pl
import pytest

from tests.conftest import assert_bad_param_rejected, dvc, method_runs, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

P = Path("pipelines/bridgevlm")
ARMS = ("answer_only", "prompt_level", "bridgevlm", "bridgevlm_concat", "no_dag", "no_node",
        "no_graph", "oracle")
CAUSAL = ("bridgevlm", "bridgevlm_concat", "no_dag", "no_node", "no_graph")


@pytest.fixture(scope="module")
def bvlm_repo(vision_repo: Path) -> Path:
    repo = vision_repo
    started = time.perf_counter()
    proc = paperline(repo, "repro", "bridgevlm", timeout=900)
    print(f"paperline repro bridgevlm at smoke: {time.perf_counter() - started:.1f} s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return repo


def test_pairs_arms_models_and_claims(bvlm_repo: Path):
    from stages.bridgevlm import causal
    from stages.models.vlm import load_vlm
    from stages.tasks import pendulum

    data = bvlm_repo / P / "data/pairs"
    sizes = {}
    for split in ("train", "val", "test"):
        df = pl.read_parquet(data / f"{split}.parquet")
        sizes[split] = df.height
        assert set(df["scm"]) == {"pendulum", "relay"} and set(df["split"]) == {split}
        pendulum.check_ground_truth(df, split)
    assert sizes == {"train": 24, "val": 4, "test": 8}

    details = json.loads((bvlm_repo / P / "details/train.json").read_text())
    for arm in ARMS:
        for seed in (0, 1):
            for key in ("intervention_acc", "cf_acc", "structure_f1", "loss"):
                assert f"seed{seed}/{arm}/{key}" in details, (arm, seed, key)
            folder = bvlm_repo / P / "models" / arm / f"seed{seed}"
            assert (folder / "config.json").is_file()
            assert (folder / "causal.safetensors").is_file() == (arm in CAUSAL)
    # A-based structure metrics only where a DAG is learned; both SCMs scored
    assert "seed0/bridgevlm/a_f1_hard_relay" in details
    assert "seed0/bridgevlm/a_scm_gap" in details
    assert "seed0/no_dag/a_f1_hard" not in details and "seed0/oracle/a_f1_hard" not in details
    # a saved causal arm reloads: the LLaVA through the Auto classes, the module strictly
    folder = bvlm_repo / P / "models/no_graph/seed0"
    vlm = load_vlm(folder)
    shape = json.loads((folder / "causal.json").read_text())
    assert shape["graph_tokens"] is False and shape["variables"] == list(pendulum.VARIABLES)
    module = causal.CausalModule(vlm.model.config.text_config.hidden_size,
                                 causal.CausalSpec(**shape["spec"]), 4, 4,
                                 dag=shape["dag"], node_tokens=shape["node_tokens"],
                                 graph_tokens=shape["graph_tokens"],
                                 decoder_ramp=shape["decoder_ramp"])
    from safetensors.torch import load_file
    module.load_state_dict(load_file(str(folder / "causal.safetensors")), strict=True)

    head = json.loads((bvlm_repo / P / "metrics/compare.json").read_text())
    cmp = json.loads((bvlm_repo / P / "details/compare.json").read_text())
    tested = sum(head[k] for k in ("reproduced", "inconclusive", "contradicted"))
    assert tested + head["not_tested"] == 10         # 9 arm claims + the induction claim
    assert cmp.get("claim/interv_vs_prompt/paper_effect") == 0.212 or \
        cmp.get("claim/interv_vs_prompt/not_tested") == 1
    assert cmp["memorised_f1"] == pytest.approx(2 / 7)
    assert paperline(bvlm_repo, "report", "bridgevlm").returncode == 0
    block = (bvlm_repo / P / "README.md").read_text().split("<!-- results:start")[1]
    block = block.split("<!-- results:end")[0]
    assert "| bridgevlm |" in block and "| oracle |" in block
    assert "BridgeVLM > prompt-level, intervention accuracy" in block


def test_mlflow_versions_bad_param_and_noop(bvlm_repo: Path):
    client = mlflow_client(bvlm_repo)
    for arm in ("bridgevlm", "prompt_level", "oracle"):
        version = client.get_model_version_by_alias("bridgevlm-vlm", arm)
        assert version.tags["bridgevlm.arm"] == arm
        assert client.get_model_version_by_alias("bridgevlm-vlm", f"{arm}-seed-1").version
    runs = [r for r in method_runs(client, "bridgevlm", methods_only=False)
            if r.data.params.get("arm") == "bridgevlm"]
    assert len(runs) == 2 and all("intervention_acc" in r.data.metrics for r in runs)
    assert_bad_param_rejected(bvlm_repo / P, "bridgevlm", "train", "train.losses.edge", -1.0,
                              "edge", bvlm_repo / P / "metrics/train.json")
    out = dvc(bvlm_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]
