"""Stage `validate_sim` (issue check 2): the simulator against a real server, request by request.

1. Serve the base model with `stages.serving.server` (continuous batching on `transformers`,
   127.0.0.1, its own process, stopped by PID) and drive it with the same bounded Poisson load
   at each rate (`measure_server`): every request's arrival, prompt and output length, TTFT
   and E2E as the server saw them.
2. Replay each rate's trace (the measured arrivals and lengths) in the simulator on one
   decode instance that prefills locally, as the server does: every waiting request admitted
   as one prefill batch (no token budget, `max_batch` sequences), the batch's decode stalled
   meanwhile. Two latency models:
     `profile`     the profile stage `profile_engine` measured just before (the DAG order);
     `server_log`  the same forms refitted on the server's own iteration log
                   (`profile.fit_iterations`): same schedule, the latency the server really
                   had. The gap between the rows separates the latency model's error (the
                   machine ran slower or faster under load than when profiled) from the
                   scheduling error (the simulator's queueing and batching against the server's).
3. Report, per rate and latency model, the relative error (simulated - measured) / measured of
   mean and P90 TTFT and E2E against the target (20%), the simulated utilisation of the
   engine (the rates must stay below saturation), the server's iteration slowdown against
   the profile (measured / predicted time, median over iterations), and the load average.

Outputs: a per-request parquet (measured and both simulated latencies), the plot table
(`plots/validate_sim.csv`: measured against simulated, one row per (rate, model, statistic)).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.core import io
from stages.serving.latency import LatencyProfile, load_profile
from stages.serving.profile import fit_iterations
from stages.serving.server import LoadConfig, ServerProcess, measure_server
from stages.serving.sim import ClusterConfig, InstanceSpec, simulate
from stages.serving.workload import Trace

STATS = ("ttft_mean", "ttft_p90", "e2e_mean", "e2e_p90")
MODELS = ("profile", "server_log")



# Durations returned here are results (simulated or the measurement this stage exists to make),
# not this machine's wall time: only `*seconds`/`wall_*` keys are kept out of DVC
# (stages/core/io.py `is_timing_key`).
TIMES_ARE_RESULTS = True

class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field("base_model", description="paths key of the save_pretrained folder served")
    profile: str = Field("serving_profile", description="paths key of the measured profile JSON")
    out: str = Field("validate_requests", description="paths key of the per-request parquet")
    plot: str = Field("validate_plot", description="paths key of the plot CSV")
    rates: list[float] = Field(description="Poisson rates (req/s), each below saturation")
    requests: int = Field(ge=5, le=100_000, description="requests per rate (the same set at "
                          "every rate: common random numbers)")
    target_rel_err: float = Field(0.2, gt=0, description="the issue's target |error|")
    load: LoadConfig = Field(default_factory=LoadConfig, description="the request mix and the "
                             "server (max_batch, threads)")

    @field_validator("rates")
    @classmethod
    def _rates(cls, v: list[float]) -> list[float]:
        if not v or any(not (r > 0) for r in v) or len(set(v)) != len(v):
            raise ValueError(f"rates = {v}: expected distinct rates > 0 (req/s)")
        return sorted(v)


def server_cluster(load: LoadConfig) -> ClusterConfig:
    """The server as the simulator sees it: one decode instance prefilling locally, no token
    budget per prefill batch, `max_batch` sequences, a KV pool that never binds (the server
    has no KV limit below max_batch)."""
    return ClusterConfig(instances=[InstanceSpec(
        role="decode", kv_capacity_tokens=10**8, max_batch_seqs=load.max_batch,
        max_batch_tokens=10**8)])


def replay(df: Any, profile: LatencyProfile, load: LoadConfig) -> tuple[np.ndarray, np.ndarray,
                                                                         float]:
    """Simulated (ttft, e2e) per request of one rate's measured table, in its row order, and
    the engine's simulated utilisation."""
    n = df.height
    trace = Trace.from_columns(session=np.arange(n), round=np.zeros(n),
                               arrival_s=df["arrival_s"].to_numpy(),
                               input_tokens=df["prompt_len"].to_numpy(),
                               output_tokens=df["output_len"].to_numpy(),
                               tool_gap_s=np.zeros(n))
    res = simulate(trace, server_cluster(load), profile)
    r = res.rounds
    order = np.argsort(r["session"])            # the trace is sorted by arrival; session = row
    return r["ttft_s"][order], r["e2e_s"][order], float(res.instances[0]["utilisation"])


