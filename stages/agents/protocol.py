"""The environment/tool protocol every agent paper plugs into: tools, calls, environments.

An environment shows the agent text (a task and observations) and accepts text actions. An
action names one of the environment's tools and gives its arguments; each tool declares its
arguments as a pydantic model, so a call is validated (types, required fields, no extra keys)
before the environment sees it. Three written forms of a call, one per shape of tool:

    buy                                       no arguments
    click[item 12]                            one required argument (WebShop's bracket form,
    execute_query[SELECT count(*) FROM labs]  arXiv 2510.08558 / DDR arXiv 2602.02039): the text
                                              between the first '[' and the last ']' is its value
    execute_query{"query": "SELECT 1", "limit": 5}    any tool: a JSON object of arguments

`parse_call(text, tools)` turns call text into a `ToolCall` or raises `CallError` whose `reason`
is one of `PARSE_REASONS` (counted per reason by the rollout runner, never a crash). An
environment refuses a well-formed call that makes no sense in its state (a move into a wall, a
write through a read-only SQL tool) by raising `InvalidAction(reason, message)` with a reason
it names; the runner counts it and shows the message as the observation, so the agent can
recover. Any other exception from an environment is a bug and propagates.

    class Move(BaseModel):
        direction: Literal["left", "right"]

    tools = (Tool("move", "walk to the next room", Move), Tool("take", "pick up the key"))
    parse_call("move[left]", tools)            # ToolCall(name='move', args={'direction': 'left'})
    tools[0].render({"direction": "left"})     # 'move[left]' (the canonical text experts emit)

Environments subclass `Env`: `reset() -> (task, first observation)`, `step(call) -> StepResult`,
optionally `legal_actions()` (call texts a random agent and Early Experience's alternative
actions draw from) and `success()`. An environment must be deep-copyable when a pipeline
branches from a state (one-step alternatives, arXiv 2510.08558 section 2).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

from pydantic import BaseModel, ConfigDict, ValidationError

# Why a model's text was not a usable call; the runner counts each.
NO_ACTION = "no_action"          # no `Action:` line, or an empty one
BAD_SYNTAX = "bad_syntax"        # unbalanced brackets, invalid JSON, text after the call
UNKNOWN_TOOL = "unknown_tool"    # a name the environment has no tool for
BAD_ARGUMENTS = "bad_arguments"  # the tool's argument schema rejects the arguments
PARSE_REASONS = (NO_ACTION, BAD_SYNTAX, UNKNOWN_TOOL, BAD_ARGUMENTS)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class NoArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CallError(ValueError):
    """Call text that is not a valid tool call; `reason` is one of PARSE_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in PARSE_REASONS, reason
        super().__init__(message)
        self.reason = reason


class InvalidAction(Exception):
    """Raised by `Env.step` for a valid call the environment refuses in its current state;
    `reason` is a short name the environment chooses (counted), `message` what the agent sees."""

    def __init__(self, reason: str, message: str) -> None:
        if not _NAME.fullmatch(reason):
            raise ValueError(f"InvalidAction reason {reason!r}: use a short identifier "
                             "(letters, digits, underscores), it becomes a metric name")
        super().__init__(message)
        self.reason, self.message = reason, message


