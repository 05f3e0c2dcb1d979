"""Task family `rendered_text`: the same content as a text string and as a rendered page (CoRe).

A page is a stream of short items, cut at the page's capacity (`cols x rows` characters, every
page full, as dense VTC rendering fills pages), with a question about one complete item and an
exact answer:

    kv      ab=17 cd=4 qx=61 ju=8 a     query  get cd        target  4
    arith   a:23+45-17 b:8+91 c:40-     query  solve a       target  23+45=68; 68-17=51 #### 51
    table   #:a,b p:12,7 q:3,88 r:5     query  cell q b      target  88

The text-conditioned policy reads `content` as a string; the image-conditioned one reads
`image`: the same characters drawn row by row, one glyph per `cell_w x cell_h` pixel cell
(monospace TrueType font, anti-aliased, black on white), wrapping at `cols` characters with no
regard for words (the line break is visual only; the string has none). With 4x8 cells and 8x8
patches a visual token covers exactly two characters: the compression ratio (characters per
visual token, CoRe spec §6: report it with every number) is 2.0 on every page (the issue asks
>= 2), and it is a column of the data.

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
    "content": pl.String,          # x_txt: what the page shows, cols*rows characters
    "query": pl.String,            # the question, always text: "get cd"
    "target": pl.String,           # the exact answer text
    "answer": pl.String,           # the value checked ("4"; arith: the final integer)
    "image": pl.Binary,            # PNG, mode L, cols*cell_w x rows*cell_h
    "image_sha": pl.String,
    "n_chars": pl.Int64,           # len(content)
    "n_lines": pl.Int64,           # lines the page wraps to (= rows)
    "visual_tokens": pl.Int64,     # (width / patch) * (height / patch)
    "chars_per_token": pl.Float64,  # n_chars / visual_tokens: the compression ratio
    "difficulty": pl.Int64,        # kv: items on the page; arith: operands asked; table: rows
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
    cols: int = Field(8, ge=2, le=256, description="character cells per line")
    rows: int = Field(4, ge=1, le=256, description="lines per page")
    patch_size: int = Field(8, ge=2, le=64,
                            description="the model's patch side: sets visual tokens per page")
    min_chars_per_token: float = Field(2.0, ge=0, description="every page reaches this ratio")
    kinds: list[str] = Field(default_factory=lambda: list(KINDS), min_length=1,
                             description="content kinds, drawn in turn")
    arith_operands: tuple[int, int] = Field((2, 3), description="arith: operands per problem")
    table_cols: tuple[int, int] = Field((2, 3), description="table: value columns")
    max_value: int = Field(99, ge=1, le=9999, description="largest value anywhere")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        bad = sorted(set(self.kinds) - set(KINDS))
        if bad:
            raise ValueError(f"kinds {bad}: known {list(KINDS)}")
        for name in ("arith_operands", "table_cols"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} = ({lo}, {hi}): expected 1 <= min <= max")
        if self.arith_operands[0] < 2:
            raise ValueError("arith_operands: a problem has at least 2 operands")
        w, h = self.size
        if w != h:
            raise ValueError(f"page {w}x{h} (cols*cell_w x rows*cell_h) is not square: the "
                             f"patch encoder takes square images")
        if w % self.patch_size:
            raise ValueError(f"page {w}x{h} (cols*cell_w x rows*cell_h) is not a multiple of "
                             f"patch_size {self.patch_size}")
        if self.capacity / self.visual_tokens < self.min_chars_per_token:
            raise ValueError(f"a page holds {self.capacity} characters in {self.visual_tokens} "
                             f"visual tokens: {self.capacity / self.visual_tokens:.2f} per token "
                             f"< min_chars_per_token {self.min_chars_per_token}")
        if self.capacity < 16:
            raise ValueError(f"a page of {self.capacity} characters is too small for an item "
                             f"and a question")
        return self

    @property
    def capacity(self) -> int:
        """Characters on a (full) page."""
        return self.cols * self.rows

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
    """`content` drawn one glyph per cell, row by row, wrapping every `cols` characters:
    (rows*cell_h, cols*cell_w) uint8, black on white. Raises ValueError for content longer than
    the page or holding a newline (the page's lines are visual only)."""
    import numpy as np
    from PIL import Image, ImageDraw

    if len(content) > cfg.capacity or "\n" in content:
        raise ValueError(f"content does not fit a page of {cfg.cols}x{cfg.rows} cells (or holds "
                         f"a newline): {content!r}")
    font = _font(cfg.font, cfg.font_size)
    img = Image.new("L", cfg.size, 255)
    draw = ImageDraw.Draw(img)
    for k, ch in enumerate(content):
        if ch != " ":
            r, c = divmod(k, cfg.cols)
            draw.text((c * cfg.cell_w, r * cfg.cell_h), ch, font=font, fill=0)
    return np.asarray(img, dtype=np.uint8)


# --- content: a stream of items, each with its question --------------------------------------
# An item is (text, query, target, answer, difficulty); query None = not askable (a header).

def kv_items(cfg: Config, rng: random.Random) -> list[tuple]:
    keys = rng.sample([a + b for a in string.ascii_lowercase for b in string.ascii_lowercase],
                      cfg.capacity)
    items = []
    for k in keys:
        v = rng.randint(0, cfg.max_value)
        items.append((f"{k}={v}", f"get {k}", str(v), str(v), 0))
    return items


def arith_items(cfg: Config, rng: random.Random) -> list[tuple]:
    items = []
    for label in string.ascii_lowercase:
        k = rng.randint(*cfg.arith_operands)
        operands = [rng.randint(0, cfg.max_value) for _ in range(k)]
        ops = [rng.choice("+-") for _ in range(k - 1)]
        target = arith_family.format_target(operands, ops).strip()
        answer = arith_family.solution_steps(operands, ops)[-1].value
        items.append((f"{label}:{arith_family.format_question(operands, ops)}", f"solve {label}",
                      target, str(answer), k))
    return items


def table_items(cfg: Config, rng: random.Random) -> list[tuple]:
    n_cols = rng.randint(*cfg.table_cols)
    col_names = string.ascii_lowercase[:n_cols]
    items: list[tuple] = [("#:" + ",".join(col_names), None, "", "", 0)]
    for r in rng.sample(string.ascii_lowercase[n_cols:], 26 - n_cols):
        vals = [rng.randint(0, cfg.max_value) for _ in col_names]
        j = rng.randrange(n_cols)
        items.append((f"{r}:" + ",".join(map(str, vals)), f"cell {r} {col_names[j]}",
                      str(vals[j]), str(vals[j]), n_cols))
    return items


ITEMS = {"kv": kv_items, "arith": arith_items, "table": table_items}


def make_page(cfg: Config, kind: str, rng: random.Random) -> dict[str, Any] | None:
    """A full page of `kind`: items joined by spaces, cut at the capacity; the question asks
    one item that is complete on the page (None if no item is)."""
    text, complete = "", []
    for item in ITEMS[kind](cfg, rng):
        start = len(text) + (1 if text else 0)
        text = f"{text} {item[0]}" if text else item[0]
        if start + len(item[0]) <= cfg.capacity and item[1] is not None:
            complete.append(item)
        if len(text) >= cfg.capacity:
            break
    if len(text) < cfg.capacity or not complete:
        return None
    _, query, target, answer, difficulty = rng.choice(complete)
    return {"kind": kind, "content": text[:cfg.capacity], "query": query, "target": target,
            "answer": answer, "difficulty": difficulty or len(complete)}


def generate(cfg: Config, n: int, seed: int | str, *, split: str = "train",
             exclude: Iterable[str] = ()) -> list[dict[str, Any]]:
    """`n` full pages, kinds in turn; no `content` in `exclude`."""
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
            raise ValueError(f"rendered_text: found only {len(rows)} of {n} distinct pages for "
                             f"split {split!r}; enlarge the page or the value range")
        kind = cfg.kinds[len(rows) % len(cfg.kinds)]
        page = make_page(cfg, kind, rng)
        if page is None or page["content"] in seen:
            continue
        content = page["content"]
        seen.add(content)
        pixels = render(cfg, content)
        rows.append({
            "id": f"{FAMILY}-{split}-{len(rows):06d}", "family": FAMILY, "split": split,
            "kind": kind, "content": content, "query": page["query"], "target": page["target"],
            "answer": page["answer"], "image": encode_png(pixels), "image_sha": pixel_sha(pixels),
            "n_chars": len(content), "n_lines": -(-len(content) // cfg.cols),
            "visual_tokens": tokens, "chars_per_token": len(content) / tokens,
            "difficulty": page["difficulty"]})
    return rows


def generate_splits(cfg: Config, sizes: dict[str, int], seed: int
                    ) -> dict[str, list[dict[str, Any]]]:
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
        rules["n_chars"] = {"values": [cfg.capacity]}
        rules["n_lines"] = {"values": [cfg.rows]}
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
    """A transcription matches iff it equals the content exactly (trailing blanks aside: a blank
    cell at the end of a page is invisible)."""
    return transcription.rstrip() == row["content"].rstrip()


def char_accuracy(truth: str, guess: str) -> float:
    """Share of the truth's characters reproduced at the same position (a softer OCR score)."""
    if not truth:
        return float(guess == truth)
    return sum(1 for a, b in zip(truth, guess) if a == b) / max(len(truth), len(guess))
