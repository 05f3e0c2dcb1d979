"""DiffuReason: Monte Carlo tree search for diffusion language models.

Song, You, Tian, Su, Huang, Hou, "DiffuReason: Enhancing Reasoning Ability for Diffusion
Language Models via Monte Carlo Tree Search", ICML 2026 (poster 64457). No arXiv copy and no
official code were found: the four stages (select, expand, simulate, revise) over thought
blocks come from the abstract, in-place re-masking revision from the authors' lab post, the
rest is reconstructed (pipelines/diffureason/README.md lists every choice).

    task.py     stage `problems`: modular multi-step arithmetic with a chain of thought
    train.py    stage `train`: the diffusion LM (LLaDA objective, `stages.models.mdlm`) and
                its autoregressive twin, per seed
    search.py   stage `search`: vanilla, best-of-N, DiffuReason (with and without revision)
                and AR + MCTS on the NFE grid, on the shared engine (`stages.search`)
    compare.py  stage `compare`: paired claims by the house rule, table and curve
"""
