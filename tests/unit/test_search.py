"""The shared search engine (stages/search): UCT finds a known optimum that greedy misses, the
ledger counts exactly the model work done and never lets a problem past its budget, a forest run
batched builds the same trees as one problem at a time, and budget grids stop exactly at B."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from stages.search.budget import compute_curve, plot_accuracy_vs_compute, run_budget_grid
from stages.search.ledger import Budget, BudgetExceeded, Cost, Ledger
from stages.search.uct import Child, Evaluation, Expansion, Search, SearchConfig, Tree

# --- a toy problem with a known optimum ------------------------------------------------------
# Depth-3 tree, branching 3; a state is the tuple of actions taken. Branch 0 is uniformly decent
# (every leaf 0.6); branch 1 hides the only best leaf (1, 2, 0) = 1.0 among poor ones (0.1);
# branch 2 is mediocre (0.3). The value of an inner node is the mean of the leaves below it, so
# a greedy search (c = 0) commits to branch 0 and never finds the optimum.
DEPTH, K = 3, 3
BEST = (1, 2, 0)


def reward(leaf: tuple[int, ...]) -> float:
    if leaf == BEST:
        return 1.0
    return {0: 0.6, 1: 0.1, 2: 0.3}[leaf[0]]


def mean_below(state: tuple[int, ...]) -> float:
    leaves = [state + rest for rest in itertools.product(range(K), repeat=DEPTH - len(state))]
    return sum(reward(x) for x in leaves) / len(leaves)


class ToyModel:
    """Deterministic expander/evaluator with its own counters, independent of the ledger: an
    expansion costs K generations of 4 NFE each (2 tokens read per depth, 4 written), an
    evaluation 1 value call."""

    def __init__(self) -> None:
        self.expand_calls, self.expanded, self.evaluated = 0, [], []

    def expand(self, nodes):
        self.expand_calls += 1
        out = []
        for n in nodes:
            self.expanded.append(n.state)
            kids = [Child(n.state + (a,), prior=1.0, terminal=len(n.state) + 1 == DEPTH)
                    for a in range(K)]
            out.append(Expansion(kids, Cost(nfe=4 * K, generations=K,
                                            input_tokens=2 * len(n.state) * K,
                                            output_tokens=4 * K)))
        return out

    def evaluate(self, nodes):
        self.evaluated.extend(n.state for n in nodes)
        return [Evaluation(reward(n.state) if len(n.state) == DEPTH else mean_below(n.state),
                           Cost(value_calls=1)) for n in nodes]

    def bound(self, node):
        return Cost(nfe=4 * K, generations=K, input_tokens=2 * len(node.state) * K,
                    output_tokens=4 * K, value_calls=K + 1)


@pytest.mark.parametrize("select, c", [("ucb1", 1.0), ("puct", 1.5)])
def test_uct_converges_to_the_known_optimum(select, c):
    search = Search(SearchConfig(select=select, c=c, max_sims=400), ToyModel())
    tree = Tree(())
    assert search.simulate([tree]) == ["sims"]
    path = tree.principal_path()
    assert path[-1].state == BEST and path[-1].terminal
    assert path[1].visits > sum(ch.visits for ch in tree.root.children) / 2  # most visits there
    assert tree.root.visits == 400


def test_greedy_selection_misses_the_optimum_so_the_toy_tests_exploration():
    search = Search(SearchConfig(select="ucb1", c=0.0, max_sims=400), ToyModel())
    tree = Tree(())
    search.simulate([tree])
    assert tree.principal_path()[-1].state[0] == 0       # stuck on the decent branch
    assert all(n.state[:1] != (1,) or len(n.state) == 1 for n in tree.nodes)  # never went deeper


def test_best_first_follows_values_and_random_is_seeded():
    search = Search(SearchConfig(select="best_first", stop_on_solved=False), ToyModel())
    tree = Tree(())
    search.step([tree])
    search.step([tree])
    # root first (it has no value), then the child of highest value: branch 0 (0.6)
    assert [n.state for n in tree.nodes if n.expansions] == [(), (0,)]
    runs = []
    for _ in range(2):
        t = Tree((), seed=7)
        Search(SearchConfig(select="random", max_sims=6), ToyModel()).simulate([t])
        runs.append(t.snapshot())
    assert runs[0] == runs[1]


def test_ledger_counts_exactly_the_work_done():
    model = ToyModel()
    ledger = Ledger()
    trees = [Tree((), ledger.meter("uct", None, f"p{i}"), seed=i) for i in range(3)]
    Search(SearchConfig(select="ucb1", c=1.0, max_sims=25), model).simulate(trees)
    total = ledger.total("uct")
    n_exp = len(model.expanded)
    assert total.generations == K * n_exp and total.nfe == 4 * K * n_exp
    assert total.output_tokens == 4 * K * n_exp
    assert total.input_tokens == sum(2 * len(s) * K for s in model.expanded)
    assert total.value_calls == len(model.evaluated) == K * n_exp
    # ... and per problem: every problem's tree accounts for its own expansions only
    for i, t in enumerate(trees):
        mine = sum(1 for n in t.nodes if n.expansions)
        assert ledger.spent("uct", None, f"p{i}").generations == K * mine
    frame = ledger.frame()
    assert frame.height == 3 and frame["generations"].sum() == total.generations


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 10, 13, 50])
def test_a_budget_is_never_exceeded_and_unit_steps_stop_exactly_at_it(limit):
    class OneAtATime(ToyModel):  # a refine step: one child, one generation
        def expand(self, nodes):
            self.expand_calls += 1
            return [Expansion([Child(n.state + (len(n.children) % K,))], Cost(generations=1))
                    for n in nodes]

        def evaluate(self, nodes):  # open-ended: any depth
            return [Evaluation(0.5, Cost(value_calls=1)) for _ in nodes]

        def bound(self, node):
            return Cost(generations=1, value_calls=2)

    ledger = Ledger()
    budget = Budget(unit="generations", limit=limit)
    tree = Tree((), ledger.meter("refine", budget, "p0"), seed=3)
    Search(SearchConfig(select="random", widen=True), OneAtATime()).simulate([tree])
    assert tree.stop == "budget"
    assert ledger.spent("refine", budget, "p0").generations == limit
    # K-child steps: the tree stops when the next step no longer fits, never past the budget
    ledger = Ledger()
    budget = Budget(unit="nfe", limit=limit * 5)
    tree = Tree((), ledger.meter("uct", budget, "p0"))
    Search(SearchConfig(select="ucb1"), ToyModel()).simulate([tree])
    spent = ledger.spent("uct", budget, "p0").nfe
    assert spent <= limit * 5 and (tree.stop != "budget" or limit * 5 - spent < 4 * K)


def test_a_charge_past_the_budget_raises_before_it_is_recorded():
    class Liar(ToyModel):  # its bound says 1 generation, a step costs K
        def bound(self, node):
            return Cost(generations=1)

    ledger = Ledger()
    budget = Budget(unit="generations", limit=2)
    tree = Tree((), ledger.meter("liar", budget, "p0"))
    with pytest.raises(BudgetExceeded, match="bound of this step was too low"):
        Search(SearchConfig(), Liar()).simulate([tree])
    assert ledger.spent("liar", budget, "p0").generations == 0


@pytest.mark.parametrize("cfg", [
    dict(select="ucb1", c=1.2), dict(select="puct", c=1.0),
    dict(select="random", widen=True, stop_on_solved=True)])
def test_batched_expansion_across_problems_builds_the_same_trees_as_one_at_a_time(cfg):
    class Hashed:
        """Deterministic in the node alone: children and values come from the state's hash."""

        def __init__(self) -> None:
            self.batch_sizes: list[int] = []

        def expand(self, nodes):
            self.batch_sizes.append(len(nodes))
            out = []
            for n in nodes:
                r = random.Random(repr(n.state) + str(len(n.children)))
                kids = [Child(n.state + (r.randrange(100),), prior=r.random(),
                              terminal=len(n.state) >= 3, solved=r.random() < 0.05)
                        for _ in range(1 + r.randrange(3))]
                out.append(Expansion(kids, Cost(generations=len(kids), nfe=7 * len(kids))))
            return out

        def evaluate(self, nodes):
            return [Evaluation(random.Random(repr(n.state)).random(), Cost(value_calls=1))
                    for n in nodes]

        def bound(self, node):
            return Cost(generations=3, nfe=21, value_calls=4)

    roots = [(p,) for p in range(6)]
    budget = Budget(unit="generations", limit=20)

    def run(batches):
        model, ledger, trees = Hashed(), Ledger(), []
        for group in batches:
            ts = [Tree(roots[i], ledger.meter("a", budget, str(i)), seed=i) for i in group]
            Search(SearchConfig(**cfg), model).simulate(ts)
            trees += ts
        return [t.snapshot() for t in trees], ledger.rows(), model.batch_sizes

    together, rows_together, sizes = run([range(6)])
    alone, rows_alone, _ = run([[i] for i in range(6)])
    assert together == alone and rows_together == rows_alone
    assert max(sizes) == 6  # one model call really served all six problems



