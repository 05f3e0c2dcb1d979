"""The tiny VLM (stages/models/vlm.py) and its training stage's pieces (stages/train/vlm.py).

Hand-computed prompt spans, the constant sinks, the eager-attention guard, save/load identity
through the Auto classes (the same path a real local LLaVA takes), left padding, patch targets,
a few real training steps, and malformed params / images named before compute."""

from __future__ import annotations

import shutil

import numpy as np
import polars as pl
import pytest
import torch
from pydantic import ValidationError

from stages.models import vlm as vm
from stages.tasks import rendered_text as rt
from stages.tasks import shapes
from stages.tasks.images import ImageValidationError
from stages.train import vlm as tv

torch.set_num_threads(1)

SPEC = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, vision_hidden=16,
            vision_heads=2, max_positions=128)
QUERY = "is there a red circle ?"


@pytest.fixture(scope="module")
def world():
    """A few shapes images with their questions, and a word tokenizer over them."""
    cfg = shapes.Config()
    rows = shapes.generate(cfg, 6, seed=0, split="train")
    freq, cooc = shapes.train_statistics(r["objects"] for r in rows)
    df = pl.DataFrame(rows, schema=shapes.SCHEMA)
    qa = pl.DataFrame(shapes.questions(cfg, rows, freq, cooc, 0, "train"),
                      schema=shapes.QUESTION_SCHEMA)
    layout = vm.Layout()
    tok = vm.build_tokenizer("word", tv.tokenizer_texts("shapes", df, qa, layout) + [QUERY])
    from stages.tasks.images import decode_all
    images = decode_all(df["image"], df["id"], size=(64, 64), mode="RGB", source="t")
    return {"df": df, "qa": qa, "tok": tok, "layout": layout, "images": images}


def tiny(world, **spec):
    torch.manual_seed(0)
    model, processor = vm.build_vlm(vm.Spec(**{**SPEC, **spec}), world["layout"], world["tok"])
    model.eval()
    return vm.VLM(model=model, processor=processor, layout=world["layout"],
                  sink_norm=vm.Spec().sink_norm)


# --- prompts and spans ------------------------------------------------------------------------

def test_spans_hand_computed(world):
    tok, layout = world["tok"], world["layout"]
    ids = vm.encode_image_prompt(layout, tok, QUERY)
    # <bos> image : | <sink> <sink> <image> x 64 | is there a red circle ? | answer :
    assert len(ids) == 3 + 2 + 64 + 6 + 2
    s = vm.prompt_spans(ids, tok, layout, QUERY)
    assert (s.v0, s.v1, s.q0, s.q1, s.length) == (3, 68, 69, 74, 77)
    assert s.sinks == (3, 4) and s.patches == slice(5, 69)
    assert tok.convert_ids_to_tokens(ids[s.query]) == QUERY.split()
    assert tok.convert_ids_to_tokens(ids[s.q1 + 1:]) == ["answer", ":"]
    # the processor (what a real LLaVA goes through) gives exactly these ids
    vlm = tiny(world)
    batch = vlm.processor(images=[world["images"][0]], text=[vm.image_prompt(layout, QUERY)],
                          return_tensors="pt")
    assert batch["input_ids"][0].tolist() == ids


def test_spans_follow_left_padding(world):
    tok, layout = world["tok"], world["layout"]
    ids = vm.encode_image_prompt(layout, tok, QUERY)
    padded, _ = vm.left_pad([ids, ids + [tok.convert_tokens_to_ids("?")] * 3], tok.pad_token_id)
    s0 = vm.prompt_spans(padded[0].tolist(), tok, layout)
    s = vm.prompt_spans(ids, tok, layout)
    assert (s0.v0, s0.v1, s0.q0, s0.q1) == (s.v0 + 3, s.v1 + 3, s.q0 + 3, s.q1 + 3)


