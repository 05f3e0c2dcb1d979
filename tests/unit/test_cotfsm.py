"""CoT-FSM's math on hand-computed values, the planner against the closed-form optimum, the
task family's labeller, and steering at sentence ends on a real (tiny, random) Llama."""

from __future__ import annotations

import random

import numpy as np
import pytest
from pydantic import ValidationError

from stages.cotfsm import fsm
from stages.cotfsm.traces import (Config, THINK, build_tokenizer, make_split, noisy_labels,
                                  parse_states)

I, D, A, U, B, C = range(6)
CHAIN = [[0, .6, .25, .15, 0, 0], [0, .3, .1, .25, .05, .3], [0, .6, .1, .15, .1, .05],
         [0, .25, .1, .1, .3, .25], [0, .6, .2, .15, .05, 0], [0, 0, 0, 0, 0, 1]]


def test_merge_and_advantage_by_hand():
    assert fsm.merge_repeats([I, D, D, U, U, D, C]) == [I, D, U, D, C]
    traces = [[I, D, D, C], [I, U, C], [I, D, C], [I, U, B, D, C]]
    correct = [True, False, True, True]
    r = fsm.advantage_matrix(traces, correct)
    # correct: I->D 2 of 3, I->U 1 of 3; incorrect: I->U 1 of 1
    assert r[I, D] == pytest.approx(2 / 3) and r[I, U] == pytest.approx(1 / 3 - 1)
    # U: correct U->B (1/1), incorrect U->C (1/1)
    assert r[U, B] == pytest.approx(1.0) and r[U, C] == pytest.approx(-1.0)
    assert np.allclose(r.sum(axis=1)[[I, U]], 0)          # rows of two distributions
    with pytest.raises(ValueError, match="correct and incorrect"):
        fsm.advantage_matrix(traces, [True] * 4)


def test_q_iteration_one_step_by_hand():
    r = np.zeros((6, 6))
    r[U, B], r[B, D] = 0.5, 0.2
    q = fsm.q_iteration(r, gamma=0.9, clip=0.25, iterations=100)
    # the Bellman fixed point (to gamma^100), with R(U, B) = 0.5 clipped to 0.25
    assert np.allclose(q, np.clip(r, -0.25, 0.25) + 0.9 * q.max(axis=1)[None, :], atol=1e-3)
    assert q[U, B] - 0.9 * q[B].max() == pytest.approx(0.25, abs=1e-3)
    # the loop U -> B -> D -> U pays 0.45 every 3 steps: V(U) = 0.25 + 0.9 * 0.2 + ...
    assert q[U].max() == pytest.approx((0.25 + 0.9 * 0.2) / (1 - 0.9 ** 3), abs=1e-2)
    assert q[U].argmax() == B


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q_iteration_equals_the_closed_form_optimum(seed: int):
    """On random advantages, 100 Q-iterations give the Q* of the best of all 6^6 deterministic
    policies, V^pi = (I - gamma P_pi)^-1 r_pi (to gamma^100), and the same greedy policy."""
    r = np.random.default_rng(seed).uniform(-0.3, 0.3, (6, 6))
    q = fsm.q_iteration(r, gamma=0.9, clip=None, iterations=100)
    q_star, pi = fsm.optimal_q_by_enumeration(r, 0.9)
    assert np.abs(q - q_star).max() < 1e-3
    assert tuple(q.argmax(axis=1)) == pi


def test_q_iteration_recovers_the_good_transitions_of_a_synthetic_chain():
    """Traces from the chain, success from the transitions visited (10% label noise on what
    the planner sees): from uncertain it plans backtrack, from backtrack deduce."""
    w = np.zeros((6, 6))
    w[U, B], w[B, D], w[U, C], w[U, D] = 1.5, 1.0, -1.5, -1.0
    cfg = Config(sizes={"lm_train": 4000, "fit": 2, "val": 2, "test": 2}, chain=CHAIN,
                 weights=w.tolist(), bias=-0.5)
    rows = make_split("lm_train", 4000, 0, cfg)
    r = fsm.advantage_matrix([x["labels"] for x in rows], [x["correct"] for x in rows])
    policy = fsm.q_iteration(r, 0.9, 0.25).argmax(axis=1)
    assert policy[U] == B and policy[B] == D
    assert r[U, C] < 0 and r[U, D] < 0


def test_steering_vectors_are_differences_of_means():
    h = np.array([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 4.0]])
    cur, nxt = np.array([U, U, D, D]), np.array([B, B, C, U])
    v = fsm.steering_vectors(h, cur, nxt)
    assert np.allclose(v[U, B], [2.0, 0.0] - np.array([0.0, 3.0]))
    assert np.allclose(v[D, C], [0.0, 2.0] - np.array([4 / 3, 4 / 3]))
    assert not v[I, D].any()                                  # never seen: no vector


