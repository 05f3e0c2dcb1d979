"""Trajectories on disk: two parquet tables with great-expectations suites, read back checked.

A rollout folder holds

    episodes.parquet   one row per episode: who played what, why it stopped, what it spent
    steps.parquet      one row per turn: prompt, reply, parse outcome, observations, tokens

Two tables because an episode can end before its first turn (a prompt-token budget smaller
than its first prompt) and still has to be counted. `write_rollouts` validates both (the
suites below, then the cross-table rules) before it renames the folder into place;
`read_rollouts` is the only way back in: it runs the same checks, so a stage never trains on a
truncated, hand-edited or inconsistent trajectory. The cross-table rules, which a column suite
cannot state: every step belongs to a listed episode, steps run 0..n-1 with n = the episode's
`steps`, only an episode's last step may be `done` (and then its stop reason is `done`), and
the episode's tokens and failure counts are the sums over its steps.

`summarise(episodes)` gives the numbers a stage reports: success rate, turns, model calls and
tokens per episode, parse failures and invalid actions per turn, and the count of episodes per
stop reason (`stop_<reason>`) and of turns per parse failure reason (`parse_<reason>`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import polars as pl

from stages.agents.protocol import PARSE_REASONS
from stages.agents.rollout import STOP_REASONS, Episode
from stages.core import io
from stages.core.checks import ColumnSpec, DataValidationError, FrameSpec, validate_frame

EPISODE_SCHEMA: dict[str, Any] = {
    "episode_id": pl.String, "env": pl.String, "agent": pl.String, "task": pl.String,
    "stop_reason": pl.String, "success": pl.Boolean, "total_reward": pl.Float64,
    "steps": pl.Int64, "calls": pl.Int64, "gen_tokens": pl.Int64, "prompt_tokens": pl.Int64,
    "parse_failures": pl.Int64, "invalid_actions": pl.Int64,
}
STEP_SCHEMA: dict[str, Any] = {
    "episode_id": pl.String, "step": pl.Int64, "prompt": pl.String, "text": pl.String,
    "turn": pl.String, "thought": pl.String, "tool": pl.String, "arguments": pl.String,
    "parse_error": pl.String, "invalid_action": pl.String, "observation": pl.String,
    "next_observation": pl.String, "reward": pl.Float64, "done": pl.Boolean,
    "model_call": pl.Boolean, "max_new_tokens": pl.Int64, "gen_tokens": pl.Int64,
    "prompt_tokens": pl.Int64,
}


def episode_expectations() -> FrameSpec:
    """Typed, not-null columns (prompt_tokens may be null: not counted), unique ids, stop
    reasons from the runner's list, counts >= 0."""
    cols = {name: ColumnSpec(dtype=dtype) for name, dtype in EPISODE_SCHEMA.items()}
    cols["episode_id"] = ColumnSpec(dtype=pl.String, unique=True)
    cols["stop_reason"] = ColumnSpec(dtype=pl.String, values=STOP_REASONS)
    for name in ("steps", "calls", "gen_tokens", "parse_failures", "invalid_actions"):
        cols[name] = ColumnSpec(dtype=pl.Int64, min=0)
    cols["prompt_tokens"] = ColumnSpec(dtype=pl.Int64, min=0, nullable=True)
    return FrameSpec(cols, min_rows=1)


def step_expectations() -> FrameSpec:
    """Typed, not-null columns (prompt_tokens may be null), step >= 0, parse errors from
    protocol.PARSE_REASONS or empty, token counts >= 0. May be empty (no episode took a turn)."""
    cols = {name: ColumnSpec(dtype=dtype) for name, dtype in STEP_SCHEMA.items()}
    cols["step"] = ColumnSpec(dtype=pl.Int64, min=0)
    cols["parse_error"] = ColumnSpec(dtype=pl.String, values=("", *PARSE_REASONS))
    for name in ("max_new_tokens", "gen_tokens"):
        cols[name] = ColumnSpec(dtype=pl.Int64, min=0)
    cols["prompt_tokens"] = ColumnSpec(dtype=pl.Int64, min=0, nullable=True)
    return FrameSpec(cols, min_rows=0)


