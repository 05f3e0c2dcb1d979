"""Does the tiny diffusion LM learn DiffuReason's `cpu` task, and does its AR twin?

    .venv/bin/python benchmarks/diffureason_learning.py [--steps 250 1000] [--seeds 0 1]
        [--arch bert|llama] [--t-min 0.0] [--train-rows 3000] [--schedule llada|block]
        [--no-ar]

Trains both models of `pipelines/diffureason` (the `cpu` profile's task and model: single
digits mod 10, + and -, 2-4 steps; d = 64, 2 layers, lr 3e-3, batch 64) at each step count,
one torch thread, and prints per (model, seed, steps): the training loss of the last 10% of
steps, greedy validation accuracy (the diffusion LM with T_b = B/2 passes per block, as the
pipeline's `vanilla` arm) and the first validation problem decoded. It separates what a model
learned to copy (operands, the previous step's result) from the digit arithmetic, which is
what the search needs. A diagnostic behind the README's "Deviations"; not a speed benchmark.

`probe` (diffusion LM only): accuracy at each response position when that position ALONE is
masked and every other token is visible, by kind: `result` (a digit right after `=` or `#`,
the step's arithmetic), `operand` (any other digit), `symbol` (operators, `=`, `;`, `#`),
`eos`. In the task's format a step's result is also the next step's first operand and the
final answer, so a model can score 1.0 on `result` by copying from either side without
knowing any arithmetic; compare it with greedy accuracy, where the right side is masked.
`first result, all masked`: the first step's result digit predicted with the whole response
masked (prompt only: nothing to copy from), the arithmetic alone.

`--arch llama` trains LLaDA's own block (the AR twin's Llama block without the causal mask,
transformers' EuroBERT class) instead of BERT; `--t-min` draws the mask ratio from
[t_min, 1] instead of (0, 1] (1: every response token masked on every row; not LLaDA, a
diagnostic of what the mixture of mask ratios costs); `--train-rows` the train split's size;
`--schedule block` masks block-wise as the decoder sees the response (`mdlm.block_mask`:
blocks before a random block k clean, block k at ratio t, later blocks fully masked).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch
    from transformers import set_seed

    from stages.diffureason import search as S
    from stages.diffureason import task as T
    from stages.diffureason.train import encode_rows
    from stages.models import mdlm
    from stages.train.sft import sft

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, nargs="+", default=[250, 1000])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--arch", choices=["bert", "llama"], default="bert")
    ap.add_argument("--t-min", type=float, default=0.0)
    ap.add_argument("--train-rows", type=int, default=3000)
    ap.add_argument("--schedule", choices=["llada", "block"], default="llada")
    ap.add_argument("--no-ar", action="store_true", help="diffusion LM only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = T.Config(modulus=10, operators="+-", min_steps=2, max_steps=4, block_size=8,
                   sizes={"test": 60, "val": 50, "train": args.train_rows})
    rows, tok = T.generate(cfg, 0), T.build_tokenizer()
    meta = {"prompt_len": cfg.prompt_len, "response_len": cfg.response_len,
            "block_size": cfg.block_size, "n_blocks": cfg.n_blocks, "modulus": cfg.modulus}
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    prompts, gold = [r["prompt"] for r in val], [r["answer"] for r in val]
    x_train = encode_rows(tok, [r["prompt"] for r in train], [r["response"] for r in train], meta)
    x_val = encode_rows(tok, prompts, [r["response"] for r in val], meta)
    size = mdlm.Config(arch=args.arch, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                       max_positions=64)
    print(f"first validation problem: {val[0]['prompt']} -> {val[0]['response']}")
    print(f"arch {args.arch}, t ~ U({args.t_min}, 1], schedule {args.schedule}, "
          f"{len(train)} train rows")
    print("| model | seed | steps | train loss | val greedy acc | probe: result / operand / "
          "symbol / eos | first result, all masked | first problem decoded | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for steps in args.steps:
        for seed in args.seeds:
            set_seed(seed)
            t0 = time.time()
            diff = mdlm.build_mdlm(size, tok)
            got = mdlm.train_mdlm(diff, x_train, cfg.prompt_len, tok.mask_token_id, steps=steps,
                                  batch_size=64, lr=3e-3, seed=seed, t_min=args.t_min,
                                  schedule=args.schedule, block_size=cfg.block_size)
            dec = S.Decoder(diff, tok, meta, seed=seed)
            x = dec.vanilla(prompts, steps=cfg.block_size // 2)
            kinds = probe(diff, tok, x_val, [r["response"] for r in val], cfg.prompt_len)
            print(f"| diffusion | {seed} | {steps} | {got['train_loss']:.3f} | "
                  f"{S.accuracy(dec, x, gold):.2f} | "
                  f"{' / '.join(f'{kinds[k]:.2f}' for k in ('result', 'operand', 'symbol', 'eos'))}"
                  f" | {first_result(diff, tok, x_val, val, cfg.prompt_len):.2f}"
                  f" | `{dec.response(x[0])}` | "
                  f"{time.time() - t0:.0f} |", flush=True)
            if args.no_ar:
                continue
            set_seed(seed)
            t0 = time.time()
            ar = mdlm.build_ar_twin(size, tok)
            got = sft(ar, tok, [r["prompt"] for r in train], [r["response"] for r in train],
                      steps=steps, batch_size=64, lr=3e-3, seed=seed, warmup=0.05,
                      min_lr_ratio=0.1, log_every=max(1, steps // 10))
            ar.generation_config.pad_token_id = tok.pad_token_id
            ar.generation_config.eos_token_id = tok.eos_token_id
            x = S.ARDecoder(ar, tok, meta, seed=seed).greedy(prompts)
            print(f"| AR twin | {seed} | {steps} | {float(got['train_loss']):.3f} | "
                  f"{S.accuracy(dec, x, gold):.2f} | - | - | `{dec.response(x[0])}` | "
                  f"{time.time() - t0:.0f} |", flush=True)


def kind_of(response: str, j: int) -> str:
    """What response position j holds: result, operand, symbol or eos (module docstring)."""
    if j >= len(response):
        return "eos"
    if not response[j].isdigit():
        return "symbol"
    return "result" if j > 0 and response[j - 1] in "=#" else "operand"


def first_result(model, tok, x_val, val: list[dict], prompt_len: int) -> float:
    """The first step's result digit with the whole response masked (module docstring)."""
    import torch

    x = x_val.clone()
    x[:, prompt_len:] = tok.mask_token_id
    pos = [r["response"].index("=") + 1 for r in val]
    with torch.no_grad():
        logits = model(input_ids=x, attention_mask=(x != tok.pad_token_id).long()).logits
    pred = torch.stack([logits[i, prompt_len + p].argmax() for i, p in enumerate(pos)])
    gold = torch.stack([x_val[i, prompt_len + p] for i, p in enumerate(pos)])
    return float((pred == gold).float().mean())


def probe(model, tok, x_val, responses: list[str], prompt_len: int) -> dict[str, float]:
    """Single-position masked accuracy by kind (module docstring)."""
    import torch

    hits: dict[str, list[int]] = {}
    with torch.no_grad():
        for j in range(x_val.shape[1] - prompt_len):
            x = x_val.clone()
            x[:, prompt_len + j] = tok.mask_token_id
            logits = model(input_ids=x, attention_mask=(x != tok.pad_token_id).long()).logits
            right = logits[:, prompt_len + j].argmax(-1) == x_val[:, prompt_len + j]
            for i, r in enumerate(responses):
                hits.setdefault(kind_of(r, j), []).append(int(right[i]))
    return {k: sum(v) / len(v) for k, v in hits.items()}


if __name__ == "__main__":
    main()
