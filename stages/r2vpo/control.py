"""Stage `control`: R²VPO vs PPO-clip on continuous control (spec §4, Task B).

Both arms are stable-baselines3's PPO (`stages.r2vpo.ppo`): same GAE, value loss, entropy term,
network, optimiser, epochs and minibatches, same seeds. They share one `train()` (SB3 2.9.2's
`PPO.train`, copied: SB3 has no loss hook) and differ only in the policy-loss line:

    ppo:    -mean min(r A, clip(r, 1-c, 1+c) A)                    (SB3's clipped surrogate)
    r2vpo:  -[mean(r A) - lambda (V_hat - eps)],  no clip           (stages.r2vpo.r2vpo)
            lambda <- max(0, lambda + eta (EMA(V_hat) - eps))       after every minibatch step

Both arms log the ratio variance, the share of samples the clip cuts (or would cut), how often
the |log r| <= 20 guard bites, and lambda for R²VPO (SB3 logger `train/*`, per-eval MLflow).

`sparse:<id>` replaces the reward by 1 at steps where the task is "solved" (Pendulum: upright,
cos(theta) > 0.95) and 0 elsewhere: the spec's sparse-reward setting, where the paper claims the
largest gap. Evaluation always reports the original dense return, so sparse and dense runs share
one scale, plus the share of evaluation steps spent solved.

Departures from the paper (whose control setup is unpublished): Pendulum instead of its 10
unnamed robotic tasks at the cpu profile (MuJoCo ids such as HalfCheetah-v5 work at gpu scale);
no replay buffer for control (fresh on-policy data, as in PPO); hyper-parameters are rl-zoo's
tuned PPO Pendulum-v1 ones, shared by both arms.

    python -m stages r2vpo control       # sizes from pipelines/r2vpo/params.yaml (profile)
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Literal

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from pydantic import Field, field_validator, model_validator

from stages.core import io
from stages.r2vpo.r2vpo import R2VPOParams

log = logging.getLogger("paperline")

SPARSE_PREFIX = "sparse:"
EVAL_SEED_OFFSET = 10_000  # the eval env's seeds never coincide with a training env's


class Config(R2VPOParams):
    """Defaults: rl-zoo's tuned PPO for Pendulum-v1 (rl-baselines3-zoo hyperparams/ppo.yml:
    n_envs 4, n_steps 1024, batch 64, n_epochs 10, lr 1e-3, gamma 0.9, gae_lambda 0.95,
    clip 0.2, ent_coef 0, use_sde True, sde_sample_freq 4, 1e5 steps), except one env so a
    50k-step run updates 49 times (~1 min on one core). The R²VPO arm's constraint and
    multiplier (epsilon, lambda_init, lambda_lr, dual_rule, center, v_ema) are `R2VPOParams`'
    fields, at its [reconstructed] defaults, the same settings as the LLM arms'."""

    envs: list[str] = Field(
        default_factory=lambda: ["Pendulum-v1", "sparse:Pendulum-v1"], min_length=1,
        description="gymnasium ids; 'sparse:<id>' rewards only solved steps (Pendulum-v1)")
    arms: list[Literal["ppo", "r2vpo"]] = Field(
        default_factory=lambda: ["ppo", "r2vpo"], min_length=1,
        description="ppo: SB3's clipped loss; r2vpo: ratio-variance Lagrangian, no clip")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1,
                             description="training seeds, the same for every arm")
    total_timesteps: int = Field(50_000, ge=1, le=100_000_000,
                                 description="env steps per run (whole rollouts: SB3 rounds up)")
    n_envs: int = Field(1, ge=1, le=64, description="parallel training envs (rl-zoo: 4)")
    n_steps: int = Field(1024, ge=2, le=1_000_000, description="env steps per env per rollout")
    batch_size: int = Field(64, ge=2, le=1_000_000, description="minibatch size")
    n_epochs: int = Field(10, ge=1, le=100, description="passes over each rollout")
    learning_rate: float = Field(1e-3, gt=0, le=1, description="Adam learning rate")
    gamma: float = Field(0.9, gt=0, le=1, description="discount (rl-zoo Pendulum: 0.9)")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    clip_range: float = Field(0.2, gt=0, le=10, description="PPO clip; R²VPO uses it only for "
                                                            "the would-be clip fraction")
    ent_coef: float = Field(0.0, ge=0, le=1, description="entropy bonus (0: spec's faithful "
                                                         "default)")
    target_kl: float | None = Field(None, gt=0, description="SB3 early stop of an update when "
                                                            "approx KL > 1.5 target (None: off)")
    use_sde: bool = Field(True, description="gSDE exploration (rl-zoo Pendulum: True)")
    sde_sample_freq: int = Field(4, ge=-1, description="resample the gSDE noise every n steps")
    net_arch: list[int] = Field(default_factory=lambda: [64, 64], min_length=1,
                                description="hidden sizes of the (separate) actor and critic")
    sparse_threshold: float = Field(0.95, gt=-1, lt=1, description="Pendulum is solved when "
                                                                   "cos(theta) > this")
    eval_every: int = Field(5_000, ge=1, description="env steps between evaluations")
    eval_episodes: int = Field(5, ge=1, le=1000, description="deterministic episodes per eval")
    num_threads: int = Field(1, ge=1, le=512, description="torch CPU threads (1 is fastest "
                                                          "for 64x64 MLPs)")
    workers: int = Field(1, ge=1, le=256, description="(env, arm, seed) runs trained at once, "
                         "each in its own process; results do not depend on it (every run "
                         "seeds itself), only wall time")

    @field_validator("envs")
    @classmethod
    def _known_envs(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"envs {value} list an env twice")
        for spec in value:
            parse_env_spec(spec)
        return value

    @field_validator("arms", "seeds")
    @classmethod
    def _unique(cls, value: list[Any]) -> list[Any]:
        if len(set(value)) != len(value):
            raise ValueError(f"{value} repeats a value")
        return value

    @model_validator(mode="after")
    def _check_sizes(self) -> "Config":
        rollout = self.n_steps * self.n_envs
        if rollout % self.batch_size:
            raise ValueError(f"n_steps * n_envs = {self.n_steps} * {self.n_envs} = {rollout} "
                             f"samples per rollout must split evenly into minibatches of "
                             f"batch_size = {self.batch_size}")
        if self.total_timesteps < rollout:
            raise ValueError(f"total_timesteps = {self.total_timesteps} is less than one rollout "
                             f"(n_steps * n_envs = {rollout})")
        return self


