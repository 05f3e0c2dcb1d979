"""A search tree over partial solutions with batched expansion across problems (UCT / PUCT /
best-first), every step charged to the compute ledger.

One simulation of one tree (Kocsis & Szepesvari 2006, "Bandit based Monte-Carlo planning", ECML):

    SELECT    descend from the root to a leaf by the selection rule
    EXPAND    the model proposes the leaf's children (K thought blocks, K proofs, ...)
    EVALUATE  each new child gets a value V(c) in [0, 1] (rollouts, a value model, a verifier)
    BACKUP    the mean V of the new children is added along the path leaf -> root
              (N += 1, W += v; Q = W / N), as DiffuReason's loop backs up "mean V along path"
              (DiffuReason: ICML 2026, no arXiv copy; its search loop is reconstructed)

Selection rules (`SearchConfig.select`), c = `SearchConfig.c`:

    ucb1        argmax_c  Q(c) + c * sqrt(ln N(parent) / (1 + N(c)))
                UCB1 (Auer, Cesa-Bianchi & Fischer 2002) applied at every node is UCT; the
                1 + N(c) denominator (DiffuReason's form) keeps a fresh child finite.
    puct        argmax_c  Q(c) + c * P(c) * sqrt(N(parent)) / (1 + N(c))
                PUCT as in AlphaZero (Silver et al. 2017, after Rosin 2011); P(c) is the
                child's prior from the expander (normalised over siblings; uniform if none).
    best_first  argmax over EVERY expandable node of its value V(n): Refine-Prover's
                value-guided tree (arXiv 2604.18587), where expanding the root is a restart and
                expanding another node a repair of its proof.
    random      a uniformly random expandable node: Refine-Prover's random refine tree.

A new child counts as visited once by its own evaluation (N = 1, W = V(c)), so Q is defined from
the start. A terminal leaf reached again backs up its own value at no cost (UCT's revisits of a
good end state); a tree stops when its budget cannot pay the next step, when it found a solved
node (`stop_on_solved`), when best-first / random find no expandable node ('exhausted'), after
`max_sims` simulations, or after
`max_revisits` free revisits in a row (with a small c UCT could otherwise revisit one good
terminal leaf for ever without spending anything).
With `widen` (best_first / random only) a node stays expandable after it was expanded: a
failed proof can be repaired again, the root restarted again.

Batching: `Search.simulate(trees)` runs one simulation of every live tree per round, with ONE
`model.expand` call over all selected leaves and ONE `model.evaluate` call over all new children.
Each tree's steps depend only on its own state and its own random generator, so a forest run
batched builds exactly the trees that running each problem alone would (tested), while a GPU
sees one large batch per round. A tree contributes one leaf per round; more leaves per tree
would need virtual loss, which none of our papers uses.

The model (what a paper brings) implements `SearchModel`:

    expand(nodes)   -> [Expansion(children=[Child(state, prior, terminal, solved)], cost)]
    evaluate(nodes) -> [Evaluation(value, cost)]
    bound(node)     -> Cost: an upper bound of the next step at `node` (expanding it and
                       evaluating its children, and the node itself when it has no value yet)

An evaluator may replace `node.state` before it returns the value (DiffuReason's in-place
revision of a low-value block: the revised block is what the node then holds and is valued).

The engine checks `meter.can_afford(bound(leaf))` before a step and charges the real costs after
it, so no problem ever spends past its budget, and with fixed step costs (one generation per
refine step) it stops exactly at the budget.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.search.ledger import Cost, Meter


class SearchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    select: Literal["ucb1", "puct", "best_first", "random"] = Field(
        "ucb1", description="selection rule (formulas in the module docstring)")
    c: float = Field(1.0, ge=0, le=100, description="exploration constant (c_uct / c_puct); "
                                                    "DiffuReason: 1.0-1.4")
    widen: bool = Field(False, description="a node stays expandable after it was expanded "
                                           "(best_first / random: repair again, restart again)")
    stop_on_solved: bool = Field(False, description="a tree stops at its first solved node "
                                                    "(Refine-Prover stops at an accepted proof)")
    max_sims: int | None = Field(None, ge=1, description="simulations per tree per `simulate` "
                                                         "call (None: until the budget)")
    max_revisits: int = Field(1000, ge=1, description="a tree stops ('converged') after this "
                              "many simulations in a row that only revisited terminal leaves: "
                              "they cost nothing, so a budget alone would never end them")

    @model_validator(mode="after")
    def _check(self) -> "SearchConfig":
        if self.widen and self.select in ("ucb1", "puct"):
            raise ValueError(f"search.widen = true needs select best_first or random, not "
                             f"{self.select!r} (UCT expands a node once, all its children at once)")
        return self


@dataclass(frozen=True)
class Child:
    """A child proposed by the expander: its state and what the expander knows of it."""

    state: Any
    prior: float | None = None   # P(c) for PUCT (any scale; normalised over siblings)
    terminal: bool = False       # nothing follows (an answer, a complete proof)
    solved: bool = False         # verified correct (a checker accepted it)


@dataclass(frozen=True)
class Expansion:
    children: list[Child]
    cost: Cost                   # what proposing them cost (charged to the node's tree)


@dataclass(frozen=True)
class Evaluation:
    value: float                 # V(n) in [0, 1]
    cost: Cost = Cost()


@dataclass(eq=False)
class Node:
    state: Any
    parent: "Node | None" = None
    depth: int = 0
    prior: float = 1.0
    terminal: bool = False
    solved: bool = False
    value: float | None = None   # V(n) from the evaluator (None until evaluated)
    visits: int = 0              # N(n)
    value_sum: float = 0.0       # W(n)
    expansions: int = 0
    children: list["Node"] = field(default_factory=list)

    @property
    def q(self) -> float:
        """Q(n) = W / N; the node's own value before its first visit."""
        return self.value_sum / self.visits if self.visits else (self.value or 0.0)


