"""Stage `grpo` of CoRe: GRPO on the rendered page, without and with the text anchor (CoRe-RL),
from one SFT arm's checkpoints; then each policy answers the test split from the text and from
the page (ICML 2026, poster 64509; the anchor term: `stages.core_align.trainer`).

- `visual_grpo`  the engine's GRPO (TRL's clipped loss) on rollouts y ~ pi_theta(.|x_img)
- `core_grpo`    the same + lambda * mean_t KL(pi_theta(.|x_img, y_<t) || sg pi(.|x_txt, y_<t))

Reward: the rendered-text family's exact verifier (1 if the answer is right). Both arms start
from the same checkpoint per seed (`start`, an arm of the sft stage) and share every budget.

How the engine samples from a page. The engine (`stages.train.grpo_trainer.GRPOTrainer`, a
`trl.GRPOTrainer`) tokenises string prompts and generates from token ids; this stage's trainer
subclass (`PageGRPOTrainer`) overrides, in this package only:
- `_tokenize_prompts`: a prompt string is a page's id; its ids are the image prompt
  (`vlm.encode_image_prompt`, piece by piece) and its `pixel_values` go to TRL as a multimodal
  field, which TRL hands to `generate` (the LLaVA fills the `<image>` run from it);
- `_generate_and_score_completions`: adds each rollout's `pixel_values` to the batch, which TRL's
  loss passes to the model row by row (`pixel_values=inputs.get("pixel_values")`);
- `image_branch` / `anchor_prompt_ids`: the anchor term's two prompts (page embeddings, text ids).
TRL computes no log-probs between generation and the loss when every round is one optimiser
step on fresh rollouts (`minibatches: 1`, `num_iterations: 1`, `beta: 0`): those would be
computed without the page, so the Config refuses anything else. `train_grpo` (the engine's
driver) is not used: it loads a causal LM by path and scores with a registered family's
verifier; `train_page_grpo` below is the same GRPOConfig for the VLM.

    python -m stages core grpo
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io
from stages.core_align.core import CoReGRPOParams
from stages.core_align.sft import (check_answer_room, load_split, map_seeds, record_seeds,
                                  score_arm)
from stages.models import vlm as vlm_model

RL_ARMS = ("visual_grpo", "core_grpo")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data: str = Field("vlm_data", description="path key: rendered_text/{train,val,test}.parquet "
                                              "(the vlm pipeline's, or the pages stage's)")
    models: str = Field("core_models", description="path key: the sft stage's <arm>/seed<k>/")
    start: Literal["text_sft", "visual_sft", "core_sft"] = Field(
        "text_sft", description="the sft arm both RL arms start from [reconstructed]")
    out: str = Field("core_rl_models", description="path key: <arm>/seed<k>/ policies")
    answers: str = Field("core_rl_answers", description="path key: answers.parquet")
    register_as: str | None = Field("core-policy", description="MLflow registered model name")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1,
                             description="seeds (the sft stage's)")
    arms: list[Literal["visual_grpo", "core_grpo"]] = Field(
        default_factory=lambda: list(RL_ARMS), min_length=1, description="RL arms to run")
    grpo: CoReGRPOParams = Field(default_factory=CoReGRPOParams,
                                 description="GRPO budgets and the anchor term (`anchor.lam`)")
    kinds: list[Literal["kv", "arith", "table", "index"]] = Field(
        default_factory=lambda: ["kv", "arith", "table"], min_length=1,
        description="page kinds trained and evaluated")
    max_train_rows: int | None = Field(None, ge=1, description="use at most this many pages")
    split: Literal["val", "test"] = Field("test", description="split every arm answers")
    max_eval_rows: int | None = Field(None, ge=1, description="answer at most this many items")
    check_image_size: bool = Field(True, description="pages must have the model's input size")
    answer_tokens: int = Field(24, ge=1, le=512, description="max new tokens of a test answer")
    eval_batch_size: int = Field(64, ge=1, le=4096, description="prompts decoded together")
    workers: int = Field(1, ge=1, le=64, description="seeds trained at once, one process each")
    num_threads: int = Field(0, ge=0, le=256, description="torch threads per worker; 0 = the "
                                                          "cores split between the workers")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        g = self.grpo
        if g.minibatches != 1 or g.num_iterations != 1 or g.beta != 0 or g.replay_batches:
            raise ValueError(f"grpo: minibatches = {g.minibatches}, num_iterations = "
                             f"{g.num_iterations}, beta = {g.beta}, replay_batches = "
                             f"{g.replay_batches}: this stage needs 1, 1, 0, 0 (TRL would score "
                             f"stored rollouts without their page; module docstring)")
        for name in ("seeds", "arms", "kinds"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"{name} {values} repeat a value")
        return self


def verifier_reward() -> Any:
    """TRL reward function: 1.0 when the rendered-text verifier accepts the answer."""
    from stages.tasks import rendered_text

    def correct(prompts: list[str], completions: list[str], answer: list[str],
                kind: list[str], **_: Any) -> list[float]:
        return [float(rendered_text.verify_answer({"answer": a, "kind": k}, c))
                for c, a, k in zip(completions, answer, kind)]

    return correct


def page_trainer_class() -> type:
    """`PageGRPOTrainer`, built on first use (it imports TRL)."""
    import torch

    from stages.core_align.sft import image_branch
    from stages.core_align.trainer import CoReGRPOTrainer
    from stages.train.grpo_trainer import GRPOTrainer

    class PageGRPOTrainer(CoReGRPOTrainer):
        """CoRe's GRPO trainer whose policy reads the rendered page (module docstring)."""

        def __init__(self, *args: Any, pages: dict[str, dict[str, Any]], layout: Any,
                     **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.pages, self.layout = pages, layout

        def _tokenize_prompts(self, prompts: list) -> tuple[list, None, dict[str, Any]]:
            ids = [self.pages[p]["image_ids"] for p in prompts]
            pixels = torch.stack([self.pages[p]["pixels"] for p in prompts])
            return ids, None, {"pixel_values": pixels}

        def _generate_and_score_completions(self, inputs: list[dict[str, Any]]
                                            ) -> dict[str, Any]:
            out = super()._generate_and_score_completions(inputs)
            out["pixel_values"] = torch.stack([self.pages[r["prompt"]]["pixels"]
                                               for r in inputs]).to(out["prompt_ids"].device)
            out["num_images"] = [1] * len(inputs)      # one page per rollout, row by row
            return out

        def anchor_prompt_ids(self, inputs: list[dict[str, Any]]) -> list[list[int]]:
            return [self.pages[r["prompt"]]["text_ids"] for r in inputs]

        def image_branch(self, inputs: dict[str, Any]) -> Any:
            return image_branch(self.model, inputs["prompt_ids"], inputs["prompt_mask"],
                                inputs["pixel_values"])

        def policy_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
            if self.params.policy_loss == "clip":        # visual GRPO: the engine's loss only
                return GRPOTrainer.policy_loss(self, model, inputs)
            return super().policy_loss(model, inputs)

    return PageGRPOTrainer


def train_page_grpo(params: CoReGRPOParams, vlm: vlm_model.VLM, df: Any, images: list[Any],
                    seed: int, log: Any = None) -> dict[str, float]:
    """GRPO on `vlm` in place, prompts = the pages of `df` (the engine's GRPOConfig, as
    `stages.train.grpo.train_grpo` sets it, with one optimiser step per round)."""
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback, set_seed
    from trl import GRPOConfig

    set_seed(seed)
    tok, layout = vlm.tokenizer, vlm.layout
    pixels = vlm_model.pixel_values(vlm.processor, images)
    pages = {}
    for i, r in enumerate(df.select("id", "content", "query").iter_rows(named=True)):
        pages[r["id"]] = {
            "image_ids": vlm_model.encode_image_prompt(layout, tok, r["query"]),
            "text_ids": vlm_model.encode_text_prompt(layout, tok, r["content"], r["query"]),
            "pixels": pixels[i]}
    dataset = Dataset.from_list([{"prompt": r["id"], "answer": r["answer"], "kind": r["kind"]}
                                 for r in df.select("id", "answer", "kind").iter_rows(named=True)])
    history: list[dict[str, float]] = []

    class Hooks(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                point = {f"train/{k}": float(v) for k, v in logs.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)
                         and math.isfinite(float(v))}
                history.append(point)
                if log is not None:
                    log(point, state.global_step)

    model = vlm.model
    model.train()
    with tempfile.TemporaryDirectory(prefix="paperline-core-grpo-") as scratch:
        config = GRPOConfig(
            output_dir=scratch, max_steps=params.rounds,
            per_device_train_batch_size=params.prompts_per_round * params.num_generations,
            steps_per_generation=1, num_generations=params.num_generations, num_iterations=1,
            max_completion_length=params.max_completion_length, temperature=params.temperature,
            top_k=0, top_p=1.0, learning_rate=params.lr, lr_scheduler_type="constant",
            beta=0.0, epsilon=params.clip_epsilon, loss_type=params.loss_type,
            max_grad_norm=params.max_grad_norm, logging_steps=max(1, params.rounds // 10),
            save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(),
            bf16=False, gradient_checkpointing=False, seed=seed, data_seed=seed,
            dataloader_pin_memory=False, disable_tqdm=True, shuffle_dataset=True)
        trainer = page_trainer_class()(
            model=model, processing_class=tok, reward_funcs=[verifier_reward()], args=config,
            train_dataset=dataset, callbacks=[Hooks()], params=params, pages=pages,
            layout=layout)
        wall, cpu = time.perf_counter(), time.process_time()
        trainer.train()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    model.eval()
    reward = [p["train/rewards/correct/mean"] for p in history
              if "train/rewards/correct/mean" in p]
    kl = [p["train/core/anchor_kl"] for p in history if "train/core/anchor_kl" in p]
    out = {"rollouts": float(trainer.rollouts), "steps": float(trainer.state.global_step),
           "train_seconds": wall, "train_cpu_seconds": cpu}
    if reward:
        out["first_reward"], out["final_reward"] = reward[0], reward[-1]
    if kl:
        out["first_anchor_kl"], out["final_anchor_kl"] = kl[0], kl[-1]
    return out


def seed_arms(cfg: Config, seed: int, start_dir: Path, train_df: Any, train_images: list[Any],
              eval_df: Any, eval_images: list[Any], out: Path) -> dict[str, Any]:
    """Both RL arms of one seed from `start_dir`: train, answer, save to `out/<arm>/seed<k>`."""
    rows: list[dict[str, Any]] = []
    metrics: dict[str, float] = {}
    logs: dict[str, list[tuple[dict[str, float], int]]] = {}
    for arm in cfg.arms:
        params = cfg.grpo.model_copy(update={"policy_loss": "core" if arm == "core_grpo"
                                             else "clip"})
        vlm = vlm_model.load_vlm(start_dir)
        logs[arm] = []
        m = train_page_grpo(params, vlm, train_df, train_images, seed,
                            lambda point, step, arm=arm: logs[arm].append((point, step)))
        vlm_model.save_vlm(vlm, out / arm / f"seed{seed}")
        got, acc = score_arm(vlm, eval_df, eval_images, arm, seed, cfg, "grpo")
        rows += got
        metrics.update({f"{arm}/{k}": v for k, v in {**m, **acc}.items()})
    return {"rows": rows, "metrics": metrics, "logs": logs}


def _seed_job(job: tuple[Any, ...]) -> dict[str, Any]:
    from stages.models.base import set_threads

    threads, cfg, *args = job
    set_threads(threads)
    return seed_arms(Config.model_validate(cfg), *args)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    models = ctx.path(cfg.models) / cfg.start
    missing = [s for s in cfg.seeds if not (models / f"seed{s}" / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(f"{models}: no {cfg.start} checkpoint for seeds {missing} (the "
                                f"sft stage trains them; seeds must be a subset of its seeds)")
    first = vlm_model.load_vlm(models / f"seed{cfg.seeds[0]}")
    size = first.model.config.vision_config.image_size if cfg.check_image_size else None
    data_dir = ctx.path(cfg.data)
    train_df, train_images = load_split(data_dir, "train", cfg.kinds, size, cfg.max_train_rows)
    eval_df, eval_images = load_split(data_dir, cfg.split, cfg.kinds, size, cfg.max_eval_rows)
    check_answer_room(first.tokenizer, [eval_df], cfg.answer_tokens, "answer_tokens")
    check_answer_room(first.tokenizer, [train_df], cfg.grpo.max_completion_length,
                      "grpo.max_completion_length")
    print(f"{ctx.stage}: from {cfg.start}, {train_df.height} train pages, {eval_df.height} "
          f"{cfg.split} items, arms {cfg.arms}, seeds {cfg.seeds}, {cfg.grpo.rounds} rounds x "
          f"{cfg.grpo.prompts_per_round} prompts x {cfg.grpo.num_generations}", flush=True)
    out = ctx.path(cfg.out)
    with io.atomic_path(out, is_dir=True) as tmp:
        results = map_seeds(cfg, seed_arms, _seed_job, models, (train_df, train_images),
                            (eval_df, eval_images), tmp)
    metrics: dict[str, float] = {"rounds": float(cfg.grpo.rounds),
                                 "anchor_lambda": cfg.grpo.anchor.lam}
    record_seeds(ctx, cfg, "grpo", results, metrics,
                 lambda arm, seed: {"arm": arm, "seed": seed, "start": cfg.start,
                                    "grpo": cfg.grpo.model_dump(mode="json")}, out)
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: each RL arm's accuracy on the page, means over seeds (details/grpo.json has
    the rest)."""
    from stages.core.stats import mean_std

    out: dict[str, float] = {}
    for arm in RL_ARMS:
        vals = [v for k, v in metrics.items() if k.startswith("seed")
                and k.endswith(f"/{arm}/acc_image")]
        if vals:
            out[f"{arm}_image"] = mean_std(vals)[0]
    return out
