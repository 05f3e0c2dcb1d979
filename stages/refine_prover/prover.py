"""The prover side of Refine-Prover (Li, Tian, Wang, "Compile to Compress", arXiv 2604.18587,
ICML 2026; no official code): prompt formats, the refinement tree's model for the shared search
engine (`stages.search.uct`), the long-history chain and the value model.

Prompts (character-level tiny Llama models; spec §4):

    base prover   T:<statement> P:                              -> proof
    refiner       T:<statement> F:<failed proof> E:<error> P:   -> repaired proof
    long history  T:<statement> F:<p1> E:<e1> F:<p2> E:<e2> P:  -> proof (every earlier attempt)

The error is the kernel's first error, encoded `L<line> <class> <residual goal>` (+k more errors),
the paper's compiler feedback reduced to what our kernel reports (spec §2, [reconstructed]).

Refinement tree (spec §2, Algorithm): the root is the statement; expanding it is a fresh sample
of the base prover (a restart), expanding a proof node is a repair of that proof by the refiner
from that node's proof and error alone (no history: short contexts). Every expansion costs one
generation; the tree stops at the first proof the kernel accepts. Selection:

    random      a uniformly random node (root included), `SearchConfig(select="random")`
    value       the node of highest V(n): best-first with the value model (restart vs repair)

V(n) = sigmoid(w . phi(n)) is a logistic regression on phi(n) = (1, is_root, one-hot first error
class, #errors, first error line / #lines, depth, #lines) fitted on expansions logged from random
trees on held-out training statements, label = "the child this expansion made was accepted"
(a one-step horizon, [reconstructed]: the spec's "solved within the subtree" labels the root 1
whenever a problem is ever solved, which cannot rank a restart against a repair). A node that was
expanded k times without success is re-ranked by V k0 / (k0 + k) (a Beta prior of strength k0
updated by k failures; [ours]), so best-first does not repair one proof for ever.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from stages.refine_prover import kernel
from stages.search.ledger import Cost
from stages.search.uct import Child, Evaluation, Expansion, Node

log = logging.getLogger("paperline")

FEATURES = ("bias", "is_root", *(f"class/{c}" for c in kernel.ERROR_CLASSES), "n_errors",
            "error_pos", "depth", "n_lines")


def base_prompt(statement: str) -> str:
    return f"T:{statement} P:"


def refine_prompt(statement: str, proof: str, feedback: str) -> str:
    return f"T:{statement} F:{proof} E:{feedback} P:"


def history_prompt(statement: str, attempts: Sequence[tuple[str, str]]) -> str:
    return f"T:{statement} " + " ".join(f"F:{p} E:{fb}" for p, fb in attempts) + " P:"


# --- value model ---------------------------------------------------------------------------

def features(result: kernel.Result | None, depth: int) -> list[float]:
    """phi(n): the root (result None) or a failed proof's kernel result at `depth`."""
    if result is None:
        return [1.0, 1.0] + [0.0] * len(kernel.ERROR_CLASSES) + [0.0, 0.0, 0.0, 0.0]
    first = result.errors[0] if result.errors else None
    onehot = [1.0 if first is not None and first.error_class == c else 0.0
              for c in kernel.ERROR_CLASSES]
    pos = (first.line - 1) / max(result.n_lines, 1) if first is not None else 1.0
    return [1.0, 0.0, *onehot, float(len(result.errors)), pos, float(depth),
            float(result.n_lines)]


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -30, 30)))


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-2, iters: int = 50) -> np.ndarray:
    """Weights of a ridge-penalised logistic regression by Newton's method (IRLS); the bias
    (column 0) is not penalised. x: (n, d), y in {0, 1}."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if x.ndim != 2 or len(x) != len(y) or len(y) == 0:
        raise ValueError(f"fit_logistic: x {x.shape} and y {y.shape} do not match")
    w = np.zeros(x.shape[1])
    pen = np.full(x.shape[1], l2)
    pen[0] = 0.0
    for _ in range(iters):
        p = sigmoid(x @ w)
        grad = x.T @ (p - y) + pen * w
        hess = (x * (p * (1 - p))[:, None]).T @ x + np.diag(pen) + 1e-9 * np.eye(x.shape[1])
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.max(np.abs(step)) < 1e-8:
            break
    return w


def fit_value(x: np.ndarray, y: np.ndarray, l2: float, what: str = "value model"
              ) -> tuple[np.ndarray, bool]:
    """(weights, degenerate): the value model, or zero weights (V = 0.5 everywhere) when the
    labels hold one class only. That case is said loudly (a warning here; the caller writes
    `value_degenerate` = 1): a constant V makes `value_tree` best-first on the visit-count
    re-ranking alone, and nothing about the value model can be read from it."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    n_pos = int(y.sum())
    if 0 < n_pos < len(y):
        return fit_logistic(x, y, l2), False
    log.warning("%s: %d positive labels of %d (one class only): weights are zero, V is the "
                "constant 0.5 and the value-guided tree ranks by visit counts alone",
                what, n_pos, len(y))
    return np.zeros(x.shape[1]), True


