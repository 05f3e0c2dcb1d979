"""The `core` pipeline end to end at `smoke` through real `dvc repro`, on the `vlm` pipeline's smoke
`vlm-text` checkpoints (repro'd first, outside the timed part): every SFT arm trained and saved
per seed, every arm's answers from the text and from the page on the same items, the claims with
their verdicts, the figure, the README block generated from the metrics, the registry."""

from __future__ import annotations

import json
import time
from pathlib import Path

import polars as pl
import pytest

from tests.conftest import assert_bad_param_rejected, dvc, method_runs, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

P = Path("pipelines/core")
ARMS = ("text_sft", "visual_sft", "core_sft")
RL_ARMS = ("visual_grpo", "core_grpo")


@pytest.fixture(scope="module")
def core_repo(vision_repo: Path) -> Path:
    repo = vision_repo
    started = time.perf_counter()
    proc = paperline(repo, "repro", "core", timeout=900)
    print(f"paperline repro core at smoke: {time.perf_counter() - started:.1f} s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return repo


def test_every_arm_trained_and_answers_the_same_items_from_text_and_page(core_repo: Path):
    from safetensors.torch import load_file

    answers = pl.read_parquet(core_repo / P / "data/answers/answers.parquet")
    assert set(answers["arm"]) == {"base", *ARMS} and set(answers["seed"]) == {0, 1}
    assert set(answers["modality"]) == {"text", "image"}
    # the same (seed, item) pairs under every arm and input: the pairing the claims rest on
    keys = answers.group_by("arm", "modality").agg(pl.struct("seed", "item").sort().alias("k"))
    assert len({tuple(map(str, k)) for k in keys["k"].to_list()}) == 1
    assert answers.height == 4 * 2 * 2 * 6              # arms x inputs x seeds x 6 test items
    # the smoke profile reads the pages stage's index pages, as cpu does
    assert set(answers["kind"]) == {"index"}
    test_pages = pl.read_parquet(core_repo / P / "data/pages/rendered_text/test.parquet")
    assert set(answers["item"]) == set(test_pages["id"])
    details = json.loads((core_repo / P / "details/sft.json").read_text())
    assert details["chars_per_visual_token"] == 2.0      # issue 18: >= 2 per visual token
    assert details["eval_items"] == 6 and details["steps"] == 3
    assert (answers["nll"] > 0).all()            # the reference answer's NLL, both inputs
    for seed in (0, 1):
        # CoRe-SFT logs its three loss parts; the baselines one each
        assert {"final_match", "final_ce_img", "final_ce_txt"} <= {
            k.split("/")[-1] for k in details if k.startswith(f"seed{seed}/core_sft/")}
        assert f"seed{seed}/visual_sft/final_ce_img" in details
        assert f"seed{seed}/text_sft/final_ce_txt" in details
        assert f"seed{seed}/base/acc_image" in details
        base = load_file(str(core_repo / "pipelines/vlm/models/text" / f"seed{seed}"
                             / "model.safetensors"))
        for arm in ARMS:
            trained = load_file(str(core_repo / P / "models" / arm / f"seed{seed}"
                                    / "model.safetensors"))
            assert trained.keys() == base.keys()
            assert any(not (trained[k] == base[k]).all() for k in base), f"{arm} did not train"
    # visual SFT never trains the text path's prompt tokens; text SFT never the vision tower
    text_model = load_file(str(core_repo / P / "models/text_sft/seed0/model.safetensors"))
    base0 = load_file(str(core_repo / "pipelines/vlm/models/text/seed0/model.safetensors"))
    tower = [k for k in base0 if "vision_tower" in k]
    assert tower and all((text_model[k] == base0[k]).all() for k in tower)


def test_grpo_arms_start_from_text_sft_and_answer_the_same_items(core_repo: Path):
    from safetensors.torch import load_file

    rl = pl.read_parquet(core_repo / P / "data/rl_answers/answers.parquet")
    sft = pl.read_parquet(core_repo / P / "data/answers/answers.parquet")
    assert set(rl["arm"]) == set(RL_ARMS) and set(rl["seed"]) == {0, 1}
    key = ["seed", "item", "modality"]
    assert rl.filter(pl.col("arm") == "core_grpo").select(key).sort(key).equals(
        sft.filter(pl.col("arm") == "base").select(key).sort(key))
    details = json.loads((core_repo / P / "details/grpo.json").read_text())
    assert details["rounds"] == 2
    for seed in (0, 1):
        assert details[f"seed{seed}/core_grpo/rollouts"] == 2 * 2 * 2     # rounds x prompts x G
        assert details[f"seed{seed}/core_grpo/first_anchor_kl"] >= 0
        assert f"seed{seed}/visual_grpo/first_anchor_kl" not in details  # no anchor term
        start = load_file(str(core_repo / P / "models/text_sft" / f"seed{seed}"
                              / "model.safetensors"))
        core = load_file(str(core_repo / P / "rl_models/core_grpo" / f"seed{seed}"
                             / "model.safetensors"))
        # the anchor KL gives a gradient even where every rollout's reward is equal
        assert any(not (core[k] == start[k]).all() for k in start)


def test_compare_claims_figure_readme_and_registry(core_repo: Path):
    head = json.loads((core_repo / P / "metrics/compare.json").read_text())
    cmp = json.loads((core_repo / P / "details/compare.json").read_text())
    assert cmp["seeds"] == 2 and cmp["items"] == 6 and cmp["chars_per_visual_token"] == 2.0
    # three claims on accuracy and three on the answer's NLL, gap recovery of CoRe-SFT and
    # CoRe-RL on each
    verdicts = sum(head[k] for k in ("reproduced", "inconclusive", "contradicted"))
    assert verdicts == 10
    assert cmp["claim/transfer_failure/pairs"] == 12               # 2 seeds x 6 items
    assert cmp["claim/core_grpo_vs_visual_grpo/pairs"] == 12
    assert cmp["claim/gap_recovery_sft/paper_effect"] == 0.70
    assert (core_repo / P / "report/accuracy.png").stat().st_size > 1000
    assert paperline(core_repo, "report", "core").returncode == 0
    block = (core_repo / P / "README.md").read_text().split("<!-- results:start")[1]
    block = block.split("<!-- results:end")[0]
    assert "CoRe-SFT beats visual SFT on the page" in block and "| visual SFT |" in block
    client = mlflow_client(core_repo)
    for arm in ARMS + RL_ARMS:
        alias = arm.replace("_", "-")
        version = client.get_model_version_by_alias("core-policy", alias)
        assert version.tags["paperline.method"] == arm and version.tags["paperline.seed"] == "0"
        assert client.get_model_version_by_alias("core-policy", f"{alias}-seed1").version
    runs = method_runs(client, "core")
    assert {(r.data.params.get("arm"), r.data.params.get("seed")) for r in runs} >= \
        {(a, s) for a in ("base", *ARMS, *RL_ARMS) for s in ("0", "1")}
    assert all("acc_image" in r.data.metrics for r in runs)


def test_bad_params_rejected_before_compute(core_repo: Path):
    untouched = core_repo / P / "data/answers/answers.parquet"
    assert_bad_param_rejected(core_repo / P, "core", "sft", "sft.core.divergence", "js",
                              "forward", untouched)
    assert_bad_param_rejected(core_repo / P, "core", "sft", "sft.arms", ["visual_sft", "oops"],
                              "core_sft", untouched)


def test_second_repro_does_nothing(core_repo: Path):
    out = dvc(core_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]
