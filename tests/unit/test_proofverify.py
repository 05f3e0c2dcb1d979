"""ProofVerify's pure parts on hand-made inputs: output contracts, judge scores, the knockout
tournament (bracket sizes, byes, reshuffles, parse failures), baselines, metrics, candidates."""

from __future__ import annotations

import math
import random

import polars as pl
import pytest
from pydantic import ValidationError

from stages.core import stats
from stages.proofverify import compare as cmp
from stages.proofverify import proofverify as pv
from stages.proofverify import candidates as cand
from stages.proofverify import oracle
from stages.proofverify import select as sel
from stages.proofverify import train_judge as train

# --- output contracts -------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [
    (" Yes", True), ("No", False), (" No\n", False),
    ("<summary>step 2 is wrong</summary>\n<judgement>Judgement: No</judgement>", False),
    ("quoting <judgement>Judgement: No</judgement> ... <judgement>Judgement: Yes</judgement>",
     True),                                              # the last tagged verdict wins
    (" Yess", None), ("yes", None), (" Yes No", None), ("", None), ("Judgement: Yes", None),
    (" 1+2=3 =; #### 3 = Verdict: Yes", True), (" 1+2=3 !; #### 4 ! Verdict: No", False),
    (" 1+2=3 =; #### 3 = Verdict: Yes!", None), (" 1+2=3 =; #### 3 = Verdict:", None),
])
def test_parse_judgement(text, want):
    assert pv.parse_judgement(text) is want


@pytest.mark.parametrize("text, want", [
    (" 1", 0), ("2", 1), ("<best_solution>2</best_solution>", 1),
    ("<best_solution>3</best_solution>", None), (" 0", None), (" 12", None), ("one", None),
    ("", None), (" 1 2", None), (" [1] 1+2=3 = [2] 1+2=4 ! Best: 1", 0),
    (" [1] 1+2=3 = [2] 1+2=4 ! Best: 3", None), (" [1] 1+2=3 = [2] 1+2=4 !", None),
])
def test_parse_choice(text, want):
    assert pv.parse_choice(text, 2) == want


def test_prompts_end_where_the_tiny_models_answer():
    assert pv.judge_prompt("Q: 1+2=? A:", " 1+2=3 #### 3") == "Q: 1+2=? A: 1+2=3 #### 3 Verdict:"
    assert pv.genselect_prompt("Q: 1+2=? A:", " a", " b") == "Q: 1+2=? A: [1] a [2] b Best:"
    opc = pv.genselect_prompt("P", "first", "second", "opc")
    assert opc.endswith("[Proof 1]\nfirst\n\n[Proof 2]\nsecond") and "<best_solution>" in opc
    assert "<judgement>Judgement: Yes</judgement>" in pv.judge_prompt("P", "S", "opc")


@pytest.mark.parametrize("solution, trace", [
    (" 20+5=25; 25-3=22 #### 22", "20+5=25 =; 25-3=22 =; #### 22 ="),        # valid
    (" 20+5=26; 26-3=22 #### 22", "20+5=25 !; 26-3=23 !; #### 22 !"),        # flaw b
    (" 20+5=25; 25-3=21 #### 21", "20+5=25 =; 25-3=22 !; #### 21 !"),        # flaw a
    (" 20+5=25; 24-3=21 #### 21", "20+5=25 =; 24-3=21 !; #### 21 !"),        # broken chain
    (" 20-5=15; 15-3=12 #### 12", "20-5=15 !; 15-3=12 =; #### 12 !"),        # wrong operator
    (" 20+5=25 #### 25", "20+5=25 =; #### 25 !"),                            # a missing step
    (" 20+5=25; 25-3=22 #### 23", "20+5=25 =; 25-3=22 =; #### 23 !"),        # answer != result
    ("abc", "?; #### ? !"),
])
def test_check_trace_marks_every_step_and_the_answer(solution, trace):
    assert pv.check_trace("20+5-3", solution) == trace
    row = {"question": "20+5-3", "answer": 22, "n_operands": 3}
    assert (" !" not in trace and "?" not in trace) == cand.label(row, solution)["valid"]


# --- judge scores and selection ---------------------------------------------------------------

