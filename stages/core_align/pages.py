"""Stage `pages` of CoRe: key->value pages asked by position, the retrieval the tiny `cpu`
substrate can learn in budget.

A page of token-aligned items (every key and every value exactly one pair token, one visual
token), asked by position (`item j` -> the j-th item's value) or, with `ask: key`, by key
(`get cd`):

    index   ab17cd04ef99gh23ij50kl07mn61op38    query  item 2     target  04

Why these pages and not the vlm pipeline's kinds (`kv`, `arith`, `table`,
stages/tasks/rendered_text.py) at `cpu`: the pipeline README, "How the profile got here", with
the measurements of `benchmarks/core_learning.py` that led here. The `cpu` and `smoke` profiles'
CoRe arms train and answer these pages (kind `index`); the `gpu` profile keeps the vlm kinds.

The pages are drawn exactly as the vlm pipeline draws its pages (the same renderer and page
geometry, `page` here): before anything is written, the first test page of the vlm data stage is
rendered with this config and must give its pixels (the same SHA-256), or the stage stops naming
the geometry params. Same schema as the vlm splits (`rendered_text.SCHEMA`); splits drawn
held-out first and disjoint on `content`.

Outputs: `<paths.core_pages>/rendered_text/{test,val,train}.parquet`.

    python -m stages core pages
"""

from __future__ import annotations

import random
import string
from typing import Any, Literal

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io
from stages.tasks import rendered_text

KIND = "index"
KINDS = (*rendered_text.KINDS, KIND)     # what the CoRe stages read: the vlm kinds and this one
VALUE_DIGITS = 2                         # a value is one pair token: 00-99
SPLITS = ("test", "val", "train")        # held-out first, as the vlm data stage


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    out: str = Field("core_pages", description="path key: the pages' folder")
    reference: str | None = Field("vlm_data", description="path key: the vlm data stage's "
                                  "folder, whose first test page this geometry must redraw "
                                  "exactly (None: no check)")
    page: rendered_text.Config = Field(default_factory=rendered_text.Config,
                                       description="page geometry (font, cells, patch size): "
                                                   "the vlm data stage's `rendered_text`")
    ask: Literal["position", "key"] = Field("position", description="`item j` (position) or "
                                            "`get ab` (key) [ours]")
    sizes: dict[str, int] = Field(description="pages per split: train, val, test")
    seed: int = Field(0, ge=0, description="the draw (the splits use seeds of their own)")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if sorted(self.sizes) != sorted(SPLITS):
            raise ValueError(f"sizes {sorted(self.sizes)}: expected exactly {sorted(SPLITS)}")
        bad = {k: v for k, v in self.sizes.items() if v < 1}
        if bad:
            raise ValueError(f"sizes {bad}: every split needs at least one page")
        if self.page.capacity % (2 + VALUE_DIGITS):
            raise ValueError(f"a page of {self.page.capacity} characters (cols x rows) does "
                             f"not hold whole {2 + VALUE_DIGITS}-character items")
        p = self.page
        if p.cols % (2 + VALUE_DIGITS) or p.patch_size != p.cell_h or p.patch_size != 2 * p.cell_w:
            raise ValueError(f"page cols {p.cols}, cells {p.cell_w}x{p.cell_h}, patch_size "
                             f"{p.patch_size}: a key or a value is one visual token only with "
                             "patch_size = cell_h = 2 x cell_w and cols a multiple of 4")
        return self


