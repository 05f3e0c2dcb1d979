"""Stage `simulate`: every arm on every trace of `workload` (stages.maps.policies for the arms).

Cluster: 1 prefiller + 2 decoders with the KV capacities of the workload's manifest (40k : 25k
tokens, scaled for `own`), blocks of S tokens, continuous batching, preemption of the youngest
running request by recompute when a decoder's KV runs out (the simulator's only preemption
mode: stages.serving.sim). The latency profile is the one `workload` derived the rates from.

Per run (workload, seed, rate, arm) one row of `runs.parquet`: mean / P99 E2E and TTFT, mean
TPOT, the time-weighted number of queued requests (prefill + decoder ready + resume queues,
from the simulator's queue integrals), preemptions, migrations, fallbacks of the dispatcher,
the coverage of the L̂_up used at dispatch (MAPS arms: share of requests with L <= L̂_up), P99
E2E of the longest-output decile (spec §6: SJF must not starve long requests), and the peak KV
use of each decoder as a share of its capacity (never above 1: checked here).

Malformed inputs fail before any simulation: every trace is read through the checked reader
(a DataValidationError naming file, column and rule), predictions must cover every session.
Runs are spread over `workers` processes; each task is one (workload, seed, rate) trace with
all arms, so the arms of a trace always see the same file.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.maps.workload import calibration_spec, pred_spec
from stages.core.checks import read_json_checked, read_parquet_checked
from stages.core import io
from stages.core.pool import map_jobs
from stages.maps.policies import ARMS, make_policy
from stages.maps.workload import ClusterSpec
from stages.serving.latency import LatencyProfile
from stages.serving.sim import ClusterConfig, InstanceSpec, simulate
from stages.serving.workload import read_trace



# Durations returned here are results (simulated or the measurement this stage exists to make),
# not this machine's wall time: only `*seconds`/`wall_*` keys are kept out of DVC
# (stages/core/io.py `is_timing_key`).
TIMES_ARE_RESULTS = True


def runs_spec():
    """What compare relies on in the runs table (one row per workload, seed, rate and arm);
    `coverage` is NaN for the arms without a conformal bound."""
    import polars as pl

    from stages.core.checks import ColumnSpec, FrameSpec

    pos = {c: ColumnSpec(dtype=pl.Float64, min=0.0)
           for c in ("rate", "load", "e2e_mean_s", "e2e_p99_s", "e2e_p99_long_s", "queue_len",
                     "ttft_mean_s", "tpot_mean_s")}
    return FrameSpec(columns={"workload": ColumnSpec(dtype=pl.String),
                              "arm": ColumnSpec(dtype=pl.String),
                              "seed": ColumnSpec(dtype=pl.Int64),
                              "rate_index": ColumnSpec(dtype=pl.Int64, min=0),
                              "preemptions": ColumnSpec(dtype=pl.Int64, min=0),
                              "coverage": ColumnSpec(dtype=pl.Float64, min=0.0, max=1.0,
                                                     nullable=True), **pos})

class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    arms: list[str] = Field(default_factory=lambda: list(ARMS), min_length=1)
    alpha: float = Field(0.1, gt=0, lt=1, description="UAC miscoverage (paper 0.1)")
    uac_window: int = Field(500, ge=9, description="online UAC window n (paper 500)")
    max_wait_s: float = Field(1.0, gt=0, description="SJF max-wait guard (paper 1 s)")
    migrate_threshold: float = Field(0.9, gt=0, le=1, description="Llumnix-like: KV use that "
                                     "triggers a migration (spec: >= 90%)")
    migrate_every: int = Field(16, ge=1, description="Llumnix-like: decode iterations between "
                                                     "migration checks [reconstructed]")
    workers: int = Field(2, ge=1, le=64, description="processes")
    workload_path: str = Field("maps_workload", description="paths key: workload folder")
    runs_path: str = Field("maps_runs", description="paths key: per-run results parquet")

    @field_validator("arms")
    @classmethod
    def _arms(cls, v: list[str]) -> list[str]:
        bad = [a for a in v if a not in ARMS]
        if bad or len(set(v)) != len(v):
            raise ValueError(f"arms {v}: unknown or repeated {bad}; arms: {', '.join(ARMS)}")
        return v


def _cluster(spec: ClusterSpec, wl: dict[str, Any]) -> ClusterConfig:
    return ClusterConfig(instances=[
        InstanceSpec(role="prefill", kv_capacity_tokens=int(wl["prefill_kv_tokens"])),
        *[InstanceSpec(role="decode", kv_capacity_tokens=int(c),
                       max_batch_seqs=spec.max_batch_seqs) for c in wl["decode_kv_tokens"]]])


def _task(args: tuple) -> list[dict[str, Any]]:
    (cfg_json, wl_name, wl, seed, rate_i, path, pred, pred_weak, true, cal, cal_weak,
     profile_json) = args
    cfg = Config.model_validate_json(cfg_json)
    profile = LatencyProfile.model_validate_json(profile_json)
    profile = profile.model_copy(update={"kv_block_tokens": cfg.cluster.block_tokens})
    trace = read_trace(path)
    # what every arm of this task is run on: recorded per row, so a reader can check that all
    # arms saw the same requests (and, through `lengths_sha`, every rate of a seed too)
    lengths_sha = _sha(trace.input_tokens, trace.output_tokens, trace.session)
    trace_sha = _sha(trace.arrival_s, trace.input_tokens, trace.output_tokens, trace.session)
    cluster = _cluster(cfg.cluster, wl)
    caps = [int(c) for c in wl["decode_kv_tokens"]]
    long_cut = np.quantile(trace.output_tokens, 0.9)
    rows = []
    for arm in cfg.arms:
        if arm == "maps_sp160m" and pred_weak is None:
            continue
        policy = make_policy(arm, len(caps), pred=pred, pred_weak=pred_weak, true=true,
                             calibration=cal, calibration_weak=cal_weak, alpha=cfg.alpha,
                             window=cfg.uac_window, max_wait_s=cfg.max_wait_s,
                             block_tokens=cfg.cluster.block_tokens,
                             migrate_threshold=cfg.migrate_threshold,
                             migrate_every=cfg.migrate_every)
        started = time.perf_counter()
        res = simulate(trace, cluster, profile, policy)
        r = res.rounds
        e2e = r["e2e_s"]
        sid = r["session"]
        upper = getattr(policy, "upper", None)
        cov = float("nan")
        if upper is not None and arm not in ("oracle", "maps_no_uac"):
            used = ~np.isnan(upper[sid])   # dispatched requests (a one-token one never is)
            cov = float(np.mean(r["output_tokens"][used] <= upper[sid][used]))
        decoders = [i for i in res.instances if i["role"] == "decode"]
        row = {"workload": wl_name, "seed": seed, "rate_index": rate_i,
               "rate": float(wl["rates"][rate_i]), "load": float(wl["load_factors"][rate_i]),
               "arm": arm, "requests": len(e2e), "trace_sha": trace_sha,
               "lengths_sha": lengths_sha,
               "e2e_mean_s": float(e2e.mean()), "e2e_p99_s": float(np.percentile(e2e, 99)),
               "ttft_mean_s": float(r["ttft_s"].mean()),
               "ttft_p99_s": float(np.percentile(r["ttft_s"], 99)),
               "tpot_mean_s": float(np.nanmean(r["tpot_s"])),
               "queue_len": float(sum(res.queues[k]["mean_length"]
                                      for k in ("prefill", "ready", "resume"))),
               "decode_queue_len": float(res.queues["ready"]["mean_length"]
                                         + res.queues["resume"]["mean_length"]),
               "preemptions": int(r["preemptions"].sum()),
               "migrations": int(r["migrations"].sum()),
               "fallbacks": int(getattr(policy, "fallbacks", 0)),
               "coverage": cov,
               "e2e_p99_long_s": float(np.percentile(e2e[r["output_tokens"] >= long_cut], 99)),
               "share_decoder0": float(np.mean(r["decode_instance"] == 0)),
               "sim_seconds": time.perf_counter() - started}
        for k, d in enumerate(decoders):
            use = d["kv_peak_blocks"] / d["kv_capacity_blocks"]
            if use > 1.0:
                raise RuntimeError(f"{wl_name} seed {seed} rate {rate_i} arm {arm}: decoder {k} "
                                   f"peaked at {use:.3f} of its KV capacity")
            row[f"kv_peak_decoder{k}"] = float(use)
        rows.append(row)
    return rows


def _sha(*arrays: np.ndarray) -> str:
    import hashlib

    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def load_inputs(cfg: Config, folder: Path) -> tuple[dict[str, Any], list[tuple]]:
    """Read and check everything before simulating: the manifest, every trace, predictions."""
    import polars as pl

    from stages.core.checks import DataValidationError

    mpath = folder / "manifest.json"
    if not mpath.is_file():
        raise DataValidationError(f"{mpath}: rule 'file exists' failed: run stage `workload`",
                                  source=str(mpath), rule="file exists")
    manifest = read_json_checked(mpath, {"profile": dict, "workloads": dict, "load_factors": list, "seeds": list})
    profile = LatencyProfile.model_validate(manifest["profile"])
    tasks = []
    for wl_name, wl in manifest["workloads"].items():
        wl = {**wl, "load_factors": manifest["load_factors"]}
        preds = read_parquet_checked(folder / wl_name / "pred.parquet", pred_spec())
        cals = read_parquet_checked(folder / wl_name / "calibration.parquet",
                                    calibration_spec())
        for seed in manifest["seeds"]:
            p = preds.filter(pl.col("seed") == seed).sort("session")
            c = cals.filter(pl.col("seed") == seed)
            weak = "pred_weak" in p.columns
            for i in range(len(wl["rates"])):
                path = folder / wl_name / f"seed{seed}_rate{i}.parquet"
                trace = read_trace(path)   # checked: a malformed trace fails here, named
                n = int(trace.session.max()) + 1
                if p.height != n or (p["session"].to_numpy() != np.arange(n)).any():
                    raise DataValidationError(
                        f"{folder / wl_name / 'pred.parquet'}: rule 'one prediction per session' "
                        f"failed: seed {seed} has {p.height} rows for {n} sessions",
                        source=str(folder / wl_name / "pred.parquet"), column="session",
                        rule="one prediction per session")
                tasks.append((cfg.model_dump_json(), wl_name, wl, seed, i, path,
                              p["pred"].to_numpy(), p["pred_weak"].to_numpy() if weak else None,
                              p["true"].to_numpy(), c["residual"].to_numpy(),
                              c["residual_weak"].to_numpy() if weak else None,
                              profile.model_dump_json()))
    return manifest, tasks


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    started = time.perf_counter()
    manifest, tasks = load_inputs(cfg, Path(ctx.path(cfg.workload_path)))
    # spawned, not forked (`stages.core.pool`): the stage process runs tracking threads (MLflow,
    # Prefect) whose locks a forked child can inherit held, and then hangs forever
    results = map_jobs(_task, tasks, cfg.workers)
    df = pl.DataFrame([row for rows in results for row in rows])
    # each run's wall time goes to MLflow (the stage's metrics), not into the runs table: the
    # same inputs must give the same bytes
    sim_seconds = float(df["sim_seconds"].sum())
    df = df.drop("sim_seconds")
    io.write_parquet(ctx.path(cfg.runs_path), df)
    m: dict[str, float] = {"runs": float(df.height), "traces": float(len(tasks)),
                           "wall_s": time.perf_counter() - started,
                           "sim_seconds": sim_seconds,
                           "kv_peak_max": float(max(df[c].max() for c in df.columns
                                                    if c.startswith("kv_peak_decoder")))}
    for (wl, arm), g in df.group_by(["workload", "arm"], maintain_order=True):
        m[f"{wl}/{arm}/preemptions"] = float(g["preemptions"].sum())
        if g["coverage"].is_not_nan().any():
            m[f"{wl}/{arm}/coverage"] = float(g["coverage"].mean())
    print(f"maps simulate: {df.height} runs over {len(tasks)} traces in {m['wall_s']:.1f} s "
          f"(profile {manifest['profile']['name']})")
    return m


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: simulated runs and traces; per-arm preemptions and coverage in details."""
    return {k: metrics[k] for k in ("runs", "traces") if k in metrics}
