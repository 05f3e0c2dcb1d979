"""Stage `control`: R²VPO vs PPO-clip on continuous control (spec §4, Task B).

Both arms are stable-baselines3's PPO: same GAE, value loss, entropy term, network, optimiser,
epochs and minibatches, same seeds. They share one `train()` (SB3 2.9.2's `PPO.train`, copied:
SB3 has no loss hook) and differ only in the policy-loss line:

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
import math
import time
from collections import defaultdict
from contextlib import nullcontext
from typing import Any, Callable, Literal

import gymnasium as gym
import numpy as np
import torch as th
from gymnasium import spaces
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.utils import explained_variance
from stable_baselines3.common.vec_env import DummyVecEnv
from torch.nn import functional as F

from stages.core import io
from stages.r2vpo.r2vpo import (
    DualState,
    clip_fraction,
    clipped_surrogate_loss,
    policy_ratio,
    r2vpo_loss,
    ratio_variance,
)

log = logging.getLogger("paperline")

SPARSE_PREFIX = "sparse:"
EVAL_SEED_OFFSET = 10_000  # the eval env's seeds never coincide with a training env's


class Config(BaseModel):
    """Defaults: rl-zoo's tuned PPO for Pendulum-v1 (rl-baselines3-zoo hyperparams/ppo.yml:
    n_envs 4, n_steps 1024, batch 64, n_epochs 10, lr 1e-3, gamma 0.9, gae_lambda 0.95,
    clip 0.2, ent_coef 0, use_sde True, sde_sample_freq 4, 1e5 steps), except one env so a
    50k-step run updates 49 times (~1 min on one core); R²VPO defaults from the spec (§2)."""

    model_config = ConfigDict(extra="forbid")

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
    epsilon: float = Field(0.01, gt=0, le=10, description="R²VPO target Var(r) (PPO clip 0.2 "
                                                          "keeps Var(r) ~ 0.005-0.02)")
    lambda_init: float = Field(0.1, ge=0, le=1e4, description="lambda_0")
    lambda_lr: float = Field(0.1, ge=0, le=100, description="eta_lambda, dual step size")
    dual_rule: Literal["additive", "multiplicative", "fixed"] = Field(
        "additive", description="lambda update; 'fixed' keeps lambda_init (ablation)")
    center: Literal["mean", "one"] = Field("mean", description="Var around r_bar or around 1")
    v_ema: float = Field(0.9, ge=0, lt=1, description="EMA of V_hat before the dual step")
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


# --- the two arms: one train(), two policy losses -------------------------------------------

class _PolicyLossPPO(PPO):
    """SB3 2.9.2's `PPO.train()` with the policy loss behind `_policy_loss` and diagnostics.

    Both arms compute the ratio with `policy_ratio` (SB3: `exp(log_prob - old_log_prob)`; the
    clamp at |log r| = 20 only bites beyond r ~ 5e8 and is logged as `train/log_ratio_clamped`).
    """

    def _setup_model(self) -> None:
        super()._setup_model()
        self.last_train_stats: dict[str, float] = {}  # means over the latest train() call

    def _policy_loss(self, ratio: th.Tensor, advantages: th.Tensor
                     ) -> tuple[th.Tensor, dict[str, float]]:
        raise NotImplementedError

    def _after_policy_step(self, stats: dict[str, float]) -> None:
        """Called after every optimizer step with that minibatch's `_policy_loss` stats."""

    def train(self) -> None:
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        clip_range = self.clip_range(self._current_progress_remaining)  # type: ignore[operator]
        if self.clip_range_vf is not None:
            clip_range_vf = self.clip_range_vf(self._current_progress_remaining)  # type: ignore[operator]

        entropy_losses, pg_losses, value_losses, clip_fractions = [], [], [], []
        diagnostics: dict[str, list[float]] = defaultdict(list)

        continue_training = True
        for epoch in range(self.n_epochs):
            approx_kl_divs = []
            for rollout_data in self.rollout_buffer.get(self.batch_size):
                actions = rollout_data.actions
                if isinstance(self.action_space, spaces.Discrete):
                    actions = rollout_data.actions.long().flatten()

                values, log_prob, entropy = self.policy.evaluate_actions(
                    rollout_data.observations, actions)
                values = values.flatten()
                advantages = rollout_data.advantages
                if self.normalize_advantage and len(advantages) > 1:
                    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

                ratio, clamped = policy_ratio(log_prob, rollout_data.old_log_prob)  # (B,)
                policy_loss, stats = self._policy_loss(ratio, advantages)  # the arms differ here

                pg_losses.append(policy_loss.item())
                clip_fractions.append(th.mean((th.abs(ratio - 1) > clip_range).float()).item())
                with th.no_grad():
                    stats["ratio_mean"] = ratio.mean().item()
                    stats["ratio_var"] = ratio_variance(ratio, center="mean").item()
                    stats["clip_fraction_would_be"] = clip_fraction(ratio, advantages,
                                                                    clip_range).item()
                    stats["log_ratio_clamped"] = clamped.float().mean().item()

                if self.clip_range_vf is None:
                    values_pred = values
                else:
                    values_pred = rollout_data.old_values + th.clamp(
                        values - rollout_data.old_values, -clip_range_vf, clip_range_vf)
                value_loss = F.mse_loss(rollout_data.returns, values_pred)
                value_losses.append(value_loss.item())

                if entropy is None:
                    entropy_loss = -th.mean(-log_prob)
                else:
                    entropy_loss = -th.mean(entropy)
                entropy_losses.append(entropy_loss.item())

                loss = policy_loss + self.ent_coef * entropy_loss + self.vf_coef * value_loss

                with th.no_grad():
                    log_ratio = log_prob - rollout_data.old_log_prob
                    approx_kl_div = th.mean((th.exp(log_ratio) - 1) - log_ratio).cpu().numpy()
                    approx_kl_divs.append(approx_kl_div)

                if self.target_kl is not None and approx_kl_div > 1.5 * self.target_kl:
                    continue_training = False
                    if self.verbose >= 1:
                        print(f"Early stopping at step {epoch} due to reaching max kl: "
                              f"{approx_kl_div:.2f}")
                    break

                self.policy.optimizer.zero_grad()
                loss.backward()
                th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
                self.policy.optimizer.step()
                self._after_policy_step(stats)  # R²VPO: the dual step
                for key, value in stats.items():
                    diagnostics[key].append(value)

            self._n_updates += 1
            if not continue_training:
                break

        explained_var = explained_variance(self.rollout_buffer.values.flatten(),
                                           self.rollout_buffer.returns.flatten())
        self.logger.record("train/entropy_loss", np.mean(entropy_losses))
        self.logger.record("train/policy_gradient_loss", np.mean(pg_losses))
        self.logger.record("train/value_loss", np.mean(value_losses))
        self.logger.record("train/approx_kl", np.mean(approx_kl_divs))
        self.logger.record("train/clip_fraction", np.mean(clip_fractions))
        self.logger.record("train/loss", loss.item())
        self.logger.record("train/explained_variance", explained_var)
        if hasattr(self.policy, "log_std"):
            self.logger.record("train/std", th.exp(self.policy.log_std).mean().item())
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/clip_range", clip_range)
        if self.clip_range_vf is not None:
            self.logger.record("train/clip_range_vf", clip_range_vf)

        summary = {k: float(np.mean(v)) for k, v in diagnostics.items()}
        summary.update(self._dual_summary())
        for key, value in summary.items():
            self.logger.record(f"train/{key}", value)
        summary["entropy"] = -float(np.mean(entropy_losses))
        summary["approx_kl"] = float(np.mean(approx_kl_divs))
        self.last_train_stats = summary

    def _dual_summary(self) -> dict[str, float]:
        return {}


