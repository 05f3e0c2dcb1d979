"""Early experience: the agent's own one-step alternatives from expert states, and the three
kinds of training example built from them (arXiv 2510.08558, section 2; spec section 2).

At each expert state s_i (the goal and the page), K alternative actions a_i^j != a_i are drawn
and executed for ONE step from a copy of the environment, giving s_i^j; the expert's own next
state s_{i+1} is kept too. From D_rollout = {(s_i, a_i^j, s_i^j)}:

    implicit world modelling (IWM)   prompt = the policy's prompt at s_i + `Action: a`,
                                     target = `Observation: s'` for every (a, s') of the state,
                                     expert transition included: L_IWM = -sum log p(s' | s, a)
    self-reflection (SR)             prompt = the policy's prompt at s_i, target =
                                     `Thought: c_i^j | Action: a_i`: L_SR = -sum log p(c, a | s)
                                     with c a TEMPLATED reflection (below)
    DPO pairs                        (prompt at s_i, chosen = the expert turn, rejected = the
                                     alternative turn)

Alternatives are drawn uniformly from the page's legal actions minus the expert's (spec
section 4 allows "sampled from the IL model (or uniformly from legal actions)"; uniform needs
no IL model first and never repeats the expert action, the spec's second pitfall). With fewer
than K other legal actions, every one is taken.

Reflections: the paper prompts the same model to explain, from the two observed outcomes, why
the expert action is better. A tiny model trained from scratch here cannot write one, so
here `reflection()` fills a template from the outcome difference ("[40] $25 > $20; [12] fits:
$18, M"). These are TEMPLATED reflections, a stand-in the spec names (section 6: they make SR
look stronger than model-written ones); the pipeline labels them so in params, MLflow and
the README.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from stages.agents.protocol import Env, parse_call
from stages.agents.react import PromptFormat
from stages.early_experience.shop import ShopEnv


@dataclass(frozen=True)
class Branch:
    """One executed action from an expert state: the call and the environment after it."""

    call: str
    observation: str
    env: Any


def step_copy(env: Env, call: str) -> Branch:
    """Execute `call` for one step on a copy of `env` (the original is untouched)."""
    twin = copy.deepcopy(env)
    result = twin.step(parse_call(call, twin.tools))
    return Branch(call, result.observation, twin)


def alternatives(env: Env, expert_call: str, k: int, rng: random.Random) -> list[str]:
    """Up to `k` distinct legal calls other than the expert's, uniformly drawn."""
    pool = [a for a in env.legal_actions() if a != expert_call]
    return rng.sample(pool, min(k, len(pool)))


def _item_diff(env: ShopEnv, b: Branch, n: str) -> str:
    g, it = env.goal, b.env.item
    assert it is not None
    if it.category != g.category or it.color != g.color:
        return f"{n} is a {it.color} {it.category}"
    if it.price > g.max_price:
        return f"{n} is ${it.price} > ${g.max_price}"
    if g.size not in it.sizes:
        return f"{n} has no {g.size}"
    return f"{n} fits but is later"


def reflection(env: ShopEnv, expert: Branch, alt: Branch) -> str:
    """A TEMPLATED reflection: what the alternative led to, then why the expert action is
    right, from the two outcomes (`env` is the state both branched from)."""
    g = env.goal
    name = alt.call.split("[")[0]
    if name == "search":
        shown = alt.env.results[0] if alt.env.results else None
        got = f"{shown.color} {shown.category}" if shown else "nothing"
        why = f"that lists {got}"
    elif name == "click":
        why = _item_diff(env, alt, alt.call[len("click["):-1])
    elif name == "select":
        size = alt.call[len("select["):-1]
        why = (f"size {size} is not {g.size}" if size != g.size
               else f"{size} is already selected")
    elif name == "buy":
        why = "no size yet" if env.size != g.size else "buy fails"
    else:
        why = "back loses it"
    if expert.env.page == "item" and expert.call.startswith("click"):
        it = expert.env.item
        assert it is not None
        good = f"{expert.call[len('click['):-1]} is ${it.price} with {g.size}"
    elif expert.call.startswith("select"):
        good = f"need {g.size}"
    elif expert.call == "buy":
        good = "all met"
    elif expert.call.startswith("search"):
        good = f"need {g.color} {g.category}"
    else:
        good = "nothing fits"
    return f"{why}; {good}"


def explore_state(env: Env, expert_call: str, k: int, rng: random.Random,
                  reflect: Callable[[Any, Branch, Branch], str] = reflection
                  ) -> list[dict[str, object]]:
    """The rows of one expert state: j = 0 the expert's transition, j = 1..k the alternatives,
    each with its one-step outcome and (alternatives only) the templated reflection
    `reflect(env, expert, alternative)` (the mini-WebShop's `reflection` by default; BabyAI's
    is `stages.early_experience.babyai.reflection`)."""
    expert = step_copy(env, expert_call)
    rows: list[dict[str, object]] = [{"j": 0, "call": expert_call, "next": expert.observation,
                                      "reflection": ""}]
    for j, a in enumerate(alternatives(env, expert_call, k, rng), start=1):
        b = step_copy(env, a)
        rows.append({"j": j, "call": a, "next": b.observation,
                     "reflection": reflect(env, expert, b)})
    return rows


# The `experience` stage's table (stages/early_experience/explore.py), one row per expert state
# and branch; `train` reads it through this check.
def _schema() -> dict[str, Any]:
    import polars as pl

    return {"episode": pl.Int64, "step": pl.Int64, "j": pl.Int64, "prompt": pl.String,
            "expert_call": pl.String, "call": pl.String, "next": pl.String,
            "reflection": pl.String}


SCHEMA = _schema()


def experience_spec() -> Any:
    import polars as pl

    from stages.core.checks import ColumnSpec, FrameSpec

    cols = {k: ColumnSpec(dtype=v) for k, v in SCHEMA.items()}
    for k in ("episode", "step", "j"):
        cols[k] = ColumnSpec(dtype=pl.Int64, min=0)
    return FrameSpec(cols, min_rows=1)


# The example builders read the rows of the `experience` stage's table (one row per expert
# state and branch: prompt, expert_call, j, call, next, reflection); `k` keeps branches j <= k.

def iwm_examples(rows: Sequence[dict], fmt: PromptFormat, k: int) -> tuple[list[str], list[str]]:
    """Next-state prediction: prompt at s + `Action: a` -> `Observation: s'`, expert transition
    (j = 0) and the first `k` alternatives."""
    keep = [r for r in rows if r["j"] <= k]
    return ([r["prompt"] + fmt.turn(r["call"]) + fmt.sep for r in keep],
            [fmt.observation(r["next"]) for r in keep])


def sr_examples(rows: Sequence[dict], fmt: PromptFormat, k: int) -> tuple[list[str], list[str]]:
    """Reflection then the expert action, one per (state, alternative j <= k)."""
    keep = [r for r in rows if 1 <= r["j"] <= k]
    return ([r["prompt"] for r in keep],
            [fmt.turn(r["expert_call"], r["reflection"]) for r in keep])


def dpo_pairs(rows: Sequence[dict], fmt: PromptFormat, k: int
              ) -> tuple[list[str], list[str], list[str]]:
    """(prompts, chosen, rejected): the expert turn over each alternative j <= k."""
    keep = [r for r in rows if 1 <= r["j"] <= k]
    return ([r["prompt"] for r in keep], [fmt.turn(r["expert_call"]) for r in keep],
            [fmt.turn(r["call"]) for r in keep])
