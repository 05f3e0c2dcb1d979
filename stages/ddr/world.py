"""Hybrid databases from hidden narratives (DDR spec section 4; arXiv 2602.02039 section 3).

DDR-Bench builds each entity's checklist from the hidden, unstructured part of its data (a
discharge note) and keeps only facts derivable from the visible, structured part. Here the
direction is reversed so derivability holds by construction: a hidden narrative per entity
(ICU stays, lab trajectories, medications, allergies) is sampled first, then rendered twice:

    visible   a SQLite database (tables stays, labs, prescriptions, allergies)
    hidden    a templated discharge note (never shown to an explorer)

and its checklist items are read off the narrative. Every item carries the SQL query that
derives its answer from the visible tables (`gold_sql`); `check_derivable` runs them all and a
test does too.

A fact is an `aspect` (a column name in the shared fact vocabulary below), the `binding` that
says which object it is about (`{"item": "creatinine"}` for a lab, `{}` for the entity) and its
`answer`. The paper's LLM judge reads free text; the deterministic judge here
(`stages.ddr.judge`) reads facts in this vocabulary, so an explorer's query must name what it
computed (`MAX(los_days) AS max_los`) for the judge to credit it [reconstructed].
"""

from __future__ import annotations

import json
import random
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LABS = {  # name: (low, high) of the first value, units implied
    "creatinine": (0.6, 1.4), "glucose": (80.0, 140.0), "hemoglobin": (9.0, 15.0),
    "sodium": (132.0, 146.0), "potassium": (3.4, 5.0)}
UNITS = ("MICU", "SICU", "CCU")
DRUGS = ("vancomycin", "heparin", "furosemide", "insulin", "metoprolol", "ceftriaxone")
ALLERGENS = ("penicillin", "sulfa", "latex", "iodine")
TRENDS = ("rising", "falling", "stable")
TREND_UP, TREND_DOWN = 1.15, 0.85          # last/first ratios that make a trend [ours]
TABLES = ("stays", "labs", "prescriptions", "allergies")

SCHEMA = {
    "stays": "stay_id INTEGER, admit_day INTEGER, los_days INTEGER, unit TEXT",
    "labs": "day INTEGER, item TEXT, value REAL",
    "prescriptions": "day INTEGER, drug TEXT, dose_mg INTEGER",
    "allergies": "substance TEXT",
}


def trend_label(first: float, last: float) -> str:
    """The trend of a series from its first and last values (the gold SQL's CASE, the insight
    extractor's summary and the generator all use this rule)."""
    if last > first * TREND_UP:
        return "rising"
    if last < first * TREND_DOWN:
        return "falling"
    return "stable"


@dataclass
class Narrative:
    """The hidden story of one entity (a patient)."""

    entity: int
    age: int
    stays: list[tuple[int, int, int, str]]            # stay_id, admit_day, los_days, unit
    labs: dict[str, list[tuple[int, float]]]          # item -> [(day, value)] by day
    trends: dict[str, str]
    notable_lab: str                                   # the lab whose peak the note mentions
    prescriptions: list[tuple[int, str, int]]          # day, drug, dose_mg
    allergies: list[str] = field(default_factory=list)


