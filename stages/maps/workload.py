"""Stage `workload`: the request traces every arm is simulated on, with their predicted lengths.

Three workloads, one trace file per (workload, seed, rate) (`stages.serving.workload` format):
- `sharegpt`: ShareGPT-like length pairs (`workload.sharegpt_like`), Poisson arrivals;
- `bursty`: the same requests with Gamma inter-arrival times of CV `bursty_cv` (spec §4: 3-4);
- `own`: requests made from the predictor's TEST split (`stages.maps.predictor`): the project's
  real prompts (their token counts), the lengths the base model really generated for them at the
  served temperature, and the real predictor's L̂; `n_requests` rows drawn with replacement per
  seed (the test split holds fewer), Poisson arrivals.

Common random numbers: for one seed every rate sees the same requests, lengths and predictions
(`make_trace` draws arrivals at unit rate and divides by the rate; predictions are drawn per
seed, not per rate), and every arm reads the same files.

Predicted lengths. `sharegpt`/`bursty`: the spec's noise model L̂ = max(1, L e^eps + delta) at
two quality levels (`predictor.NOISE_LEVELS`: sp7b ~ the paper's SP-7B, sp160m ~ SP-160M);
`own`: the real predictor. Each workload also gets calibration residuals L - L̂ (n =
`calibration_size`, the paper's window 500) from requests disjoint from the trace: a separate
draw of the same length law for the noise model, the predictor's calibration split for `own`.
They seed the online UAC window, as a deployment would start from an offline calibration.

Cluster and load (`ClusterSpec`, shared with `simulate` through a YAML anchor): 1 prefiller + 2
decoders of 40k : 25k KV tokens (the paper's memory caps 0.8 : 0.5), S = 16. Rates are fractions
`load_factors` of the cluster's capacity, derived from the latency profile and the workload's
mean lengths before any simulation (`capacity_rate`), never tuned on results. For `own` the KV
capacities are scaled by the ratio of mean KV footprints (`footprint`, below) of
`own` to `sharegpt`, so each decoder holds about as many concurrent requests as in the
ShareGPT-like runs (the tiny model's requests are ~50x shorter); capacities are rounded up to
whole blocks and never below the largest request.

Outputs: `<maps_workload>/<workload>/seed<s>_rate<i>.parquet` (trace), `<workload>/pred.parquet`
(seed, session, true, pred[, pred_weak]), `<workload>/calibration.parquet` (seed, residual[,
residual_weak]) and `manifest.json` (rates, capacities, means, profile) that `simulate` reads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.core.checks import read_parquet_checked
from stages.core import io
from stages.serving.latency import LatencyProfile, load_profile
from stages.serving.workload import make_trace, sharegpt_like, write_trace

WORKLOADS = ("sharegpt", "bursty", "own")


class ClusterSpec(BaseModel):
    """What `workload` and `simulate` must agree on (one YAML anchor in params.yaml)."""

    model_config = ConfigDict(extra="forbid")
    latency_profile: str = Field("measured", description="'measured' (pipeline serving's "
                                 "profile.json, paths.serving_profile) or a shipped profile name "
                                 "('a100', ...)")
    prefill_kv_tokens: int = Field(40_000, ge=16, description="prefiller KV tokens [reconstructed:"
                                   " the paper caps prefiller memory at 0.8 like decoder 1]")
    decode_kv_tokens: list[int] = Field(default_factory=lambda: [40_000, 25_000], min_length=2,
                                        description="KV tokens per decoder (paper: 0.8 : 0.5)")
    block_tokens: int = Field(16, ge=1, description="S, tokens per KV block")
    max_batch_seqs: int = Field(256, ge=1, description="most sequences in a decode batch (vLLM)")

    @field_validator("decode_kv_tokens")
    @classmethod
    def _pos(cls, v: list[int]) -> list[int]:
        if any(c < 16 for c in v):
            raise ValueError(f"decode_kv_tokens {v}: each must be >= 16")
        return v


def resolve_profile(spec: ClusterSpec, ctx: Any) -> LatencyProfile:
    if spec.latency_profile == "measured":
        return load_profile(ctx.path("serving_profile"))
    return load_profile(spec.latency_profile)


def footprint(prompt: np.ndarray, output: np.ndarray) -> float:
    """The mean KV tokens a running request holds, time-averaged over the requests running at
    a random instant: request i holds p_i + t tokens during its t-th step and runs L_i steps,
    so it contributes p_i L_i + L_i^2 / 2 token-steps; by Little's law the average over running
    requests is E[p L + L^2 / 2] / E[L]. (Not E[p] + E[L] / 2: long requests hold their memory
    longer, so with ShareGPT-like tails the footprint is ~1.5x that.)"""
    p, L = np.asarray(prompt, dtype=np.float64), np.asarray(output, dtype=np.float64)
    return float(np.mean(p * L + L * L / 2) / np.mean(L))


def capacity_rate(profile: LatencyProfile, decode_kv: list[int], f: float, mean_prompt: float,
                  mean_output: float, max_batch_seqs: int, max_batch_tokens: int = 8192) -> float:
    """Requests/s the cluster sustains, from the profile alone (no simulation):
    a decoder of K KV tokens holds B = min(max_batch_seqs, K / f) requests, f the mean KV
    footprint of a running request (`footprint`); it emits B / T_dec(B, B f) tokens/s, i.e.
    that over mean output requests/s; the prefiller runs batches of max_batch_tokens / mean
    prompt prompts. Capacity = min(sum over decoders, prefiller)."""
    decode = 0.0
    for k in decode_kv:
        b = max(1.0, min(float(max_batch_seqs), k / f))
        decode += b / profile.decode_step_time(b, b * f) / mean_output
    per_batch = max(1.0, max_batch_tokens / mean_prompt)
    prefill = per_batch / profile.prefill_batch_time([round(mean_prompt)] * int(per_batch),
                                                     [0] * int(per_batch))
    return min(decode, prefill)



# Durations returned here are results (simulated or the measurement this stage exists to make),
# not this machine's wall time: only `*seconds`/`wall_*` keys are kept out of DVC
# (stages/core/io.py `is_timing_key`).
TIMES_ARE_RESULTS = True


def pred_spec():
    """pred.parquet: the length prediction per (seed, session); `pred_weak` where written."""
    import polars as pl

    from stages.core.checks import ColumnSpec, FrameSpec

    return FrameSpec(columns={"seed": ColumnSpec(dtype=pl.Int64),
                              "session": ColumnSpec(dtype=pl.Int64, min=0),
                              "true": ColumnSpec(dtype=pl.Float64, min=0.0),
                              "pred": ColumnSpec(dtype=pl.Float64)})


def calibration_spec():
    """calibration.parquet: conformal residuals (true - predicted) per seed."""
    import polars as pl

    from stages.core.checks import ColumnSpec, FrameSpec

    return FrameSpec(columns={"seed": ColumnSpec(dtype=pl.Int64),
                              "residual": ColumnSpec(dtype=pl.Float64)})


def samples_spec():
    """The predictor's table (lengths.parquet) as workload reads it: the split of each prompt,
    its length in tokens, the served length and the prediction."""
    import polars as pl

    from stages.core.checks import ColumnSpec, FrameSpec

    return FrameSpec(columns={"split": ColumnSpec(dtype=pl.String, values=("train", "cal", "test")),
                              "prompt_tokens": ColumnSpec(dtype=pl.Int64, min=0),
                              "served_length": ColumnSpec(dtype=pl.Int64, min=0),
                              "pred": ColumnSpec(dtype=pl.Float64)})

class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    workloads: list[Literal["sharegpt", "bursty", "own"]] = Field(
        default_factory=lambda: list(WORKLOADS), min_length=1)
    seeds: list[int] = Field(default_factory=lambda: list(range(10)), min_length=1)
    load_factors: list[float] = Field(default_factory=lambda: [0.5, 0.65, 0.8, 0.95, 1.1],
                                      min_length=1, description="rates as fractions of capacity")
    n_requests: int = Field(1000, ge=10, description="requests per trace")
    bursty_cv: float = Field(3.0, gt=1, description="Gamma inter-arrival CV (spec: 3-4)")
    calibration_size: int = Field(500, ge=9, description="offline UAC residuals (paper n = 500)")
    strong_level: str = Field("sp7b", description="noise level of the `maps` arm")
    weak_level: str = Field("sp160m", description="noise level of the `maps_sp160m` arm")
    predictor_samples: str = Field("maps_lengths", description="paths key: predictor table")
    out_path: str = Field("maps_workload", description="paths key: output folder")

    @field_validator("load_factors")
    @classmethod
    def _loads(cls, v: list[float]) -> list[float]:
        if any(not 0 < x <= 3 for x in v) or len(set(v)) != len(v):
            raise ValueError(f"load_factors {v}: each in (0, 3], listed once")
        return v

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v) or min(v) < 0:
            raise ValueError(f"seeds {v}: non-negative, listed once")
        return v

    @model_validator(mode="after")
    def _levels(self) -> "Config":
        from stages.maps.predictor import NOISE_LEVELS

        for name in ("strong_level", "weak_level"):
            if getattr(self, name) not in NOISE_LEVELS:
                raise ValueError(f"{name} {getattr(self, name)!r}: expected one of "
                                 f"{sorted(NOISE_LEVELS)}")
        return self


def _sub(seed: int, *tags: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *tags]))


def _round_up(x: float, block: int) -> int:
    return int(math.ceil(x / block) * block)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.maps.predictor import noise_predictions

    profile = resolve_profile(cfg.cluster, ctx)
    out = Path(ctx.path(cfg.out_path))
    manifest: dict[str, Any] = {"profile": profile.model_dump(mode="json"),
                                "seeds": cfg.seeds, "load_factors": cfg.load_factors,
                                "workloads": {}}
    metrics: dict[str, float] = {}
    with io.atomic_path(out, is_dir=True) as tmp:
        synth = sharegpt_like(cfg.n_requests, 1.0)
        first = make_trace(synth, cfg.seeds[0])   # means that set the rates: data, not results
        sg_prompt, sg_out = float(first.input_tokens.mean()), float(first.output_tokens.mean())
        sg_f = footprint(first.input_tokens, first.output_tokens)
        for wl in cfg.workloads:
            folder = tmp / wl
            folder.mkdir(parents=True)
            caps = list(cfg.cluster.decode_kv_tokens)
            pcap = cfg.cluster.prefill_kv_tokens
            preds, cals = [], []
            if wl in ("sharegpt", "bursty"):
                wcfg = sharegpt_like(cfg.n_requests, 1.0,
                                     bursty_cv=cfg.bursty_cv if wl == "bursty" else None)
                base = {s: make_trace(wcfg, s) for s in cfg.seeds}
                mean_prompt, mean_out, f = sg_prompt, sg_out, sg_f
                for s in cfg.seeds:
                    tr = base[s]
                    true = tr.output_tokens.astype(np.float64)
                    # predictions per seed (not per rate): the same on every rate and arm
                    preds.append(pl.DataFrame({
                        "seed": np.full(len(tr), s), "session": tr.session, "true": true,
                        "pred": noise_predictions(true, cfg.strong_level, seed=_sub(s, 1)),
                        "pred_weak": noise_predictions(true, cfg.weak_level, seed=_sub(s, 2))}))
                    # calibration: other requests of the same law (disjoint draws)
                    cal_true = wcfg.output.sample(_sub(s, 3), cfg.calibration_size).astype(float)
                    cals.append(pl.DataFrame({
                        "seed": np.full(cfg.calibration_size, s),
                        "residual": cal_true - noise_predictions(cal_true, cfg.strong_level,
                                                                 seed=_sub(s, 4)),
                        "residual_weak": cal_true - noise_predictions(cal_true, cfg.weak_level,
                                                                      seed=_sub(s, 5))}))
                unit = base
            else:
                table = read_parquet_checked(ctx.path(cfg.predictor_samples), samples_spec())
                test = table.filter(pl.col("split") == "test")
                cal = table.filter(pl.col("split") == "cal")
                if test.height < 2 or cal.height < 1:
                    raise ValueError(f"{ctx.path(cfg.predictor_samples)}: needs test and cal "
                                     f"rows, has {test.height} and {cal.height}")
                p_tok = test["prompt_tokens"].to_numpy()
                served = np.maximum(1, test["served_length"].to_numpy())
                pred = test["pred"].to_numpy()
                mean_prompt, mean_out = float(p_tok.mean()), float(served.mean())
                f = footprint(p_tok, served)
                scale = f / sg_f
                biggest = int((p_tok + served).max())
                bt = cfg.cluster.block_tokens
                caps = [max(_round_up(c * scale, bt), _round_up(biggest, bt)) for c in caps]
                pcap = max(_round_up(pcap * scale, bt), _round_up(int(p_tok.max()), bt))
                manifest.setdefault("own_kv_scale", scale)
                unit = {}
                from stages.serving.workload import Trace, unit_interarrivals
                for s in cfg.seeds:
                    rng = _sub(s, 6)
                    idx = rng.integers(0, test.height, cfg.n_requests)
                    arr = np.cumsum(unit_interarrivals(_sub(s, 7), cfg.n_requests, "poisson", 1.0))
                    unit[s] = Trace.from_columns(
                        source=f"own seed {s}", session=np.arange(cfg.n_requests),
                        round=np.zeros(cfg.n_requests), arrival_s=arr,
                        input_tokens=np.maximum(1, p_tok[idx]), output_tokens=served[idx],
                        tool_gap_s=np.zeros(cfg.n_requests))
                    preds.append(pl.DataFrame({
                        "seed": np.full(cfg.n_requests, s), "session": np.arange(cfg.n_requests),
                        "true": served[idx].astype(np.float64), "pred": pred[idx],
                        "test_row": idx}))
                    cal_res = (np.maximum(1, cal["served_length"].to_numpy())
                               - cal["pred"].to_numpy())
                    cals.append(pl.DataFrame({"seed": np.full(len(cal_res), s),
                                              "residual": cal_res.astype(np.float64)}))
            cap_rate = capacity_rate(profile, caps, f, mean_prompt, mean_out,
                                     cfg.cluster.max_batch_seqs)
            rates = [f * cap_rate for f in cfg.load_factors]
            for s in cfg.seeds:
                tr = unit[s]
                for i, r in enumerate(rates):
                    write_trace(_scaled(tr, r), folder / f"seed{s}_rate{i}.parquet")
            io.write_parquet(folder / "pred.parquet", pl.concat(preds))
            io.write_parquet(folder / "calibration.parquet", pl.concat(cals))
            manifest["workloads"][wl] = {
                "rates": rates, "capacity_rate": cap_rate, "decode_kv_tokens": caps,
                "prefill_kv_tokens": pcap, "mean_prompt": mean_prompt, "mean_output": mean_out,
                "kv_footprint": f}
            metrics.update({f"{wl}/capacity_rate": cap_rate, f"{wl}/kv_footprint": f,
                            f"{wl}/mean_prompt": mean_prompt,
                            f"{wl}/mean_output": mean_out,
                            **{f"{wl}/decode{k}_kv_tokens": float(c) for k, c in enumerate(caps)}})
            allp = pl.concat(preds)
            t, p = allp["true"].to_numpy(), allp["pred"].to_numpy()
            metrics[f"{wl}/pred_mae"] = float(np.mean(np.abs(p - t)))
            metrics[f"{wl}/pred_acc_100"] = float(np.mean(np.abs(p - t) <= 100))
            if "pred_weak" in allp.columns:
                pw = allp["pred_weak"].to_numpy()
                metrics[f"{wl}/pred_weak_mae"] = float(np.mean(np.abs(pw - t)))
                metrics[f"{wl}/pred_weak_acc_100"] = float(np.mean(np.abs(pw - t) <= 100))
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    metrics["profile_is_measured"] = float(cfg.cluster.latency_profile == "measured")
    return metrics


def _scaled(tr, rate: float):
    """The unit-rate trace at `rate` (arrivals / rate; everything else identical)."""
    from stages.serving.workload import Trace

    return Trace(session=tr.session, round=tr.round, arrival_s=tr.arrival_s / rate,
                 input_tokens=tr.input_tokens, output_tokens=tr.output_tokens,
                 tool_gap_s=tr.tool_gap_s)


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: whether the latency profile was measured here; per workload in details."""
    return {k: metrics[k] for k in ("profile_is_measured",) if k in metrics}
