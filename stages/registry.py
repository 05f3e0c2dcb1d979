"""Which code runs each stage: a plain dict, pipeline -> stage name (as in dvc.yaml) -> module.

Each module defines `Config` (a pydantic model, extra="forbid") and `run(cfg, ctx) -> dict`.
The DAG itself lives only in dvc.yaml; this maps a stage name to its code, nothing more.
The params section a stage reads is its stage name.
"""

from __future__ import annotations

# Pipelines of shared substrates, not papers: their packages are engines every paper may import
# (`base`: tasks, tokenizer, base model; `serving`: the serving simulator and its checks;
# `vlm`: the image task families and the tiny vision-language models).
SHARED: frozenset[str] = frozenset({"base", "serving", "vlm"})

# A paper's package where it is not `stages/<slug>/` (the import rule checks it as that paper's):
# the CoRe paper's slug `core` would clash with `stages/core`, the stage contract.
PACKAGES: dict[str, str] = {"core": "core_align"}

STAGES: dict[str, dict[str, str]] = {
    # Shared stages of the root dvc.yaml; together they are the pipeline named "base".
    "base": {
        "tasks": "stages.tasks.build",
        "tokenizer": "stages.models.tokenizer",
        "base": "stages.models.base",
        "evaluate": "stages.evaluate.accuracy",
    },
    # R²VPO (ratio-variance constraint) vs clipped GRPO/PPO: every LLM arm is stages.r2vpo.rl
    # (the shared GRPO engine; policy_loss picks the trainer class) with its own params section;
    # `control` is the SB3 continuous-control arm.
    "r2vpo": {
        "prompts": "stages.tasks.prompts",
        "grpo": "stages.r2vpo.rl",
        "grpo_replay": "stages.r2vpo.rl",
        "r2vpo": "stages.r2vpo.rl",
        "r2vpo_fixed_lambda": "stages.r2vpo.rl",
        "r2vpo_no_replay": "stages.r2vpo.rl",
        "control": "stages.r2vpo.control",
        "compare": "stages.r2vpo.compare",
    },
    # HSIR (VeriExit + InDiv self-improvement) vs STaR / ReST-EM / a length filter, and H-GRPO vs
    # GRPO / GRPO + length penalty: every self-training arm is `self_improve` with its own pool
    # rule, every RL arm `stages.hsir.rl` (the shared GRPO engine) with its own reward bonus.
    "hsir": {
        "prompts": "stages.tasks.prompts",
        "hard_prompts": "stages.tasks.prompts",
        "seed_sft": "stages.hsir.seed_sft",
        "star": "stages.hsir.self_improve",
        "rest_em": "stages.hsir.self_improve",
        "veriexit": "stages.hsir.self_improve",
        "indiv": "stages.hsir.self_improve",
        "hsir": "stages.hsir.self_improve",
        "length_filter": "stages.hsir.self_improve",
        "grpo": "stages.hsir.rl",
        "h_grpo": "stages.hsir.rl",
        "grpo_length": "stages.hsir.rl",
        "compare": "stages.hsir.compare",
    },
    # BIS: Monte Carlo-annotated rollouts -> subsets chosen by the Balanced-Information Score
    # (and random / heuristic / full baselines) -> one PRM per subset -> step F1 and best-of-N.
    "bis": {
        "problems": "stages.tasks.prompts",
        "rollouts": "stages.models.rollouts",
        "mc_annotate": "stages.models.mc_annotate",
        "select": "stages.bis.bis",
        "train_prm": "stages.train.prm",
        "evaluate": "stages.bis.prm_eval",
        "compare": "stages.bis.compare",
    },
    # EDCO: entropy-driven dynamic curriculum on a new domain (arith with `*`): the prefix
    # entropy estimator vs the full answer, curriculum SFT (EDCO, its mean-aggregation ablation,
    # dynamic loss, random, easy-to-hard, static PPL) and curriculum GRPO (EDCO vs random).
    "edco": {
        "pool": "stages.edco.pool",
        "entropy_estimate": "stages.edco.edco",
        "sft_edco": "stages.edco.sft",
        "sft_edco_mean": "stages.edco.sft",
        "sft_loss": "stages.edco.sft",
        "sft_random": "stages.edco.sft",
        "sft_easy_to_hard": "stages.edco.sft",
        "sft_ppl": "stages.edco.sft",
        "rl_edco": "stages.edco.rl",
        "rl_random": "stages.edco.rl",
        "compare": "stages.edco.compare",
    },
    # ProofVerify: candidates labelled by the exact verifier (proof-level and final-answer) ->
    # a tiny judge + GenSelect selector -> pure Judge, pure GenSelect knockout, their Hybrid and
    # its lenient-score ablation (one module, four params sections) -> compare with majority vote
    # and a random pick.
    "proofverify": {
        "candidates": "stages.proofverify.candidates",
        "train_judge": "stages.proofverify.train_judge",
        "judge": "stages.proofverify.select",
        "genselect": "stages.proofverify.select",
        "hybrid": "stages.proofverify.select",
        "hybrid_lenient": "stages.proofverify.select",
        "oracle": "stages.proofverify.oracle",
        "compare": "stages.proofverify.compare",
    },
    # RACER: two judges fine-tuned from the base model (direct yes/no vs recompute-then-verdict),
    # their offline outcomes, MiniLM features, budgeted DRO routers (primal-dual) vs ERM and
    # baselines under a difficulty shift, and the tabular solver checked against a direct
    # solution (a 1-D search for lambda* and the KL-ball convex program, cvxpy).
    "racer": {
        "judges": "stages.racer.judges",
        "judge_outcomes": "stages.racer.outcomes",
        "features": "stages.racer.features",
        "train_router": "stages.racer.racer",
        "solver_check": "stages.racer.solver_check",
        "evaluate": "stages.racer.compare",
    },
    # TRACE: Toulmin-argued arithmetic CoTs -> 8-label sentence tagger -> TRACE of sampled CoTs
    # from generators of varied argument quality -> correlation with accuracy; GRPO with
    # accuracy-only vs accuracy + TRACE reward (both arms are stages.trace.rl).
    "trace": {
        "corpus": "stages.trace.corpus",
        "label": "stages.trace.label",
        "policy": "stages.trace.policy",
        "score": "stages.trace.score",
        "correlate": "stages.trace.correlate",
        "rl_acc": "stages.trace.rl",
        "rl_trace": "stages.trace.rl",
        "compare": "stages.trace.compare",
    },
    # The shared serving substrate (issue 17), like "base" for the LLM papers: the measured
    # latency profile the serving papers read, and the simulator's checks against queueing
    # theory (check 1) and a real continuous-batching server (check 2).
    "serving": {
        "profile_engine": "stages.serving.profile",
        "queueing_check": "stages.serving.queueing_check",
        "validate_sim": "stages.serving.validate",
    },
    # The shared vision-language substrate (issue 18), like "base" for the vision papers: the
    # shapes world and rendered-text families, a tiny LLaVA per family and seed (vlm-shapes,
    # vlm-text), and the gates the papers need (hallucination to fix, text that can be read).
    "vlm": {
        "data": "stages.tasks.vlm_data",
        "train_shapes": "stages.train.vlm",
        "train_text": "stages.train.vlm",
        "gates": "stages.evaluate.vlm_gates",
    },
    # AMPD: multi-round agent sessions on a simulated 8-GPU PD-disaggregated cluster; where each
    # (incremental) prefill runs and in what order, against Dynamo-like, always-local and
    # colocated serving; the replica plan by ILP. One simulation stage runs every arm.
    "ampd": {
        "workload": "stages.ampd.workload",
        "plan": "stages.ampd.planner",
        "simulate": "stages.ampd.simulate",
        "compare": "stages.ampd.compare",
    },
    # MAPS: Appendix A skew simulation; a real length predictor + conformal bound (UAC) on the
    # base model's own generations; ShareGPT-like, bursty and own-model traces; every arm
    # (stages.maps.policies) on the serving simulator; claims by paired CI.
    "maps": {
        "motivation": "stages.maps.motivation",
        "predictor": "stages.maps.predictor",
        "workload": "stages.maps.workload",
        "simulate": "stages.maps.simulate",
        "compare": "stages.maps.compare",
    },
    # GIFT: gaze-shift saliency + balanced attention rescaling (training-free) vs greedy, a
    # VAF-like uniform visual boost and the visual-only ablation, on the vlm pipeline's
    # vlm-shapes checkpoints; alpha and layers on the validation split.
    "gift": {
        "calibrate": "stages.gift.calibrate",
        "decode": "stages.gift.decode",
        "compare": "stages.gift.compare",
    },
    # CoRe: the vlm-text checkpoints post-trained on rendered-text QA under text SFT, visual SFT
    # and visual SFT + step-wise matching to the model's own text-conditioned policy (a
    # stop-gradient dynamic anchor), then GRPO on the page without and with that anchor; every
    # arm answers from the text and from the page. At `cpu` the pages are the `pages` stage's
    # key->value pages asked by position (the retrieval the tiny family learns in budget).
    "core": {
        "pages": "stages.core_align.pages",
        "sft": "stages.core_align.sft",
        "grpo": "stages.core_align.grpo",
        "compare": "stages.core_align.compare",
    },
    # SAME: MoE-LoRA continual instruction tuning of the frozen vlm-shapes checkpoints on five
    # sequential shapes tasks: LoRA, MoE-LoRA, + spectral router, + curvature, + freezing.
    "same": {
        "tasks": "stages.same.data",
        "train": "stages.same.train",
        "compare": "stages.same.compare",
    },
    # BridgeVLM: rendered (before, after) pairs of two SCMs -> the tiny VLM from scratch per arm
    # (answer-only, prompt-level, Causal Tokens + RAMP + M3S and its ablations, a true-variable
    # oracle) -> intervention / counterfactual accuracy and structure F1 by paired CI.
    "bridgevlm": {
        "data": "stages.tasks.pendulum",
        "train": "stages.bridgevlm.train",
        "compare": "stages.bridgevlm.compare",
    },
    # DDR: question-free exploration of per-patient SQLite databases (read-only, SELECT-only
    # guard) scored on hidden checklists; a tiny Llama explorer imitating the scripted
    # breadth-first one, against scripted breadth/depth/random/reactive reference arms.
    "ddr": {
        "databases": "stages.ddr.databases",
        "expert": "stages.ddr.expert",
        "train_explorer": "stages.ddr.train_explorer",
        "explore": "stages.ddr.explore",
        "score": "stages.ddr.score",
        "compare": "stages.ddr.compare",
    },
    # PlugMem: LongMemEval-lite + two-hop corpus -> a learned structurer -> the knowledge-graph
    # memory (thresholds recalibrated on val) and raw / BM25 / no-memory arms -> a learned reader.
    "plugmem": {
        "corpus": "stages.plugmem.corpus",
        "train_structurer": "stages.plugmem.train",
        "structure": "stages.plugmem.structure",
        "memory": "stages.plugmem.memory",
        "train_reader": "stages.plugmem.train",
        "answer": "stages.plugmem.answer",
        "compare": "stages.plugmem.compare",
    },
    # Early Experience: a text mini-WebShop (scripted expert, OOD categories), one-step
    # alternatives from expert states, tiny Llama policies at equal update counts: imitation,
    # implicit world modelling -> imitation, templated self-reflection + imitation, DPO.
    "early_experience": {
        "shop": "stages.early_experience.build",
        "experience": "stages.early_experience.explore",
        "train": "stages.early_experience.train",
        "evaluate": "stages.early_experience.evaluate",
        "babyai": "stages.early_experience.build_babyai",
        "babyai_experience": "stages.early_experience.explore",
        "babyai_train": "stages.early_experience.train",
        "babyai_evaluate": "stages.early_experience.evaluate",
        "compare": "stages.early_experience.compare",
    },
    # Refine-Prover: a toy tactic language with a Python kernel (z3-certified statements, a
    # Coq `lia` cross-check), a tiny base prover and refiner (cold start + expert iteration), a
    # value model; i.i.d. sampling vs random / value-guided refinement trees on a budget grid.
    "refine_prover": {
        "problems": "stages.refine_prover.problems",
        "train": "stages.refine_prover.train",
        "search": "stages.refine_prover.search",
        "compare": "stages.refine_prover.compare",
    },
    # CoT-FSM: a task family of state-templated CoTs, a tiny model trained on them, the offline
    # FSM fit (R, Q, probes, steering vectors per layer) and four steering arms on an nfe grid.
    "cotfsm": {
        "traces": "stages.cotfsm.traces",
        "train": "stages.cotfsm.train",
        "fit_fsm": "stages.cotfsm.fit",
        "steer_eval": "stages.cotfsm.steer",
        "compare": "stages.cotfsm.compare",
    },
    # DiffuReason: a tiny masked-diffusion LM (LLaDA objective) and its AR twin on modular
    # arithmetic with a chain of thought; UCT over thought blocks with coarse-rollout values and
    # in-place revision vs vanilla, best-of-N and AR + MCTS on an NFE grid.
    "diffureason": {
        "problems": "stages.diffureason.task",
        "train": "stages.diffureason.train",
        "search": "stages.diffureason.search",
        "compare": "stages.diffureason.compare",
    },
}