def sample_narrative(seed: int, entity: int, n_labs: int = 3) -> Narrative:
    rng = random.Random(f"ddr/{seed}/{entity}")
    stays, day = [], rng.randint(1, 30)
    for k in range(rng.randint(1, 4)):
        los = rng.randint(1, 14)
        stays.append((k + 1, day, los, rng.choice(UNITS)))
        day += los + rng.randint(5, 60)
    labs, trends = {}, {}
    for item in sorted(rng.sample(sorted(LABS), n_labs)):
        lo, hi = LABS[item]
        trend = rng.choice(TRENDS)
        first = round(rng.uniform(lo, hi), 1)
        ratio = {"rising": rng.uniform(1.4, 2.0), "falling": rng.uniform(0.45, 0.7),
                 "stable": rng.uniform(0.97, 1.03)}[trend]
        n = rng.randint(3, 6)
        days = sorted(rng.sample(range(1, 60), n))
        series = []
        for i, d in enumerate(days):
            frac = i / (n - 1)
            value = first * (1 + (ratio - 1) * frac) * (1 + rng.uniform(-0.03, 0.03) * (0 < i < n - 1))
            series.append((d, round(value, 1)))
        series[0] = (days[0], first)
        if trend_label(series[0][1], series[-1][1]) != trend:      # rounding moved it: pin it
            series[-1] = (days[-1], round(first * ratio, 1))
        assert trend_label(series[0][1], series[-1][1]) == trend, (item, series)
        labs[item], trends[item] = series, trend
    drugs = rng.sample(DRUGS, rng.randint(2, 4))
    start_days = sorted(rng.sample(range(1, 40), len(drugs)))   # distinct: one first drug
    rx = []
    for drug, d in zip(drugs, start_days):
        dose = rng.choice((20, 40, 80, 250, 500, 1000))
        rx.append((d, drug, dose))
        if rng.random() < 0.5:
            rx.append((d + rng.randint(1, 5), drug, dose))
    allergies = sorted(rng.sample(ALLERGENS, rng.choice((0, 1, 1, 2))))
    return Narrative(entity, rng.randint(25, 90), stays, labs, trends, rng.choice(sorted(labs)),
                     sorted(rx), allergies)


def note(n: Narrative) -> str:
    """The hidden discharge note: the narrative in words (what DDR-Bench's facts come from)."""
    longest = max(s[2] for s in n.stays)
    parts = [f"Patient {n.entity}, {n.age} years old, had {len(n.stays)} ICU stay(s); the "
             f"longest lasted {longest} days, mostly in the {top_unit(n)}."]
    for item, trend in n.trends.items():
        parts.append(f"{item.capitalize()} was {trend} over the admission.")
    peak = max(v for _, v in n.labs[n.notable_lab])
    parts.append(f"{n.notable_lab.capitalize()} peaked at {peak}.")
    first = min(n.prescriptions)[1]
    parts.append(f"{first.capitalize()} was started first; "
                 f"{len({d for _, d, _ in n.prescriptions})} drugs in all.")
    parts.append(f"Allergies: {', '.join(n.allergies) or 'none known'}.")
    return " ".join(parts)


def top_unit(n: Narrative) -> str:
    counts: dict[str, int] = {}
    for s in n.stays:
        counts[s[3]] = counts.get(s[3], 0) + 1
    return min(counts, key=lambda u: (-counts[u], u))       # ties: alphabetical, as the SQL


