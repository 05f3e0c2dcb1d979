"""ProofVerify: generative verifiers for selecting one solution out of n (arXiv 2511.13027).

The method in three lines (§2 of the paper; the official NeMo-Skills recipe
`recipes/proof-gen-verification`):
- LLM-as-a-Judge: n_j sampled verdicts per solution, score s(p) = #Yes / #parseable (s = -1 when
  no reply parses); pick argmax s, ties to the first maximum after a shuffle.
- GenSelect: a pairwise knockout tournament, remaining candidates reshuffled before every round,
  the odd one out gets a bye, an unparseable game has a uniformly random winner; N - w games.
- Hybrid (the paper's recommendation): knockout down to w = n_s survivors, then the argmax over
  the survivors of mean_{j=1..n_j} 1[judge_j(p) = Yes], the mean over ALL n_j judgements (an
  unparseable reply counts as not Yes: `hybrid_score`); n_s x n_j judgements instead of
  n_p x n_j. The judge's #Yes / #parseable on the survivors is kept as the ablation arm
  `hybrid_lenient` (`survivor_score("parseable")`).

This module holds the pure parts (prompts, output contracts, scores, the tournament, the
selection rules and the metrics), each testable on hand-made inputs. The stages that call a
backend are `select.py` (judge / genselect / hybrid / hybrid_lenient), `candidates.py` and
`train_judge.py`; the comparison is `compare.py`, the simulated-oracle budget sweep `oracle.py`.

Departures: the tiny local models reason in a step check trace (`check_trace`) before
`Verdict: Yes|No` / `Best: 1|2` (`check` style; `compact` answers with the verdict alone), the
`opc` style is the paper's tagged contract for served models; the parsers accept all three. The
last round of a knockout plays only the games still needed (the paper's code plays the round in
parallel and truncates), so the cost is exactly N - w games, the figure the paper quotes. Run:
`paperline repro proofverify` (see pipelines/proofverify/README.md).
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from typing import Callable, Literal, Sequence

PromptStyle = Literal["compact", "check", "opc"]

# --- prompts and output contracts -----------------------------------------------------------

OPC_JUDGE = (
    "You are judging whether a proof is completely correct. Check every step of the solution "
    "below: a solution with any wrong step is incorrect, even if its final answer is right.\n"
    "First summarise your check in <summary>...</summary>, then give your verdict as "
    "<judgement>Judgement: Yes</judgement> or <judgement>Judgement: No</judgement>.\n\n"
    "### Problem\n{problem}\n\n### Solution\n{solution}\n")
OPC_GENSELECT = (
    "You are given a problem and {k} candidate proofs. Compare them step by step and decide "
    "which one is correct and complete. End with <best_solution>k</best_solution>, where k is "
    "the number of the best proof.\n\n### Problem\n{problem}")


def judge_prompt(problem: str, solution: str, style: PromptStyle = "compact") -> str:
    """The judge's input for one solution. compact: `<prompt><solution> Verdict:` -> ` Yes|No`;
    check: `<prompt><solution> Check:` -> ` <check_trace> Verdict: Yes|No`."""
    if style == "compact":
        return f"{problem}{solution} Verdict:"
    if style == "check":
        return f"{problem}{solution} Check:"
    return OPC_JUDGE.format(problem=problem, solution=solution.strip())


def genselect_prompt(problem: str, first: str, second: str,
                     style: PromptStyle = "compact") -> str:
    """The selector's input for one game. compact: `<prompt> [1]<a> [2]<b> Best:` -> ` 1|2`."""
    if style == "compact":
        return f"{problem} [1]{first} [2]{second} Best:"
    if style == "check":
        return f"{problem} [1]{first} [2]{second} Check:"
    return (OPC_GENSELECT.format(k=2, problem=problem)
            + f"\n\n[Proof 1]\n{first.strip()}\n\n[Proof 2]\n{second.strip()}")


_JUDGEMENT = re.compile(r"<judgement>\s*Judgement:\s*(Yes|No)\s*</judgement>")
_BEST = re.compile(r"<best_solution>\s*(\d+)\s*</best_solution>")
_VERDICT_END = re.compile(r"Verdict: (Yes|No)\s*$")
_BEST_END = re.compile(r"Best: (\d+)\s*$")
_STEP = re.compile(r"(-?\d+)\s*([+\-*])\s*(\d+)\s*=\s*(-?\d+)")


