"""A text mini-WebShop: a catalogue of items, goals with constraints, four page-bound tools.

The Early Experience paper's WebShop (arXiv 2510.08558, section 5; WebShop itself is Yao et
al., arXiv 2207.01206) at the size a tiny model trained from scratch can read (spec section 4):

    catalogue   items with a category, a colour, a price and the sizes in stock
    goal        "red shirt, size M, max $20": success = bought an item of that category and
                colour, at or under the budget, with that size selected
    pages       search -> results (up to `max_results` items) -> item -> buy

    tool          page      what it does
    search[q]     search    lists the items whose category (and colour, when named) q names
    click[n]      results   opens the n-th listed item's page (positions, not catalogue ids
                            [ours]: a character model copies one digit)
    select[size]  item      selects a size the item has in stock
    buy           item      ends the episode (success or not)
    back          results / item   one page up

A call that makes no sense on the current page (a click on the search page, a size the item
lacks, an unlisted id) is refused with `InvalidAction` and a reason, counted by the rollout
runner. Every observation is the whole page, so the last observation and the goal are the
state: the policy's prompt shows no history (`PromptFormat(window=0)`), which keeps prompts
~100 characters.

Splits (the spec's OOD: "unseen categories and constraint combinations"): `train` goals (the
expert's demonstrations), `test` goals over the same (colour, category) pairs (in-domain),
`ood` goals over categories no train goal has (unseen categories: their words are in no
demonstration) and `ood_combo` goals over held-out (colour, category) pairs of the in-domain
categories (`HELD_OUT`: each colour and each category in five train pairs, never this one: an
unseen combination of seen words). Goals are drawn so that at least one item meets them and,
with `distractors`, the search that finds it also lists items that break a constraint (over
budget, size out of stock): the choice on the results page is the decision to learn.

`expert_action(env)` is the scripted expert (privileged: it reads the goal and the page); its
success is the ceiling, a uniform draw over `legal_actions()` the floor.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.agents.protocol import Env, InvalidAction, StepResult, Tool, ToolCall

COLORS = ("red", "blue", "green", "black", "white", "grey")
SIZES = ("S", "M", "L", "XL")
IN_DOMAIN = ("shirt", "shoes", "hat", "bag", "mug", "lamp")
OOD = ("scarf", "jacket")          # categories of the OOD split only
# [ours] the (colour, category) pairs of the `ood_combo` split, held out of the train and test
# goals: one per colour and per category (a Latin diagonal), so every word stays in training
HELD_OUT = ("red shirt", "blue shoes", "green hat", "black bag", "white mug", "grey lamp")


def parse_pairs(pairs: Any) -> list[tuple[str, str]]:
    """`["red shirt", ...]` -> [(colour, category)]: each an in-domain pair, no repeats, and
    every colour and every category left in at least one training pair. A named error
    otherwise."""
    out: list[tuple[str, str]] = []
    for p in pairs:
        words = str(p).split()
        if len(words) != 2 or words[0] not in COLORS or words[1] not in IN_DOMAIN:
            raise ValueError(f"held-out pair {p!r}: want 'colour category' with a colour in "
                             f"{COLORS} and an in-domain category in {IN_DOMAIN}")
        out.append((words[0], words[1]))
    if len(set(out)) != len(out):
        raise ValueError(f"held-out pairs {list(pairs)} repeat a pair")
    for c in COLORS:
        if sum(pc == c for pc, _ in out) == len(IN_DOMAIN):
            raise ValueError(f"held-out pairs hold out every category of colour {c!r}: the "
                             "word would be unseen, not the combination")
    for k in IN_DOMAIN:
        if sum(pk == k for _, pk in out) == len(COLORS):
            raise ValueError(f"held-out pairs hold out every colour of category {k!r}")
    return out


def in_domain_pairs(held_out: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Every (colour, category) of the in-domain categories except the held-out ones."""
    return [(c, k) for k in IN_DOMAIN for c in COLORS if (c, k) not in set(held_out)]


class SearchArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str = Field(min_length=1, max_length=40)


class ClickArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    item: int = Field(ge=1, description="position on the results page, from 1")


class SelectArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: str = Field(min_length=1, max_length=4)


TOOLS = (Tool("search", "search the shop", SearchArgs),
         Tool("click", "open a listed item", ClickArgs),
         Tool("select", "select a size on an item page", SelectArgs),
         Tool("buy", "buy the open item"),
         Tool("back", "go one page up"))


@dataclass(frozen=True)
class Item:
    id: int
    category: str
    color: str
    price: int
    sizes: tuple[str, ...]

    def line(self) -> str:
        return f"{self.color} {self.category} ${self.price} {'/'.join(self.sizes)}"


@dataclass(frozen=True)
class Goal:
    category: str
    color: str
    size: str
    max_price: int

    def text(self) -> str:
        return f"{self.color} {self.category}, size {self.size}, max ${self.max_price}"

    def met_by(self, item: Item, size: str | None) -> bool:
        return (item.category == self.category and item.color == self.color
                and item.price <= self.max_price and size == self.size)

    def fits(self, item: Item) -> bool:
        """The item could meet the goal (the right size in stock)."""
        return (item.category == self.category and item.color == self.color
                and item.price <= self.max_price and self.size in item.sizes)


def make_catalogue(seed: int, per_pair: int) -> list[Item]:
    """`per_pair` items per (category, colour), prices $5-$60, 1-3 sizes each."""
    rng = random.Random(f"catalogue/{seed}")
    items: list[Item] = []
    for cat in IN_DOMAIN + OOD:
        for color in COLORS:
            for _ in range(per_pair):
                stock = set(rng.sample(SIZES, rng.randint(1, 3)))
                sizes = tuple(s for s in SIZES if s in stock)
                items.append(Item(0, cat, color, 5 * rng.randint(1, 12), sizes))
    rng.shuffle(items)      # ids carry no category information
    return [Item(i, it.category, it.color, it.price, it.sizes) for i, it in enumerate(items)]


def search(catalogue: list[Item], query: str, max_results: int) -> list[Item]:
    """Items of the colour and the category the query names (both needed [ours]: the results
    page then names them once and lists only price and sizes); in id order, at most
    `max_results`."""
    words = query.lower().split()
    colors = [w for w in words if w in COLORS]
    cats = [w for w in words if w in IN_DOMAIN + OOD]
    if not colors or not cats:
        return []
    return [it for it in catalogue if it.category == cats[0]
            and it.color == colors[0]][:max_results]


def make_goals(catalogue: list[Item], categories: tuple[str, ...], n: int, seed: int,
               max_results: int, distractors: bool = True,
               pairs: list[tuple[str, str]] | None = None) -> list[Goal]:
    """`n` goals over `categories` (every colour), or over the (colour, category) `pairs` when
    given, each met by some item the expert's search lists; with `distractors`, that search
    also lists an item that breaks a constraint."""
    rng = random.Random(f"goals/{seed}")
    goals: list[Goal] = []
    tries = 0
    while len(goals) < n:
        tries += 1
        if tries > 100 * n:
            raise ValueError(f"could not draw {n} goals over {categories}: too few items "
                             "per (category, colour) (raise per_pair)")
        if pairs is None:
            cat, color = rng.choice(categories), rng.choice(COLORS)
        else:
            color, cat = rng.choice(pairs)
        listed = search(catalogue, f"{color} {cat}", max_results)
        target = rng.choice(listed)
        size = rng.choice(target.sizes)
        budget = target.price + 5 * rng.randint(0, 2)
        goal = Goal(cat, color, size, budget)
        if distractors and all(goal.fits(it) for it in listed):
            continue
        goals.append(goal)
    return goals