@dataclass(frozen=True)
class Item:
    """A checklist item: a question, its answer, the fact that states it, the SQL deriving it."""

    item_id: str
    question: str
    aspect: str                     # the fact's name (a column alias in the fact vocabulary)
    binding: dict[str, str]         # which object the fact is about ({} = the entity)
    answer: str
    kind: str                       # numeric | categorical
    gold_sql: str

    def row(self, seed: int, entity: int) -> dict[str, Any]:
        return {"seed": seed, "entity": entity, "item_id": self.item_id,
                "question": self.question, "aspect": self.aspect,
                "binding": json.dumps(self.binding, sort_keys=True), "answer": self.answer,
                "kind": self.kind, "gold_sql": self.gold_sql}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def checklist(n: Narrative) -> list[Item]:
    """5-10 items per entity, read off the narrative (never off the database)."""
    items = [
        Item("n_stays", "How many ICU stays did the patient have?", "n_stays", {},
             str(len(n.stays)), "numeric", "SELECT COUNT(*) AS n_stays FROM stays"),
        Item("max_los", "How long was the longest ICU stay, in days?", "max_los", {},
             str(max(s[2] for s in n.stays)), "numeric",
             "SELECT MAX(los_days) AS max_los FROM stays"),
        Item("top_unit", "In which unit did the patient stay most often?", "top_unit", {},
             top_unit(n), "categorical",
             "SELECT unit AS top_unit FROM stays GROUP BY unit ORDER BY COUNT(*) DESC, unit "
             "LIMIT 1"),
    ]
    for item, trend in n.trends.items():
        first = f"(SELECT value FROM labs WHERE item = '{item}' ORDER BY day LIMIT 1)"
        last = f"(SELECT value FROM labs WHERE item = '{item}' ORDER BY day DESC LIMIT 1)"
        items.append(Item(
            f"trend_{item}", f"How did the patient's {item} change over the admission?",
            "trend", {"item": item}, trend, "categorical",
            f"SELECT CASE WHEN {last} > {first} * {TREND_UP} THEN 'rising' "
            f"WHEN {last} < {first} * {TREND_DOWN} THEN 'falling' ELSE 'stable' END AS trend"))
    peak = max(v for _, v in n.labs[n.notable_lab])
    items.append(Item(f"peak_{n.notable_lab}", f"What was the patient's peak {n.notable_lab}?",
                      "peak", {"item": n.notable_lab}, _num(peak), "numeric",
                      f"SELECT MAX(value) AS peak FROM labs WHERE item = '{n.notable_lab}'"))
    items.append(Item("first_drug", "Which drug was started first?", "first_drug", {},
                      min(n.prescriptions)[1], "categorical",
                      "SELECT drug AS first_drug FROM prescriptions ORDER BY day, drug LIMIT 1"))
    items.append(Item("n_drugs", "How many different drugs were prescribed?", "n_drugs", {},
                      str(len({d for _, d, _ in n.prescriptions})), "numeric",
                      "SELECT COUNT(DISTINCT drug) AS n_drugs FROM prescriptions"))
    items.append(Item("n_allergies", "How many allergies are recorded?", "n_allergies", {},
                      str(len(n.allergies)), "numeric",
                      "SELECT COUNT(*) AS n_allergies FROM allergies"))
    return items


def write_database(n: Narrative, path: Path) -> None:
    """The visible tables of one entity, written to a fresh SQLite file (stdlib sqlite3)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    con = sqlite3.connect(path)
    try:
        for table in TABLES:
            con.execute(f"CREATE TABLE {table} ({SCHEMA[table]})")
        con.executemany("INSERT INTO stays VALUES (?, ?, ?, ?)", n.stays)
        con.executemany("INSERT INTO labs VALUES (?, ?, ?)",
                        [(d, item, v) for item, s in n.labs.items() for d, v in s])
        con.executemany("INSERT INTO prescriptions VALUES (?, ?, ?)", n.prescriptions)
        con.executemany("INSERT INTO allergies VALUES (?)", [(a,) for a in n.allergies])
        con.commit()
    finally:
        con.close()


def answer_matches(value: Any, answer: str, kind: str) -> bool:
    """Whether a fact's value states the answer: numbers within 0.5% (plus 1e-9), categories
    case-insensitively."""
    if kind == "numeric":
        try:
            v, a = float(value), float(answer)
        except (TypeError, ValueError):
            return False
        return abs(v - a) <= 1e-9 + 0.005 * abs(a)
    return str(value).strip().lower() == str(answer).strip().lower()


def check_derivable(db: Path, items: list[Item]) -> None:
    """Run every item's gold SQL on the database (read-only); ValueError naming the first
    item whose query does not return its answer."""
    from stages.ddr.env import connect_read_only

    con = connect_read_only(db)
    try:
        for it in items:
            rows = con.execute(it.gold_sql).fetchall()
            got = rows[0][0] if rows else None
            if len(rows) != 1 or not answer_matches(got, it.answer, it.kind):
                raise ValueError(f"{db.name}: item {it.item_id}: gold SQL returned {rows!r}, "
                                 f"the narrative says {it.answer!r}")
    finally:
        con.close()
