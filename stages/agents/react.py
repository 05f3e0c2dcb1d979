"""The ReAct text format: how an episode becomes a prompt and a model's reply becomes a call.

ReAct (Yao et al., arXiv 2210.03629) interleaves a free-text thought, one action and the
environment's observation per turn; DDR (arXiv 2602.02039) runs its agents this way with
exactly one tool call per turn. A prompt here is plain text (the tiny models have no chat
template; a served instruct model gets the same text through `/v1/completions`):

    <instructions>                      optional, e.g. a served model's system prompt
    Tools: move[direction]: ...; take   optional (`show_tools`), one signature per tool
    Task: find the key in room 4
    (3 earlier steps)                   when older turns fall outside `window`
    Observation: room 2, nothing here
    Thought: the key is to the right    the agent's earlier turns, as the parser kept them
    Action: move[right]
    Observation: room 3, nothing here
                                        <- the model writes the next `Thought: ...` /
                                           `Action: ...` from here

`parse_turn` reads the first `Action:` of the reply; the call is the text after it up to the
end of that line (or an `Observation:`, `Thought:` or `Action:` marker, which a model that
keeps writing the environment's part produces), so a served model needs no stop sequences.
What the parser kept is what later prompts show: the history never carries a hallucinated
observation. The separator `sep` between lines is `\\n` by default; a tokenizer without a
newline (the project's character tokenizer keeps printable ASCII only) uses e.g. `" | "`.

The same `PromptFormat` renders the prompts of expert rollouts (stored with each step, the
imitation-learning inputs) and of the learned agent's rollouts, so training and acting see the
same text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field

from stages.agents.protocol import NO_ACTION, CallError, Tool, ToolCall, parse_call

_MARKERS = ("Observation:", "Thought:", "Action:")


class PromptFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sep: str = Field("\n", min_length=1, description="text between lines (a tokenizer "
                     "without a newline token needs e.g. ' | ')")
    window: int | None = Field(None, ge=0, description="earlier turns shown in full (None: "
                               "all); older ones become '(k earlier steps)'")
    max_obs_chars: int = Field(2000, ge=16, description="an observation longer than this is "
                               "cut (DDR query results can be long)")
    max_prompt_chars: int | None = Field(None, ge=64, description="drop the oldest turns until "
                                         "the prompt fits (a tiny model's context, in its "
                                         "character tokens); None: no limit")
    show_tools: bool = Field(False, description="list the tool signatures in the prompt (a "
                             "served model needs them; a model trained here learns them)")
    instructions: str = Field("", description="text opening every prompt (a system prompt)")

    def turn(self, call: str, thought: str = "") -> str:
        """A turn's text: `Thought: ...` (when given), then `Action: call`."""
        thought = " ".join(thought.split())
        return (f"Thought: {thought}{self.sep}" if thought else "") + f"Action: {call}"

    def observation(self, text: str) -> str:
        text = text.replace("\n", " ") if self.sep != "\n" else text
        if len(text) > self.max_obs_chars:
            text = text[:self.max_obs_chars - 15] + " ...(truncated)"
        return f"Observation: {text}"

    def render(self, task: str, first_observation: str, turns: Sequence[tuple[str, str]],
               tools: Sequence[Tool] = ()) -> str:
        """The prompt before the next turn; `turns` are (kept turn text, observation after it)
        pairs, oldest first."""
        head = []
        if self.instructions:
            head.append(self.instructions)
        if self.show_tools and tools:
            head.append("Tools: " + "; ".join(t.signature() for t in tools))
        head.append(f"Task: {task}")
        keep = len(turns) if self.window is None else min(self.window, len(turns))
        while True:
            prompt = self._join(head, first_observation, turns, keep)
            if self.max_prompt_chars is None or len(prompt) <= self.max_prompt_chars:
                return prompt
            if keep == 0:
                raise ValueError(
                    f"prompt of {len(prompt)} characters with no earlier turn exceeds "
                    f"max_prompt_chars = {self.max_prompt_chars}: the task and the current "
                    f"observation alone are too long (lower max_obs_chars = "
                    f"{self.max_obs_chars} or raise max_prompt_chars)")
            keep -= 1

    def _join(self, head: list[str], first: str, turns: Sequence[tuple[str, str]],
              keep: int) -> str:
        lines = list(head)
        hidden = len(turns) - keep
        if hidden == 0:
            lines.append(self.observation(first))
        else:
            lines.append(f"({hidden} earlier step{'s' if hidden > 1 else ''})")
            # the observation the first shown turn answered: the latest hidden one
            lines.append(self.observation(turns[hidden - 1][1]))
        for text, obs in turns[hidden:]:
            lines += [text, self.observation(obs)] if text else [self.observation(obs)]
        return self.sep.join(lines) + self.sep


@dataclass(frozen=True)
class ParsedTurn:
    """A reply read as one ReAct turn: `call` when it parsed, else `error` (a reason from
    protocol.PARSE_REASONS) and `message`; `kept` is the text later prompts show."""

    thought: str
    call_text: str
    kept: str
    call: ToolCall | None = None
    error: str = ""
    message: str = ""


def parse_turn(text: str, tools: Sequence[Tool], fmt: PromptFormat) -> ParsedTurn:
    """The first `Action:` of `text`, parsed against `tools` (never raises on model text)."""
    at = text.find("Action:")
    if at < 0:
        thought = _clean_thought(text)
        kept = f"Thought: {thought}" if thought else ""     # an empty reply shows no line
        return ParsedTurn(thought, "", kept, error=NO_ACTION,
                          message="no 'Action:' in the reply; end every turn with "
                                  "'Action: <tool call>'")
    thought = _clean_thought(text[:at])
    rest = text[at + len("Action:"):]
    cut = len(rest)
    for stop in ("\n", *_MARKERS):
        pos = rest.find(stop)
        if 0 <= pos < cut:
            cut = pos
    call_text = rest[:cut].strip()
    kept = fmt.turn(call_text, thought)
    try:
        return ParsedTurn(thought, call_text, kept, call=parse_call(call_text, tools))
    except CallError as err:
        return ParsedTurn(thought, call_text, kept, error=err.reason, message=str(err))


def _clean_thought(text: str) -> str:
    text = re.sub(r"^\s*Thought:", "", text.strip())
    return " ".join(text.split())
