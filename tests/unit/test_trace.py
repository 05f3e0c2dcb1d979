"""TRACE: the score on hand-labelled sentences (hand-computed values), the splitter, the LLM
labeler's malformed replies, the Toulmin task family and the correlation helpers."""

from __future__ import annotations

import math

import polars as pl
import pytest
from pydantic import ValidationError

from stages.core import stats
from stages.core.stats import pearson, ranks, spearman
from stages.tasks import arith, toulmin
from stages.trace import trace
from stages.trace.compare import Config as CompareConfig
from stages.trace.compare import claims, correlation_claims, results_table
from stages.trace.correlate import best_of_n, bootstrap, bootstrap_diff_ci

T = trace.Tables()  # the spec's default tables, alpha = 0.7


def L(*sets: str) -> list[frozenset[str]]:
    return [frozenset(s) for s in sets]


def test_well_argued_step_scores_by_hand():
    # "Given 12 and 7." {D} "Adding joins both." {W} "So 12+7=19." {C} "Let me check." {M}
    # "19-7=12, right." {E}
    # V = (1 + 1 + 1 + 0.5 [{M} vs {M,E}] + 1) / 5 = 0.9
    # C = (D>W 1 + W>C 1 + C>M 0.5 + M>E 1) / 4 = 0.875
    s = trace.trace_score(L("D", "W", "C", "M", "E"), T)
    assert s["v_state"] == pytest.approx(0.9)
    assert s["c_trans"] == pytest.approx(0.875)
    assert s["trace"] == pytest.approx(0.7 * 0.9 + 0.3 * 0.875)      # 0.8925


def test_hedge_loop_scores_low_by_hand():
    # "Maybe." {Q} "Perhaps." {Q} "Maybe 12+7=19." {Q,C}
    # V: {Q} best J 0.5 ({Q,C}), capped 0.5; {Q,C} J 1 capped 0.5 -> V = 0.5
    # C: Q>Q 0; {Q}->{Q,C}: (Q>Q 0 + Q>C 0.5) / 2 = 0.25 -> C = 0.125
    s = trace.trace_score(L("Q", "Q", "QC"), T)
    assert s["v_state"] == pytest.approx(0.5)
    assert s["c_trans"] == pytest.approx(0.125)
    assert s["trace"] == pytest.approx(0.3875)


def test_compound_monitor_chain_and_empty_sets_by_hand():
    # {D,W,C} (the spec's Pythagoras example) is allowed: J = 1; M alone 0.5; E 1
    # V = (1 + .5 + .5 + 1) / 4 = .75; C = ((.5+.5+.5)/3 + M>M 0 + M>E 1) / 3 = .5
    s = trace.trace_score(L("DWC", "M", "M", "E"), T)
    assert (s["v_state"], s["c_trans"]) == pytest.approx((0.75, 0.5))
    assert s["trace"] == pytest.approx(0.675)
    # an empty label set: J = 0, and both of its pairs weigh 0.5
    s = trace.trace_score(L("C", "", "D"), T)
    assert (s["v_state"], s["c_trans"]) == pytest.approx((2 / 3, 0.5))
    assert s["trace"] == pytest.approx(0.7 * 2 / 3 + 0.15)


def test_state_validity_edges():
    assert trace.state_validity("BWC", T) == pytest.approx(2 / 3)     # vs {W,C} or {B,W}
    assert trace.state_validity("QC", T) == 0.5                        # a hedged claim
    assert trace.state_validity("", T) == 0.0
    assert trace.trace_score(L("C"), T) == pytest.approx(
        {"v_state": 1.0, "c_trans": 0.5, "trace": 0.85})               # one sentence
    assert trace.trace_score([], T)["trace"] == 0.0


def test_tables_are_validated():
    with pytest.raises(ValidationError, match="transition 'X>C'"):
        trace.Tables(good=["X>C"])
    with pytest.raises(ValidationError, match="both good and bad"):
        trace.Tables(good=["M>M"])
    with pytest.raises(ValidationError, match="allowed state"):
        trace.Tables(allowed=["CZ"])
    assert trace.Tables(alpha=1.0, allowed=["C"]).weight("Q", "Q") == 0.0


def test_splitter_keeps_decimals_and_matches_generated_traces():
    assert trace.split_sentences("Given 3.5 and 2. So 3.5+2=5.5. Let me check.") == [
        "Given 3.5 and 2.", "So 3.5+2=5.5.", "Let me check."]
    cfg = toulmin.Config(policy_variants=5)
    rows = arith.generate(cfg.arith, 40, 0)
    for t in toulmin.traces(cfg, rows, 0):
        assert trace.split_sentences(trace.cot_block(t["target"])) == t["sentences"]
        assert len(t["labels"]) == len(t["sentences"])
        assert toulmin.verify_answer(t, t["target"]) == t["correct"]