# --- environments ---------------------------------------------------------------------------

def _pendulum_upright(obs: np.ndarray, threshold: float) -> bool:
    return bool(obs[0] > threshold)  # obs = (cos theta, sin theta, theta_dot); upright: theta 0


# When each env counts as "solved" at a step, from the observation after it. Add an entry to
# allow `sparse:<id>` and a sparse success rate for another env.
SOLVED: dict[str, Callable[[np.ndarray, float], bool]] = {
    "Pendulum-v1": _pendulum_upright,
}


class SparseReward(gym.Wrapper):
    """Reward 1.0 at a step whose new observation is solved, else 0.0.

    The dense reward goes to `info["dense_reward"]`, the flag to `info["solved"]`; episodes end
    exactly as in the wrapped env.
    """

    def __init__(self, env: gym.Env, threshold: float = 0.95):
        super().__init__(env)
        env_id = env.spec.id if env.spec is not None else repr(env)
        if env_id not in SOLVED:
            raise ValueError(f"no 'solved' rule for {env_id}, so {SPARSE_PREFIX}{env_id} is "
                             f"undefined; known: {', '.join(SOLVED)}")
        self.solved = SOLVED[env_id]
        self.threshold = threshold

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        solved = self.solved(obs, self.threshold)
        info = {**info, "dense_reward": float(reward), "solved": solved}
        return obs, float(solved), terminated, truncated, info