def test_judge_score_is_yes_share_of_parseable_and_minus_one_when_none_parse():
    assert pv.judge_score([True, None, False, True]) == pytest.approx(2 / 3)
    assert pv.judge_score([True, True]) == 1.0
    assert pv.judge_score([None, None]) == -1.0
    assert pv.judge_score([]) == -1.0
    assert pv.judge_score([False, None]) == 0.0          # one parseable No beats no parse at all


def test_hybrid_scores_survivors_over_all_judgements_not_the_parseable_ones():
    # spec §2: Hybrid = argmax over the survivors of mean_{j=1..n_j} 1[judge_j(p) = Yes]; an
    # unparseable reply counts as not Yes. A: 1 Yes + 3 unparseable -> 1/4; B: 3 Yes + 1 No -> 3/4.
    a, b = [True, None, None, None], [True, True, True, False]
    assert pv.hybrid_score(a) == 0.25 and pv.hybrid_score(b) == 0.75
    assert pv.hybrid_score([None, None]) == 0.0 and pv.hybrid_score([]) == -1.0
    # the lenient ablation (#Yes / #parseable, the pure judge's s(p), which the spec keeps for
    # the pure judge): A scores 1/1 = 1.0 and beats B's 0.75
    assert pv.judge_score(a) == 1.0 and pv.judge_score(b) == 0.75
    assert pv.survivor_score("all") is pv.hybrid_score
    assert pv.survivor_score("parseable") is pv.judge_score
    with pytest.raises(ValueError, match="survivor score 'mean'"):
        pv.survivor_score("mean")
    # through the stage's scoring of cached votes and the survivors' argmax: B by the paper's
    # rule, A by the lenient one, whatever the tie shuffle
    votes = pl.DataFrame({"candidate_id": ["A"] * 4 + ["B"] * 4, "vote": [0, 1, 2, 3] * 2,
                          "verdict": a + b},
                         schema={"candidate_id": pl.String, "vote": pl.Int64,
                                 "verdict": pl.Boolean})
    for rule, winner in (("all", "B"), ("parseable", "A")):
        scores = sel.scores_from_votes(votes, 4, pv.survivor_score(rule))
        ids = ["A", "B"]
        picks = {ids[pv.select_by_score([0, 1], [scores[c] for c in ids], random.Random(s))]
                 for s in range(10)}
        assert picks == {winner}, rule


def test_argmax_takes_the_first_maximum_and_selection_shuffles_ties():
    assert pv.argmax_first([0.5, 0.75, 0.75, -1.0]) == 1
    with pytest.raises(ValueError):
        pv.argmax_first([])
    scores = [0.5, 0.75, 0.75, -1.0]
    picks = {pv.select_by_score(range(4), scores, random.Random(s)) for s in range(40)}
    assert picks == {1, 2}                                # only maxima, both tied ones
    assert pv.select_by_score([0, 3], scores, random.Random(0)) == 0   # restricted to a subset


def test_scores_from_votes_use_the_first_n_j_votes():
    votes = pl.DataFrame({"candidate_id": ["a"] * 4 + ["b"] * 4, "vote": [0, 1, 2, 3] * 2,
                          "verdict": [True, None, False, False, None, None, True, True]},
                         schema={"candidate_id": pl.String, "vote": pl.Int64,
                                 "verdict": pl.Boolean})
    assert sel.scores_from_votes(votes, 2) == {"a": 1.0, "b": -1.0}
    assert sel.scores_from_votes(votes, 4) == {"a": pytest.approx(1 / 3), "b": 1.0}


# --- knockout ---------------------------------------------------------------------------------

def better_wins(pairs_or_games, key=lambda g: g):
    """The lower candidate index is the better one (a transitive 'oracle' selector)."""
    return [0 if a < b else 1 for a, b in (key(g) for g in pairs_or_games)]


def drive(ko: pv.Knockout, play=better_wins) -> list[list[tuple[int, int]]]:
    rounds = []
    while not ko.done:
        pairs = ko.next_pairs()
        rounds.append(pairs)
        ko.record(play(pairs))
    return rounds