def test_online_rule_gates():
    q = np.zeros((6, 6))
    q[D, C], q[D, U] = 0.5, 0.1
    sure = np.eye(6)[U] * 0.95 + 0.01
    unsure = np.array([0, .3, 0, .4, 0, .3])
    assert fsm.q_value_action(q, D, sure, stuck=False) is None            # confident
    target, alpha = fsm.q_value_action(q, D, sure, stuck=True)            # stuck overrides
    assert target == C and alpha == pytest.approx(max(0.3, 0.4 * sure.max()))
    target, alpha = fsm.q_value_action(q, D, unsure, stuck=False, beta=0.1)
    assert target == C and alpha == pytest.approx(0.4 * 0.4)              # gap * conf
    assert fsm.q_value_action(q, D, np.eye(6)[C] * 0.5 + 0.1, False) is None  # already q*
    assert fsm.q_value_action(q, D, unsure, False, delta=0.5) is None     # gap < delta


def test_weighted_mixture_and_greedy_target():
    r = np.zeros((6, 6))
    r[D, C], r[D, U] = 0.3, -0.1
    vec = np.zeros((6, 6, 2))
    vec[D, C], vec[D, U] = [1.0, 0.0], [0.0, 1.0]
    assert fsm.greedy_target(r, D) == C
    assert np.allclose(fsm.weighted_mixture(r, vec, D), [0.75, -0.25])
    assert not fsm.weighted_mixture(r, vec, I).any()


def test_labeller_and_noise():
    words = "We need to find x , then . Then x = 3 , done . So the answer is 3 . <eos>".split()
    assert parse_states(words) == ([I, D, C], True)
    assert parse_states(words[:-1]) == ([I, D, C], False)                 # cut before <eos>
    assert parse_states("We need to find x . Banana x .".split()) == ([I], False)
    flips = [a != b for a, b in zip([D] * 5000,
                                    noisy_labels([D] * 5000, random.Random(0), 0.1))]
    assert 0.08 < np.mean(flips) < 0.12


def test_tokenizer_covers_the_traces():
    cfg = Config(sizes={"lm_train": 50, "fit": 2, "val": 2, "test": 2}, chain=CHAIN,
                 weights=np.zeros((6, 6)).tolist())
    tok = build_tokenizer(cfg.max_number)
    for row in make_split("lm_train", 50, 0, cfg):
        ids = tok(row["prompt"] + " " + row["target"])["input_ids"]
        assert tok.unk_token_id not in ids
        words = tok.convert_ids_to_tokens(ids)
        assert parse_states(words[words.index(THINK) + 1:] + ["<eos>"]) == (row["states"], True)


def test_bad_chain_is_named():
    bad = [row[:] for row in CHAIN]
    bad[2] = [0, .5, .1, .1, .1, .1]                                      # sums to 0.9
    with pytest.raises(ValidationError, match="chain row 'augment'"):
        Config(sizes={"lm_train": 2, "fit": 2, "val": 2, "test": 2}, chain=bad,
               weights=np.zeros((6, 6)).tolist())
    with pytest.raises(ValidationError, match="every split"):
        Config(sizes={"lm_train": 2}, chain=CHAIN, weights=np.zeros((6, 6)).tolist())


def _tiny_model():
    import torch

    from stages.models import base

    tok = build_tokenizer(20)
    torch.manual_seed(0)
    cfg = base.Config(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32)
    return base.build_model(cfg, tok).eval(), tok


def _probes(d: int, scale: float):
    from stages.cotfsm.steer import Probes

    rng = np.random.default_rng(0)
    r = np.zeros((6, 6))
    r[:, C] = 0.5                                        # greedy: always towards closure
    arrays = {"R": r, "Q": fsm.q_iteration(r), "mean": np.zeros(d), "scale": np.ones(d),
              "curr_w": rng.normal(size=(6, d)), "curr_b": np.zeros(6),
              "next_w": rng.normal(size=(6, d)), "next_b": np.zeros(6),
              "vectors": scale * rng.normal(size=(6, 6, d))}
    return Probes(arrays, layer=1)


def test_steering_edits_only_sentence_ends_and_zero_changes_nothing():
    from stages.cotfsm.steer import Steering, sample_cots

    model, tok = _tiny_model()
    prompts = [f"Solve {a} + 1 = x {THINK}" for a in range(12)]
    base_run = sample_cots(model, tok, prompts, 24, seed=3)
    zero = sample_cots(model, tok, prompts, 24, seed=3, arm="greedy", probes=_probes(16, 0.0),
                       steering=Steering())
    assert zero["words"] == base_run["words"]             # a zero vector changes nothing
    strong = sample_cots(model, tok, prompts, 24, seed=3, arm="greedy",
                         probes=_probes(16, 50.0), steering=Steering())
    ends = [sum(w in (".", "?", "!") for w in words) for words in strong["words"]]
    # greedy steers at every sentence-final token generated (the last one's forward never
    # runs when it is the budget's last token) and nowhere else
    assert all(n - 1 <= iv <= n for iv, n in zip(strong["interventions"], ends))
    assert sum(strong["interventions"]) > 0
    assert strong["words"] != base_run["words"]
    assert strong["reads"] == strong["interventions"]
