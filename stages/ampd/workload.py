"""Stage `workload`: the latency profiles, the SLOs, the session-rate grid and one multi-round
agentic trace per (seed, rate).

Sessions follow the spec's agent workload (`stages.serving.workload.agentic_sessions`: Poisson
sessions of 3-8 rounds, first prompt lognormal with median 1.5k tokens, increments median 400
with a tail to 4k, 50-300 output tokens per round, tool gaps Exp(1 s)). The paper's token counts
are kept for every latency profile; what changes with the profile is how fast a GPU serves them.
So the rate grid is not a list of sessions/s but of LOADS, fractions of the reference cluster's
capacity: the sessions/s that arms a/b/d/e's prefill/decode split serves within the ITL SLO,
computed from the profile and the workload's per-session means (`arms.capacity`). Rates = loads x
capacity, from low load to past saturation, on the measured tiny model and on the A100 alike.

Common random numbers: one trace per (seed, rate), read by every arm; for one seed every rate
holds the same sessions (`make_trace` draws unit-rate arrivals and divides by the rate).

Outputs (`paths.ampd_workload`): traces/seed<s>_load<i>.parquet, profiles/<name>.json (the
profiles every later stage uses, copied so that they read one place), grid.json.
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.core import io
from stages.core.checks import DataValidationError
from stages.core.context import Context
from stages.serving.latency import (PROFILES_DIR, LatencyProfile, ProfileError, load_profile,
                                    save_profile)
from stages.serving.workload import (LengthDist, WorkloadConfig, agentic_sessions, make_trace,
                                     write_trace)

from .arms import SLO, ClusterParams, WorkloadShape, capacity, strategies

MEASURED = "measured"   # the profile stage `profile_engine` of pipeline `serving` measured


def _known_profile(name: str) -> str:
    shipped = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
    if name != MEASURED and name not in shipped:
        raise ValueError(f"unknown latency profile {name!r}: `{MEASURED}` or one of "
                         f"{', '.join(shipped)}")
    return name


class TPProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gpus: int = Field(ge=1, le=64, description="GPUs per replica (the TP degree)")
    profile: str = Field(min_length=1, description="`measured` or a shipped profile name")

    @field_validator("profile")
    @classmethod
    def _name(cls, v: str) -> str:
        return _known_profile(v)



# Durations returned here are results (simulated or the measurement this stage exists to make),
# not this machine's wall time: only `*seconds`/`wall_*` keys are kept out of DVC
# (stages/core/io.py `is_timing_key`).
TIMES_ARE_RESULTS = True

# What planner, simulate and compare read from grid.json (checked at their boundary).
GRID_KEYS = {"seeds": list, "loads": list, "rates": list, "slo": dict, "capacity": dict,
             "shape": dict, "tp_profiles": dict, "traces": dict}

class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    latency_profile: str = Field(MEASURED, min_length=1, description="`measured` (pipeline "
                                 "serving's profile.json) or a shipped profile: a100, ...")
    tp_profiles: dict[str, TPProfile] = Field(
        default_factory=lambda: {"tp1": TPProfile(gpus=1, profile=MEASURED)},
        description="the planner's strategies: name -> GPUs per replica and profile")
    cluster: ClusterParams = Field(default_factory=ClusterParams)
    sessions: int = Field(200, ge=2, le=1_000_000, description="sessions per trace")
    seeds: list[int] = Field(default_factory=lambda: list(range(10)), min_length=1)
    loads: list[float] = Field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0, 1.25, 1.5],
                               min_length=1, description="session rates as fractions of the "
                               "reference cluster's capacity")
    rounds_min: int = Field(3, ge=1)
    rounds_max: int = Field(8, ge=1)
    prompt: LengthDist = Field(default_factory=lambda: agentic_sessions(1, 1.0).prompt)
    increment: LengthDist = Field(default_factory=lambda: agentic_sessions(1, 1.0).increment)
    output: LengthDist = Field(default_factory=lambda: agentic_sessions(1, 1.0).output)
    tool_gap_mean_s: float = Field(1.0, ge=0)
    ttft_factor: float = Field(5.0, gt=0, description="TTFT SLO = this x unloaded prefill of "
                               "the median first prompt")
    itl_factor: float = Field(3.0, gt=0, description="ITL SLO = this x unloaded decode step")
    shape_sessions: int = Field(20_000, ge=100, description="sessions of the large sample the "
                                "per-session means are measured on")
    shape_seed: int = Field(10_007, ge=0, description="its seed (not one of `seeds`)")

    @field_validator("latency_profile")
    @classmethod
    def _profile(cls, v: str) -> str:
        return _known_profile(v)

    @field_validator("loads")
    @classmethod
    def _loads(cls, v: list[float]) -> list[float]:
        if any(not (math.isfinite(x) and x > 0) for x in v):
            raise ValueError(f"loads must be finite and > 0, got {v}")
        if sorted(set(v)) != v:
            raise ValueError(f"loads must be strictly increasing, got {v}")
        return v

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v) or any(s < 0 for s in v):
            raise ValueError(f"seeds must be distinct and >= 0, got {v}")
        return v

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if self.rounds_max < self.rounds_min:
            raise ValueError(f"rounds_max = {self.rounds_max} < rounds_min = {self.rounds_min}")
        if not self.tp_profiles:
            raise ValueError("tp_profiles: at least one planner strategy")
        if self.cluster.prefill_instances >= self.cluster.gpus:
            raise ValueError(f"cluster.prefill_instances = {self.cluster.prefill_instances} "
                             f"leaves no decode instance of {self.cluster.gpus} GPUs")
        return self

    def workload(self, sessions: int, rate: float) -> WorkloadConfig:
        return agentic_sessions(sessions, rate, rounds_min=self.rounds_min,
                                rounds_max=self.rounds_max).model_copy(update=dict(
                                    prompt=self.prompt, increment=self.increment,
                                    output=self.output, tool_gap_mean_s=self.tool_gap_mean_s))


def resolve_profile(name: str, ctx: Context) -> LatencyProfile:
    """`measured` -> pipeline serving's measured profile (paths.serving_profile); else shipped.
    A missing or malformed file is a data error naming the file and the field."""
    where = ctx.path("serving_profile") if name == MEASURED else name
    try:
        return load_profile(where)
    except ProfileError as exc:
        raise DataValidationError(str(exc), source=str(where), rule="latency profile") from None


def trace_name(seed: int, load_index: int) -> str:
    return f"seed{seed}_load{load_index}.parquet"


def run(cfg: Config, ctx: Context) -> dict[str, float]:
    out: Path = ctx.path("ampd_workload")
    # every profile first: a missing or malformed one fails before any trace is drawn
    base = resolve_profile(cfg.latency_profile, ctx)
    tp = {name: (t.gpus, resolve_profile(t.profile, ctx)) for name, t in cfg.tp_profiles.items()}

    shape = WorkloadShape.of(make_trace(cfg.workload(cfg.shape_sessions, 1.0), cfg.shape_seed))
    median_prompt = int(round(cfg.prompt.median if cfg.prompt.kind == "lognormal"
                              else (cfg.prompt.min + cfg.prompt.max) / 2))
    slo = SLO.from_profile(base, median_prompt, cfg.ttft_factor, cfg.itl_factor)
    ref = strategies({"reference": (1, base)}, shape, slo, cfg.cluster.kv_capacity_tokens)[0]
    cap = capacity(ref, shape, cfg.cluster.prefill_instances,
                   cfg.cluster.gpus - cfg.cluster.prefill_instances)
    rates = [load * cap["cluster"] for load in cfg.loads]

    with io.atomic_path(out, is_dir=True) as tmp:
        for name, (_, prof) in {"default": (1, base), **tp}.items():
            save_profile(prof, tmp / "profiles" / f"{name}.json")
        rounds = 0
        for seed in cfg.seeds:
            for i, rate in enumerate(rates):
                trace = make_trace(cfg.workload(cfg.sessions, rate), seed)
                write_trace(trace, tmp / "traces" / trace_name(seed, i))
                rounds += len(trace)
        io.write_json(tmp / "grid.json", {
            "latency_profile": cfg.latency_profile, "profile_name": base.name,
            "tp_profiles": {n: {"gpus": g, "profile": cfg.tp_profiles[n].profile}
                            for n, (g, _) in tp.items()},
            "seeds": cfg.seeds, "loads": cfg.loads, "rates": rates, "capacity": cap,
            "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s, "median_prompt": median_prompt},
            "shape": shape.__dict__, "sessions": cfg.sessions,
            "traces": {f"{s}/{i}": trace_name(s, i) for s in cfg.seeds
                       for i in range(len(rates))}})
    return {"capacity_sessions_per_s": cap["cluster"], "capacity_prefill": cap["prefill"],
            "capacity_decode": cap["decode"], "rate_min": rates[0], "rate_max": rates[-1],
            "slo_ttft_s": slo.ttft_s, "slo_itl_s": slo.itl_s, "traces": len(rates) * len(cfg.seeds),
            "rounds": rounds, "prefill_tokens_per_session": shape.prefill_tokens,
            "decode_tokens_per_session": shape.decode_tokens}


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the cluster's capacity (sessions/s) the rate grid is scaled on, and rounds."""
    return {k: metrics[k] for k in ("capacity_sessions_per_s", "rounds") if k in metrics}
