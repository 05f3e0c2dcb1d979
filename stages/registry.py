"""Which code runs each stage: a plain dict, pipeline -> stage name (as in dvc.yaml) -> module.

Each module defines `Config` (a pydantic model, extra="forbid") and `run(cfg, ctx) -> dict`.
The DAG itself lives only in dvc.yaml; this maps a stage name to its code, nothing more.
The params section a stage reads is its stage name.
"""

from __future__ import annotations

STAGES: dict[str, dict[str, str]] = {
    # Shared stages of the root dvc.yaml; together they are the pipeline named "base".
    "base": {
        "tasks": "stages.tasks.build",
        "tokenizer": "stages.models.tokenizer",
        "base": "stages.models.base",
        "evaluate": "stages.evaluate.accuracy",
    },
    # R²VPO (ratio-variance constraint) vs clipped GRPO/PPO: every LLM arm is the shared GRPO
    # trainer with its own params section; `control` is the SB3 continuous-control arm.
    "r2vpo": {
        "prompts": "stages.tasks.prompts",
        "grpo": "stages.train.grpo",
        "grpo_replay": "stages.train.grpo",
        "r2vpo": "stages.train.grpo",
        "r2vpo_fixed_lambda": "stages.train.grpo",
        "r2vpo_no_replay": "stages.train.grpo",
        "control": "stages.train.control",
        "compare": "stages.evaluate.rl_compare",
    },
    # HSIR (VeriExit + InDiv self-improvement) vs STaR / ReST-EM / a length filter, and H-GRPO vs
    # GRPO / GRPO + length penalty: every self-training arm is `self_improve` with its own pool
    # rule, every RL arm the shared GRPO trainer with its own reward bonus.
    "hsir": {
        "prompts": "stages.tasks.prompts",
        "hard_prompts": "stages.tasks.prompts",
        "seed_sft": "stages.train.hsir_seed",
        "star": "stages.train.self_improve",
        "rest_em": "stages.train.self_improve",
        "veriexit": "stages.train.self_improve",
        "indiv": "stages.train.self_improve",
        "hsir": "stages.train.self_improve",
        "length_filter": "stages.train.self_improve",
        "grpo": "stages.train.grpo",
        "h_grpo": "stages.train.grpo",
        "grpo_length": "stages.train.grpo",
        "compare": "stages.evaluate.hsir_compare",
    },
    # BIS: Monte Carlo-annotated rollouts -> subsets chosen by the Balanced-Information Score
    # (and random / heuristic / full baselines) -> one PRM per subset -> step F1 and best-of-N.
    "bis": {
        "problems": "stages.tasks.prompts",
        "rollouts": "stages.models.rollouts",
        "mc_annotate": "stages.models.mc_annotate",
        "select": "stages.select.bis",
        "train_prm": "stages.train.prm",
        "evaluate": "stages.evaluate.prm_eval",
        "compare": "stages.evaluate.bis_compare",
    },
    # EDCO: entropy-driven dynamic curriculum on a new domain (arith with `*`): the prefix
    # entropy estimator vs the full answer, curriculum SFT (EDCO, its mean-aggregation ablation,
    # dynamic loss, random, easy-to-hard, static PPL) and curriculum GRPO (EDCO vs random).
    "edco": {
        "pool": "stages.select.edco_pool",
        "entropy_estimate": "stages.select.edco",
        "sft_edco": "stages.train.edco_sft",
        "sft_edco_mean": "stages.train.edco_sft",
        "sft_loss": "stages.train.edco_sft",
        "sft_random": "stages.train.edco_sft",
        "sft_easy_to_hard": "stages.train.edco_sft",
        "sft_ppl": "stages.train.edco_sft",
        "rl_edco": "stages.train.edco_rl",
        "rl_random": "stages.train.edco_rl",
        "compare": "stages.evaluate.edco_compare",
    },
    # ProofVerify: candidates labelled by the exact verifier (proof-level and final-answer) ->
    # a tiny judge + GenSelect selector -> pure Judge, pure GenSelect knockout, their Hybrid
    # (one module, three params sections) -> compare with majority vote and a random pick.
    "proofverify": {
        "candidates": "stages.verify.proofverify_candidates",
        "train_judge": "stages.verify.proofverify_train",
        "judge": "stages.verify.proofverify_select",
        "genselect": "stages.verify.proofverify_select",
        "hybrid": "stages.verify.proofverify_select",
        "oracle": "stages.verify.proofverify_oracle",
        "compare": "stages.evaluate.proofverify_compare",
    },
    # RACER: two judges fine-tuned from the base model (direct yes/no vs recompute-then-verdict),
    # their offline outcomes, MiniLM features, budgeted DRO routers (primal-dual) vs ERM and
    # baselines under a difficulty shift, and the solver checked against cvxpy.
    "racer": {
        "judges": "stages.verify.racer_judges",
        "judge_outcomes": "stages.verify.racer_outcomes",
        "features": "stages.verify.racer_features",
        "train_router": "stages.verify.racer",
        "solver_check": "stages.verify.racer_solver",
        "evaluate": "stages.evaluate.racer_compare",
    },
    # TRACE: Toulmin-argued arithmetic CoTs -> 8-label sentence tagger -> TRACE of sampled CoTs
    # from generators of varied argument quality -> correlation with accuracy; GRPO with
    # accuracy-only vs accuracy + TRACE reward (both arms are stages.verify.trace_rl).
    "trace": {
        "corpus": "stages.verify.trace_data",
        "label": "stages.verify.trace_label",
        "policy": "stages.verify.trace_policy",
        "score": "stages.verify.trace_score",
        "correlate": "stages.verify.trace_correlate",
        "rl_acc": "stages.verify.trace_rl",
        "rl_trace": "stages.verify.trace_rl",
        "compare": "stages.evaluate.trace_compare",
    },
}

# How each pipeline's README results table is rendered from its DVC metrics ("module:function"
# taking {stage: metrics} and returning markdown). Pipelines not listed get a plain table.
REPORTS: dict[str, str] = {
    "base": "stages.evaluate.report:base_results_table",
    "r2vpo": "stages.evaluate.rl_compare:results_table",
    "hsir": "stages.evaluate.hsir_compare:results_table",
    "bis": "stages.evaluate.bis_compare:results_table",
    "edco": "stages.evaluate.edco_compare:results_table",
    "trace": "stages.evaluate.trace_compare:results_table",
    "proofverify": "stages.evaluate.proofverify_compare:results_table",
    "racer": "stages.evaluate.racer_compare:results_table",
}