def test_llm_replies_parse_or_count_as_malformed():
    assert trace.parse_llm_labels("C, D") == frozenset("CD")
    assert trace.parse_llm_labels("Warrant Claim.\nmore text") == frozenset("WC")
    assert trace.parse_llm_labels(" none") == frozenset()
    for bad in ("", "12+7=19", "C, X", "Labels: ??"):
        assert trace.parse_llm_labels(bad) is None

    class Replies:  # a stand-in server: fixed replies, one per prompt
        def complete(self, prompts, **_):
            from stages.models.backend import Completion
            texts = ["C", "garbage 1+1", "", "Monitoring, Evaluation"]
            return [[Completion(texts[i % 4], 1)] for i in range(len(prompts))]

    tagger = trace.LLMTagger(Replies())
    got = tagger.tag(["a.", "b.", "c.", "d."])
    assert got == [frozenset("C"), frozenset(), frozenset(), frozenset("ME")]
    assert tagger.malformed == 2 and tagger.calls == 4


def test_toulmin_traces_are_deterministic_and_structured():
    cfg = toulmin.Config()
    rows = arith.generate(cfg.arith, 30, 1)
    a, b = toulmin.traces(cfg, rows, 1), toulmin.traces(cfg, rows, 1)
    assert a == b and len(a) == 5 * len(rows)
    for t in a:
        assert len(t["prompt"]) + len(t["target"]) <= cfg.max_chars
        if t["kind"] == "unsupported":
            assert set(t["labels"]) == {"C"}
        if t["kind"] == "hedge_loop":
            assert all("Q" in l for l in t["labels"])
    good = [t for t in a if t["kind"] == "good"]
    assert sum(t["correct"] for t in good) / len(good) > 0.8
    # gold labels of a fixed sentence
    s = arith.Step(12, "+", 7, 19)
    import random
    assert toulmin.sentence(random.Random(0), "DWC", s, 19, 1) == ("Since 12+7 is a sum, 19.",
                                                                  "CDW")
    assert toulmin.sentence(random.Random(0), "WC", arith.Step(9, "-", 4, 5), 5, 1) == (
        "Sub: 9-4=5.", "CW")


def test_correlation_helpers_by_hand():
    # x = 1,2,3; y = 2,4,7: sxy = 5, sxx = 2, syy = 114/9 -> r = 5 / sqrt(2 * 114 / 9)
    assert pearson([1, 2, 3], [2, 4, 7]) == pytest.approx(5 / math.sqrt(228 / 9))
    assert math.isnan(pearson([1, 1], [2, 3]))
    assert ranks([1, 1, 2]) == [1.5, 1.5, 3.0]
    assert spearman([1, 2, 3], [10, 20, 15]) == pytest.approx(0.5)
    samples = pl.DataFrame({
        "condition": ["a"] * 4, "id": ["p", "p", "q", "q"], "sample": [0, 1, 0, 1],
        "trace": [0.9, 0.1, 0.2, 0.8], "length": [10, 50, 60, 5],
        "correct": [True, False, False, True]})
    bon = best_of_n(samples)
    assert bon["bon_trace"] == 1.0 and bon["bon_length"] == 0.0 and bon["bon_oracle"] == 1.0
    assert bon["bon_random"] == 0.5  # the expectation: half of each prompt's samples are right


def test_paired_bootstrap_of_the_r_difference():
    y = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    # x tracks y exactly, z is y with two points swapped: on every draw r(x) >= r(z), and the
    # draws that keep both swapped points make it strictly higher, so the CI is >= 0 throughout
    x, z = y, [0.1, 0.2, 0.4, 0.3, 0.5, 0.6]
    low, high, sd = bootstrap_diff_ci(x, z, y, 500, seed=0)
    assert 0 <= low <= high and high > 0 and sd > 0
    # a score against itself: every draw's difference is exactly 0
    assert bootstrap_diff_ci(x, x, y, 100) == (0.0, 0.0, 0.0)
    # the difference is antisymmetric: the CI of z against x is the mirror image
    low2, high2, sd2 = bootstrap_diff_ci(z, x, y, 500, seed=0)
    assert (low2, high2, sd2) == pytest.approx((-high, -low, sd))


def test_bootstrap_is_stats_percentile_ci_plus_the_spread_of_its_draws():
    # the CI is exactly stats.percentile_ci's (same seed, same draws); the sd is over the finite
    # draws: a statistic that is NaN on half the indices leaves those out of both
    def stat(p: list[int]) -> float:
        return math.nan if p[0] % 2 else float(sum(p))
    got = bootstrap(5, stat, 200, seed=3)
    assert (got.low, got.high) == stats.percentile_ci(5, stat, 200, seed=3)
    import random
    rng, seen = random.Random(3), []
    for _ in range(200):
        v = stat([rng.randrange(5) for _ in range(5)])
        if math.isfinite(v):
            seen.append(v)
    assert got.sd == pytest.approx(stats.mean_std(seen)[1])


