"""The shared reasoning-time search engine: a tree over partial solutions, a compute ledger and
budget grids. It holds no paper code; papers bring their model (what a child is, how it is
valued) as a `uct.SearchModel` from their own package.

Used by the reasoning-time search papers:
- DiffuReason (ICML 2026, no arXiv copy): UCT over thought blocks of a diffusion LM, and the
  AR + MCTS baseline, on an NFE grid;
- Refine-Prover (arXiv 2604.18587): random and value-guided refinement trees, budgets in
  generations, input and output tokens reported apart;
- CoT-FSM (arXiv 2510.22437): arms compared at equal, reported compute; its activation reading
  and steering live in `stages/models/hooks.py`.

    ledger.py   Cost (nfe, generations, input/output tokens, value calls), Budget, Meter,
                Ledger: what every arm spent per problem; a charge past a budget raises
    uct.py      SearchConfig, Tree, Search: select (UCB1 / PUCT / best-first / random),
                expand, evaluate, backup; one batched model call per round across problems
    budget.py   run_budget_grid, compute_curve, plot_accuracy_vs_compute: every arm at every
                budget of a grid, accuracy against compute
"""