@pytest.mark.parametrize("n, w, games, rounds, byes", [
    (8, 1, 7, 3, 0),       # 4 + 2 + 1 games
    (5, 1, 4, 3, 2),       # 2 games + bye, 1 game + bye, 1 game
    (6, 4, 2, 1, 2),       # the last round plays only the 2 games still needed
    (16, 4, 12, 2, 0),     # hybrid at n_p = 16, n_s = 4: 8 + 4
    (256, 16, 240, 4, 0),  # the paper's hybrid: 240 games [spec table]
    (256, 1, 255, 8, 0),   # the paper's pure GenSelect: 255 games
    (3, 3, 0, 0, 0),       # nothing to knock out
])
def test_bracket_sizes_and_byes(n, w, games, rounds, byes):
    ko = pv.Knockout(n, w, random.Random(0))
    played = drive(ko)
    assert ko.calls == games == pv.knockout_cost(n, w) == sum(len(r) for r in played)
    assert ko.rounds == rounds and ko.byes == byes
    assert len(ko.winners) == min(w, n)
    assert 0 in ko.winners                                # the best survives a perfect selector
    # (the w best need not all survive: two of them may meet in a round)
    assert ko.parse_failures == 0


def test_every_round_is_reshuffled():
    seen = set()
    for seed in range(20):
        ko = pv.Knockout(8, 1, random.Random(seed))
        played = drive(ko)
        assert ko.winners == [0]                          # a perfect selector always wins
        assert all(a not in ko.knocked[:i] for i, (a, _) in enumerate(played[1]))
        seen.add(tuple(sorted(tuple(sorted(p)) for p in played[1])))
    assert len(seen) > 1                                  # round 2 pairings differ by seed


def test_invalid_candidates_are_knocked_out_before_the_first_game():
    ko = pv.Knockout(5, 1, random.Random(0), invalid=[0, 3])
    played = drive(ko)
    assert ko.calls == 2 == pv.knockout_cost(5, 1, invalid=2)
    assert {c for r in played for p in r for c in p} == {1, 2, 4}
    assert ko.winners == [1]
    # more invalid candidates than N - w: the last ones are revived, no game is played
    ko = pv.Knockout(3, 1, random.Random(0), invalid=[0, 1, 2])
    assert ko.done and ko.next_pairs() == [] and ko.winners == [2]
    with pytest.raises(ValueError, match="outside"):
        pv.Knockout(3, 1, random.Random(0), invalid=[5])


def test_parse_failures_pick_a_random_winner_and_are_counted():
    winners = []
    for seed in range(60):
        ko = pv.Knockout(4, 1, random.Random(seed))
        drive(ko, play=lambda pairs: [None] * len(pairs))
        assert ko.calls == 3 and ko.parse_failures == 3
        assert len(ko.winners) == 1
        winners.append(ko.winners[0])
    assert set(winners) == {0, 1, 2, 3}                   # a coin flip per game, not position 1
    again = pv.Knockout(4, 1, random.Random(7))
    drive(again, play=lambda pairs: [None] * len(pairs))
    first = pv.Knockout(4, 1, random.Random(7))
    drive(first, play=lambda pairs: [None] * len(pairs))
    assert again.history == first.history                 # reproducible per seed


def test_knockout_misuse_is_an_error():
    ko = pv.Knockout(4, 1, random.Random(0))
    with pytest.raises(RuntimeError, match="next_pairs"):
        ko.record([0])
    pairs = ko.next_pairs()
    with pytest.raises(RuntimeError, match="record"):
        ko.next_pairs()
    with pytest.raises(ValueError, match="results for"):
        ko.record([0] * (len(pairs) + 1))
    with pytest.raises(ValueError, match="expected 0, 1 or None"):
        ko.record([2] * len(pairs))
    with pytest.raises(ValueError):
        pv.Knockout(0, 1, random.Random(0))


def test_play_knockouts_batches_every_tournament_per_round():
    tours = [pv.Knockout(n, w, random.Random(n)) for n, w in ((8, 1), (5, 1), (16, 4), (2, 2))]
    batches = []

    def play(games):
        batches.append(len(games))
        return better_wins(games, key=lambda g: (g[1], g[2]))

    rounds = pv.play_knockouts(tours, play)
    assert rounds == 3 and sum(batches) == 7 + 4 + 12 + 0
    assert batches[0] == 4 + 2 + 8                        # round 1 of the first three at once
    assert [t.winners[0] for t in tours] == [0, 0, 0, 0]
    assert [len(t.winners) for t in tours] == [1, 1, 4, 2]


# --- baselines and metrics (hand-computed) ------------------------------------------------------