def index_page(capacity: int, rng: random.Random, ask: str = "position") -> dict[str, Any]:
    """A full page of `capacity // 4` items `<key><value>` (two letters, two digits, no
    separator: each is one pair token) and a question about one item: `item j` (its position,
    from 1) or `get <key>`; the answer is the value, zero-padded."""
    keys = [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]
    items = [(k, f"{rng.randint(0, 10 ** VALUE_DIGITS - 1):0{VALUE_DIGITS}d}")
             for k in rng.sample(keys, capacity // (2 + VALUE_DIGITS))]
    j = rng.randrange(len(items))
    query = f"item {j + 1}" if ask == "position" else f"get {items[j][0]}"
    return {"kind": KIND, "content": "".join(k + v for k, v in items), "query": query,
            "target": items[j][1], "answer": items[j][1], "difficulty": len(items)}


def generate(cfg: rendered_text.Config, n: int, seed: int | str, *, split: str,
             ask: str = "position", exclude: set[str] | frozenset[str] = frozenset()
             ) -> list[dict[str, Any]]:
    """`n` distinct index pages as rows of `rendered_text.SCHEMA`, none with a `content` in
    `exclude`; deterministic in (seed, split, ask)."""
    from stages.tasks.images import encode_png, pixel_sha

    rendered_text.check_font(cfg.font)
    rng = random.Random(f"core-pages:{ask}:{split}:{seed}")
    seen, rows = set(exclude), []
    while len(rows) < n:
        page = index_page(cfg.capacity, rng, ask)
        if page["content"] in seen:
            continue
        seen.add(page["content"])
        pixels = rendered_text.render(cfg, page["content"])
        rows.append({"id": f"{KIND}-{split}-{len(rows):06d}", "family": rendered_text.FAMILY,
                     "split": split, **page, "image": encode_png(pixels),
                     "image_sha": pixel_sha(pixels), "n_chars": cfg.capacity,
                     "n_lines": cfg.rows, "visual_tokens": cfg.visual_tokens,
                     "chars_per_token": cfg.capacity / cfg.visual_tokens})
    return rows


def expectations(split: str | None = None, kinds: tuple[str, ...] = KINDS) -> Any:
    """The checks of a page split the CoRe stages read (the vlm pipeline's or this stage's):
    the rendered-text suite, with `index` among the kinds (this stage's own output: `index`
    only)."""
    from stages.core.checks import ColumnSpec, FrameSpec

    spec = rendered_text.expectations(None, split)
    return FrameSpec(columns={**spec.columns, "kind": ColumnSpec(dtype=pl.String, values=kinds)},
                     min_rows=spec.min_rows)


def check_geometry(cfg: rendered_text.Config, reference: Any) -> None:
    """The vlm data stage's first test page, redrawn with `cfg`, has its pixels exactly, and its
    characters, lines and visual tokens are this config's (the renderer ignores `patch_size`:
    the visual-token count checks it)."""
    from stages.core.checks import read_parquet_checked
    from stages.tasks.images import pixel_sha

    path = reference / "rendered_text" / "test.parquet"
    row = read_parquet_checked(path, rendered_text.expectations(None, "test")).row(0, named=True)
    ours = {"n_chars": cfg.capacity, "n_lines": cfg.rows, "visual_tokens": cfg.visual_tokens}
    differ = {k: (v, row[k]) for k, v in ours.items() if row[k] != v}
    if differ or pixel_sha(rendered_text.render(cfg, row["content"])) != row["image_sha"]:
        what = ", ".join(f"{k} {a} here, {b} there" for k, (a, b) in differ.items())
        raise ValueError(f"pages.page draws {path} row {row['id']} differently"
                         + (f" ({what})" if differ else "")
                         + ": its font, font_size, cell_w, cell_h, cols, rows and patch_size "
                         "must be the vlm data stage's (pipelines/vlm/params.yaml, "
                         "data.rendered_text)")


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.checks import validate_frame

    if cfg.reference is not None:
        check_geometry(cfg.page, ctx.path(cfg.reference))
    splits: dict[str, list[dict[str, Any]]] = {}
    used: set[str] = set()
    for split in SPLITS:
        splits[split] = generate(cfg.page, cfg.sizes[split], cfg.seed, split=split, ask=cfg.ask,
                                 exclude=used)
        used.update(r["content"] for r in splits[split])
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        (tmp / "rendered_text").mkdir()
        for split, rows in splits.items():
            df = pl.DataFrame(rows, schema=rendered_text.SCHEMA)
            validate_frame(df, expectations(split, (KIND,)), f"pages/{split}")
            df.write_parquet(tmp / "rendered_text" / f"{split}.parquet")
    return {f"{s}_pages": float(len(r)) for s, r in splits.items()} | {
        "chars_per_visual_token": cfg.page.capacity / cfg.page.visual_tokens,
        "items_per_page": float(cfg.page.capacity // (2 + VALUE_DIGITS))}


def headline(metrics: dict[str, float]) -> dict[str, float]:
    return {k: metrics[k] for k in ("train_pages", "test_pages", "chars_per_visual_token")}
