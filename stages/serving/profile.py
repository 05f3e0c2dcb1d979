"""Stage `profile_engine`: measure the tiny model's prefill and decode times; fit the latency model.

The serving simulator charges every prefill and decode iteration a time from a linear model
whose constants are measured here, on this machine, not invented:

    prefill of B prompts of lengths l_i:   T = s0 + a * sum(l_i) + b * sum(l_i^2)
    one decode step, B rows, C ctx tokens: T = s0 + c * B + d * C
    KV hand-off of n bytes:                T = s0 + n / bandwidth

The prefill form is DistServe's profiler model (Zhong et al., OSDI'24; its A100 JSON stores
(a, b, c) of `a + b*sum(L) + c*sum(L^2)`); the decode form is the per-iteration linear model of
Vidur (Agrawal et al., MLSys'24) and DistServe (a cost per sequence for the linear layers, a cost
per context token for attention over the KV cache). AMPD (arXiv 2602.14516, §2 "offline
profiler") fits the same alpha-beta forms by least squares; it splits them piecewise over token
ranges, which one tiny model over <= 256 positions does not need.

How it measures: the project's base model (a `save_pretrained` folder, loaded offline) runs
through `stages.serving.engine.Engine`, the same prefill/decode functions the real server of
check 2 runs (`stages.serving.server`), with the KV cache on. Prefill: every (prompt length,
batch) of the grid, equal-length random prompts. Decode: every (batch, context length), one step
on a prefilled batch, which `Engine.restore` rewinds between repeats. Transfer: a copy of that
batch's whole KV cache (what moving it between two engines in one host costs; a simulated
cluster link overrides it by param). `warmup` untimed rounds, then `repeats` timed rounds,
each running every point once in a fresh random order; a point's time is its median over the
rounds, so a slow spell of this shared 2-core machine lands on one round of many points rather
than bending one end of a curve.

The fit: least squares with non-negative coefficients (a negative cost per token is noise, and
extrapolates to negative times), weighted by 1/T so it minimises relative error: times span
~30x, and an unweighted fit lets the largest batches set the constants while the short prefills
most requests see go tens of percent off. Reported per form: MAPE and R^2.

    python -m stages <pipeline> profile_engine   # writes <paths[out]>: the LatencyProfile JSON
"""

from __future__ import annotations

import itertools
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.core import io
from stages.serving.latency import LatencyProfile  # the contract: what this stage writes



# Durations returned here are results (simulated or the measurement this stage exists to make),
# not this machine's wall time: only `*seconds`/`wall_*` keys are kept out of DVC
# (stages/core/io.py `is_timing_key`).
TIMES_ARE_RESULTS = True

