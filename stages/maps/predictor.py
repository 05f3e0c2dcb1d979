"""MAPS output-length predictor: a regressor on the base model's hidden state of the prompt,
trained on the lengths the project's own model really generates, with a conformal upper bound.

The method (Zhang et al., ICML 2026, arXiv 2609.15359, §2 "Speculative predictor" and "UAC"):
  1. predict the output length L̂ from the prompt before decoding starts;
  2. calibrate L̂_up = L̂ + q_α on held-out requests (one-sided split conformal,
     `stages.maps.uac`), so P(L ≤ L̂_up) ≥ 1 - α;
  3. the dispatcher reserves KV blocks for L_prompt + L̂_up (`stages.maps.dispatch`).

Here, at tiny scale:
- Data. Prompts of a task split; the base model generates `samples_per_temperature` completions
  at every temperature in `temperatures` (0 = greedy), and we count the tokens it generated
  before `<eos>` (exact ids from `model.generate`, not re-tokenised text; a completion that hits
  `max_new_tokens` counts as that many and is reported in `truncated_rate`). The training target
  is the MAXIMUM length over those samples, as the paper's ("the maximum output length observed
  over LLaMA3.1-8B and Qwen2.5-3B at temperatures {0, 0.3, 0.5, 0.7}": deliberately
  conservative); `train_target: mean` is the alternative. The length a request "really" has when
  served is one sample at `served_temperature`: calibration residuals, coverage, MAE and Acc-k are
  measured against it, as the paper's UAC scores completed requests.
- Model. The paper LoRA-tunes a 160M/7B LM to print the length. We instead regress log(1 + L) on
  the mean-pooled last-layer hidden state of the prompt (plus log prompt length), with ridge
  (closed form, default) or a one-hidden-layer MLP head: the served model's own representation,
  the cheap variant of hidden-state predictors, and trainable in seconds on 2 cores.
- Splits. One seeded permutation of the prompts: train / calibration / test. q_α comes from the
  calibration split; coverage is checked on the test split against [1-α, 1-α + 1/(n_cal+1)].
- The spec's noise model (§4 "Predictor simulator": L̂ = max(1, L·e^ε + δ), two quality levels)
  is `noise_predictions`, a named extra predictor for simulator arms, not the default.

Saved as a folder: `head.safetensors` (weights and standardisation) + `config.json` (head shape,
feature settings, α, q_α, calibration size), written atomically; `load_predictor` reads it back.

    trained = train_predictor(model, tokenizer, prompts, Config(), seed=0)
    save_predictor(trained.predictor, "models/maps_predictor")
    p = load_predictor("models/maps_predictor"); p.upper(p.predict(model, tokenizer, prompts))
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.core import io
from stages.maps.uac import (conformal_quantile, coverage_bounds, min_calibration_size, quality,
                             upper_bound)

__all__ = ["Config", "LengthPredictor", "Trained", "conformal_quantile", "upper_bound",
           "generated_lengths", "prompt_features", "fit_head", "train_predictor",
           "save_predictor", "load_predictor", "split_indices", "NOISE_LEVELS",
           "noise_predictions", "run"]

FORMAT_VERSION = 1


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Inputs and outputs (paths keys, as in stages.evaluate.accuracy).
    family: str = Field("arith", description="task family whose prompts are used")
    split: str = Field("train", description="split the prompts come from")
    model: str = Field("base_model", description="paths key of the base model folder")
    predictor_path: str = Field("maps_predictor", description="paths key of the saved predictor")
    samples_path: str = Field("maps_lengths",
                              description="paths key of the per-prompt lengths/predictions parquet")
    n_prompts: int = Field(600, ge=12, le=1_000_000, description="prompts used (first N of split)")
    # Generation (what 'the output length' is).
    temperatures: list[float] = Field(
        default_factory=lambda: [0.0, 0.3, 0.5, 0.7], min_length=1,
        description="sampling temperatures, 0 = greedy (paper: {0, 0.3, 0.5, 0.7})")
    samples_per_temperature: int = Field(1, ge=1, le=64, description="completions per temperature")
    served_temperature: float = Field(
        0.7, ge=0, description="temperature of the sample taken as the served request's true "
                               "length (must be one of `temperatures`)")
    max_new_tokens: int = Field(96, ge=1, le=32768, description="generation cap, tokens")
    gen_batch_size: int = Field(128, ge=1, le=8192, description="sequences decoded together")
    train_target: Literal["max", "mean"] = Field(
        "max", description="per-prompt regression target over all samples (paper: max)")
    # Features and head.
    layer: int = Field(-1, description="hidden_states index pooled (-1: last layer, after norm)")
    add_prompt_length: bool = Field(True, description="append log(1 + prompt tokens) as a feature")
    feature_batch_size: int = Field(64, ge=1, le=8192, description="prompts per forward pass")
    head: Literal["ridge", "mlp"] = Field("ridge", description="regressor on the features")
    ridge_lambda: float = Field(1.0, ge=0, description="L2 penalty on standardised features")
    mlp_hidden: int = Field(64, ge=1, le=65536, description="MLP hidden units")
    mlp_epochs: int = Field(300, ge=1, le=100_000, description="full-batch Adam steps")
    mlp_lr: float = Field(1e-2, gt=0, le=1, description="MLP learning rate")
    mlp_weight_decay: float = Field(1e-4, ge=0, le=1, description="MLP AdamW weight decay")
    # Conformal calibration and evaluation.
    cal_fraction: float = Field(0.25, gt=0, lt=1, description="share of prompts for calibration")
    test_fraction: float = Field(0.25, gt=0, lt=1, description="share of prompts for the test")
    alpha: float = Field(0.1, gt=0, lt=1, description="miscoverage α (paper: 0.1)")
    register_as: str | None = Field("maps-predictor", description="MLflow registered model "
                                    "name (None: not registered)")
    acc_tokens: list[float] = Field(
        default_factory=lambda: [5, 10, 50, 100], min_length=1,
        description="k of Acc-k (paper: 50, 100; our completions are tens of tokens, so small "
                    "k are the informative ones)")

    @field_validator("temperatures")
    @classmethod
    def _temps(cls, value: list[float]) -> list[float]:
        if any(t < 0 for t in value) or len(set(value)) != len(value):
            raise ValueError(f"temperatures {value}: each must be >= 0 and listed once")
        return value

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if self.served_temperature not in self.temperatures:
            raise ValueError(f"served_temperature {self.served_temperature} is not one of "
                             f"temperatures {self.temperatures}")
        n_cal, n_test = split_sizes(self.n_prompts, self.cal_fraction, self.test_fraction)
        need = min_calibration_size(self.alpha)
        if n_cal < need:
            raise ValueError(f"n_prompts {self.n_prompts} x cal_fraction {self.cal_fraction} = "
                             f"{n_cal} calibration prompts: alpha = {self.alpha} needs at least "
                             f"{need} for a finite conformal quantile")
        if self.n_prompts - n_cal - n_test < 2:
            raise ValueError(f"cal_fraction + test_fraction ({self.cal_fraction} + "
                             f"{self.test_fraction}) leaves fewer than 2 of {self.n_prompts} "
                             "prompts to train on")
        return self


# --- data: what the model really generates ------------------------------------------------

def generated_lengths(model: Any, tokenizer: Any, prompts: Sequence[str], *,
                      max_new_tokens: int, temperature: float = 0.0, num_samples: int = 1,
                      batch_size: int = 64, seed: int = 0) -> np.ndarray:
    """Output tokens generated before `<eos>` per prompt and sample, shape (n_prompts, samples).

    Counted on the generated ids (the text of `stages.models.generate` drops special tokens and
    may re-tokenise differently). Greedy (temperature 0) decodes once and repeats the count.
    Prompts are sorted by length so a left-padded batch pads little; sampling is seeded and
    leaves the global RNG as it was.
    """
    if not prompts:
        return np.zeros((0, num_samples), dtype=np.int64)
    sample = temperature > 0
    reps = num_samples if sample else 1
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    encoded = tokenizer(list(prompts))["input_ids"]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    per_batch = max(1, batch_size // reps)
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": sample,
                              "pad_token_id": pad, "eos_token_id": eos, "use_cache": True}
    if sample:  # top_k=0: HF's default 50 would truncate a small vocabulary
        kwargs.update(temperature=temperature, top_p=1.0, top_k=0, num_return_sequences=reps)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    out = np.zeros((len(encoded), reps), dtype=np.int64)
    device = next(model.parameters()).device
    was_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
            torch.manual_seed(seed)
            for start in range(0, len(order), per_batch):
                idx = order[start:start + per_batch]
                batch = tokenizer.pad({"input_ids": [encoded[i] for i in idx]},
                                      return_tensors="pt").to(device)
                with torch.inference_mode():
                    ids = model.generate(**batch, **kwargs)
                new = ids[:, batch["input_ids"].shape[1]:]          # (rows * reps, steps)
                is_eos = new == eos
                # index of the first <eos>; rows that never stopped generated every column
                first = torch.where(is_eos.any(1), is_eos.int().argmax(1),
                                    torch.full_like(is_eos[:, 0], new.shape[1], dtype=torch.long))
                out[idx] = first.view(len(idx), reps).cpu().numpy()
    finally:
        tokenizer.padding_side = was_side
    return out if sample else np.repeat(out, num_samples, axis=1)


def prompt_features(model: Any, tokenizer: Any, prompts: Sequence[str], *, layer: int = -1,
                    add_prompt_length: bool = True, batch_size: int = 64) -> np.ndarray:
    """Mean-pooled hidden state of each prompt (n, d), plus log(1 + prompt tokens) (n, d + 1).

    Right padding with the attention mask, so positions match an unpadded forward pass and the
    mean covers the prompt's own tokens only.
    """
    encoded = tokenizer(list(prompts))["input_ids"]
    body = getattr(model, "base_model", model)   # the decoder without the LM head
    device = next(model.parameters()).device
    rows: list[np.ndarray] = []
    was_side = tokenizer.padding_side
    tokenizer.padding_side = "right"
    try:
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start:start + batch_size]
            batch = tokenizer.pad({"input_ids": chunk}, return_tensors="pt").to(device)
            with torch.inference_mode():
                hidden = body(**batch, output_hidden_states=True).hidden_states[layer]
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)   # (B, T, 1)
            pooled = (hidden * mask).sum(1) / mask.sum(1)                    # (B, d)
            rows.append(pooled.float().cpu().numpy())
    finally:
        tokenizer.padding_side = was_side
    feats = np.concatenate(rows).astype(np.float64)
    if add_prompt_length:
        lengths = np.array([len(e) for e in encoded], dtype=np.float64)
        feats = np.concatenate([feats, np.log1p(lengths)[:, None]], axis=1)
    return feats


# --- the regressor ---------------------------------------------------------------------------

class LengthHead(torch.nn.Module):
    """Standardise features -> ridge (linear) or MLP -> de-standardise -> L̂ = expm1(log-length)."""

    def __init__(self, in_features: int, kind: str = "ridge", hidden: int = 64):
        super().__init__()
        self.kind, self.in_features, self.hidden = kind, in_features, hidden
        if kind == "ridge":
            self.net = torch.nn.Sequential(torch.nn.Linear(in_features, 1))
        elif kind == "mlp":
            self.net = torch.nn.Sequential(torch.nn.Linear(in_features, hidden), torch.nn.ReLU(),
                                           torch.nn.Linear(hidden, 1))
        else:
            raise ValueError(f"head kind {kind!r}: expected 'ridge' or 'mlp'")
        self.net.double()   # float64 throughout: the ridge solution is stored exactly
        for name in ("x_mean", "x_std"):
            self.register_buffer(name, torch.zeros(in_features, dtype=torch.float64))
        for name in ("y_mean", "y_std"):
            self.register_buffer(name, torch.zeros(1, dtype=torch.float64))

    def log_length(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.x_mean) / self.x_std).squeeze(-1) * self.y_std + self.y_mean

    def predict(self, features: np.ndarray) -> np.ndarray:
        x = torch.as_tensor(np.asarray(features, dtype=np.float64))
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"features of shape {tuple(x.shape)}: the head expects "
                             f"(n, {self.in_features})")
        with torch.no_grad():
            return np.maximum(0.0, np.expm1(self.log_length(x).numpy()))


def fit_head(features: np.ndarray, lengths: np.ndarray, *, kind: str = "ridge",
             ridge_lambda: float = 1.0, hidden: int = 64, epochs: int = 300, lr: float = 1e-2,
             weight_decay: float = 1e-4, seed: int = 0) -> LengthHead:
    """Fit log(1 + L) on standardised features. Ridge: closed form
    w = (ZᵀZ + λI)⁻¹ Zᵀy on centred data; MLP: full-batch AdamW on the squared error."""
    x = np.asarray(features, dtype=np.float64)
    y = np.log1p(np.asarray(lengths, dtype=np.float64))
    if x.ndim != 2 or len(x) != len(y) or len(y) < 2:
        raise ValueError(f"need (n, d) features and n >= 2 lengths, got {x.shape} and {y.shape}")
    if np.any(np.asarray(lengths) < 0) or not np.all(np.isfinite(x)):
        raise ValueError("lengths must be >= 0 and features finite")
    head = LengthHead(x.shape[1], kind, hidden)
    x_mean, x_std = x.mean(0), x.std(0)
    x_std = np.where(x_std > 1e-8, x_std, 1.0)       # constant features: leave them at 0
    y_mean, y_std = float(y.mean()), float(y.std()) or 1.0
    head.x_mean.copy_(torch.as_tensor(x_mean))
    head.x_std.copy_(torch.as_tensor(x_std))
    head.y_mean.fill_(y_mean)
    head.y_std.fill_(y_std)
    z, t = (x - x_mean) / x_std, (y - y_mean) / y_std
    if kind == "ridge":
        w = np.linalg.solve(z.T @ z + ridge_lambda * np.eye(z.shape[1]), z.T @ t)
        with torch.no_grad():
            head.net[0].weight.copy_(torch.as_tensor(w[None, :]))
            head.net[0].bias.zero_()   # centred target
        return head.eval()
    gen = torch.Generator().manual_seed(seed)
    for p in head.net.parameters():   # seeded init, independent of the global RNG
        bound = 1.0 / math.sqrt(p.shape[-1]) if p.ndim == 2 else 0.01
        with torch.no_grad():
            p.uniform_(-bound, bound, generator=gen)
    zt, tt = torch.as_tensor(z), torch.as_tensor(t)
    opt = torch.optim.AdamW(head.net.parameters(), lr=lr, weight_decay=weight_decay)
    head.train()
    for _ in range(epochs):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(head.net(zt).squeeze(-1), tt)
        loss.backward()
        opt.step()
    return head.eval()


@dataclass
class LengthPredictor:
    """A fitted head + the feature recipe + its conformal quantile q_α."""

    head: LengthHead
    layer: int = -1
    add_prompt_length: bool = True
    alpha: float = 0.1
    q: float = math.inf
    n_calibration: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def features(self, model: Any, tokenizer: Any, prompts: Sequence[str],
                 batch_size: int = 64) -> np.ndarray:
        return prompt_features(model, tokenizer, prompts, layer=self.layer,
                               add_prompt_length=self.add_prompt_length, batch_size=batch_size)

    def predict(self, model: Any, tokenizer: Any, prompts: Sequence[str]) -> np.ndarray:
        """L̂ for each prompt (tokens, >= 0)."""
        return self.head.predict(self.features(model, tokenizer, prompts))

    def upper(self, pred: np.ndarray) -> np.ndarray:
        """L̂_up = L̂ + q_α."""
        return upper_bound(np.asarray(pred, dtype=np.float64), self.q)


def save_predictor(predictor: LengthPredictor, path: str | Path) -> Path:
    """`head.safetensors` + `config.json` in folder `path`, swapped in atomically."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous().cpu() for k, v in predictor.head.state_dict().items()}
    config = {"format_version": FORMAT_VERSION, "head": predictor.head.kind,
              "in_features": predictor.head.in_features, "hidden": predictor.head.hidden,
              "layer": predictor.layer, "add_prompt_length": predictor.add_prompt_length,
              "alpha": predictor.alpha, "q": predictor.q if math.isfinite(predictor.q) else None,
              "n_calibration": predictor.n_calibration, "meta": predictor.meta}
    with io.atomic_path(path, is_dir=True) as tmp:
        save_file(state, str(tmp / "head.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return Path(path)


def load_predictor(path: str | Path) -> LengthPredictor:
    """Read a folder written by `save_predictor`; a missing or mismatched file is named."""
    from safetensors.torch import load_file

    folder = Path(path)
    for name in ("config.json", "head.safetensors"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name}: missing; expected a folder written by "
                                    "stages.maps.predictor.save_predictor")
    config = json.loads((folder / "config.json").read_text())
    if config.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{folder / 'config.json'}: format_version "
                         f"{config.get('format_version')!r}, expected {FORMAT_VERSION}")
    head = LengthHead(int(config["in_features"]), config["head"], int(config["hidden"]))
    try:
        head.load_state_dict(load_file(str(folder / "head.safetensors")), strict=True)
    except RuntimeError as err:
        raise ValueError(f"{folder / 'head.safetensors'} does not match config.json: {err}") from err
    q = config["q"]
    return LengthPredictor(head=head.eval(), layer=int(config["layer"]),
                           add_prompt_length=bool(config["add_prompt_length"]),
                           alpha=float(config["alpha"]), q=math.inf if q is None else float(q),
                           n_calibration=int(config["n_calibration"]), meta=config["meta"])


