"""Stage `profile_engine`: the least-squares fits recover hand-made constants, the KV size is
the hand-computed one, bad grids are rejected by name, and a real measurement of a tiny model
through the serving engine writes a valid LatencyProfile."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from pydantic import ValidationError

from stages.core.context import Context
from stages.serving import profile as P


def test_prefill_fit_recovers_hand_made_constants():
    s0, a, b = 0.012, 1.8e-4, 4.0e-8                       # s, s/token, s/token^2
    lengths, batches = [8, 32, 64, 128, 200], [1, 2, 4]
    sum_l = [bs * n for n in lengths for bs in batches]
    sum_l2 = [bs * n * n for n in lengths for bs in batches]
    seconds = [s0 + a * x + b * x2 for x, x2 in zip(sum_l, sum_l2)]
    coef, stats = P.fit_prefill(sum_l, sum_l2, seconds)
    np.testing.assert_allclose(coef, [s0, a, b], rtol=1e-6)
    assert stats["mape"] < 1e-9 and stats["r2"] == pytest.approx(1.0)


def test_decode_fit_recovers_constants_through_noise():
    s0, c, d = 0.004, 6e-4, 2e-6                           # s, s/seq, s/context token
    rng = np.random.default_rng(0)
    batch = np.repeat([1, 2, 4, 8, 16, 32], 5)
    ctx = batch * np.tile([16, 32, 64, 128, 192], 6)
    exact = s0 + c * batch + d * ctx
    noisy = exact * rng.lognormal(0.0, 0.02, size=len(exact))   # 2% multiplicative noise
    coef, stats = P.fit_decode(batch, ctx, noisy)
    np.testing.assert_allclose(coef, [s0, c, d], rtol=0.1)
    assert 0.005 < stats["mape"] < 0.05 and stats["r2"] > 0.99


def test_transfer_fit_gives_bandwidth():
    n_bytes = [4096 * n for n in (16, 64, 256, 1024)]
    seconds = [2e-5 + x / 10e9 for x in n_bytes]
    coef, _ = P.fit_transfer(n_bytes, seconds)
    assert coef[0] == pytest.approx(2e-5) and 1 / coef[1] == pytest.approx(10e9)


def test_non_negative_least_squares_clamps_a_negative_slope():
    # y falls with x: the unconstrained slope is -0.1; the best slope >= 0 is 0, and the
    # intercept is then the mean of y, 0.8 (hand-computed).
    x = np.column_stack([np.ones(5), np.arange(5.0)])
    y = 1.0 - 0.1 * np.arange(5.0)
    assert np.linalg.lstsq(x, y, rcond=None)[0][1] < 0
    np.testing.assert_allclose(P.nonneg_lstsq(x, y), [0.8, 0.0], atol=1e-12)


def test_kv_bytes_per_token_hand_computed():
    # 2 (K, V) * 3 layers * 2 KV heads (GQA) * head_dim 256/8 = 32 * 2 bytes (fp16) = 768
    gqa = SimpleNamespace(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                          hidden_size=256, head_dim=None)
    assert P.kv_bytes_per_token(gqa, 2) == 768
    # an explicit head_dim wins; no kv heads given -> as many as query heads: 2*2*4*64*4 = 4096
    mha = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=128,
                          head_dim=64)
    assert P.kv_bytes_per_token(mha, 4) == 4096


def test_fit_iterations_refits_a_server_log_and_keeps_the_rest():
    like = P.LatencyProfile(name="tiny-cpu", source="x", prefill_s0=1.0, prefill_s_per_token=1.0,
                            decode_s0=1.0, decode_s_per_seq=1.0, decode_s_per_ctx_token=1.0,
                            kv_bytes_per_token=4096, link_bytes_per_s=1e10).model_dump()
    log = [{"kind": "prefill", "batch": 1, "sum_l": n, "sum_l2": n * n, "ctx_tokens": 0,
            "seconds": 0.01 + 1e-4 * n + 1e-7 * n * n} for n in (8, 20, 40, 64)]
    log += [{"kind": "decode", "batch": b, "sum_l": 0, "sum_l2": 0, "ctx_tokens": b * c,
             "seconds": 0.005 + 2e-4 * b + 1e-6 * b * c} for b in (1, 3, 8) for c in (20, 50)]
    got = P.fit_iterations(log, like)
    assert got["name"] == "tiny-cpu-server-log" and got["kv_bytes_per_token"] == 4096
    assert got["prefill_s0"] == pytest.approx(0.01) and got["decode_s_per_seq"] == pytest.approx(2e-4)
    assert got["decode_s_per_ctx_token"] == pytest.approx(1e-6)
    with pytest.raises(ValueError, match="too few distinct sizes"):
        P.fit_iterations(log[:2] + log[4:], like)


@pytest.mark.parametrize("bad, field", [
    ({"prompt_lengths": [8, 16]}, "prompt_lengths"),
    ({"decode_batches": [4, 4]}, "decode_batches"),
    ({"context_lengths": [0, 16, 32]}, "context_lengths"),
    ({"repeats": 1}, "repeats"),
    ({"link_bytes_per_s": 1e9}, "transfer_s0"),
    ({"prompt_lenghts": [8, 16, 32]}, "prompt_lenghts"),
])
def test_bad_config_is_rejected_by_name(bad, field):
    with pytest.raises(ValidationError, match=field):
        P.Config(**bad)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    import torch

    from stages.models import base
    from stages.models.tokenizer import build_tokenizer

    torch.manual_seed(0)
    tokenizer = build_tokenizer(set("0123456789+-=;#?:QA "))
    cfg = base.Config(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                      max_positions=64)
    folder = tmp_path_factory.mktemp("profile-model") / "tiny"
    base.build_model(cfg, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _ctx(tmp_path: Path, model: Path) -> Context:
    return Context(root=tmp_path, pipeline="x", stage="profile_engine", pipeline_dir=tmp_path,
                   profile="smoke", seed=0,
                   paths={"base_model": model, "serving_profile": tmp_path / "profile.json",
                          "serving_timings": tmp_path / "timings.parquet",
                          "metrics": tmp_path / "metrics"})


def test_profile_engine_measures_the_tiny_model_and_writes_the_profile(tiny_model, tmp_path):
    import polars as pl

    cfg = P.Config(prompt_lengths=[4, 16, 48], prefill_batches=[1, 2],
                   decode_batches=[1, 4], context_lengths=[8, 32], repeats=3, warmup=1,
                   timings="serving_timings")
    metrics = P.run(cfg, _ctx(tmp_path, tiny_model))
    profile = P.LatencyProfile(**json.loads((tmp_path / "profile.json").read_text()))
    assert profile.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4       # layers, heads, head_dim, fp32
    # the intercepts are non-negative fits: on a loaded machine a noisy fit may put one at 0, so
    # the check is that the profile predicts a positive time for the smallest step
    assert profile.prefill_s0 >= 0 and profile.decode_s0 >= 0
    assert profile.prefill_time(4) > 0 and profile.decode_step_time(1, 8) > 0
    assert min(profile.prefill_s_per_token, profile.prefill_s_per_token2,
               profile.decode_s_per_seq, profile.decode_s_per_ctx_token) >= 0
    assert profile.link_bytes_per_s > 0
    assert profile.fit["prefill_points"] == 6 and profile.fit["decode_points"] == 4
    assert {"prefill_mape", "prefill_r2", "decode_mape", "decode_r2"} <= set(profile.fit)
    assert "profile_engine" in profile.source and "DistServe" in profile.source
    assert metrics["decode_s0"] == profile.decode_s0
    timings = pl.read_parquet(tmp_path / "timings.parquet")
    assert timings.height == 6 + 4 + 4                       # prefill, decode, transfer points
    assert (timings["seconds"] > 0).all() and (timings["fitted_seconds"] > 0).all()


def test_grid_beyond_the_model_positions_fails_before_measuring(tiny_model, tmp_path):
    cfg = P.Config(prompt_lengths=[4, 16, 48], context_lengths=[8, 64])   # 64 + 1 > 64
    with pytest.raises(ValueError, match="context_lengths reach 65 positions; the model has 64"):
        P.run(cfg, _ctx(tmp_path, tiny_model))
    assert not (tmp_path / "profile.json").exists()