class Config(BaseModel):
    """Defaults are the smoke sizes (seconds). Suggested `cpu`: prompt_lengths [8, 16, 32, 48,
    64, 96, 128, 160, 192, 224], prefill_batches [1, 2, 4, 8], decode_batches [1, 2, 4, 8, 16,
    32, 64], context_lengths [16, 32, 64, 96, 128, 192], repeats 15, warmup 3 (about a minute)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("base_model", description="paths key of the save_pretrained folder measured")
    out: str = Field("serving_profile", description="paths key of the profile JSON written")
    timings: str | None = Field(None, description="paths key of a parquet of every measured "
                                "point with its fitted time (for plots); None: not written")
    name: str = Field("tiny-cpu", min_length=1, description="profile name, as the simulator's "
                      "`profile` param refers to it")
    prompt_lengths: list[int] = Field([8, 32, 64, 128], description="prefill grid: tokens per "
                                      "prompt (>= 3 distinct: three constants to fit)")
    prefill_batches: list[int] = Field([1, 2, 4], description="prefill grid: prompts per batch")
    decode_batches: list[int] = Field([1, 4, 16], description="decode grid: running sequences "
                                      "B (>= 2 distinct)")
    context_lengths: list[int] = Field([16, 64, 128], description="decode grid: context tokens "
                                       "per sequence (>= 2 distinct); C = B * this")
    repeats: int = Field(5, ge=3, le=1000, description="timed runs per point (median kept)")
    warmup: int = Field(2, ge=0, le=100, description="untimed runs before each point")
    num_threads: int = Field(1, ge=0, le=256, description="torch threads; 1 = as the real "
                             "server's engine thread runs (the other core serves HTTP); 0 = all")
    kv_block_tokens: int = Field(16, ge=1, le=4096, description="tokens per KV block in the "
                                 "simulator's block pool (vLLM's default)")
    register_as: str | None = Field("serving-profile", description="MLflow registered model "
                                    "the profile JSON becomes a version of, with the run that "
                                    "measured it; None: not registered")
    link_bytes_per_s: float | None = Field(None, gt=0, description="KV link bandwidth; None: "
                                           "measured as a same-host copy of the KV cache")
    transfer_s0: float | None = Field(None, ge=0, description="KV transfer fixed cost, s; None: "
                                      "measured with the bandwidth")

    @field_validator("prompt_lengths", "prefill_batches", "decode_batches", "context_lengths")
    @classmethod
    def _grid(cls, values: list[int], info: Any) -> list[int]:
        if not values or min(values) < 1:
            raise ValueError(f"{info.field_name} = {values}: expected a non-empty list of "
                             "integers >= 1")
        return sorted(set(values))

    @model_validator(mode="after")
    def _enough_points(self) -> "Config":
        if len(self.prompt_lengths) < 3:
            raise ValueError(f"prompt_lengths = {self.prompt_lengths}: need >= 3 distinct lengths "
                             "(equal-length batches make sum(l^2) = l * sum(l): fewer lengths "
                             "cannot separate a, b and s0)")
        for key in ("decode_batches", "context_lengths"):
            if len(getattr(self, key)) < 2:
                raise ValueError(f"{key} = {getattr(self, key)}: need >= 2 distinct values to "
                                 "separate the per-sequence and per-context-token costs")
        if (self.link_bytes_per_s is None) != (self.transfer_s0 is None):
            raise ValueError("link_bytes_per_s and transfer_s0: give both (a simulated link) or "
                             "neither (measured)")
        return self


# --- the math: small pure functions (numpy) ------------------------------------------------------

def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """KV cache bytes one token occupies: 2 (K and V) * layers * kv_heads * head_dim * bytes."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def nonneg_lstsq(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """argmin_{beta >= 0} sum_i w_i^2 (x_i . beta - y_i)^2, exactly, for a few columns.

    The optimum of a non-negative least-squares problem is the unconstrained optimum on its set
    of positive coefficients; with <= 3 columns all 7 candidate sets are tried, and the best
    feasible one kept (no scipy needed, and the answer is exact, not iterative)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    w = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=float)
    xw, yw = x * w[:, None], y * w
    best, best_loss = np.zeros(x.shape[1]), float(np.sum(yw ** 2))
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            sol = np.linalg.lstsq(xw[:, cols], yw, rcond=None)[0]
            if np.any(sol < 0):
                continue
            beta = np.zeros(x.shape[1])
            beta[list(cols)] = sol
            loss = float(np.sum((xw @ beta - yw) ** 2))
            if loss < best_loss - 1e-18:
                best, best_loss = beta, loss
    return best


def fit_stats(pred: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """MAPE (mean |pred - y| / y) and R^2 (1 - SS_res / SS_tot) of a fitted form."""
    pred, y = np.asarray(pred, dtype=float), np.asarray(y, dtype=float)
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((pred - y) ** 2)) / ss_tot if ss_tot > 0 else float("nan")
    return {"mape": float(np.mean(np.abs(pred - y) / y)), "r2": r2}


def _fit(columns: Sequence[np.ndarray], seconds: Sequence[float],
         relative: bool = True) -> tuple[np.ndarray, dict]:
    y = np.asarray(seconds, dtype=float)
    if np.any(y <= 0):
        raise ValueError("timings must be > 0 s")
    x = np.column_stack([np.ones(len(y)), *[np.asarray(c, dtype=float) for c in columns]])
    # relative error (1/T weights): see module docstring; unweighted for raw noisy logs
    coef = nonneg_lstsq(x, y, weights=1.0 / y if relative else None)
    return coef, fit_stats(x @ coef, y)


def fit_prefill(sum_l: Sequence[float], sum_l2: Sequence[float], seconds: Sequence[float],
                relative: bool = True) -> tuple[np.ndarray, dict[str, float]]:
    """(s0, a, b) of T = s0 + a*sum(l) + b*sum(l^2) (DistServe, OSDI'24) and its fit errors."""
    return _fit([sum_l, sum_l2], seconds, relative)


