"""Scripted explorers: the reference arms of DDR's small-scale reproduction (spec section 4) and
the expert the learned explorer imitates. None of them is the method under test; the learned
tiny Llama explorer (stage `train_explorer`) is.

    breadth    get_database_info, describe every table, then the catalog level by level across
               tables (every table's first query, then every table's second, ...), FINISH
    depth      get_database_info, then one random table at a time, described and queried to
               the end of its catalog before the next, FINISH
    random     a uniform draw from every catalog call at every turn (never finishes)
    reactive   given the checklist questions (the paper's reactive mode): for each item, the
               catalog query that answers it, FINISH

Each is a plan of call texts indexed by the turn; the budget cuts it. A plan depends on the
entity's database (its lab items) and, for depth, on a seed per episode, never on the budget,
so the run at budget b is the first b turns of the run at the largest budget.
"""

from __future__ import annotations

import random
from typing import Callable

from stages.agents.rollout import Episode, ScriptedAgent, random_agent
from stages.ddr.env import catalog
from stages.ddr.world import TABLES

SCRIPTED = ("breadth", "depth", "random", "reactive")
FINISH = "finish"

# which catalog query (table, index) states each aspect: the reactive explorer's lookup
ANSWERS = {"n_stays": ("stays", 0), "max_los": ("stays", 0), "top_unit": ("stays", 1),
           "trend": ("labs", 0), "peak": ("labs", 0), "first_drug": ("prescriptions", 0),
           "n_drugs": ("prescriptions", 1), "n_allergies": ("allergies", 0)}


def _q(sql: str) -> str:
    return f"execute_query[{sql}]"


def breadth_plan(lab_items: list[str]) -> list[str]:
    plan = ["get_database_info"] + [f"describe_table[{t}]" for t in TABLES]
    cats = {t: catalog(t, lab_items) for t in TABLES}
    for level in range(max(len(c) for c in cats.values())):
        plan += [_q(cats[t][level]) for t in TABLES if level < len(cats[t])]
    return plan + [FINISH]


def depth_plan(lab_items: list[str], rng: random.Random) -> list[str]:
    plan = ["get_database_info"]
    for t in rng.sample(TABLES, len(TABLES)):
        plan += [f"describe_table[{t}]"] + [_q(q) for q in catalog(t, lab_items)]
    return plan + [FINISH]


def reactive_plan(lab_items: list[str], aspects: list[str]) -> list[str]:
    plan: list[str] = []
    for aspect in aspects:
        table, k = ANSWERS[aspect]
        call = _q(catalog(table, lab_items)[k])
        if call not in plan:
            plan.append(call)
    return plan + [FINISH]


def _planned(name: str, make: Callable[[Episode], list[str]]) -> ScriptedAgent:
    plans: dict[str, list[str]] = {}

    def policy(ep: Episode) -> tuple[str, str]:
        if ep.episode_id not in plans:
            plans[ep.episode_id] = make(ep)
        plan = plans[ep.episode_id]
        return "", plan[min(len(ep.steps), len(plan) - 1)]

    return ScriptedAgent(name, policy)


def make_explorer(name: str, *, seed: int = 0,
                  checklists: dict[str, list[str]] | None = None) -> ScriptedAgent:
    """A scripted explorer by name; `checklists` (episode id -> the aspects of its items, in
    checklist order) only for `reactive`."""
    if name == "breadth":
        return _planned(name, lambda ep: breadth_plan(ep.env.lab_items()))
    if name == "depth":
        return _planned(name, lambda ep: depth_plan(
            ep.env.lab_items(), random.Random(f"depth/{seed}/{ep.episode_id}")))
    if name == "random":
        agent = random_agent(seed)
        agent.name = "random"
        return agent
    if name == "reactive":
        if checklists is None:
            raise ValueError("the reactive explorer is given the checklist: pass checklists")
        return _planned(name, lambda ep: reactive_plan(ep.env.lab_items(),
                                                       checklists[ep.episode_id]))
    raise ValueError(f"unknown explorer {name!r}; scripted explorers: {', '.join(SCRIPTED)}")
