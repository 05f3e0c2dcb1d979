"""CoT-FSM: a chain of thought as a walk through a six-state machine, and Q-value steering.

Shahariar, Shayegani, Nazari, Abu-Ghazaleh, "Modeling Hierarchical Thinking in Large Reasoning
Models", arXiv 2510.22437 v2 (ICML 2026); code github.com/shahariar-shibli/CoT-FSM (a placeholder
README only). The method's details come from a secondary note (pipelines/cotfsm/README.md).

Offline phase (paper §3, [secondary] for the numbers):

    states       Q = {init, deduce, augment, uncertain, backtrack, closure}; a CoT is split into
                 sentences, each labelled with a state; consecutive repeats are MERGED before
                 counting transitions (else self-loops dominate)
    advantage    R = T_corr - T_inc, T_ij = P(next = j | current = i) on the correct (incorrect)
                 traces                                                   (`advantage_matrix`)
    Q-values     Q_{k+1}(q, q') = clip(R, -c, c)(q, q') + gamma * max_q'' Q_k(q', q''),
                 gamma = 0.9, 100 iterations, c in [0.2, 0.3]: choosing the next state is the
                 action and transitions are deterministic                 (`q_iteration`)
    vectors      v_{u->v}[l] = mean h_l(sentence end | u->v) - mean h_l(sentence end | other
                 transitions), at the sentence-final token                 (`steering_vectors`)
    probes       g_curr(h): the current state, g_next(h): the next state's distribution

Online step at every sentence-final token, at one layer (`q_value_action`):

    q = argmax g_curr(h); p = g_next(h); conf = max p; q_hat = argmax p
    stuck = the same state for the last `stuck_window` (5) sentences
    if not stuck and conf >= 0.9: no intervention
    q* = argmax_q' Q(q, q'); gap = Q(q, q*) - Q(q, q_hat); if gap < delta (0.06): none
    alpha = max(beta, gap * conf);  h <- h + alpha * (v_{q->q*} orthogonal to h)

Baselines: greedy steers at every sentence end towards argmax_j R(q, j) with alpha = 1;
weighted adds a mixture of every transition vector of q weighted by R(q, j) (positive towards,
negative away). The closed-form check (`optimal_q_by_enumeration`): for a deterministic MDP
with action = next state, V^pi = (I - gamma P_pi)^-1 r_pi for each of the 6^6 deterministic
policies; the best of them is the optimum Q-iteration must reach.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

STATES: tuple[str, ...] = ("init", "deduce", "augment", "uncertain", "backtrack", "closure")
N_STATES = len(STATES)
INIT, DEDUCE, AUGMENT, UNCERTAIN, BACKTRACK, CLOSURE = range(N_STATES)


def merge_repeats(states: Sequence[int]) -> list[int]:
    """[1, 1, 3, 3, 1] -> [1, 3, 1]: a run of sentences in one state is one visit."""
    out: list[int] = []
    for s in states:
        if not out or out[-1] != s:
            out.append(int(s))
    return out


def transition_counts(traces: Sequence[Sequence[int]], merge: bool = True) -> np.ndarray:
    """(6, 6) counts of i -> j over the traces (after merging repeats unless told not to)."""
    counts = np.zeros((N_STATES, N_STATES))
    for t in traces:
        seq = merge_repeats(t) if merge else list(t)
        for a, b in zip(seq[:-1], seq[1:]):
            counts[a, b] += 1
    return counts


def transition_matrix(traces: Sequence[Sequence[int]]) -> np.ndarray:
    """Row-normalised transition counts P(j | i); a state never left has a zero row."""
    counts = transition_counts(traces)
    rows = counts.sum(axis=1, keepdims=True)
    return np.divide(counts, rows, out=np.zeros_like(counts), where=rows > 0)


def advantage_matrix(traces: Sequence[Sequence[int]], correct: Sequence[bool]) -> np.ndarray:
    """R = T_corr - T_inc (paper §3.2): which transitions successful chains take more often."""
    if len(traces) != len(correct):
        raise ValueError(f"{len(traces)} traces but {len(correct)} correctness labels")
    good = [t for t, c in zip(traces, correct) if c]
    bad = [t for t, c in zip(traces, correct) if not c]
    if not good or not bad:
        raise ValueError(f"advantage_matrix needs correct and incorrect traces; got "
                         f"{len(good)} correct and {len(bad)} incorrect")
    return transition_matrix(good) - transition_matrix(bad)


def q_iteration(r: np.ndarray, gamma: float = 0.9, clip: float | None = 0.25,
                iterations: int = 100) -> np.ndarray:
    """Q_{k+1}(q, q') = R_clip(q, q') + gamma * max_q'' Q_k(q', q''), from Q_0 = 0."""
    r = np.asarray(r, dtype=float)
    if r.ndim != 2 or r.shape[0] != r.shape[1]:
        raise ValueError(f"R must be square, got shape {r.shape}")
    if not 0 <= gamma < 1:
        raise ValueError(f"gamma = {gamma}: expected 0 <= gamma < 1")
    r = np.clip(r, -clip, clip) if clip is not None else r
    q = np.zeros_like(r)
    for _ in range(iterations):
        q = r + gamma * q.max(axis=1)[None, :]
    return q


def optimal_q_by_enumeration(r: np.ndarray, gamma: float) -> tuple[np.ndarray, tuple[int, ...]]:
    """The exact optimum of the deterministic MDP (state = current state, action = next state,
    reward R(q, q')): V^pi = (I - gamma P_pi)^-1 r_pi for every deterministic policy pi, the
    best (elementwise: one policy is best in every state) is V*, and Q*(q, q') = R(q, q') +
    gamma V*(q'). Exponential in the number of states: a test oracle, not a planner."""
    n = r.shape[0]
    policies = np.array(list(itertools.product(range(n), repeat=n)))      # (n^n, n)
    p = np.zeros((len(policies), n, n))
    rows = np.arange(n)
    p[np.arange(len(policies))[:, None], rows[None, :], policies] = 1.0
    rewards = r[rows[None, :], policies]                                    # (n^n, n)
    values = np.linalg.solve(np.eye(n)[None] - gamma * p, rewards[..., None])[..., 0]
    best = int(np.argmax(values.sum(axis=1)))
    return r + gamma * values[best][None, :], tuple(int(a) for a in policies[best])


def steering_vectors(hidden: np.ndarray, current: np.ndarray, following: np.ndarray
                     ) -> np.ndarray:
    """(6, 6, d) difference-of-means vectors at one layer (paper §3.3).

    hidden (n, d): the residual stream at n sentence-final tokens; current / following (n,):
    the state of that sentence and of the next one. v[u, v] = mean h over u->v minus mean h
    over every other transition; zero where u->v never occurs (nothing to steer towards)."""
    hidden = np.asarray(hidden, dtype=np.float64)
    if hidden.ndim != 2 or len(hidden) != len(current) or len(current) != len(following):
        raise ValueError(f"steering_vectors: hidden {hidden.shape}, {len(current)} current and "
                         f"{len(following)} next states: expected (n, d), n, n")
    total, n = hidden.sum(axis=0), len(hidden)
    out = np.zeros((N_STATES, N_STATES, hidden.shape[1]))
    for u in range(N_STATES):
        for v in range(N_STATES):
            pos = (current == u) & (following == v)
            k = int(pos.sum())
            if k == 0 or k == n:
                continue
            s = hidden[pos].sum(axis=0)
            out[u, v] = s / k - (total - s) / (n - k)
    return out


def q_value_action(q_values: np.ndarray, current: int, next_probs: np.ndarray, stuck: bool, *,
                   conf_gate: float = 0.9, delta: float = 0.06, beta: float = 0.3
                   ) -> tuple[int, float] | None:
    """The online rule (module docstring): (target state q*, alpha), or None (no intervention)."""
    conf = float(np.max(next_probs))
    q_hat = int(np.argmax(next_probs))
    if not stuck and conf >= conf_gate:
        return None
    target = int(np.argmax(q_values[current]))
    gap = float(q_values[current, target] - q_values[current, q_hat])
    if gap < delta:
        return None
    return target, max(beta, gap * conf)


def greedy_target(r: np.ndarray, current: int) -> int:
    """Greedy baseline: the transition with the largest immediate advantage."""
    return int(np.argmax(r[current]))


def weighted_mixture(r: np.ndarray, vectors: np.ndarray, current: int) -> np.ndarray:
    """Weighted baseline: sum_j R(q, j) v_{q->j} / sum_j |R(q, j)| (a soft mixture of the
    positive and negative transition vectors); zero when R's row is zero."""
    w = np.asarray(r[current], dtype=float)
    norm = np.abs(w).sum()
    if norm == 0:
        return np.zeros(vectors.shape[-1])
    return np.tensordot(w / norm, vectors[current], axes=1)


def success_probability(states: Sequence[int], weights: np.ndarray, bias: float) -> float:
    """The task family's ground truth (not the method's): a trace that reaches closure succeeds
    with probability sigmoid(bias + sum of weights over its merged transitions)."""
    seq = merge_repeats(states)
    score = bias + sum(float(weights[a, b]) for a, b in zip(seq[:-1], seq[1:]))
    return float(1.0 / (1.0 + np.exp(-score)))
