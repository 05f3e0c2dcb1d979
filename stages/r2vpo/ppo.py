"""The two arms of the control stage as stable-baselines3 PPO subclasses (spec §4, Task B):
PPO-clip and R²VPO (Luo et al., ICML 2026, arXiv 2605.26784) with one shared `train()`.

Both arms are SB3's PPO: same GAE, value loss, entropy term, network, optimiser, epochs and
minibatches, same seeds. They share one `train()` (SB3 2.9.2's `PPO.train`, copied: SB3 has no
loss hook) and differ only in the policy-loss line:

    ppo:    -mean min(r A, clip(r, 1-c, 1+c) A)                    (SB3's clipped surrogate)
    r2vpo:  -[mean(r A) - lambda (V_hat - eps)],  no clip           (stages.r2vpo.r2vpo)
            lambda <- max(0, lambda + eta (EMA(V_hat) - eps))       after every minibatch step

Both log the ratio variance, the share of samples the clip cuts (or would cut), how often the
|log r| <= 20 guard bites, and lambda for R²VPO (SB3 logger `train/*`). `train_one` trains and
evaluates one (env, arm, seed) of the stage `stages.r2vpo.control`, which imports this module
only when it trains (torch and SB3 are slow to import; its Config validates without them).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.utils import explained_variance
from stable_baselines3.common.vec_env import DummyVecEnv
from torch.nn import functional as F

from stages.r2vpo.control import EVAL_SEED_OFFSET, SOLVED, Config, make_env, parse_env_spec
from stages.r2vpo.r2vpo import (
    DualState,
    R2VPOParams,
    clipped_surrogate_loss,
    r2vpo_loss,
    ratio_variance,
)
from stages.train.ratio import clip_fraction, policy_ratio


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

    Extra kwargs: the fields of `R2VPOParams` (epsilon, lambda_init, lambda_lr, dual_rule,
    center, v_ema; its [reconstructed] defaults), validated there. `clip_range` only sets the
    range of the would-be clip fraction diagnostic.
    """

    def __init__(self, policy: Any, env: Any, **kwargs: Any):
        names = set(R2VPOParams.model_fields)
        r2vpo = R2VPOParams(**{k: v for k, v in kwargs.items() if k in names})
        self.center = r2vpo.center
        self.dual = DualState.from_params(r2vpo)
        super().__init__(policy, env, **{k: v for k, v in kwargs.items() if k not in names})

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
    if arm == "r2vpo":  # Config is an R2VPOParams: its constraint and multiplier settings
        kwargs.update({k: getattr(cfg, k) for k in R2VPOParams.model_fields})
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
