"""Stage `train`: every arm from the same freshly initialised tiny Llama, at the SAME number of
optimizer updates (the spec's first pitfall: IWM and SR get no extra gradient steps).

    il    imitation learning, `steps` updates on D_expert (L_IL = -sum log pi(a_i | s_i))
    iwm   implicit world modelling then IL: `round(iwm_share * steps)` updates of next-state
          prediction on the expert transitions and the K alternatives (L_IWM), then the rest
          of the `steps` on D_expert (the paper's "about 1 epoch of L_IWM, then L_IL", with the
          total <= IL's)
    sr    self-reflection + IL: `steps` updates on D_expert mixed with D_refl (templated
          reflection then the expert action, L_SR); the reflections are TEMPLATED from outcome
          differences, not written by the model (stages.early_experience.experience)
    dpo   the paper's DPO baseline: IL for `steps - dpo_steps` updates, then `dpo_steps`
          updates of DPO (Rafailov et al., arXiv 2305.18290; `dpo_loss`) with the expert turn
          chosen and the alternative rejected, the IL checkpoint as the reference

Every phase runs the project's SFT engine (`stages.train.sft`, the harness's imitation recipe:
AdamW, warm-up then cosine) except DPO's, a small loop here with the same optimiser settings
at its own peak learning rate `dpo_lr` (None: lr / 3). DPO tolerates far less than IL: at
lr / 3 = 1e-3 the arm broke its own output format (most turns unparsable), so params.yaml sets
1e-5, chosen on validation goals (pipelines/early_experience/README.md, "Deviations").

Tokens: `tokenizer: chars` gives every character a token (the project's default);
`tokenizer: bpe` learns subwords on the world's own text once per stage (`world_tokenizer`:
every arm's demonstrations, next pages, reflections and rejected actions; at most
`vocab_size` tokens, every printable character kept, so an unseen word is spelt, never
`<unk>`), and every arm trains with that one vocabulary. A shop IL example is 2.6x fewer
subwords than characters and an update 2.3x cheaper (benchmarks/early_experience_tokens.py;
pipelines/early_experience/README.md, "Deviations").

Settings: the main one (all demonstrations, K = `k`) for every arm; with `fractions`, every arm
of `sweep_arms` (None: all) also on each fraction f, the leading share f of the demonstrations
(the data-efficiency curve; their experience is that of the same episodes, every setting
trains for the same `steps` updates, and the subword vocabulary is the world's one, learnt on
all demonstrations); with `k_sweep`, iwm and sr (of `sweep_arms`) also at each K.
A setting's name is
`<arm>` (main), `<arm>@f<fraction>` or `<arm>@k<K>`. Models: `<paths.ee_policies>/<setting>/
s<seed>` (save_pretrained, safetensors); the main setting's first seed of each arm is
registered as `early-experience-policy` with the arm as its alias.
"""

from __future__ import annotations

import copy
import math
import string
from typing import Any, Literal

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.agents.imitation import check_examples, il_examples
from stages.agents.react import PromptFormat
from stages.agents.trajectories import read_rollouts
from stages.core import io
from stages.core.checks import read_parquet_checked
from stages.core.pool import map_jobs
from stages.early_experience.experience import (dpo_pairs, experience_spec, iwm_examples,
                                                sr_examples)

