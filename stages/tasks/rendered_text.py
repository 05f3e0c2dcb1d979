"""Task family `rendered_text`: the same content as a text string and as a rendered image (CoRe).

Three kinds of content, each a few short lines (`content`, lines joined by "\\n"), with a
question about it and an exact answer:

    kv      ab=17 cd=4 qx=61        query  get cd        target  4
            ...
    arith   a:23+45-17              query  solve a       target  23+45=68; 68-17=51 #### 51
            b:8+91
    table   #:a,b,c                 query  cell q b      target  88
            p:12,7,45
            q:3,88,9

The text-conditioned policy reads `content` as characters; the image-conditioned one reads
`image`: the same characters drawn on a fixed grid of `cell_w x cell_h` pixel cells (one glyph
per cell, monospace TrueType font, anti-aliased, black on white), `cols x rows` cells. Placing
each glyph in its own cell (not the font's advance) fixes the geometry exactly: with 4x8 cells
and 16-pixel patches a visual token covers 2 lines x 4 characters. The compression ratio
(characters per visual token, CoRe spec §6: report it with every number) is a column, and
every row must reach `min_chars_per_token` (the issue asks >= 2).

Verifiers are exact: `verify_answer` (the answer string; for arith the integer after `####`,
as in stages/tasks/arith.py) and `ocr_exact` (a transcription equals `content`).
The font is a param (`font`, a Debian TrueType file); a missing file fails before any rendering,
naming the path and the Debian package that ships it. Deterministic in the seed.
"""

from __future__ import annotations

import hashlib
import random
import string
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.tasks import arith as arith_family

if TYPE_CHECKING:
    import numpy as np

    from stages.core.checks import FrameSpec

FAMILY = "rendered_text"
KINDS = ("kv", "arith", "table")
SPLITS = ("test", "val", "train")
RENDERER_VERSION = 1  # bump when the drawing changes: the images (and every result) change
DEFAULT_FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf"

SCHEMA: dict[str, pl.DataType] = {
    "id": pl.String,               # rendered_text-train-000123
    "family": pl.String,           # "rendered_text"
    "split": pl.String,
    "kind": pl.String,             # kv | arith | table
    "content": pl.String,          # x_txt: what the image shows, lines joined by "\n"
    "query": pl.String,            # the question, always text: "get cd"
    "target": pl.String,           # the exact answer text
    "answer": pl.String,           # the value checked ("4"; arith: the final integer)
    "image": pl.Binary,            # PNG, mode L, cols*cell_w x rows*cell_h
    "image_sha": pl.String,
    "n_chars": pl.Int64,           # len(content)
    "n_lines": pl.Int64,
    "visual_tokens": pl.Int64,     # (width / patch) * (height / patch)
    "chars_per_token": pl.Float64,  # n_chars / visual_tokens: the compression ratio
    "difficulty": pl.Int64,        # kv: pairs; arith: operands of the asked problem; table: rows
}


class FontNotFoundError(FileNotFoundError):
    """The configured TrueType font is not on this machine."""


