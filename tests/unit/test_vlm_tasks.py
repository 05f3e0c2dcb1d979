"""The image task families of the vlm substrate: shapes world and rendered text.

Hand-computed ground truth (pixels of a drawn object, glyph cells of a rendered line), the
planted prior's exact rates, disjoint splits, POPE negatives, CHAIR/POPE counting, the exact
verifiers, and malformed images / params / fonts rejected by name before any compute."""

from __future__ import annotations

import io
import random
from collections import Counter

import numpy as np
import polars as pl
import pytest
from pydantic import ValidationError

from stages.core.checks import DataValidationError, validate_frame
from stages.tasks import rendered_text as rt
from stages.tasks import shapes
from stages.tasks.images import ImageValidationError, decode_all, decode_image, encode_png

FLAT = dict(texture_contrast=0, colour_jitter=0)   # exact colours on a near-flat background


# --- shapes: drawing --------------------------------------------------------------------------

def flat_render(cfg: shapes.Config, objects, centres, sizes):
    rng = np.random.default_rng(0)
    return shapes.render(cfg, objects, [0] * len(objects), sizes, centres, "noise", rng)


def test_object_pixels_are_its_colour_and_the_background_is_grey():
    cfg = shapes.Config(outline=0, **FLAT)
    img = flat_render(cfg, ["red circle"], [(16, 16)], [16])
    assert tuple(img[16, 16]) == (220, 40, 40)            # the centre: exactly the class colour
    corner = img[1, 1].astype(int)                         # far outside the circle: grey + tint
    assert np.ptp(corner) <= 16 and not np.array_equal(corner, [220, 40, 40])
    # the disc of diameter 16 at (16, 16): (9, 16) is inside, (8, 8) (bbox corner) is outside
    assert tuple(img[16, 9]) == (220, 40, 40)
    assert tuple(img[8, 8]) != (220, 40, 40)


def test_square_fills_its_box_and_triangle_does_not():
    cfg = shapes.Config(outline=0, **FLAT)
    square = flat_render(cfg, ["blue square"], [(16, 16)], [16])
    triangle = flat_render(cfg, ["blue triangle"], [(16, 16)], [16])
    blue = (40, 80, 230)
    # box of side 16 centred at (16, 16): x, y in 8..23
    assert tuple(square[8, 8]) == blue and tuple(square[23, 23]) == blue
    assert tuple(square[7, 7]) != blue
    # the apex-up triangle: the top-left corner of its box is background, the base is filled
    assert tuple(triangle[8, 8]) != blue and tuple(triangle[23, 16]) == blue


def test_outline_is_dark_whatever_the_colour():
    cfg = shapes.Config(outline=1, **FLAT)
    img = flat_render(cfg, ["yellow square"], [(16, 16)], [16])
    assert tuple(img[8, 16]) == shapes.OUTLINE           # the top edge of the box
    assert tuple(img[16, 16]) == (235, 205, 30)


def test_sampled_image_ground_truth_matches_its_caption_and_cells():
    cfg = shapes.Config()
    rows = shapes.generate(cfg, 40, seed=3, split="train")
    for row in rows:
        assert row["target"] == " and ".join(f"a {o}" for o in row["objects"])
        assert row["cells"] == sorted(row["cells"]) and len(set(row["objects"])) == row["n_objects"]
        for cell, x, y in zip(row["cells"], row["xs"], row["ys"]):
            r, c = divmod(cell, cfg.grid)                 # centre within jitter of cell centre
            assert abs(x - (c * 32 + 16)) <= cfg.jitter and abs(y - (r * 32 + 16)) <= cfg.jitter
        pixels = decode_image(row["image"], size=(64, 64), mode="RGB", where="t")
        assert pixels.shape == (64, 64, 3)
    df = pl.DataFrame(rows, schema=shapes.SCHEMA)
    validate_frame(df, shapes.expectations(cfg, "train"), "train")
    shapes.check_ground_truth(df, cfg, "train")


# --- shapes: the planted prior, splits, questions ---------------------------------------------

