"""CoRe's stages (stages/core_align/{sft,grpo,compare}.py) on a tiny rendered-text VLM: the page
branch equals LLaVA's own forward with pixel values, what each SFT arm trains, the GRPO reward and
the configs it refuses, and the compare stage's claims on hand-made answers."""

from __future__ import annotations

import math

import polars as pl
import pytest
import torch
from pydantic import ValidationError

from stages.core_align import compare, grpo, sft
from stages.core_align.core import CoReParams, response_logits
from stages.models import vlm as vm
from stages.tasks import rendered_text as rt
from stages.tasks.images import decode_all
from stages.train import vlm as tv

torch.set_num_threads(1)

SPEC = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_layers=2,
            num_heads=2, vision_hidden=16, vision_heads=2, vision_layers=1, max_positions=96)
LAYOUT = vm.Layout(sink_tokens=0, image_tokens=16)


@pytest.fixture(scope="module")
def page_world():
    """Six rendered pages (two of each kind) and a tiny pair-tokenizer VLM over them."""
    rows = rt.generate(rt.Config(), 6, seed=0, split="train")
    df = pl.DataFrame(rows, schema=rt.SCHEMA)
    tok = vm.build_tokenizer("pair", tv.tokenizer_texts("rendered_text", df, None, LAYOUT))
    torch.manual_seed(0)
    model, processor = vm.build_vlm(vm.Spec(**SPEC), LAYOUT, tok)
    model.eval()
    vlm = vm.VLM(model=model, processor=processor, layout=LAYOUT)
    images = decode_all(df["image"], df["id"], size=(32, 32), mode="L", source="t")
    return {"df": df, "vlm": vlm, "images": images,
            "pixels": vm.pixel_values(processor, images)}


def test_page_branch_is_llavas_own_forward_with_pixel_values(page_world):
    vlm, pairs = page_world["vlm"], sft.encode_pairs(page_world["vlm"], page_world["df"])
    pad = vlm.tokenizer.pad_token_id
    text, image, r_ids, r_mask = sft.batch_branches(vlm.model, pairs, page_world["pixels"],
                                                    [0, 3], pad)
    got = response_logits(vlm.model, image, r_ids, r_mask)
    prompt = pairs[0]["image"]
    full = vlm.model(input_ids=torch.tensor([prompt + pairs[0]["response"]]),
                     pixel_values=page_world["pixels"][:1]).logits
    n = len(pairs[0]["response"])
    torch.testing.assert_close(got[0, :n], full[0, len(prompt) - 1:len(prompt) - 1 + n])
    # both branches score the same response tokens (spec §6 pitfall)
    assert text.input_ids.shape[0] == image.inputs_embeds.shape[0] == r_ids.shape[0] == 2


def _grads(page_world, arm, core=CoReParams()):
    vlm = page_world["vlm"]
    pairs = sft.encode_pairs(vlm, page_world["df"])
    vlm.model.zero_grad(set_to_none=True)
    loss, parts = sft.arm_loss(arm, vlm.model, pairs, page_world["pixels"], [0, 1, 2, 3],
                               vlm.tokenizer.pad_token_id, core)
    loss.backward()
    tower = [p.grad for n, p in vlm.model.named_parameters() if "vision_tower" in n]
    return loss.item(), parts, any(g is not None and g.abs().max() > 0 for g in tower)


def test_what_each_sft_arm_trains(page_world):
    _, parts, tower = _grads(page_world, "text_sft")
    assert set(parts) == {"loss", "ce_txt"} and not tower         # the page is never read
    visual, parts, tower = _grads(page_world, "visual_sft")
    assert set(parts) == {"loss", "ce_img"} and tower
    core, parts, tower = _grads(page_world, "core_sft")
    assert tower and core == pytest.approx(parts["ce_img"] + parts["match"] + parts["ce_txt"],
                                           rel=1e-5)
    assert parts["ce_img"] == pytest.approx(visual, rel=1e-5) and parts["match"] > 0
    # lam = mu = 0: CoRe-SFT is visual SFT
    off, _, _ = _grads(page_world, "core_sft", CoReParams(lam=0.0, mu=0.0))
    assert off == pytest.approx(visual, rel=1e-5)


def test_a_few_sft_steps_move_the_model(page_world):
    vlm = vm.VLM(model=__import__("copy").deepcopy(page_world["vlm"].model),
                 processor=page_world["vlm"].processor, layout=LAYOUT)
    pairs = sft.encode_pairs(vlm, page_world["df"])
    cfg = sft.Config(steps=6, batch_size=4, lr=3e-3, log_every=3)
    m = sft.train_arm(cfg, "core_sft", vlm, pairs, page_world["pixels"], seed=0)
    assert m["final_loss"] < m["first_loss"]
    rows = sft.answer_rows(vlm, page_world["df"], page_world["images"], "core_sft", 0,
                           cfg.model_copy(update={"answer_tokens": 4}))
    assert len(rows) == 12 and {r["modality"] for r in rows} == {"text", "image"}
    frame = sft.answers_frame(rows)
    from stages.core.checks import check_schema
    check_schema(frame.schema, sft.answers_spec(), "answers.parquet")     # raises on a mismatch


