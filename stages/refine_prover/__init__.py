"""Refine-Prover (Li, Tian, Wang, "Compile to Compress: Boosting Formal Theorem Provers with
Compiler Outputs", ICML 2026, arXiv 2604.18587; no official code) on a toy proof language.

    kernel.py    the tactic language, its proof kernel with structured errors (line, class,
                 residual goal), the scripted first-error fixer, z3 certification and the Coq
                 `lia` cross-check
    prover.py    prompts, the refinement tree's model for the shared search engine, the
                 long-history chain, the value model (logistic regression on error features)
    problems.py  stage `problems`; train.py stage `train`; search.py stage `search`;
    compare.py   stage `compare` (claims by the house rule) and the README table
"""