def test_majority_vote_picks_a_holder_of_the_most_common_answer():
    answers = [5, 7, 5, None, 7, 5]
    picks = {pv.majority_vote(answers, random.Random(s)) for s in range(30)}
    assert picks == {0, 2, 5}
    assert pv.majority_vote([None, None], random.Random(0)) in (0, 1)
    assert pv.majority_vote([None, 3, None], random.Random(0)) == 1
    tie = {answers_pick for answers_pick in (pv.majority_vote([1, 2], random.Random(s))
                                             for s in range(30))}
    assert tie == {0, 1}


def test_precision_recall_f1_hand_values():
    m = pv.precision_recall_f1([True, True, False, False, True], [True, False, True, False, True])
    # tp = 2, fp = 1, fn = 1, tn = 1
    assert m["precision"] == pytest.approx(2 / 3) and m["recall"] == pytest.approx(2 / 3)
    assert m["f1"] == pytest.approx(2 / 3) and m["accuracy"] == pytest.approx(3 / 5)
    none = pv.precision_recall_f1([False, False], [True, False])
    assert math.isnan(none["precision"]) and none["recall"] == 0.0 and none["f1"] == 0.0


def test_final_answer_precision_and_balanced_set():
    assert pv.final_answer_precision([True, True, False, True], [True, False, True, True]) == \
        pytest.approx(2 / 3)
    assert math.isnan(pv.final_answer_precision([False], [True]))
    pids = ["p"] * 7 + ["q"] * 4
    right = [True, False, True, False, True, False, True] + [True, True, False, False]
    # p: right at 0,2,4,6 and wrong at 1,3,5 -> first three of each; q has only 2 + 2
    assert pv.balanced_indices(pids, right, 3) == [0, 1, 2, 3, 4, 5]
    assert pv.balanced_indices(pids, right, 2) == [0, 1, 2, 3, 7, 8, 9, 10]


def test_the_shared_paired_bootstrap_gives_the_former_numbers_by_hand():
    # the compare's paired CI is stats.paired_ci(method="bootstrap", draws, seed 0): every
    # problem the same gap collapses the CI on it, which the sign test accepts from 6 pairs on
    assert stats.paired_ci([1.0, 0.5] * 3, [0.5, 0.0] * 3, method="bootstrap") == (0.5, 0.5, 0.5)
    mean, low, high = stats.paired_ci([1.0, 0.5, 1.0], [0.5, 0.0, 0.5], method="bootstrap")
    assert mean == 0.5 and math.isnan(low) and math.isnan(high)
    # diffs [1, 0]: resampled means are 0 (P = 1/4), 0.5 (1/2) or 1 (1/4), so the 2.5% and
    # 97.5% percentiles are 0 and 1: a +0.5 mean whose CI touches 0 is not a win
    assert stats.paired_ci([1.0, 0.0], [0.0, 0.0], method="bootstrap") == (0.5, 0.0, 1.0)


def _selections():
    # hybrid picks the valid candidate on both problems and both seeds (acc 1, 1) at 5 calls;
    # judge picks it on p in seed 0 only (p: 0.5, q: 0) at 8 calls -> diffs [0.5, 1.0], mean
    # 0.75, every resample >= 0.5; genselect ties hybrid on both problems
    rows = []
    for seed in (0, 1):
        rows += [("hybrid", seed, "p", "p-0", 5), ("hybrid", seed, "q", "q-2", 5),
                 ("judge", seed, "p", "p-0" if seed == 0 else "p-1", 8),
                 ("judge", seed, "q", "q-0", 8)]
    for m in ("genselect", "hybrid_lenient", "majority", "random"):
        rows += [(m, 0, "p", "p-0", 1), (m, 0, "q", "q-2" if m != "random" else "q-1", 1)]
    return pl.DataFrame(rows, schema=["method", "seed", "problem_id", "selected_id", "calls"],
                        orient="row")