# How each pipeline's README results table is rendered from its DVC metrics ("module:function"
# taking {stage: metrics} and returning markdown). Pipelines not listed get a plain table.
REPORTS: dict[str, str] = {
    "base": "stages.evaluate.report:base_results_table",
    "r2vpo": "stages.r2vpo.compare:results_table",
    "hsir": "stages.hsir.compare:results_table",
    "bis": "stages.bis.compare:results_table",
    "edco": "stages.edco.compare:results_table",
    "trace": "stages.trace.compare:results_table",
    "proofverify": "stages.proofverify.compare:results_table",
    "racer": "stages.racer.compare:results_table",
    "serving": "stages.serving.report:results_table",
    "vlm": "stages.evaluate.vlm_gates:results_table",
    "ampd": "stages.ampd.compare:results_table",
    "maps": "stages.maps.compare:results_table",
    "gift": "stages.gift.compare:results_table",
    "core": "stages.core_align.compare:results_table",
    "same": "stages.same.compare:results_table",
    "bridgevlm": "stages.bridgevlm.compare:results_table",
    "ddr": "stages.ddr.compare:results_table",
    "plugmem": "stages.plugmem.compare:results_table",
    "early_experience": "stages.early_experience.compare:results_table",
    "refine_prover": "stages.refine_prover.compare:results_table",
    "cotfsm": "stages.cotfsm.compare:results_table",
    "diffureason": "stages.diffureason.compare:results_table",
}

