"""Seconds per RL optimizer step: paperline's trainer arms vs the stock TRL GRPO step.

    .venv/bin/python benchmarks/grpo_step.py [--model models/base] [--rounds 6] [--repeats 2]

Same model, same prompts, same seed, same budget (prompts x G per round, minibatches, passes) for:
  stock      `trl.GRPOTrainer` as shipped (the reference step)
  clip       the engine's GRPOTrainer (stages.train.grpo_trainer): TRL's clipped loss + ratio
             diagnostics
  r2vpo      R2VPOTrainer (stages.r2vpo.trainer): the R²VPO loss and dual step, fresh data only
  r2vpo+rep  R²VPO with 2 rounds of replay (each step also trains on replayed rows)
  h-grpo     clipped GRPO + H-GRPO's InDiv reward bonus (one extra forward pass with attentions
             over each round's completions)
Runs alternate (stock, clip, r2vpo, r2vpo+rep, stock, ...) `--repeats` times so machine noise
hits every arm alike; the ratios are of the medians. Also reports rollout tokens/s (completion
tokens generated per second of training wall time). Writes the "GRPO step" section of
benchmarks/RESULTS.md. Target (issue 4): R²VPO and H-GRPO at most 1.1x the stock step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks._results import write_section  # noqa: E402


def one_run(kind: str, model_dir: Path, rows: list[dict], args: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from transformers import set_seed
    from trl import GRPOConfig, GRPOTrainer

    from stages.hsir.rl import GroupBonus
    from stages.models.generate import load_model
    from stages.r2vpo.rl import Config as R2VPOArm
    from stages.r2vpo.rl import trainer_class
    from stages.train.grpo import verifier_reward

    set_seed(0)
    model, tokenizer = load_model(model_dir)
    model.train()
    params = R2VPOArm(policy_loss="r2vpo" if kind.startswith("r2vpo") else "clip",
                      replay_batches=2 if kind == "r2vpo+rep" else 0,
                      prompts_per_round=args.prompts, num_generations=args.generations,
                      minibatches=2, num_iterations=4, max_completion_length=64)
    steps = args.rounds * params.steps_per_round
    with tempfile.TemporaryDirectory() as scratch:
        config = GRPOConfig(
            output_dir=scratch, max_steps=steps,
            per_device_train_batch_size=args.prompts * args.generations // 2,
            steps_per_generation=2, num_generations=args.generations, num_iterations=4,
            max_completion_length=64, temperature=1.0, top_k=0, learning_rate=5e-5,
            loss_type="bnpo", report_to="none", use_cpu=True, bf16=False,
            gradient_checkpointing=False, save_strategy="no", disable_tqdm=True, seed=0,
            logging_steps=10**6)
        ds = Dataset.from_list([{"prompt": r["prompt"], "answer": int(r["answer"])} for r in rows])
        rewards = [verifier_reward("arith")]
        if kind == "h-grpo":
            rewards.append(GroupBonus("indiv", 0.2, args.generations, "arith").bind(model,
                                                                                   tokenizer))
        common = dict(model=model, processing_class=tokenizer, args=config, train_dataset=ds,
                      reward_funcs=rewards)
        trainer = (GRPOTrainer(**common) if kind == "stock"
                   else trainer_class(params.policy_loss)(**common, params=params))
        started = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - started
    tokens = getattr(trainer, "tokens_generated", None)
    return {"s_per_step": wall / steps, "wall": wall, "tokens": tokens,
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models/base"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    from stages.tasks import arith

    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        sys.exit(f"{model_dir}: no model; run `make run PIPELINE=base` first")
    rows = arith.generate(arith.Config(min_operands=4, max_operands=5), 256, "bench")
    kinds = ["stock", "clip", "r2vpo", "r2vpo+rep", "h-grpo"]
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for kind in kinds:
            results[kind].append(one_run(kind, model_dir, rows, args))
            print(kind, results[kind][-1], flush=True)
    med = {k: statistics.median(r["s_per_step"] for r in v) for k, v in results.items()}
    lines = ["| arm | s / optimizer step (median) | ratio to stock TRL | rollout tokens / s |",
             "|---|---|---|---|"]
    for k in kinds:
        toks = [r["tokens"] / r["wall"] for r in results[k] if r["tokens"]]
        tok_s = f"{statistics.median(toks):.0f}" if toks else "n/a"
        lines.append(f"| {k} | {med[k]:.3f} | {med[k] / med['stock']:.2f}x | {tok_s} |")
    body = (f"`.venv/bin/python benchmarks/grpo_step.py --rounds {args.rounds} --repeats "
            f"{args.repeats}` on `{model_dir.relative_to(ROOT) if model_dir.is_relative_to(ROOT) else model_dir}`: "
            f"{args.prompts} prompts x G={args.generations} per round, 2 minibatches x 4 passes "
            f"= 8 optimizer steps per round, {args.rounds} rounds per run, runs interleaved, "
            f"{results['stock'][0]['threads']} torch threads.\n\n" + "\n".join(lines) +
            "\n\nA step includes its share of generation (one round's sampling is amortised over "
            "its 8 steps). `r2vpo+rep` trains on 3x the rows per step (fresh + 2 replayed rounds) "
            "at the same rollout budget, so its step is not comparable at equal work; the 1.1x "
            "target applies to `r2vpo` and `h-grpo`.\n")
    print(body)
    if not args.no_write:
        write_section("GRPO step", body)


if __name__ == "__main__":
    main()