@pytest.mark.parametrize("kwargs, named", [
    ({"core": {"granularity": "step"}}, "granularity"),
    ({"core": {"anchor": "ema"}}, "anchor"),
    ({"arms": ["visual_sft", "visual_sft"]}, "repeat"),
    ({"core": {"divergence": "js"}}, "divergence"),
])
def test_sft_config_refuses(kwargs, named):
    with pytest.raises(ValidationError, match=named):
        sft.Config(**kwargs)


@pytest.mark.parametrize("grpo_kwargs", [{"minibatches": 2, "prompts_per_round": 2},
                                         {"num_iterations": 2}, {"beta": 0.01}])
def test_grpo_config_refuses_rounds_scored_without_the_page(grpo_kwargs):
    with pytest.raises(ValidationError, match="minibatches = .* needs 1, 1, 0, 0"):
        grpo.Config(grpo={"minibatches": 1, "num_iterations": 1, **grpo_kwargs})
    grpo.Config(grpo={"minibatches": 1, "num_iterations": 1})


def test_grpo_reward_is_the_exact_verifier():
    reward = grpo.verifier_reward()
    got = reward(["p"] * 4, ["4", " 4 ", "23+45=68 #### 68", "23+45=68 #### 67"],
                 answer=["4", "4", "68", "68"], kind=["kv", "kv", "arith", "arith"])
    assert got == [1.0, 1.0, 1.0, 0.0]


def _answers(table: dict[str, dict[str, list[int]]]) -> pl.DataFrame:
    """{arm: {modality: per-item 0/1}} over one seed -> an answers frame."""
    rows = []
    for arm, by_mod in table.items():
        for mod, correct in by_mod.items():
            rows += [{"arm": arm, "seed": 0, "item": f"i{k}", "kind": "kv", "difficulty": 1,
                      "modality": mod, "completion": "", "correct": c, "nll": 1.0 - 0.5 * c}
                     for k, c in enumerate(correct)]
    return sft.answers_frame(rows)


def test_gap_recovery_and_claims_on_hand_made_answers():
    # text SFT on text 8/10, visual SFT on the page 2/10, CoRe-SFT on the page 5/10
    text = [1] * 8 + [0] * 2
    visual = [1] * 2 + [0] * 8
    core = [1] * 5 + [0] * 5
    answers = _answers({"text_sft": {"text": text, "image": visual},
                        "visual_sft": {"text": visual, "image": visual},
                        "core_sft": {"text": text, "image": core}})
    claim, g = compare.recovery_claim(answers, "core_sft", draws=500)
    assert g.value == pytest.approx((0.5 - 0.2) / (0.8 - 0.2)) and g.gap == pytest.approx(0.6)
    assert claim.paper_effect == 0.70 and claim.n == 10
    c = compare.accuracy_claim(answers, "text_sft", "text", "visual_sft", "image", draws=500)
    assert c.diff == pytest.approx(0.6) and c.name == "reproduced"
    c = compare.accuracy_claim(answers, "core_sft", "image", "visual_sft", "image", draws=500)
    assert c.diff == pytest.approx(0.3) and c.n == 10
    # on the answer's NLL (1 - c/2 per item: lower where right) the recovery is the same ratio
    claim, g = compare.recovery_claim(answers, "core_sft", draws=500, statistic="nll")
    assert g.value == pytest.approx(0.5)
    c = compare.accuracy_claim(answers, "core_sft", "image", "visual_sft", "image", draws=500,
                               statistic="nll", direction=-1)
    assert c.diff == pytest.approx(-0.15)
    # arms answering different items cannot be paired
    short = answers.filter(~((pl.col("arm") == "core_sft") & (pl.col("item") == "i0")))
    with pytest.raises(ValueError, match="different"):
        compare.accuracy_claim(short, "core_sft", "image", "visual_sft", "image", draws=100)
    # no gap (text SFT no better than visual SFT): gap recovery undefined, inconclusive
    flat = _answers({"text_sft": {"text": visual}, "visual_sft": {"image": visual},
                     "core_sft": {"image": core}})
    claim, g = compare.recovery_claim(flat, "core_sft", draws=100)
    assert math.isnan(g.value) and claim.name == "inconclusive"


# --- the pages stage: key->value pages asked by position -------------------------------------

