"""DDR (stages/ddr): derivable checklists, the read-only SELECT guard, the judge's contract and
metrics on hand-computed values, the explorers' ordering (seconds, no model)."""

from __future__ import annotations

import hashlib
import math
import sqlite3
from pathlib import Path

import pytest

from stages.agents.react import PromptFormat
from stages.agents.rollout import Budget, ScriptedAgent, run_episodes
from stages.ddr import world
from stages.ddr.env import (SQLGuardError, SQLiteEnv, connect_read_only, exploration_entropy,
                            guard_select, result_facts)
from stages.ddr.explorers import breadth_plan, make_explorer
from stages.ddr.judge import (CORRECT, INCORRECT, INSUFFICIENT, FactMatchJudge, ItemSpec,
                              accuracies, check_contract, correct_at_k, summary_message)

FMT = PromptFormat(window=1, max_obs_chars=160)


@pytest.fixture(scope="module")
def dbs(tmp_path_factory) -> list[tuple[Path, list[world.Item]]]:
    root = tmp_path_factory.mktemp("ddr")
    out = []
    for e in range(12):
        story = world.sample_narrative(7, e)
        path = root / f"patient{e}.sqlite"
        world.write_database(story, path)
        out.append((path, world.checklist(story)))
    return out


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _spec(it: world.Item) -> ItemSpec:
    return ItemSpec(it.question, it.answer, it.aspect, it.binding, it.kind)


def test_every_item_is_derived_by_its_gold_sql_and_the_oracle_scores_100(dbs):
    judge = FactMatchJudge()
    qualities = []
    for path, items in dbs:
        assert 5 <= len(items) <= 10
        world.check_derivable(path, items)              # raises on the first mismatch
        oracle = [[{**it.binding, it.aspect: it.answer} for it in items]]
        qualities += [(path.name, judge.judge(_spec(it), oracle)["context_quality"])
                      for it in items]
    assert accuracies(qualities)["acc_item"] == 1.0
    # the check can fail: a wrong answer is named
    path, items = dbs[0]
    wrong = world.Item(**{**items[0].__dict__, "answer": "99"})
    with pytest.raises(ValueError, match="item n_stays: gold SQL returned"):
        world.check_derivable(path, [wrong])


def test_trend_rule_on_hand_values():
    assert world.trend_label(1.0, 1.16) == "rising"
    assert world.trend_label(1.0, 1.15) == "stable"            # strictly above 1.15x
    assert world.trend_label(2.0, 1.69) == "falling"
    assert world.trend_label(2.0, 1.7) == "stable"


@pytest.mark.parametrize("sql, reason", [
    ("DROP TABLE labs", "not_select"),
    ("DELETE FROM labs", "not_select"),
    ("UPDATE stays SET los_days = 0", "not_select"),
    ("INSERT INTO allergies VALUES ('x')", "not_select"),
    ("ATTACH DATABASE '/tmp/x.db' AS x", "not_select"),
    ("PRAGMA writable_schema = ON", "not_select"),
    ("SELECT 1; DROP TABLE labs", "multi_statement"),
    ("SELECT * FROM labs; DELETE FROM labs", "multi_statement"),
    ("SELEC * FROM labs", "sql_syntax"),
])
def test_guard_refuses_writes_and_injections_by_name(dbs, sql, reason):
    path, _ = dbs[0]
    before = _sha(path)
    with pytest.raises(SQLGuardError) as err:
        guard_select(sql)
    assert err.value.reason == reason
    # through the tool: a named invalid action, counted, the file unchanged
    env = SQLiteEnv(path, 0)
    script = [f'execute_query{{"query": "{sql}"}}',
              "execute_query[SELECT COUNT(*) AS n FROM labs]"]
    agent = ScriptedAgent("attacker", lambda ep: ("", script[len(ep.steps)]))
    [ep] = run_episodes([env], agent, Budget(max_steps=2), FMT)
    env.close()
    assert ep.steps[0].invalid_action == reason and ep.ledger.invalid_actions == 1
    assert ep.steps[0].next_observation.startswith(f"Error ({reason})")
    assert ep.steps[1].next_observation.startswith("n=")          # the agent goes on
    assert _sha(path) == before


def test_selects_pass_and_the_connection_itself_is_read_only(dbs):
    for sql in ("SELECT 1", "WITH a AS (SELECT 1 AS x) SELECT x FROM a",
                "SELECT item FROM labs UNION SELECT drug FROM prescriptions"):
        guard_select(sql)
    path, _ = dbs[1]
    before = _sha(path)
    con = connect_read_only(path)
    with pytest.raises(sqlite3.OperationalError, match="readonly|read-only|query_only"):
        con.execute("DELETE FROM labs")                   # the second lock, without the guard
    con.close()
    assert _sha(path) == before