def fit_decode(batch: Sequence[float], ctx_tokens: Sequence[float], seconds: Sequence[float],
               relative: bool = True) -> tuple[np.ndarray, dict[str, float]]:
    """(s0, c, d) of T = s0 + c*B + d*C (Vidur, MLSys'24; DistServe) and its fit errors."""
    return _fit([batch, ctx_tokens], seconds, relative)


def fit_transfer(n_bytes: Sequence[float],
                 seconds: Sequence[float]) -> tuple[np.ndarray, dict[str, float]]:
    """(s0, 1/bandwidth) of T = s0 + bytes / bandwidth and its fit errors."""
    return _fit([n_bytes], seconds)


# --- measurement ---------------------------------------------------------------------------------

def measure(model: Any, tokenizer: Any, cfg: Config, seed: int = 0) -> list[dict[str, float]]:
    """Every grid point's median time: rows of kind (prefill | decode | transfer) and inputs.

    Repeats are interleaved: round r runs every point once, in a fresh random order, and a
    point's time is the median over rounds. On a shared machine a slow spell then lands on one
    round of many points instead of on every repeat of a few (measured here: back-to-back
    repeats put single points 3x off the curve). The price: every decode point's prefilled
    batch is held at once (sum over the grid of B * l * kv_bytes_per_token; ~0.3 GB for the
    suggested cpu grid of the 1M-param base model)."""
    import torch

    from stages.serving.engine import Engine

    engine = Engine(model, pad_id=tokenizer.pad_token_id)
    longest = max(max(cfg.prompt_lengths), max(cfg.context_lengths) + 1)  # + the decoded token
    if longest > engine.max_positions:
        raise ValueError(f"profile_engine: prompt_lengths / context_lengths reach {longest} "
                         f"positions; the model has {engine.max_positions} "
                         "(max_position_embeddings)")
    rng = np.random.default_rng(seed)
    specials = set(tokenizer.all_special_ids)
    vocab = np.array([i for i in range(len(tokenizer)) if i not in specials])

    def prompts(batch: int, length: int) -> list[list[int]]:
        return rng.choice(vocab, size=(batch, length)).tolist()

    # (row, timed fn, untimed fn after it); rows carry the form's inputs.
    points: list[tuple[dict[str, float], Callable[[], Any], Callable[[], Any] | None]] = []
    for n in cfg.prompt_lengths:
        for b in cfg.prefill_batches:
            ps = prompts(b, n)
            points.append(({"kind": "prefill", "batch": b, "length": n, "sum_l": b * n,
                            "sum_l2": b * n * n, "ctx_tokens": 0, "bytes": 0},
                           lambda ps=ps: engine.prefill(ps), None))
    for n in cfg.context_lengths:
        for b in cfg.decode_batches:
            batch, _ = engine.prefill(prompts(b, n))
            snap = Engine.snapshot(batch)
            points.append(({"kind": "decode", "batch": b, "length": n, "sum_l": 0, "sum_l2": 0,
                            "ctx_tokens": batch.context_tokens, "bytes": 0},
                           lambda batch=batch: engine.decode(batch),
                           lambda batch=batch, snap=snap: Engine.restore(batch, snap)))
            tensors = [x for kv in batch.kv_tensors() for x in kv]
            points.append(({"kind": "transfer", "batch": b, "length": n, "sum_l": 0, "sum_l2": 0,
                            "ctx_tokens": batch.context_tokens,
                            "bytes": sum(x.numel() * x.element_size() for x in tensors)},
                           lambda tensors=tensors: [x.clone() for x in tensors], None))

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    times: list[list[float]] = [[] for _ in points]
    for rnd in range(cfg.warmup + cfg.repeats):
        for i in rng.permutation(len(points)):
            _, fn, after = points[i]
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if rnd >= cfg.warmup:
                times[i].append(time.perf_counter() - t0)
            if after is not None:
                after()
    rows = []
    for (row, _, _), ts in zip(points, times):
        q1, med, q3 = np.quantile(ts, [0.25, 0.5, 0.75])
        rows.append({**row, "seconds": float(med), "iqr_seconds": float(q3 - q1)})
    return rows


