"""Task family `pendulum`: (before, after) image pairs of a structural causal model under one
single-variable intervention, with exact intervention / counterfactual / structure answers.

The BridgeVLM spec §4 (CausalVLBench Pendulum, Komanduri et al. 2025, reconstructed): four
variables with four levels each, `angle`, `light`, `shadow_len`, `shadow_pos`, drawn as a 2x2
dashboard of dials and bars (a pendulum rod at an angle, a light disk along a rail, a shadow bar
of some length, a shadow marker at some position). Two SCMs share those four rendered variables
and differ only in their DAG and mechanisms:

    pendulum  angle -> shadow_len, angle -> shadow_pos, light -> shadow_len, light -> shadow_pos
              shadow_len = (angle + light) // 2, shadow_pos = (angle - light + 3) // 2
    relay     angle -> light -> shadow_pos -> shadow_len      (held out from graph design:
              light = (angle + 1) % 4, shadow_pos = 3 - light, shadow_len = (shadow_pos + 2) % 4)

so only the dynamics seen across the two images tell the graphs apart. A row: an SCM, a
`before` state (roots uniform, the rest by the mechanisms), a single intervention do(X = v)
with v != before[X], the `after` state, both images (PNG bytes), and three questions:
- intervention: `which variable was intervened on ?` -> the variable's name;
- counterfactual: `if <X> were <v> what would every variable be ?` (from the before state)
  -> the four levels in variable order (`2 1 1 2`: correct only if every variable is);
- structure: `does <X> cause <Y> ?` -> yes / no (direct edge), yes and no alternating by row.
The true graph and values are stored beside the images; a model only ever reads the images.

Splits test, val, train (8:1:1 by default) are drawn in that order from the seed, disjoint on
the pixels of the pair. Every table passes its great-expectations suite before it is written.

    python -m stages bridgevlm data
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import numpy as np

    from stages.core.checks import FrameSpec

FAMILY = "pendulum"
SPLITS = ("test", "val", "train")          # generation order: held-out splits first
VARIABLES = ("angle", "light", "shadow_len", "shadow_pos")
LEVELS = 4
INTERVENTION_QUERY = "which variable was intervened on ?"

Mechanism = Callable[[Sequence[int]], int]
# name -> (edges (cause, effect) as variable indices, topological order, mechanisms of non-roots)
SCMS: dict[str, tuple[tuple[tuple[int, int], ...], tuple[int, ...], dict[int, Mechanism]]] = {
    "pendulum": (((0, 2), (0, 3), (1, 2), (1, 3)), (0, 1, 2, 3),
                 {2: lambda v: (v[0] + v[1]) // 2, 3: lambda v: (v[0] - v[1] + 3) // 2}),
    "relay": (((0, 1), (1, 3), (3, 2)), (0, 1, 3, 2),
              {1: lambda v: (v[0] + 1) % 4, 3: lambda v: 3 - v[1], 2: lambda v: (v[3] + 2) % 4}),
}

SCHEMA: dict[str, pl.DataType] = {
    "id": pl.String,                   # pendulum-train-000123
    "family": pl.String,
    "split": pl.String,
    "scm": pl.String,                  # pendulum | relay
    "edges": pl.List(pl.String),       # the true DAG, "cause>effect"
    "before": pl.List(pl.Int64),       # levels of VARIABLES before the intervention
    "after": pl.List(pl.Int64),        # ... after it
    "do_var": pl.String,               # the intervened variable
    "do_value": pl.Int64,
    "image_before": pl.Binary,         # PNG, RGB, image_size x image_size
    "image_after": pl.Binary,
    "pair_sha": pl.String,             # SHA-256 of both images' pixels: unique across splits
    "intervention_query": pl.String,
    "intervention_answer": pl.String,  # = do_var
    "cf_var": pl.String,
    "cf_value": pl.Int64,
    "cf_query": pl.String,
    "cf_answer": pl.String,            # four levels, "2 1 1 2"
    "cf_values": pl.List(pl.Int64),
    "struct_cause": pl.String,
    "struct_effect": pl.String,
    "struct_query": pl.String,
    "struct_answer": pl.String,        # yes | no
    "struct_label": pl.Int64,          # 1 = direct edge cause -> effect
}


class TaskConfig(BaseModel):
    """The dataset: which SCMs, how many pairs, how they are drawn."""

    model_config = ConfigDict(extra="forbid")

    scms: list[str] = Field(default_factory=lambda: ["pendulum", "relay"], min_length=1,
                            description="SCMs mixed in every split (names in SCMS)")
    image_size: int = Field(32, ge=16, le=512, description="square image side, pixels "
                            "(spec §4: 48; 32 here: 16 patch tokens per image at patch 8)")
    noise: float = Field(6.0, ge=0, le=64, description="per-pixel Gaussian noise std, grey levels")
    jitter: int = Field(1, ge=0, le=4, description="position jitter of each drawn part, pixels")

    @model_validator(mode="after")
    def _check(self) -> "TaskConfig":
        unknown = sorted(set(self.scms) - set(SCMS))
        if unknown:
            raise ValueError(f"scms {unknown} unknown; expected some of {sorted(SCMS)}")
        if len(set(self.scms)) != len(self.scms):
            raise ValueError(f"scms {self.scms} repeat a name")
        if self.image_size % 16:
            raise ValueError(f"image_size {self.image_size} is not a multiple of 16 (2x2 panels "
                             f"of whole 8-pixel patches)")
        return self


# --- the SCMs -------------------------------------------------------------------------------

def adjacency(scm: str) -> list[list[int]]:
    """The true DAG as an m x m 0/1 matrix, A[i][j] = 1 for an edge i -> j."""
    a = [[0] * len(VARIABLES) for _ in VARIABLES]
    for i, j in SCMS[scm][0]:
        a[i][j] = 1
    return a


def propagate(scm: str, values: Sequence[int], do: dict[int, int] | None = None) -> list[int]:
    """The state after do(): roots and intervened variables keep their given value, every other
    variable follows its mechanism, in topological order (no exogenous noise: the counterfactual
    of a state is this same function, abduction is trivial)."""
    _, order, mech = SCMS[scm]
    do = do or {}
    v = list(values)
    for k in order:
        if k in do:
            v[k] = do[k]
        elif k in mech:
            v[k] = mech[k](v)
    return v


def sample_state(scm: str, rng: random.Random) -> list[int]:
    roots = [rng.randrange(LEVELS) for _ in VARIABLES]
    return propagate(scm, roots)


# --- rendering ------------------------------------------------------------------------------

def render(cfg: TaskConfig, values: Sequence[int], rng: "np.random.Generator") -> "np.ndarray":
    """(size, size, 3) uint8: the 2x2 dashboard. Panel k (row-major) shows VARIABLES[k]."""
    import math

    import numpy as np
    from PIL import Image, ImageDraw

    s, p = cfg.image_size, cfg.image_size // 2
    img = Image.new("RGB", (s, s), (205, 205, 205))
    draw = ImageDraw.Draw(img)
    u = p / 16                                        # drawing unit: 1 px at 32x32

    def j() -> int:
        return int(rng.integers(-cfg.jitter, cfg.jitter + 1)) if cfg.jitter else 0

    draw.line([(p, 0), (p, s - 1)], fill=(170, 170, 170))
    draw.line([(0, p), (s - 1, p)], fill=(170, 170, 170))
    angle, light, length, pos = values
    # angle: a rod from a pivot, four angles from the vertical, with a bob
    cx, cy = p / 2 + j(), 2 * u + j()
    theta = math.radians((-45, -15, 15, 45)[angle])
    bx, by = cx + 8 * u * math.sin(theta), cy + 8 * u * math.cos(theta)
    draw.line([(cx, cy), (bx, by)], fill=(150, 30, 30), width=max(1, int(u)))
    draw.ellipse([bx - 2 * u, by - 2 * u, bx + 2 * u, by + 2 * u], fill=(200, 40, 40))
    # light: a disk on a rail, four positions
    lx, ly = p + (light + 0.5) * 4 * u + j(), 6 * u + j()
    draw.line([(p + u, 11 * u), (2 * p - u, 11 * u)], fill=(120, 120, 120))
    draw.ellipse([lx - 2 * u, ly - 2 * u, lx + 2 * u, ly + 2 * u], fill=(240, 190, 20))
    # shadow length: a bar of 1-4 units of 3.5 px
    y0 = p + 6 * u + j()
    x0 = u + j()
    draw.rectangle([x0, y0, x0 + (length + 1) * 3.5 * u - 1, y0 + 4 * u - 1], fill=(40, 40, 60))
    # shadow position: a marker at one of four places
    mx = p + (pos + 0.5) * 4 * u + j()
    my = p + 8 * u + j()
    draw.rectangle([mx - 1.5 * u, my - 2 * u, mx + 1.5 * u, my + 2 * u], fill=(30, 60, 160))
    pixels = np.asarray(img, dtype=np.float64)
    if cfg.noise:
        pixels = pixels + rng.normal(0.0, cfg.noise, pixels.shape)
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8)


# --- rows -----------------------------------------------------------------------------------

def levels_text(values: Sequence[int]) -> str:
    return " ".join(str(v) for v in values)


def cf_query(var: str, value: int) -> str:
    return f"if {var} were {value} what would every variable be ?"


def struct_query(cause: str, effect: str) -> str:
    return f"does {cause} cause {effect} ?"


def sample_row(cfg: TaskConfig, scm: str, rng: random.Random, nprng: "np.random.Generator",
               yes: bool) -> dict[str, Any]:
    """One (before, after) pair of `scm` with its three questions (images rendered)."""
    from stages.tasks.images import encode_png, pixel_sha

    before = sample_state(scm, rng)
    k = rng.randrange(len(VARIABLES))
    value = rng.choice([v for v in range(LEVELS) if v != before[k]])
    after = propagate(scm, before, {k: value})
    c = rng.randrange(len(VARIABLES))
    cf_value = rng.randrange(LEVELS)
    cf = propagate(scm, before, {c: cf_value})
    a = adjacency(scm)
    pairs = [(i, jj) for i in range(len(VARIABLES)) for jj in range(len(VARIABLES))
             if i != jj and a[i][jj] == int(yes)]
    cause, effect = rng.choice(pairs)
    img_b, img_a = render(cfg, before, nprng), render(cfg, after, nprng)
    sha = hashlib.sha256((pixel_sha(img_b) + pixel_sha(img_a)).encode()).hexdigest()
    return {"family": FAMILY, "scm": scm,
            "edges": [f"{VARIABLES[i]}>{VARIABLES[jj]}" for i, jj in SCMS[scm][0]],
            "before": before, "after": after, "do_var": VARIABLES[k], "do_value": value,
            "image_before": encode_png(img_b), "image_after": encode_png(img_a), "pair_sha": sha,
            "intervention_query": INTERVENTION_QUERY, "intervention_answer": VARIABLES[k],
            "cf_var": VARIABLES[c], "cf_value": cf_value, "cf_query": cf_query(VARIABLES[c],
                                                                                 cf_value),
            "cf_answer": levels_text(cf), "cf_values": cf,
            "struct_cause": VARIABLES[cause], "struct_effect": VARIABLES[effect],
            "struct_query": struct_query(VARIABLES[cause], VARIABLES[effect]),
            "struct_answer": "yes" if yes else "no", "struct_label": int(yes)}


def generate_splits(cfg: TaskConfig, sizes: dict[str, int], seed: int) -> dict[str, list[dict]]:
    """Every split's rows, deterministic in `seed`; SCMs alternate row by row, structure answers
    alternate yes/no every two rows (both SCMs get both); pixel-disjoint across splits."""
    import numpy as np

    rng = random.Random(f"pendulum-{seed}")
    nprng = np.random.default_rng(seed)
    seen: set[str] = set()
    out: dict[str, list[dict]] = {}
    for split in SPLITS:
        rows: list[dict] = []
        while len(rows) < sizes[split]:
            i = len(rows)
            row = sample_row(cfg, cfg.scms[i % len(cfg.scms)], rng, nprng,
                             yes=(i // len(cfg.scms)) % 2 == 0)
            if row["pair_sha"] in seen:
                continue
            seen.add(row["pair_sha"])
            rows.append({"id": f"{FAMILY}-{split}-{i:06d}", "split": split, **row})
        out[split] = rows
    return out


def expectations(cfg: TaskConfig | None = None, split: str | None = None) -> "FrameSpec":
    """Data checks of a split: schema, uniqueness, value sets, levels in range, balance."""
    from stages.core.checks import ColumnSpec, spec_from_schema

    level = ColumnSpec(dtype=pl.Int64, min=0, max=LEVELS - 1)
    names = list(VARIABLES)
    rules: dict[str, dict[str, Any]] = {
        "id": {"unique": True}, "pair_sha": {"unique": True}, "family": {"values": [FAMILY]},
        "scm": {"values": sorted(SCMS)}, "do_var": {"values": names},
        "do_value": {"min": 0, "max": LEVELS - 1}, "cf_value": {"min": 0, "max": LEVELS - 1},
        "intervention_answer": {"values": names}, "cf_var": {"values": names},
        "struct_cause": {"values": names}, "struct_effect": {"values": names},
        "intervention_query": {"values": [INTERVENTION_QUERY]},
        "struct_answer": {"values": ["yes", "no"], "max_imbalance": 1.5},
        "struct_label": {"values": [0, 1]},
        "before": {"min_len": len(VARIABLES), "elements": level},
        "after": {"min_len": len(VARIABLES), "elements": level},
        "cf_values": {"min_len": len(VARIABLES), "elements": level},
        "edges": {"min_len": 1},
    }
    if split is not None:
        rules["split"] = {"values": [split]}
    if cfg is not None:
        rules["scm"] = {"values": cfg.scms}
    return spec_from_schema(SCHEMA, **rules)


def check_ground_truth(df: pl.DataFrame, source: str) -> None:
    """Row rules GE cannot express: after = propagate(before, do), the counterfactual and the
    structure answer follow from the SCM, the intervened variable changed."""
    from stages.core.checks import DataValidationError

    for row in df.select("id", "scm", "before", "after", "do_var", "do_value", "cf_var",
                         "cf_value", "cf_values", "struct_cause", "struct_effect",
                         "struct_label").iter_rows(named=True):
        k = VARIABLES.index(row["do_var"])
        c = VARIABLES.index(row["cf_var"])
        a = adjacency(row["scm"])
        ok = (len(row["before"]) == len(VARIABLES)
              and row["after"] == propagate(row["scm"], row["before"], {k: row["do_value"]})
              and row["before"][k] != row["do_value"]
              and row["cf_values"] == propagate(row["scm"], row["before"], {c: row["cf_value"]})
              and a[VARIABLES.index(row["struct_cause"])][VARIABLES.index(row["struct_effect"])]
              == row["struct_label"])
        if not ok:
            raise DataValidationError(f"{source}: row {row['id']}: rule 'scm ground truth' "
                                      f"failed", source=source, column="after",
                                      rule="scm ground truth")


# --- the data stage -------------------------------------------------------------------------

class Sizes(BaseModel):
    model_config = ConfigDict(extra="forbid")

    train: int = Field(ge=2, le=1_000_000, description="train pairs")
    val: int = Field(ge=2, le=100_000, description="validation pairs")
    test: int = Field(ge=2, le=100_000, description="test pairs (reported numbers)")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    out: str = Field("bridgevlm_data", description="path key of the output folder")
    task: TaskConfig = Field(default_factory=TaskConfig, description="SCMs and rendering")
    sizes: Sizes = Field(default_factory=lambda: Sizes(train=1600, val=200, test=200),
                         description="pairs per split (spec §4: 8:1:1)")


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core import io
    from stages.core.checks import validate_frame

    out = ctx.path(cfg.out)
    sizes = cfg.sizes.model_dump()
    started = time.perf_counter()
    splits = generate_splits(cfg.task, sizes, ctx.seed)
    metrics: dict[str, float] = {}
    with io.atomic_path(out, is_dir=True) as tmp:
        for split, rows in splits.items():
            df = pl.DataFrame(rows, schema=SCHEMA)
            name = f"{out.name}/{split}.parquet"
            validate_frame(df, expectations(cfg.task, split), name)
            check_ground_truth(df, name)
            io.write_parquet(tmp / f"{split}.parquet", df)
            metrics[f"{split}_pairs"] = float(df.height)
            metrics[f"{split}_yes_rate"] = float(df["struct_label"].mean())
            # how often the intervention moved some other variable (the part that carries the
            # graph): a leaf intervention changes one variable only
            moved = [sum(a != b for a, b in zip(r["before"], r["after"])) > 1 for r in rows]
            metrics[f"{split}_propagated_rate"] = sum(moved) / len(moved)
    metrics["data_seconds"] = time.perf_counter() - started
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    keys = ("train_pairs", "test_pairs", "test_propagated_rate")
    return {k: metrics[k] for k in keys if k in metrics}
