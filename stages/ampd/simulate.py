"""Stage `simulate`: every arm on every (seed, rate) trace, in one stage.

Why one stage over all arms and not one per arm: a run is a fraction of a second to a few
seconds, so a stage per arm would spend more on start-up (imports, its MLflow run) than on
simulation at `smoke`, and DVC runs stages one after another while a process pool over all
(arm, seed, rate) runs keeps both cores busy to the end. The arms share this code and the
traces; the common random numbers are the same trace FILE read by every arm.

Every trace is read through the checked loader (`read_trace`) before the first run, so a
malformed file fails with its name, column and rule before any compute.

Outputs (`paths.ampd_sim`): runs.parquet (one row per (arm, seed, load): `arms.score`, the
cluster, stall seconds, KV transfers, the routing rule counts, wall seconds) and rounds.parquet
(one row per round of every run: TTFT, ITL, where its prefill ran).
"""

from __future__ import annotations

import os
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.ampd.planner import PLAN_KEYS
from stages.ampd.workload import GRID_KEYS
from stages.core.checks import read_json_checked
from stages.core.pool import map_jobs
from stages.core import io
from stages.core.context import Context
from stages.serving.latency import load_profile
from stages.serving.sim import simulate
from stages.serving.workload import read_trace

from .arms import ARMS, SLO, ClusterParams, build_cluster, make_policy, score

ROUND_COLUMNS = ("session", "round", "ttft_s", "itl_p90_s", "itl_max_s", "e2e_s", "local",
                 "prefill_instance", "decode_instance", "overtaken", "input_tokens",
                 "output_tokens", "cached_tokens")



# Durations returned here are results (simulated or the measurement this stage exists to make),
# not this machine's wall time: only `*seconds`/`wall_*` keys are kept out of DVC
# (stages/core/io.py `is_timing_key`).
TIMES_ARE_RESULTS = True


def runs_spec():
    """What compare relies on in runs.parquet (one row per arm, seed and load)."""
    import polars as pl

    from stages.core.checks import ColumnSpec, FrameSpec

    share = {c: ColumnSpec(dtype=pl.Float64, min=0.0, max=1.0)
             for c in ("attainment", "round_attainment", "itl_attainment", "ttft_attainment",
                       "local_fraction", "local_fraction_history")}
    return FrameSpec(columns={"arm": ColumnSpec(dtype=pl.String),
                              "seed": ColumnSpec(dtype=pl.Float64, min=0),
                              "load_index": ColumnSpec(dtype=pl.Float64, min=0),
                              "load": ColumnSpec(dtype=pl.Float64, min=0.0),
                              "rate": ColumnSpec(dtype=pl.Float64, min=0.0), **share})

class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arms: list[str] = Field(default_factory=lambda: list(ARMS), min_length=1)
    cluster: ClusterParams = Field(default_factory=ClusterParams)
    alpha: float = Field(0.8, gt=0, le=10, description="routing: prefill side 'not busy' when "
                         "its windowed TTFT <= alpha SLO_TTFT [reconstructed]")
    beta: float = Field(0.8, gt=0, le=10, description="routing: decode 'has ITL slack' when its "
                        "windowed ITL + amortised stall <= beta SLO_ITL [reconstructed]")
    lookahead: int = Field(3, ge=1, le=64, description="reordering window w [secondary]")
    stall_allowance: int = Field(4, ge=0, description="stalls a request's P90 ITL absorbs "
                                 "(10% of the gaps of the shortest output) [reconstructed]")
    workers: int = Field(1, ge=1, le=64, description="processes (runs are independent)")

    @field_validator("arms")
    @classmethod
    def _arms(cls, v: list[str]) -> list[str]:
        bad = [a for a in v if a not in ARMS]
        if bad:
            raise ValueError(f"unknown arms {bad}; arms: {', '.join(ARMS)}")
        if len(set(v)) != len(v):
            raise ValueError(f"arms repeat: {v}")
        return v


