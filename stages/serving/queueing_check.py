"""Stage `queueing_check` (issue check 1): the simulator, with routing and batching off, is a
textbook queue; the theory against the simulated value with its 95% interval, as metrics.

The same set-up as tests/unit/test_serving_queueing.py, at the sizes of the params profile:
one prefill instance serving one prompt at a time, service time = `a` * prompt tokens, Poisson
arrivals, one-token outputs (a request ends at its prefill).

    mm1        W_q, geometric tokens (exponential service, mean 1 s)  vs rho / (mu - lambda)
    md1        W_q, constant tokens (1 s)                             vs rho s / (2 (1 - rho))
    mg1        W_q, uniform tokens 1..1999 (mean 1 s)                 vs Pollaczek-Khinchine
    mg1_ps     E[T] of a decode instance whose step costs t per sequence (processor sharing)
               vs E[S] / (1 - rho)
    kleinrock  sum_p rho_p W_p under FCFS and under SJF (same arrivals) vs rho W0 / (1 - rho)
    little     L = lambda W on every run (metrics.py raises if it fails; reported: the largest
               relative gap over the runs)

A check passes when the theory lies inside the simulated value's 95% batch-means interval
(`batches` contiguous batches after a 5% warm-up). The stage reports; it does not fail on a
miss: at 95% one check in twenty misses by chance, and a reader should see the number.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from stages.serving import queueing as q
from stages.serving.latency import LatencyProfile
from stages.serving.sim import ClusterConfig, InstanceSpec, Policy, simulate
from stages.serving.workload import Trace

CHECKS = ("mm1", "md1", "mg1", "mg1_ps", "kleinrock_fcfs", "kleinrock_sjf")



# Durations returned here are results (simulated or the measurement this stage exists to make),
# not this machine's wall time: only `*seconds`/`wall_*` keys are kept out of DVC
# (stages/core/io.py `is_timing_key`).
TIMES_ARE_RESULTS = True

class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests: int = Field(10_000, ge=400, le=10_000_000, description="requests per check "
                          "(M/M/1, the noisiest, runs twice as many)")
    rho: float = Field(0.5, gt=0, lt=0.95, description="load of the M/M/1, M/D/1, M/G/1, PS "
                       "checks (E[S] = 1 s, so lambda = rho)")
    rho_kleinrock: float = Field(0.7, gt=0, lt=0.95, description="load of the SJF vs FCFS check "
                                 "(high enough that SJF reorders clearly)")
    batches: int = Field(20, ge=5, le=1000, description="batch means per interval")
    level: float = Field(0.95, gt=0.5, lt=1.0, description="confidence level of the interval")
    s_per_token: float = Field(1e-3, gt=0, description="service seconds per prompt token")
    ps_step_s: float = Field(0.02, gt=0, description="PS check: decode step seconds per "
                             "sequence; outputs uniform 2..100 tokens, E[S] = 50 steps = 1 s")


class _ShortestFirst(Policy):
    """SJF on the prefill queue: the prompt with the fewest tokens."""

    def next_prefill(self, queue: Any, inst: Any, now: float) -> int:
        return min(range(len(queue)), key=lambda i: queue[i].new)


def _profile(cfg: Config, **kw: float) -> LatencyProfile:
    base = dict(name="queue", source="stage queueing_check", prefill_s0=0.0,
                prefill_s_per_token=cfg.s_per_token, decode_s0=0.0, decode_s_per_seq=0.0,
                decode_s_per_ctx_token=0.0, kv_bytes_per_token=1, link_bytes_per_s=1e12)
    return LatencyProfile(**{**base, **kw})


def _trace(arrivals: np.ndarray, inputs: np.ndarray, outputs: np.ndarray) -> Trace:
    n = len(arrivals)
    return Trace.from_columns(session=np.arange(n), round=np.zeros(n), arrival_s=arrivals,
                              input_tokens=inputs, output_tokens=outputs, tool_gap_s=np.zeros(n))


_SINGLE = ClusterConfig(instances=[
    InstanceSpec(role="prefill", kv_capacity_tokens=10**9, max_batch_seqs=1),  # batching off
    InstanceSpec(role="decode", kv_capacity_tokens=10**9)])                   # never used


def run_checks(cfg: Config, seed: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(metrics, table rows): per check theory, simulated mean, half-width, pass."""
    rng = np.random.default_rng([seed, 17])
    n = cfg.requests
    a = cfg.s_per_token
    mean_tokens = round(1.0 / a)                # E[S] = 1 s
    lam = cfg.rho
    rows: list[dict[str, Any]] = []
    little_gap = 0.0

    def arrivals(k: int, rate: float) -> np.ndarray:
        return np.cumsum(rng.exponential(1 / rate, k))

    def single(tokens: np.ndarray, rate: float, policy: Policy | None = None) -> Any:
        nonlocal little_gap
        k = len(tokens)
        res = simulate(_trace(arrivals(k, rate), tokens, np.ones(k, dtype=int)), _SINGLE,
                       _profile(cfg), policy)
        lt = res.little
        little_gap = max(little_gap, abs(lt["L"] - lt["lambda"] * lt["W"]) / max(lt["L"], 1e-12))
        return res

    def record(check: str, what: str, samples: np.ndarray, theory: float) -> None:
        mean, half = q.batch_means_ci(samples, batches=cfg.batches, level=cfg.level,
                                      warmup=len(samples) // 20)
        rows.append({"check": check, "quantity": what, "theory": theory, "simulated": mean,
                     "half_width": half, "requests": len(samples),
                     "pass": bool(abs(mean - theory) <= half)})

    uniform = np.arange(1, 2 * mean_tokens) * a
    es_u, es2_u = q.discrete_moments(uniform)

    tokens = rng.geometric(1 / mean_tokens, 2 * n)
    record("mm1", "W_q (s)", single(tokens, lam).rounds["wait_prefill_s"],
           q.mm1_wait(lam, 1.0 / (mean_tokens * a)))
    record("md1", "W_q (s)", single(np.full(n, mean_tokens), lam).rounds["wait_prefill_s"],
           q.md1_wait(lam, mean_tokens * a))
    tokens = rng.integers(1, 2 * mean_tokens, n)
    record("mg1", "W_q (s), Pollaczek-Khinchine",
           single(tokens, lam).rounds["wait_prefill_s"], q.mg1_wait(lam, es_u, es2_u))

    # processor sharing: B sequences' step takes B * t; service = (output - 1) steps
    outputs = rng.integers(2, 101, n)
    cluster = ClusterConfig(instances=[
        InstanceSpec(role="decode", kv_capacity_tokens=10**9, max_batch_seqs=10**6)])
    ps_rate = cfg.rho / (50 * cfg.ps_step_s)
    res = simulate(_trace(arrivals(n, ps_rate), np.ones(n, dtype=int), outputs), cluster,
                   _profile(cfg, prefill_s_per_token=0.0, decode_s_per_seq=cfg.ps_step_s))
    record("mg1_ps", "E[T] (s)", res.rounds["e2e_s"], q.mg1_ps_sojourn(ps_rate, 50 * cfg.ps_step_s))

    # Kleinrock: FCFS and SJF on the same arrivals and tokens (common random numbers)
    lam_k = cfg.rho_kleinrock
    arr = arrivals(n, lam_k)
    tokens = rng.integers(1, 2 * mean_tokens, n)
    theory = q.kleinrock_load_weighted_wait(lam_k, es_u, es2_u)
    weighted = {}
    for name, policy in (("fcfs", Policy()), ("sjf", _ShortestFirst())):
        r = simulate(_trace(arr, tokens, np.ones(n, dtype=int)), _SINGLE, _profile(cfg), policy)
        horizon = float(r.rounds["done_s"].max() - arr[0])
        sw = tokens * a * r.rounds["wait_prefill_s"]
        weighted[name] = float(sw.sum())
        record(f"kleinrock_{name}", "sum_p rho_p W_p", sw * (n / horizon), theory)
    metrics: dict[str, float] = {}
    for row in rows:
        c = row["check"]
        metrics.update({f"{c}/theory": row["theory"], f"{c}/simulated": row["simulated"],
                        f"{c}/half_width": row["half_width"], f"{c}/pass": float(row["pass"])})
    # on the sample path itself the load-weighted wait is identical for the two orders
    metrics["kleinrock/sample_path_rel_gap"] = abs(weighted["sjf"] - weighted["fcfs"]) / \
        weighted["fcfs"]
    metrics["little/max_rel_gap"] = little_gap
    metrics["passed"] = float(sum(r["pass"] for r in rows))
    metrics["checks"] = float(len(rows))
    return metrics, rows


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    metrics, rows = run_checks(cfg, ctx.seed)
    for r in rows:
        print(f"queueing_check {r['check']:>15}: theory {r['theory']:.4f}, simulated "
              f"{r['simulated']:.4f} +- {r['half_width']:.4f} -> "
              f"{'pass' if r['pass'] else 'MISS'}")
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: checks run and passed; every check's theory, simulation and CI in details."""
    return {k: metrics[k] for k in ("checks", "passed") if k in metrics}
