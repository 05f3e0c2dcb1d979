"""Check 1 of the serving simulator: with routing and batching off it is a textbook queue.

The formulas (stages/serving/queueing.py) first on hand-computed values, then the simulator:
one prefill instance serving one prompt at a time, service time = a * prompt tokens (a = 1 ms),
Poisson arrivals, one-token outputs (a request ends at its prefill). Its mean wait must fall
inside the 95% batch-means interval of M/M/1, M/D/1 and M/G/1 (Pollaczek-Khinchine). A decode
instance whose step costs t per sequence is a processor-sharing server: E[T] = E[S] / (1 - rho).
Little's law is checked inside every run (metrics.py); Kleinrock's conservation law compares
SJF with FCFS on the same arrivals (common random numbers).
"""

from __future__ import annotations

import numpy as np
import pytest

from stages.serving import queueing as q
from stages.serving.latency import LatencyProfile
from stages.serving.sim import ClusterConfig, InstanceSpec, Policy, SimError, simulate
from stages.serving.workload import Trace

A = 1e-3          # seconds per prompt token: service time = A * tokens
N = 10_000        # requests per run (M/M/1, the noisiest, runs twice as many)
LAM = 0.5         # arrivals per second; E[S] = 1 s below, so rho = 0.5


# --- the formulas, by hand -----------------------------------------------------------------------


def test_formulas_on_hand_computed_values():
    # M/M/1, lambda 0.5, mu 1: rho 0.5, W_q = 0.5 / 0.5 = 1, T = 1 / 0.5 = 2
    assert q.mm1_wait(0.5, 1.0) == pytest.approx(1.0)
    assert q.mm1_sojourn(0.5, 1.0) == pytest.approx(2.0)
    # M/D/1, lambda 0.8, s 1: 0.8 * 1 / (2 * 0.2) = 2
    assert q.md1_wait(0.8, 1.0) == pytest.approx(2.0)
    # PK with exponential moments (E[S^2] = 2) is M/M/1; with deterministic (1) is M/D/1
    assert q.mg1_wait(0.5, 1.0, 2.0) == pytest.approx(q.mm1_wait(0.5, 1.0))
    assert q.mg1_wait(0.8, 1.0, 1.0) == pytest.approx(q.md1_wait(0.8, 1.0))
    # PS: E[S] 2, lambda 0.25 (rho 0.5) -> 4
    assert q.mg1_ps_sojourn(0.25, 2.0) == pytest.approx(4.0)
    assert q.little_l(3.0, 2.5) == pytest.approx(7.5)
    # Kleinrock: rho W0 / (1 - rho), lambda 0.5, E[S] 1, E[S^2] 2: 0.5 * 0.5 / 0.5 = 0.5
    assert q.kleinrock_load_weighted_wait(0.5, 1.0, 2.0) == pytest.approx(0.5)
    # uniform on {1, 2, 3}: E = 2, E[X^2] = 14 / 3
    assert q.discrete_moments([1, 2, 3]) == pytest.approx((2.0, 14 / 3))
    mean, half = q.batch_means_ci([1.0, 3.0] * 10, batches=2)
    assert mean == 2.0 and half == 0.0


def test_formulas_refuse_an_unstable_queue():
    with pytest.raises(ValueError, match="unstable queue: rho"):
        q.mm1_wait(1.0, 1.0)
    with pytest.raises(ValueError, match="not the moments"):
        q.mg1_wait(0.5, 1.0, 0.5)


# --- the simulator as a single-server queue -----------------------------------------------------------


def _profile(**kw) -> LatencyProfile:
    base = dict(name="queue", source="unit test", prefill_s0=0.0, prefill_s_per_token=A,
                decode_s0=0.0, decode_s_per_seq=0.0, decode_s_per_ctx_token=0.0,
                kv_bytes_per_token=1, link_bytes_per_s=1e12)
    return LatencyProfile(**{**base, **kw})


def _trace(arrivals, inputs, outputs) -> Trace:
    n = len(arrivals)
    return Trace.from_columns(session=np.arange(n), round=np.zeros(n), arrival_s=arrivals,
                              input_tokens=inputs, output_tokens=outputs, tool_gap_s=np.zeros(n))


SINGLE_SERVER = ClusterConfig(instances=[
    InstanceSpec(role="prefill", kv_capacity_tokens=10**9, max_batch_seqs=1),  # batching off
    InstanceSpec(role="decode", kv_capacity_tokens=10**9)])                   # never used


def _arrivals(seed: int, lam: float = LAM, n: int = N) -> np.ndarray:
    return np.cumsum(np.random.default_rng(seed).exponential(1 / lam, n))


def _waits(tokens, seed=1, policy=None):
    n = len(tokens)
    result = simulate(_trace(_arrivals(seed, n=n), tokens, np.ones(n, dtype=int)),
                      SINGLE_SERVER, _profile(), policy)
    return result, result.rounds["wait_prefill_s"]