# --- training, calibration, evaluation ---------------------------------------------------------

def split_sizes(n: int, cal_fraction: float, test_fraction: float) -> tuple[int, int]:
    return int(round(n * cal_fraction)), max(1, int(round(n * test_fraction)))


def split_indices(n: int, cal_fraction: float, test_fraction: float,
                  seed: int) -> dict[str, np.ndarray]:
    """One seeded permutation cut into train / cal / test index arrays (disjoint, all of 0..n-1)."""
    n_cal, n_test = split_sizes(n, cal_fraction, test_fraction)
    perm = np.random.default_rng(seed).permutation(n)
    return {"test": np.sort(perm[:n_test]), "cal": np.sort(perm[n_test:n_test + n_cal]),
            "train": np.sort(perm[n_test + n_cal:])}


@dataclass
class Trained:
    predictor: LengthPredictor
    table: Any                      # polars DataFrame, one row per prompt
    metrics: dict[str, float]


def train_predictor(model: Any, tokenizer: Any, prompts: Sequence[str], cfg: Config,
                    seed: int = 0, ids: Sequence[str] | None = None) -> Trained:
    """Generate, featurise, fit on train, calibrate q_α on cal, evaluate on test."""
    import polars as pl

    prompts = list(prompts)
    if len(prompts) != cfg.n_prompts:
        raise ValueError(f"got {len(prompts)} prompts, config n_prompts = {cfg.n_prompts}")
    started = time.perf_counter()
    per_temp = [generated_lengths(model, tokenizer, prompts, max_new_tokens=cfg.max_new_tokens,
                                  temperature=t, num_samples=cfg.samples_per_temperature,
                                  batch_size=cfg.gen_batch_size, seed=seed + i)
                for i, t in enumerate(cfg.temperatures)]
    lengths = np.concatenate(per_temp, axis=1)                      # (n, T * S)
    served = per_temp[cfg.temperatures.index(cfg.served_temperature)][:, 0].astype(np.float64)
    target = lengths.max(1) if cfg.train_target == "max" else lengths.mean(1)
    gen_seconds = time.perf_counter() - started

    started = time.perf_counter()
    feats = prompt_features(model, tokenizer, prompts, layer=cfg.layer,
                            add_prompt_length=cfg.add_prompt_length,
                            batch_size=cfg.feature_batch_size)
    split = split_indices(len(prompts), cfg.cal_fraction, cfg.test_fraction, seed)
    head = fit_head(feats[split["train"]], target[split["train"]], kind=cfg.head,
                    ridge_lambda=cfg.ridge_lambda, hidden=cfg.mlp_hidden, epochs=cfg.mlp_epochs,
                    lr=cfg.mlp_lr, weight_decay=cfg.mlp_weight_decay, seed=seed)
    pred = head.predict(feats)
    cal, test = split["cal"], split["test"]
    q = conformal_quantile(served[cal] - pred[cal], cfg.alpha)
    fit_seconds = time.perf_counter() - started

    predictor = LengthPredictor(head=head, layer=cfg.layer, add_prompt_length=cfg.add_prompt_length,
                                alpha=cfg.alpha, q=q, n_calibration=len(cal),
                                meta={"train_target": cfg.train_target,
                                      "served_temperature": cfg.served_temperature,
                                      "temperatures": cfg.temperatures,
                                      "max_new_tokens": cfg.max_new_tokens})
    lo, hi = coverage_bounds(len(cal), cfg.alpha)
    metrics = {f"test_{k}": v for k, v in quality(pred[test], served[test], q,
                                                  cfg.acc_tokens).items()}
    # the floor a predictor must beat: the train median for every prompt
    constant = np.full(len(test), float(np.median(target[split["train"]])))
    metrics.update({
        "q_alpha": q, "alpha": cfg.alpha, "coverage_lower_bound": lo, "coverage_upper_bound": hi,
        "test_mae_constant": float(np.mean(np.abs(constant - served[test]))),
        "test_mae_vs_target": float(np.mean(np.abs(pred[test] - target[test]))),
        "n_train": float(len(split["train"])), "n_cal": float(len(cal)),
        "n_test": float(len(test)), "mean_served_length": float(served.mean()),
        "truncated_rate": float(np.mean(lengths >= cfg.max_new_tokens)),
        "gen_seconds": gen_seconds, "fit_seconds": fit_seconds})
    which = np.empty(len(prompts), dtype=object)
    for name, idx in split.items():
        which[idx] = name
    prompt_tokens = [len(e) for e in tokenizer(prompts)["input_ids"]]
    table = pl.DataFrame({
        "id": list(ids) if ids is not None else [f"p{i:06d}" for i in range(len(prompts))],
        "prompt": prompts, "split": which.tolist(), "prompt_tokens": prompt_tokens,
        "served_length": served.astype(np.int64), "target_length": target.astype(np.float64),
        "lengths": lengths.tolist(), "pred": pred, "upper": pred + q})
    return Trained(predictor, table, metrics)