def log_loss(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(sigmoid(np.asarray(x, float) @ w), 1e-9, 1 - 1e-9)
    y = np.asarray(y, float)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


# --- generation -----------------------------------------------------------------------------

@dataclass
class Generator:
    """A causal LM with sampling settings; `__call__(prompts, seed)` -> completions."""

    model: Any
    tokenizer: Any
    max_new_tokens: int
    temperature: float
    batch_size: int = 256

    def __call__(self, prompts: Sequence[str], seed: int, num_samples: int = 1
                 ) -> list[list[str]]:
        from stages.models.generate import generate

        return generate(self.model, self.tokenizer, list(prompts),
                        max_new_tokens=self.max_new_tokens, do_sample=True,
                        temperature=self.temperature, num_samples=num_samples,
                        batch_size=self.batch_size, seed=seed)


def gen_cost(prompt: str, completion: str) -> Cost:
    """One generation: input = prompt chars + <bos>, output = completion chars + <eos>; a
    decoder with a KV cache runs one forward pass per output token."""
    out = len(completion) + 1
    return Cost(generations=1, nfe=out, input_tokens=len(prompt) + 1, output_tokens=out)


@dataclass
class GenLog:
    """Every generation one problem received, in order: (cost, accepted)."""

    gens: list[tuple[Cost, bool]] = field(default_factory=list)

    def at_budget(self, budget: int) -> tuple[bool, Cost]:
        """Solved within the first `budget` generations, and what they cost up to the first
        accepted proof (the search stops there)."""
        total, solved = Cost(), False
        for cost, ok in self.gens[:budget]:
            total += cost
            if ok:
                solved = True
                break
        return solved, total


# --- the refinement tree's model for the search engine ----------------------------------------

@dataclass
class ProofState:
    problem: str
    statement: str
    proof: str | None = None               # None at the root
    result: kernel.Result | None = None


class RefineModel:
    """`uct.SearchModel` of the refinement tree: root -> base prover, proof node -> refiner."""

    def __init__(self, base: Generator, refiner: Generator, *, seed: int,
                 value_weights: np.ndarray | None = None, prior_strength: float = 2.0,
                 max_errors: int = 1):
        self.base, self.refiner, self.seed = base, refiner, seed
        self.w, self.k0, self.max_errors = value_weights, prior_strength, max_errors
        self.logs: dict[str, GenLog] = {}
        self.expansions: list[tuple[list[float], bool]] = []   # (phi(parent), child accepted)
        self.calls = 0

    def bound(self, node: Node) -> Cost:
        return Cost(generations=1)

    def expand(self, nodes: Sequence[Node]) -> list[Expansion]:
        self.calls += 1
        prompts = []
        for n in nodes:
            s: ProofState = n.state
            prompts.append(base_prompt(s.statement) if s.proof is None else
                           refine_prompt(s.statement, s.proof,
                                         s.result.feedback(self.max_errors)))  # type: ignore[union-attr]
        roots = [i for i, n in enumerate(nodes) if n.state.proof is None]
        repairs = [i for i, n in enumerate(nodes) if n.state.proof is not None]
        outs: dict[int, str] = {}
        for idx, gen, tag in ((roots, self.base, 0), (repairs, self.refiner, 1)):
            if idx:
                texts = gen([prompts[i] for i in idx], seed=self.seed * 100003 + self.calls * 2 + tag)
                outs.update({i: t[0].strip() for i, t in zip(idx, texts)})
        expansions = []
        for i, n in enumerate(nodes):
            s = n.state
            proof = outs[i]
            res = _safe_check(s.statement, proof)
            cost = gen_cost(prompts[i], proof)
            self.logs.setdefault(s.problem, GenLog()).gens.append((cost, res.ok))
            self.expansions.append((features(s.result, n.depth), res.ok))
            child = ProofState(s.problem, s.statement, proof, res)
            expansions.append(Expansion([Child(child, terminal=res.ok, solved=res.ok)], cost))
            if self.w is not None and n.value is not None and not res.ok:
                # k failed expansions: re-rank by the Beta posterior mean V k0 / (k0 + k).
                v0 = self.value(s.result, n.depth)
                n.value = v0 * self.k0 / (self.k0 + n.expansions + 1)
        return expansions

    def value(self, result: kernel.Result | None, depth: int) -> float:
        if self.w is None:
            return 0.5
        return float(sigmoid(np.array(features(result, depth)) @ self.w))

    def evaluate(self, nodes: Sequence[Node]) -> list[Evaluation]:
        if self.w is None:   # random tree: no value model, nothing charged
            return [Evaluation(0.5) for _ in nodes]
        return [Evaluation(1.0 if n.state.result is not None and n.state.result.ok
                           else self.value(n.state.result, n.depth), Cost(value_calls=1))
                for n in nodes]


def _safe_check(statement: str, proof: str) -> kernel.Result:
    """Model output is untrusted text: any proof string gets a verdict, never an exception."""
    return kernel.check(statement, proof)


def run_tree(problems: dict[str, str], model: RefineModel, budget: int, select: str
             ) -> dict[str, GenLog]:
    """One refinement tree per problem, batched across problems, at `budget` generations."""
    from stages.search.ledger import Budget, Ledger
    from stages.search.uct import Search, SearchConfig, Tree

    ledger = Ledger()
    b = Budget(unit="generations", limit=budget)
    cfg = SearchConfig(select="best_first" if select == "value" else "random", widen=True,
                       stop_on_solved=True)
    trees = [Tree(ProofState(p, st), ledger.meter(select, b, p), seed=model.seed * 7919 + i)
             for i, (p, st) in enumerate(problems.items())]
    Search(cfg, model).simulate(trees)
    return {p: model.logs.get(p, GenLog()) for p in problems}


def run_iid(problems: dict[str, str], base: Generator, budget: int, seed: int
            ) -> dict[str, GenLog]:
    """`budget` independent base samples per problem; the log stops at the first accepted one
    (sequential sampling that stops on success spends exactly that)."""
    ids = list(problems)
    prompts = [base_prompt(problems[p]) for p in ids]
    texts = base(prompts, seed=seed, num_samples=budget)
    logs = {}
    for p, prompt, samples in zip(ids, prompts, texts):
        log = GenLog()
        for t in samples:
            t = t.strip()
            ok = _safe_check(problems[p], t).ok
            log.gens.append((gen_cost(prompt, t), ok))
            if ok:
                break
        logs[p] = log
    return logs


def sample_rates(problems: dict[str, str], base: Generator, n: int, seed: int
                 ) -> tuple[dict[str, float], list[tuple[str, str]]]:
    """Per-problem acceptance rate of the base prover from `n` samples, and every wrong
    (statement, proof) pair seen (for the signature statistics)."""
    ids = list(problems)
    texts = base([base_prompt(problems[p]) for p in ids], seed=seed, num_samples=n)
    rates, wrong = {}, []
    for p, samples in zip(ids, texts):
        ok = 0
        for t in samples:
            if _safe_check(problems[p], t.strip()).ok:
                ok += 1
            else:
                wrong.append((problems[p], t.strip()))
        rates[p] = ok / n
    return rates, wrong


def predicted_iid(rates: Sequence[float], budget: int) -> float:
    """Solved fraction of i.i.d. sampling at `budget`: mean over problems of
    1 - prod_{j<=B}(1 - p) = 1 - (1 - p)^B."""
    return float(np.mean([1.0 - (1.0 - p) ** budget for p in rates]))


def run_history(problems: dict[str, str], base: Generator, refiner: Generator, budget: int,
                seed: int, history: int, max_errors: int = 1) -> dict[str, GenLog]:
    """Long-history refinement: one chain per problem; attempt 1 is a base sample, each later
    attempt conditions on the last `history` attempts and their errors (all of them while the
    context allows: the refiner's window holds `history`)."""
    attempts: dict[str, list[tuple[str, str]]] = {p: [] for p in problems}
    logs = {p: GenLog() for p in problems}
    for step in range(budget):
        live = [p for p in problems if not (logs[p].gens and logs[p].gens[-1][1])]
        if not live:
            break
        if step == 0:
            prompts = [base_prompt(problems[p]) for p in live]
            texts = base(prompts, seed=seed * 100003 + step)
        else:
            prompts = [history_prompt(problems[p], attempts[p][-history:]) for p in live]
            texts = refiner(prompts, seed=seed * 100003 + step)
        for p, prompt, t in zip(live, prompts, texts):
            proof = t[0].strip()
            res = _safe_check(problems[p], proof)
            logs[p].gens.append((gen_cost(prompt, proof), res.ok))
            attempts[p].append((proof, res.feedback(max_errors)))
    return logs


def value_data(expansions: Sequence[tuple[list[float], bool]]) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([phi for phi, _ in expansions], dtype=float)
    y = np.array([float(ok) for _, ok in expansions])
    return x, y


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Area under the ROC curve (ties count half); NaN with one class only."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return math.nan
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


Sampler = Callable[[Sequence[str], int], list[list[str]]]