def stats(ttft: np.ndarray, e2e: np.ndarray) -> dict[str, float]:
    return {"ttft_mean": float(np.mean(ttft)), "ttft_p90": float(np.quantile(ttft, 0.9)),
            "e2e_mean": float(np.mean(e2e)), "e2e_p90": float(np.quantile(e2e, 0.9))}


def slowdown(iterations: list[dict[str, float]], profile: LatencyProfile) -> float:
    """Median of measured / profile-predicted seconds over the server's iterations."""
    ratios = []
    for it in iterations:
        if it["kind"] == "prefill":
            pred = (profile.prefill_s0 + profile.prefill_s_per_token * it["sum_l"]
                    + profile.prefill_s_per_token2 * it["sum_l2"])
        else:
            pred = profile.decode_step_time(int(it["batch"]), it["ctx_tokens"])
        if pred > 0:
            ratios.append(it["seconds"] / pred)
    return float(np.median(ratios)) if ratios else float("nan")


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    profile = load_profile(ctx.path(cfg.profile))      # a bad profile fails here, before serving
    model_dir = ctx.path(cfg.model)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with ServerProcess(model_dir, max_batch=cfg.load.max_batch, threads=cfg.load.threads) as srv:
        measured = measure_server(model_dir, cfg.rates, cfg.requests, ctx.seed, cfg.load,
                                  url=srv.url)
        iterations = srv.iterations()
    serve_s = time.perf_counter() - started
    load_after = os.getloadavg()[0]
    refit = LatencyProfile.model_validate(fit_iterations(iterations, profile.model_dump()))
    profiles = {"profile": profile, "server_log": refit}

    metrics: dict[str, float] = {
        "load_avg_1m_before": load_before, "load_avg_1m_after": load_after,
        "serve_seconds": serve_s, "iterations": float(len(iterations)),
        "iteration_slowdown": slowdown(iterations, profile),
        "server_log/prefill_mape": refit.fit.get("prefill_mape", float("nan")),
        "server_log/decode_mape": refit.fit.get("decode_mape", float("nan")),
        "target_rel_err": cfg.target_rel_err}
    tables, plot_rows = [], []
    within = {m: 0 for m in MODELS}
    for rate in cfg.rates:
        df = measured.filter(pl.col("rate") == rate).sort("request")
        real = stats(df["ttft_s"].to_numpy(), df["e2e_s"].to_numpy())
        key = f"rate{rate:g}"
        metrics[f"{key}/requests"] = float(df.height)
        metrics.update({f"{key}/measured/{s}": v for s, v in real.items()})
        sim_cols = {}
        for name, prof in profiles.items():
            ttft, e2e, util = replay(df, prof, cfg.load)
            sim = stats(ttft, e2e)
            metrics[f"{key}/{name}/utilisation"] = util
            for s in STATS:
                err = (sim[s] - real[s]) / real[s]
                metrics[f"{key}/{name}/{s}"] = sim[s]
                metrics[f"{key}/{name}/{s}_rel_err"] = err
                within[name] += int(abs(err) <= cfg.target_rel_err)
                plot_rows.append({"rate": rate, "model": name, "statistic": s,
                                  "measured_s": real[s], "simulated_s": sim[s]})
            sim_cols[f"{name}_ttft_s"], sim_cols[f"{name}_e2e_s"] = ttft, e2e
        tables.append(df.with_columns(**{k: pl.Series(v) for k, v in sim_cols.items()}))
    for name in MODELS:
        metrics[f"{name}/within_target"] = float(within[name])
    metrics["comparisons"] = float(len(cfg.rates) * len(STATS))
    io.write_parquet(ctx.path(cfg.out), pl.concat(tables))
    with io.atomic_path(ctx.path(cfg.plot)) as tmp:
        pl.DataFrame(plot_rows).write_csv(tmp)
    print(f"validate_sim: {len(cfg.rates)} rates x {cfg.requests} requests served in "
          f"{serve_s:.1f} s; iteration slowdown vs profile {metrics['iteration_slowdown']:.2f}x; "
          f"within {cfg.target_rel_err:.0%}: profile {within['profile']}, server log "
          f"{within['server_log']} of {int(metrics['comparisons'])}")
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: whether the simulator with the profile, and with the server-log refit, came
    within the target error of the real server; every rate's numbers in details."""
    return {k: metrics[k] for k in ("profile/within_target", "server_log/within_target")
            if k in metrics}
