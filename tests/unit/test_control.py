"""The continuous-control arm: PPO-clip vs R²VPO on SB3 (stages.r2vpo.ppo), the sparse-reward
wrapper, the stage (stages.r2vpo.control)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import polars as pl
import pytest
import torch
from stable_baselines3 import PPO

from stages.core.context import Context
from stages.r2vpo import control
from stages.r2vpo.control import Config, SparseReward, make_env, steps_to_reach, summarize
from stages.r2vpo.ppo import R2VPO, PPOWithStats

torch.set_num_threads(1)

TINY = dict(n_steps=128, batch_size=32, n_epochs=2, seed=0, device="cpu", use_sde=True,
            sde_sample_freq=4, gamma=0.9, learning_rate=1e-3)


def _params(model: PPO) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.policy.state_dict().items()}


@pytest.fixture(scope="module")
def models() -> tuple[PPOWithStats, R2VPO]:
    return (PPOWithStats("MlpPolicy", "Pendulum-v1", **TINY),
            R2VPO("MlpPolicy", "Pendulum-v1", **TINY))


def _sb3_clipped(ratio: torch.Tensor, advantages: torch.Tensor, clip: float) -> torch.Tensor:
    # verbatim from stable_baselines3/ppo/ppo.py (2.9.2) PPO.train
    policy_loss_1 = advantages * ratio
    policy_loss_2 = advantages * torch.clamp(ratio, 1 - clip, 1 + clip)
    return -torch.min(policy_loss_1, policy_loss_2).mean()


def test_ppo_policy_loss_is_sb3s_clipped_loss(models):
    ppo, _ = models
    ratio = torch.tensor([0.5, 0.9, 1.0, 1.1, 1.25, 1.6])
    adv = torch.tensor([1.0, -2.0, 0.5, 1.5, 2.0, -1.0])
    loss, _ = ppo._policy_loss(ratio, adv)
    assert ppo.clip_range(1.0) == 0.2
    assert torch.equal(loss, _sb3_clipped(ratio, adv, 0.2))


def test_ppo_arm_trains_exactly_like_sb3_ppo():
    """Same seed, same rollouts, same minibatches: the overridden train() is SB3's."""
    ref = PPO("MlpPolicy", "Pendulum-v1", **TINY).learn(256)
    ours = PPOWithStats("MlpPolicy", "Pendulum-v1", **TINY).learn(256)
    a, b = _params(ref), _params(ours)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=k)
    assert {"ratio_var", "clip_fraction_would_be", "log_ratio_clamped"} <= set(
        ours.last_train_stats)


def test_r2vpo_with_lambda_zero_equals_ppo_inside_the_clip_range(models):
    ppo, r2 = models
    r2.dual.lam = 0.0
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    grads = []
    for model in (ppo, r2):
        logp = torch.log(torch.tensor([0.85, 0.95, 1.1, 1.15])).requires_grad_()
        ratio = torch.exp(logp - old)
        loss, _ = model._policy_loss(ratio, adv)
        loss.backward()
        grads.append((loss.detach(), logp.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])


def test_r2vpo_brakes_a_ratio_that_ran_ahead(models):
    """Effective advantage r (A - 2 lam (r - r_bar)) (spec §2), computed by hand."""
    _, r2 = models
    r = [0.9, 1.0, 1.3]
    adv = [1.0, -1.0, 2.0]
    r_bar = sum(r) / 3
    grads = {}
    for lam in (0.0, 0.5):
        r2.dual.lam = lam
        logp = torch.log(torch.tensor(r, dtype=torch.float64)).requires_grad_()
        loss, _ = r2._policy_loss(torch.exp(logp), torch.tensor(adv, dtype=torch.float64))
        loss.backward()
        grads[lam] = -logp.grad  # ascent direction = (1/N) r_i (A_i - 2 lam (r_i - r_bar))
        by_hand = [ri * (ai - 2 * lam * (ri - r_bar)) / 3 for ri, ai in zip(r, adv)]
        assert grads[lam].tolist() == pytest.approx(by_hand)
    # sample 2: r = 1.3 > r_bar, A > 0: a smaller push, still positive (a soft brake, no zero)
    assert 0 < grads[0.5][2] < grads[0.0][2]
    # sample 0: r = 0.9 < r_bar, A > 0: pulled back up harder
    assert grads[0.5][0] > grads[0.0][0]


def test_sparse_reward_is_one_exactly_when_upright():
    for threshold in (0.95, 0.0):
        env = SparseReward(gym.make("Pendulum-v1"), threshold)
        dense = gym.make("Pendulum-v1")
        # start near upright so both outcomes occur: it falls over within the episode
        obs, _ = env.reset(seed=3, options={"x_init": 0.3, "y_init": 0.1})
        dense.reset(seed=3, options={"x_init": 0.3, "y_init": 0.1})
        env.action_space.seed(3)
        rewards = []
        for _ in range(200):
            action = env.action_space.sample()
            obs, reward, terminated, truncated, info = env.step(action)
            _, dense_reward, *_ = dense.step(action)
            assert reward == (1.0 if obs[0] > threshold else 0.0)
            assert info["dense_reward"] == pytest.approx(dense_reward)
            rewards.append(reward)
            if terminated or truncated:
                break
        assert set(rewards) == {0.0, 1.0}, threshold
    assert isinstance(make_env("sparse:Pendulum-v1", 0), SparseReward)
    assert not isinstance(make_env("Pendulum-v1", 0), SparseReward)