class Config(BaseModel):
    """Layout and content knobs of the rendered-text family."""

    model_config = ConfigDict(extra="forbid")

    font: str = Field(DEFAULT_FONT, description="TrueType font file (Debian: fonts-dejavu-core)")
    font_size: int = Field(7, ge=4, le=64, description="font size in pixels")
    cell_w: int = Field(4, ge=2, le=64, description="pixels per character cell, horizontally")
    cell_h: int = Field(8, ge=4, le=64, description="pixels per character cell (line height)")
    cols: int = Field(16, ge=4, le=256, description="character cells per line")
    rows: int = Field(8, ge=1, le=256, description="lines per image")
    patch_size: int = Field(16, ge=2, le=64,
                            description="the model's patch side: sets visual tokens per image")
    min_chars_per_token: float = Field(2.0, ge=0, description="every row reaches this ratio")
    kinds: list[str] = Field(default_factory=lambda: list(KINDS), min_length=1,
                             description="content kinds, drawn in turn")
    kv_pairs: tuple[int, int] = Field((4, 7), description="kv: pairs per image, min and max")
    arith_problems: tuple[int, int] = Field((2, 4), description="arith: problems per image")
    arith_operands: tuple[int, int] = Field((2, 3), description="arith: operands per problem")
    table_rows: tuple[int, int] = Field((2, 4), description="table: data rows per image")
    table_cols: tuple[int, int] = Field((2, 3), description="table: value columns")
    max_value: int = Field(99, ge=1, le=9999, description="largest value anywhere")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        bad = sorted(set(self.kinds) - set(KINDS))
        if bad:
            raise ValueError(f"kinds {bad}: known {list(KINDS)}")
        for name in ("kv_pairs", "arith_problems", "arith_operands", "table_rows", "table_cols"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} = ({lo}, {hi}): expected 1 <= min <= max")
        if self.arith_operands[0] < 2:
            raise ValueError("arith_operands: a problem has at least 2 operands")
        w, h = self.size
        if w % self.patch_size or h % self.patch_size:
            raise ValueError(f"image {w}x{h} (cols*cell_w x rows*cell_h) is not a multiple of "
                             f"patch_size {self.patch_size}")
        if self.table_rows[1] + 1 > self.rows or self.arith_problems[1] > self.rows:
            raise ValueError(f"rows = {self.rows}: fewer lines than the tables or problems need")
        return self

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return self.cols * self.cell_w, self.rows * self.cell_h

    @property
    def visual_tokens(self) -> int:
        w, h = self.size
        return (w // self.patch_size) * (h // self.patch_size)


# --- rendering ------------------------------------------------------------------------------

def check_font(path: str) -> Path:
    """The font file, or FontNotFoundError naming it and the Debian package that ships it."""
    p = Path(path)
    if not p.is_file():
        raise FontNotFoundError(
            f"rendered_text.font = {path!r}: no such font file. The default is DejaVu Sans Mono "
            f"from the Debian package fonts-dejavu-core (`apt-get install fonts-dejavu-core`); "
            f"or set `font` to any monospace .ttf on this machine")
    return p


def font_sha(path: str) -> str:
    """SHA-256 of the font file: logged with the data, since a different font changes results."""
    return hashlib.sha256(check_font(path).read_bytes()).hexdigest()


@lru_cache(maxsize=8)
def _font(path: str, size: int) -> Any:
    from PIL import ImageFont

    return ImageFont.truetype(str(check_font(path)), size)


def render(cfg: Config, content: str) -> "np.ndarray":
    """`content` drawn one glyph per cell, (rows*cell_h, cols*cell_w) uint8, black on white.

    Raises ValueError if a line is longer than `cols` or there are more than `rows` lines: the
    layout never wraps silently (a wrapped line would not be the text string the other policy
    reads)."""
    import numpy as np
    from PIL import Image, ImageDraw

    lines = content.split("\n")
    if len(lines) > cfg.rows or any(len(line) > cfg.cols for line in lines):
        raise ValueError(f"content does not fit {cfg.cols}x{cfg.rows} cells: {content!r}")
    font = _font(cfg.font, cfg.font_size)
    img = Image.new("L", cfg.size, 255)
    draw = ImageDraw.Draw(img)
    for r, line in enumerate(lines):
        for c, ch in enumerate(line):
            if ch != " ":
                draw.text((c * cfg.cell_w, r * cfg.cell_h), ch, font=font, fill=0)
    return np.asarray(img, dtype=np.uint8)


# --- content --------------------------------------------------------------------------------

def _wrap(words: list[str], cols: int) -> list[str]:
    lines: list[str] = []
    for w in words:
        if lines and len(lines[-1]) + 1 + len(w) <= cols:
            lines[-1] += " " + w
        else:
            lines.append(w)
    return lines


def make_kv(cfg: Config, rng: random.Random) -> dict[str, Any]:
    n = rng.randint(*cfg.kv_pairs)
    keys = rng.sample([a + b for a in string.ascii_lowercase for b in string.ascii_lowercase], n)
    values = [rng.randint(0, cfg.max_value) for _ in keys]
    lines = _wrap([f"{k}={v}" for k, v in zip(keys, values)], cfg.cols)
    i = rng.randrange(n)
    return {"kind": "kv", "lines": lines, "query": f"get {keys[i]}", "target": str(values[i]),
            "answer": str(values[i]), "difficulty": n}


def make_arith(cfg: Config, rng: random.Random) -> dict[str, Any]:
    n = rng.randint(*cfg.arith_problems)
    labels = string.ascii_lowercase[:n]
    problems = []
    for _ in labels:
        k = rng.randint(*cfg.arith_operands)
        operands = [rng.randint(0, cfg.max_value) for _ in range(k)]
        ops = [rng.choice("+-") for _ in range(k - 1)]
        problems.append((operands, ops))
    lines = [f"{lab}:{arith_family.format_question(o, p)}" for lab, (o, p) in zip(labels, problems)]
    i = rng.randrange(n)
    operands, ops = problems[i]
    target = arith_family.format_target(operands, ops).strip()
    answer = arith_family.solution_steps(operands, ops)[-1].value
    return {"kind": "arith", "lines": lines, "query": f"solve {labels[i]}", "target": target,
            "answer": str(answer), "difficulty": len(operands)}


def make_table(cfg: Config, rng: random.Random) -> dict[str, Any]:
    n_rows, n_cols = rng.randint(*cfg.table_rows), rng.randint(*cfg.table_cols)
    col_names = string.ascii_lowercase[:n_cols]
    row_names = rng.sample(string.ascii_lowercase[n_cols:], n_rows)
    cells = [[rng.randint(0, cfg.max_value) for _ in col_names] for _ in row_names]
    lines = ["#:" + ",".join(col_names)]
    lines += [f"{r}:" + ",".join(str(v) for v in vals) for r, vals in zip(row_names, cells)]
    i, j = rng.randrange(n_rows), rng.randrange(n_cols)
    return {"kind": "table", "lines": lines, "query": f"cell {row_names[i]} {col_names[j]}",
            "target": str(cells[i][j]), "answer": str(cells[i][j]), "difficulty": n_rows}


MAKERS = {"kv": make_kv, "arith": make_arith, "table": make_table}


def generate(cfg: Config, n: int, seed: int | str, *, split: str = "train",
             exclude: Iterable[str] = ()) -> list[dict[str, Any]]:
    """`n` rows, kinds in turn; no `content` in `exclude`; every row fits the grid and reaches
    `min_chars_per_token` (content that does not is redrawn)."""
    from stages.tasks.images import encode_png, pixel_sha

    if n < 0:
        raise ValueError(f"n = {n}: expected >= 0")
    check_font(cfg.font)
    rng = random.Random(f"{FAMILY}:{split}:{seed}")
    seen = set(exclude)
    tokens = cfg.visual_tokens
    rows: list[dict[str, Any]] = []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 50 * n + 1000:
            raise ValueError(f"rendered_text: found only {len(rows)} of {n} rows for split "
                             f"{split!r} that fit {cfg.cols}x{cfg.rows} cells at >= "
                             f"{cfg.min_chars_per_token} chars per token; enlarge the content "
                             f"ranges or lower min_chars_per_token")
        kind = cfg.kinds[len(rows) % len(cfg.kinds)]
        item = MAKERS[kind](cfg, rng)
        content = "\n".join(item["lines"])
        if (content in seen or len(item["lines"]) > cfg.rows
                or any(len(line) > cfg.cols for line in item["lines"])
                or len(content) / tokens < cfg.min_chars_per_token):
            continue
        seen.add(content)
        pixels = render(cfg, content)
        rows.append({
            "id": f"{FAMILY}-{split}-{len(rows):06d}", "family": FAMILY, "split": split,
            "kind": kind, "content": content, "query": item["query"], "target": item["target"],
            "answer": item["answer"], "image": encode_png(pixels), "image_sha": pixel_sha(pixels),
            "n_chars": len(content), "n_lines": len(item["lines"]), "visual_tokens": tokens,
            "chars_per_token": len(content) / tokens, "difficulty": item["difficulty"]})
    return rows


def generate_splits(cfg: Config, sizes: dict[str, int], seed: int) -> dict[str, list[dict[str, Any]]]:
    """Splits disjoint on `content`, drawn in the order of `sizes` (held-out first)."""
    out: dict[str, list[dict[str, Any]]] = {}
    used: set[str] = set()
    for split, n in sizes.items():
        out[split] = generate(cfg, n, seed, split=split, exclude=used)
        used.update(r["content"] for r in out[split])
    return out


# --- checks and verifiers -------------------------------------------------------------------

def expectations(cfg: Config | None = None, split: str | None = None) -> "FrameSpec":
    from stages.core.checks import spec_from_schema

    rules: dict[str, dict[str, Any]] = {
        "id": {"unique": True}, "content": {"unique": True}, "image_sha": {"unique": True},
        "family": {"values": [FAMILY]}, "kind": {"values": list(KINDS)},
        "n_chars": {"min": 1}, "n_lines": {"min": 1},
    }
    if split is not None:
        rules["split"] = {"values": [split]}
    if cfg is not None:
        rules["kind"] = {"values": cfg.kinds}
        rules["n_chars"] = {"min": 1, "max": cfg.cols * cfg.rows + cfg.rows - 1}
        rules["n_lines"] = {"min": 1, "max": cfg.rows}
        rules["visual_tokens"] = {"values": [cfg.visual_tokens]}
        rules["chars_per_token"] = {"min": cfg.min_chars_per_token}
    return spec_from_schema(SCHEMA, **rules)


def verify_answer(row: dict[str, Any], completion: str) -> bool:
    """Exact: the completion's answer equals the row's (arith: the integer after `####`)."""
    if row["kind"] == "arith":
        got = arith_family.extract_answer(completion)
        return got is not None and str(got) == row["answer"]
    return completion.strip() == row["answer"]


def ocr_exact(row: dict[str, Any], transcription: str) -> bool:
    """A transcription matches iff it equals the content exactly (trailing whitespace aside)."""
    return transcription.rstrip() == row["content"]


def char_accuracy(truth: str, guess: str) -> float:
    """Share of the truth's characters reproduced at the same position (a softer OCR score)."""
    if not truth:
        return float(guess == truth)
    return sum(1 for a, b in zip(truth, guess) if a == b) / max(len(truth), len(guess))