def parse_env_spec(spec: str) -> tuple[str, bool]:
    """'sparse:Pendulum-v1' -> ('Pendulum-v1', True); checks the id against gymnasium's registry
    (no env is built). Raises ValueError naming the spec."""
    sparse = spec.startswith(SPARSE_PREFIX)
    env_id = spec[len(SPARSE_PREFIX):] if sparse else spec
    if ":" in env_id:  # gymnasium would import the part before ':' as a module
        raise ValueError(f"env spec {spec!r}: the only prefix is {SPARSE_PREFIX!r}")
    try:
        gym.spec(env_id)
    except gym.error.Error as exc:
        raise ValueError(f"env spec {spec!r}: {exc}") from None
    if sparse and env_id not in SOLVED:
        raise ValueError(f"env spec {spec!r}: no 'solved' rule for {env_id}, so the sparse "
                         f"reward is undefined; sparse: works for {', '.join(SOLVED)}")
    return env_id, sparse


def make_env(spec: str, seed: int, sparse_threshold: float = 0.95) -> gym.Env:
    """The training env of a spec, reset once with `seed` (SB3 reseeds it from the model seed)."""
    env_id, sparse = parse_env_spec(spec)
    env = gym.make(env_id)
    if sparse:
        env = SparseReward(env, sparse_threshold)
    env.reset(seed=seed)
    env.action_space.seed(seed)
    return env


# --- summary --------------------------------------------------------------------------------