class SearchModel(Protocol):
    def expand(self, nodes: Sequence[Node]) -> list[Expansion]: ...

    def evaluate(self, nodes: Sequence[Node]) -> list[Evaluation]: ...

    def bound(self, node: Node) -> Cost: ...


class Tree:
    """One problem's search tree, its account in the ledger and its own random generator."""

    def __init__(self, root_state: Any, meter: Meter | None = None, seed: int = 0):
        self.root = Node(root_state)
        self.nodes: list[Node] = [self.root]      # creation order: ties break towards older
        self.meter = meter
        self.rng = random.Random(seed)
        self.sims = 0                             # simulations in this `simulate` call
        self.revisits = 0                         # free revisits in a row (see max_revisits)
        self.stop: str | None = None              # why it stopped: budget / solved /
                                                  # exhausted / converged / sims

    @property
    def solved(self) -> list[Node]:
        return [n for n in self.nodes if n.solved]

    def commit(self) -> Node:
        """Re-root at the root's most visited child (ties: higher Q, then older): DiffuReason
        commits a thought block this way after its simulations. The subtree is kept."""
        if not self.root.children:
            raise ValueError("commit: the root has no children; run simulations first")
        best = max(self.root.children, key=lambda n: (n.visits, n.q))
        best.parent = None
        keep = set()
        stack = [best]
        while stack:
            n = stack.pop()
            keep.add(id(n))
            stack.extend(n.children)
        self.nodes = [n for n in self.nodes if id(n) in keep]
        self.root, self.sims, self.revisits, self.stop = best, 0, 0, None
        return best

    def principal_path(self) -> list[Node]:
        """Root to leaf, following the most visited child (ties: higher Q, then older)."""
        path = [self.root]
        while path[-1].children:
            path.append(max(path[-1].children, key=lambda n: (n.visits, n.q)))
        return path

    def snapshot(self, node: Node | None = None) -> tuple:
        """The tree as nested tuples (state, N, W, V, terminal, solved, children): comparable."""
        n = node or self.root
        return (n.state, n.visits, round(n.value_sum, 12), n.value, n.terminal, n.solved,
                tuple(self.snapshot(c) for c in n.children))