@dataclass(frozen=True)
class Tool:
    """A tool: its name, one line the agent may be shown, and its argument schema."""

    name: str
    description: str
    args: type[BaseModel] = NoArgs

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"tool name {self.name!r}: expected an identifier")
        if self.args.model_config.get("extra") != "forbid":
            raise ValueError(f"tool {self.name}: its argument model {self.args.__name__} must "
                             "set model_config = ConfigDict(extra='forbid') (an unknown "
                             "argument is a mistake to count, not to ignore)")

    @property
    def bracket_field(self) -> str | None:
        """The field a bracket call fills: the only required field (others take defaults)."""
        required = [n for n, f in self.args.model_fields.items() if f.is_required()]
        if len(required) == 1:
            return required[0]
        if not required and len(self.args.model_fields) == 1:
            return next(iter(self.args.model_fields))
        return None

    def signature(self) -> str:
        """One line for a prompt: `name[field]: description` or `name{"a": int, ...}`."""
        fields = self.args.model_fields
        if not fields:
            return f"{self.name}: {self.description}"
        if self.bracket_field and len(fields) == 1:
            return f"{self.name}[{self.bracket_field}]: {self.description}"
        parts = ", ".join(f'"{n}": {getattr(f.annotation, "__name__", f.annotation)}'
                          + ("" if f.is_required() else " (optional)")
                          for n, f in fields.items())
        return f"{self.name}{{{parts}}}: {self.description}"

    def validate(self, args: dict[str, Any]) -> dict[str, Any]:
        """Arguments checked and coerced by the schema, or CallError(bad_arguments)."""
        try:
            return self.args.model_validate(args).model_dump()
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}"
                                 for e in err.errors())
            raise CallError(BAD_ARGUMENTS, f"{self.name}: {problems}") from None

    def render(self, args: dict[str, Any] | None = None) -> str:
        """The canonical call text (what a scripted expert emits): bare name, bracket form when
        only the bracket field differs from its default, else JSON."""
        args = self.validate(dict(args or {}))
        if not self.args.model_fields:
            return self.name
        defaults = {n: f.get_default(call_default_factory=True)
                    for n, f in self.args.model_fields.items() if not f.is_required()}
        changed = {n for n, v in args.items() if n not in defaults or defaults[n] != v}
        key = self.bracket_field
        if key and changed <= {key}:
            value = str(args[key])
            if "\n" not in value and value == value.strip():   # parses back to itself
                return f"{self.name}[{value}]"
        return f"{self.name}{json.dumps(args, ensure_ascii=False)}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: dict[str, Any] = field(default_factory=dict)

    def args_json(self) -> str:
        return json.dumps(self.args, sort_keys=True, ensure_ascii=False)


def parse_call(text: str, tools: Sequence[Tool]) -> ToolCall:
    """`name`, `name[value]` or `name{json}` -> a validated ToolCall; CallError otherwise."""
    text = text.strip()
    if not text:
        raise CallError(NO_ACTION, "empty action")
    by_name = {t.name: t for t in tools}
    head = re.match(r"[A-Za-z_][A-Za-z0-9_]*", text)
    if head is None:
        raise CallError(BAD_SYNTAX, f"{_short(text)!r}: an action starts with a tool name")
    name, rest = head.group(0), text[head.end():].lstrip()
    if name not in by_name:
        raise CallError(UNKNOWN_TOOL, f"no tool {name!r}; tools: {', '.join(by_name)}")
    tool = by_name[name]
    if not rest:
        args: dict[str, Any] = {}
    elif rest[0] == "[":
        if not rest.endswith("]"):
            raise CallError(BAD_SYNTAX, f"{name}: '[' without a closing ']' at the end")
        key = tool.bracket_field
        if key is None and not tool.args.model_fields:
            raise CallError(BAD_ARGUMENTS, f"{name} takes no arguments; write just {name}")
        if key is None:
            raise CallError(BAD_ARGUMENTS, f"{name} takes several required arguments; write "
                            f'{name}{{"name": value, ...}}')
        args = {key: rest[1:-1].strip()}
    elif rest[0] == "{":
        try:
            args = json.loads(rest)
        except json.JSONDecodeError as err:
            raise CallError(BAD_SYNTAX, f"{name}: arguments are not valid JSON ({err.msg})") \
                from None
        if not isinstance(args, dict):
            raise CallError(BAD_SYNTAX, f"{name}: arguments must be a JSON object")
    else:
        raise CallError(BAD_SYNTAX, f"{name}: unexpected text after the tool name: "
                        f"{_short(rest)!r}")
    return ToolCall(name, tool.validate(args))


def _short(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[:n] + "..."


@dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float = 0.0
    done: bool = False


class Env:
    """Base class of a text environment. Subclasses set `name` and `tools` and implement
    `reset` and `step`; `step` receives only calls `parse_call` validated against `tools`."""

    name: ClassVar[str] = "env"
    tools: tuple[Tool, ...] = ()

    def reset(self) -> tuple[str, str]:
        """Start the episode: (task text, first observation)."""
        raise NotImplementedError

    def step(self, call: ToolCall) -> StepResult:
        """Apply a validated call; raise InvalidAction to refuse it (state unchanged)."""
        raise NotImplementedError

    def legal_actions(self) -> list[str]:
        """Call texts that parse in the current state (a random agent draws from these)."""
        raise NotImplementedError(f"{type(self).__name__} does not list its legal actions")

    def success(self) -> bool:
        """Whether the episode reached its goal (False for environments without one)."""
        return False
