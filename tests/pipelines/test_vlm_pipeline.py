"""The `vlm` pipeline end to end at `smoke` through real `dvc repro` (it needs no other pipeline):
the data with its checks, a tiny LLaVA per family and seed saved and registered in MLflow, the
gates and the README block generated from them; a corrupted image stops a stage by name before
it trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import yaml

from stages.models import vlm as vm
from tests.conftest import copy_repo, dvc, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

P = Path("pipelines/vlm")


@pytest.fixture(scope="module")
def vlm_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = copy_repo(tmp_path_factory.mktemp("vlm") / "repo")
    started = time.perf_counter()
    proc = paperline(repo, "repro", "vlm", timeout=900)
    seconds = time.perf_counter() - started
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(f"paperline repro vlm at smoke: {seconds:.1f} s")
    return repo


def test_data_models_and_registry(vlm_repo: Path):
    data = vlm_repo / P / "data" / "tasks"
    for split in ("train", "val", "test"):
        assert pl.read_parquet(data / "shapes" / f"{split}.parquet").height > 0
        assert pl.read_parquet(data / "shapes" / f"{split}_questions.parquet").height > 0
        assert pl.read_parquet(data / "rendered_text" / f"{split}.parquet").height > 0
    client = mlflow_client(vlm_repo)
    for family, name in (("shapes", "vlm-shapes"), ("text", "vlm-text")):
        for seed in (0, 1):
            folder = vlm_repo / P / "models" / family / f"seed{seed}"
            vlm = vm.load_vlm(folder)                   # the Auto classes, offline
            vm.require_eager(vlm.model)
            assert type(vlm.model).__name__ == "LlavaForConditionalGeneration"
        versions = client.search_model_versions(f"name = '{name}'")
        assert sorted(v.tags["paperline.seed"] for v in versions) == ["0", "1"]
        aliases = client.get_registered_model(name).aliases
        assert {"champion", "seed-0", "seed-1"} <= set(aliases)
        by_seed = {v.tags["paperline.seed"]: v.version for v in versions}
        assert aliases["champion"] == by_seed["0"] == aliases["seed-0"]
        assert aliases["seed-1"] == by_seed["1"]
        # the gates stage tagged each version with its scores
        assert any(k.startswith("metric.") for k in
                   client.get_model_version(name, by_seed["1"]).tags)
    shapes = vm.load_vlm(vlm_repo / P / "models/shapes/seed0")
    assert shapes.layout.sink_tokens == 2 and shapes.layout.image_tokens == 64


def test_gates_metrics_and_readme(vlm_repo: Path):
    head = json.loads((vlm_repo / P / "metrics/gates.json").read_text())
    assert set(head) == {"caption_f1", "yes_no_acc", "chair_sentence", "ocr_exact",
                         "gate_chair", "gate_ocr"}
    details = json.loads((vlm_repo / P / "details/gates.json").read_text())
    for seed in (0, 1):
        assert 0 <= details[f"shapes/seed{seed}/chair_sentence"] <= 1
        assert details[f"text/seed{seed}/chars_per_token"] >= 2.0
        share = details[f"shapes/seed{seed}/sink_attention"]
        assert 0 <= share <= 1
    assert not any("seconds" in k for k in details)       # wall times go to MLflow only
    samples = pl.read_parquet(vlm_repo / P / "data/gates_samples.parquet")
    assert set(samples["family"]) == {"shapes", "text"} and set(samples["seed"]) == {0, 1}
    data = json.loads((vlm_repo / P / "details/data.json").read_text())
    assert data["text_test_chars_per_token_min"] >= 2.0
    readme = (vlm_repo / P / "README.md").read_text()
    block = readme.split("<!-- results:start")[1].split("<!-- results:end")[0]
    assert "CHAIR_S (captions with a hallucinated object)" in block
    assert f"{details['shapes/chair_sentence_mean']:.3f} ± " in block
    assert "**Gates**" in block


def test_second_repro_does_nothing(vlm_repo: Path):
    out = dvc(vlm_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]


def test_corrupted_image_named_before_training(vlm_repo: Path):
    path = vlm_repo / P / "data/tasks/shapes/train.parquet"
    good = path.read_bytes()
    try:
        df = pl.read_parquet(path)
        cut = pl.col("image").bin.slice(0, 40)
        bad = df.with_columns(pl.when(pl.col("id") == df["id"][3]).then(cut)
                              .otherwise(pl.col("image")).alias("image"))
        bad.write_parquet(path)
        proc = subprocess.run([sys.executable, "-m", "stages", "vlm", "train_shapes"],
                              cwd=vlm_repo / P, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PAPERLINE_TRACKING": "off"})
        assert proc.returncode != 0
        assert f"row {df['id'][3]}: column 'image': rule 'readable png'" in proc.stderr
        assert "steps x" not in proc.stdout                  # no model was built or trained
    finally:
        path.write_bytes(good)
    status = yaml.safe_load(dvc(vlm_repo, "status", str(P / "dvc.yaml"), "--json").stdout or "{}")
    assert not status, status
