"""AMPD offline planner: how many prefill and decode replicas of which parallel strategy to
deploy under a GPU budget, as an integer linear program solved with HiGHS.

The method (He et al., ICML 2026, arXiv 2602.14516, §2 "Planner ILP"; the paper solves it with
SCIP, we use HiGHS through `highspy`). Integer replica counts x_n (prefill) and y_n (decode) per
strategy n (a tensor-parallel degree, costing g_n GPUs per replica); binaries u_n, v_n say
whether strategy n is used at all; Z is the worst SLO-normalised latency of any used strategy:

    min Z  s.t.  Σ_n g_n (x_n + y_n) ≤ G                                   GPU budget
                 Σ_n x_n μ_pre(n) ρ ≥ λ W_pre                               prefill capacity
                 Σ_n y_n μ_dec(n)   ≥ λ W_dec (1 + h)                       decode capacity
                 x_n ≤ M_n u_n,  u_n ≤ x_n,  y_n ≤ M_n v_n,  v_n ≤ y_n       u, v ∈ {0, 1}
                 Z ≥ τ_pre(n)/SLO_TTFT - R (1 - u_n)                        big-M: only used
                 Z ≥ τ_dec(n)/SLO_ITL  - R (1 - v_n)                        strategies count

with λ the session rate, W_pre / W_dec the prefill / decode tokens per session (all rounds,
incremental prefills included), μ the tokens/s of one replica, M_n = ⌊G / g_n⌋ (the tightest big
M for counts) and R = the largest normalised latency (the tightest for Z).

[reconstructed] (the spec gives the structure, not these pieces; each is a config value):
- τ_pre(n), "predicted latency at the planned load", is the M/D/1 response time of a prefill
  replica at utilisation ρ: S_n (1 + ρ / (2 (1 - ρ))), S_n its unloaded prefill time of the mean
  request. The capacity row caps every replica's utilisation at ρ (`max_utilisation`), which is
  what makes that τ an upper bound when load is spread in proportion to capacity.
- τ_dec(n) is the replica's decode step time at its operating batch (the ITL it serves); the
  decode row keeps a throughput headroom h (`decode_headroom`).
- `objective: max_goodput` is the planner's other reading ("maximise SLO-feasible goodput"):
  max T, the session rate served, s.t. T W_pre ≤ Σ x_n μ_pre(n) ρ, T W_dec (1 + h) ≤
  Σ y_n μ_dec(n), the budget, and only strategies whose τ meets its SLO (τ/SLO ≤ 1).
- Ties: among optimal plans the one with the fewest GPUs (a second, lexicographic solve).

`brute_force_plan` enumerates every allocation within the budget and applies the same objective
and tie rule: the ILP's test oracle (tests/unit/test_ampd_plan.py). The planner's linear model
misses nonlinear queueing (reviewers' caveat, spec §6): the simulator is the judge of a plan.

`tp_strategies` turns DistServe/Vidur-form latency constants into strategies for TP degrees
1, 2, 4 with a TP-efficiency model [reconstructed].
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

TOL = 1e-7   # relative tolerance for "equal objective" (ILP vs brute force, ties)


class Strategy(BaseModel):
    """One parallel strategy θ_n and what a single replica of it delivers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="e.g. tp2")
    gpus: int = Field(ge=1, le=4096, description="g_n: GPUs per replica")
    prefill_tokens_per_s: float = Field(gt=0, description="μ_pre: prefill throughput, tokens/s")
    prefill_latency_s: float = Field(gt=0, description="S: unloaded prefill time of the mean "
                                                       "request, s")
    decode_tokens_per_s: float = Field(gt=0, description="μ_dec: decode throughput at the "
                                                         "operating batch, tokens/s")
    itl_s: float = Field(gt=0, description="decode step time at the operating batch, s")


class PlanConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpu_budget: int = Field(8, ge=1, le=100_000, description="G: GPUs available (spec: 8 A100s)")
    objective: Literal["min_max_latency", "max_goodput"] = Field(
        "min_max_latency", description="spec's min-max Z at rate λ, or max SLO-feasible goodput")
    session_rate: float = Field(1.0, ge=0, description="λ: sessions/s (min_max_latency)")
    prefill_tokens_per_session: float = Field(
        gt=0, description="W_pre: prefill tokens per session, incremental rounds included")
    decode_tokens_per_session: float = Field(gt=0, description="W_dec: output tokens per session")
    slo_ttft_s: float = Field(gt=0, description="TTFT SLO, s")
    slo_itl_s: float = Field(gt=0, description="ITL SLO, s")
    max_utilisation: float = Field(0.8, gt=0, lt=1, description="ρ: planned prefill "
                                   "utilisation [reconstructed]")
    decode_headroom: float = Field(0.1, ge=0, le=10, description="h: decode capacity margin "
                                   "[reconstructed]")


@dataclass(frozen=True)
class Plan:
    feasible: bool
    prefill: dict[str, int]        # strategy name -> x_n
    decode: dict[str, int]         # strategy name -> y_n
    objective: float               # Z (min_max_latency) or T (max_goodput); nan if infeasible
    gpus: int
    max_norm_latency: float        # Z of this plan (0 if nothing deployed)
    goodput: float                 # T of this plan: sessions/s its capacity serves within ρ, h

    def counts(self, strategies: Sequence[Strategy]) -> tuple[list[int], list[int]]:
        return ([self.prefill.get(s.name, 0) for s in strategies],
                [self.decode.get(s.name, 0) for s in strategies])


def prefill_latency_at_load(s: Strategy, rho: float) -> float:
    """τ_pre: M/D/1 mean response time S (1 + ρ / (2 (1 - ρ))) [reconstructed]."""
    return s.prefill_latency_s * (1.0 + rho / (2.0 * (1.0 - rho)))


def normalised_latencies(strategies: Sequence[Strategy], cfg: PlanConfig
                         ) -> tuple[np.ndarray, np.ndarray]:
    """(τ_pre(n) / SLO_TTFT, τ_dec(n) / SLO_ITL) for every strategy."""
    r_pre = np.array([prefill_latency_at_load(s, cfg.max_utilisation) / cfg.slo_ttft_s
                      for s in strategies])
    r_dec = np.array([s.itl_s / cfg.slo_itl_s for s in strategies])
    return r_pre, r_dec


def evaluate_plan(strategies: Sequence[Strategy], x: Sequence[int], y: Sequence[int],
                  cfg: PlanConfig) -> Plan:
    """Z, T, GPUs and feasibility of one allocation (shared by the ILP and brute force)."""
    r_pre, r_dec = normalised_latencies(strategies, cfg)
    x, y = np.asarray(x, dtype=np.int64), np.asarray(y, dtype=np.int64)
    g = np.array([s.gpus for s in strategies])
    mu_pre = np.array([s.prefill_tokens_per_s for s in strategies]) * cfg.max_utilisation
    mu_dec = np.array([s.decode_tokens_per_s for s in strategies])
    gpus = int(g @ (x + y))
    cap_pre, cap_dec = float(mu_pre @ x), float(mu_dec @ y)
    goodput = min(cap_pre / cfg.prefill_tokens_per_session,
                  cap_dec / (cfg.decode_tokens_per_session * (1.0 + cfg.decode_headroom)))
    used = list(r_pre[x > 0]) + list(r_dec[y > 0])
    z = max(used) if used else 0.0
    if cfg.objective == "min_max_latency":
        feasible = (gpus <= cfg.gpu_budget
                    and cap_pre >= cfg.session_rate * cfg.prefill_tokens_per_session * (1 - 1e-9)
                    and cap_dec >= cfg.session_rate * cfg.decode_tokens_per_session
                    * (1.0 + cfg.decode_headroom) * (1 - 1e-9))
        objective = z
    else:
        feasible = gpus <= cfg.gpu_budget and all(r <= 1.0 + 1e-12 for r in used)
        objective = goodput
    names = [s.name for s in strategies]
    return Plan(feasible, {n: int(v) for n, v in zip(names, x) if v},
                {n: int(v) for n, v in zip(names, y) if v},
                objective if feasible else math.nan, gpus, z, goodput)