def test_r2vpo_training_changes_the_policy_and_moves_lambda():
    model = R2VPO("MlpPolicy", "Pendulum-v1", lambda_init=0.1, **{**TINY, "n_steps": 256,
                                                                   "batch_size": 64})
    before = _params(model)
    model.learn(512)
    after = _params(model)
    assert all(not torch.equal(before[k], after[k]) for k in before
               if k.startswith(("mlp_extractor.policy_net", "action_net")))
    assert model.dual.lam != 0.1 and model.dual.v_ema is not None
    stats = model.last_train_stats
    assert stats["lambda"] == model.dual.lam and stats["ratio_var"] >= 0
    assert stats["log_ratio_clamped"] == 0.0


def _ctx(tmp_path) -> Context:
    return Context(root=tmp_path, pipeline="r2vpo", stage="control", pipeline_dir=tmp_path,
                   profile="smoke", seed=0, tracker=None,
                   paths={"metrics": tmp_path / "metrics",
                          "control_curves": tmp_path / "curves.parquet"})


def test_run_writes_curves_for_every_env_arm_and_seed(tmp_path):
    cfg = Config(envs=["Pendulum-v1", "sparse:Pendulum-v1"], seeds=[0], total_timesteps=256,
                 n_steps=128, batch_size=64, n_epochs=1, eval_every=128, eval_episodes=1)
    metrics = control.run(cfg, _ctx(tmp_path))
    df = pl.read_parquet(tmp_path / "curves.parquet")
    assert {"env", "arm", "seed", "env_steps", "dense_return", "sparse_success"} <= set(df.columns)
    assert df.height == 2 * 2 * 3                      # evaluations at 0, 128, 256 env steps
    for (env, arm), g in df.group_by(["env", "arm"]):
        assert g.sort("env_steps")["env_steps"].to_list() == [0, 128, 256], (env, arm)
        assert g["sparse_success"].is_between(0, 1).all()
    # the same seed starts from the same policy in both arms and both envs
    first = df.filter(pl.col("env_steps") == 0)["dense_return"]
    assert first.n_unique() == 1 and first[0] < -100   # Pendulum's return is negative
    assert df.filter(pl.col("arm") == "ppo")["lambda"].is_null().all()
    assert df.filter((pl.col("arm") == "r2vpo") & (pl.col("env_steps") > 0))["lambda"] \
        .is_not_null().all()
    for key in ("Pendulum-v1", "sparse_Pendulum-v1"):
        for arm in ("ppo", "r2vpo"):
            assert f"{key}/{arm}/return_last10_mean" in metrics
            assert metrics[f"{key}/{arm}/return_last10_std"] == 0.0   # one seed
            assert 0 <= metrics[f"{key}/{arm}/steps_to_80pct_mean"] <= 256
    assert "Pendulum-v1/r2vpo/lambda_final_mean" in metrics and metrics["seconds"] > 0
    assert all(isinstance(v, float) and np.isfinite(v) for v in metrics.values())


def test_parallel_workers_give_the_same_curves(tmp_path):
    """`workers` changes wall time only: every run seeds itself, so the curves are identical."""
    cfg = Config(envs=["Pendulum-v1"], seeds=[0, 1], total_timesteps=128, n_steps=64,
                 batch_size=32, n_epochs=1, eval_every=64, eval_episodes=1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    m1 = control.run(cfg, _ctx(tmp_path / "a"))
    m2 = control.run(cfg.model_copy(update={"workers": 2}), _ctx(tmp_path / "b"))
    keys = ["env", "arm", "seed", "env_steps"]
    a = pl.read_parquet(tmp_path / "a/curves.parquet").sort(keys)
    b = pl.read_parquet(tmp_path / "b/curves.parquet").sort(keys)
    assert a.height == 2 * 2 * 3 and a.equals(b)
    assert {k: v for k, v in m1.items() if k != "seconds"} == \
        {k: v for k, v in m2.items() if k != "seconds"}


def test_steps_to_reach_and_summary_by_hand():
    # start -1000, best -200: level = -1000 + 0.8 * 800 = -360
    curve = [(0, -1000.0), (100, -500.0), (200, -350.0), (300, -200.0)]
    assert steps_to_reach(curve, -200.0, 0.8, 999) == 200.0
    assert steps_to_reach(curve[:2], -200.0, 0.8, 999) == 999.0     # never: the budget
    cfg = Config(envs=["Pendulum-v1"], arms=["ppo"], seeds=[0, 1], total_timesteps=1024,
                 n_steps=128, batch_size=64)
    rows = [{"env": "Pendulum-v1", "arm": "ppo", "seed": s, "env_steps": x, "dense_return": y,
             "sparse_success": 0.5, "lambda": None}
            for s, pts in ((0, curve), (1, [(0, -1000.0), (100, -900.0)])) for x, y in pts]
    m = summarize(rows, cfg)
    assert m["Pendulum-v1/ppo/return_last10_mean"] == pytest.approx((-200 - 900) / 2)
    assert m["Pendulum-v1/ppo/return_last10_std"] == pytest.approx(350.0)   # ddof = 0
    assert m["Pendulum-v1/ppo/steps_to_80pct_mean"] == pytest.approx((200 + 1024) / 2)
    assert m["Pendulum-v1/ppo/reached_80pct_frac"] == 0.5


def test_bad_env_specs_are_named():
    for spec in ("Pendulm-v1", "dense:Pendulum-v1", "sparse:MountainCarContinuous-v0"):
        with pytest.raises(ValueError, match=spec):
            make_env(spec, 0)
        with pytest.raises(ValueError, match=spec):
            Config(envs=[spec])
    with pytest.raises(ValueError, match="Did you mean"):
        Config(envs=["Pendulm-v1"])


def test_config_refuses_uneven_minibatches():
    with pytest.raises(ValueError, match="split evenly"):
        Config(n_steps=100, batch_size=64)
    with pytest.raises(ValueError, match="one rollout"):
        Config(total_timesteps=100, n_steps=128, batch_size=64)