def test_hybrid_claims_pair_problems_and_average_seeds():
    m = cmp.hybrid_claims(_selections(), _cands(), cmp.Config(bootstrap=500))
    j = stats.read_claim(m, "claim/hybrid_vs_judge/proof_acc")
    assert (j.diff, j.low, j.high, j.n) == (pytest.approx(0.75), 0.5, 1.0, 2)
    assert j.name == "reproduced" and j.paper_effect is None        # CI above 0
    g = stats.read_claim(m, "claim/hybrid_vs_genselect/proof_acc")
    assert (g.diff, g.name) == (0.0, "inconclusive") and math.isnan(g.low)  # [0, 0]: no CI
    # calls: 5 - 8 on both problems, the paper says fewer (direction -1); two identical
    # differences fail the sign test (2 * 0.5^2 > 0.05): no interval, inconclusive
    c = stats.read_claim(m, "claim/hybrid_vs_judge/calls")
    assert (c.diff, c.name) == (-3.0, "inconclusive") and math.isnan(c.high)
    # a paper effect set in params is carried into the metrics and back (README sentence)
    cfg = cmp.Config(bootstrap=500, paper_hybrid_vs_judge=0.6)
    m = cmp.hybrid_claims(_selections(), _cands(), cfg)
    assert m["claim/hybrid_vs_judge/proof_acc/paper_effect"] == 0.6
    assert "paper: +0.600" in stats.read_claim(m, "claim/hybrid_vs_judge/proof_acc").sentence()
    # the rules the paper makes no claim about: difference and CI, no verdict
    d = cmp.paired_vs_hybrid(_selections(), _cands(), draws=500)
    assert set(d) == {f"diff/hybrid_{r}_{k}" for r in ("hybrid_lenient", "majority", "random")
                      for k in ("mean", "ci_low", "ci_high")}
    assert d["diff/hybrid_random_mean"] == pytest.approx(0.5)       # q-1 is invalid
    assert d["diff/hybrid_hybrid_lenient_mean"] == 0.0


def test_compare_refuses_arms_on_different_problems():
    def sel(*pairs):
        return pl.DataFrame(list(pairs), schema=["seed", "problem_id"], orient="row")

    same = {"judge": sel((0, "p"), (0, "q")), "genselect": sel((0, "q"), (0, "p"))}
    cmp.check_same_cover(same)
    with pytest.raises(ValueError, match=r"hybrid/selections.parquet covers 1 .* judge's 2, 1 "
                                         r"not in both"):
        cmp.check_same_cover({**same, "hybrid": sel((0, "p"))})


def _cands() -> pl.DataFrame:
    return pl.DataFrame({
        "candidate_id": ["p-0", "p-1", "p-2", "q-0", "q-1", "q-2"],
        "problem_id": ["p", "p", "p", "q", "q", "q"],
        "valid": [True, False, False, False, False, True],
        "answer_correct": [True, True, False, True, False, True],
        "flaw": ["none", "b", "a", "b", "a", "none"],
        "final_answer": [3, 3, 4, 9, 8, 9]})


def test_arm_metrics_aggregate_over_seeds_by_hand():
    s = pl.DataFrame({"method": ["judge"] * 4, "seed": [0, 0, 1, 1],
                      "problem_id": ["p", "q", "p", "q"],
                      "selected_id": ["p-0", "q-0", "p-1", "q-2"],
                      "calls": [6, 6, 6, 6], "parse_failures": [0, 3, 0, 0]})
    m = cmp.arm_metrics(s, _cands())
    # seed 0: valid [1, 0] -> 0.5, answers [1, 1] -> 1.0; seed 1: valid [0, 1] -> 0.5, [1, 1]
    assert m["judge/proof_acc_mean"] == 0.5 and m["judge/proof_acc_std"] == 0.0
    assert m["judge/answer_acc_mean"] == 1.0
    # parse failures: 3 of 12 calls in seed 0, 0 in seed 1 -> mean 0.125, std 0.125
    assert m["judge/parse_fail_rate_mean"] == pytest.approx(0.125)
    assert m["judge/parse_fail_rate_std"] == pytest.approx(0.125)
    bad = s.with_columns(pl.lit("nope").alias("selected_id"))
    with pytest.raises(ValueError, match="not in candidates"):
        cmp.arm_metrics(bad, _cands())