@dataclass
class ShopEnv(Env):
    """One episode: a goal on the shared catalogue (deep-copyable: one-step alternatives
    branch from a copy)."""

    catalogue: list[Item]
    goal: Goal
    max_results: int = 5
    page: str = "search"
    results: list[Item] = field(default_factory=list)
    item: Item | None = None
    size: str | None = None
    bought: bool = False
    query: str = ""
    searchable: tuple[str, ...] = IN_DOMAIN     # categories the legal searches name

    name = "webshop"
    tools = TOOLS

    def __deepcopy__(self, memo: dict) -> "ShopEnv":
        # the catalogue is immutable and shared; copying only the page state keeps branching
        # at every expert state cheap
        return ShopEnv(self.catalogue, self.goal, self.max_results, self.page,
                       list(self.results), self.item, self.size, self.bought, self.query,
                       self.searchable)

    def reset(self) -> tuple[str, str]:
        self.page, self.results, self.item, self.size = "search", [], None, None
        self.bought, self.query = False, ""
        return self.goal.text(), self.observe()

    def observe(self) -> str:
        if self.page == "search":
            return "search page"
        if self.page == "results":
            if not self.results:
                return f"no results for {self.query}"
            head = f"{self.results[0].color} {self.results[0].category}"
            return f"{head}: " + "; ".join(f"{i} ${it.price} {'/'.join(it.sizes)}"
                                         for i, it in enumerate(self.results, start=1))
        assert self.item is not None
        return f"item {self.item.line()}, size {self.size or '-'}"

    def _refuse(self, reason: str, message: str) -> None:
        raise InvalidAction(reason, f"{message} (on the {self.page} page)")

    def step(self, call: ToolCall) -> StepResult:
        name, args = call.name, call.args
        if name == "search":
            if self.page != "search":
                self._refuse("wrong_page", "search only from the search page")
            self.query = " ".join(args["query"].split())
            self.results = search(self.catalogue, self.query, self.max_results)
            self.page = "results"
        elif name == "click":
            if self.page != "results":
                self._refuse("wrong_page", "click only on a results page")
            if not 1 <= args["item"] <= len(self.results):
                self._refuse("not_listed", f"no result {args['item']}")
            self.item, self.size, self.page = self.results[args["item"] - 1], None, "item"
        elif name == "select":
            if self.page != "item":
                self._refuse("wrong_page", "select only on an item page")
            assert self.item is not None
            if args["size"] not in self.item.sizes:
                self._refuse("no_such_size", f"size {args['size']} is not in stock")
            self.size = args["size"]
        elif name == "buy":
            if self.page != "item":
                self._refuse("wrong_page", "buy only on an item page")
            self.bought = True
            ok = self.success()
            return StepResult(f"bought {self.item.line()} size {self.size or '-'}",  # type: ignore
                              reward=float(ok), done=True)
        elif name == "back":
            if self.page == "search":
                self._refuse("wrong_page", "nothing above the search page")
            self.page = "results" if self.page == "item" else "search"
        return StepResult(self.observe())

    def success(self) -> bool:
        return self.bought and self.item is not None and self.goal.met_by(self.item, self.size)

    def legal_actions(self) -> list[str]:
        """Every call the page accepts; searches: each colour x `searchable` category (the
        in-domain ones for train, test and `ood_combo` goals, so no OOD category word reaches
        training through an alternative action; every category for `ood` goals). A held-out
        pair is a legal search on a train state: early experience may try it, as the paper's
        agent may try any action; the expert never does."""
        if self.page == "search":
            return [f"search[{c} {k}]" for k in self.searchable for c in COLORS]
        if self.page == "results":
            return [f"click[{i}]" for i in range(1, len(self.results) + 1)] + ["back"]
        assert self.item is not None
        return [f"select[{s}]" for s in self.item.sizes] + ["buy", "back"]


def expert_action(env: ShopEnv) -> str:
    """The scripted expert: search colour + category, open the first listed item that fits,
    select the size, buy. Privileged (reads the goal); never an arm under test."""
    g = env.goal
    if env.page == "search":
        return f"search[{g.color} {g.category}]"
    if env.page == "results":
        fit = [i for i, it in enumerate(env.results, start=1) if g.fits(it)]
        return f"click[{fit[0]}]" if fit else "back"
    assert env.item is not None
    if not g.fits(env.item):
        return "back"
    if env.size != g.size:
        return f"select[{g.size}]"
    return "buy"


def expert_agent() -> Any:
    from stages.agents.rollout import ScriptedAgent

    return ScriptedAgent("expert", lambda ep: ("", expert_action(ep.env)))


