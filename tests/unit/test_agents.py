"""The agent harness (stages/agents) end to end on a toy key-finding environment.

A corridor of rooms, the key in one of them, named in the task; tools `move[left|right]` and
`take[key]`. A scripted expert walks to the key and takes it. Its trajectories train a tiny
Llama by imitation (seconds), and the learned agent, run through the project's LLM backend,
must beat a random agent. Around that: call parsing with named failure reasons, malformed
replies counted rather than crashing, budgets held exactly, batching across episodes giving the
same greedy trajectories as one episode at a time, trajectories stored and read back only
through the checked loader, and the same agent served over the OpenAI-compatible HTTP backend.
"""

from __future__ import annotations

import os
import random
import string
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import polars as pl
import pytest
from pydantic import BaseModel, ConfigDict, Field

from stages.agents.imitation import ILConfig, check_examples, il_examples, train_il
from stages.agents.protocol import (BAD_ARGUMENTS, BAD_SYNTAX, NO_ACTION, UNKNOWN_TOOL,
                                    CallError, Env, InvalidAction, StepResult, Tool, ToolCall,
                                    parse_call)
from stages.agents.react import PromptFormat, parse_turn
from stages.agents.rollout import (Budget, ModelAgent, ScriptedAgent, random_agent,
                                   run_episodes)
from stages.agents.trajectories import (parse_failure_counts, read_rollouts, summarise,
                                        to_frames, write_rollouts)
from stages.core.checks import DataValidationError

# --- the toy environment -----------------------------------------------------------------------


class Move(BaseModel):
    model_config = ConfigDict(extra="forbid")
    direction: Literal["left", "right"]


class Take(BaseModel):
    model_config = ConfigDict(extra="forbid")
    item: Literal["key"]


class KeyRooms(Env):
    """Rooms 0..n-1 in a row; the agent starts in one, the key lies in another, and the task
    says on which side. The agent must read both the task (the side) and the observation (is
    the key here?): the room numbers alone do not say when to stop."""

    name = "keyrooms"
    tools = (Tool("move", "walk to the next room", Move), Tool("take", "pick up an item", Take))

    def __init__(self, seed: int, n_rooms: int = 6) -> None:
        rng = random.Random(seed)
        self.n = n_rooms
        self.start = rng.randrange(n_rooms)
        self.key = rng.choice([r for r in range(n_rooms) if r != self.start])

    def _look(self) -> str:
        return f"room {self.pos}: {'a key' if self.pos == self.key else 'empty'}"

    def reset(self) -> tuple[str, str]:
        self.pos, self.has_key = self.start, False
        side = "right" if self.key > self.start else "left"
        return f"take the key, it is to your {side}", self._look()

    def step(self, call: ToolCall) -> StepResult:
        if call.name == "take":
            if self.pos != self.key:
                raise InvalidAction("nothing_here", f"there is no key in room {self.pos}")
            self.has_key = True
            return StepResult("you hold the key", reward=1.0, done=True)
        target = self.pos + (1 if call.args["direction"] == "right" else -1)
        if not 0 <= target < self.n:
            raise InvalidAction("wall", f"no room to the {call.args['direction']} of "
                                f"room {self.pos}")
        self.pos = target
        return StepResult(self._look())

    def legal_actions(self) -> list[str]:
        return ["move[left]", "move[right]", "take[key]"]

    def success(self) -> bool:
        return self.has_key


def expert_policy(ep) -> tuple[str, str]:
    env = ep.env
    if env.pos == env.key:
        return "the key is here", "take[key]"
    side = "right" if env.key > env.pos else "left"
    return f"not here, go {side}", f"move[{side}]"


EXPERT = ScriptedAgent("expert", expert_policy)
FMT = PromptFormat(window=1)
CHARS = set(string.printable) - set("\t\r\x0b\x0c")       # printable ASCII and the newline


def envs(seeds) -> list[KeyRooms]:
    return [KeyRooms(s) for s in seeds]


def ids(seeds) -> list[str]:
    return [f"s{s}" for s in seeds]