class PPOWithStats(_PolicyLossPPO):
    """PPO-clip exactly as SB3 computes it, plus the shared ratio diagnostics."""

    def _policy_loss(self, ratio: th.Tensor, advantages: th.Tensor
                     ) -> tuple[th.Tensor, dict[str, float]]:
        clip = self.clip_range(self._current_progress_remaining)  # type: ignore[operator]
        return clipped_surrogate_loss(ratio, advantages, clip), {}


class R2VPO(_PolicyLossPPO):
    """PPO with the clip replaced by the ratio-variance constraint and a dual multiplier.

    Extra kwargs (spec §2 defaults): epsilon (target Var(r)), lambda_init, lambda_lr,
    dual_rule (additive | multiplicative | fixed), center (mean: r_bar | one), v_ema.
    `clip_range` only sets the range of the would-be clip fraction diagnostic.
    """

    def __init__(self, policy: Any, env: Any, *, epsilon: float = 0.01,
                 lambda_init: float = 0.1, lambda_lr: float = 0.1,
                 dual_rule: Literal["additive", "multiplicative", "fixed"] = "additive",
                 center: Literal["mean", "one"] = "mean", v_ema: float = 0.9, **ppo_kwargs: Any):
        if dual_rule not in ("additive", "multiplicative", "fixed"):
            raise ValueError(f"dual_rule = {dual_rule!r}: expected additive, multiplicative "
                             f"or fixed")
        if center not in ("mean", "one"):
            raise ValueError(f"center = {center!r}: expected 'mean' or 'one'")
        self.center = center
        self.dual = DualState(lam=lambda_init, lr=lambda_lr, epsilon=epsilon, rule=dual_rule,
                              ema=v_ema)
        super().__init__(policy, env, **ppo_kwargs)

    def _policy_loss(self, ratio: th.Tensor, advantages: th.Tensor
                     ) -> tuple[th.Tensor, dict[str, float]]:
        # lambda enters as a float: the primal step never moves it (spec §6, "lambda in the loss")
        loss, v_hat = r2vpo_loss(ratio, advantages, lam=self.dual.lam,
                                 epsilon=self.dual.epsilon, center=self.center)
        return loss, {"v_hat": v_hat.detach().item()}

    def _after_policy_step(self, stats: dict[str, float]) -> None:
        self.dual.update(stats["v_hat"])  # dual ascent on the detached V_hat

    def _dual_summary(self) -> dict[str, float]:
        return {"lambda": self.dual.lam,
                "v_hat_ema": self.dual.v_ema if self.dual.v_ema is not None else float("nan")}