def _cor(**over: float) -> dict[str, float]:
    cor = {"conditions": 8.0, "pearson/trace": 0.9, "ci_low/trace": 0.6, "ci_high/trace": 0.99,
           "boot_sd/trace": 0.1, "pearson/neg_ppl": 0.8, "pearson/length": 0.1,
           "diff_ci_low/neg_ppl": -0.05, "diff_ci_high/neg_ppl": 0.3,
           "diff_boot_sd/neg_ppl": 0.1, "diff_ci_low/length": 0.3, "diff_ci_high/length": 1.5,
           "diff_boot_sd/length": 0.3}
    return cor | over


def test_trace_claims_need_the_paired_ci_above_zero_for_each_baseline():
    cfg = CompareConfig(paper_r_trace=0.74, paper_r_neg_ppl=0.3, paper_r_length=0.1)
    c = correlation_claims(_cor(), cfg)
    # higher point estimate than both baselines, but the perplexity difference CI [-0.05, 0.3]
    # crosses 0 (inconclusive), and it excludes the paper's 0.74 - 0.3 = 0.44 (said beside it)
    assert c["claim/trace_beats_length/verdict"] == 1.0
    assert c["claim/trace_beats_length/diff"] == pytest.approx(0.8)
    assert c["claim/trace_beats_length/paper_effect"] == pytest.approx(0.64)
    assert c["claim/trace_beats_neg_ppl/verdict"] == 0.0
    assert c["claim/trace_beats_neg_ppl/paper_effect"] == pytest.approx(0.44)
    from stages.core.stats import read_claim
    assert read_claim(c, "claim/trace_beats_neg_ppl").excludes_paper_effect
    # the MDE from the bootstrap spread: 2.8 sd; pairs = conditions
    assert c["claim/trace_beats_neg_ppl/mde"] == pytest.approx(0.28)
    assert c["claim/trace_beats_neg_ppl/pairs"] == 8
    # a CI that holds 0 and the paper's effect: inconclusive, not beside the paper's effect
    c = correlation_claims(_cor(**{"diff_ci_high/neg_ppl": 0.5}), cfg)
    assert c["claim/trace_beats_neg_ppl/verdict"] == 0.0
    assert not read_claim(c, "claim/trace_beats_neg_ppl").excludes_paper_effect
    assert c["claim/trace_correlates/verdict"] == 1.0          # r's own CI [0.6, 0.99] > 0
    assert c["claim/trace_correlates/paper_effect"] == 0.74
    # r's own CI touching 0: not reproduced; no bootstrap (no CI) cannot pass a claim
    c = correlation_claims(_cor(**{"ci_low/trace": 0.0}), cfg)
    assert c["claim/trace_correlates/verdict"] == 0.0
    c = correlation_claims({"pearson/trace": 0.9, "conditions": 8.0}, cfg)
    assert c["claim/trace_correlates/verdict"] == 0.0
    assert c["claim/trace_beats_length/verdict"] == 0.0
    assert not any(k.startswith("claim_") for k in c)           # the old booleans are gone


def test_rl_claim_pairs_the_arms_by_seed_and_the_table_prints_every_claim():
    # final accuracy per seed: rl_trace - rl_acc = 0.05, 0.07, 0.06: mean 0.06, sd 0.01,
    # t_{0.975, 2} = 4.303: 0.06 +- 0.0248 = [0.035, 0.085] above 0: reproduced
    cfg = CompareConfig(paper_rl_gain=0.052)
    acc = {"rl_acc": {0: 0.50, 1: 0.52, 2: 0.48}, "rl_trace": {0: 0.55, 1: 0.59, 2: 0.54}}
    c = claims({"correlate": _cor()}, acc, cfg)
    assert c["claim/trace_reward_beats_acc/diff"] == pytest.approx(0.06)
    assert c["claim/trace_reward_beats_acc/ci_low"] == pytest.approx(
        0.06 - 4.302653 * 0.01 / math.sqrt(3), abs=1e-5)
    assert c["claim/trace_reward_beats_acc/verdict"] == 1.0
    assert c["claim/trace_reward_beats_acc/pairs"] == 3
    with pytest.raises(ValueError, match="same keys"):
        claims({"correlate": _cor()}, {"rl_acc": {0: 0.5}, "rl_trace": {1: 0.6}}, cfg)
    table = results_table({"label": {"macro_f1": 0.8}, "correlate": _cor(), "compare": c})
    assert ("the accuracy + TRACE reward ends more accurate than the accuracy-only reward "
            "(final accuracy, paired by seed): **reproduced**: +0.060 [+0.035, +0.085] over 3 "
            "pairs") in table
    assert "TRACE tracks accuracy better than length (r(TRACE) - r(length)): **reproduced**" \
        in table
