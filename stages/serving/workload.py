"""Workloads for the serving simulator: arrivals, length pairs, multi-round sessions, trace files.

A trace is a table with one row per round of a session:

    session  round  arrival_s  input_tokens  output_tokens  tool_gap_s
    0        0      0.731      1480          212            0.84      <- first round: the prompt
    0        1      0.731      377           95             1.93      <- new input after a tool call
    0        2      0.731      402           160            0.0       <- last round

`arrival_s` is the session's arrival (the same on every row of a session); round k+1 is released
`tool_gap_s[k]` seconds after round k finishes, so its arrival depends on the served latency and
only the simulator knows it. The context of round k+1 is everything before it (all earlier
inputs and outputs) plus its own `input_tokens`. A single-round request is a session of one round.

Generation (`make_trace`), all from numpy Generators seeded by `seed`:
- arrivals: Poisson (i.i.d. Exp inter-arrival times) or bursty (Gamma inter-arrival times with a
  coefficient of variation `cv` > 1; cv = 1 is Poisson again), scaled to `rate` sessions/s;
- lengths: integer lognormal (given median and sigma of the log) or uniform, clipped to [min, max];
  prompt and first output can be correlated in log space (ShareGPT-like pairs);
- rounds per session uniform in [rounds_min, rounds_max]; tool gaps Exp(mean).

Common random numbers: each quantity has its own substream of `SeedSequence(seed)`, and
arrivals are unit-rate draws divided by `rate`. So for one seed every arm, and every rate, sees
the same sessions with the same lengths; a rate sweep only compresses time. The policy never
touches these streams.

Not modelled: diurnal patterns, request cancellation, prefix sharing between sessions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io
from stages.core.checks import DataValidationError

COLUMNS = ("session", "round", "arrival_s", "input_tokens", "output_tokens", "tool_gap_s")


@dataclass(frozen=True)
class Trace:
    """One row per round (module docstring). Arrays of equal length, rows sorted by
    (arrival_s, session, round)."""

    session: np.ndarray        # int64
    round: np.ndarray          # int64, 0..R-1 within a session
    arrival_s: np.ndarray      # float64, the session's arrival
    input_tokens: np.ndarray   # int64 >= 1, new tokens of this round
    output_tokens: np.ndarray  # int64 >= 1, tokens this round generates
    tool_gap_s: np.ndarray     # float64 >= 0, pause after this round before the next

    def __len__(self) -> int:
        return len(self.session)

    @property
    def n_sessions(self) -> int:
        return int(np.unique(self.session).size)

    def to_polars(self):
        import polars as pl

        return pl.DataFrame({c: getattr(self, c) for c in COLUMNS}, schema=TRACE_SCHEMA())

    @classmethod
    def from_columns(cls, source: str = "<trace>", **cols) -> "Trace":
        """Build from array-likes, sort the rows, and check the semantic rules (check_rows)."""
        arrays = {
            "session": np.asarray(cols["session"], dtype=np.int64),
            "round": np.asarray(cols["round"], dtype=np.int64),
            "arrival_s": np.asarray(cols["arrival_s"], dtype=np.float64),
            "input_tokens": np.asarray(cols["input_tokens"], dtype=np.int64),
            "output_tokens": np.asarray(cols["output_tokens"], dtype=np.int64),
            "tool_gap_s": np.asarray(cols["tool_gap_s"], dtype=np.float64),
        }
        check_rows(arrays, source)
        order = np.lexsort((arrays["round"], arrays["session"], arrays["arrival_s"]))
        return cls(**{k: v[order] for k, v in arrays.items()})


def TRACE_SCHEMA():
    import polars as pl

    return {"session": pl.Int64, "round": pl.Int64, "arrival_s": pl.Float64,
            "input_tokens": pl.Int64, "output_tokens": pl.Int64, "tool_gap_s": pl.Float64}


def _fail(source: str, column: str | None, rule: str, detail: str) -> DataValidationError:
    where = f"column {column!r}: " if column else ""
    return DataValidationError(f"{source}: {where}rule {rule!r} failed: {detail}",
                               source=source, column=column, rule=rule)


def check_rows(a: dict[str, np.ndarray], source: str) -> None:
    """The rules a trace obeys beyond types; each failure names the file, column and rule."""
    n = len(a["session"])
    if n == 0:
        raise _fail(source, None, "at least one row", "the trace is empty")
    for c in COLUMNS:
        if len(a[c]) != n:
            raise _fail(source, c, "equal lengths", f"{len(a[c])} values, {n} sessions")
    for c in ("arrival_s", "tool_gap_s"):
        bad = ~np.isfinite(a[c]) | (a[c] < 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise _fail(source, c, "finite and >= 0", f"row {i} has {a[c][i]!r}")
    for c in ("input_tokens", "output_tokens"):
        if (a[c] < 1).any():
            i = int(np.argmax(a[c] < 1))
            raise _fail(source, c, ">= 1 token", f"row {i} has {a[c][i]}")
    if (a["round"] < 0).any():
        raise _fail(source, "round", ">= 0", f"row {int(np.argmax(a['round'] < 0))}")
    order = np.lexsort((a["round"], a["session"]))
    s, r, t = a["session"][order], a["round"][order], a["arrival_s"][order]
    first = np.r_[True, s[1:] != s[:-1]]
    # rounds of a session are 0, 1, ..., R-1: each row is 0 at a session start, else previous + 1
    expected = np.where(first, 0, np.r_[0, r[:-1] + 1])
    if (r != expected).any():
        i = int(np.argmax(r != expected))
        raise _fail(source, "round", "rounds 0..R-1 once each per session",
                    f"session {s[i]} has round {r[i]} where {expected[i]} was expected")
    same = ~first
    if (t[same] != t[np.flatnonzero(same) - 1]).any():
        i = int(np.flatnonzero(same)[np.argmax(t[same] != t[np.flatnonzero(same) - 1])])
        raise _fail(source, "arrival_s", "one arrival per session",
                    f"session {s[i]} has arrivals {t[i - 1]} and {t[i]}")


# --- files ----------------------------------------------------------------------------------------


def write_trace(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Parquet, atomically."""
    return io.write_parquet(path, trace.to_polars())


