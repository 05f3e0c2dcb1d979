"""How many updates does the Early Experience IL policy need? Chosen on validation goals.

    .venv/bin/python benchmarks/early_experience_budget.py --steps 300 1000 --seeds 0
    .venv/bin/python benchmarks/early_experience_budget.py --world babyai --steps 250 500
    .venv/bin/python benchmarks/early_experience_budget.py --arm dpo --dpo-lr 1e-3 1e-4 1e-5

A diagnostic behind the `cpu` profile's update budget (`pipelines/early_experience/params.yaml`,
`train.steps`), chosen WITHOUT the test or OOD goals: the IL policy (the pipeline's `train_one`
with the active profile's `train` section, every demonstration) is trained for each step count
and seed, then played (the `evaluate` stage's budget, prompt and local backend) on
**validation goals**: in-domain goals drawn with a generator seed of their own over the train
goals' (colour, category) pairs (never a held-out `ood_combo` pair), none of them a train or
test goal. Prints the success rate, the parse-failure rate and the training seconds.
Needs the pipeline's `shop` stage output (`paperline repro early_experience` first). With
`--world babyai`: the `babyai_train` / `babyai_evaluate` sections, the `babyai` stage's
demonstrations, and validation missions from level seeds of their own (`BABYAI_VAL_START`, a
ball or a box as the target like train and test, none of their seeds). With `--arm dpo`: the
DPO arm instead (IL, then DPO on the experience stage's expert-vs-alternative pairs, as the
pipeline's `train`), once per `--dpo-lr` (the DPO phase's peak learning rate).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# make_goals seeds: 1 train, 2 test, 3 OOD, 4 OOD combinations (stages/early_experience/build.py);
# validation goals use 5 (4 until the held-out pairs existed, 2026-12-07) and the train pairs only
VAL_SEED = 5
BABYAI_VAL_START = 3_000_000   # level seeds: train 0.., test 1e6.., OOD 2e6.. (params.yaml)


def main() -> None:
    from stages.agents.imitation import il_examples
    from stages.agents.rollout import Budget, ModelAgent, run_episodes
    from stages.agents.trajectories import read_rollouts, summarise, to_frames
    from stages.core.config import validate_section
    from stages.core.runner import load_params
    from stages.early_experience import babyai, shop
    from stages.early_experience.evaluate import Config as EvalConfig
    from stages.early_experience.train import Config as TrainConfig, train_one, world_tokenizer
    from stages.models.backend import make_backend

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, nargs="+", default=[300, 1000])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--n-val", type=int, default=100)
    ap.add_argument("--world", choices=["shop", "babyai"], default="shop")
    ap.add_argument("--arm", choices=["il", "dpo"], default="il")
    ap.add_argument("--dpo-lr", type=float, nargs="+", default=[None])
    args = ap.parse_args()
    if args.arm == "il" and args.dpo_lr != [None]:
        ap.error("--dpo-lr goes with --arm dpo (IL has no DPO phase)")
    root_params, params, source = load_params(ROOT, "early_experience")
    profile = root_params.get("profile", "cpu")
    pre = "babyai_" if args.world == "babyai" else ""
    tcfg = validate_section(TrainConfig, params, f"{pre}train", profile, source)
    ecfg = validate_section(EvalConfig, params, f"{pre}evaluate", profile, source)
    data = ROOT / "pipelines/early_experience/data" / args.world
    if args.world == "babyai":
        level = babyai.read_episodes(data)["train"][0].level
        val_seeds = babyai.draw_seeds(level, babyai.IN_DOMAIN, args.n_val, BABYAI_VAL_START)

        def val_envs() -> list:
            return [babyai.BabyAIEnv(level, s) for s, _ in val_seeds]
    else:
        catalogue, goals = shop.read_shop(data)
        taken = set(goals["train"]) | set(goals["test"])
        seen_pairs = sorted({(g.color, g.category) for g in goals["train"]})
        pool = shop.make_goals(catalogue, shop.IN_DOMAIN, 4 * args.n_val, VAL_SEED,
                               ecfg.max_results, pairs=seen_pairs)
        val = [g for g in pool if g not in taken][:args.n_val]

        def val_envs() -> list:
            return shop.envs_for(catalogue, val, "val", ecfg.max_results)
    episodes, steps = read_rollouts(data / "expert")
    il = il_examples(episodes, steps)
    train_data: dict = {"il": il}
    import polars as pl
    import yaml

    from stages.core.checks import read_parquet_checked
    from stages.early_experience.experience import dpo_pairs, experience_spec

    folder = ROOT / "pipelines/early_experience"
    paths = yaml.safe_load((folder / "params.yaml").read_text())["paths"]
    exp = read_parquet_checked(folder / paths[tcfg.experience], experience_spec())
    ok = sorted(int(s.split("/")[1]) for s in
                episodes.filter(pl.col("success"))["episode_id"].to_list())
    rows = exp.filter(pl.col("episode").is_in(ok)).to_dicts()
    # the `train` stage's tokenizer: learnt on every arm's texts (`world_tokenizer`)
    tok_json = world_tokenizer(tcfg, il, rows)
    if args.arm == "dpo":
        train_data["dpo"] = dpo_pairs(rows, tcfg.prompt, tcfg.k)
    budget = Budget(max_steps=ecfg.max_steps, max_new_tokens=ecfg.max_new_tokens,
                    max_failures=ecfg.max_failures)
    print(f"profile {profile}, {args.world}: {args.arm} on {len(il[0])} expert turns, "
          f"{args.n_val} validation goals (none a train or test goal)")
    print("| arm | updates | DPO lr | seed | train loss | val success | parse failures / turn "
          "| train s |")
    print("|---|---|---|---|---|---|---|---|")
    for n, dpo_lr, seed in [(n, d, s) for n in args.steps for d in args.dpo_lr
                            for s in args.seeds]:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = tcfg.model_copy(update={"steps": n, "dpo_lr": dpo_lr or tcfg.dpo_lr})
            m = train_one({"cfg": cfg.model_dump(), "arm": args.arm, "seed": seed,
                           "data": train_data, "tokenizer": tok_json,
                           "out": str(Path(tmp) / "il"),
                           "threads": 1})
            agent = ModelAgent(make_backend(ecfg.policy.model_copy(
                update={"model": str(Path(tmp) / "il")}), root=ROOT), name="il")
            envs = val_envs()
            eps = run_episodes(envs, agent, budget, ecfg.prompt,
                               episode_ids=[f"val/{i}" for i in range(len(envs))],
                               batch_size=ecfg.batch_size, seed=seed)
        s = summarise(to_frames(eps, "il")[0])
        lr_shown = "-" if args.arm == "il" else f"{cfg.dpo_lr or cfg.lr / 3:g}"
        print(f"| {args.arm} | {n} | {lr_shown} | {seed} | {m['train_loss']:.3f} | "
              f"{s['success_rate']:.3f} | "
              f"{s['parse_failure_rate']:.3f} | {m['train_seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