# --- the spec's noise-model predictor (an extra, named arm) -------------------------------------

# ε ~ N(eps_mean, eps_sd), δ ~ N(0, delta_sd); L̂ = max(1, L·e^ε + δ)  (maps.md §4).
# sp7b: the spec's constants verbatim. On a lognormal reference (median 100 tokens, σ = 1,
#       mean ≈ 165) they give MAE ≈ 55, Acc-100 ≈ 0.87 (the paper's SP-7B: 56, 85%).
# sp160m: tuned here on the same reference to MAE ≈ 92, Acc-100 ≈ 0.65 (the paper's SP-160M:
#       92.2, 65%); Acc-100 that low at that MAE needs heavy additive noise [reconstructed].
NOISE_LEVELS: dict[str, dict[str, float]] = {
    "sp7b": {"eps_mean": 0.05, "eps_sd": 0.35, "delta_sd": 20.0},
    "sp160m": {"eps_mean": 0.05, "eps_sd": 0.25, "delta_sd": 120.0},
}


def noise_predictions(true_lengths: Sequence[float], level: str = "sp7b", *,
                      seed: int | np.random.Generator = 0) -> np.ndarray:
    """The spec's simulated predictor: L̂ = max(1, L·e^ε + δ) at quality `level`."""
    if level not in NOISE_LEVELS:
        raise ValueError(f"noise level {level!r}: expected one of {sorted(NOISE_LEVELS)}")
    p = NOISE_LEVELS[level]
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    L = np.asarray(true_lengths, dtype=np.float64)
    eps = rng.normal(p["eps_mean"], p["eps_sd"], L.shape)
    delta = rng.normal(0.0, p["delta_sd"], L.shape)
    return np.maximum(1.0, L * np.exp(eps) + delta)