def test_commit_reroots_at_the_most_visited_child():
    search = Search(SearchConfig(select="ucb1", c=1.0, max_sims=200), ToyModel())
    tree = Tree(())
    search.simulate([tree])
    first = tree.commit()
    assert first.state == (1,) and first.parent is None and tree.root is first
    assert all(n.state[:1] == (1,) for n in tree.nodes)
    search.simulate([tree])
    assert tree.commit().state == (1, 2)


def test_bad_config_and_bad_model_answers_are_named():
    with pytest.raises(ValueError, match="widen"):
        SearchConfig(select="ucb1", widen=True)

    class OutOfRange(ToyModel):
        def evaluate(self, nodes):
            return [Evaluation(1.5) for _ in nodes]

    with pytest.raises(ValueError, match=r"V = 1.5"):
        Search(SearchConfig(), OutOfRange()).simulate([Tree(())])
    with pytest.raises(ValueError, match="expected an int >= 0"):
        Cost(nfe=-1)
    with pytest.raises(ValueError, match="unknown compute unit"):
        Cost().get("flops")


# --- budget grids ---------------------------------------------------------------------------

def test_budget_grid_runs_each_budget_to_exactly_b_and_plots(tmp_path: Path):
    problems = [f"p{i}" for i in range(20)]
    rates = {p: 0.05 + 0.04 * i for i, p in enumerate(problems)}   # per-sample success rate

    def iid(budget, meters):
        scores = {}
        for p in problems:
            r = random.Random(f"{p}-{budget.limit}")
            solved = False
            while not solved and meters[p].can_afford(Cost(generations=1)):
                meters[p].charge(Cost(generations=1, nfe=10, output_tokens=10))
                solved = r.random() < rates[p]
            scores[p] = float(solved)
        return scores

    def wasteful(budget, meters):    # spends exactly B on every problem, solves nothing
        for m in meters.values():
            for _ in range(budget.limit):
                m.charge(Cost(generations=1))
        return {p: 0.0 for p in meters}

    ledger = Ledger()
    rows = run_budget_grid("iid", iid, [1, 4, 16], "generations", problems, ledger)
    rows += run_budget_grid("waste", wasteful, [1, 4, 16], "generations", problems, ledger)
    assert all(r["generations"] <= r["budget"] for r in rows)
    assert all(r["generations"] == r["budget"] for r in rows if r["arm"] == "waste")
    assert all(r["generations"] == r["budget"] for r in rows if r["score"] == 0.0)
    curve = compute_curve(rows, ledger)
    iid_curve = curve.filter(curve["arm"] == "iid")
    assert iid_curve["budget"].to_list() == [1, 4, 16]
    acc = iid_curve["accuracy"].to_list()
    assert acc[0] < acc[2]                              # more samples solve more
    assert curve.filter(curve["arm"] == "waste")["used"].to_list() == [1.0, 1.0, 1.0]
    assert (curve["wall_seconds_per_problem"] >= 0).all()
    png = plot_accuracy_vs_compute(curve, tmp_path / "acc.png", x="generations")
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no column 'tokens'"):
        plot_accuracy_vs_compute(curve, tmp_path / "x.png", x="tokens")


def test_budget_grid_rejects_bad_input_before_running():
    ran = []

    def arm(budget, meters):
        ran.append(budget)
        return {p: 1.0 for p in meters}

    for budgets, match in [([], "integers >= 1"), ([0, 4], "integers >= 1"),
                           ([4, 4], "listed twice")]:
        with pytest.raises(ValueError, match=match):
            run_budget_grid("a", arm, budgets, "nfe", ["p"], Ledger())
    with pytest.raises(ValueError, match="unit"):
        run_budget_grid("a", arm, [2], "flops", ["p"], Ledger())
    assert ran == []
    with pytest.raises(ValueError, match="scores missing"):
        run_budget_grid("a", lambda b, m: {}, [2], "nfe", ["p"], Ledger())