def test_judge_metrics_by_hand():
    votes = pl.DataFrame({"seed": [0] * 6, "candidate_id": _cands()["candidate_id"],
                          "verdict": [True, True, None, False, False, True]},
                         schema={"seed": pl.Int64, "candidate_id": pl.String,
                                 "verdict": pl.Boolean})
    m = cmp.judge_metrics(votes, _cands(), per_side=1)
    # yes = [1,1,0,0,0,1] vs valid [1,0,0,0,0,1]: tp 2, fp 1, fn 0
    assert m["judge_eval/precision_mean"] == pytest.approx(2 / 3)
    assert m["judge_eval/recall_mean"] == 1.0 and m["judge_eval/f1_mean"] == pytest.approx(0.8)
    assert m["judge_eval/yes_rate_flaw_b_mean"] == 0.5      # p-1 yes, q-0 no
    assert m["judge_eval/yes_rate_flaw_a_mean"] == 0.0      # the None counts as not-Yes
    assert m["judge_eval/parse_fail_rate_mean"] == pytest.approx(1 / 6)
    # balanced 1+/1-: p -> p-0 (right), p-2 (wrong); q -> q-0, q-1. Yes on p-0 only -> 1/1
    assert m["judge_eval/fa_precision_mean"] == 1.0


def test_baselines_choose_by_final_answer_and_spend_no_calls():
    b = cmp.baseline_selections(_cands(), [0, 1])
    maj = b.filter(pl.col("method") == "majority")
    assert set(maj.filter(pl.col("problem_id") == "p")["selected_id"]) <= {"p-0", "p-1"}
    assert set(maj.filter(pl.col("problem_id") == "q")["selected_id"]) <= {"q-0", "q-2"}
    assert (b["calls"] == 0).all() and b.height == 2 * 2 * 2


# --- candidates -------------------------------------------------------------------------------

ROW = {"question": "20+5-3", "answer": 22, "n_operands": 3, "id": "x",
       "prompt": "Q: 20+5-3=? A:", "target": " 20+5=25; 25-3=22 #### 22"}


def test_labels_separate_proof_validity_from_the_final_answer():
    assert cand.label(ROW, ROW["target"])["flaw"] == "none"
    wrong = cand.label(ROW, " 20+5=25; 25-3=21 #### 21")
    assert wrong["flaw"] == "a" and wrong["final_answer"] == 21
    lucky = cand.label(ROW, " 20+5=26; 26-3=22 #### 22")
    assert lucky["flaw"] == "b" and lucky["answer_correct"] and not lucky["valid"]
    short = cand.label(ROW, " 20+5=25 #### 22")          # a missing step is not a valid proof
    assert short["flaw"] == "b"
    assert cand.label(ROW, "garbage")["final_answer"] is None


def test_corruption_always_yields_flaw_b():
    rng = random.Random(0)
    for _ in range(50):
        text = cand.corrupt(ROW, rng)
        lab = cand.label(ROW, text)
        assert lab["flaw"] == "b" and text.endswith("#### 22"), text
    rows, natural = cand.build_rows([ROW], [[ROW["target"]] * 20], 0.5, random.Random(1))
    assert natural == 0
    corrupted = [r for r in rows if r["source"] == "corrupted"]
    assert 0 < len(corrupted) < 20 and all(r["flaw"] == "b" for r in corrupted)
    assert all(r["flaw"] == "none" for r in rows if r["source"] == "policy")


def test_bad_configs_fail_before_compute():
    with pytest.raises(ValidationError, match="winner_count"):
        sel.Config(method="genselect", backend={"model": "m"}, winner_count=2, out="o")
    with pytest.raises(ValidationError, match="needs `votes`"):
        sel.Config(method="hybrid", backend={"model": "m"}, out="o")
    with pytest.raises(ValidationError, match="survivor_score = 'parseable' with method = judge"):
        sel.Config(method="judge", backend={"model": "m"}, survivor_score="parseable", out="o")
    assert sel.Config(method="hybrid", backend={"model": "m"}, votes="v", out="o"
                      ).survivor_score == "all"                     # the paper's rule by default
    with pytest.raises(ValidationError, match="repeat"):
        sel.Config(method="judge", backend={"model": "m"}, seeds=[0, 0], out="o")
    with pytest.raises(ValidationError, match="only 'arith'"):
        cand.Config(family="other")
    with pytest.raises(ValidationError, match="extra"):
        sel.Config(method="judge", backend={"model": "m"}, out="o", n_votes=3)