ALGORITHMS: dict[str, type[_PolicyLossPPO]] = {"ppo": PPOWithStats, "r2vpo": R2VPO}


def build_model(cfg: Config, arm: str, spec: str, seed: int) -> _PolicyLossPPO:
    """The arm's SB3 model on the spec's training env(s); everything but the loss is shared."""
    env = DummyVecEnv([lambda i=i: Monitor(make_env(spec, seed + i, cfg.sparse_threshold))
                       for i in range(cfg.n_envs)])
    kwargs: dict[str, Any] = dict(
        learning_rate=cfg.learning_rate, n_steps=cfg.n_steps, batch_size=cfg.batch_size,
        n_epochs=cfg.n_epochs, gamma=cfg.gamma, gae_lambda=cfg.gae_lambda,
        clip_range=cfg.clip_range, ent_coef=cfg.ent_coef, target_kl=cfg.target_kl,
        use_sde=cfg.use_sde, sde_sample_freq=cfg.sde_sample_freq,
        policy_kwargs={"net_arch": list(cfg.net_arch)}, seed=seed,
        device="cpu",  # a 64x64 MLP is faster on CPU than through a GPU round trip
        verbose=0)
    if arm == "r2vpo":
        kwargs.update(epsilon=cfg.epsilon, lambda_init=cfg.lambda_init,
                      lambda_lr=cfg.lambda_lr, dual_rule=cfg.dual_rule, center=cfg.center,
                      v_ema=cfg.v_ema)
    model = ALGORITHMS[arm]("MlpPolicy", env, **kwargs)
    # SB3's default logger makes a folder $TMPDIR/SB3-<time> per model even with no output
    # format; ours records `train/*` in memory only (the callback sends what we keep to MLflow)
    model.set_logger(Logger(folder=None, output_formats=[]))
    return model


# --- evaluation -----------------------------------------------------------------------------

def evaluate(model: PPO, env: gym.Env, episodes: int, seed: int,
             solved: Callable[[np.ndarray], bool] | None) -> tuple[float, float | None]:
    """(mean dense return, sparse success) over `episodes` deterministic episodes.

    Episode k starts from `reset(seed=seed + k)`: every evaluation of every arm sees the same
    start states. Sparse success = share of steps whose observation is solved (the sparse
    return per step); None when the env has no solved rule.
    """
    returns, success = [], []
    for k in range(episodes):
        obs, _ = env.reset(seed=seed + k)
        total, hits, steps, done = 0.0, 0, 0, False
        while not done:
            action, _ = model.predict(obs, deterministic=True)
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            hits += int(solved(obs)) if solved is not None else 0
            steps += 1
            done = terminated or truncated
        returns.append(total)
        success.append(hits / steps)
    return float(np.mean(returns)), (float(np.mean(success)) if solved is not None else None)