# --- on disk: the catalogue and the goals of every split ---------------------------------

SPLITS = ("train", "test", "ood", "ood_combo")
EVAL_SPLITS = ("test", "ood", "ood_combo")      # what every policy plays
ITEM_SCHEMA = {"id": "Int64", "category": "String", "color": "String", "price": "Int64",
               "sizes": "String"}
GOAL_SCHEMA = {"split": "String", "goal_id": "Int64", "category": "String", "color": "String",
               "size": "String", "max_price": "Int64"}


def _schema(names: dict[str, str]) -> dict[str, Any]:
    import polars as pl

    return {k: getattr(pl, v) for k, v in names.items()}


def item_spec() -> Any:
    import polars as pl

    from stages.core.checks import ColumnSpec, FrameSpec

    cols = {k: ColumnSpec(dtype=v) for k, v in _schema(ITEM_SCHEMA).items()}
    cols["id"] = ColumnSpec(dtype=pl.Int64, min=0, unique=True)
    cols["color"] = ColumnSpec(dtype=pl.String, values=COLORS)
    cols["category"] = ColumnSpec(dtype=pl.String, values=IN_DOMAIN + OOD)
    cols["price"] = ColumnSpec(dtype=pl.Int64, min=1)
    return FrameSpec(cols, min_rows=1)


def goal_spec() -> Any:
    import polars as pl

    from stages.core.checks import ColumnSpec, FrameSpec

    cols = {k: ColumnSpec(dtype=v) for k, v in _schema(GOAL_SCHEMA).items()}
    cols["split"] = ColumnSpec(dtype=pl.String, values=SPLITS)
    cols["color"] = ColumnSpec(dtype=pl.String, values=COLORS)
    cols["category"] = ColumnSpec(dtype=pl.String, values=IN_DOMAIN + OOD)
    cols["size"] = ColumnSpec(dtype=pl.String, values=SIZES)
    cols["max_price"] = ColumnSpec(dtype=pl.Int64, min=1)
    return FrameSpec(cols, min_rows=1)


def write_shop(folder: Any, catalogue: list[Item], goals: dict[str, list[Goal]]) -> None:
    import polars as pl

    pl.DataFrame([{"id": it.id, "category": it.category, "color": it.color,
                   "price": it.price, "sizes": "/".join(it.sizes)} for it in catalogue],
                 schema=_schema(ITEM_SCHEMA)).write_parquet(folder / "items.parquet")
    pl.DataFrame([{"split": s, "goal_id": i, "category": g.category, "color": g.color,
                   "size": g.size, "max_price": g.max_price}
                  for s, gs in goals.items() for i, g in enumerate(gs)],
                 schema=_schema(GOAL_SCHEMA)).write_parquet(folder / "goals.parquet")


def read_shop(folder: Any) -> tuple[list[Item], dict[str, list[Goal]]]:
    """The catalogue and the goals per split, through the checked reads."""
    from stages.core.checks import read_parquet_checked

    items = read_parquet_checked(folder / "items.parquet", item_spec())
    goals = read_parquet_checked(folder / "goals.parquet", goal_spec())
    catalogue = [Item(r["id"], r["category"], r["color"], r["price"],
                      tuple(r["sizes"].split("/"))) for r in items.sort("id").iter_rows(named=True)]
    if [it.id for it in catalogue] != list(range(len(catalogue))):
        raise ValueError(f"{folder}/items.parquet: item ids must run 0..n-1")
    out: dict[str, list[Goal]] = {s: [] for s in SPLITS}
    for r in goals.sort("split", "goal_id").iter_rows(named=True):
        out[r["split"]].append(Goal(r["category"], r["color"], r["size"], r["max_price"]))
    return catalogue, out


def envs_for(catalogue: list[Item], goals: list[Goal], split: str, max_results: int
             ) -> list[ShopEnv]:
    searchable = IN_DOMAIN + OOD if split == "ood" else IN_DOMAIN
    return [ShopEnv(catalogue, g, max_results, searchable=searchable) for g in goals]