def check_trace(question: str, solution: str) -> str:
    """The `check` style's reasoning before a verdict (a step judge's trace, spec §2 "step
    judges"): each written step `a op b=c` is redone as `a op b=<a op b>` and marked `=` when it
    holds and continues the chain (a = the previous written result, or the first operand; op and
    b the question's), `!` otherwise, `?` when it is not a step; then the final answer, `=` when
    it is the last result and no step is missing. All marks `=` iff the solution is valid.

    >>> check_trace("20+5-3", " 20+5=26; 26-3=22 #### 22")
    '20+5=25 !; 26-3=23 !; #### 22 !'
    """
    from stages.tasks import arith

    operands, ops = arith.parse_question(question)
    parts, prev, ok = [], operands[0], True
    steps = arith.parse_steps(solution)
    for i, text in enumerate(steps):
        m = _STEP.fullmatch(text)
        if m is None:
            parts.append("?")
            ok = False
            continue
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        redo = arith.apply(a, op, b)
        good = (redo == c and a == prev and i < len(ops) and (op, b) == (ops[i], operands[i + 1]))
        ok = ok and good
        parts.append(f"{a}{op}{b}={redo} {'=' if good else '!'}")
        prev = c
    answer = arith.extract_answer(solution)
    good = ok and answer is not None and answer == prev and len(steps) == len(ops)
    parts.append(f"#### {'?' if answer is None else answer} {'=' if good else '!'}")
    return "; ".join(parts)


def parse_judgement(text: str) -> bool | None:
    """Yes -> True, No -> False, anything else -> None (a parse failure).

    Accepted: the tagged contract `<judgement>Judgement: Yes|No</judgement>` (last one wins, as
    a model may quote the format first), a reply ending in `Verdict: Yes|No` (check) or a bare
    `Yes` / `No` as the whole reply (compact)."""
    tagged = _JUDGEMENT.findall(text)
    if tagged:
        return tagged[-1] == "Yes"
    checked = _VERDICT_END.search(text)
    if checked:
        return checked[1] == "Yes"
    bare = text.strip()
    if bare in ("Yes", "No"):
        return bare == "Yes"
    return None


def parse_choice(text: str, k: int = 2) -> int | None:
    """The 0-based index of the chosen candidate, or None: `<best_solution>j</best_solution>`
    (last one wins), a reply ending in `Best: j` (check) or a bare `j` as the whole reply, with
    1 <= j <= k."""
    tagged = _BEST.findall(text)
    checked = _BEST_END.search(text)
    raw = tagged[-1] if tagged else checked[1] if checked else text.strip()
    if not re.fullmatch(r"\d+", raw):
        return None
    j = int(raw)
    return j - 1 if 1 <= j <= k else None


# --- LLM-as-a-Judge scores ------------------------------------------------------------------

def judge_score(verdicts: Sequence[bool | None]) -> float:
    """s(p) = #Yes / #parseable; -1 when no verdict parses (also for no verdict at all)."""
    parsed = [v for v in verdicts if v is not None]
    if not parsed:
        return -1.0
    return sum(parsed) / len(parsed)


def hybrid_score(verdicts: Sequence[bool | None]) -> float:
    """Hybrid's survivor score, mean_{j=1..n_j} 1[judge_j(p) = Yes] over ALL n_j judgements:
    an unparseable reply (None) counts as not Yes, so a proof with 1 Yes and 3 unparseable
    replies scores 0.25, below one with 3 Yes and 1 No (0.75). -1 when there is no verdict."""
    if not verdicts:
        return -1.0
    return sum(v is True for v in verdicts) / len(verdicts)


SurvivorScore = Literal["all", "parseable"]


def survivor_score(rule: SurvivorScore) -> Callable[[Sequence[bool | None]], float]:
    """The score Hybrid ranks its survivors by: `all` (the paper's, `hybrid_score`) or
    `parseable` (the judge's #Yes / #parseable, `judge_score`: the lenient ablation)."""
    rules: dict[str, Callable[[Sequence[bool | None]], float]] = {
        "all": hybrid_score, "parseable": judge_score}
    if rule not in rules:
        raise ValueError(f"survivor score {rule!r}: expected 'all' or 'parseable'")
    return rules[rule]