def test_template_change_is_caught(world):
    tok, layout = world["tok"], world["layout"]
    ids = vm.encode_image_prompt(layout, tok, QUERY)
    with pytest.raises(vm.PromptSpanError, match="does not end with the tail"):
        vm.prompt_spans(ids[:-1], tok, layout)
    with pytest.raises(vm.PromptSpanError, match="decodes to"):
        vm.prompt_spans(ids, tok, layout, "is there a blue circle ?")
    with pytest.raises(vm.PromptSpanError, match="1 sink"):
        vm.prompt_spans(ids[:3] + ids[4:], tok, layout)
    with pytest.raises(vm.PromptSpanError, match="no <image>"):
        vm.prompt_spans(tok(vm.text_prompt(layout, "ab=1", "get ab"))["input_ids"], tok, layout)


# --- sinks, attention ---------------------------------------------------------------------------

def test_sinks_are_constant_high_norm_visual_tokens(world):
    vlm = tiny(world)
    tok = world["tok"]
    emb = vlm.model.get_input_embeddings().weight
    sink = emb[vm.sink_ids(tok)]
    assert sink.norm().item() == pytest.approx(20.0, rel=1e-5)
    typical = emb.norm(dim=-1).median().item()
    assert sink.norm().item() > 20 * typical
    assert torch.equal(sink, vm.sink_vectors(1, 32, 20.0)[0])
    # in a prompt, both sink positions carry that vector, whatever the image
    ids = torch.tensor([vm.encode_image_prompt(world["layout"], tok, QUERY)])
    embeds = vlm.model.get_input_embeddings()(ids)[0]
    assert torch.equal(embeds[3], sink) and torch.equal(embeds[4], sink)