def fit_profile(rows: list[dict[str, float]], cfg: Config, kv_bytes: int,
                source: str) -> tuple[dict[str, Any], list[float]]:
    """The LatencyProfile dict from measured rows, and each row's fitted time (same order)."""
    by = {k: [r for r in rows if r["kind"] == k] for k in ("prefill", "decode", "transfer")}
    pre, pre_fit = fit_prefill([r["sum_l"] for r in by["prefill"]],
                               [r["sum_l2"] for r in by["prefill"]],
                               [r["seconds"] for r in by["prefill"]])
    dec, dec_fit = fit_decode([r["batch"] for r in by["decode"]],
                              [r["ctx_tokens"] for r in by["decode"]],
                              [r["seconds"] for r in by["decode"]])
    tra, tra_fit = fit_transfer([r["bytes"] for r in by["transfer"]],
                                [r["seconds"] for r in by["transfer"]])
    if cfg.link_bytes_per_s is not None:
        transfer_s0, bandwidth = float(cfg.transfer_s0 or 0.0), cfg.link_bytes_per_s
    else:
        # A copy too fast to resolve leaves 1/bandwidth at 0: keep it finite (~1 TB/s cap).
        transfer_s0, bandwidth = float(tra[0]), 1.0 / max(float(tra[1]), 1e-12)
    fit = {f"{form}_{stat}": value for form, stats in
           (("prefill", pre_fit), ("decode", dec_fit), ("transfer", tra_fit))
           for stat, value in stats.items()}
    fit.update(prefill_points=float(len(by["prefill"])), decode_points=float(len(by["decode"])))
    profile = LatencyProfile(
        name=cfg.name, source=source,
        prefill_s0=float(pre[0]), prefill_s_per_token=float(pre[1]),
        prefill_s_per_token2=float(pre[2]),
        decode_s0=float(dec[0]), decode_s_per_seq=float(dec[1]),
        decode_s_per_ctx_token=float(dec[2]),
        kv_bytes_per_token=kv_bytes, kv_block_tokens=cfg.kv_block_tokens,
        transfer_s0=transfer_s0, link_bytes_per_s=float(bandwidth), fit=fit)
    fitted = []
    for r in rows:
        if r["kind"] == "prefill":
            fitted.append(float(pre[0] + pre[1] * r["sum_l"] + pre[2] * r["sum_l2"]))
        elif r["kind"] == "decode":
            fitted.append(float(dec[0] + dec[1] * r["batch"] + dec[2] * r["ctx_tokens"]))
        else:
            fitted.append(float(tra[0] + tra[1] * r["bytes"]))
    return profile.model_dump(), fitted


def fit_iterations(iterations: Sequence[dict[str, float]], like: dict[str, Any],
                   name: str | None = None) -> dict[str, Any]:
    """The prefill and decode forms refitted on a server's own iteration log (GET /iterations
    of `stages.serving.server`: kind, batch, sum_l, sum_l2, ctx_tokens, seconds); the other
    fields are copied from the profile `like`.

    What it is for (check 2): replaying a trace with this profile instead of the measured one
    separates the simulator's scheduling error from the latency model's error. On this shared
    machine the server's iterations ran ~1.7x the profile's prediction under load while a
    one-request-at-a-time A/B gave equal step times, i.e. the gap was CPU contention (driver,
    other tenants), not the engine.

    Unweighted least squares here, unlike the profile's relative-error fit: a server log is one
    noisy sample per iteration (no medians), and what queueing sees is the SUM of iteration
    times, which an unweighted fit with an intercept preserves; 1/T weights shrink the high
    outliers' say and biased a 500-iteration log ~40% low (decode R^2 < 0)."""
    pre = [r for r in iterations if r["kind"] == "prefill"]
    dec = [r for r in iterations if r["kind"] == "decode"]
    if len({r["sum_l"] for r in pre}) < 3 or len({r["batch"] for r in dec}) < 2:
        raise ValueError(f"fit_iterations: {len(pre)} prefill / {len(dec)} decode iterations "
                         "with too few distinct sizes (need >= 3 prompt-token totals and >= 2 "
                         "batch sizes)")
    p, p_fit = fit_prefill([r["sum_l"] for r in pre], [r["sum_l2"] for r in pre],
                           [r["seconds"] for r in pre], relative=False)
    d, d_fit = fit_decode([r["batch"] for r in dec], [r["ctx_tokens"] for r in dec],
                          [r["seconds"] for r in dec], relative=False)
    fit = {f"{form}_{stat}": value for form, stats in (("prefill", p_fit), ("decode", d_fit))
           for stat, value in stats.items()}
    fit.update(prefill_points=float(len(pre)), decode_points=float(len(dec)))
    return LatencyProfile(**{
        **like, "name": name or f"{like['name']}-server-log",
        "source": f"refitted on {len(pre) + len(dec)} iterations of the serving server's log; "
                  f"other fields from {like['name']}",
        "prefill_s0": float(p[0]), "prefill_s_per_token": float(p[1]),
        "prefill_s_per_token2": float(p[2]), "decode_s0": float(d[0]),
        "decode_s_per_seq": float(d[1]), "decode_s_per_ctx_token": float(d[2]),
        "fit": fit}).model_dump()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(model: Any, cfg: Config) -> str:
    """Where the constants come from: the `source` field of the profile."""
    import torch

    device = next(model.parameters()).device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{_cpu_name()} ({len(os.sched_getaffinity(0))} cores)"
    n_params = sum(p.numel() for p in model.parameters())
    return (f"measured by stage profile_engine: {n_params / 1e6:.2f}M-param "
            f"{model.config.model_type} through transformers {_version('transformers')} / torch "
            f"{torch.__version__} on {where}, {torch.get_num_threads()} thread(s), median of "
            f"{cfg.repeats}; forms of DistServe (OSDI'24) and Vidur (MLSys'24)")


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def profile_engine(model: Any, tokenizer: Any, cfg: Config, seed: int = 0) -> dict[str, Any]:
    """Measure `model` (eval mode) on the grids of `cfg` and return the LatencyProfile dict."""
    profile, _ = _measure_and_fit(model, tokenizer, cfg, seed)
    return profile