def trace_spec():
    from stages.core.checks import ColumnSpec, FrameSpec

    schema = TRACE_SCHEMA()
    mins = {"session": 0, "round": 0, "arrival_s": 0.0, "input_tokens": 1, "output_tokens": 1,
            "tool_gap_s": 0.0}
    return FrameSpec(columns={c: ColumnSpec(dtype=schema[c], min=mins[c]) for c in COLUMNS})


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a trace file through the checked loader, then the semantic rules (check_rows). A
    malformed trace is a DataValidationError naming the file, the column and the rule."""
    from stages.core.checks import read_parquet_checked

    df = read_parquet_checked(path, trace_spec())
    return Trace.from_columns(source=str(path), **{c: df[c].to_numpy() for c in COLUMNS})


# --- generation -----------------------------------------------------------------------------------


class LengthDist(BaseModel):
    """Integer token lengths: lognormal with this median and log-sigma, or uniform; clipped."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["lognormal", "uniform"] = "lognormal"
    median: float = Field(100.0, gt=0, description="lognormal: median tokens (exp of mu)")
    sigma: float = Field(1.0, ge=0, description="lognormal: std of log length")
    min: int = Field(1, ge=1, description="smallest length (uniform: lower end)")
    max: int = Field(4096, ge=1, description="largest length (uniform: upper end)")

    @model_validator(mode="after")
    def _order(self) -> "LengthDist":
        if self.max < self.min:
            raise ValueError(f"max = {self.max} < min = {self.min}")
        return self

    def sample(self, rng: np.random.Generator, n: int, z: np.ndarray | None = None) -> np.ndarray:
        """n lengths; `z` (standard normals) may be passed to correlate two lengths."""
        if self.kind == "uniform":
            return rng.integers(self.min, self.max + 1, size=n)
        if z is None:
            z = rng.standard_normal(n)
        raw = np.rint(self.median * np.exp(self.sigma * z))
        return np.clip(raw, self.min, self.max).astype(np.int64)


class WorkloadConfig(BaseModel):
    """A synthetic workload (module docstring). Defaults: single-round, Poisson."""

    model_config = ConfigDict(extra="forbid")
    sessions: int = Field(1000, ge=1, description="sessions (requests when single-round)")
    rate: float = Field(1.0, gt=0, description="session arrival rate (sessions/s)")
    arrival: Literal["poisson", "gamma"] = Field("poisson", description="inter-arrival law")
    cv: float = Field(1.0, gt=0, description="gamma: coefficient of variation of inter-arrival "
                                             "times (bursty: 3-4); poisson: must be 1")
    rounds_min: int = Field(1, ge=1, description="fewest rounds per session")
    rounds_max: int = Field(1, ge=1, description="most rounds per session")
    prompt: LengthDist = Field(default_factory=LengthDist, description="first-round input")
    increment: LengthDist = Field(default_factory=LengthDist,
                                  description="input of rounds >= 1 (tool output, retrieval)")
    output: LengthDist = Field(default_factory=LengthDist, description="output per round")
    log_corr: float = Field(0.0, ge=-1, le=1, description="correlation of log prompt and log "
                                                          "first output (lognormal only)")
    tool_gap_mean_s: float = Field(1.0, ge=0, description="mean Exp tool gap between rounds")

    @model_validator(mode="after")
    def _check(self) -> "WorkloadConfig":
        if self.rounds_max < self.rounds_min:
            raise ValueError(f"rounds_max = {self.rounds_max} < rounds_min = {self.rounds_min}")
        if self.arrival == "poisson" and self.cv != 1.0:
            raise ValueError(f"cv = {self.cv} is for arrival: gamma (Poisson has cv 1)")
        return self


