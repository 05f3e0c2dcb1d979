"""BabyAI behind a text wrapper: the second Early Experience environment (issue 20).

BabyAI (Chevalier-Boisvert et al., "BabyAI: A Platform to Study the Sample Efficiency of
Grounded Language Learning", arXiv 1810.08272) as PyPI's `minigrid` ships it: a grid world,
a mission in words ("go to the red ball") and a partial, egocentric 7x7 view. The level here is
`BabyAI-GoToLocalS8N3-v0` [ours]: one 8x8 room, 3 objects (balls, boxes and keys of 6
colours), one of them the target. Success is minigrid's own verifier: the agent faces the
target, next to it.

The agent reads text, never the grid. `describe(view)` turns the egocentric view into one line,
objects nearest first, each with its offset from the agent (cells ahead, cells to the left or
right), and the distance to the wall or door straight ahead:

    grey key 2 ahead 1 left; red box 1 ahead 2 right; wall 3 ahead

Tools (no arguments): `left`, `right`, `forward`, `pickup`, `drop`, `toggle`, minigrid's
actions 0-5 (its `done`, 6, is not a tool: no BabyAI level needs it). Every tool is always
legal (forward into a wall is a no-op, as in minigrid), so `legal_actions()` is all six.

The expert is minigrid's own `BabyAIBot` (privileged: it reads the grid and plans with
subgoals), built at `reset` and asked once per step (`expert_action`), the demonstrator the
issue names. Its success is the ceiling, a uniform draw over the six tools the floor.

Splits [ours], by what the mission names, mirroring the mini-WebShop's unseen categories:
`train` and `test` missions name a ball or a box (disjoint level seeds), `ood` missions a key.
A key does appear in train observations (as a distractor), never as a goal.
"""

from __future__ import annotations

import contextlib
import io as _io
from dataclasses import dataclass, field
from typing import Any

from stages.agents.protocol import Env, StepResult, Tool, ToolCall

LEVEL = "BabyAI-GoToLocalS8N3-v0"
ACTIONS = ("left", "right", "forward", "pickup", "drop", "toggle")   # minigrid actions 0-5
TOOLS = tuple(Tool(a, d) for a, d in (
    ("left", "turn left"), ("right", "turn right"), ("forward", "move one cell ahead"),
    ("pickup", "pick up the object ahead"), ("drop", "drop what you carry ahead"),
    ("toggle", "open or close the door ahead")))
IN_DOMAIN = ("ball", "box")            # target types of train and test missions
OOD = ("key",)                         # target type of the OOD missions only
SPLITS = ("train", "test", "ood")
VIEW_AGENT = (3, 6)                    # the agent's cell in minigrid's 7x7 egocentric view