@pytest.mark.parametrize("p", [0.0, 1.0])
def test_cooccurrence_rate_is_exact_at_the_extremes(p):
    cfg = shapes.Config()
    rng = random.Random(0)
    draws = [shapes.sample_classes(cfg, rng, p) for _ in range(600)]
    for anchor, partner in cfg.pairs:
        with_anchor = [d for d in draws if anchor in d]
        assert with_anchor
        rate = sum(partner in d for d in with_anchor) / len(with_anchor)
        assert rate == p
    assert all(cfg.min_objects <= len(d) <= cfg.max_objects and len(set(d)) == len(d)
               for d in draws)


def test_cooccurrence_rate_near_the_setting():
    cfg = shapes.Config()
    rng = random.Random(1)
    draws = [shapes.sample_classes(cfg, rng, 0.8) for _ in range(3000)]
    anchored = [(d, b) for d in draws for a, b in cfg.pairs if a in d]
    rate = sum(b in d for d, b in anchored) / len(anchored)
    assert 0.76 < rate < 0.84, rate


def test_splits_are_disjoint_deterministic_and_seeded():
    cfg = shapes.Config()
    sizes = {"test": 20, "val": 10, "train": 40}
    a = shapes.generate_splits(cfg, sizes, seed=0)
    b = shapes.generate_splits(cfg, sizes, seed=0)
    c = shapes.generate_splits(cfg, sizes, seed=1)
    shas = {s: {r["image_sha"] for r in rows} for s, rows in a.items()}
    assert not (shas["test"] & shas["val"]) and not (shas["test"] & shas["train"])
    assert not (shas["val"] & shas["train"])
    assert [r["image"] for r in a["train"]] == [r["image"] for r in b["train"]]
    assert [r["image"] for r in a["train"]] != [r["image"] for r in c["train"]]
    # held-out splits do not depend on the train size
    bigger = shapes.generate_splits(cfg, {**sizes, "train": 60}, seed=0)
    assert [r["image"] for r in bigger["test"]] == [r["image"] for r in a["test"]]


def test_pope_negatives_by_kind_hand_made_statistics():
    classes = ["red circle", "blue triangle", "green square", "yellow diamond"]
    freq = Counter({"green square": 50, "yellow diamond": 10, "blue triangle": 5})
    cooc = Counter({("red circle", "blue triangle"): 40, ("red circle", "green square"): 3})
    rng = random.Random(0)
    present = ["red circle"]
    assert shapes.negative("adversarial", present, classes, freq, cooc, rng, 1) == "blue triangle"
    assert shapes.negative("popular", present, classes, freq, cooc, rng, 1) == "green square"
    assert shapes.negative("random", present, classes, freq, cooc, rng, 1) in classes[1:]
    assert shapes.negative("random", classes, classes, freq, cooc, rng, 1) is None


def test_questions_one_positive_and_one_per_kind():
    cfg = shapes.Config()
    images = shapes.generate(cfg, 30, seed=0, split="test")
    freq, cooc = shapes.train_statistics(r["objects"] for r in images)
    qa = shapes.questions(cfg, images, freq, cooc, 0, "test")
    by_image = Counter(q["image_id"] for q in qa)
    assert set(by_image.values()) == {4}
    for q in qa:
        img = next(r for r in images if r["id"] == q["image_id"])
        assert (q["object"] in img["objects"]) == (q["label"] == 1) == (q["target"] == "yes")
        assert q["query"] == f"is there a {q['object']} ?"
    train = shapes.questions(cfg, images, freq, cooc, 0, "train")
    assert {q["negative"] for q in train} == {"positive", "random"}
    validate_frame(pl.DataFrame(qa, schema=shapes.QUESTION_SCHEMA),
                   shapes.question_expectations(cfg, "test"), "qa")