def tiny_llama(max_positions: int = 256, chars: set[str] = CHARS) -> tuple[Any, Any]:
    import torch

    from stages.models import base
    from stages.models.tokenizer import build_tokenizer

    torch.manual_seed(0)
    tokenizer = build_tokenizer(chars)
    cfg = base.Config(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                      max_positions=max_positions)
    return base.build_model(cfg, tokenizer), tokenizer


class CountingBackend:
    """The real local backend, recording each `complete` call (prompts, cap)."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name
        self.model, self.tokenizer = inner.model, inner.tokenizer
        self.calls: list[tuple[int, int]] = []

    def complete(self, prompts, **kw):
        self.calls.append((len(prompts), kw["max_new_tokens"]))
        return self.inner.complete(prompts, **kw)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- protocol: calls and their named failures -------------------------------------------------


class Query(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str
    limit: int = Field(10, ge=1)


class Select(BaseModel):
    model_config = ConfigDict(extra="forbid")
    item: str
    size: str


QUERY = Tool("execute_query", "run a read-only SELECT", Query)
TOOLS = (*KeyRooms.tools, QUERY, Tool("buy", "buy the selected item"),
         Tool("select", "choose an item's size", Select))


def test_calls_parse_in_three_forms_and_render_canonically():
    assert parse_call("move[left]", TOOLS) == ToolCall("move", {"direction": "left"})
    assert parse_call(" buy ", TOOLS) == ToolCall("buy", {})
    # bracket form fills the only required field; the value runs to the LAST ']'
    assert parse_call("execute_query[SELECT a[1] FROM t]", TOOLS) == \
        ToolCall("execute_query", {"query": "SELECT a[1] FROM t", "limit": 10})
    assert parse_call('execute_query{"query": "SELECT 1", "limit": "5"}', TOOLS).args == \
        {"query": "SELECT 1", "limit": 5}                   # coerced by the schema
    assert QUERY.render({"query": "SELECT 1"}) == "execute_query[SELECT 1]"
    assert QUERY.render({"query": "SELECT 1", "limit": 5}) == \
        'execute_query{"query": "SELECT 1", "limit": 5}'
    assert QUERY.render({"query": " padded"}) == 'execute_query{"query": " padded", "limit": 10}'
    for tool, args in ((TOOLS[0], {"direction": "right"}), (QUERY, {"query": "x", "limit": 2}),
                       (QUERY, {"query": " padded"}), (TOOLS[3], {}),
                       (TOOLS[4], {"item": "red shirt", "size": "M"})):
        assert parse_call(tool.render(args), TOOLS).args == tool.validate(args)
    assert TOOLS[0].signature() == "move[direction]: walk to the next room"
    assert QUERY.signature().startswith('execute_query{"query": str, "limit": int (optional)}')


@pytest.mark.parametrize("text, reason, words", [
    ("", NO_ACTION, "empty"),
    ("fly[up]", UNKNOWN_TOOL, "no tool 'fly'"),
    ("move[up]", BAD_ARGUMENTS, "direction"),
    ("move", BAD_ARGUMENTS, "direction: Field required"),
    ('move{"direction": "left", "speed": 2}', BAD_ARGUMENTS, "speed"),
    ("buy[now]", BAD_ARGUMENTS, "takes no arguments"),
    ("select[red shirt]", BAD_ARGUMENTS, "several required arguments"),
    ('select{"item": "red shirt"}', BAD_ARGUMENTS, "size: Field required"),
    ("move[left", BAD_SYNTAX, "closing"),
    ('execute_query{"query": }', BAD_SYNTAX, "not valid JSON"),
    ('execute_query["a", 1]', BAD_ARGUMENTS, "limit"),     # a bracket value is one string...
    ("move left", BAD_SYNTAX, "unexpected text"),
    ("[left]", BAD_SYNTAX, "starts with a tool name"),
])
def test_bad_calls_fail_with_a_named_reason(text, reason, words):
    if text == 'execute_query["a", 1]':                       # ...so this one parses
        assert parse_call(text, TOOLS).args["query"] == '"a", 1'
        with pytest.raises(CallError) as err:
            parse_call('execute_query{"query": "a", "limit": 0}', TOOLS)
    else:
        with pytest.raises(CallError) as err:
            parse_call(text, TOOLS)
    assert err.value.reason == reason and words in str(err.value)


def test_tools_and_refusals_are_declared_strictly():
    class Loose(BaseModel):
        x: int

    with pytest.raises(ValueError, match="extra='forbid'"):
        Tool("loose", "ignores unknown arguments", Loose)
    with pytest.raises(ValueError, match="identifier"):
        Tool("two words", "bad name")
    with pytest.raises(ValueError, match="metric name"):
        InvalidAction("not a name", "x")


# --- the ReAct format --------------------------------------------------------------------------


def test_parse_turn_reads_the_first_action_and_drops_what_follows():
    got = parse_turn("Thought: the key is\n  to the right\nAction: move[right]\n"
                     "Observation: room 9: a key\nAction: take[key]", TOOLS, FMT)
    assert got.call == ToolCall("move", {"direction": "right"})
    assert got.thought == "the key is to the right"
    assert got.kept == "Thought: the key is to the right\nAction: move[right]"
    # no newline in the vocabulary: the call stops at the next marker on the same line
    bar = PromptFormat(sep=" | ")
    got = parse_turn("Action: take[key] | Observation: you hold the key", TOOLS, bar)
    assert got.call_text == "take[key] |" and got.error == BAD_SYNTAX
    got = parse_turn("Action: take[key] Observation: done", TOOLS, bar)
    assert got.call == ToolCall("take", {"item": "key"}) and got.kept == "Action: take[key]"
    got = parse_turn("I would go left", TOOLS, FMT)
    assert got.error == NO_ACTION and got.call is None and got.thought == "I would go left"
    assert got.kept == "Thought: I would go left"
    assert parse_turn("\n \n", TOOLS, FMT).kept == ""               # shows no line at all
    assert FMT.render("t", "room 0", [("", "Error (no_action): ...")]) == \
        "Task: t\nObservation: room 0\nObservation: Error (no_action): ...\n"


def test_prompt_shows_a_window_of_turns_and_fits_its_limit():
    turns = [("Action: move[right]", f"room {i}: empty") for i in range(1, 5)]
    full = PromptFormat().render("take the key in room 5", "room 0: empty", turns)
    assert full.startswith("Task: take the key in room 5\nObservation: room 0: empty\n")
    assert full.endswith("Action: move[right]\nObservation: room 4: empty\n")
    assert full.count("Action:") == 4
    one = PromptFormat(window=1).render("t", "room 0: empty", turns)
    assert one == ("Task: t\n(3 earlier steps)\nObservation: room 3: empty\n"
                   "Action: move[right]\nObservation: room 4: empty\n")
    fits = PromptFormat(max_prompt_chars=100).render("t", "room 0: empty", turns)
    assert len(fits) <= 100 and "earlier steps)" in fits and fits.endswith("room 4: empty\n")
    with pytest.raises(ValueError, match="max_prompt_chars = 64"):
        PromptFormat(max_prompt_chars=64).render("t" * 80, "room 0", turns)
    tools = PromptFormat(show_tools=True, instructions="You find keys.", sep=" | ").render(
        "t", "a\nb", [], KeyRooms.tools)
    assert tools == ("You find keys. | Tools: move[direction]: walk to the next room; "
                     "take[item]: pick up an item | Task: t | Observation: a b | ")


# --- rollouts: failures counted, budgets exact ------------------------------------------------


def test_malformed_replies_and_refused_actions_are_counted_not_crashes():
    script = ["hello", "Action: fly[up]", "Action: move[up]", "Action: move[left",
              "Action: take[key]", "Action: move[left]"]          # seed 1: start 1, key 5

    def garbage(ep):
        return script[len(ep.steps)]

    env = KeyRooms(1)
    assert (env.start, env.key) == (1, 5)
    [ep] = run_episodes([env], ScriptedAgent("garbage", garbage, raw=True),
                        Budget(max_steps=6), FMT)
    assert [s.parse_error for s in ep.steps] == [NO_ACTION, UNKNOWN_TOOL, BAD_ARGUMENTS,
                                                 BAD_SYNTAX, "", ""]
    assert [s.invalid_action for s in ep.steps] == ["", "", "", "", "nothing_here", ""]
    assert ep.ledger.parse_failures == 4 and ep.ledger.invalid_actions == 1
    assert ep.stop_reason == "max_steps" and not ep.success
    assert ep.steps[4].next_observation == "Error (nothing_here): there is no key in room 1"
    assert ep.steps[5].next_observation == "room 0: empty"    # recovered: a valid move
    # the agent sees its error next turn, and the prompt shows only what the parser kept
    assert "Observation: Error (unknown_tool): no tool 'fly'" in ep.steps[2].prompt
    episodes, steps = to_frames([ep], "garbage")
    assert parse_failure_counts(steps) == {"parse_no_action": 1.0, "parse_bad_syntax": 1.0,
                                           "parse_unknown_tool": 1.0,
                                           "parse_bad_arguments": 1.0}
    assert summarise(episodes)["parse_failure_rate"] == pytest.approx(4 / 6)
    # stopping rule: three failed turns in a row end the episode
    [ep] = run_episodes([KeyRooms(1)], ScriptedAgent("garbage", garbage, raw=True),
                        Budget(max_steps=6, max_failures=3), FMT)
    assert ep.stop_reason == "max_failures" and len(ep.steps) == 3


@pytest.fixture(scope="module")
def untrained(tmp_path_factory) -> Path:
    model, tokenizer = tiny_llama(max_positions=1024)
    folder = tmp_path_factory.mktemp("agents") / "untrained"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_budgets_hold_exactly(untrained):
    from stages.models.backend import LocalHFBackend

    backend = CountingBackend(LocalHFBackend(untrained))
    agent = ModelAgent(backend)
    seeds = range(3)
    # calls: exactly max_calls turns, one batched call per round for all three episodes
    eps = run_episodes(envs(seeds), agent, Budget(max_steps=10, max_calls=3, max_new_tokens=4),
                       FMT, episode_ids=ids(seeds))
    assert [(e.stop_reason, e.ledger.calls, len(e.steps)) for e in eps] == \
        [("max_calls", 3, 3)] * 3
    assert backend.calls == [(3, 4)] * 3
    assert all(s.parse_error for e in eps for s in e.steps)   # untrained: garbage, no crash
    # generated tokens: each call capped by what is left; the run stops when none is
    backend.calls.clear()
    eps = run_episodes(envs(seeds), agent,
                       Budget(max_steps=10, max_new_tokens=5, max_gen_tokens=12), FMT)
    for e in eps:
        used = 0
        for s in e.steps:
            assert s.max_new_tokens == min(5, 12 - used) and 1 <= s.gen_tokens <= s.max_new_tokens
            used += s.gen_tokens
        assert used == e.ledger.gen_tokens <= 12
        assert e.stop_reason == "max_gen_tokens" and used == 12   # the cap cut every reply
    assert backend.calls == [(3, 5), (3, 5), (3, 2)]
    # prompt tokens: a call is made only if its prompt still fits
    first = agent.count_tokens(eps[0].steps[0].prompt)
    assert first == len(eps[0].steps[0].prompt) + 1                 # characters + <bos>
    [e] = run_episodes(envs([0]), agent, Budget(max_steps=10, max_prompt_tokens=2 * first),
                       FMT)
    assert e.stop_reason == "max_prompt_tokens" and e.ledger.calls == 1
    assert e.ledger.prompt_tokens == first
    [e] = run_episodes(envs([0]), agent, Budget(max_prompt_tokens=first - 1), FMT)
    assert e.stop_reason == "max_prompt_tokens" and e.steps == []   # nothing fit
    # sampled replies repeat for a seed (and batch size)
    sampled = [run_episodes(envs(seeds), ModelAgent(backend.inner, temperature=1.0),
                            Budget(max_steps=2, max_new_tokens=6), FMT, seed=3)
               for _ in range(2)]
    assert to_frames(sampled[0], "s")[1].equals(to_frames(sampled[1], "s")[1])
    assert to_frames(sampled[0], "s")[1]["text"].n_unique() > 1
    # context: a call is made only if the prompt plus the reply cap fit the model
    assert agent.context == 1024                                  # from the model's config
    short = ModelAgent(backend.inner, context=200)
    eps = run_episodes(envs(seeds), short, Budget(max_steps=10, max_new_tokens=8),
                       PromptFormat(window=None), episode_ids=ids(seeds))
    for e in eps:
        assert e.stop_reason == "max_context" and 1 <= len(e.steps) < 10
        assert all(s.prompt_tokens + s.max_new_tokens <= 200 for s in e.steps)
        assert short.count_tokens(e.prompt(PromptFormat(window=None))) + 8 > 200
    # scripted agents cost no call; only max_steps binds them
    [e] = run_episodes(envs([0]), random_agent(), Budget(max_steps=2, max_calls=1), FMT)
    assert e.ledger.calls == 0 and len(e.steps) == 2 and e.stop_reason == "max_steps"
    with pytest.raises(ValueError, match="count_tokens"):
        run_episodes(envs([0]), _NoCount(backend.inner), Budget(max_prompt_tokens=100), FMT)


class _NoCount(ModelAgent):
    """A model agent that cannot count tokens (as over an HTTP backend without a tokenizer)."""

    def count_tokens(self, text: str) -> None:
        return None


# --- trajectories on disk ------------------------------------------------------------------


def test_trajectories_round_trip_through_the_checked_loader(tmp_path, untrained):
    from stages.models.backend import LocalHFBackend

    seeds = range(4)
    eps = run_episodes(envs(seeds), EXPERT, Budget(max_steps=8), FMT, episode_ids=ids(seeds))
    ep_df, step_df = to_frames(eps, "expert")
    write_rollouts(tmp_path / "expert", ep_df, step_df)
    back_eps, back_steps = read_rollouts(tmp_path / "expert")
    assert back_eps.equals(ep_df) and back_steps.equals(step_df)
    assert back_eps["success"].all() and back_eps["prompt_tokens"].null_count() == 4
    # an episode that ended before its first turn is stored and read back too
    [empty] = run_episodes(envs([0]), ModelAgent(LocalHFBackend(untrained)),
                           Budget(max_prompt_tokens=5), FMT, episode_ids=["none"])
    e2, s2 = to_frames([empty], "model")
    write_rollouts(tmp_path / "empty", e2, s2)
    assert read_rollouts(tmp_path / "empty")[1].height == 0

    def broken(ep_edit=None, step_edit=None) -> Path:
        folder = tmp_path / "broken"
        folder.mkdir(exist_ok=True)
        (ep_edit or (lambda d: d))(ep_df).write_parquet(folder / "episodes.parquet")
        (step_edit or (lambda d: d))(step_df).write_parquet(folder / "steps.parquet")
        return folder

    cases = [
        (dict(step_edit=lambda d: d.filter(pl.col("step") != 1)), "step", "steps 0..n-1"),
        (dict(step_edit=lambda d: d.with_columns(parse_error=pl.lit("typo"))), "parse_error",
         "value set"),
        (dict(ep_edit=lambda d: d.with_columns(gen_tokens=pl.lit(7, pl.Int64))), "gen_tokens",
         "sum over steps"),
        (dict(ep_edit=lambda d: d.with_columns(stop_reason=pl.lit("max_steps"))), "done",
         "done ends the episode"),
        (dict(ep_edit=lambda d: d.with_columns(stop_reason=pl.lit("tired"))), "stop_reason",
         "value set"),
        (dict(step_edit=lambda d: d.drop("turn")), "turn", "column exists"),
        (dict(step_edit=lambda d: d.with_columns(episode_id=pl.lit("ghost"))), "episode_id",
         "step of a listed episode"),
        (dict(ep_edit=lambda d: d.vstack(d.head(1))), "episode_id", "unique"),
    ]
    for edit, column, rule in cases:
        with pytest.raises(DataValidationError) as err:
            read_rollouts(broken(**edit))
        assert (err.value.column, err.value.rule) == (column, rule), str(err.value)
    # the writer refuses the same defects before anything reaches the disk
    with pytest.raises(DataValidationError, match="sum over steps"):
        write_rollouts(tmp_path / "never", ep_df.with_columns(calls=pl.lit(1, pl.Int64)),
                       step_df)
    assert not (tmp_path / "never").exists()


# --- imitation learning: the learned agent beats a random one -------------------------------

TRAIN_SEEDS, TEST_SEEDS = range(100, 160), range(1000, 1040)
EVAL_BUDGET = Budget(max_steps=8, max_new_tokens=64)


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> dict[str, Any]:
    """Expert rollouts -> parquet -> checked read -> IL of a tiny Llama -> saved model folder."""
    root = tmp_path_factory.mktemp("il")
    eps = run_episodes(envs(TRAIN_SEEDS), EXPERT, Budget(max_steps=8), FMT,
                       episode_ids=ids(TRAIN_SEEDS))
    write_rollouts(root / "expert", *to_frames(eps, "expert"))
    episodes, steps = read_rollouts(root / "expert")
    model, tokenizer = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = train_il(model, tokenizer, episodes, steps,
                       ILConfig(steps=150, batch_size=16, lr=1e-2, log_every=50), seed=0)
    changed = sum(not before[k].equal(v) for k, v in model.state_dict().items())
    model.save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")
    return {"folder": root / "policy", "metrics": metrics, "changed": changed,
            "n_params": len(before), "expert": summarise(episodes)}


def test_learned_agent_beats_a_random_agent(policy):
    from stages.models.backend import LocalHFBackend

    assert policy["expert"]["success_rate"] == 1.0
    assert policy["changed"] == policy["n_params"]              # every tensor trained
    assert policy["metrics"]["il_examples"] > 150 and policy["metrics"]["train_loss"] < 0.1
    learned = run_episodes(envs(TEST_SEEDS), ModelAgent(LocalHFBackend(policy["folder"])),
                           EVAL_BUDGET, FMT, episode_ids=ids(TEST_SEEDS))
    rand = run_episodes(envs(TEST_SEEDS), random_agent(seed=0), EVAL_BUDGET, FMT,
                        episode_ids=ids(TEST_SEEDS))
    got, base = (summarise(to_frames(e, n)[0]) for e, n in ((learned, "il"), (rand, "random")))
    print(f"IL agent {got}\nrandom {base}")
    assert got["success_rate"] >= 0.9 and base["success_rate"] <= 0.5
    assert got["success_rate"] - base["success_rate"] >= 0.4
    assert got["mean_steps"] < base["mean_steps"]


def test_batching_across_episodes_gives_the_same_greedy_trajectories(policy):
    from stages.models.backend import LocalHFBackend

    backend = CountingBackend(LocalHFBackend(policy["folder"]))
    agent = ModelAgent(backend)
    seeds = TEST_SEEDS[:10]
    alone = run_episodes(envs(seeds), agent, EVAL_BUDGET, FMT, batch_size=1,
                         episode_ids=ids(seeds))
    calls_alone = len(backend.calls)
    backend.calls.clear()
    together = run_episodes(envs(seeds), agent, EVAL_BUDGET, FMT, batch_size=4,
                            episode_ids=ids(seeds))
    assert to_frames(alone, "il")[1].equals(to_frames(together, "il")[1])
    assert [e.stop_reason for e in alone] == [e.stop_reason for e in together]
    # one backend call per round, several episodes in it, fewer calls in all
    assert max(n for n, _ in backend.calls) == 4 and len(backend.calls) < calls_alone
    assert sum(n for n, _ in backend.calls) == sum(e.ledger.calls for e in together)


def test_il_refuses_examples_it_would_silently_corrupt(policy):
    _, tokenizer = tiny_llama()
    prompts, targets = ["Task: t\nObservation: room 1\n"], ["Action: take[key]"]
    assert check_examples(tokenizer, prompts, targets, 64) == len(prompts[0] + targets[0]) + 2
    with pytest.raises(ValueError, match="over the model's context of 32"):
        check_examples(tokenizer, prompts, targets, 32)
    _, no_newline = tiny_llama(chars=CHARS - {"\n"})            # the project's char vocabulary
    with pytest.raises(ValueError, match=r"characters \['\\n'\] are not in the tokenizer"):
        check_examples(no_newline, prompts, targets, 64)
    with pytest.raises(ValueError, match="no example"):
        check_examples(tokenizer, [], [], 64)
    # counted as training encodes it, prompt and reply apart: subwords learnt on the glued
    # text spell ` Action` as one piece glued, but ` ` + `A ct ion` apart (more tokens)
    from stages.models import subword
    from stages.models.base import encode_sft_rows

    bpe = subword.train_bpe([" Action: take[key]"] * 3, string.printable[:95], 200)
    p, t = ["room 1 "], ["Action: take[key]"]
    glued = len(bpe(p[0] + t[0], add_special_tokens=False)["input_ids"]) + 2
    apart = len(encode_sft_rows(bpe, p, t, 1 << 30)[0]["input_ids"])
    assert apart > glued and check_examples(bpe, p, t, apart) == apart
    with pytest.raises(ValueError, match=f"is {apart} tokens, over the model's context of "
                                         f"{glued}"):
        check_examples(bpe, p, t, glued)
    # only successful episodes and accepted turns are imitated
    episodes = pl.DataFrame({"episode_id": ["a", "b"], "success": [True, False]})
    steps = pl.DataFrame({"episode_id": ["a", "a", "b"], "step": [1, 0, 0],
                          "prompt": ["p1", "p0", "q"], "turn": ["t1", "t0", "u"],
                          "parse_error": ["", "", ""], "invalid_action": ["wall", "", ""]})
    assert il_examples(episodes, steps) == (["p0"], ["t0"])
    assert il_examples(episodes, steps, only_success=False, skip_failed_turns=False) == \
        (["p0", "p1", "q"], ["t0", "t1", "u"])


# --- the served agent: the gpu profile's path, tested against the local server ---------------


def test_served_agent_plays_the_same_episodes_as_the_local_one(policy):
    from stages.models.backend import BackendConfig, LocalHFBackend, make_backend

    proc = subprocess.Popen([sys.executable, "-m", "stages.models.serve", "--model",
                             str(policy["folder"]), "--name", "policy", "--port", "0"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving policy on http://127.0.0.1:"), \
            line + (proc.stderr.read()[-2000:] if proc.poll() is not None else "")
        url = line.split(" on ")[1].strip()
        served = ModelAgent(make_backend(BackendConfig(kind="openai", model="policy",
                                                       base_url=url)))
        seeds = TEST_SEEDS[:6]
        remote = run_episodes(envs(seeds), served, EVAL_BUDGET, FMT, batch_size=3,
                              episode_ids=ids(seeds))
    finally:
        os.kill(proc.pid, 15)
        proc.wait(timeout=30)
    local = run_episodes(envs(seeds), ModelAgent(LocalHFBackend(policy["folder"])),
                         EVAL_BUDGET, FMT, batch_size=3, episode_ids=ids(seeds))
    cols = ["episode_id", "step", "text", "tool", "arguments", "next_observation",
            "gen_tokens"]
    assert to_frames(remote, "served")[1].select(cols).equals(
        to_frames(local, "local")[1].select(cols))
    assert all(e.ledger.prompt_tokens is None for e in remote)   # no tokenizer over HTTP
    assert all(e.ledger.prompt_tokens for e in local)