def test_series_summary_and_entropy_on_hand_values():
    facts = result_facts(["item", "day", "value"],
                         [("a", 1, 2.0), ("a", 5, 3.0), ("a", 3, 4.0), ("b", 2, 1.0)])
    summaries = [f for f in facts if "trend" in f]
    assert summaries == [
        {"item": "a", "first": "2", "last": "3", "peak": "4", "n": "3", "trend": "rising"},
        {"item": "b", "first": "1", "last": "1", "peak": "1", "n": "1", "trend": "stable"}]
    assert exploration_entropy([["labs"], ["stays"], ["allergies"], ["prescriptions"]], 4) == 1.0
    assert exploration_entropy([["labs"], ["labs"], []], 4) == 0.0
    h = -(2 / 3 * math.log2(2 / 3) + 1 / 3 * math.log2(1 / 3)) / 2
    assert exploration_entropy([["labs"], ["labs"], ["stays"]], 4) == pytest.approx(h)


def test_judge_contract_topk_and_averaging_on_hand_values():
    spec = ItemSpec("peak creatinine?", "2.3", "peak", {"item": "creatinine"}, "numeric")
    msgs = [[], [{"item": "glucose", "peak": "2.3"}], [{"item": "creatinine", "peak": "2.1"}],
            [{"item": "creatinine", "peak": "2.30"}]]
    v = check_contract(FactMatchJudge().judge(spec, msgs), len(msgs))
    assert v["context_quality"] == CORRECT                      # the latest statement wins
    assert v["supporting_message_indices"] == [3]
    assert v["contradicting_message_indices"] == [2]
    assert FactMatchJudge().judge(spec, msgs[:3])["context_quality"] == INCORRECT
    assert FactMatchJudge().judge(spec, msgs[:2])["context_quality"] == INSUFFICIENT
    assert [correct_at_k(v, k) for k in (3, 4)] == [False, True]
    # I_t: the last statement of each fact
    [summary] = summary_message(msgs)
    assert summary == [{"item": "glucose", "peak": "2.3"}, {"item": "creatinine", "peak": "2.30"}]
    with pytest.raises(ValueError, match="not message indices"):
        check_contract({**v, "supporting_message_indices": [9]}, len(msgs))
    with pytest.raises(ValueError, match="context_quality"):
        check_contract({**v, "context_quality": "MAYBE"}, len(msgs))
    # sample-averaged: per-entity shares (1/2, 1) -> 0.75; item-averaged: 2/3
    acc = accuracies([("a", CORRECT), ("a", INSUFFICIENT), ("b", CORRECT)])
    assert acc["acc_sample"] == 0.75 and acc["acc_item"] == pytest.approx(2 / 3)
    assert acc["insufficient"] == pytest.approx(1 / 3) and acc["incorrect"] == 0.0


def _accuracy(dbs, arm: str, budget: int) -> float:
    envs = [SQLiteEnv(p, e) for e, (p, _) in enumerate(dbs)]
    ids = [f"e{e}" for e in range(len(dbs))]
    agent = make_explorer(arm, seed=0, checklists={i: [it.aspect for it in items]
                                                   for i, (_, items) in zip(ids, dbs)})
    eps = run_episodes(envs, agent, Budget(max_steps=budget), FMT, episode_ids=ids)
    q = []
    for env, ep, (_, items) in zip(envs, eps, dbs):
        env.close()
        assert ep.ledger.invalid_actions == 0 and ep.ledger.parse_failures == 0
        q += [(ep.episode_id, FactMatchJudge().judge(_spec(it), env.insights)["context_quality"])
              for it in items]
    return accuracies(q)["acc_sample"]


def test_explorers_order_as_predicted_on_a_few_databases(dbs):
    assert len(breadth_plan(["a", "b", "c"])) == 20            # 19 calls + FINISH
    full = {arm: _accuracy(dbs, arm, 20) for arm in ("breadth", "depth", "reactive")}
    assert full == {"breadth": 1.0, "depth": 1.0, "reactive": 1.0}   # every plan covers all
    ten = {arm: _accuracy(dbs, arm, 10) for arm in ("breadth", "depth", "reactive")}
    assert ten["reactive"] == 1.0 and ten["breadth"] > ten["depth"]
    assert _accuracy(dbs, "breadth", 5) == 0.0                  # still reading the schema