# --- shapes: bad params and bad data ----------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"pairs": [("red circle", "pink star")]}, "'pink star' is not a class"),
    ({"pairs": [("red circle", "blue square"), ("blue square", "green circle")]},
     "appears in two pairs"),
    ({"max_objects": 5}, "does not fit a 2x2 grid"),
    ({"max_size": 40}, "does not fit a grid cell"),
    ({"shapes": ["circle", "hexagon"]}, "no drawing"),
    ({"colours": {"red": [300, 0, 0]}}, "three values in 0..255"),
    ({"train_negatives": ["hard"]}, "train_negatives"),
])
def test_bad_shapes_params_are_named(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        shapes.Config(**kwargs)


def test_caption_not_matching_objects_is_rejected():
    cfg = shapes.Config()
    rows = shapes.generate(cfg, 3, seed=0, split="val")
    rows[1]["target"] = "a red circle"
    rows[1]["objects"] = ["blue square"]
    df = pl.DataFrame(rows, schema=shapes.SCHEMA)
    with pytest.raises(DataValidationError, match=r"row shapes-val-000001: rule 'ground truth'"):
        shapes.check_ground_truth(df, cfg, "val.parquet")


def test_object_outside_the_vocabulary_fails_the_suite():
    cfg = shapes.Config()
    rows = shapes.generate(cfg, 3, seed=0, split="val")
    rows[0]["objects"] = ["pink star"]
    with pytest.raises(DataValidationError) as exc:
        validate_frame(pl.DataFrame(rows, schema=shapes.SCHEMA), shapes.expectations(cfg, "val"),
                       "val.parquet")
    assert exc.value.column == "objects[]" and "pink star" in str(exc.value)


# --- images -----------------------------------------------------------------------------------

def test_malformed_images_are_named():
    good = encode_png(np.zeros((64, 64, 3), dtype=np.uint8))
    with pytest.raises(ImageValidationError, match="row r7: column 'image': rule 'readable png'"):
        decode_image(good[:40], size=(64, 64), mode="RGB", where="f.parquet: row r7")
    with pytest.raises(ImageValidationError, match="rule 'image size' failed: 32x32"):
        decode_image(encode_png(np.zeros((32, 32, 3), dtype=np.uint8)), size=(64, 64),
                     mode="RGB", where="f")
    with pytest.raises(ImageValidationError, match="rule 'image mode' failed: mode L"):
        decode_image(encode_png(np.zeros((64, 64), dtype=np.uint8)), size=(64, 64), mode="RGB",
                     where="f")
    with pytest.raises(ImageValidationError, match="rule 'png bytes'"):
        decode_image(b"", size=(64, 64), mode="RGB", where="f")
    buf = io.BytesIO()
    from PIL import Image
    Image.new("RGB", (64, 64)).save(buf, format="JPEG")
    with pytest.raises(ImageValidationError, match="format JPEG"):
        decode_image(buf.getvalue(), size=(64, 64), mode="RGB", where="f")
    # a split is decoded whole before compute: the bad row is named
    with pytest.raises(ImageValidationError, match="row b"):
        decode_all([good, good[:50]], ["a", "b"], size=None, mode="RGB", source="s")


# --- rendered text ----------------------------------------------------------------------------

def test_glyphs_sit_in_their_cells():
    cfg = rt.Config()                                    # 8 columns x 4 lines of 4x8 cells
    img = rt.render(cfg, "8 1=abcd9")
    assert img.shape == (32, 32) and img.dtype == np.uint8
    cell = lambda r, c: img[r * 8:(r + 1) * 8, c * 4:(c + 1) * 4]   # noqa: E731
    assert cell(0, 0).min() < 128                    # ink of "8"
    assert cell(0, 1).min() == 255                   # the space: blank
    assert cell(0, 2).min() < 128 and cell(0, 3).min() < 200       # "1", "="
    assert cell(1, 0).min() < 128                    # the 9th character wraps to line 2
    assert cell(1, 1).min() == 255 and img[16:, :].min() == 255    # nothing after it
    with pytest.raises(ValueError, match="does not fit"):
        rt.render(cfg, "x" * 33)
    with pytest.raises(ValueError, match="newline"):
        rt.render(cfg, "ab\ncd")


def test_pages_are_full_verify_and_reach_the_compression_ratio():
    cfg = rt.Config()
    splits = rt.generate_splits(cfg, {"test": 12, "val": 6, "train": 30}, seed=0)
    contents = {s: {r["content"] for r in rows} for s, rows in splits.items()}
    assert not (contents["test"] & contents["train"]) and not (contents["val"] & contents["train"])
    for rows in splits.values():
        assert {r["kind"] for r in rows} == set(rt.KINDS)
        for r in rows:
            assert rt.verify_answer(r, r["target"]) and rt.ocr_exact(r, r["content"])
            assert r["n_chars"] == 32 and r["visual_tokens"] == 16
            assert r["chars_per_token"] == 2.0       # two glyph cells per 8x8 patch
            pixels = decode_image(r["image"], size=(32, 32), mode="L", where="t")
            assert np.array_equal(pixels, rt.render(cfg, r["content"]))
    validate_frame(pl.DataFrame(splits["train"], schema=rt.SCHEMA),
                   rt.expectations(cfg, "train"), "train")
    again = rt.generate_splits(cfg, {"test": 12, "val": 6, "train": 30}, seed=0)
    assert [r["image"] for r in again["train"]] == [r["image"] for r in splits["train"]]


def test_answers_are_exact_hand_made():
    kv = {"kind": "kv", "answer": "17", "content": "ab=17 cd=4"}
    assert rt.verify_answer(kv, "17") and rt.verify_answer(kv, " 17 ")
    assert not rt.verify_answer(kv, "171") and not rt.verify_answer(kv, "4")
    ar = {"kind": "arith", "answer": "51", "content": "a:23+45-17"}
    assert rt.verify_answer(ar, "23+45=68; 68-17=51 #### 51")
    assert not rt.verify_answer(ar, "23+45=68; 68-17=50 #### 50")
    assert rt.ocr_exact(kv, "ab=17 cd=4\n") and not rt.ocr_exact(kv, "ab=17 cd=5")
    assert rt.char_accuracy("ab=17", "ab=18") == 0.8


def test_the_asked_item_is_whole_on_the_page():
    cfg = rt.Config()
    rng = random.Random(0)
    from stages.tasks.arith import format_target, parse_question
    for _ in range(20):
        page = rt.make_page(cfg, "arith", rng)
        label = page["query"].split()[1]
        item = next(x for x in page["content"].split(" ") if x.startswith(f"{label}:"))
        whole = [x for x in page["content"].split(" ")[:-1]]      # the last may be cut
        assert item in whole
        assert page["target"] == format_target(*parse_question(item.split(":")[1])).strip()
        table = rt.make_page(cfg, "table", rng)
        r, c = table["query"].split()[1:]
        items = table["content"].split(" ")
        header = items[0][2:].split(",")
        row = next(x for x in items[:-1] if x.startswith(f"{r}:"))
        assert row[2:].split(",")[header.index(c)] == table["answer"]
        kv = rt.make_page(cfg, "kv", rng)
        key = kv["query"].split()[1]
        assert f"{key}={kv['answer']}" in kv["content"].split(" ")[:-1]


def test_missing_font_fails_before_rendering(tmp_path):
    cfg = rt.Config(font=str(tmp_path / "NoSuchFont.ttf"))
    with pytest.raises(rt.FontNotFoundError, match="NoSuchFont.ttf.*fonts-dejavu-core"):
        rt.generate(cfg, 0, seed=0)


@pytest.mark.parametrize("kwargs, message", [
    ({"patch_size": 24}, "not a multiple of patch_size"),
    ({"cols": 16}, "not square"),
    ({"kinds": ["kv", "poem"]}, "kinds"),
    ({"arith_operands": (3, 2)}, "arith_operands"),
    ({"min_chars_per_token": 3.0}, "2.00 per token < min_chars_per_token 3.0"),
])
def test_bad_text_params_are_named(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        rt.Config(**kwargs)