def _assert_in_ci(samples, expected, what):
    # the first 5% see an empty system: dropped; 20 batches of ~500+ requests, far longer than
    # the queue's relaxation time at rho 0.5 (about 12 service times for M/M/1)
    mean, half = q.batch_means_ci(samples, batches=20, warmup=len(samples) // 20)
    assert abs(mean - expected) <= half, (
        f"{what}: simulated {mean:.4f} +- {half:.4f} (95% batch means), theory {expected:.4f}")
    assert half < 0.15 * expected  # the interval is tight enough to mean something


def test_mm1_mean_wait():
    # exponential service approximated by geometric token counts with mean 1000 (E[S] = 1 s):
    # E[S^2] = (2m^2 - m) A^2 instead of 2 m^2 A^2, a 0.05% difference, far inside the interval
    tokens = np.random.default_rng(2).geometric(1 / 1000, 2 * N)
    result, waits = _waits(tokens)
    _assert_in_ci(waits, q.mm1_wait(LAM, 1.0), "M/M/1 W_q")
    # Little's law on the queue: time-average length = arrival rate x mean wait
    qs = result.queues["prefill"]
    assert qs["mean_length"] == pytest.approx(qs["arrival_rate"] * qs["mean_wait_s"], rel=1e-9)
    assert result.little["L"] == pytest.approx(result.little["lambda"] * result.little["W"],
                                               rel=1e-9)


def test_md1_mean_wait():
    _, waits = _waits(np.full(N, 1000))
    _assert_in_ci(waits, q.md1_wait(LAM, 1.0), "M/D/1 W_q")


def test_mg1_mean_wait_pollaczek_khinchine():
    tokens = np.random.default_rng(3).integers(1, 2000, N)   # uniform on 1..1999: E[S] = 1 s
    es, es2 = q.discrete_moments(np.arange(1, 2000) * A)
    _, waits = _waits(tokens)
    _assert_in_ci(waits, q.mg1_wait(LAM, es, es2), "M/G/1 W_q (PK)")


def test_mg1_processor_sharing_sojourn():
    # decode steps of B sequences take B * t: each sequence gets 1/B of the server (PS, at
    # token granularity: a newcomer waits for the step in progress, about 1% of E[T] here).
    # Zero-cost local prefills; the service is (output - 1) decode tokens: uniform 1..99.
    t = 0.02
    outputs = np.random.default_rng(4).integers(2, 101, N)
    cluster = ClusterConfig(instances=[
        InstanceSpec(role="decode", kv_capacity_tokens=10**9, max_batch_seqs=10**6)])
    profile = _profile(prefill_s_per_token=0.0, decode_s_per_seq=t)
    result = simulate(_trace(_arrivals(1), np.ones(N, dtype=int), outputs), cluster, profile)
    _assert_in_ci(result.rounds["e2e_s"], q.mg1_ps_sojourn(LAM, 50 * t), "M/G/1-PS E[T]")


class ShortestFirst(Policy):
    """SJF on the prefill queue: the prompt with the fewest tokens."""

    def next_prefill(self, queue, inst, now):
        return min(range(len(queue)), key=lambda i: queue[i].new)


def test_kleinrock_conservation_sjf_against_fcfs():
    lam = 0.7  # rho 0.7: SJF and FCFS differ clearly
    arrivals = _arrivals(5, lam)
    tokens = np.random.default_rng(6).integers(1, 2000, N)
    es, es2 = q.discrete_moments(np.arange(1, 2000) * A)
    runs = {}
    for name, policy in (("fcfs", Policy()), ("sjf", ShortestFirst())):
        result = simulate(_trace(arrivals, tokens, np.ones(N, dtype=int)), SINGLE_SERVER,
                          _profile(), policy)
        runs[name] = result.rounds
    service = tokens * A
    sw = {k: service * r["wait_prefill_s"] for k, r in runs.items()}
    # SJF really reorders: a lower mean wait than FCFS, and requests overtaken
    assert runs["sjf"]["wait_prefill_s"].mean() < 0.8 * runs["fcfs"]["wait_prefill_s"].mean()
    assert runs["sjf"]["overtaken"].sum() > 0 and runs["fcfs"]["overtaken"].sum() == 0
    # The load-weighted wait sum_j S_j W_j is conserved on the sample path itself (the
    # unfinished work is the same for every work-conserving discipline) ...
    assert sw["sjf"].sum() == pytest.approx(sw["fcfs"].sum(), rel=1e-9)
    # ... and its time average matches Kleinrock's rho W0 / (1 - rho) for both disciplines
    horizon = runs["fcfs"]["done_s"].max() - arrivals[0]
    theory = q.kleinrock_load_weighted_wait(lam, es, es2)
    for name, values in sw.items():
        mean, half = q.batch_means_ci(values * (N / horizon), batches=20, warmup=N // 20)
        assert abs(mean - theory) <= half, f"{name}: {mean:.4f} +- {half:.4f} vs {theory:.4f}"


def test_little_check_catches_a_wait_charged_nowhere(monkeypatch):
    """The per-run Little's-law check is live: a queue that forgets to charge waits fails."""
    from stages.serving import instances

    def take_at_without_charging(self, i):
        self._tick()
        job = self[i]
        del self[i]
        return job

    monkeypatch.setattr(instances.Queue, "take_at", take_at_without_charging)
    n = 200
    trace = _trace(_arrivals(7, n=n), np.full(n, 1000), np.ones(n, dtype=int))
    with pytest.raises(SimError, match="Little's law fails for the prefill queues"):
        simulate(trace, SINGLE_SERVER, _profile())