# --- stage entry (the lead wires it into pipelines/maps) -----------------------------------------

def run(cfg: Config, ctx: Any) -> dict[str, float]:
    """Train the predictor on the first `n_prompts` prompts of `<tasks>/<family>/<split>`;
    write the predictor folder and the per-prompt table; return the test metrics."""
    from stages.models.base import set_threads
    from stages.models.generate import load_model
    from stages.tasks import load_split

    set_threads(0)
    df = load_split(ctx.path("tasks"), cfg.family, cfg.split)
    if df.height < cfg.n_prompts:
        raise ValueError(f"n_prompts = {cfg.n_prompts}: split {cfg.family}/{cfg.split} has only "
                         f"{df.height} rows")
    df = df.head(cfg.n_prompts)
    model, tokenizer = load_model(ctx.path(cfg.model))
    trained = train_predictor(model, tokenizer, df["prompt"].to_list(), cfg, seed=ctx.seed,
                              ids=df["id"].to_list())
    trained.predictor.meta["base_model"] = str(cfg.model)
    save_predictor(trained.predictor, ctx.path(cfg.predictor_path))
    io.write_parquet(ctx.path(cfg.samples_path), trained.table)
    m = trained.metrics
    if cfg.register_as and ctx.tracker is not None:   # with the run that made it
        ctx.tracker.register_model(ctx.path(cfg.predictor_path), cfg.register_as,
                                   aliases=["champion"], artifact_path="maps-predictor")
    print(f"maps predictor: test MAE {m['test_mae']:.2f} (constant {m['test_mae_constant']:.2f}), "
          f"q_alpha {m['q_alpha']:.1f}, coverage {m['test_coverage']:.3f} "
          f"(bounds {m['coverage_lower_bound']:.3f}..{m['coverage_upper_bound']:.3f})")
    return m


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the length predictor's test MAE, Acc-100 and conformal coverage."""
    return {k: metrics[k] for k in ("test_mae", "test_acc_100", "test_coverage") if k in metrics}
