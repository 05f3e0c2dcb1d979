"""MAPS length predictor on a real tiny model: token counting on what the model generates, the
regressor learning from its prompt hidden states, conformal calibration and the test metrics,
the safetensors round trip, config validation and the stage entry `run`.

The model is the project's tiny Llama over the char tokenizer (`stages.models.base`), trained
for a few seconds to answer `" ok" * (operands - 1)`: output lengths 3, 5 or 7 tokens that
depend on the prompt, so a predictor has something real to learn.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from stages.core.context import Context
from stages.core import io
from stages.maps import predictor as P
from stages.models import base
from stages.models.generate import generate, load_model
from stages.models.tokenizer import build_tokenizer
from stages.tasks import arith
from stages.tasks.build import family_frames

N = 48


def answer(n_operands: int) -> str:
    return " " + "ok" * (n_operands - 1)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return family_frames("arith", arith.Config(), {"train": N}, seed=1)["train"].to_dicts()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, rows) -> Path:
    torch.manual_seed(0)
    tokenizer = build_tokenizer(set("0123456789+-=;#?:QA ok"))
    cfg = base.Config(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                      max_positions=64, steps=80, batch_size=24, lr=1e-2, warmup=0.0,
                      log_every=1000, group_by_length=False)
    model = base.build_model(cfg, tokenizer)
    train_rows = base.encode_sft_rows(tokenizer, [r["prompt"] for r in rows],
                                      [answer(r["n_operands"]) for r in rows], max_len=64)
    base.train(cfg, model, tokenizer, train_rows, seed=0)
    folder = tmp_path_factory.mktemp("maps-model") / "base"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(model_dir, device="cpu")


def small_config(**kw) -> P.Config:
    values = dict(n_prompts=N, temperatures=[0.0, 0.7], served_temperature=0.7,
                  samples_per_temperature=2, max_new_tokens=16, gen_batch_size=32, alpha=0.2,
                  acc_tokens=[1, 2])
    values.update(kw)
    return P.Config(**values)


def test_lengths_are_the_tokens_generated_before_eos(loaded, rows):
    model, tokenizer = loaded
    prompts = [r["prompt"] for r in rows]
    greedy = P.generated_lengths(model, tokenizer, prompts, max_new_tokens=16, batch_size=16)
    assert greedy.shape == (N, 1)
    # the count is exactly the decoded completion's length (one token per character here)
    texts = generate(model, tokenizer, prompts, max_new_tokens=16, batch_size=16)
    assert greedy[:, 0].tolist() == [len(t[0]) for t in texts]
    # ... and the model learned its length rule: 3, 5 or 7 tokens by operand count
    intended = np.array([len(answer(r["n_operands"])) for r in rows])
    assert np.mean(greedy[:, 0] == intended) >= 0.9
    # a cap shorter than the answer counts the cap (truncated)
    assert P.generated_lengths(model, tokenizer, prompts[:4], max_new_tokens=2).tolist() == [[2]] * 4
    # sampling: shape, seeded, the global RNG left alone
    state = torch.get_rng_state()
    sampled = P.generated_lengths(model, tokenizer, prompts, max_new_tokens=16, temperature=0.7,
                                  num_samples=3, batch_size=12, seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    assert sampled.shape == (N, 3) and sampled.min() >= 0 and sampled.max() <= 16
    assert np.array_equal(sampled, P.generated_lengths(model, tokenizer, prompts,
                                                       max_new_tokens=16, temperature=0.7,
                                                       num_samples=3, batch_size=12, seed=5))
    assert P.generated_lengths(model, tokenizer, prompts[:2], max_new_tokens=8,
                               num_samples=4).shape == (2, 4)   # greedy repeated


@pytest.mark.parametrize("kind", ["ridge", "mlp"])
@pytest.mark.parametrize("add_prompt_length", [True, False])
def test_head_learns_lengths_from_prompt_hidden_states(loaded, rows, kind, add_prompt_length):
    model, tokenizer = loaded
    prompts = [r["prompt"] for r in rows]
    feats = P.prompt_features(model, tokenizer, prompts, add_prompt_length=add_prompt_length,
                              batch_size=7)
    assert feats.shape == (N, 32 + add_prompt_length)
    # right padding + mask: a prompt's features do not depend on its batch
    alone = P.prompt_features(model, tokenizer, prompts[:1], add_prompt_length=add_prompt_length)
    assert np.allclose(alone[0], feats[0], atol=1e-5)
    lengths = np.array([len(answer(r["n_operands"])) for r in rows], dtype=float)
    train, test = np.arange(32), np.arange(32, N)
    head = P.fit_head(feats[train], lengths[train], kind=kind, ridge_lambda=1.0, epochs=200)
    pred = head.predict(feats[test])
    mae = np.mean(np.abs(pred - lengths[test]))
    constant = np.mean(np.abs(np.median(lengths[train]) - lengths[test]))
    assert mae < 0.5 * constant, (mae, constant)


def test_train_calibrate_evaluate_and_round_trip(loaded, rows, tmp_path):
    model, tokenizer = loaded
    prompts = [r["prompt"] for r in rows]
    cfg = small_config()
    trained = P.train_predictor(model, tokenizer, prompts, cfg, seed=0)
    m, table = trained.metrics, trained.table
    assert (m["n_train"], m["n_cal"], m["n_test"]) == (24, 12, 12)
    assert 0 <= m["q_alpha"] < math.inf and trained.predictor.q == m["q_alpha"]
    assert m["coverage_lower_bound"] == pytest.approx(0.8)
    assert m["coverage_upper_bound"] == pytest.approx(0.8 + 1 / 13)
    assert 0 <= m["test_coverage"] <= 1 and 0 <= m["test_acc_2"] <= 1
    assert m["test_mae"] < m["test_mae_constant"]        # it beats predicting the median
    assert table.height == N and set(table["split"]) == {"train", "cal", "test"}
    # q_alpha is the conformal quantile of the served lengths' residuals on the cal split
    cal = table.filter(table["split"] == "cal")
    assert m["q_alpha"] == P.conformal_quantile(cal["served_length"] - cal["pred"], 0.2)
    assert np.allclose(table["upper"], table["pred"] + m["q_alpha"])
    # the max-over-samples target is at least every sample
    assert all(t >= max(ls) for t, ls in zip(table["target_length"], table["lengths"]))

    P.save_predictor(trained.predictor, tmp_path / "pred")
    assert sorted(p.name for p in (tmp_path / "pred").iterdir()) == ["config.json",
                                                                    "head.safetensors"]
    again = P.load_predictor(tmp_path / "pred")
    assert again.q == trained.predictor.q and again.alpha == 0.2
    assert np.allclose(again.predict(model, tokenizer, prompts), table["pred"].to_numpy())
    assert np.allclose(again.upper(table["pred"].to_numpy()), table["upper"].to_numpy())


def test_load_names_what_is_wrong(loaded, rows, tmp_path):
    model, tokenizer = loaded
    feats = P.prompt_features(model, tokenizer, [r["prompt"] for r in rows[:20]])
    head = P.fit_head(feats, np.arange(20.0))
    P.save_predictor(P.LengthPredictor(head=head, q=3.0), tmp_path / "p")
    config = json.loads((tmp_path / "p" / "config.json").read_text())
    io.write_text(tmp_path / "p" / "config.json", json.dumps({**config, "in_features": 7}))
    with pytest.raises(ValueError, match="does not match config.json"):
        P.load_predictor(tmp_path / "p")
    (tmp_path / "p" / "head.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="head.safetensors"):
        P.load_predictor(tmp_path / "p")
    with pytest.raises(ValueError, match=r"expects \(n, 33\)"):
        head.predict(np.zeros((2, 5)))


def test_bad_config_is_rejected_before_compute():
    with pytest.raises(ValidationError, match="served_temperature"):
        P.Config(temperatures=[0.0, 0.3], served_temperature=0.7)
    with pytest.raises(ValidationError, match="calibration prompts"):
        P.Config(n_prompts=40, alpha=0.05)             # 10 calibration prompts, needs 19
    with pytest.raises(ValidationError, match="fewer than 2"):
        P.Config(n_prompts=20, cal_fraction=0.5, test_fraction=0.45)
    with pytest.raises(ValidationError, match="extra"):
        P.Config(learning_rate=1.0)
    with pytest.raises(ValidationError, match="listed once"):
        P.Config(temperatures=[0.0, 0.0])


def test_run_writes_the_predictor_and_the_table(model_dir, rows, tmp_path):
    tasks = tmp_path / "data" / "tasks"
    io.write_parquet(tasks / "arith" / "train.parquet",
                     family_frames("arith", arith.Config(), {"train": N}, seed=1)["train"])
    paths = {"tasks": tasks, "base_model": model_dir, "maps_predictor": tmp_path / "pred",
             "maps_lengths": tmp_path / "lengths.parquet"}
    ctx = Context(root=tmp_path, pipeline="maps", stage="predictor", pipeline_dir=tmp_path,
                  profile="smoke", seed=0, paths=paths)
    metrics = P.run(small_config(), ctx)
    assert metrics["n_test"] == 12 and math.isfinite(metrics["q_alpha"])
    assert P.load_predictor(tmp_path / "pred").meta["base_model"] == "base_model"
    import polars as pl

    table = pl.read_parquet(tmp_path / "lengths.parquet")
    assert table["id"].to_list() == [r["id"] for r in rows]
    with pytest.raises(ValueError, match="has only 48 rows"):
        P.run(small_config(n_prompts=60), ctx)