class EvalCurve(BaseCallback):
    """Evaluates at env step 0, every `every` env steps, and at the end of training."""

    def __init__(self, evaluate_now: Callable[[PPO], dict[str, Any]], every: int,
                 log: Callable[..., None]):
        super().__init__()
        self.evaluate_now, self.every, self.log = evaluate_now, every, log
        self.rows: list[dict[str, Any]] = []
        self.next_eval = 0

    def _evaluate(self) -> None:
        steps = int(self.model.num_timesteps)
        row = {"env_steps": steps, **self.evaluate_now(self.model)}
        self.rows.append(row)
        self.log({k: v for k, v in row.items() if k != "env_steps" and v is not None},
                 step=steps)
        self.next_eval = (steps // self.every + 1) * self.every

    def _on_training_start(self) -> None:
        self._evaluate()

    def _on_step(self) -> bool:
        if self.model.num_timesteps >= self.next_eval:
            self._evaluate()
        return True

    def _on_training_end(self) -> None:
        if self.rows[-1]["env_steps"] != self.model.num_timesteps:
            self._evaluate()


def train_one(cfg: Config, spec: str, arm: str, seed: int,
              log: Callable[..., None] = lambda metrics, step=None: None) -> list[dict[str, Any]]:
    """Train one (env, arm, seed); returns its evaluation rows."""
    env_id, _ = parse_env_spec(spec)
    eval_env = gym.make(env_id)  # always the dense env: returns on one scale for every variant
    rule = SOLVED.get(env_id)
    solved = (lambda obs: rule(obs, cfg.sparse_threshold)) if rule is not None else None
    model = build_model(cfg, arm, spec, seed)

    def evaluate_now(m: _PolicyLossPPO) -> dict[str, Any]:
        dense, success = evaluate(m, eval_env, cfg.eval_episodes, seed + EVAL_SEED_OFFSET, solved)
        stats = m.last_train_stats  # of the latest update; empty before the first one
        return {"dense_return": dense, "sparse_success": success,
                "lambda": m.dual.lam if isinstance(m, R2VPO) else None,
                "ratio_var": stats.get("ratio_var"),
                "clip_fraction_would_be": stats.get("clip_fraction_would_be")}

    curve = EvalCurve(evaluate_now, cfg.eval_every, log)
    model.learn(total_timesteps=cfg.total_timesteps, callback=curve)
    eval_env.close()
    model.get_env().close()
    return [{"env": spec, "arm": arm, "seed": seed, **row} for row in curve.rows]


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


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std (ddof=0): the seeds run are the whole population reported."""
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
                    mean_std(values)
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


class _NullRun:
    """Stands in for an MLflow method run when the stage runs without a tracker (unit tests)."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass


def _train_job(job: tuple[Config, str, str, int]) -> tuple[list[dict[str, Any]], float]:
    """One (env, arm, seed) run in a worker process: its evaluation rows and seconds."""
    cfg, spec, arm, seed = job
    th.set_num_threads(cfg.num_threads)
    t0 = time.time()
    return train_one(cfg, spec, arm, seed), time.time() - t0


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import polars as pl

    th.set_num_threads(cfg.num_threads)
    _preflight(cfg)
    started = time.time()
    rows: list[dict[str, Any]] = []
    params = cfg.model_dump(mode="json", exclude={"envs", "arms", "seeds", "workers"})
    jobs = [(spec, arm, seed) for spec in cfg.envs for arm in cfg.arms for seed in cfg.seeds]
    done: dict[tuple[str, str, int], tuple[list[dict[str, Any]], float]] = {}
    if cfg.workers > 1:
        # Runs in parallel processes (spawned: no forked torch/MLflow threads); each run's curve
        # is logged to its MLflow child run afterwards, step = env steps, as the live path does.
        with ProcessPoolExecutor(min(cfg.workers, len(jobs)),
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            for job, result in zip(jobs, pool.map(_train_job, [(cfg, *j) for j in jobs])):
                done[job] = result
    for spec, arm, seed in jobs:
        run_ctx = (ctx.tracker.method_run(group=f"control/{spec}", method=arm, seed=seed,
                                          params=params)
                   if ctx.tracker is not None else nullcontext(_NullRun()))
        with run_ctx as mr:
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