def test_index_page_by_hand():
    import random

    from stages.core_align import pages

    page = pages.index_page(32, random.Random(0))
    content = page["content"]
    items = [content[i:i + 4] for i in range(0, 32, 4)]
    assert len(content) == 32 and len(items) == 8 == page["difficulty"]
    assert all(it[:2].isalpha() and it[:2].islower() and it[2:].isdigit() for it in items)
    assert len({it[:2] for it in items}) == 8                 # distinct keys
    j = int(page["query"].removeprefix("item "))
    assert page["query"] == f"item {j}" and 1 <= j <= 8
    assert page["answer"] == page["target"] == items[j - 1][2:]
    by_key = pages.index_page(32, random.Random(0), ask="key")
    key = by_key["query"].removeprefix("get ")
    assert by_key["content"] == content and by_key["answer"] == dict(
        (it[:2], it[2:]) for it in items)[key]


def test_pages_are_distinct_checked_and_drawn_as_the_vlm_pages(tmp_path):
    from stages.core.checks import validate_frame
    from stages.core_align import pages

    cfg = rt.Config()
    test = pages.generate(cfg, 5, 0, split="test")
    train = pages.generate(cfg, 20, 0, split="train",
                           exclude={r["content"] for r in test})
    assert not {r["content"] for r in test} & {r["content"] for r in train}
    assert len({r["content"] for r in train}) == 20
    assert pages.generate(cfg, 5, 0, split="test") == test          # deterministic
    validate_frame(pl.DataFrame(train, schema=rt.SCHEMA), pages.expectations("train"), "t")
    # the vlm data stage's page, redrawn: the same pixels with the same geometry, a named
    # error with another one
    (tmp_path / "rendered_text").mkdir()
    pl.DataFrame(rt.generate(cfg, 3, 0, split="test"), schema=rt.SCHEMA).write_parquet(
        tmp_path / "rendered_text" / "test.parquet")
    pages.check_geometry(cfg, tmp_path)
    with pytest.raises(ValueError, match="font_size, cell_w"):
        pages.check_geometry(rt.Config(font_size=8), tmp_path)
    # the renderer ignores patch_size: the visual-token count catches it
    with pytest.raises(ValueError, match="visual_tokens 4 here, 16 there"):
        pages.check_geometry(rt.Config(patch_size=16), tmp_path)


def test_load_split_reads_either_page_source_filtered_and_checked(tmp_path, page_world):
    from stages.core_align import pages

    cfg = rt.Config()
    (tmp_path / "rendered_text").mkdir()
    rows = rt.generate(cfg, 6, 0, split="val") + pages.generate(cfg, 4, 0, split="val")
    pl.DataFrame(rows, schema=rt.SCHEMA).write_parquet(tmp_path / "rendered_text" / "val.parquet")
    df, images = sft.load_split(tmp_path, "val", ["index"], 32, None)
    assert df["kind"].to_list() == ["index"] * 4 and len(images) == 4
    assert images[0].shape == (32, 32)                  # mode L, the model's size
    df, images = sft.load_split(tmp_path, "val", ["kv", "table"], 32, 3)
    assert set(df["kind"]) <= {"kv", "table"} and df.height == len(images) == 3
    with pytest.raises(ValueError, match="no rows of kinds"):
        sft.load_split(tmp_path, "val", ["nothing"], 32, None)
    from stages.tasks.images import ImageValidationError

    with pytest.raises(ImageValidationError, match="val.parquet: row index-val-000000"):
        sft.load_split(tmp_path, "val", ["index"], 64, None)     # 32x32 pages, a 64 model


def test_answer_room_is_checked_before_compute(page_world):
    tok = page_world["vlm"].tokenizer
    df = pl.DataFrame({"target": ["04", "23+45=68 #### 68"]})
    longest = len(tok("23+45=68 #### 68", add_special_tokens=False)["input_ids"])
    sft.check_answer_room(tok, [df], longest + 1, "answer_tokens")
    with pytest.raises(ValueError, match=f"answer_tokens = {longest}.*at least {longest + 1}"):
        sft.check_answer_room(tok, [df], longest, "answer_tokens")


@pytest.mark.parametrize("kwargs, named", [
    ({"sizes": {"train": 4, "test": 2}}, "expected exactly"),
    ({"sizes": {"train": 4, "val": 0, "test": 2}}, "at least one page"),
    ({"page": {"cols": 6, "rows": 3}}, "whole 4-character items"),
    ({"page": {"patch_size": 16}}, "one visual token only with"),
])
def test_pages_config_refuses(kwargs, named):
    from stages.core_align import pages

    with pytest.raises(ValidationError, match=named):
        pages.Config(**{"sizes": {"train": 4, "val": 2, "test": 2}, **kwargs})