def test_eager_guard(world, tmp_path):
    vlm = tiny(world)
    vm.require_eager(vlm.model)
    vm.save_vlm(vlm, tmp_path / "m")
    loaded = vm.load_vlm(tmp_path / "m", attn_implementation="sdpa")
    with pytest.raises(vm.EagerAttentionRequired, match="'sdpa' attention"):
        vm.require_eager(loaded.model)
    eager = vm.load_vlm(tmp_path / "m")
    vm.require_eager(eager.model)
    ids = torch.tensor([vm.encode_image_prompt(world["layout"], world["tok"], QUERY)])
    pixels = vm.pixel_values(eager.processor, world["images"][:1])
    out = eager.model(input_ids=ids, pixel_values=pixels, output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (1, 2, 77, 77)
    assert torch.allclose(out.attentions[0].sum(-1), torch.ones(1, 2, 77), atol=1e-5)


# --- save / load --------------------------------------------------------------------------------

def test_save_load_round_trip_identical_logits(world, tmp_path):
    vlm = tiny(world)
    ids = torch.tensor([vm.encode_image_prompt(world["layout"], world["tok"], QUERY)])
    pixels = vm.pixel_values(vlm.processor, world["images"][:1])
    with torch.no_grad():
        before = vlm.model(input_ids=ids, pixel_values=pixels).logits
    vm.save_vlm(vlm, tmp_path / "m")
    assert {"model.safetensors", "config.json", "processor_config.json", vm.LAYOUT_FILE} <= {
        p.name for p in (tmp_path / "m").iterdir()}
    loaded = vm.load_vlm(tmp_path / "m")
    assert type(loaded.model).__name__ == "LlavaForConditionalGeneration"
    assert loaded.layout == world["layout"] and loaded.sink_norm == 20.0
    with torch.no_grad():
        after = loaded.model(input_ids=ids,
                             pixel_values=vm.pixel_values(loaded.processor, world["images"][:1]))
    assert torch.equal(before, after.logits)
    # the gpu path: a folder without our layout file (a real LLaVA) needs the layout as a param
    bare = tmp_path / "bare"
    shutil.copytree(tmp_path / "m", bare)
    (bare / vm.LAYOUT_FILE).unlink()
    with pytest.raises(ValueError, match="no paperline_vlm.json; pass the prompt layout"):
        vm.load_vlm(bare)
    real = vm.load_vlm(bare, layout=world["layout"].model_dump())
    with torch.no_grad():
        again = real.model(input_ids=ids,
                           pixel_values=vm.pixel_values(real.processor, world["images"][:1]))
    assert torch.equal(before, again.logits) and real.sink_norm is None
    with pytest.raises(FileNotFoundError, match="no config.json"):
        vm.load_vlm(tmp_path / "nothing")


def test_left_padded_batch_equals_one_by_one(world):
    vlm = tiny(world)
    tok, layout = world["tok"], world["layout"]
    prompts = [vm.encode_image_prompt(layout, tok, QUERY),
               vm.encode_image_prompt(layout, tok, "describe the image .")]
    assert len(prompts[0]) != len(prompts[1])
    ids, mask = vm.left_pad(prompts, tok.pad_token_id)
    pixels = vm.pixel_values(vlm.processor, world["images"][:2])
    with torch.no_grad():
        together = vlm.model(input_ids=ids, attention_mask=mask, pixel_values=pixels).logits
        for i, p in enumerate(prompts):
            alone = vlm.model(input_ids=torch.tensor([p]), pixel_values=pixels[i:i + 1]).logits
            assert torch.allclose(together[i, -1], alone[0, -1], atol=1e-5)
    out = vm.generate(vlm, prompts, world["images"][:2], max_new_tokens=3)
    assert out == [vm.generate(vlm, [p], [im], max_new_tokens=3)[0]
                   for p, im in zip(prompts, world["images"][:2])]


def test_text_only_prompt_runs_without_images(world):
    vlm = tiny(world)
    ids = world["tok"](vm.text_prompt(world["layout"], "a red circle", QUERY))["input_ids"]
    assert world["tok"].convert_tokens_to_ids(vm.IMAGE_TOKEN) not in ids
    assert len(vm.generate(vlm, [ids], None, max_new_tokens=2)) == 1


# --- training pieces ----------------------------------------------------------------------------

def test_patch_targets_hand_computed(world):
    tok = world["tok"]
    df = pl.DataFrame({"objects": [["red circle"]], "xs": [[16]], "ys": [[16]], "sizes": [[16]]})
    t = tv.patch_targets("shapes", df, tok, vm.Spec(), (4, 8))
    assert t.shape == (1, 64, 2)
    named = {i for i in range(64) if t[0, i, 0] != tok.pad_token_id}
    assert named == {9, 10, 17, 18}           # the 2x2 patches around pixel (16, 16)
    assert tok.convert_ids_to_tokens(t[0, 9].tolist()) == ["red", "circle"]
    # a 32x32 page, 8x8 patches over 4x8 cells: each visual token shows two characters,
    # one pair token; the page's 9th character starts line 2 (visual token 4)
    ptok = vm.build_tokenizer("pair", ["ab=17 cd=4", " "])
    page = pl.DataFrame({"content": ["ab=17 cd=4"]})
    t = tv.patch_targets("rendered_text", page, ptok, vm.Spec(image_size=32), (4, 8))
    assert t.shape == (1, 16, 1)
    assert ptok.convert_ids_to_tokens(t[0, :6, 0].tolist()) == ["ab", "=1", "7 ", "cd",
                                                                "=4", "  "]
    # the same characters as text: token j of the transcription is visual token j's target
    assert ptok("ab=17 cd=4", add_special_tokens=False)["input_ids"] == t[0, :5, 0].tolist()
    ctok = vm.build_tokenizer("char", ["ab=17 cd=4"])
    t = tv.patch_targets("rendered_text", page, ctok, vm.Spec(image_size=32), (4, 8))
    assert t.shape == (1, 16, 2) and ctok.convert_ids_to_tokens(t[0, 1].tolist()) == ["=", "1"]


def test_training_steps_move_the_model_but_not_the_sinks(world):
    cfg = tv.Config(family="shapes", out="x", steps=3, batch_size=4, lr=1e-2, seeds=[0],
                    spec=vm.Spec(**SPEC), log_every=1, weight_decay=0.1)
    tok = world["tok"]
    torch.manual_seed(0)
    vlm = tv.initial_vlm(cfg, tok)
    before = {k: v.clone() for k, v in vlm.model.state_dict().items()}
    examples = tv.build_examples(cfg, "shapes", world["df"], world["qa"], tok)
    assert len(examples) == 6 + world["qa"].height
    targets = tv.patch_targets("shapes", world["df"], tok, cfg.spec, cfg.text_cell)
    m = tv.train_one(cfg, vlm, examples, world["images"], 0, targets=targets)
    assert m["train_steps"] == 3 and np.isfinite(m["train_loss"]) and np.isfinite(m["aux_loss"])
    after = vlm.model.state_dict()
    assert set(after) == set(before)                    # the auxiliary head is gone
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert any("vision_tower" in k for k in changed) and any("layers.1" in k for k in changed)
    emb = vlm.model.get_input_embeddings().weight
    assert torch.equal(emb[vm.sink_ids(tok)], vm.sink_vectors(1, 32, 20.0)[0])


def test_rendered_text_examples_are_ocr_and_text_answers():
    cfg = tv.Config(family="rendered_text", out="x", tokenizer="pair",
                    spec=vm.Spec(image_size=32, **SPEC),
                    layout=vm.Layout(sink_tokens=0, image_tokens=16))
    rows = rt.generate(rt.Config(), 3, seed=0)
    df = pl.DataFrame(rows, schema=rt.SCHEMA)
    tok = vm.build_tokenizer("pair", tv.tokenizer_texts("rendered_text", df, None, cfg.layout))
    ex = tv.build_examples(cfg, "rendered_text", df, None, tok)
    assert [e["img"] for e in ex] == [0, -1, 1, -1, 2, -1]
    ocr = [t for t in ex[0]["labels"] if t != -100]
    assert tok.decode(ocr, skip_special_tokens=True) == rows[0]["content"]
    assert len(ocr) == 16 + 1                 # 32 characters = 16 pair tokens (+ <eos>)
    first = next(i for i, t in enumerate(ex[1]["labels"]) if t != -100)
    assert tok.decode(ex[1]["input_ids"][:first], skip_special_tokens=True) == vm.text_prompt(
        cfg.layout, rows[0]["content"], rows[0]["query"])
    # the content's tokens are the same in the text prompt and in the transcription
    assert ocr[:-1] == ex[1]["input_ids"][1 + len(tok("text :", add_special_tokens=False)[
        "input_ids"]):][:16]


@pytest.mark.parametrize("kwargs, message", [
    ({"spec": {"image_size": 60}}, "not a multiple of patch_size"),
    ({"spec": {"hidden_size": 130}}, "not divisible by its heads"),
    ({"layout": {"image_tokens": 16}}, "layout.image_tokens = 16 but spec gives 64"),
    ({"init": "pretrained"}, "needs pretrained_path"),
    ({"seeds": [0, 0]}, "repeat"),
    ({"caption_repeats": 0, "question_repeats": 0}, "nothing to train"),
    ({"family": "poems"}, "family"),
])
def test_bad_train_params_are_named(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        tv.Config(**{"family": "shapes", "out": "x", **kwargs})


def test_malformed_image_stops_loading_before_compute(tmp_path):
    cfg = shapes.Config()
    rows = shapes.generate(cfg, 3, seed=0, split="train")
    rows[2]["image"] = rows[2]["image"][:30]
    freq, cooc = shapes.train_statistics(r["objects"] for r in rows)
    (tmp_path / "shapes").mkdir()
    pl.DataFrame(rows, schema=shapes.SCHEMA).write_parquet(tmp_path / "shapes/train.parquet")
    pl.DataFrame(shapes.questions(cfg, rows, freq, cooc, 0, "train"),
                 schema=shapes.QUESTION_SCHEMA).write_parquet(
        tmp_path / "shapes/train_questions.parquet")
    with pytest.raises(ImageValidationError, match="row shapes-train-000002: column 'image'"):
        tv.load_family(tmp_path, "shapes", "train", 64)