def _one(job: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list]]:
    """One (arm, seed, load) run; in a worker process, so it takes and returns plain data."""
    started = time.perf_counter()
    trace = read_trace(job["trace"])
    profiles = {name: load_profile(path) for name, path in job["profiles"].items()}
    slo = SLO(**job["slo"])
    cluster = build_cluster(job["arm"], ClusterParams(**job["cluster"]), job["plan"])
    policy = make_policy(job["arm"], slo, window_s=job["cluster"]["itl_window_s"], **job["policy"])
    result = simulate(trace, cluster, profiles, policy)
    row = {"arm": job["arm"], "seed": job["seed"], "load_index": job["load_index"],
           "load": job["load"], "rate": job["rate"], **score(result.rounds, slo),
           "prefill_instances": len([i for i in result.instances if i["role"] == "prefill"]),
           "decode_instances": len([i for i in result.instances if i["role"] == "decode"]),
           "stall_s": float(sum(i.get("stall_s", 0.0) for i in result.instances)),
           "preemptions": float(sum(i.get("preemptions", 0) for i in result.instances)),
           "transfers": float(result.transfers), "link_wait_s": float(result.link_wait_s),
           "rounds": len(trace), "horizon_s": result.horizon_s,
           **{f"rule_{k}": float(v) for k, v in getattr(policy, "rules", {}).items()},
           "wall_s": time.perf_counter() - started}
    rounds = {c: result.rounds[c].tolist() for c in ROUND_COLUMNS}
    n = len(trace)
    rounds.update(arm=[job["arm"]] * n, seed=[job["seed"]] * n, load_index=[job["load_index"]] * n)
    return row, rounds


def run(cfg: Config, ctx: Context) -> dict[str, float]:
    import polars as pl

    wdir = ctx.path("ampd_workload")
    grid = read_json_checked(wdir / "grid.json", GRID_KEYS)
    # the checked loader on every trace first: a malformed file stops the stage before compute
    traces = {key: wdir / "traces" / name for key, name in grid["traces"].items()}
    for path in traces.values():
        read_trace(path)
    plan = None
    if "planned" in cfg.arms:
        plan = read_json_checked(ctx.path("ampd_plan") / "plan.json", PLAN_KEYS)
    default = {"default": str(wdir / "profiles" / "default.json")}
    tp = {name: str(wdir / "profiles" / f"{name}.json") for name in grid["tp_profiles"]}
    policy = dict(alpha=cfg.alpha, beta=cfg.beta, lookahead=cfg.lookahead,
                  stall_allowance=cfg.stall_allowance)
    jobs = [{"arm": arm, "seed": seed, "load_index": i, "load": load, "rate": grid["rates"][i],
             "trace": str(traces[f"{seed}/{i}"]), "slo": {k: grid["slo"][k] for k in
                                                          ("ttft_s", "itl_s")},
             "profiles": tp if arm == "planned" else default, "plan": plan,
             "cluster": cfg.cluster.model_dump(), "policy": policy}
            for arm in cfg.arms for seed in grid["seeds"]
            for i, load in enumerate(grid["loads"])]
    started = time.perf_counter()
    # spawned workers (nothing inherited from the tracker's threads), results in job order
    results = map_jobs(_one, jobs, min(cfg.workers, os.cpu_count() or 1))
    wall = time.perf_counter() - started
    rows = [r for r, _ in results]
    for r in rows:
        if r["arm"] in ("reorder", "planned") and r["max_overtaken"] > cfg.lookahead - 1:
            raise RuntimeError(f"{r['arm']} seed {r['seed']} load {r['load']}: a prefill was "
                               f"overtaken {r['max_overtaken']:.0f} times > w - 1 = "
                               f"{cfg.lookahead - 1}")
    runs = pl.DataFrame(rows, infer_schema_length=None).fill_null(0.0)
    # each run's wall time goes to MLflow (the stage's metrics), not into runs.parquet: the same
    # inputs must give the same bytes
    max_run_wall = float(runs["wall_s"].max())
    runs = runs.drop("wall_s")
    rounds = pl.concat([pl.DataFrame(rd) for _, rd in results], how="vertical")
    out = ctx.path("ampd_sim")
    with io.atomic_path(out, is_dir=True) as tmp:
        io.write_parquet(tmp / "runs.parquet", runs)
        io.write_parquet(tmp / "rounds.parquet", rounds)
    n_rounds = float(runs["rounds"].sum())
    return {"runs": float(len(rows)), "rounds": n_rounds, "wall_s": wall,
            "rounds_per_wall_s": n_rounds / wall if wall > 0 else 0.0,
            "max_run_wall_s": max_run_wall,
            "max_overtaken": float(runs.filter(pl.col("arm").is_in(["reorder", "planned"]))
                                   ["max_overtaken"].max() or 0.0)}


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: simulated runs and rounds."""
    return {k: metrics[k] for k in ("runs", "rounds") if k in metrics}