def argmax_first(scores: Sequence[float]) -> int:
    """Index of the first maximum (the paper's tie rule)."""
    if not scores:
        raise ValueError("argmax of no scores")
    best = 0
    for i, s in enumerate(scores):
        if s > scores[best]:
            best = i
    return best


def select_by_score(candidates: Sequence[int], scores: Sequence[float],
                    rng: random.Random) -> int:
    """argmax of `scores` (indexed by candidate) over `candidates`, shuffled first so that a tie
    is not always won by the lowest index (spec §6, tie order)."""
    order = list(candidates)
    rng.shuffle(order)
    return order[argmax_first([scores[c] for c in order])]


# --- GenSelect: pairwise knockout -----------------------------------------------------------

class Knockout:
    """One problem's knockout tournament among candidates 0..n-1, down to `winner_count`.

    Drive it round by round (so many problems' games can share one batched backend call):

        ko = Knockout(n, winner_count, rng, invalid={3})
        while not ko.done:
            pairs = ko.next_pairs()          # the remaining candidates reshuffled and paired
            ko.record([play(a, b) for a, b in pairs])   # 0: first wins, 1: second, None: failed
        ko.winners

    `invalid` candidates (e.g. empty solutions) are knocked out before the first round. The last
    round plays only as many games as are still needed, so a tournament costs exactly
    `n - winner_count - len(invalid)` games (when that is positive).
    """

    def __init__(self, n: int, winner_count: int, rng: random.Random,
                 invalid: Sequence[int] = ()) -> None:
        if n < 1 or winner_count < 1:
            raise ValueError(f"knockout needs n >= 1 and winner_count >= 1, got {n}, "
                             f"{winner_count}")
        self.n, self.winner_count = n, min(winner_count, n)
        self.rng = rng
        self.knocked: list[int] = sorted(set(invalid))
        bad = [i for i in self.knocked if not 0 <= i < n]
        if bad:
            raise ValueError(f"invalid candidates {bad} outside 0..{n - 1}")
        self.calls = self.parse_failures = self.rounds = self.byes = 0
        # (round, a, b, choice as parsed or None, winner) per game played
        self.history: list[tuple[int, int, int, int | None, int]] = []
        self._pending: list[tuple[int, int]] | None = None

    @property
    def target(self) -> int:
        """How many candidates must be knocked out: N - winner_count."""
        return self.n - self.winner_count

    @property
    def done(self) -> bool:
        return len(self.knocked) >= self.target

    def remaining(self) -> list[int]:
        out = set(self.knocked)
        return [i for i in range(self.n) if i not in out]

    def next_pairs(self) -> list[tuple[int, int]]:
        """This round's games (empty once done): shuffle, pair neighbours, odd one gets a bye."""
        if self._pending is not None:
            raise RuntimeError("record() the previous round's results first")
        if self.done:
            return []
        alive = self.remaining()
        self.rng.shuffle(alive)
        pairs = list(zip(alive[0::2], alive[1::2]))
        pairs = pairs[:self.target - len(self.knocked)]   # the last round: only needed games
        self.byes += len(alive) - 2 * len(pairs)
        self.rounds += 1
        self._pending = pairs
        return pairs

    def record(self, choices: Sequence[int | None]) -> None:
        """Results of the pending games: 0 (first wins), 1 (second wins) or None (unparseable:
        the winner is drawn uniformly, spec §2)."""
        if self._pending is None:
            raise RuntimeError("no pending round: call next_pairs() first")
        if len(choices) != len(self._pending):
            raise ValueError(f"{len(choices)} results for {len(self._pending)} games")
        for (a, b), c in zip(self._pending, choices):
            self.calls += 1
            parsed = c
            if c is None:
                self.parse_failures += 1
                c = self.rng.randrange(2)
            elif c not in (0, 1):
                raise ValueError(f"game result {c!r}: expected 0, 1 or None")
            winner, loser = (a, b) if c == 0 else (b, a)
            self.history.append((self.rounds - 1, a, b, parsed, winner))
            self.knocked.append(loser)
        self._pending = None

    @property
    def winners(self) -> list[int]:
        """The survivors: everyone not among the first N - w knocked out (more invalid
        candidates than N - w revives the last ones), in index order."""
        out = set(self.knocked[:self.target])
        return [i for i in range(self.n) if i not in out]