def return_last10(returns: list[float]) -> float:
    """Mean of the last 10% of a seed's evaluations (at least the last one), in eval order."""
    k = max(1, len(returns) // 10)
    return float(np.mean(returns[-k:]))


def steps_to_reach(curve: list[tuple[int, float]], best: float, frac: float,
                   budget: int) -> float:
    """First env_steps at which a seed's curve reaches `frac` of the way from its own first
    evaluation to `best`.

    curve: (env_steps, dense_return) sorted by env_steps, starting with the step-0 evaluation.
    level = R_0 + frac * (best - R_0), with best the highest dense return any arm and seed
    reached on that env at any evaluation; reached when dense_return >= level. A seed whose
    first evaluation is already the best reaches it at its first point; a seed that never
    reaches it counts `budget` (total_timesteps), so the metric is never NaN.
    """
    start = curve[0][1]
    level = start + frac * (best - start)
    for steps, ret in curve:
        if ret >= level:
            return float(steps)
    return float(budget)


def seed_mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std (ddof 0) over seeds, by numpy. Not `stages.core.stats.mean_std`
    on purpose: numpy adds a0 + (a1 + a2 + ...), that function ((a0 + a1) + a2) + ..., which
    differ in the last bit for about 1 draw in 2000, and the committed control metrics are
    numpy's."""
    return float(np.mean(values)), float(np.std(values, ddof=0))


def summarize(rows: list[dict[str, Any]], cfg: Config) -> dict[str, float]:
    """Flat metrics per env and arm, mean and std over seeds; keys in config order."""
    metrics: dict[str, float] = {}
    for spec in cfg.envs:
        env_rows = [r for r in rows if r["env"] == spec]
        best = max(r["dense_return"] for r in env_rows)
        key = spec.replace(":", "_")
        for arm in cfg.arms:
            last10, reach, success, lam = [], [], [], []
            for seed in cfg.seeds:
                seed_rows = sorted((r for r in env_rows if r["arm"] == arm and r["seed"] == seed),
                                   key=lambda r: r["env_steps"])
                returns = [r["dense_return"] for r in seed_rows]
                last10.append(return_last10(returns))
                reach.append(steps_to_reach([(r["env_steps"], r["dense_return"])
                                             for r in seed_rows], best, 0.8,
                                            cfg.total_timesteps))
                if seed_rows[-1]["sparse_success"] is not None:
                    success.append(return_last10([r["sparse_success"] for r in seed_rows]))
                if seed_rows[-1]["lambda"] is not None:
                    lam.append(seed_rows[-1]["lambda"])
            out = {"return_last10": last10, "steps_to_80pct": reach}
            if success:
                out["sparse_success_last10"] = success
            if lam:
                out["lambda_final"] = lam
            for name, values in out.items():
                metrics[f"{key}/{arm}/{name}_mean"], metrics[f"{key}/{arm}/{name}_std"] = \
                    seed_mean_std(values)
            metrics[f"{key}/{arm}/reached_80pct_frac"] = float(
                np.mean([s < cfg.total_timesteps for s in reach]))
    return metrics


# --- stage ----------------------------------------------------------------------------------

def _preflight(cfg: Config) -> None:
    """Build every env once before any compute: a missing MuJoCo fails here, not at hour 3."""
    for spec in cfg.envs:
        try:
            env = make_env(spec, 0, cfg.sparse_threshold)
        except gym.error.Error as exc:
            raise ValueError(f"env spec {spec!r} cannot be built: {exc}") from None
        if cfg.use_sde and not isinstance(env.action_space, spaces.Box):
            raise ValueError(f"env spec {spec!r}: use_sde needs a continuous (Box) action "
                             f"space, not {env.action_space}")
        env.close()


def _train_job(job: tuple[Config, str, str, int]) -> tuple[list[dict[str, Any]], float]:
    """One (env, arm, seed) run in a worker process: its evaluation rows and seconds."""
    import torch

    from stages.r2vpo.ppo import train_one

    cfg, spec, arm, seed = job
    torch.set_num_threads(cfg.num_threads)
    t0 = time.time()
    return train_one(cfg, spec, arm, seed), time.time() - t0


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl
    import torch

    from stages.core.pool import map_jobs
    from stages.r2vpo.ppo import train_one

    torch.set_num_threads(cfg.num_threads)
    _preflight(cfg)
    started = time.time()
    rows: list[dict[str, Any]] = []
    params = cfg.model_dump(mode="json", exclude={"envs", "arms", "seeds", "workers"})
    jobs = [(spec, arm, seed) for spec in cfg.envs for arm in cfg.arms for seed in cfg.seeds]
    done: dict[tuple[str, str, int], tuple[list[dict[str, Any]], float]] = {}
    if cfg.workers > 1:
        # Runs in worker processes (stages.core.pool: spawned, no forked torch/MLflow threads;
        # a single job runs here); each run's curve is logged to its MLflow child run
        # afterwards, step = env steps, as the live path does.
        done = dict(zip(jobs, map_jobs(_train_job, [(cfg, *j) for j in jobs], cfg.workers)))
    for spec, arm, seed in jobs:
        with ctx.method_run(f"control/{spec}", arm, seed, params) as mr:
            if (spec, arm, seed) in done:
                seed_rows, seconds = done[(spec, arm, seed)]
                for row in seed_rows:
                    mr.log_metrics({k: v for k, v in row.items() if v is not None and k not in
                                    ("env", "arm", "seed", "env_steps")}, step=row["env_steps"])
            else:
                t0 = time.time()
                seed_rows = train_one(cfg, spec, arm, seed, mr.log_metrics)
                seconds = time.time() - t0
            final = return_last10([r["dense_return"] for r in seed_rows])
            mr.log_metrics({"return_last10": final}, step=seed_rows[-1]["env_steps"])
        rows += seed_rows
        log.info("control %s %s seed %d: return_last10 %.1f (%.0fs)", spec, arm, seed, final,
                 seconds)
    schema = {"env": pl.Utf8, "arm": pl.Utf8, "seed": pl.Int64, "env_steps": pl.Int64,
              "dense_return": pl.Float64, "sparse_success": pl.Float64, "lambda": pl.Float64,
              "ratio_var": pl.Float64, "clip_fraction_would_be": pl.Float64}
    io.write_parquet(ctx.path("control_curves"), pl.DataFrame(rows, schema=schema))
    metrics = summarize(rows, cfg)
    metrics["seconds"] = time.time() - started
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: each arm's final return per env (`<arm>/<env>`: mean of the last 10
    evaluations, mean over seeds); spreads, success rates, steps to 80% in
    details/control.json."""
    return {f"{k.split('/')[1]}/{k.split('/')[0]}": v for k, v in metrics.items()
            if k.count("/") == 2 and k.endswith("/return_last10_mean")}
