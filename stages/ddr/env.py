"""The DDR tools over one entity's database, read-only, behind a SELECT-only guard.

DDR (arXiv 2602.02039, section 3 and the official code's SQLite MCP server) gives the agent
`get_database_info()`, `describe_table(table_name)` and `execute_query(query, limit)`, and
requires read-only access "enforced in the tools, not in the prompt" (spec section 6). Two
locks here:

1. `guard_select(sql)`: the query is parsed with sqlglot (SQLite dialect); anything but exactly
   one SELECT (a UNION or a CTE ending in a SELECT included) is refused with a named
   `SQLGuardError` (`sql_syntax`, `multi_statement`, `not_select`) before SQLite sees it.
2. The connection itself is read-only (`mode=ro` URI, plus `PRAGMA query_only`), so even a
   statement the guard let through could not write.

The environment turns a refusal into `InvalidAction(reason)`, counted by the rollout runner;
the file is never touched (a test hashes it before and after).

Each turn also yields an *insight* (the paper's per-turn LLM_insight call, here
deterministic): the facts a query result states, one dict per result row, plus, for a result
with `day` and `value` columns, a per-series summary (first, last, peak, n, trend) the way an
analyst would read a time series. Schema calls and errors give "NO INSIGHT", as in the paper.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.agents.protocol import Env, InvalidAction, StepResult, Tool, ToolCall
from stages.ddr.world import TABLES, trend_label

NO_INSIGHT = "NO INSIGHT"


class SQLGuardError(ValueError):
    """A query the SELECT-only guard refuses; `reason` names why (a metric name)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def guard_select(sql: str) -> None:
    """Raise SQLGuardError unless `sql` is exactly one read-only SELECT statement."""
    import sqlglot
    from sqlglot import exp
    from sqlglot.errors import SqlglotError

    try:
        statements = [s for s in sqlglot.parse(sql, read="sqlite") if s is not None]
    except SqlglotError as err:
        raise SQLGuardError("sql_syntax", f"query does not parse: {str(err)[:120]}") from None
    if len(statements) != 1:
        raise SQLGuardError("multi_statement", f"{len(statements)} statements: one SELECT per "
                            "call")
    stmt = statements[0]
    if not isinstance(stmt, exp.Query):
        raise SQLGuardError("not_select", f"{stmt.key.upper()} refused: the database is "
                            "read-only, only SELECT queries run")
    writes = (exp.Insert, exp.Update, exp.Delete, exp.Drop, exp.Create, exp.Alter,
              exp.Command, exp.Pragma, exp.Attach, exp.Detach)
    bad = next((n for n in stmt.walk() if isinstance(n, writes)), None)
    if bad is not None:
        raise SQLGuardError("not_select", f"{bad.key.upper()} inside a SELECT refused")


def connect_read_only(path: Path) -> sqlite3.Connection:
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such database")
    con = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True)
    con.execute("PRAGMA query_only = ON")
    return con


def render_rows(columns: list[str], rows: list[tuple]) -> str:
    if not rows:
        return "(no rows)"
    return "; ".join(", ".join(f"{c}={_fmt(v)}" for c, v in zip(columns, r)) for r in rows)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else f"{v:.4g}"
    return str(v)


def result_facts(columns: list[str], rows: list[tuple]) -> list[dict[str, str]]:
    """The facts a result states: each row as {column: value}, plus a series summary per group
    when the result has `day` and `value` columns (grouped by its other text columns)."""
    facts = [{c: _fmt(v) for c, v in zip(columns, r)} for r in rows]
    if "day" in columns and "value" in columns:
        di, vi = columns.index("day"), columns.index("value")
        keys = [i for i, c in enumerate(columns) if i not in (di, vi)
                and all(isinstance(r[i], str) for r in rows)]
        groups: dict[tuple, list[tuple]] = {}
        for r in rows:
            if isinstance(r[vi], (int, float)) and isinstance(r[di], (int, float)):
                groups.setdefault(tuple(r[i] for i in keys), []).append((r[di], r[vi]))
        for key, series in groups.items():
            series.sort()
            first, last = series[0][1], series[-1][1]
            facts.append({**{columns[i]: str(k) for i, k in zip(keys, key)},
                          "first": _fmt(float(first)), "last": _fmt(float(last)),
                          "peak": _fmt(float(max(v for _, v in series))),
                          "n": str(len(series)), "trend": trend_label(first, last)})
    return facts


class QueryArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str = Field(min_length=1)
    limit: int = Field(50, ge=1, le=1000)


class DescribeArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    table_name: str = Field(min_length=1)


TOOLS = (
    Tool("get_database_info", "list the tables and their row counts"),
    Tool("describe_table", "the columns of a table", DescribeArgs),
    Tool("execute_query", "run one read-only SELECT (SQLite)", QueryArgs),
    Tool("finish", "end the exploration (the paper's FINISH: message)"),
)