ARMS = ("il", "iwm", "sr", "dpo")
CHARS = set(string.printable) - set("\t\r\n\x0b\x0c")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arms: list[str] = Field(min_length=1, description=f"from {ARMS}; `il` is the baseline")
    seeds: list[int] = Field(min_length=2, description="training seeds (paired CIs over them)")
    steps: int = Field(ge=2, le=1_000_000, description="optimizer updates of EVERY arm")
    batch_size: int = Field(16, ge=1, le=4096)
    lr: float = Field(3e-3, gt=0, le=1.0)
    warmup: float = Field(0.05, ge=0, lt=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    k: int = Field(4, ge=1, le=64, description="alternatives per state of the main setting")
    iwm_share: float = Field(0.5, gt=0, lt=1, description="share of the updates on L_IWM")
    dpo_share: float = Field(0.25, gt=0, lt=1, description="share of the updates on DPO")
    dpo_beta: float = Field(0.1, gt=0, le=10)
    dpo_lr: float | None = Field(None, gt=0, le=1.0, description="peak learning rate of the "
                                 "DPO phase (None: lr / 3)")
    fractions: list[float] = Field(default_factory=list, description="extra settings: every "
                                   "arm of `sweep_arms` on this fraction of the demonstrations")
    k_sweep: list[int] = Field(default_factory=list, description="extra settings: iwm and sr "
                               "(those of `sweep_arms`) at these K")
    sweep_arms: list[str] | None = Field(None, description="the arms the extra settings "
                                         "(`fractions`, `k_sweep`) train; None: every arm")
    hidden_size: int = Field(64, ge=16, le=4096)
    num_layers: int = Field(2, ge=1, le=64)
    num_heads: int = Field(4, ge=1, le=64)
    intermediate_size: int = Field(128, ge=16, le=16384)
    max_positions: int = Field(384, ge=64, le=8192, description="context in tokens, with "
                               "<bos> and <eos>")
    tokenizer: Literal["chars", "bpe"] = Field(
        "chars", description="`chars`: one token per character; `bpe`: subwords learnt on the "
        "world's demonstrations and experience, the same for every arm (stages/models/subword.py)")
    vocab_size: int = Field(512, ge=104, le=65_536, description="`bpe`: at most this many "
                            "tokens (the printable characters and 4 specials included)")
    prompt: PromptFormat
    num_threads: int = Field(0, ge=0, le=256, description="torch threads (workers = 1)")
    workers: int = Field(1, ge=1, le=64, description="models trained at once, one process "
                         "(1 thread) each")
    register_as: str = "early-experience-policy"
    demos: str = Field("ee_shop", description="path key: the world stage's folder (expert/)")
    experience: str = Field("ee_experience", description="path key: the experience table")
    out: str = Field("ee_policies", description="path key: the trained policies")

    @field_validator("arms")
    @classmethod
    def _arms(cls, v: list[str]) -> list[str]:
        bad = [a for a in v if a not in ARMS]
        if bad or len(set(v)) != len(v) or "il" not in v:
            raise ValueError(f"train.arms {v}: unknown {bad}, repeated, or no `il` baseline; "
                             f"arms: {ARMS}")
        return v

    @field_validator("fractions")
    @classmethod
    def _fractions(cls, v: list[float]) -> list[float]:
        bad = [f for f in v if not 0 < f < 1]
        if bad:
            raise ValueError(f"train.fractions {v}: {bad} not in (0, 1) (1 is the main setting)")
        names = [f"{f:g}" for f in v]      # a setting is named by f:g (`il@f0.25`)
        if len(set(names)) != len(names):
            raise ValueError(f"train.fractions {v}: repeated fraction (as named: {names})")
        return v

    @field_validator("k_sweep")
    @classmethod
    def _k_sweep(cls, v: list[int]) -> list[int]:
        bad = [k for k in v if not 1 <= k <= 64]
        if bad:
            raise ValueError(f"train.k_sweep {v}: {bad} not in [1, 64] (alternatives per state)")
        if len(set(v)) != len(v):
            raise ValueError(f"train.k_sweep {v}: repeated K")
        return v

    @model_validator(mode="after")
    def _k(self) -> "Config":
        if self.sweep_arms is not None:
            bad = [a for a in self.sweep_arms if a not in self.arms]
            if bad or not self.sweep_arms or len(set(self.sweep_arms)) != len(self.sweep_arms):
                raise ValueError(f"train.sweep_arms {self.sweep_arms}: empty, repeated or "
                                 f"{bad} not in train.arms {self.arms}")
            if self.fractions and "il" not in self.sweep_arms:
                raise ValueError(f"train.sweep_arms {self.sweep_arms}: with `fractions`, `il` "
                                 "must be swept too (the curve's baseline on the same share)")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"train.seeds {self.seeds}: repeated seed")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"train.hidden_size {self.hidden_size} not divisible by "
                             f"num_heads {self.num_heads}")
        return self


def settings(cfg: Config) -> list[tuple[str, str, float, int]]:
    """(setting name, arm, fraction of demonstrations, K) of every model to train."""
    sweep = cfg.arms if cfg.sweep_arms is None else cfg.sweep_arms
    out = [(a, a, 1.0, cfg.k) for a in cfg.arms]
    out += [(f"{a}@f{f:g}", a, f, cfg.k) for f in cfg.fractions for a in sweep]
    out += [(f"{a}@k{k}", a, 1.0, k) for k in cfg.k_sweep if k != cfg.k
            for a in sweep if a in ("iwm", "sr")]
    return out


def world_tokenizer(cfg: Config, il: tuple[list[str], list[str]],
                    rows: list[dict[str, Any]]) -> str:
    """The tokenizer every arm of a world trains with, as JSON (`stages.models.subword`).
    `bpe`: merges learnt on the main setting's texts of all four arms (the demonstrations'
    turns, the K alternatives' next pages, the reflections, the rejected actions): one
    vocabulary per world, like a pretrained tokenizer, so every arm has the same model shape
    and reads the same pieces; a word none of them has is spelt in characters."""
    from stages.models import subword
    from stages.models.tokenizer import build_tokenizer

    if cfg.tokenizer == "chars":
        return subword.to_json(build_tokenizer(CHARS))
    # prompts and replies apart, as `encode_sft_rows` and generation encode them: a prompt
    # ends in the separator's space, a reply starts with its first word (`Action`), and the
    # merges are learnt on those pieces, not on the pair glued together
    texts: list[str] = []
    for part in (il, iwm_examples(rows, cfg.prompt, cfg.k), sr_examples(rows, cfg.prompt, cfg.k),
                 dpo_pairs(rows, cfg.prompt, cfg.k)):
        for column in part:
            texts += column
    return subword.to_json(subword.train_bpe(texts, CHARS, cfg.vocab_size))