def _quiet(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """minigrid's level generator prints each rejected sample ("Sampling rejected: ..."); keep
    stage logs to what matters."""
    with contextlib.redirect_stdout(_io.StringIO()):
        return fn(*args, **kwargs)


def check_level(level: str, where: str) -> None:
    """A registered BabyAI GoTo level, or a ValueError naming `where` it came from (the wrapper
    reads one target object from a GoTo mission; other levels' missions it cannot read)."""
    import gymnasium as gym
    import minigrid  # noqa: F401  (registers the BabyAI levels)

    if level not in gym.envs.registry or not level.startswith("BabyAI-GoTo"):
        raise ValueError(f"{where}: level {level!r} is not a registered BabyAI GoTo level (the "
                         "wrapper reads one target object from the mission)")


def make_level(level: str, seed: int) -> Any:
    """The unwrapped minigrid env of `level`, reset with `seed` (the same layout and mission
    for the same pair)."""
    import gymnasium as gym
    import minigrid  # noqa: F401  (registers the BabyAI levels)

    env = gym.make(level).unwrapped
    _quiet(env.reset, seed=seed)
    return env


def describe(image: Any, carrying: Any = None) -> str:
    """One line from minigrid's egocentric view `image` (7, 7, 3: object, colour, state per
    cell; x left to right, y far to near, the agent at (3, 6) facing up)."""
    from minigrid.core.constants import IDX_TO_COLOR, IDX_TO_OBJECT

    ax, ay = VIEW_AGENT
    objects = []
    for x in range(image.shape[0]):
        for y in range(image.shape[1]):
            kind = IDX_TO_OBJECT[int(image[x, y, 0])]
            if kind in ("unseen", "empty", "wall", "floor", "agent") or (x, y) == (ax, ay):
                continue
            ahead, side = ay - y, x - ax
            where = f"{ahead} ahead" + (f" {abs(side)} {'left' if side < 0 else 'right'}"
                                        if side else "")
            colour = IDX_TO_COLOR[int(image[x, y, 1])]
            objects.append((ahead + abs(side), ahead, side, f"{colour} {kind} {where}"))
    parts = [text for *_, text in sorted(objects)]
    # what blocks the way straight ahead (nothing: the view's edge)
    for d in range(1, ay + 1):
        kind = IDX_TO_OBJECT[int(image[ax, ay - d, 0])]
        if kind not in ("empty", "floor"):
            if kind in ("wall", "door"):
                parts.append(f"{kind} {d} ahead")
            break
    if carrying is not None:
        parts.append(f"carrying {carrying.color} {carrying.type}")
    return "; ".join(parts) if parts else "nothing in view"


def target_offset(image: Any, color: str | None, kind: str) -> tuple[int, int] | None:
    """(ahead, side) of the nearest visible object matching the mission, or None."""
    from minigrid.core.constants import IDX_TO_COLOR, IDX_TO_OBJECT

    ax, ay = VIEW_AGENT
    best = None
    for x in range(image.shape[0]):
        for y in range(image.shape[1]):
            if (IDX_TO_OBJECT[int(image[x, y, 0])] == kind and (color is None or
                                                               IDX_TO_COLOR[int(image[x, y, 1])]
                                                               == color)):
                off = (ay - y, x - ax)
                if best is None or sum(map(abs, off)) < sum(map(abs, best)):
                    best = off
    return best


@dataclass
class BabyAIEnv(Env):
    """One BabyAI episode, rebuilt from (level, seed) at every `reset`; deep-copyable (one-step
    alternatives branch from a copy, the bot included)."""

    level: str
    seed: int
    env: Any = None
    bot: Any = None
    done: bool = False
    won: bool = False
    last_obs: dict = field(default_factory=dict)

    name = "babyai"
    tools = TOOLS

    def reset(self) -> tuple[str, str]:
        from minigrid.utils.baby_ai_bot import BabyAIBot

        self.env = make_level(self.level, self.seed)
        self.last_obs = self.env.gen_obs()
        self.bot = BabyAIBot(self.env)
        self.done = self.won = False
        return self.last_obs["mission"], self.observe()

    def observe(self) -> str:
        return describe(self.last_obs["image"], self.env.carrying)

    def mission_target(self) -> tuple[str | None, str]:
        desc = self.env.instrs.desc
        return desc.color, desc.type

    def step(self, call: ToolCall) -> StepResult:
        obs, reward, terminated, truncated, _ = self.env.step(ACTIONS.index(call.name))
        self.last_obs = obs
        self.won = self.won or reward > 0
        self.done = bool(terminated or truncated)
        return StepResult(self.observe(), reward=float(reward > 0), done=self.done)

    def success(self) -> bool:
        return self.won

    def legal_actions(self) -> list[str]:
        return list(ACTIONS)

    def target_offset(self) -> tuple[int, int] | None:
        color, kind = self.mission_target()
        return target_offset(self.last_obs["image"], color, kind)


def expert_action(env: BabyAIEnv) -> str:
    """minigrid's BabyAIBot, asked once per step (it keeps its own plan, so the rollout must
    take the action it returns). Privileged; never an arm under test."""
    action = int(env.bot.replan())
    if action >= len(ACTIONS):     # `done`: no GoTo level asks for it (success needs none)
        raise ValueError(f"{env.level} seed {env.seed}: BabyAIBot chose minigrid action "
                         f"{action}, which is not a tool here ({', '.join(ACTIONS)})")
    return ACTIONS[action]


def expert_agent() -> Any:
    from stages.agents.rollout import ScriptedAgent

    return ScriptedAgent("expert", lambda ep: ("", expert_action(ep.env)))


def where(offset: tuple[int, int] | None, kind: str) -> str:
    """The target's place after a branch, for a reflection: `key 2 ahead 1 left`, `key in
    reach` (faced, next to it: the goal), `key out of view`."""
    if offset is None:
        return f"{kind} out of view"
    ahead, side = offset
    if (ahead, side) == (1, 0):
        return f"{kind} in reach"
    return f"{kind} {ahead} ahead" + (f" {abs(side)} {'left' if side < 0 else 'right'}"
                                      if side else "")


def reflection(env: BabyAIEnv, expert: Any, alt: Any) -> str:
    """A TEMPLATED reflection from the two one-step outcomes (`expert`, `alt`: Branches whose
    `env` is the BabyAIEnv after the call): where each leaves the mission's target."""
    _, kind = env.mission_target()
    a = where(alt.env.target_offset(), kind)
    e = where(expert.env.target_offset(), kind)
    if alt.env.success():
        return f"{alt.call} also reaches the {kind}"
    if a == e:
        return f"{alt.call}: {a}, no closer; {expert.call}: on the way"
    return f"{alt.call}: {a}; {expert.call}: {e}"


# --- on disk: the episodes of every split ------------------------------------------------------

EPISODE_SCHEMA = {"split": "String", "episode": "Int64", "level": "String", "seed": "Int64",
                  "mission": "String", "target": "String"}


def draw_seeds(level: str, kinds: tuple[str, ...], n: int, start: int) -> list[tuple[int, str]]:
    """The first `n` level seeds from `start` whose mission names one of `kinds`: (seed,
    mission)."""
    out: list[tuple[int, str]] = []
    seed = start
    while len(out) < n:
        if seed - start > 100 * n:
            raise ValueError(f"{level}: fewer than {n} missions naming {kinds} in "
                             f"{100 * n} seeds from {start}")
        env = make_level(level, seed)
        if env.instrs.desc.type in kinds:
            out.append((seed, env.mission))
        seed += 1
    return out


def episode_spec() -> Any:
    import polars as pl

    from stages.core.checks import ColumnSpec, FrameSpec

    cols = {k: ColumnSpec(dtype=getattr(pl, v)) for k, v in EPISODE_SCHEMA.items()}
    cols["split"] = ColumnSpec(dtype=pl.String, values=SPLITS)
    cols["episode"] = ColumnSpec(dtype=pl.Int64, min=0)
    cols["seed"] = ColumnSpec(dtype=pl.Int64, min=0)
    cols["target"] = ColumnSpec(dtype=pl.String, values=IN_DOMAIN + OOD)
    return FrameSpec(cols, min_rows=1)


def read_episodes(folder: Any) -> dict[str, list[BabyAIEnv]]:
    """The environments of every split, through the checked read of `episodes.parquet`."""
    from stages.core.checks import read_parquet_checked

    path = folder / "episodes.parquet"
    df = read_parquet_checked(path, episode_spec())
    for level in df["level"].unique().sort():     # before any episode is played
        check_level(level, str(path))
    out: dict[str, list[BabyAIEnv]] = {s: [] for s in SPLITS}
    for r in df.sort("split", "episode").iter_rows(named=True):
        out[r["split"]].append(BabyAIEnv(r["level"], r["seed"]))
    return out
