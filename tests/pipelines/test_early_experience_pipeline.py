"""The `early_experience` pipeline end to end at `smoke` through real `dvc repro` (after the
shared stages)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import polars as pl
import pytest

from stages.core import io
from tests.conftest import assert_bad_param_rejected, dvc, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

P = Path("pipelines/early_experience")
ARMS = ("il", "iwm", "sr", "dpo")


@pytest.fixture(scope="module")
def ee_repo(smoke_repo: Path) -> Path:
    proc = paperline(smoke_repo, "repro", "early_experience", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return smoke_repo


def test_shop_experience_and_rollouts_well_formed(ee_repo: Path):
    from stages.agents.trajectories import read_rollouts

    s = io.read_metrics(ee_repo / P / "details/shop.json")
    assert s["demos"] == 24 and s["demo_success"] == 1.0
    assert s["expert/test/success"] == 1.0 and s["expert/ood/success"] == 1.0
    assert s["expert/ood_combo/success"] == 1.0
    assert s["random/test/success"] <= 0.25
    exp = pl.read_parquet(ee_repo / P / "data/experience.parquet")
    states = exp.filter(pl.col("j") == 0)
    assert states.height == 24 * 4                      # every expert turn is a state
    alts = exp.filter(pl.col("j") > 0)
    assert alts.height > 0 and (alts["call"] != alts["expert_call"]).all()
    assert (alts["reflection"].str.len_chars() > 0).all()
    episodes, steps = read_rollouts(ee_repo / P / "data/runs/rollouts")    # checked read
    assert set(episodes["agent"]) == set(ARMS)
    # arms x seeds x (test + ood + ood_combo goals)
    assert episodes.height == len(ARMS) * 2 * (8 + 8 + 8)
    assert steps["step"].max() < 4                      # the turn budget
    succ = pl.read_parquet(ee_repo / P / "data/runs/success.parquet")
    # every arm and seed played the same goals: success is paired per episode
    played = {tuple(g["goal"].sort()) + tuple(g["split"].sort())
              for _, g in succ.group_by("setting", "seed")}
    assert len(played) == 1


def test_equal_updates_compare_and_readme(ee_repo: Path):
    t = io.read_metrics(ee_repo / P / "details/train.json")
    assert t["updates"] == 4
    assert t["iwm/iwm_examples"] > t["il/il_examples"] and t["sr/sr_examples"] > 0
    c = io.read_metrics(ee_repo / P / "details/compare.json")
    for name in ("iwm_vs_il", "sr_vs_il", "iwm_vs_il_ood", "sr_vs_il_ood", "iwm_vs_il_ood_combo",
                 "sr_vs_il_ood_combo", "iwm_vs_dpo", "sr_vs_dpo", "il_vs_random"):
        assert c[f"claim/{name}/verdict"] in (-1.0, 0.0, 1.0)
        assert c[f"claim/{name}/pairs"] == 2
    assert c["claim/iwm_vs_il/paper_effect"] == 0.113
    m = json.loads((ee_repo / P / "metrics/compare.json").read_text())
    assert set(m) == {"reproduced", "inconclusive", "contradicted"}     # both worlds' claims
    assert sum(m.values()) == sum(k.endswith("/verdict") for k in c)
    readme = (ee_repo / P / "README.md").read_text()
    block = readme.split("<!-- results:start")[1].split("<!-- results:end")[0]
    assert "| IWM -> IL |" in block and "SR > IL, OOD" in block and "templated" in block
    assert "OOD (unseen colour × category)" in block


def test_every_arm_reads_the_worlds_one_subword_vocabulary(ee_repo: Path):
    """`tokenizer: bpe`: one tokenizer per world, learnt in `train`, saved with every policy."""
    from transformers import AutoTokenizer

    for world, folder, text in (("train", "models/policies", "Task: red hat, size M, max $20"),
                                ("babyai_train", "models/babyai_policies",
                                 "Task: go to the red ball")):
        saved = {(ee_repo / P / folder / arm / "s0/tokenizer.json").read_bytes() for arm in ARMS}
        assert len(saved) == 1, world
        tok = AutoTokenizer.from_pretrained(str(ee_repo / P / folder / "il/s0"))
        assert len(tok) == io.read_metrics(ee_repo / P / f"details/{world}.json")["vocab_size"]
        assert len(tok) > 4 + 95                                  # merges over the characters
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) < len(text) / 2 and tok.unk_token_id not in ids, world


def test_every_arm_registered_with_its_alias(ee_repo: Path):
    client = mlflow_client(ee_repo)
    for arm in ARMS:
        v = client.get_model_version_by_alias("early-experience-policy", arm)
        assert v.tags["arm"] == arm
        if arm == "sr":
            assert v.tags["reflections"] == "templated"


def test_registered_policy_loads_and_arms_side_by_side(ee_repo: Path):
    client = mlflow_client(ee_repo)
    from stages.models.backend import LocalHFBackend

    v = client.get_model_version_by_alias("early-experience-policy", "il")
    assert v.tags["arm"] == "il"
    local = client.download_artifacts(v.run_id, "model", str(ee_repo / "dl"))
    backend = LocalHFBackend(local)                      # the real HF loading code
    assert backend.complete(["Task: red hat, size M, max $20 | "],
                            max_new_tokens=4)[0][0].n_tokens >= 1
    exp = client.get_experiment_by_name("early_experience")
    runs = [r for r in client.search_runs([exp.experiment_id], max_results=5000)
            if r.data.tags.get("paperline.source_stage") == "evaluate"
            and r.data.tags.get("paperline.method")]
    assert {(r.data.params["arm"], r.data.params["seed"]) for r in runs} == \
        {(a, s) for a in ARMS for s in ("0", "1")}
    assert {r.data.params["reflections"] for r in runs if r.data.params["arm"] == "sr"} == \
        {"templated"}
    keys = {frozenset(r.data.metrics) for r in runs}
    assert len(keys) == 1
    assert {"success_test", "success_ood", "success_ood_combo"} <= next(iter(keys))


def test_babyai_world_end_to_end(ee_repo: Path):
    """The second environment (minigrid's BabyAI behind the text wrapper): the bot's demos,
    one-step branches over its six tools, every arm played on the same missions, its claims."""
    from stages.agents.trajectories import read_rollouts

    s = io.read_metrics(ee_repo / P / "details/babyai.json")
    assert s["demos"] == 12 and s["demo_success"] == 1.0
    assert s["expert/test/success"] == 1.0 and s["expert/ood/success"] == 1.0
    eps = pl.read_parquet(ee_repo / P / "data/babyai/episodes.parquet")
    assert set(eps.filter(pl.col("split") == "ood")["target"]) == {"key"}
    assert not set(eps.filter(pl.col("split") != "ood")["target"]) & {"key"}
    exp = pl.read_parquet(ee_repo / P / "data/babyai_experience.parquet")
    alts = exp.filter(pl.col("j") > 0)
    assert exp.filter(pl.col("j") == 0).height == s["demo_turns"]
    assert alts.height == 2 * s["demo_turns"]            # K = 2 of the 5 other tools
    assert (alts["call"] != alts["expert_call"]).all()
    assert alts["reflection"].str.contains(r"(ball|box)").all()
    episodes, _ = read_rollouts(ee_repo / P / "data/babyai_runs/rollouts")
    # the smoke profile sweeps il and iwm: half the demonstrations, and iwm at K = 1
    sweep = ["il@f0.5", "iwm@f0.5", "iwm@k1"]
    assert set(episodes["agent"]) == set(ARMS) | set(sweep)
    assert episodes.height == (len(ARMS) + 3) * 2 * (4 + 4)   # settings x seeds x splits
    t = io.read_metrics(ee_repo / P / "details/babyai_train.json")
    assert t["il@f0.5/demos"] == 6 and t["il/demos"] == 12
    assert t["iwm@k1/k"] == 1 and t["iwm@f0.5/k"] == 2
    # every setting trained for the same updates (equal budget)
    assert {t[f"{n}/s{s}/train_steps"] for n in ("il", "il@f0.5") for s in (0, 1)} == {4.0}
    assert not (ee_repo / P / "models/babyai_policies/sr@f0.5").exists()
    c = io.read_metrics(ee_repo / P / "details/compare.json")
    assert c["babyai_seeds"] == 2
    for name in ("iwm_vs_il", "sr_vs_il", "iwm_vs_il_ood", "il_vs_random", "iwm_f0.5_vs_il",
                 "iwm_vs_il_f0.5", "iwm_vs_iwm_k1"):
        assert c[f"claim/babyai_{name}/verdict"] in (-1.0, 0.0, 1.0)
    shop_claims = {k.split("/")[1] for k in c
                   if k.startswith("claim/") and not k.startswith("claim/babyai_")}
    assert shop_claims and not [n for n in shop_claims if re.search(r"_[fk][0-9]", n)]
    assert "claim/babyai_iwm_vs_il/paper_effect" not in c
    v = mlflow_client(ee_repo).get_model_version_by_alias("early-experience-babyai-policy",
                                                          "iwm")
    assert v.tags["arm"] == "iwm"
    block = (ee_repo / P / "README.md").read_text().split("<!-- results:start")[1]
    babyai_block = block.split("<!-- results:end")[0].split("### BabyAI")[1]
    assert "**Data efficiency**" in babyai_block and "**K alternatives" in babyai_block
    assert "IWM on 0.5 of the demonstrations > IL on all" in babyai_block


def test_bad_params_rejected_by_name_before_compute(ee_repo: Path):
    assert_bad_param_rejected(ee_repo / P, "early_experience", "train", "train.arms",
                              ["il", "iwn"], "iwn", untouched=ee_repo / P / "models/policies")


def test_second_repro_of_the_pipeline_does_nothing(ee_repo: Path):
    out = dvc(ee_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]