def solve_plan(strategies: Sequence[Strategy], cfg: PlanConfig, *,
               time_limit_s: float = 60.0) -> Plan:
    """The ILP above, solved to optimality with HiGHS; then the fewest-GPU optimal plan."""
    import highspy

    _check_strategies(strategies)
    n = len(strategies)
    g = [s.gpus for s in strategies]
    bound = [cfg.gpu_budget // gi for gi in g]                      # M_n
    r_pre, r_dec = normalised_latencies(strategies, cfg)
    big_r = float(max(r_pre.max(), r_dec.max()))                   # R
    rho, h = cfg.max_utilisation, cfg.decode_headroom
    goodput_mode = cfg.objective == "max_goodput"

    h_ = highspy.Highs()
    h_.setOptionValue("output_flag", False)
    h_.setOptionValue("mip_rel_gap", 0.0)
    h_.setOptionValue("mip_abs_gap", 0.0)
    h_.setOptionValue("time_limit", float(time_limit_s))
    # HiGHS's default row tolerance (1e-6) lets a continuous T overshoot its true optimum by
    # that much, more than the tie tolerance TOL: the tie-break solve would then be infeasible.
    for option in ("primal_feasibility_tolerance", "mip_feasibility_tolerance"):
        h_.setOptionValue(option, 1e-10)
    inf = highspy.kHighsInf
    # in max_goodput mode a strategy whose latency breaks its SLO is not allowed at all
    x = [h_.addIntegral(lb=0, ub=0 if goodput_mode and r_pre[i] > 1 else bound[i])
         for i in range(n)]
    y = [h_.addIntegral(lb=0, ub=0 if goodput_mode and r_dec[i] > 1 else bound[i])
         for i in range(n)]
    h_.addConstr(sum(g[i] * (x[i] + y[i]) for i in range(n)) <= cfg.gpu_budget)
    if goodput_mode:
        t = h_.addVariable(lb=0, ub=inf)
        # rows in sessions/s (divided by the work per session): T's coefficient is 1
        w_pre, w_dec = cfg.prefill_tokens_per_session, cfg.decode_tokens_per_session * (1 + h)
        h_.addConstr(sum(strategies[i].prefill_tokens_per_s * rho / w_pre * x[i]
                         for i in range(n)) - t >= 0)
        h_.addConstr(sum(strategies[i].decode_tokens_per_s / w_dec * y[i] for i in range(n))
                     - t >= 0)
        h_.setObjective(t, highspy.ObjSense.kMaximize)
        objective_var = t
    else:
        u = [h_.addBinary() for _ in range(n)]
        v = [h_.addBinary() for _ in range(n)]
        z = h_.addVariable(lb=0, ub=inf)
        h_.addConstr(sum(strategies[i].prefill_tokens_per_s * rho * x[i] for i in range(n))
                     >= cfg.session_rate * cfg.prefill_tokens_per_session)
        h_.addConstr(sum(strategies[i].decode_tokens_per_s * y[i] for i in range(n))
                     >= cfg.session_rate * cfg.decode_tokens_per_session * (1 + h))
        for i in range(n):
            h_.addConstr(x[i] - bound[i] * u[i] <= 0)
            h_.addConstr(u[i] - x[i] <= 0)
            h_.addConstr(y[i] - bound[i] * v[i] <= 0)
            h_.addConstr(v[i] - y[i] <= 0)
            h_.addConstr(z - float(r_pre[i]) + big_r * (1 - u[i]) >= 0)
            h_.addConstr(z - float(r_dec[i]) + big_r * (1 - v[i]) >= 0)
        h_.setObjective(z, highspy.ObjSense.kMinimize)
        objective_var = z
    if not _optimal(h_):
        return Plan(False, {}, {}, math.nan, 0, math.nan, 0.0)
    best = h_.getSolution().col_value[objective_var.index]
    # lexicographic second solve: the fewest GPUs among plans within TOL of the optimum
    slack = TOL * max(1.0, abs(best))
    if goodput_mode:
        h_.addConstr(objective_var >= best - slack)
    else:
        h_.addConstr(objective_var <= best + slack)
    h_.setObjective(sum(g[i] * (x[i] + y[i]) for i in range(n)), highspy.ObjSense.kMinimize)
    if not _optimal(h_):
        raise RuntimeError("HiGHS: the tie-break solve failed although the first solve was optimal")
    values = h_.getSolution().col_value
    xs = [int(round(values[v_.index])) for v_ in x]
    ys = [int(round(values[v_.index])) for v_ in y]
    return evaluate_plan(strategies, xs, ys, cfg)


def _optimal(h_: "highspy.Highs") -> bool:  # noqa: F821
    import highspy

    h_.run()
    return h_.getModelStatus() == highspy.HighsModelStatus.kOptimal


def brute_force_plan(strategies: Sequence[Strategy], cfg: PlanConfig) -> Plan:
    """Every (x, y) within the GPU budget; the best objective, then the fewest GPUs."""
    _check_strategies(strategies)
    n = len(strategies)
    g = [s.gpus for s in strategies]
    best: Plan | None = None
    for counts in itertools.product(*[range(cfg.gpu_budget // gi + 1) for gi in g * 2]):
        if sum(c * gi for c, gi in zip(counts, g * 2)) > cfg.gpu_budget:
            continue
        plan = evaluate_plan(strategies, counts[:n], counts[n:], cfg)
        if plan.feasible and (best is None or _better(plan, best, cfg)):
            best = plan
    return best if best is not None else Plan(False, {}, {}, math.nan, 0, math.nan, 0.0)


def _better(a: Plan, b: Plan, cfg: PlanConfig) -> bool:
    sign = 1.0 if cfg.objective == "max_goodput" else -1.0
    slack = TOL * max(1.0, abs(b.objective))
    if sign * (a.objective - b.objective) > slack:
        return True
    return abs(a.objective - b.objective) <= slack and a.gpus < b.gpus


def _check_strategies(strategies: Sequence[Strategy]) -> None:
    if not strategies:
        raise ValueError("no strategies to plan with")
    names = [s.name for s in strategies]
    if len(set(names)) != len(names):
        raise ValueError(f"strategy names repeat: {names}")


# --- strategies from α-β latency constants ------------------------------------------------------

def tp_strategies(*, prefill_s0: float, prefill_s_per_token: float, decode_s0: float,
                  decode_s_per_seq: float, decode_s_per_ctx_token: float,
                  mean_prompt_tokens: float, mean_context_tokens: float,
                  kv_tokens_per_gpu: float, slo_itl_s: float, prefill_s_per_token2: float = 0.0,
                  tp_degrees: Sequence[int] = (1, 2, 4), tp_efficiency: float = 0.85,
                  itl_target: float = 0.8, max_batch: int = 512) -> list[Strategy]:
    """Strategies `tp<k>` from one-GPU latency forms (DistServe/Vidur; spec §2 'Offline
    profiler'): prefill(L) = s0 + a L + b L², decode step(B, C) = s0 + c B + d C.

    TP scaling [reconstructed]: the per-token terms shrink by k · e^{log2 k} (e = `tp_efficiency`
    per doubling, for the all-reduce cost); the fixed terms do not; KV capacity grows k-fold.
    The decode operating batch is the largest B ≤ `max_batch` whose step time stays within
    `itl_target` · SLO_ITL and whose KV (B · mean context) fits.
    """
    out = []
    for k in tp_degrees:
        if k < 1:
            raise ValueError(f"tp degree {k}: must be >= 1")
        speed = k * tp_efficiency ** math.log2(k)
        prefill = (prefill_s0 + (prefill_s_per_token * mean_prompt_tokens
                                 + prefill_s_per_token2 * mean_prompt_tokens ** 2) / speed)

        def step(b: int) -> float:
            return decode_s0 + (decode_s_per_seq * b
                                + decode_s_per_ctx_token * b * mean_context_tokens) / speed

        fits = [b for b in range(1, max_batch + 1)
                if step(b) <= itl_target * slo_itl_s
                and b * mean_context_tokens <= k * kv_tokens_per_gpu]
        b = max(fits) if fits else 1   # no batch meets the SLO: batch 1, ITL ratio > 1
        out.append(Strategy(name=f"tp{k}", gpus=k,
                            prefill_tokens_per_s=mean_prompt_tokens / prefill,
                            prefill_latency_s=prefill, decode_tokens_per_s=b / step(b),
                            itl_s=step(b)))
    return out