def split_updates(steps: int, share: float) -> tuple[int, int]:
    """(first phase, second phase) updates summing to `steps`, each >= 1."""
    first = min(steps - 1, max(1, round(share * steps)))
    return first, steps - first


def dpo_loss(pi_chosen: Any, pi_rejected: Any, ref_chosen: Any, ref_rejected: Any,
             beta: float) -> Any:
    """DPO: -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), sequence log-probs, mean."""
    import torch

    margin = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
    return -torch.nn.functional.logsigmoid(beta * margin).mean()


def sequence_logp(model: Any, batch: dict[str, Any]) -> Any:
    """Sum of log p of the labelled (completion) tokens of each row."""
    import torch

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits, labels = logits[:, :-1].float(), batch["labels"][:, 1:]
    mask = labels != -100
    logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return (logp * mask).sum(-1)


def train_dpo(model: Any, tokenizer: Any, prompts: list[str], chosen: list[str],
              rejected: list[str], *, steps: int, batch_size: int, lr: float, beta: float,
              seed: int, min_lr_ratio: float) -> dict[str, float]:
    """`steps` DPO updates in place, the model as it enters as the frozen reference."""
    import random

    import torch

    from stages.models.base import CompletionCollator, encode_sft_rows

    max_len = model.config.max_position_embeddings
    rc = encode_sft_rows(tokenizer, prompts, chosen, max_len)
    rr = encode_sft_rows(tokenizer, prompts, rejected, max_len)
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    collate = CompletionCollator(tokenizer.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    rng = random.Random(f"dpo/{seed}")
    model.train()
    losses, accs = [], []
    for t in range(steps):
        for g in opt.param_groups:      # cosine to lr * min_lr_ratio, no warm-up (warm model)
            g["lr"] = lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 *
                            (1 + math.cos(math.pi * t / max(1, steps))))
        idx = rng.sample(range(len(rc)), min(batch_size, len(rc)))
        bc, br = collate([rc[i] for i in idx]), collate([rr[i] for i in idx])
        with torch.no_grad():
            ref_c, ref_r = sequence_logp(ref, bc), sequence_logp(ref, br)
        pi_c, pi_r = sequence_logp(model, bc), sequence_logp(model, br)
        loss = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        accs.append(float(((pi_c - ref_c) > (pi_r - ref_r)).float().mean()))
    model.eval()
    tail = max(1, steps // 5)
    return {"dpo_loss": sum(losses[-tail:]) / tail, "dpo_pref_acc": sum(accs[-tail:]) / tail}


def train_one(job: dict[str, Any]) -> dict[str, float]:
    """Train one (setting, seed) from scratch and save it to `job["out"]`; returns its losses
    and wall times. A plain function of plain data: the stage runs it in a pool of processes."""
    import time

    import torch

    from stages.models import base, subword
    from stages.train.sft import sft

    t0 = time.perf_counter()
    cfg, arm, seed, data = Config.model_validate(job["cfg"]), job["arm"], job["seed"], job["data"]
    base.set_threads(job["threads"])
    tokenizer = subword.from_json(job["tokenizer"])     # `world_tokenizer`
    torch.manual_seed(seed)
    model = base.build_model(base.Config(
        hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size, max_positions=cfg.max_positions), tokenizer)
    common = dict(batch_size=cfg.batch_size, lr=cfg.lr, seed=seed, warmup=cfg.warmup,
                  min_lr_ratio=cfg.min_lr_ratio, log_every=max(1, cfg.steps // 4))
    il_p, il_t = data["il"]
    if arm == "il":
        m = sft(model, tokenizer, il_p, il_t, steps=cfg.steps, **common)
    elif arm == "iwm":
        n1, n2 = split_updates(cfg.steps, cfg.iwm_share)
        wm = sft(model, tokenizer, *data["iwm"], steps=n1, **common)
        m = sft(model, tokenizer, il_p, il_t, steps=n2, **common)
        m["iwm_loss"] = wm["train_loss"]
    elif arm == "sr":
        m = sft(model, tokenizer, *data["sr"], steps=cfg.steps, **common)
    else:
        n1, n2 = split_updates(cfg.steps, 1 - cfg.dpo_share)
        m = sft(model, tokenizer, il_p, il_t, steps=n1, **common)
        m.update(train_dpo(model, tokenizer, *data["dpo"], steps=n2, batch_size=cfg.batch_size,
                           lr=cfg.lr / 3 if cfg.dpo_lr is None else cfg.dpo_lr,
                           beta=cfg.dpo_beta, seed=seed,
                           min_lr_ratio=cfg.min_lr_ratio))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    io.save_model(model, tokenizer, job["out"])
    m["train_seconds"] = time.perf_counter() - t0
    return {k: float(v) for k, v in m.items()}


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    fmt = cfg.prompt
    episodes, steps = read_rollouts(ctx.path(cfg.demos) / "expert")
    exp = read_parquet_checked(ctx.path(cfg.experience), experience_spec())
    largest_k = int(exp["j"].max())
    wanted = max([cfg.k, *cfg.k_sweep])
    if wanted > largest_k:
        raise ValueError(f"train: K = {wanted} asked but the experience stage drew at most "
                         f"{largest_k} alternatives per state (raise experience.k)")
    from stages.models import subword

    demo_ids = sorted(episodes.filter(pl.col("success"))["episode_id"].to_list(),
                      key=lambda s: int(s.split("/")[1]))
    ok_eps = sorted(int(s.split("/")[1]) for s in demo_ids)
    tok_json = world_tokenizer(cfg, il_examples(episodes.filter(pl.col("episode_id").is_in(
        demo_ids)), steps), exp.filter(pl.col("episode").is_in(ok_eps)).to_dicts())
    tokenizer = subword.from_json(tok_json)
    out: dict[str, float] = {"updates": float(cfg.steps), "demos": float(len(demo_ids)),
                             "vocab_size": float(len(tokenizer))}
    root = ctx.path(cfg.out)
    jobs = []
    with io.atomic_path(root, is_dir=True) as tmp:
        for name, arm, frac, k in settings(cfg):
            n_demo = max(1, round(frac * len(demo_ids)))
            keep_ids = demo_ids[:n_demo]
            keep_eps = sorted(int(s.split("/")[1]) for s in keep_ids)
            il_p, il_t = il_examples(episodes.filter(pl.col("episode_id").is_in(keep_ids)),
                                     steps)
            rows = exp.filter(pl.col("episode").is_in(keep_eps)).to_dicts()
            data: dict[str, Any] = {"il": (il_p, il_t)}
            if arm == "iwm":
                data["iwm"] = iwm_examples(rows, fmt, k)
            elif arm == "sr":
                sp, st = sr_examples(rows, fmt, k)
                data["sr"] = (il_p + sp, il_t + st)
                out[f"{name}/sr_examples"] = float(len(sp))
            elif arm == "dpo":
                data["dpo"] = dpo_pairs(rows, fmt, k)
                check_examples(tokenizer, data["dpo"][0], data["dpo"][1], cfg.max_positions)
            for p, *_, t in data.values():     # every example fits and has no <unk>
                check_examples(tokenizer, p, t, cfg.max_positions)
            out[f"{name}/demos"] = float(n_demo)
            out[f"{name}/il_examples"] = float(len(il_p))
            out[f"{name}/k"] = float(k)
            if arm == "iwm":
                out[f"{name}/iwm_examples"] = float(len(data["iwm"][0]))
            if arm == "dpo":
                out[f"{name}/dpo_pairs"] = float(len(data["dpo"][0]))
            for seed in cfg.seeds:
                jobs.append((name, seed, {"cfg": cfg.model_dump(), "arm": arm, "seed": seed,
                                          "data": data, "tokenizer": tok_json,
                                          "out": str(tmp / name / f"s{seed}"),
                                          "threads": cfg.num_threads if cfg.workers == 1
                                          else 1}))
        # one model per process: at this size two 1-thread processes beat one 2-thread one
        results = map_jobs(train_one, [job for _, _, job in jobs], cfg.workers)
    for (name, seed, _), m in zip(jobs, results, strict=True):
        for key, v in m.items():
            if io.is_timing_key(key):
                ctx.log_metrics({f"{name}/s{seed}/{key}": v})
            else:
                out[f"{name}/s{seed}/{key}"] = v
    if ctx.tracker is not None:
        for arm in cfg.arms:
            tags = {"arm": arm, "updates": str(cfg.steps), "k": str(cfg.k)}
            if arm == "sr":
                tags["reflections"] = "templated"
            ctx.tracker.register_model(root / arm / f"s{cfg.seeds[0]}", cfg.register_as, [arm],
                                       tags=tags)
    return out


def headline(details: dict[str, float]) -> dict[str, float]:
    return {"updates": details["updates"], "demos": details["demos"]}
