"""Stage `train` of Refine-Prover: per seed, the base prover, the refiner (cold start, then
expert iteration on its own failures) and the value model.

1. Base prover: a tiny Llama (spec §4: 2 layers, d = 128) trained from scratch, completion-only
   SFT (`stages.train.sft`) on `T:<statement> P:` -> canonical proof of the train statements.
2. Cold-start refiner: a copy of the base prover fine-tuned on (statement, failed proof, error)
   -> the scripted fixer's repair of the first error (`kernel.scripted_fix`; the paper's Claude
   repairs). Failed proofs: the base prover's own samples on train statements plus synthetic
   corruptions of canonical proofs. A `history_share` of rows put 1-2 other failed attempts of
   the same statement before the last one, so the same refiner can read the long-history prompt.
3. Expert iteration (spec §2, `ei_rounds` rounds): the refiner repairs a pool of failed proofs
   (the base prover's, then its own failed repairs); repairs the kernel accepts join the SFT set
   and the refiner is fine-tuned on the cold-start rows plus every accepted repair so far.
4. Value model: random refinement trees with the final refiner on the `value` split; every
   expansion is a row (phi(parent), child accepted); `prover.fit_value`. Labels of one class
   only (no expansion accepted, say) leave V constant: `value_degenerate` = 1 for that seed
   (`mean/value_degenerate` = the share of seeds) and a warning in the log.

Saved per seed under `models/seed<k>/`: `base/`, `refiner_cold/`, `refiner/` (save_pretrained,
safetensors) and `value.json`; registered in MLflow as `refine-prover-base` / `-refiner` with
aliases per seed.

    python -m stages refine_prover train
"""

from __future__ import annotations

import copy
import random
import string
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.refine_prover import kernel, prover


class SFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(300, ge=1, description="optimizer steps")
    batch_size: int = Field(32, ge=1, description="rows per step")
    lr: float = Field(2e-3, gt=0, le=1, description="peak learning rate")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seeds: list[int] = Field(min_length=1, description="training seeds")
    hidden_size: int = Field(128, ge=16, description="model width d [paper-spec: 128]")
    num_layers: int = Field(2, ge=1, description="decoder layers [spec: 2]")
    num_heads: int = Field(4, ge=1, description="attention heads")
    max_positions: int = Field(512, ge=64, description="context (chars); the long-history "
                                                       "prompt must fit")
    base: SFTConfig = Field(default_factory=SFTConfig, description="base prover SFT")
    cold: SFTConfig = Field(default_factory=SFTConfig, description="cold-start refiner SFT")
    ei: SFTConfig = Field(default_factory=SFTConfig, description="SFT per expert-iteration round")
    ei_rounds: int = Field(2, ge=0, le=5, description="expert-iteration rounds [spec: 2-3]")
    ei_pool: int = Field(400, ge=1, description="failed proofs repaired per round")
    ei_samples: int = Field(2, ge=1, description="repairs sampled per failed proof")
    base_samples: int = Field(2, ge=1, description="base samples per train statement (failures "
                                                   "for the cold start)")
    synthetic_per_statement: int = Field(1, ge=0, description="synthetic wrong proofs per train "
                                                              "statement")
    history_share: float = Field(0.3, ge=0, le=1, description="refiner rows in the long-history "
                                                              "format")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    max_new_tokens: int = Field(110, ge=8, description="longest proof (chars)")
    value_budget: int = Field(16, ge=1, description="generations per value-split tree")
    value_l2: float = Field(1e-2, ge=0, description="ridge penalty of the value model")
    prior_strength: float = Field(2.0, gt=0, description="k0 of the value re-ranking")
    problems: str = Field("refine_prover_problems", description="paths key of the problems")
    out: str = Field("refine_prover_models", description="paths key of the models folder")
    num_threads: int = Field(0, ge=0, description="torch threads per process (0: all cores)")
    workers: int = Field(1, ge=1, le=64, description="seeds trained side by side in spawned "
                                                     "processes (stages.core.pool); the models "
                                                     "do not depend on it, the wall time does")


