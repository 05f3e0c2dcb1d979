"""The `proofverify` pipeline end to end at `smoke` through real `dvc repro` (after the shared
stages).

The smoke base model has seen 20 SFT steps: its verifiers reply mostly garbage, which is what
the parse-failure handling must survive (counted, never a crash)."""

from __future__ import annotations

import math

import json
from pathlib import Path

import polars as pl
import pytest

from stages.core import io, stats
from tests.conftest import dvc, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

P = Path("pipelines/proofverify")
N_TEST, N_P, SEEDS = 4, 6, 2      # the smoke profile


@pytest.fixture(scope="module")
def pv_repo(smoke_repo: Path) -> Path:
    proc = paperline(smoke_repo, "repro", "proofverify", timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return smoke_repo


def test_candidates_carry_exact_labels_and_flaw_classes(pv_repo: Path):
    test = pl.read_parquet(pv_repo / P / "data/candidates/test.parquet")
    assert test.height == N_TEST * N_P
    assert set(test["flaw"]) <= {"none", "a", "b"}
    assert (test["valid"] == (test["answer_correct"] & test["steps_valid"])).all()
    assert (test.filter(pl.col("flaw") == "b")["answer_correct"]).all()
    corrupted = test.filter(pl.col("source") == "corrupted")
    assert corrupted.height > 0 and (corrupted["flaw"] == "b").all()


def test_calls_are_counted_per_arm_as_the_paper_states(pv_repo: Path):
    judge = pl.read_parquet(pv_repo / P / "data/judge/selections.parquet")
    votes = pl.read_parquet(pv_repo / P / "data/judge/votes.parquet")
    assert votes.height == SEEDS * N_TEST * N_P * 2                    # n_j = 2 verdicts each
    assert (judge["calls"] == N_P * 2).all()
    gs = pl.read_parquet(pv_repo / P / "data/genselect/selections.parquet")
    games = pl.read_parquet(pv_repo / P / "data/genselect/games.parquet")
    assert gs.height == SEEDS * N_TEST and games.height == gs["games"].sum()
    hy = pl.read_parquet(pv_repo / P / "data/hybrid/selections.parquet")
    assert (hy["survivors"] == 2).all() and (hy["judgements"] == 2 * 2).all()
    # the lenient ablation replays the same knockout and only scores the survivors differently
    lenient = pl.read_parquet(pv_repo / P / "data/hybrid_lenient/selections.parquet")
    assert lenient.select("seed", "problem_id", "games", "judgements").sort("seed", "problem_id") \
        .equals(hy.select("seed", "problem_id", "games", "judgements").sort("seed", "problem_id"))
    cols = ["seed", "problem_id", "round", "first_id", "second_id", "winner_id"]
    assert pl.read_parquet(pv_repo / P / "data/hybrid_lenient/games.parquet").select(cols).equals(
        pl.read_parquet(pv_repo / P / "data/hybrid/games.parquet").select(cols))
    # empty candidates are knocked out before the first game; otherwise exactly N - w games
    assert (gs["games"] <= N_P - 1).all() and (hy["games"] <= N_P - 2).all()


def test_compare_metrics_readme_and_registry(pv_repo: Path):
    m = io.read_metrics(pv_repo / P / "details/compare.json")   # every number (NaN: null)
    for arm in ("judge", "genselect", "hybrid", "hybrid_lenient", "majority", "random"):
        assert 0.0 <= m[f"{arm}/proof_acc_mean"] <= m["oracle/proof_acc"] + 1e-9
        assert m[f"{arm}/answer_acc_mean"] >= m[f"{arm}/proof_acc_mean"]  # valid => right answer
        assert m[f"{arm}/parse_fail_rate_mean"] >= 0.0
    assert m["judge/calls_mean"] == N_P * 2 and m["majority/calls_mean"] == 0
    readme = (pv_repo / P / "README.md").read_text()
    block = readme.split("<!-- results:start")[1].split("<!-- results:end")[0]
    assert "| Hybrid |" in block and f"{m['hybrid/proof_acc_mean']:.3f}" in block
    # the paper's claims by the claim rule (no boolean claim_* keys), the rest as differences
    assert not any(k.startswith("claim_") for k in m)
    for rival, value in (("judge", "proof_acc"), ("genselect", "proof_acc"), ("judge", "calls")):
        c = stats.read_claim(m, f"claim/hybrid_vs_{rival}/{value}")
        # identical differences over fewer than 6 problems get no interval (stats.paired_ci)
        assert c is not None and c.n == N_TEST and (c.low <= c.diff <= c.high or math.isnan(c.low))
        assert c.sentence("{:+.1f}" if value == "calls" else "{:+.3f}") in block
    calls = stats.read_claim(m, "claim/hybrid_vs_judge/calls")
    assert calls.diff < 0                                     # 2 survivors x 2 + games < 6 x 2
    # the same saving on every problem: reproduced once the sign test can see it (6 problems)
    assert calls.name == ("reproduced" if N_TEST >= 6 else "inconclusive")
    for rule in ("hybrid_lenient", "majority", "random"):
        k = f"diff/hybrid_{rule}"
        low, mean, high = m[f"{k}_ci_low"], m[f"{k}_mean"], m[f"{k}_ci_high"]
        # NaN bounds: identical differences on too few problems for the sign test (stats)
        assert low <= mean <= high or (math.isnan(low) and math.isnan(high))
    assert f"random pick {m['diff/hybrid_random_mean']:+.3f}" in block

    # simulated-oracle mode (smoke: budgets 4, 16, 64 over pools of 16): no arm spends more
    # than its budget, GenSelect stops at n_p - 1 games, and the table reaches the README
    o = io.read_metrics(pv_repo / P / "details/oracle.json")
    for b in (4, 16, 64):
        for arm in ("judge", "genselect", "hybrid"):
            assert 0 < o[f"{arm}/B{b}/calls_mean"] <= b
            assert 0.0 <= o[f"{arm}/B{b}/proof_acc_mean"] <= o["pass_at_pool"] + 1e-9
    assert o["genselect/B64/calls_mean"] == 15 and o["judge/B64/calls_mean"] == 64
    assert "Simulated-oracle mode" in block and "| Hybrid | " in block.split("Simulated")[1]
    assert not any(k.startswith("claim_") for k in o)
    for b in (4, 16, 64):
        c = stats.read_claim(o, f"claim/hybrid_vs_judge/B{b}/proof_acc")
        assert c is not None and c.sentence() in block
    assert stats.read_claim(o, "claim/hybrid_B4_vs_judge_B64/proof_acc") is not None
    assert stats.read_claim(o, "claim/hybrid_vs_genselect/B64/proof_acc") is not None

    proc = paperline(pv_repo, "compare", "proofverify")
    assert proc.returncode == 0, proc.stderr[-2000:]
    client = mlflow_client(pv_repo)
    assert set(client.get_registered_model("proofverify-judge").aliases) >= {"champion"}
    assert "proofverify-judge" in (pv_repo / "reports/proofverify/compare.md").read_text()
    # the registered versions carry their scores: validation at registration, then each rule's
    # test scores from the stage that called the model
    judge = client.get_model_version_by_alias("proofverify-judge", "champion").tags
    selector = client.get_model_version_by_alias("proofverify-selector", "champion").tags
    assert {"metric.val_acc", "metric.judge/proof_acc", "metric.judge/calls_per_problem"} \
        <= set(judge), judge
    assert {"metric.val_acc", "metric.genselect/proof_acc", "metric.hybrid/proof_acc",
            "metric.hybrid_lenient/answer_acc"} <= set(selector), selector
    head = json.loads((pv_repo / P / "metrics/judge.json").read_text())
    assert float(judge["metric.judge/proof_acc"]) == pytest.approx(head["proof_acc"], abs=1e-5)


def test_rules_side_by_side_in_mlflow(pv_repo: Path):
    """A run per (rule, seed) under `compare` and per (rule, budget, seed) under `oracle`, each
    with the rule's params and the same metric names, so MLflow's Compare shows rules side by
    side (no method encoded in a metric name)."""
    client = mlflow_client(pv_repo)
    exp = client.get_experiment_by_name("proofverify")
    runs = client.search_runs([exp.experiment_id], max_results=2000)
    rules = [r for r in runs if r.data.tags.get("paperline.stage") == "compare"
             and r.data.tags.get("paperline.method")]
    assert {(r.data.params["method"], r.data.params["seed"]) for r in rules} == {
        (a, str(s)) for a in ("judge", "genselect", "hybrid", "hybrid_lenient", "majority",
                              "random") for s in range(SEEDS)}
    assert all(set(r.data.metrics) == {"proof_acc", "answer_acc", "calls", "parse_fail_rate"}
               for r in rules)
    hybrid = next(r for r in rules if r.data.params["method"] == "hybrid")
    assert hybrid.data.params["winner_count"] == "2" and "verifier" in hybrid.data.params
    assert "survivor_score" in hybrid.data.params
    oracle = [r for r in runs if r.data.tags.get("paperline.stage") == "oracle"
              and r.data.tags.get("paperline.method")]
    assert {r.data.tags["paperline.method"] for r in oracle} >= {"hybrid@B4", "judge@B64"}
    assert all(set(r.data.metrics) == {"proof_acc", "answer_acc", "calls"} for r in oracle)
    assert all({"method", "budget", "seed", "p_yes_valid"} <= set(r.data.params)
               for r in oracle)


def test_second_repro_of_the_pipeline_does_nothing(pv_repo: Path):
    out = dvc(pv_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]
