"""Stage `plan`: AMPD's offline replica plan for arm (f), the ILP of `plan.py` (HiGHS), checked
against brute-force enumeration of every allocation on the same instance.

Strategies are the workload stage's `tp_profiles` (cpu/smoke: the measured model at TP1 only;
gpu: A100 at TP 1, 2, 4, DistServe's constants), each turned into what one replica delivers for
this workload (`arms.strategies`). The plan provisions for the top of the rate grid
(`design_load`, default the highest load) with the spec's min-max objective; when no allocation
within the GPU budget carries that rate, it falls back to the largest SLO-feasible goodput
(`objective: max_goodput`) [reconstructed: the spec plans for one rate and is silent on an
infeasible one]. The simulator, not the ILP's linear model, then says how good the plan is.

Output `paths.ampd_plan`/plan.json: the plan (replicas per strategy and role), the strategies,
the objective used, the brute-force plan and whether both agree.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from stages.ampd.workload import GRID_KEYS
from stages.core.checks import read_json_checked
from stages.core import io
from stages.core.context import Context
from stages.serving.latency import load_profile

from .arms import SLO, ClusterParams, WorkloadShape, strategies
from .plan import TOL, PlanConfig, brute_force_plan, solve_plan



# Durations returned here are results (simulated or the measurement this stage exists to make),
# not this machine's wall time: only `*seconds`/`wall_*` keys are kept out of DVC
# (stages/core/io.py `is_timing_key`).
TIMES_ARE_RESULTS = True

# What simulate and compare read from plan.json (checked at their boundary).
PLAN_KEYS = {"prefill": dict, "decode": dict, "gpus": (int, float), "gpus_per_replica": dict}

class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cluster: ClusterParams = Field(default_factory=ClusterParams)
    design_load: float | None = Field(None, gt=0, description="load the plan provisions for; "
                                      "None: the highest of the grid")
    max_utilisation: float = Field(0.8, gt=0, lt=1, description="ρ of the planner [reconstructed]")
    decode_headroom: float = Field(0.1, ge=0, le=10, description="h of the planner "
                                   "[reconstructed]")
    time_limit_s: float = Field(60.0, gt=0)
    brute_force: bool = Field(True, description="check the ILP by enumerating every allocation")
    fill_budget: bool = Field(True, description="[ours] GPUs the fewest-GPU optimum leaves idle "
                              "become extra decode replicas of its fastest decode strategy, so "
                              "arm (f) runs on the same budget as the others")


def run(cfg: Config, ctx: Context) -> dict[str, float]:
    wdir = ctx.path("ampd_workload")
    grid = read_json_checked(wdir / "grid.json", GRID_KEYS)
    shape = WorkloadShape(**grid["shape"])
    slo = SLO(grid["slo"]["ttft_s"], grid["slo"]["itl_s"])
    tp = {name: (t["gpus"], load_profile(wdir / "profiles" / f"{name}.json"))
          for name, t in grid["tp_profiles"].items()}
    strats = strategies(tp, shape, slo, cfg.cluster.kv_capacity_tokens)
    load = cfg.design_load if cfg.design_load is not None else max(grid["loads"])
    rate = load * grid["capacity"]["cluster"]
    common = dict(gpu_budget=cfg.cluster.gpus, session_rate=rate,
                  prefill_tokens_per_session=shape.prefill_tokens,
                  decode_tokens_per_session=shape.decode_tokens, slo_ttft_s=slo.ttft_s,
                  slo_itl_s=slo.itl_s, max_utilisation=cfg.max_utilisation,
                  decode_headroom=cfg.decode_headroom)
    started = time.perf_counter()
    pcfg = PlanConfig(objective="min_max_latency", **common)
    plan = solve_plan(strats, pcfg, time_limit_s=cfg.time_limit_s)
    if not plan.feasible:
        pcfg = PlanConfig(objective="max_goodput", **common)
        plan = solve_plan(strats, pcfg, time_limit_s=cfg.time_limit_s)
    ilp_s = time.perf_counter() - started
    if not plan.feasible or not plan.decode:
        raise RuntimeError(f"no replica plan within {cfg.cluster.gpus} GPUs deploys a decode "
                           f"replica whose step meets the ITL SLO ({slo.itl_s:.4g} s): "
                           f"strategies {[s.model_dump() for s in strats]}")
    if not plan.prefill:
        raise RuntimeError("the replica plan deploys no prefill replica")
    oracle = brute_force_plan(strats, pcfg) if cfg.brute_force else None
    # optimal plans may tie: the check is on the objective and the GPUs (the tie rule), not on
    # which of several equally good allocations each method returned
    match = (oracle is not None and oracle.feasible and oracle.gpus == plan.gpus
             and abs(oracle.objective - plan.objective) <= TOL * max(1.0, abs(plan.objective)))
    deployed = {"prefill": dict(plan.prefill), "decode": dict(plan.decode)}
    gpus = plan.gpus
    if cfg.fill_budget:
        by_name = {s.name: s for s in strats}
        best = max(plan.decode, key=lambda n: (by_name[n].decode_tokens_per_s / by_name[n].gpus, n))
        extra = (cfg.cluster.gpus - gpus) // by_name[best].gpus
        deployed["decode"][best] += extra
        gpus += extra * by_name[best].gpus
    out = {"objective": pcfg.objective, "ilp_gpus": plan.gpus, "design_load": load, "design_rate": rate,
           "prefill": deployed["prefill"], "decode": deployed["decode"], "gpus": gpus,
           "ilp_prefill": plan.prefill, "ilp_decode": plan.decode,
           "goodput": plan.goodput, "max_norm_latency": plan.max_norm_latency,
           "gpus_per_replica": {s.name: s.gpus for s in strats},
           "strategies": [s.model_dump() for s in strats],
           "brute_force": None if oracle is None else {"prefill": oracle.prefill,
                                                       "decode": oracle.decode,
                                                       "objective": oracle.objective},
           "brute_force_match": match}
    io.write_json(ctx.path("ampd_plan") / "plan.json", out)
    ctx.log_params({"plan_objective": pcfg.objective,
                    **{f"plan_prefill_{n}": v for n, v in deployed["prefill"].items()},
                    **{f"plan_decode_{n}": v for n, v in deployed["decode"].items()}})
    return {"min_max_objective": float(pcfg.objective == "min_max_latency"),
            "prefill_replicas": float(sum(deployed["prefill"].values())),
            "decode_replicas": float(sum(deployed["decode"].values())), "gpus": float(gpus),
            "ilp_gpus": float(plan.gpus),
            "goodput_sessions_per_s": plan.goodput, "design_rate": rate,
            "max_norm_latency": plan.max_norm_latency, "ilp_seconds": ilp_s,
            "brute_force_match": float(match) if oracle is not None else -1.0}


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: GPUs of the ILP plan and whether brute force found the same optimum."""
    return {k: metrics[k] for k in ("gpus", "brute_force_match") if k in metrics}
