"""The `trace` pipeline end to end at `smoke` through real `dvc repro` (after the shared stages)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from stages.trace import trace
from stages.core import io
from tests.conftest import dvc, paperline
from tests.pipelines.test_base_pipeline import mlflow_client
from tests.pipelines.test_same_bytes_clones import assert_same_bytes

pytestmark = pytest.mark.slow

P = Path("pipelines/trace")
CONDITIONS = ["d10_s2", "d10_s4", "d90_s2", "d90_s4"]  # smoke: 2 mixes x 2 checkpoints


@pytest.fixture(scope="module")
def trace_repo(smoke_repo: Path) -> Path:
    proc = paperline(smoke_repo, "repro", "trace", timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return smoke_repo


def test_corpus_tagger_and_llm_labeler(trace_repo: Path):
    corpus = io.read_metrics(trace_repo / P / "details/corpus.json")
    assert corpus["n_sft_traces"] == 40 * 5
    assert corpus["correct_share/good"] > corpus["correct_share/unsupported"]
    lab = io.read_metrics(trace_repo / P / "details/label.json")
    assert 0.0 <= lab["macro_f1"] <= 1.0 and lab["n_test"] == 40
    # the LLM option ran on the tiny base model: its replies are counted, never raised
    assert lab["llm_rows"] == 8 and 0 <= lab["llm_malformed"] <= 8
    assert lab["llm_malformed_rate"] == pytest.approx(lab["llm_malformed"] / 8)
    tagger = trace.ClassifierTagger.load(trace_repo / P / "models/tagger")
    assert tagger.tag(["So 12+7=19."]) and len(tagger.tag(["a.", "b."])) == 2


def test_samples_carry_trace_recomputable_from_their_labels(trace_repo: Path):
    samples = pl.read_parquet(trace_repo / P / "data/scores/samples.parquet")
    assert sorted(samples["policy"].unique().to_list()) == CONDITIONS
    assert samples.height == len(CONDITIONS) * 8 * 2          # 8 prompts x 2 samples
    tables = trace.Tables.model_validate(json.loads(
        (trace_repo / P / "data/scores/tables.json").read_text()))
    for r in samples.head(12).iter_rows(named=True):
        again = trace.trace_score([frozenset(l) for l in r["labels"]], tables)
        assert r["trace"] == pytest.approx(again["trace"])
        assert r["n_sentences"] == len(r["labels"])
    cor = io.read_metrics(trace_repo / P / "details/correlate.json")
    assert cor["conditions"] == len(CONDITIONS)
    assert "pearson/trace" in cor and "point_biserial/length" in cor


def test_rl_arms_compare_readme_and_registry(trace_repo: Path):
    for arm, weight in (("rl_acc", 0.0), ("rl_trace", 0.5)):
        m = io.read_metrics(trace_repo / P / f"details/{arm}.json")
        assert m["seeds"] == 2 and m["trace_weight"] == weight          # smoke: 2 seeds
        assert 0.0 <= m["final_acc_mean"] <= 1.0 and m["final_acc_std"] >= 0.0
        assert 0.0 <= m["final_trace_mean"] <= 1.0
        finals = pl.read_parquet(trace_repo / P / "runs" / arm / "finals.parquet")
        assert finals["seed"].to_list() == [0, 1]
    proc = paperline(trace_repo, "report")
    assert proc.returncode == 0, proc.stderr[-2000:]
    readme = (trace_repo / P / "README.md").read_text()
    block = readme.split("<!-- results:start")[1].split("<!-- results:end")[0]
    lab = io.read_metrics(trace_repo / P / "details/label.json")
    assert f"| {lab['macro_f1']:.3f} |" in block and "| rl_trace | 0.5 |" in block
    cm = io.read_metrics(trace_repo / P / "details/compare.json")
    for name in ("trace_correlates", "trace_beats_neg_ppl", "trace_beats_length",
                 "ppl_beats_length", "trace_reward_beats_acc"):
        assert cm[f"claim/{name}/verdict"] in (-1.0, 0.0, 1.0)
    assert cm["claim/trace_reward_beats_acc/pairs"] == 2          # smoke: 2 seeds
    assert cm["claim/trace_beats_length/pairs"] == len(CONDITIONS)
    assert not any(k.startswith("claim_") for k in cm)
    assert "TRACE correlates with accuracy across generators (Pearson r): **" in block
    proc = paperline(trace_repo, "compare", "trace")
    assert proc.returncode == 0, proc.stderr[-2000:]
    client = mlflow_client(trace_repo)
    assert client.get_model_version_by_alias("trace-tagger", "champion") is not None
    assert set(client.get_registered_model("trace-policy").aliases) == {"rl-acc", "rl-trace"}
    out = dvc(trace_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]


def test_a_second_clone_gives_the_same_bytes(trace_repo: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch):
    """The chain up to the first trained policies again in a fresh clone (base shared), another
    PYTHONHASHSEED: same outputs. The generated corpus and the tagger hold the hash-seed-prone
    parts (sets of labels, sklearn's vocabulary, a pickle), `policy` torch training from a
    second process; the later stages repeat these (sampling: base's `evaluate` in
    test_same_bytes_clones.py; GRPO across processes: tests/unit/test_grpo.py)."""
    assert_same_bytes(trace_repo, "trace", str(P / "dvc.yaml"), tmp_path / "repo", monkeypatch,
                      only=["corpus", "label", "policy"])