def load_problems(ctx: Any, key: str) -> Any:
    from stages.core.checks import read_parquet_checked
    from stages.refine_prover.problems import problem_spec

    df = read_parquet_checked(ctx.path(key) / "problems.parquet", problem_spec())
    for st in df["statement"].to_list():
        kernel.parse_statement(st)          # a malformed statement is named here
    return df


def new_model(cfg: Config) -> tuple[Any, Any]:
    from stages.models import base
    from stages.models.tokenizer import build_tokenizer

    tok = build_tokenizer(set(string.printable) - set("\t\n\r\x0b\x0c"))
    mcfg = base.Config(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                       num_heads=cfg.num_heads, intermediate_size=2 * cfg.hidden_size,
                       max_positions=cfg.max_positions)
    return base.build_model(mcfg, tok), tok


def sft(model: Any, tok: Any, rows: list[tuple[str, str]], sc: SFTConfig, seed: int) -> float:
    from stages.train.sft import sft as run_sft

    out = run_sft(model, tok, [p for p, _ in rows], [c for _, c in rows], steps=sc.steps,
                  batch_size=sc.batch_size, lr=sc.lr, seed=seed, warmup=0.05, min_lr_ratio=0.1,
                  log_every=max(sc.steps, 1))
    return float(out["train_loss"])


