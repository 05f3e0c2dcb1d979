"""The rollout runner: ReAct episodes stepped together, one batched generation per step.

`run_episodes(envs, agent, budget, fmt)` plays one episode per environment. Up to `batch_size`
episodes are live at once; each round renders every live episode's prompt (`react.PromptFormat`)
and asks the agent for all their turns in one call, which for a model agent is one
`backend.complete(prompts)`, the project's LLM backend (`stages.models.backend`: the local
Hugging Face model or an OpenAI-compatible server at the `gpu` profile). A finished episode's
slot goes to the next pending one. Every turn is parsed (`react.parse_turn`), executed
(`Env.step`), and recorded as a `Step`.

Nothing an agent writes crashes a rollout: a reply that is not a valid call (`no_action`,
`bad_syntax`, `unknown_tool`, `bad_arguments`) or a call the environment refuses
(`InvalidAction`, a reason the environment names) becomes an error observation the agent sees
next turn, and is counted in the episode's ledger.

Budgets (a `Budget`, per episode) count what a model costs: model calls, generated tokens and,
when the agent can count them, prompt tokens. They are checked before each turn, so they hold
exactly: a call is made only when it fits, and its `max_new_tokens` is the smaller of the
per-call cap and what is left of the generated-token budget. The token counts are the
backend's: the local backend counts the reply's tokens plus the `<eos>` that ended it, and
counts one more than it generated when the cap ended it (its sign of a cut reply), so the
ledger charges `min(n_tokens, max_new_tokens)`, what the model really generated. Stopping
rules, in the order checked: `max_steps`, `max_calls`, `max_gen_tokens`, `max_prompt_tokens`,
`max_context` (the prompt plus the reply cap would not fit the model) before a turn, then
`done` (the environment ended it) and `max_failures` (that many failed turns in a row, DDR's
"3 failed nudges", arXiv 2602.02039) after it.

Greedy rollouts do not depend on how episodes are batched (a test compares batch sizes 1 and
4 turn by turn). Sampled ones draw one seed per round (`seed + round`), so they repeat for a
given seed and batch size. Scripted agents (experts, a random agent) run through the same loop
and cost no model call; their turns carry the prompt the model would have seen, which is what
imitation learning trains on (`stages.agents.imitation`).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field

from stages.agents.protocol import Env, InvalidAction, StepResult
from stages.agents.react import PromptFormat, parse_turn

STOP_REASONS = ("done", "max_steps", "max_calls", "max_gen_tokens", "max_prompt_tokens",
                "max_context", "max_failures")


class Budget(BaseModel):
    """What one episode may spend; checked before every turn."""

    model_config = ConfigDict(extra="forbid")

    max_steps: int = Field(20, ge=1, le=100_000, description="turns (DDR caps at 100)")
    max_calls: int | None = Field(None, ge=1, description="model calls (None: no limit "
                                  "beyond max_steps; one call per model turn)")
    max_new_tokens: int = Field(64, ge=1, le=65_536, description="cap of one reply, tokens")
    max_gen_tokens: int | None = Field(None, ge=1, description="generated tokens over the "
                                       "episode (None: no limit)")
    max_prompt_tokens: int | None = Field(None, ge=1, description="prompt tokens over the "
                                          "episode, summed over calls (needs an agent that "
                                          "counts tokens)")
    max_failures: int | None = Field(None, ge=1, description="stop after this many failed "
                                     "turns in a row (parse failure or invalid action)")


@dataclass
class Ledger:
    """What an episode spent and how many turns failed, by kind."""

    steps: int = 0
    calls: int = 0
    gen_tokens: int = 0
    prompt_tokens: int | None = None      # None: the agent cannot count them
    parse_failures: int = 0
    invalid_actions: int = 0
    failures_in_a_row: int = 0

    def stop_before(self, budget: Budget, agent: Agent, prompt_tokens: int | None,
                    cap: int) -> str | None:
        if self.steps >= budget.max_steps:
            return "max_steps"
        if not agent.uses_model:
            return None
        if budget.max_calls is not None and self.calls >= budget.max_calls:
            return "max_calls"
        if budget.max_gen_tokens is not None and self.gen_tokens >= budget.max_gen_tokens:
            return "max_gen_tokens"
        if budget.max_prompt_tokens is not None and prompt_tokens is not None:
            if (self.prompt_tokens or 0) + prompt_tokens > budget.max_prompt_tokens:
                return "max_prompt_tokens"
        if (agent.context is not None and prompt_tokens is not None
                and prompt_tokens + cap > agent.context):
            return "max_context"
        return None

    def cap(self, budget: Budget) -> int:
        if budget.max_gen_tokens is None:
            return budget.max_new_tokens
        return min(budget.max_new_tokens, budget.max_gen_tokens - self.gen_tokens)


@dataclass(frozen=True)
class Step:
    """One turn: what the agent saw and wrote, how it parsed, what the environment answered."""

    prompt: str
    text: str                  # the agent's raw reply
    turn: str                  # the part the parser kept (what later prompts show)
    thought: str
    tool: str                  # "" when the reply did not parse
    arguments: str             # JSON of the validated arguments, "" when it did not parse
    parse_error: str           # "" or one of protocol.PARSE_REASONS
    invalid_action: str        # "" or the environment's reason
    observation: str           # before the turn
    next_observation: str      # after it (an error message for a failed turn)
    reward: float
    done: bool
    model_call: bool
    max_new_tokens: int        # the cap of this call (0 for a scripted turn)
    gen_tokens: int
    prompt_tokens: int | None


@dataclass
class Episode:
    episode_id: str
    env: Env
    task: str
    first_observation: str
    observation: str
    steps: list[Step] = field(default_factory=list)
    ledger: Ledger = field(default_factory=Ledger)
    stop_reason: str | None = None
    total_reward: float = 0.0
    success: bool = False

    def history(self) -> list[tuple[str, str]]:
        return [(s.turn, s.next_observation) for s in self.steps]

    def prompt(self, fmt: PromptFormat) -> str:
        return fmt.render(self.task, self.first_observation, self.history(), self.env.tools)


@dataclass(frozen=True)
class Reply:
    text: str
    gen_tokens: int = 0


class Agent(Protocol):
    name: str
    uses_model: bool
    context: int | None        # prompt + reply tokens the model can attend to (None: unknown)

    def count_tokens(self, text: str) -> int | None: ...

    def act(self, episodes: Sequence[Episode], prompts: Sequence[str], caps: Sequence[int],
            fmt: PromptFormat, seed: int) -> list[Reply]: ...


class ModelAgent:
    """A model behind the LLM backend: one `complete` call per round for every live episode
    (one per distinct `max_new_tokens` when token budgets differ, as near their end).

    Over the local backend it counts prompt tokens with the model's tokenizer and knows the
    model's context (`max_position_embeddings`); an episode whose next prompt plus reply would
    not fit stops with `max_context` rather than letting the model run past the positions it
    was trained on. Over HTTP, pass `count_tokens` and `context` to get the same."""

    uses_model = True

    def __init__(self, backend: Any, *, name: str | None = None, temperature: float = 0.0,
                 count_tokens: Callable[[str], int] | None = None,
                 context: int | None = None) -> None:
        self.backend, self.temperature = backend, temperature
        self.name = name or backend.name
        tokenizer = getattr(backend, "tokenizer", None)     # the local backend has one
        if count_tokens is None and tokenizer is not None:
            def count_tokens(text: str) -> int:
                return len(tokenizer(text)["input_ids"])
        self._count = count_tokens
        model = getattr(backend, "model", None)
        self.context = context or getattr(getattr(model, "config", None),
                                          "max_position_embeddings", None)

    def count_tokens(self, text: str) -> int | None:
        return self._count(text) if self._count is not None else None

    def act(self, episodes: Sequence[Episode], prompts: Sequence[str], caps: Sequence[int],
            fmt: PromptFormat, seed: int) -> list[Reply]:
        replies: list[Reply | None] = [None] * len(prompts)
        for cap in sorted(set(caps), reverse=True):
            idx = [i for i, c in enumerate(caps) if c == cap]
            outs = self.backend.complete([prompts[i] for i in idx], max_new_tokens=cap,
                                         temperature=self.temperature, n=1, seed=seed)
            for i, out in zip(idx, outs, strict=True):
                replies[i] = Reply(out[0].text, min(int(out[0].n_tokens), cap))
        return [r for r in replies if r is not None]


class ScriptedAgent:
    """A policy written in code (an expert with privileged access to `episode.env`, a reference
    arm). `policy(episode)` returns (thought, call text), formatted as a ReAct turn; with
    `raw=True` it returns the whole reply text as a model would."""

    uses_model = False
    context = None

    def __init__(self, name: str, policy: Callable[[Episode], Any], *, raw: bool = False
                 ) -> None:
        self.name, self.policy, self.raw = name, policy, raw

    def count_tokens(self, text: str) -> int | None:
        return None

    def act(self, episodes: Sequence[Episode], prompts: Sequence[str], caps: Sequence[int],
            fmt: PromptFormat, seed: int) -> list[Reply]:
        out = []
        for ep in episodes:
            got = self.policy(ep)
            out.append(Reply(got if self.raw else fmt.turn(got[1], got[0])))
        return out


def random_agent(seed: int = 0) -> ScriptedAgent:
    """Uniform over `env.legal_actions()`; the draw depends on (seed, episode, step) only, so
    it does not depend on batching either."""

    def policy(ep: Episode) -> tuple[str, str]:
        rng = random.Random(f"{seed}/{ep.episode_id}/{len(ep.steps)}")
        return "", rng.choice(ep.env.legal_actions())

    return ScriptedAgent("random", policy)


def run_episodes(envs: Sequence[Env], agent: Agent, budget: Budget, fmt: PromptFormat, *,
                 batch_size: int = 32, episode_ids: Sequence[str] | None = None, seed: int = 0,
                 on_round: Callable[[int, int], None] | None = None) -> list[Episode]:
    """Play one episode per environment (each is reset here); returns them in input order.
    `on_round(round, finished)` is called after every round (progress bars, logging)."""
    if batch_size < 1:
        raise ValueError(f"batch_size = {batch_size}: must be >= 1")
    ids = list(episode_ids) if episode_ids is not None else [f"ep{i:05d}"
                                                             for i in range(len(envs))]
    if (budget.max_prompt_tokens is not None and agent.uses_model
            and agent.count_tokens("") is None):
        raise ValueError(f"budget.max_prompt_tokens = {budget.max_prompt_tokens} but agent "
                         f"{agent.name} cannot count prompt tokens (give ModelAgent a "
                         "count_tokens function)")
    if len(ids) != len(envs) or len(set(ids)) != len(ids):
        raise ValueError(f"episode_ids: expected {len(envs)} distinct ids, got {len(ids)} "
                         f"({len(set(ids))} distinct)")
    episodes: list[Episode] = []
    pending = deque(range(len(envs)))
    live: list[Episode] = []
    rnd = finished = 0
    while pending or live:
        while pending and len(live) < batch_size:
            i = pending.popleft()
            task, obs = envs[i].reset()
            ep = Episode(ids[i], envs[i], task, obs, obs)
            episodes.append(ep)
            live.append(ep)
        ready, prompts, caps = [], [], []
        for ep in live:
            prompt = ep.prompt(fmt)
            p_tokens = agent.count_tokens(prompt) if agent.uses_model else None
            cap = ep.ledger.cap(budget) if agent.uses_model else 0
            reason = ep.ledger.stop_before(budget, agent, p_tokens, cap)
            if reason is not None:
                ep.stop_reason = reason
                continue
            ready.append((ep, p_tokens))
            prompts.append(prompt)
            caps.append(cap)
        if ready:
            replies = agent.act([ep for ep, _ in ready], prompts, caps, fmt, seed + rnd)
            if len(replies) != len(ready):
                raise RuntimeError(f"agent {agent.name}: {len(replies)} replies for "
                                   f"{len(ready)} prompts")
            for (ep, p_tokens), prompt, cap, reply in zip(ready, prompts, caps, replies):
                _apply(ep, prompt, cap, p_tokens, reply, agent.uses_model, fmt, budget)
        still = [ep for ep in live if ep.stop_reason is None]
        finished += len(live) - len(still)
        live = still
        rnd += 1
        if on_round is not None:
            on_round(rnd, finished)
    for ep in episodes:
        ep.success = bool(ep.env.success())
    order = {eid: i for i, eid in enumerate(ids)}
    return sorted(episodes, key=lambda e: order[e.episode_id])


def _apply(ep: Episode, prompt: str, cap: int, p_tokens: int | None, reply: Reply,
           uses_model: bool, fmt: PromptFormat, budget: Budget) -> None:
    """Parse and execute one turn; record it and charge the ledger."""
    led = ep.ledger
    led.steps += 1
    if uses_model:
        led.calls += 1
        led.gen_tokens += reply.gen_tokens
        if p_tokens is not None:
            led.prompt_tokens = (led.prompt_tokens or 0) + p_tokens
    parsed = parse_turn(reply.text, ep.env.tools, fmt)
    invalid = ""
    if parsed.call is None:
        led.parse_failures += 1
        result = StepResult(f"Error ({parsed.error}): {parsed.message}")
    else:
        try:
            result = ep.env.step(parsed.call)
        except InvalidAction as err:
            invalid = err.reason
            led.invalid_actions += 1
            result = StepResult(f"Error ({err.reason}): {err.message}")
    failed = parsed.call is None or bool(invalid)
    led.failures_in_a_row = led.failures_in_a_row + 1 if failed else 0
    ep.steps.append(Step(
        prompt=prompt, text=reply.text, turn=parsed.kept, thought=parsed.thought,
        tool=parsed.call.name if parsed.call else "",
        arguments=parsed.call.args_json() if parsed.call else "",
        parse_error=parsed.error, invalid_action=invalid, observation=ep.observation,
        next_observation=result.observation, reward=float(result.reward), done=result.done,
        model_call=uses_model, max_new_tokens=cap, gen_tokens=reply.gen_tokens,
        prompt_tokens=p_tokens))
    ep.observation = result.observation
    ep.total_reward += float(result.reward)
    if result.done:
        ep.stop_reason = "done"
    elif budget.max_failures is not None and led.failures_in_a_row >= budget.max_failures:
        ep.stop_reason = "max_failures"