def test_verifier_training_targets():
    df = pl.DataFrame({"problem_id": ["p"] * 3, "question": ["20+5-3"] * 3,
                       "prompt": [ROW["prompt"]] * 3,
                       "completion": [ROW["target"], " 20+5=26; 26-3=22 #### 22",
                                      " 20+5=25 #### 25"],
                       "valid": [True, False, False]})
    prompts, targets = train.judge_rows(df, "check", True, random.Random(0))
    assert len(prompts) == 2 and sorted(t.split("Verdict: ")[1] for t in targets) == ["No", "Yes"]
    assert all(p.endswith(" Check:") for p in prompts)
    assert " 20+5=25 =; 25-3=22 =; #### 22 = Verdict: Yes" in targets
    assert train.judge_rows(df, "compact", False, random.Random(0))[1] == [" Yes", " No", " No"]
    firsts = []
    for seed in range(20):
        prompts, targets = train.selector_rows(df, "check", 2, random.Random(seed))
        assert len(prompts) == 2                         # the 2 (valid, invalid) pairs
        for p, t in zip(prompts, targets):
            best = int(t[-1])
            shown = p.split(" [2]")[0] if best == 1 else p.split(" [2]")[1]
            assert ROW["target"].strip() in shown        # the valid one is the answer
            assert pv.parse_choice(t) == best - 1
            firsts.append(best == 1)
    assert 0.3 < sum(firsts) / len(firsts) < 0.7         # no position bias in the data


# --- simulated-oracle mode (stage `oracle`) ---------------------------------------------------

@pytest.mark.parametrize("budget, n_p, want", [
    (64, 256, (64, 1)),       # B < n_p: 64 candidates, one verdict each
    (256, 256, (256, 1)),
    (1024, 256, (256, 4)),
    (4096, 256, (256, 16)),
    (1000, 256, (256, 3)),    # 1000 // 256: 232 calls left unspent
])
def test_judge_plan(budget, n_p, want):
    assert oracle.judge_plan(budget, n_p) == want


@pytest.mark.parametrize("budget, n_p, want", [
    (64, 256, (64, 4, 1)),          # pool of B: 60 games + 4 x 1 verdicts = 64 calls
    (256, 256, (256, 16, 1)),       # 240 games + 16 x 1 = 256
    (1024, 256, (256, 16, 49)),     # 240 + 16 x 49 = 1024
    (4096, 256, (256, 16, 241)),    # 240 + 16 x 241 = 4096
    (300, 256, (256, 16, 3)),       # 240 + 16 x 3 = 288 <= 300
    (10, 256, (10, 1, 1)),          # n_s at least 1
])
def test_hybrid_plan_spends_at_most_the_budget(budget, n_p, want):
    pool, n_s, n_j = oracle.hybrid_plan(budget, n_p, 16)
    assert (pool, n_s, n_j) == want
    assert pool - n_s + n_s * n_j <= budget


def test_genselect_plan():
    assert oracle.genselect_plan(64, 256) == 65 and oracle.genselect_plan(4096, 256) == 256


def test_oracle_games_follow_the_set_accuracy():
    rng = random.Random(0)
    sure = oracle.Oracle(pairwise_acc=1.0)
    # the valid one always wins, in either position
    assert oracle.play_oracle_game(True, False, sure, rng) == 0
    assert oracle.play_oracle_game(False, True, sure, rng) == 1
    wrong = oracle.Oracle(pairwise_acc=0.0)
    assert oracle.play_oracle_game(True, False, wrong, rng) == 1
    # same validity: a coin flip, both outcomes show up
    assert {oracle.play_oracle_game(False, False, sure, rng) for _ in range(50)} == {0, 1}
    # at 0.75 the valid side wins about 3 of 4 games
    wins = sum(oracle.play_oracle_game(True, False, oracle.Oracle(), rng) == 0
               for _ in range(4000))
    assert 0.72 < wins / 4000 < 0.78


def _pool(flaws, answers):
    return pl.DataFrame({"flaw": flaws, "valid": [f == "none" for f in flaws],
                         "final_answer": answers,
                         "answer_correct": [a == 7 for a in answers]})