def refine_rows(failed: list[tuple[str, str]], rng: random.Random, history_share: float,
                others: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(prompt, target) rows: failed proof + error -> scripted repair of the first error."""
    rows = []
    for st, proof in failed:
        res = kernel.check(st, proof)
        fix = kernel.scripted_fix(st, proof, res)
        if res.ok or fix == proof:
            continue
        pool = [p for p in others.get(st, []) if p != proof]
        if pool and rng.random() < history_share:
            earlier = rng.sample(pool, min(len(pool), rng.randint(1, 2)))
            attempts = [(p, kernel.check(st, p).feedback()) for p in earlier]
            rows.append((prover.history_prompt(st, attempts + [(proof, res.feedback())]), fix))
        else:
            rows.append((prover.refine_prompt(st, proof, res.feedback()), fix))
    return rows


def _seed_job(job: tuple[Config, Any, Any, int, Any]) -> dict[str, float]:
    """One seed, from its own seed alone (so in any process, in any order)."""
    import torch
    from transformers import set_seed

    from stages.models.base import set_threads

    cfg, train, value_split, seed, folder = job
    set_threads(cfg.num_threads)
    set_seed(seed)
    return train_seed(cfg, train, value_split, seed, random.Random(seed), folder, torch)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.pool import map_jobs

    df = load_problems(ctx, cfg.problems)
    train = df.filter(df["split"] == "train")
    value_split = df.filter(df["split"] == "value")
    out = ctx.path(cfg.out)
    metrics: dict[str, float] = {}
    with io.atomic_path(out, is_dir=True) as tmp:
        done = map_jobs(_seed_job, [(cfg, train, value_split, seed, tmp / f"seed{seed}")
                                    for seed in cfg.seeds], cfg.workers)
    for seed, m in zip(cfg.seeds, done):
        metrics.update({f"seed{seed}/{k}": v for k, v in m.items()})
        with ctx.method_run("train", "refiner", seed, {"seed": seed}) as run_:
            run_.log_metrics(m)
    for key in sorted({k.split("/", 1)[1] for k in metrics}):
        vals = [metrics[f"seed{s}/{key}"] for s in cfg.seeds if f"seed{s}/{key}" in metrics]
        metrics[f"mean/{key}"] = float(np.mean(vals))
    if ctx.tracker is not None:
        for seed in cfg.seeds:
            for name in ("base", "refiner"):
                ctx.tracker.register_model(out / f"seed{seed}" / name, f"refine-prover-{name}",
                                           [f"seed{seed}"], tags={"arm": name})
    return metrics


def train_seed(cfg: Config, train: Any, value_split: Any, seed: int, rng: random.Random,
               folder: Any, torch: Any) -> dict[str, float]:
    statements = train["statement"].to_list()
    proofs = train["proof"].to_list()
    m: dict[str, float] = {}

    torch.manual_seed(seed)
    base_model, tok = new_model(cfg)
    m["base_loss"] = sft(base_model, tok, [(prover.base_prompt(s), p)
                                           for s, p in zip(statements, proofs)], cfg.base, seed)
    base_model.generation_config.pad_token_id = tok.pad_token_id
    base_model.generation_config.eos_token_id = tok.eos_token_id
    io.save_model(base_model, tok, folder / "base")
    base_gen = prover.Generator(base_model, tok, cfg.max_new_tokens, cfg.temperature)

    # The base prover's own failures on the train statements (plus synthetic ones).
    samples = base_gen([prover.base_prompt(s) for s in statements], seed=seed,
                       num_samples=cfg.base_samples)
    failed, others, ok = [], {}, 0
    for st, outs in zip(statements, samples):
        for t in outs:
            t = t.strip()
            if kernel.check(st, t).ok:
                ok += 1
            else:
                failed.append((st, t))
                others.setdefault(st, []).append(t)
    m["base_train_accept"] = ok / max(len(statements) * cfg.base_samples, 1)
    synthetic = [(st, kernel.corrupt(p, rng)) for st, p in zip(statements, proofs)
                 for _ in range(cfg.synthetic_per_statement)]
    cold_rows = refine_rows(failed + synthetic, rng, cfg.history_share, others)
    m["cold_rows"] = float(len(cold_rows))

    refiner = copy.deepcopy(base_model)
    m["cold_loss"] = sft(refiner, tok, cold_rows, cfg.cold, seed)
    io.save_model(refiner, tok, folder / "refiner_cold")
    ref_gen = prover.Generator(refiner, tok, cfg.max_new_tokens, cfg.temperature)

    # Expert iteration on its own failures: repair, keep what compiles, retrain.
    pool = failed[:]
    rng.shuffle(pool)
    accepted_rows: list[tuple[str, str]] = []
    for r in range(cfg.ei_rounds):
        batch = pool[:cfg.ei_pool]
        prompts = [prover.refine_prompt(st, p, kernel.check(st, p).feedback()) for st, p in batch]
        outs = ref_gen(prompts, seed=seed * 1000 + r, num_samples=cfg.ei_samples)
        new_fail, kept = [], 0
        for (st, _), prompt, reps in zip(batch, prompts, outs):
            for t in reps:
                t = t.strip()
                if kernel.check(st, t).ok:
                    accepted_rows.append((prompt, t))
                    kept += 1
                else:
                    new_fail.append((st, t))
        m[f"ei{r + 1}_repair_accept"] = kept / max(len(batch) * cfg.ei_samples, 1)
        rng.shuffle(new_fail)
        pool = new_fail + pool[cfg.ei_pool:]       # its own failures first
        if accepted_rows:
            m[f"ei{r + 1}_loss"] = sft(refiner, tok, cold_rows + accepted_rows, cfg.ei,
                                       seed + 17 * (r + 1))
    m["ei_rows"] = float(len(accepted_rows))
    io.save_model(refiner, tok, folder / "refiner")

    # The value model from random trees on the value split.
    problems = dict(zip(value_split["id"].to_list(), value_split["statement"].to_list()))
    model = prover.RefineModel(base_gen, ref_gen, seed=seed)
    prover.run_tree(problems, model, cfg.value_budget, "random")
    x, y = prover.value_data(model.expansions)
    w, degenerate = prover.fit_value(x, y, cfg.value_l2, f"value model, seed {seed}")
    scores = prover.sigmoid(x @ w)
    m.update({"value_rows": float(len(y)), "value_pos_share": float(y.mean()),
              "value_degenerate": float(degenerate),
              "value_auc_train": prover.auc(list(scores), list(y.astype(bool))),
              "value_logloss": prover.log_loss(w, x, y)})
    io.write_json(folder / "value.json", {"features": list(prover.FEATURES),
                                          "weights": [float(v) for v in w],
                                          "prior_strength": cfg.prior_strength})
    return m


def headline(details: dict[str, float]) -> dict[str, float]:
    """Flat short keys (means over seeds): `dvc metrics show` prints one column per key over
    all four stages and must stay under 250 characters a line."""
    keys = {"base_accept": "mean/base_train_accept", "ei_accept": "mean/ei2_repair_accept",
            "value_auc": "mean/value_auc_train", "value_degenerate": "mean/value_degenerate"}
    return {short: details[k] for short, k in keys.items() if k in details}