class Search:
    """The engine: select / expand / evaluate / backup over many trees, batched per round."""

    def __init__(self, cfg: SearchConfig, model: SearchModel):
        self.cfg, self.model = cfg, model
        self.expand_calls = 0    # batched model calls (what wall clock follows; the ledger
        self.evaluate_calls = 0  # counts the per-sequence work)

    # --- select ---------------------------------------------------------------------------

    def score(self, parent: Node, child: Node, prior_total: float) -> float:
        c = self.cfg.c
        if self.cfg.select == "ucb1":
            return child.q + c * math.sqrt(math.log(max(parent.visits, 1)) / (1 + child.visits))
        prior = child.prior / prior_total if prior_total > 0 else 1.0 / len(parent.children)
        return child.q + c * prior * math.sqrt(parent.visits) / (1 + child.visits)

    def select(self, tree: Tree) -> Node | None:
        """The node the next simulation expands, or a terminal leaf it revisits (UCT); None when
        best-first / random find no expandable node."""
        if self.cfg.select in ("best_first", "random"):
            open_ = [n for n in tree.nodes
                     if not n.terminal and (self.cfg.widen or n.expansions == 0)]
            if not open_:
                return None
            if self.cfg.select == "random":
                return open_[tree.rng.randrange(len(open_))]
            # An unvalued node (the root before its first step) goes first.
            return max(open_, key=lambda n: math.inf if n.value is None else n.value)
        node = tree.root
        while node.children and not node.terminal:
            total = sum(ch.prior for ch in node.children)
            node = max(node.children, key=lambda ch: self.score(node, ch, total))
        return node

    # --- one round over every live tree -----------------------------------------------------

    def _live(self, tree: Tree) -> Node | None:
        """The leaf `tree` expands this round, or None after setting why it stopped."""
        if tree.stop is not None:
            return None
        if self.cfg.max_sims is not None and tree.sims >= self.cfg.max_sims:
            tree.stop = "sims"
            return None
        if self.cfg.stop_on_solved and tree.solved:
            tree.stop = "solved"
            return None
        if tree.revisits >= self.cfg.max_revisits:
            tree.stop = "converged"
            return None
        leaf = self.select(tree)
        if leaf is None:
            tree.stop = "exhausted"
            return None
        if not leaf.terminal and tree.meter is not None \
                and not tree.meter.can_afford(self.model.bound(leaf)):
            tree.stop = "budget"
            return None
        return leaf

    def step(self, trees: Sequence[Tree]) -> int:
        """One simulation in every live tree; returns how many trees took one."""
        chosen = [(t, leaf) for t in trees if (leaf := self._live(t)) is not None]
        if not chosen:
            return 0
        revisits = [(t, leaf) for t, leaf in chosen if leaf.terminal]
        grow = [(t, leaf) for t, leaf in chosen if not leaf.terminal]
        for t, leaf in revisits:  # a terminal leaf backs up its own value; no model call
            self._backup(leaf, leaf.q)
            t.sims += 1
            t.revisits += 1

        if grow:
            expansions = self.model.expand([leaf for _, leaf in grow])
            self.expand_calls += 1
            if len(expansions) != len(grow):
                raise ValueError(f"expand returned {len(expansions)} expansions for "
                                 f"{len(grow)} nodes")
            to_eval: list[tuple[Tree, Node]] = []
            new: list[list[Node]] = []
            for (t, leaf), exp in zip(grow, expansions, strict=True):
                if t.meter is not None:
                    t.meter.charge(exp.cost)
                leaf.expansions += 1
                t.revisits = 0
                kids = []
                for ch in exp.children:
                    prior = 1.0 if ch.prior is None else float(ch.prior)
                    if not prior >= 0:
                        raise ValueError(f"expand proposed a child with prior {ch.prior!r}; "
                                         f"priors must be >= 0")
                    kids.append(Node(ch.state, parent=leaf, depth=leaf.depth + 1, prior=prior,
                                     terminal=ch.terminal, solved=ch.solved))
                leaf.children.extend(kids)
                t.nodes.extend(kids)
                if leaf.value is None and self.cfg.select == "best_first":
                    to_eval.append((t, leaf))  # best-first ranks every node, root included
                to_eval.extend((t, k) for k in kids)
                new.append(kids)
            values = self.model.evaluate([n for _, n in to_eval]) if to_eval else []
            self.evaluate_calls += bool(to_eval)
            if len(values) != len(to_eval):
                raise ValueError(f"evaluate returned {len(values)} values for {len(to_eval)} "
                                 f"nodes")
            for (t, n), ev in zip(to_eval, values, strict=True):
                if not 0.0 <= ev.value <= 1.0 or math.isnan(ev.value):
                    raise ValueError(f"evaluate returned V = {ev.value!r}; values must lie in "
                                     f"[0, 1]")
                if t.meter is not None:
                    t.meter.charge(ev.cost)
                n.value = float(ev.value)
                if n.parent is not None and n.visits == 0 and n.expansions == 0:
                    n.visits, n.value_sum = 1, n.value   # its evaluation is its first visit
            for (t, leaf), kids in zip(grow, new, strict=True):
                if kids:
                    v = sum(k.value for k in kids) / len(kids)
                else:                        # a dead end: nothing to propose
                    leaf.terminal = True
                    v = leaf.value if leaf.value is not None else 0.0
                self._backup(leaf, v)
                t.sims += 1
        return len(chosen)

    @staticmethod
    def _backup(leaf: Node, v: float) -> None:
        node: Node | None = leaf
        while node is not None:
            node.visits += 1
            node.value_sum += v
            node = node.parent

    def simulate(self, trees: Sequence[Tree]) -> list[str]:
        """Rounds until every tree stopped; returns each tree's reason."""
        for t in trees:
            if t.stop in (None, "sims", "converged"):  # each call grants max_sims more
                t.stop, t.sims, t.revisits = None, 0, 0
        while self.step(trees):
            pass
        return [t.stop or "" for t in trees]