Game = tuple[int, int, int]   # (tournament index, first candidate, second candidate)


def play_knockouts(tournaments: Sequence[Knockout],
                   play: Callable[[list[Game]], list[int | None]]) -> int:
    """Run every tournament to the end, one batched `play` call per round across tournaments.
    `play` gets (tournament, a, b) triples and returns one result per game. Returns the rounds."""
    rounds = 0
    while True:
        games: list[Game] = []
        spans = []
        for t, ko in enumerate(tournaments):
            pairs = ko.next_pairs()
            spans.append((t, len(games), len(pairs)))
            games += [(t, a, b) for a, b in pairs]
        if not games:
            return rounds
        results = play(games)
        if len(results) != len(games):
            raise ValueError(f"play returned {len(results)} results for {len(games)} games")
        for t, start, count in spans:
            if count:
                tournaments[t].record(results[start:start + count])
        rounds += 1


def knockout_cost(n: int, winner_count: int, invalid: int = 0) -> int:
    """Games a knockout plays: N - w - invalid (at least 0)."""
    return max(0, n - min(winner_count, n) - invalid)


# --- baselines ------------------------------------------------------------------------------

def majority_vote(answers: Sequence[int | None], rng: random.Random) -> int:
    """A candidate holding the most frequent final answer (None answers count only when no
    candidate has one); among answers tied for most votes, and among candidates holding the
    winning answer, the first after a shuffle."""
    if not answers:
        raise ValueError("majority vote over no candidates")
    order = list(range(len(answers)))
    rng.shuffle(order)
    voted = [i for i in order if answers[i] is not None] or order
    counts = Counter(answers[i] for i in voted)           # insertion order = shuffled order
    top = max(counts.values())
    winner = next(answers[i] for i in voted if counts[answers[i]] == top)
    return next(i for i in voted if answers[i] == winner)


# --- metrics --------------------------------------------------------------------------------

def precision_recall_f1(pred: Sequence[bool], truth: Sequence[bool]) -> dict[str, float]:
    """Of the Yes class. NaN precision when nothing is predicted Yes; F1 0 when tp = 0."""
    if len(pred) != len(truth):
        raise ValueError(f"{len(pred)} predictions for {len(truth)} labels")
    tp = sum(p and t for p, t in zip(pred, truth))
    fp = sum(p and not t for p, t in zip(pred, truth))
    fn = sum(t and not p for p, t in zip(pred, truth))
    precision = tp / (tp + fp) if tp + fp else math.nan
    recall = tp / (tp + fn) if tp + fn else math.nan
    f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
    acc = sum(p == t for p, t in zip(pred, truth)) / len(pred) if pred else math.nan
    return {"precision": precision, "recall": recall, "f1": f1, "accuracy": acc}


def final_answer_precision(accepted: Sequence[bool], answer_right: Sequence[bool]) -> float:
    """Among accepted solutions, the share whose final answer is right (NaN: none accepted).
    A wrong answer makes a proof certainly invalid, so this needs no proof-level label."""
    kept = [r for a, r in zip(accepted, answer_right, strict=True) if a]
    return sum(kept) / len(kept) if kept else math.nan


def balanced_indices(problem_ids: Sequence[str], answer_right: Sequence[bool],
                     per_side: int = 3) -> list[int]:
    """The 3+/3- set: per problem, the first `per_side` right-answer and `per_side`
    wrong-answer solutions; problems with fewer than that on either side are left out."""
    right: dict[str, list[int]] = {}
    wrong: dict[str, list[int]] = {}
    for i, (p, r) in enumerate(zip(problem_ids, answer_right, strict=True)):
        (right if r else wrong).setdefault(p, []).append(i)
    out = []
    for p in dict.fromkeys(problem_ids):
        if len(right.get(p, [])) >= per_side and len(wrong.get(p, [])) >= per_side:
            out += right[p][:per_side] + wrong[p][:per_side]
    return sorted(out)