def test_perfect_oracle_arms_pick_the_only_valid_candidate_within_budget():
    import numpy as np

    # 16 candidates, one valid (index 5); majority answer 7 is held by flaw-b candidates
    flaws = ["a"] * 8 + ["b"] * 7 + ["none"]
    flaws[5], flaws[15] = "none", "a"
    answers = [3] * 8 + [7] * 8
    answers[5] = 7
    pool = _pool(flaws, answers)
    perfect = oracle.Oracle(p_yes_valid=1.0, p_yes_flaw_b=0.0, p_yes_flaw_a=0.0,
                            pairwise_acc=1.0)
    cfg = oracle.Config(oracle=perfect, budgets=[16], n_p=16, survivor_ratio=4, seeds=[0])
    for seed in range(5):
        got = oracle.select_all(pool, 16, cfg, random.Random(seed), np.random.default_rng(seed))
        assert got["judge"] == (5, 16)                     # 16 candidates x 1 verdict
        assert got["genselect"] == (5, 15)                 # 15 games
        assert got["hybrid"] == (5, 12 + 4 * 1)            # 12 games + 4 survivors x 1
        assert answers[got["majority"][0]] == 7 and got["majority"][1] == 0
    # a budget too small for the whole pool: the judge sees only the first 4 (no valid one)
    got = oracle.select_all(pool, 4, cfg, random.Random(0), np.random.default_rng(0))
    assert got["judge"][1] == 4 and got["judge"][0] < 4 and got["genselect"][1] == 4


def test_oracle_claims_by_hand():
    m = {"hybrid/B64/proof_acc_mean": 0.7, "hybrid/B256/proof_acc_mean": 0.9,
         "judge/B64/proof_acc_mean": 0.6, "judge/B256/proof_acc_mean": 0.85}
    assert oracle.matches_judge_at(m, [64, 256]) == 256.0            # 0.7 < 0.85 at 64
    m["hybrid/B64/proof_acc_mean"] = 0.86
    assert oracle.matches_judge_at(m, [64, 256]) == 64.0
    assert [p for p, _, _ in oracle.claim_pairs([256, 64])] == [
        "claim/hybrid_vs_judge/B64/proof_acc", "claim/hybrid_vs_judge/B256/proof_acc",
        "claim/hybrid_B64_vs_judge_B256/proof_acc", "claim/hybrid_vs_genselect/B256/proof_acc"]
    # two problems, two seeds; valid per (arm, budget) as seed-0 / seed-1 pairs per problem:
    #   hybrid B64  p 1/1 q 1/0 -> p 1, q .5     judge B64  p 0/0 q 0/0 -> 0, 0
    #   hybrid B256 p 1/1 q 1/1 -> 1, 1          judge B256 p 1/1 q 0/1 -> 1, .5
    #   genselect B256 p 1/1 q 1/1 -> 1, 1
    valid = {("hybrid", 64): [1, 1, 1, 0], ("judge", 64): [0, 0, 0, 0],
             ("hybrid", 256): [1, 1, 1, 1], ("judge", 256): [1, 1, 0, 1],
             ("genselect", 256): [1, 1, 1, 1]}
    rows = [{"arm": arm, "budget": b, "problem_id": pid, "seed": seed, "valid": bool(v)}
            for (arm, b), vals in valid.items()
            for (pid, seed), v in zip([("p", 0), ("p", 1), ("q", 0), ("q", 1)], vals)]
    c = oracle.claims(pl.DataFrame(rows), [64, 256], draws=500)
    at64 = stats.read_claim(c, "claim/hybrid_vs_judge/B64/proof_acc")
    assert (at64.diff, at64.low, at64.n, at64.name) == (0.75, 0.5, 2, "reproduced")  # [1, .5]
    at256 = stats.read_claim(c, "claim/hybrid_vs_judge/B256/proof_acc")           # [0, .5]
    assert (at256.diff, at256.low, at256.high, at256.name) == (0.25, 0.0, 0.5, "inconclusive")
    cheap = stats.read_claim(c, "claim/hybrid_B64_vs_judge_B256/proof_acc")      # [0, 0]
    assert (cheap.diff, cheap.name) == (0.0, "inconclusive") and math.isnan(cheap.low)
    gs = stats.read_claim(c, "claim/hybrid_vs_genselect/B256/proof_acc")
    assert (gs.diff, gs.name) == (0.0, "inconclusive") and math.isnan(gs.low)


def test_oracle_config_rejects_bad_budgets_before_compute():
    with pytest.raises(ValidationError, match="budgets"):
        oracle.Config(budgets=[0, 64])
    with pytest.raises(ValidationError, match="repeats"):
        oracle.Config(budgets=[64, 64])
    with pytest.raises(ValidationError, match="p_yes_valid"):
        oracle.Config(oracle={"p_yes_valid": 1.5})