class SQLiteEnv(Env):
    """One episode: one entity's database, no question. Every step records its insight facts
    (`self.insights`, one list per turn, empty for NO INSIGHT) and the tables it touched
    (`self.domains`), the inputs of the judge and of the exploration entropy."""

    name = "ddr_sqlite"
    tools = TOOLS

    def __init__(self, db: Path, entity: int, *, max_obs_rows: int = 50) -> None:
        self.db, self.entity, self.max_obs_rows = Path(db), entity, max_obs_rows
        self.con: sqlite3.Connection | None = None
        self.insights: list[list[dict[str, str]]] = []
        self.domains: list[list[str]] = []
        self.finished = False

    def success(self) -> bool:
        """The explorer ended its exploration itself (FINISH) rather than hitting the cap."""
        return self.finished

    def reset(self) -> tuple[str, str]:
        if self.con is not None:
            self.con.close()
        self.con = connect_read_only(self.db)
        self.insights, self.domains, self.finished = [], [], False
        return f"Analyze patient {self.entity}", "a database; no question. Explore it."

    def close(self) -> None:
        if self.con is not None:
            self.con.close()
            self.con = None

    def _record(self, facts: list[dict[str, str]], domains: list[str]) -> None:
        self.insights.append(facts)
        self.domains.append(domains)

    def step(self, call: ToolCall) -> StepResult:
        assert self.con is not None, "reset() first"
        if call.name == "finish":
            self._record([], [])
            self.finished = True
            return StepResult("FINISH", done=True)
        if call.name == "get_database_info":
            counts = [f"{t} ({self.con.execute(f'SELECT COUNT(*) FROM {t}').fetchone()[0]} rows)"
                      for t in self._tables()]
            self._record([], [])
            return StepResult("tables: " + ", ".join(counts))
        if call.name == "describe_table":
            table = call.args["table_name"]
            if table not in self._tables():
                self._record([], [])
                raise InvalidAction("unknown_table", f"no table {table!r}; tables: "
                                    f"{', '.join(self._tables())}")
            cols = self.con.execute(f"SELECT name, type FROM pragma_table_info('{table}')")
            self._record([], [table])
            return StepResult(f"{table}: " + ", ".join(f"{n} {t}" for n, t in cols.fetchall()))
        sql = call.args["query"]
        try:
            guard_select(sql)
        except SQLGuardError as err:
            self._record([], [])
            raise InvalidAction(err.reason, str(err)) from None
        try:
            cur = self.con.execute(sql)
            rows = cur.fetchmany(min(call.args["limit"], self.max_obs_rows))
        except sqlite3.Error as err:
            self._record([], [])
            raise InvalidAction("sql_error", f"SQLite: {err}") from None
        columns = [d[0] for d in cur.description or ()]
        self._record(result_facts(columns, rows), query_tables(sql))
        return StepResult(render_rows(columns, rows))

    def _tables(self) -> list[str]:
        assert self.con is not None
        return [r[0] for r in self.con.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]

    def lab_items(self) -> list[str]:
        assert self.con is not None
        return [r[0] for r in self.con.execute("SELECT DISTINCT item FROM labs ORDER BY item")]

    def legal_actions(self) -> list[str]:
        """Every call of the query catalog (what a random explorer draws from)."""
        calls = ["get_database_info"] + [f"describe_table[{t}]" for t in TABLES]
        for table in TABLES:
            calls += [f"execute_query[{q}]" for q in catalog(table, self.lab_items())]
        return calls


def query_tables(sql: str) -> list[str]:
    """The tables a SELECT reads (its exploration domains), sorted."""
    import sqlglot
    from sqlglot import exp

    tree = sqlglot.parse_one(sql, read="sqlite")
    return sorted({t.name for t in tree.find_all(exp.Table) if t.name})


def catalog(table: str, lab_items: list[str]) -> list[str]:
    """The queries an explorer knows for a table, shallow to deep: per-table aggregates and
    time series first, then row listings and per-object drill-downs (spec section 4's
    "per-column aggregates and time trends") [reconstructed]."""
    if table == "stays":
        return ["SELECT COUNT(*) AS n_stays, MAX(los_days) AS max_los FROM stays",
                "SELECT unit AS top_unit, COUNT(*) AS n FROM stays GROUP BY unit "
                "ORDER BY n DESC, unit LIMIT 1",
                "SELECT stay_id, admit_day, los_days, unit FROM stays ORDER BY admit_day",
                "SELECT AVG(los_days) AS mean_los, MIN(admit_day) AS first_admit FROM stays"]
    if table == "labs":
        return (["SELECT item, day, value FROM labs ORDER BY item, day",
                 "SELECT item, COUNT(*) AS n_tests FROM labs GROUP BY item"]
                + [f"SELECT item, day, value FROM labs WHERE item = '{i}' ORDER BY day"
                   for i in lab_items])
    if table == "prescriptions":
        return ["SELECT drug AS first_drug, day FROM prescriptions ORDER BY day, drug LIMIT 1",
                "SELECT COUNT(DISTINCT drug) AS n_drugs FROM prescriptions",
                "SELECT day, drug, dose_mg FROM prescriptions ORDER BY day"]
    if table == "allergies":
        return ["SELECT COUNT(*) AS n_allergies FROM allergies",
                "SELECT substance FROM allergies ORDER BY substance"]
    raise ValueError(f"no query catalog for table {table!r}; tables: {', '.join(TABLES)}")


def exploration_entropy(domains: list[list[str]], n_domains: int) -> float:
    """Normalised exploration entropy -sum p_i log2 p_i / log2 n over the domains (tables)
    the calls touched, p_i = share of touches on table i (DDR section 5's analysis); 0 when
    nothing was touched."""
    import math

    counts: dict[str, int] = {}
    for ds in domains:
        for d in ds:
            counts[d] = counts.get(d, 0) + 1
    total = sum(counts.values())
    if total == 0 or n_domains < 2:
        return 0.0
    h = -sum(c / total * math.log2(c / total) for c in counts.values())
    return h / math.log2(n_domains)