def unit_interarrivals(rng: np.random.Generator, n: int, arrival: str, cv: float) -> np.ndarray:
    """n inter-arrival times with mean 1: Exp(1), or Gamma(shape 1/cv^2, scale cv^2)."""
    if arrival == "poisson":
        return rng.exponential(1.0, n)
    shape = 1.0 / cv**2
    return rng.gamma(shape, 1.0 / shape, n)


def make_trace(cfg: WorkloadConfig, seed: int) -> Trace:
    """The workload of `cfg` for one seed (common random numbers: module docstring)."""
    s_arr, s_rounds, s_prompt, s_out, s_incr, s_gap = (
        np.random.default_rng(c) for c in np.random.SeedSequence(seed).spawn(6))
    n = cfg.sessions
    arrivals = np.cumsum(unit_interarrivals(s_arr, n, cfg.arrival, cfg.cv)) / cfg.rate
    rounds = s_rounds.integers(cfg.rounds_min, cfg.rounds_max + 1, size=n)
    total = int(rounds.sum())
    # correlated first round: z_out = rho z_prompt + sqrt(1 - rho^2) e
    z_p = s_prompt.standard_normal(n)
    z_o = cfg.log_corr * z_p + np.sqrt(1 - cfg.log_corr**2) * s_out.standard_normal(n)
    prompt = cfg.prompt.sample(s_prompt, n, z_p)
    first_out = cfg.output.sample(s_out, n, z_o)
    # later rounds, drawn for the worst case so a session's lengths do not depend on rounds_max
    # of the others: one block of (rounds_max - 1) draws per session
    k = cfg.rounds_max - 1
    incr = cfg.increment.sample(s_incr, n * k).reshape(n, k) if k else np.zeros((n, 0), np.int64)
    more_out = cfg.output.sample(s_out, n * k).reshape(n, k) if k else np.zeros((n, 0), np.int64)
    gaps = s_gap.exponential(cfg.tool_gap_mean_s, (n, max(k, 1))) if cfg.tool_gap_mean_s else \
        np.zeros((n, max(k, 1)))

    session = np.repeat(np.arange(n), rounds)
    rnd = np.arange(total) - np.repeat(np.cumsum(rounds) - rounds, rounds)
    later = rnd > 0
    inp = np.where(later, incr[session, np.maximum(rnd - 1, 0)] if k else 0, prompt[session])
    out = np.where(later, more_out[session, np.maximum(rnd - 1, 0)] if k else 0,
                   first_out[session])
    last = rnd == rounds[session] - 1
    gap = np.where(last, 0.0, gaps[session, np.minimum(rnd, gaps.shape[1] - 1)])
    return Trace.from_columns(source=f"make_trace(seed={seed})", session=session, round=rnd,
                              arrival_s=arrivals[session], input_tokens=inp, output_tokens=out,
                              tool_gap_s=gap)


def sharegpt_like(sessions: int, rate: float, *, bursty_cv: float | None = None) -> WorkloadConfig:
    """Single-round chat requests with ShareGPT-like length pairs.

    [reconstructed] Means near those the vLLM paper (Kwon et al., SOSP'23, sec. 6.1) reports for
    ShareGPT, about 160 input and 340 output tokens; the lognormal shape, the sigmas, the
    clipping and the weak positive correlation of log lengths are choices made here, not fitted
    to the dataset. `bursty_cv` switches to Gamma inter-arrivals with that CV."""
    return WorkloadConfig(
        sessions=sessions, rate=rate,
        arrival="gamma" if bursty_cv else "poisson", cv=bursty_cv or 1.0,
        prompt=LengthDist(median=100, sigma=1.0, min=4, max=2048),     # mean ~ 100 e^0.5 = 165
        output=LengthDist(median=250, sigma=0.8, min=4, max=2048),     # mean ~ 250 e^0.32 = 344
        log_corr=0.2)


def agentic_sessions(sessions: int, rate: float, *, rounds_min: int = 3,
                     rounds_max: int = 8) -> WorkloadConfig:
    """Multi-round agent sessions in the shape AMPD (arXiv 2602.14516) evaluates: ToolBench-like
    3-8 rounds (RAG: 3 and 3), prompt lognormal with median 1.5k tokens, incremental input
    lognormal with median 400 and a tail to 4k, output 50-300 tokens per round, tool gap
    Exp(mean 1 s). [reconstructed] the sigmas are choices made here."""
    return WorkloadConfig(
        sessions=sessions, rate=rate, rounds_min=rounds_min, rounds_max=rounds_max,
        prompt=LengthDist(median=1500, sigma=0.6, min=64, max=8192),
        increment=LengthDist(median=400, sigma=0.8, min=16, max=4096),
        output=LengthDist(kind="uniform", min=50, max=300),
        tool_gap_mean_s=1.0)