def to_frames(episodes: Sequence[Episode], agent: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(episodes table, steps table) of finished episodes played by `agent`."""
    ep_rows, step_rows = [], []
    for ep in episodes:
        if ep.stop_reason is None:
            raise ValueError(f"episode {ep.episode_id} has not finished")
        led = ep.ledger
        ep_rows.append({
            "episode_id": ep.episode_id, "env": ep.env.name, "agent": agent, "task": ep.task,
            "stop_reason": ep.stop_reason, "success": ep.success,
            "total_reward": ep.total_reward, "steps": led.steps, "calls": led.calls,
            "gen_tokens": led.gen_tokens, "prompt_tokens": led.prompt_tokens,
            "parse_failures": led.parse_failures, "invalid_actions": led.invalid_actions})
        for k, s in enumerate(ep.steps):
            step_rows.append({"episode_id": ep.episode_id, "step": k, **{
                name: getattr(s, name) for name in STEP_SCHEMA if name not in ("episode_id",
                                                                                  "step")}})
    return (pl.DataFrame(ep_rows, schema=EPISODE_SCHEMA),
            pl.DataFrame(step_rows, schema=STEP_SCHEMA))


def check_consistency(episodes: pl.DataFrame, steps: pl.DataFrame, name: str) -> None:
    """The cross-table rules (module docstring); a DataValidationError naming the rule."""
    def fail(column: str, rule: str, detail: str) -> None:
        raise DataValidationError(f"{name}: column {column!r}: rule {rule!r} failed: {detail}",
                                  source=name, column=column, rule=rule)

    unknown = set(steps["episode_id"].unique()) - set(episodes["episode_id"])
    if unknown:
        fail("episode_id", "step of a listed episode",
             f"steps of episodes not in episodes.parquet: {sorted(unknown)[:5]}")
    per = steps.group_by("episode_id").agg(
        n=pl.len(), lo=pl.col("step").min(), hi=pl.col("step").max(),
        uniq=pl.col("step").n_unique(), gen=pl.col("gen_tokens").sum(),
        prompt=pl.col("prompt_tokens").sum(),
        parse=(pl.col("parse_error") != "").sum(),
        invalid=(pl.col("invalid_action") != "").sum(),
        n_calls=pl.col("model_call").sum(),
        done_last=pl.col("done").sort_by("step").last(),
        done_any=pl.col("done").sum())
    joined = episodes.join(per, on="episode_id", how="left").with_columns(
        pl.col("n", "gen", "parse", "invalid", "n_calls", "done_any").fill_null(0),
        pl.col("done_last").fill_null(False))
    n = pl.col("n")
    gaps = (pl.col("lo") != 0) | (pl.col("hi") != n - 1) | (pl.col("uniq") != n)
    bad = joined.filter((n != pl.col("steps")) | ((n > 0) & gaps))
    if bad.height:
        r = bad.row(0, named=True)
        fail("step", "steps 0..n-1", f"episode {r['episode_id']}: {r['n']} step rows "
             f"(steps {r['lo']}..{r['hi']}, {r['uniq']} distinct) for steps = {r['steps']}")
    for col, agg in (("gen_tokens", "gen"), ("parse_failures", "parse"),
                     ("invalid_actions", "invalid"), ("calls", "n_calls")):
        bad = joined.filter(pl.col(col) != pl.col(agg))
        if bad.height:
            r = bad.row(0, named=True)
            fail(col, "sum over steps", f"episode {r['episode_id']}: {col} = {r[col]} but its "
                 f"steps sum to {r[agg]}")
    bad = joined.filter(pl.col("prompt_tokens").is_not_null()
                        & (pl.col("prompt_tokens") != pl.col("prompt")))
    if bad.height:
        r = bad.row(0, named=True)
        fail("prompt_tokens", "sum over steps", f"episode {r['episode_id']}: "
             f"{r['prompt_tokens']} but its steps sum to {r['prompt']}")
    done_any, done_last = pl.col("done_any"), pl.col("done_last")
    bad = joined.filter((done_any > 1) | ((done_any == 1) & ~done_last)
                        | (done_last != (pl.col("stop_reason") == "done")))
    if bad.height:
        r = bad.row(0, named=True)
        fail("done", "done ends the episode", f"episode {r['episode_id']}: {r['done_any']} "
             f"done step(s), last step done = {r['done_last']}, stop_reason = "
             f"{r['stop_reason']!r}")


def validate_rollouts(episodes: pl.DataFrame, steps: pl.DataFrame, name: str) -> None:
    validate_frame(episodes, episode_expectations(), f"{name}/episodes.parquet")
    validate_frame(steps, step_expectations(), f"{name}/steps.parquet")
    check_consistency(episodes, steps, name)


def write_rollouts(folder: str | os.PathLike[str], episodes: pl.DataFrame,
                   steps: pl.DataFrame) -> Path:
    """Validate, then write both tables into `folder` atomically (the whole folder), each in
    `io.write_parquet`'s canonical layout (the same rows, the same bytes, however chunked)."""
    validate_rollouts(episodes, steps, str(folder))
    with io.atomic_path(folder, is_dir=True) as tmp:
        io.write_parquet(tmp / "episodes.parquet", episodes)
        io.write_parquet(tmp / "steps.parquet", steps)
    return Path(folder)


def read_rollouts(folder: str | os.PathLike[str]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(episodes, steps) of a rollout folder, validated like `write_rollouts` does."""
    from stages.core.checks import read_parquet_checked

    root = Path(folder)
    episodes = read_parquet_checked(root / "episodes.parquet", episode_expectations())
    steps = read_parquet_checked(root / "steps.parquet", step_expectations())
    check_consistency(episodes, steps, str(folder))
    return episodes, steps


def summarise(episodes: pl.DataFrame) -> dict[str, float]:
    """The numbers a stage reports for one agent's rollouts (module docstring)."""
    n = episodes.height
    turns = int(episodes["steps"].sum())
    out = {
        "episodes": float(n),
        "success_rate": float(episodes["success"].mean()),
        "mean_steps": turns / n,
        "mean_calls": float(episodes["calls"].mean()),
        "mean_gen_tokens": float(episodes["gen_tokens"].mean()),
        "parse_failure_rate": int(episodes["parse_failures"].sum()) / turns if turns else 0.0,
        "invalid_action_rate": int(episodes["invalid_actions"].sum()) / turns if turns else 0.0,
    }
    if episodes["prompt_tokens"].null_count() == 0:
        out["mean_prompt_tokens"] = float(episodes["prompt_tokens"].mean())
    counts = dict(episodes["stop_reason"].value_counts().iter_rows())
    for reason in STOP_REASONS:
        out[f"stop_{reason}"] = float(counts.get(reason, 0))
    return out


def parse_failure_counts(steps: pl.DataFrame) -> dict[str, float]:
    """Turns per parse failure reason, `parse_<reason>` (every reason, zeros included)."""
    counts = dict(steps["parse_error"].value_counts().iter_rows())
    return {f"parse_{r}": float(counts.get(r, 0)) for r in PARSE_REASONS}
