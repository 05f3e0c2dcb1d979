"""Refine-Prover's kernel, fixer, value model and budget accounting on hand-computed values
(seconds; no model training). The Coq cross-check runs where `coqc` exists and is skipped with
the reason otherwise."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from stages.refine_prover import kernel, prover
from stages.refine_prover.problems import Config as ProblemsConfig
from stages.refine_prover.problems import make_statements, tamper_all
from stages.search.ledger import Cost

ST = "x>=2,y=5|-3x+2y>=14"
PROOF = "h3:3x>=6 mul h1;h4:2y=10 mul h2;h5:3x+2y>=16 add h3 h4;lin h5"


def test_canonical_proof_is_the_hand_written_one_and_is_accepted():
    assert kernel.canonical_proof(ST) == PROOF
    res = kernel.check(ST, PROOF)
    assert res.ok and res.errors == [] and res.n_lines == 4
    # goal terms in another order: the proof follows the goal's order
    assert kernel.canonical_proof("x>=2,y=5|-2y+3x>=14") == \
        "h3:2y=10 mul h2;h4:3x>=6 mul h1;h5:2y+3x>=16 add h3 h4;lin h5"


@pytest.mark.parametrize("proof, signature", [
    ("h3:3x>=7 mul h1;h4:2y=10 mul h2;h5:3x+2y>=17 add h3 h4;lin h5",
     (1, "type_mismatch", "3x>=6")),                       # a wrong product
    ("h3:3x>=6 mul h1;h4:2y=10 mul h2;h5:3x+2y>=17 add h3 h4;lin h5",
     (3, "type_mismatch", "3x+2y>=16")),                   # a wrong sum
    ("h3:3x>=6 mul h1;h4:2y=10 mul h2;h5:3x+2y>=16 add h3 h4",
     (4, "unsolved_goals", "3x+2y>=14")),                  # no closing line
    ("h3:3x>=6 mul h1;h4:2y=10 mul h2;h5:3x+2y>=16 add h3 h9;lin h5",
     (3, "unknown_identifier", "")),
    ("h3:3x>=6 mul h1;h4:2y=10 mul h2;h5:3x+2y>=16 add h3 h4;lin h3",
     (4, "tactic_failed", "3x+2y>=14")),
    ("h3:3x>=6 mul h1;sorry;h5:3x+2y>=16 add h3 h4;lin h5", (2, "forbidden", "3x+2y>=14")),
    ("h3:3x>=6 mul h1;h4:2y=10 mul h2;h5:3x+2y>=16 add h3 h4;lin h5;lin h5", (5, "no_goals", "")),
    ("h3:3x>=6 mul h1;h3:2y=10 mul h2;h5:3x+2y>=16 add h3 h4;lin h5", (2, "syntax", "")),
    ("h3:3x>=6 mul h1;h4:2y>=10 mul h2;h5:3x+2y=16 add h3 h4;lin h5",
     (3, "type_mismatch", "3x+2y>=16")),                   # '>=' + '>=' cannot give '='
])
def test_first_error_signature(proof: str, signature: tuple):
    res = kernel.check(ST, proof)
    assert not res.ok
    assert res.errors[0].signature == signature


def test_weaker_claims_are_entailed_and_accepted():
    # x = 2 gives 3x = 6 hence 3x >= 5; a weaker final bound still closes >= 14
    assert kernel.check(ST, "h3:3x>=5 mul h1;h4:2y=10 mul h2;h5:3x+2y>=15 add h3 h4;lin h5").ok


def test_every_one_character_tampering_is_rejected_or_still_correct():
    """The tampering test: change one character of a correct proof; the kernel rejects it unless
    the change keeps every line entailed (a weaker bound such as >=15 for >=16), which z3
    confirms line by line."""
    from stages.refine_prover.problems import _lines_entailed

    accepted = [t for t in tamper_all(PROOF) if kernel.check(ST, t).ok]
    assert len(tamper_all(PROOF)) > 1000
    assert all(_lines_entailed(ST, t) for t in accepted)
    assert len(accepted) < 20
    # the hand-picked ones: a wrong digit, a wrong citation, a wrong relation
    for bad in (PROOF.replace("3x>=6", "3x>=8"), PROOF.replace("add h3 h4", "add h3 h3"),
                PROOF.replace("lin h5", "lin h4"), PROOF.replace("2y=10", "2y=11")):
        assert not kernel.check(ST, bad).ok, bad


def test_many_wrong_proofs_share_one_signature():
    """The compression property: every wrong product in line 1 (with the sum computed from it)
    collapses onto the signature (1, type_mismatch, 3x>=6)."""
    wrong = [(ST, f"h3:3x>={v} mul h1;h4:2y=10 mul h2;h5:3x+2y>={v + 10} add h3 h4;lin h5")
             for v in range(7, 30)]
    sig = kernel.signature_counts(wrong)
    assert sig["wrong_proofs"] == 23 and sig["signatures"] == 1
    assert sig["proofs_per_signature"] == 23 and sig["shared_share"] == 1.0
    assert sig["class_share/type_mismatch"] == 1.0


def test_scripted_fix_repairs_the_first_error_only():
    bad = "h3:3x>=7 mul h1;h4:2y=10 mul h2;h5:3x+2y>=17 add h3 h4;lin h5"
    once = kernel.scripted_fix(ST, bad)
    assert once == "h3:3x>=6 mul h1;h4:2y=10 mul h2;h5:3x+2y>=17 add h3 h4;lin h5"
    twice = kernel.scripted_fix(ST, once)
    assert kernel.check(ST, twice).ok
    dropped = "h3:3x>=6 mul h1;h5:3x+2y>=16 add h3 h4;lin h5"
    assert kernel.check(ST, kernel.scripted_fix(ST, dropped)).ok


def test_malformed_statements_are_named():
    for bad, word in (("x>=2|3x>=6", "'|-'"), ("2x>=2|-2x>=4", "hypothesis h1"),
                      ("x>=2,x>=3|-x>=2", "two hypotheses"), ("x>=2|-3y>=1", "without")):
        with pytest.raises(kernel.StatementError, match=word):
            kernel.parse_statement(bad)


def test_generated_statements_are_true_by_z3_and_false_ones_are_caught():
    rows = make_statements(ProblemsConfig(sizes={"train": 20, "value": 5, "test": 5}), 0)
    assert len({r["statement"] for r in rows}) == 30
    assert all(kernel.certify_z3(r["statement"]) for r in rows)
    assert all(kernel.check(r["statement"], r["proof"]).ok for r in rows)
    assert not kernel.certify_z3("x>=2,y=5|-3x+2y>=17")      # 16 is the least value


def test_coq_lia_agrees_with_the_kernel():
    coqc = kernel.coqc_path()
    if coqc is None:
        pytest.skip("coqc not installed (Debian package `coq`; .ci/run installs it as root)")
    pairs = [(ST, PROOF), (ST, PROOF.replace("3x>=6", "3x>=7")), (ST, PROOF + ";sorry"),
             (ST, PROOF.replace(";lin h5", ""))]
    out = kernel.coq_cross_check(pairs, coqc)
    assert out["ran"] and out["agree"] == 4
    # the known, explained difference: lia accepts an entailed claim of another shape
    odd = "h3:3x>=6 mul h1;h4:x>=2 mul h3;h5:2y=10 mul h2;h6:3x+2y>=16 add h3 h5;lin h6"
    assert not kernel.check(ST, odd).ok and kernel.coq_accepts(ST, odd, coqc)
    assert kernel.explain_disagreement(ST, odd) == "lia_entails_non_rule_claim"


def test_logistic_regression_recovers_a_separating_direction():
    rng = np.random.default_rng(0)
    z = rng.normal(size=400)
    x = np.column_stack([np.ones(400), z])
    y = (rng.random(400) < 1 / (1 + np.exp(-(0.5 + 2.0 * z)))).astype(float)
    w = prover.fit_logistic(x, y, l2=0.0)
    assert abs(w[1] - 2.0) < 0.5 and abs(w[0] - 0.5) < 0.4
    assert prover.auc(list(x @ w), list(y.astype(bool))) > 0.8
    assert prover.auc([0.1, 0.9], [False, True]) == 1.0


def test_features_root_and_failed_proof():
    root = prover.features(None, 0)
    assert len(root) == len(prover.FEATURES) and root[1] == 1.0
    res = kernel.check(ST, "h3:3x>=7 mul h1;h4:2y=10 mul h2;h5:3x+2y>=17 add h3 h4;lin h5")
    phi = dict(zip(prover.FEATURES, prover.features(res, 2)))
    assert phi["is_root"] == 0 and phi["class/type_mismatch"] == 1 and phi["n_errors"] == 1
    assert phi["error_pos"] == 0.0 and phi["depth"] == 2 and phi["n_lines"] == 4


def test_iid_prediction_and_budget_prefix():
    # one problem with p = 0.5, one with p = 0: at B = 2, (1 - 0.25 + 0) / 2
    assert prover.predicted_iid([0.5, 0.0], 2) == pytest.approx(0.375)
    log = prover.GenLog([(Cost(generations=1, output_tokens=10), False),
                         (Cost(generations=1, output_tokens=7), True),
                         (Cost(generations=1, output_tokens=9), False)])
    assert log.at_budget(1) == (False, Cost(generations=1, output_tokens=10))
    assert log.at_budget(8) == (True, Cost(generations=2, output_tokens=17))


def test_gen_cost_counts_bos_and_eos():
    c = prover.gen_cost("T:x P:", "lin h1")
    assert (c.input_tokens, c.output_tokens, c.generations, c.nfe) == (7, 7, 1, 7)


def test_prompts():
    assert prover.refine_prompt(ST, "lin h1", "L1 tac 3x+2y>=14") == \
        f"T:{ST} F:lin h1 E:L1 tac 3x+2y>=14 P:"
    assert prover.history_prompt(ST, [("a", "b"), ("c", "d")]) == f"T:{ST} F:a E:b F:c E:d P:"


def test_bad_params_are_named():
    from stages.refine_prover.search import Config as SearchConfig

    with pytest.raises(ValueError, match="sizes"):
        ProblemsConfig(sizes={"train": 1, "test": 1})
    with pytest.raises(ValueError, match="unknown"):
        SearchConfig(budgets=[8], arms=["iid", "beam"])
    with pytest.raises(ValueError, match="distinct"):
        SearchConfig(budgets=[8, 8])


def test_corruptions_are_mostly_wrong():
    rng = random.Random(0)
    bad = [kernel.corrupt(PROOF, rng) for _ in range(200)]
    assert sum(not kernel.check(ST, b).ok for b in bad) > 160   # a lower bound can stay true


def test_results_table_renders_arms_claims_and_checks():
    from stages.core import stats
    from stages.refine_prover.compare import results_table

    c = stats.claim([1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0], paper_effect=0.047)
    compare = {"iid/B8/solved": 0.25, "iid/B16/solved": 0.5, "iid/output_tokens": 300.0,
               "random_tree/B8/solved": 0.5, "random_tree/B16/solved": 0.75,
               "random_tree/output_tokens": 200.0,
               **stats.claim_metrics(c, "claim/random_vs_iid/B16")}
    problems = {"n_test": 4.0, "tamper_rejected_share": 0.999, "tampered": 5000.0,
                "coq_ran": 1.0, "coq_agreement": 1.0, "coq_n": 20.0, "coq_unexplained": 0.0}
    text = results_table({"compare": compare, "problems": problems})
    assert "| iid | 0.250 | 0.500 | 300 |" in text
    assert "| random_vs_iid/B16 | inconclusive |" in text and "+0.047" in text
    assert "Coq `lia` agreement 1.000 on 20 proofs (0 unexplained)" in text
    assert results_table({}) == "_No results yet: run the pipeline._\n"


def test_unsolved_estimate_by_hand_and_unbiased():
    from math import comb

    from stages.refine_prover.search import unsolved_estimate

    # C(n-k, B) / C(n, B) with n = 4, B = 2: k = 0, 1, 2, 3 -> 1, 3/6, 1/6, 0
    assert [unsolved_estimate(k, 4, 2) for k in range(4)] == pytest.approx([1, 0.5, 1 / 6, 0])
    n, b, p = 6, 3, 0.3   # E_k[U] over k ~ Bin(n, p) is (1 - p)^B exactly
    mean = sum(comb(n, k) * p ** k * (1 - p) ** (n - k) * unsolved_estimate(k, n, b)
               for k in range(n + 1))
    assert mean == pytest.approx((1 - p) ** b, rel=1e-12)
    with pytest.raises(ValueError, match="B <= n"):
        unsolved_estimate(0, 4, 8)   # no unbiased estimate for B > n


def test_iid_check_by_hand():
    from stages.refine_prover.search import iid_check

    # predictions 1 - 1/6 and 0; D = (1/6, 0); mean 1/12, sd (1/6)/sqrt(2): z = 1
    obs, pred, z = iid_check([1.0, 0.0], [2, 0], 4, 2)
    assert (obs, pred) == pytest.approx((0.5, 5 / 12)) and z == pytest.approx(1.0)
    assert iid_check([1.0, 0.0], [4, 0], 4, 2)[2] == 0.0        # every D is 0
    assert math.isnan(iid_check([1.0, 1.0], [0, 0], 4, 2)[2])   # D all 1: no spread to size it
    with pytest.raises(ValueError, match="one rate per problem"):
        iid_check([1.0], [0, 0], 4, 2)


def test_value_model_with_one_label_class_is_flagged_degenerate(caplog):
    # 3 expansions, none accepted (the cpu run's case: 0 positives of 240): no fit, weights 0,
    # V = sigmoid(0) = 0.5 for every node, and it is said (warning + the flag `value_degenerate`)
    x = np.array([prover.features(None, 0), prover.features(kernel.check(ST, "lin h1"), 1),
                  prover.features(kernel.check(ST, "lin h2"), 2)])
    with caplog.at_level("WARNING", logger="paperline"):
        w, degenerate = prover.fit_value(x, np.zeros(3), 0.01, "value model, seed 7")
    assert degenerate and not w.any()
    assert prover.sigmoid(x @ w).tolist() == [0.5, 0.5, 0.5]
    assert "value model, seed 7: 0 positive labels of 3" in caplog.text
    _, degenerate = prover.fit_value(x, np.ones(3), 0.01)           # all accepted: same
    assert degenerate
    caplog.clear()
    w, degenerate = prover.fit_value(x, np.array([1.0, 0.0, 0.0]), 0.01)
    assert not degenerate and w.any() and not caplog.text


def test_results_table_says_a_degenerate_value_model():
    from stages.refine_prover.compare import results_table

    compare = {"iid/B8/solved": 0.25, "iid/output_tokens": 300.0}
    train = {"mean/base_train_accept": 0.0, "mean/ei2_repair_accept": 0.0,
             "mean/value_auc_train": float("nan"), "mean/value_degenerate": 1.0}
    text = results_table({"compare": compare, "train": train})
    assert "**Value model degenerate** in 100% of the seeds" in text
    train["mean/value_degenerate"] = 0.0
    assert "degenerate" not in results_table({"compare": compare, "train": train})