# The root README's pipeline table (`paperline report` renders it with the measured `cpu` wall
# time from benchmarks/RESULTS.md and the claim verdicts from each pipeline's metrics).
PAPERS: dict[str, dict[str, str]] = {
    "base": {"paper": "(shared)",
             "compares": "the tiny base model and `arith` tasks every paper builds on"},
    "r2vpo": {"paper": "R²VPO, arXiv 2605.26784",
              "compares": "ratio-variance policy optimisation vs clipped GRPO (LLM RL + SB3 "
                          "control)"},
    "hsir": {"paper": "HSIR / H-GRPO, arXiv 2605.24998",
             "compares": "VeriExit + InDiv self-training vs STaR / ReST-EM; H-GRPO vs GRPO"},
    "bis": {"paper": "BIS, arXiv 2602.04145",
            "compares": "PRM data subsets by Balanced-Information Score vs random and full data"},
    "edco": {"paper": "EDCO, arXiv 2601.03725",
             "compares": "entropy-driven dynamic curriculum vs static and random curricula"},
    "proofverify": {"paper": "ProofVerify, arXiv 2511.13027",
                    "compares": "LLM-as-a-judge, GenSelect and their hybrid vs majority vote and "
                                "a random pick"},
    "racer": {"paper": "RACER, arXiv 2605.10805",
              "compares": "KL-robust budgeted routing between a reasoning and a direct judge vs "
                          "ERM, threshold, always-one, random"},
    "maps": {"paper": "MAPS, arXiv 2609.15359",
             "compares": "predictive, memory-aware dispatch + SJF vs round-robin, least-request, "
                         "Llumnix-like on a simulated PD-disaggregated cluster"},
    "ddr": {"paper": "DDR, arXiv 2602.02039",
            "compares": "question-free database exploration: a learned (imitation) explorer vs "
                        "scripted breadth-first, depth-first, random and reactive explorers"},
    "plugmem": {"paper": "PlugMem, arXiv 2603.03296",
                "compares": "knowledge-graph memory (learned structurer, tag votes, reasoning) vs "
                            "no memory, raw-chunk and BM25 retrieval, read by a learned reader"},
    "early_experience": {"paper": "Early Experience, arXiv 2510.08558",
                         "compares": "implicit world modelling and (templated) self-reflection "
                                     "from one-step alternatives vs imitation and DPO at equal "
                                     "updates, tiny Llama agents on a text mini-WebShop and on "
                                     "BabyAI (minigrid) behind a text wrapper"},
    "refine_prover": {"paper": "Refine-Prover, arXiv 2604.18587",
                      "compares": "feedback-conditioned proof repair trees (random, value-guided) "
                                  "vs i.i.d. sampling, long-history and untrained refiners at "
                                  "equal generation budgets (toy kernel)"},
    "trace": {"paper": "TRACE, arXiv 2605.29656",
              "compares": "Toulmin-structure score of chains of thought: correlation with "
                          "accuracy; GRPO with a TRACE reward"},
    "serving": {"paper": "(shared)",
                "compares": "the serving simulator against queueing theory and a real "
                            "continuous-batching server; the latency profile AMPD and MAPS read"},
    "vlm": {"paper": "(shared)",
            "compares": "the shapes world and rendered-text tasks and the tiny VLMs (vlm-shapes, "
                        "vlm-text) the vision papers build on, against their gates"},
    "gift": {"paper": "GIFT, arXiv 2510.22067",
             "compares": "gaze-shift saliency attention boost with query rescaling vs greedy, a "
                         "VAF-like visual boost and the visual-only ablation (tiny VLM, CHAIR / "
                         "POPE)"},
    "core": {"paper": "CoRe, ICML 2026 poster 64509 (abstract only)",
             "compares": "visual SFT / GRPO + step-wise KL to the model's own text-conditioned "
                         "policy (stop-gradient dynamic anchor) vs visual SFT / GRPO and text "
                         "SFT (tiny VLM, rendered text pages, gap recovery)"},
    "same": {"paper": "SAME, arXiv 2602.01990",
             "compares": "stabilised MoE-LoRA (spectral router, curvature-scaled experts, "
                         "adaptive freezing) vs LoRA and MoE-LoRA, five sequential tasks on "
                         "the frozen tiny VLM (accuracy, BWT, router drift)"},
    "bridgevlm": {"paper": "BridgeVLM, arXiv 2606.11745",
                  "compares": "Causal Tokens from an induced soft DAG (RAMP, M3S) vs answer-only "
                              "and prompt-level fine-tuning, three ablations, RAMP before the "
                              "decoder only, and a true-variable oracle (tiny VLM, rendered SCM "
                              "image pairs)"},
    "ampd": {"paper": "AMPD, arXiv 2602.14516",
             "compares": "local vs remote (incremental) prefill routing, reordering and a replica "
                         "ILP vs Dynamo-like, always-local and colocated serving (simulated)"},
    "cotfsm": {"paper": "CoT-FSM, arXiv 2510.22437",
               "compares": "Q-value activation steering at sentence ends vs greedy, weighted and "
                           "no steering of a tiny model's state-templated CoTs, on an nfe grid"},
    "diffureason": {"paper": "DiffuReason, ICML 2026 (no arXiv copy)",
                    "compares": "UCT over thought blocks of a tiny diffusion LM (coarse-rollout "
                                "value, in-place revision) vs vanilla decoding, best-of-N and AR "
                                "+ MCTS on an NFE grid"},
}