def _measure_and_fit(model: Any, tokenizer: Any, cfg: Config,
                     seed: int) -> tuple[dict[str, Any], list[dict[str, float]]]:
    dtype_bytes = next(model.parameters()).element_size()
    rows = measure(model, tokenizer, cfg, seed)
    profile, fitted = fit_profile(rows, cfg, kv_bytes_per_token(model.config, dtype_bytes),
                                  describe(model, cfg))
    for r, f in zip(rows, fitted):
        r["fitted_seconds"] = f
    return profile, rows


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.models.base import set_threads
    from stages.models.generate import load_model

    threads = set_threads(cfg.num_threads)
    model, tokenizer = load_model(ctx.path(cfg.model))
    started = time.perf_counter()
    profile, rows = _measure_and_fit(model, tokenizer, cfg, ctx.seed)
    seconds = time.perf_counter() - started
    io.write_json(ctx.path(cfg.out), profile)
    if cfg.timings is not None:
        io.write_parquet(ctx.path(cfg.timings), pl.DataFrame(rows))
    ctx.log_params({"threads": threads, "points": len(rows)})
    if cfg.register_as and ctx.tracker is not None:
        # the JSON itself is the artefact: `models:/serving-profile@champion` downloads a folder
        # holding profile.json, which load_profile reads; the fit errors ride along as tags
        ctx.tracker.register_model(
            ctx.path(cfg.out), cfg.register_as, ["champion"], artifact_path="profile",
            tags={"profile.name": profile["name"],
                  **{f"fit.{k}": f"{v:.4g}" for k, v in profile["fit"].items()}})
    print(f"profile_engine: {len(rows)} points in {seconds:.1f} s; prefill "
          f"{profile['prefill_s0'] * 1e3:.2f} ms + {profile['prefill_s_per_token'] * 1e6:.1f} us/tok "
          f"(MAPE {profile['fit']['prefill_mape']:.1%}), decode {profile['decode_s0'] * 1e3:.2f} ms "
          f"+ {profile['decode_s_per_seq'] * 1e6:.1f} us/seq + "
          f"{profile['decode_s_per_ctx_token'] * 1e9:.0f} ns/ctx tok "
          f"(MAPE {profile['fit']['decode_mape']:.1%})")
    metrics = {k: float(v) for k, v in profile.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    metrics.update({f"fit/{k}": v for k, v in profile["fit"].items()})
    metrics["measure_seconds"] = seconds
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: how well the linear forms fit the measurements (MAPE of prefill and decode);
    the fitted constants are in data/profile.json and details/profile_engine.json."""
    return {k: metrics[k] for k in ("fit/prefill_mape", "fit/decode_mape") if k in metrics}
