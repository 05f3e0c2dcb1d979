"""GIFT's method core on hand-computed values, its attention hook on a tiny random Llama fed
`inputs_embeds`, and the CHAIR / POPE counting."""

from __future__ import annotations

import math

import pytest
import torch

from stages.gift import gift
from stages.gift.gift import Spans

torch.set_num_threads(1)


# --- phase 1 -------------------------------------------------------------------------------------

def _two_head_attention() -> torch.Tensor:
    """S = 5: [system 0][visual 1, 2][query 3, 4]; only rows 2-4 x columns 1-2 matter."""
    a = torch.zeros(2, 5, 5)
    a[0, 2, 1:3] = torch.tensor([0.2, 0.3])
    a[0, 3, 1:3] = torch.tensor([0.4, 0.1])  # shift (+0.2, -0.2 -> 0)
    a[0, 4, 1:3] = torch.tensor([0.3, 0.5])  # shift (-0.1 -> 0, +0.4)
    a[1, 2, 1:3] = torch.tensor([0.1, 0.1])
    a[1, 3, 1:3] = torch.tensor([0.1, 0.2])  # shift (0, +0.1)
    a[1, 4, 1:3] = torch.tensor([0.7, 0.0])  # shift (+0.6, -0.2 -> 0)
    return a


SPANS5 = Spans(v0=1, v1=2, q0=3, q1=4)


def test_gaze_shift_keeps_positive_increases_and_compares_q0_with_the_row_before():
    delta = gift.gaze_shift(_two_head_attention(), SPANS5)
    expected = torch.tensor([[[0.2, 0.0], [0.0, 0.4]],
                             [[0.0, 0.1], [0.6, 0.0]]])
    assert torch.allclose(delta, expected, atol=1e-7)


def test_saliency_keeps_the_top_half_of_heads_ranked_over_informative_tokens():
    attn = [_two_head_attention()]
    # all tokens: head sums 0.6 vs 0.7 -> head 1; s_j = mean over its two rows
    assert torch.allclose(gift.saliency(attn, SPANS5, [0]), torch.tensor([0.3, 0.05]))
    # only the first query token: head sums 0.2 vs 0.1 -> head 0 wins now
    first = torch.tensor([True, False])
    assert torch.allclose(gift.saliency(attn, SPANS5, [0], first), torch.tensor([0.2, 0.0]))
    second = torch.tensor([False, True])
    assert torch.allclose(gift.saliency(attn, SPANS5, [0], second), torch.tensor([0.6, 0.0]))
    # no informative token at all: every query token counts
    none = torch.tensor([False, False])
    assert torch.allclose(gift.saliency(attn, SPANS5, [0], none), torch.tensor([0.3, 0.05]))


def test_top_heads_and_informative_words():
    assert gift.top_heads(torch.tensor([0.1, 0.9, 0.5, 0.7])).tolist() == [1, 3]
    mask = gift.informative_mask(["Is", "there", "a", "Red", "circle?"], {"red", "circle"})
    assert mask.tolist() == [False, False, False, True, True]
    with pytest.raises(ValueError, match="H >= 2"):
        gift.top_heads(torch.tensor([1.0]))


def test_clip_to_three_sigma_then_min_max_scale():
    s = torch.tensor([0.0] * 18 + [1.0, 100.0], dtype=torch.float64)
    mu = 101 / 20
    sigma = math.sqrt((1 + 100 ** 2) / 20 - mu ** 2)  # population sigma
    top = mu + 3 * sigma  # ~70.4: 100 is clipped to it; the lower bound (< 0) clips nothing
    s_hat = gift.clip_and_scale(s)
    assert s_hat[:18].abs().max() == 0 and s_hat[19] == pytest.approx(1.0)
    assert s_hat[18].item() == pytest.approx(1 / top, rel=1e-9)  # 0.0142, not 0.01 unclipped
    assert gift.clip_and_scale(torch.full((4,), 0.3)).abs().max() == 0  # constant: no boost


def test_multiplier_is_exp_alpha_s_hat():
    m = gift.multiplier(torch.tensor([0.0, 0.5, 1.0]), alpha=2.0)
    assert torch.allclose(m, torch.tensor([1.0, math.e, math.e ** 2]))
    assert gift.multiplier(torch.tensor([1.0]), alpha=5.0).item() == pytest.approx(148.41, rel=1e-4)


def test_layer_rule_picks_the_middle_layer_with_most_change_and_the_next_40_percent():
    change = torch.tensor([5.0, 1, 3, 9, 2, 8, 0, 0])  # layer 0 is outside the middle window
    assert gift.choose_layers(change) == (3, [4, 5, 6])
    assert gift.choose_layers(torch.tensor([9.0, 1, 2, 0])) == (2, [3])
    assert gift.choose_layers(change, enhance_fraction=0.25, window=(0.0, 0.25)) == (0, [1, 2])


# --- phase 2 -------------------------------------------------------------------------------------

# 2 heads, [system 0][visual 1, 2, 3][query 4, 5]
ROW = torch.tensor([[0.10, 0.3, 0.1, 0.1, 0.20, 0.2],    # visual mass 0.5, query 0.40
                    [0.35, 0.1, 0.1, 0.0, 0.15, 0.3]],   # visual mass 0.2, query 0.45
                   dtype=torch.float64)
SPANS6 = Spans(v0=1, v1=3, q0=4, q1=5)
M = torch.tensor([2.0, 1.0, 3.0])


def test_enhance_row_by_hand():
    row, r = gift.enhance_row(ROW, M, SPANS6)
    # hv = head 0: visual (0.3, 0.1, 0.1) * (2, 1, 3) = (0.6, 0.1, 0.3), mass 0.5 -> 1.0, r = 2
    assert r.dim() == 0 and r.item() == pytest.approx(2.0)
    # ht = head 1 (query 0.45 > 0.40; not hv): query (0.15, 0.3) * 2 = (0.3, 0.6)
    head0 = torch.tensor([0.1, 0.6, 0.1, 0.3, 0.2, 0.2]) / 1.5
    head1 = torch.tensor([0.35, 0.1, 0.1, 0.0, 0.3, 0.6]) / 1.45
    assert torch.allclose(row, torch.stack([head0, head1]).float(), atol=1e-6)
    assert torch.allclose(row.sum(-1), torch.ones(2), atol=1e-6)


def test_visual_only_leaves_the_query_to_renormalisation_alone():
    row, r = gift.enhance_row(ROW, M, SPANS6, visual_only=True)
    assert r.item() == pytest.approx(2.0)  # computed, not used
    boosted_sum = torch.tensor([1.5, 1.0])  # head 0 boosted, head 1 untouched
    assert torch.allclose(row[:, 4:], (ROW[:, 4:] / boosted_sum[:, None]).float(), atol=1e-6)
    assert torch.allclose(row[1], ROW[1].float(), atol=1e-6)
    assert torch.allclose(row.sum(-1), torch.ones(2), atol=1e-6)


def test_vaf_row_scales_each_visual_token_by_one_plus_alpha_times_its_attention():
    row = gift.vaf_row(ROW, SPANS6, alpha=1.0)
    # spec §4: a_j (1 + alpha a_j). head 0: (0.3, 0.1, 0.1) -> (0.39, 0.11, 0.11), row sum 1.11
    head0 = torch.tensor([0.1, 0.39, 0.11, 0.11, 0.2, 0.2]) / 1.11
    # head 1: (0.1, 0.1, 0.0) -> (0.11, 0.11, 0.0), row sum 1.02
    head1 = torch.tensor([0.35, 0.11, 0.11, 0.0, 0.15, 0.3]) / 1.02
    assert torch.allclose(row, torch.stack([head0, head1]).float(), atol=1e-6)


def test_vaf_row_boosts_the_sink_most_the_reviewers_hand_case():
    # one head, [sink 0][patch 1][query 2]: visual (0.5, 0.1), query 0.4, alpha = 1
    a = torch.tensor([[0.5, 0.1, 0.4]])
    row = gift.vaf_row(a, Spans(v0=0, v1=1, q0=2, q1=2), alpha=1.0)
    boosted = torch.tensor([[0.75, 0.11, 0.4]])                # before renormalising
    assert torch.allclose(row, boosted / 1.26, atol=1e-6)
    before = (a[0, 0] / a[0, :2].sum()).item()                 # the sink's share: 0.833
    share = (row[0, 0] / row[0, :2].sum()).item()
    assert share == pytest.approx(0.75 / 0.86) and share > before + 0.03
    # a uniform factor (the old a + alpha |a|) would have kept the share at 0.833
    assert torch.equal(gift.vaf_row(a, Spans(v0=0, v1=1, q0=2, q1=2), alpha=0.0), a)


def test_enhancement_at_alpha_zero_changes_nothing():
    row, r = gift.enhance_row(ROW, torch.ones(3), SPANS6)
    assert r.item() == pytest.approx(1.0) and torch.allclose(row, ROW.float(), atol=1e-7)


def test_bad_spans_and_multipliers_are_named():
    with pytest.raises(ValueError, match="v1 < q0"):
        Spans(v0=1, v1=4, q0=4, q1=5)
    with pytest.raises(ValueError, match="3 visual tokens"):
        gift.enhance_row(ROW, torch.ones(2), SPANS6)


# --- the hook on a tiny random Llama -------------------------------------------------------------

SPANS = Spans(v0=1, v1=6, q0=7, q1=9)  # [system 0][visual 1-6][query 7-9][tail 10, 11]


def _llama(attn: str = "eager"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, initializer_range=0.2,
                         attn_implementation=attn)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama():
    model = _llama()
    embeds = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(1))
    attentions = gift.prefill_attentions(model, inputs_embeds=embeds)
    saliency_layer, enhance_layers = gift.choose_layers(
        gift.positive_change_per_layer(attentions, SPANS))
    s_hat = gift.clip_and_scale(gift.saliency(attentions, SPANS, [saliency_layer]))
    return model, embeds, attentions, enhance_layers, s_hat


def _greedy(model, embeds):
    with torch.no_grad():
        return model.generate(inputs_embeds=embeds, max_new_tokens=10, do_sample=False,
                              pad_token_id=0)[0].tolist()


def test_hook_at_alpha_zero_generates_greedy_token_for_token(llama):
    model, embeds, _, layers, s_hat = llama
    plain = _greedy(model, embeds)
    assert len(set(plain)) > 1  # a degenerate one-token loop would prove little
    with gift.attention_hook(model, layers, gift.gift_edit(SPANS, gift.multiplier(s_hat, 0.0))):
        assert _greedy(model, embeds) == plain


def test_hook_at_alpha_five_edits_rows_in_the_enhancement_layers_only(llama):
    model, embeds, plain, layers, s_hat = llama
    assert layers and min(layers) >= 1
    m = gift.multiplier(s_hat, 5.0)
    with torch.no_grad():
        base_logits = model(inputs_embeds=embeds).logits
        with gift.attention_hook(model, layers, gift.gift_edit(SPANS, m)):
            hooked = model(inputs_embeds=embeds, output_attentions=True)
            hooked_tokens = _greedy(model, embeds)
    first = min(layers)
    for layer in range(4):
        before, after = plain[layer][0], hooked.attentions[layer][0]
        if layer < first:
            assert torch.equal(before, after)
        assert torch.allclose(after[:, -1].sum(-1), torch.ones(4), atol=1e-5)
        assert torch.equal(before[:, :-1], after[:, :-1])  # only the last position's row
    # the first enhancement layer's input is unchanged: its row is exactly enhance_row's
    expected, _ = gift.enhance_row(plain[first][0, :, -1], m, SPANS)
    assert torch.allclose(hooked.attentions[first][0, :, -1], expected, atol=1e-6)
    assert not torch.allclose(hooked.attentions[first][0, :, -1], plain[first][0, :, -1])
    # the edited mixture reaches the output at the last position and nowhere else
    assert torch.allclose(hooked.logits[0, :-1], base_logits[0, :-1], atol=1e-5)
    assert not torch.allclose(hooked.logits[0, -1], base_logits[0, -1], atol=1e-4)
    assert hooked_tokens != _greedy(model, embeds)  # alpha = 5 changes this seed's caption
    # leaving the block restores the model exactly
    with torch.no_grad():
        assert torch.equal(model(inputs_embeds=embeds).logits, base_logits)
    assert all(not hasattr(mod, "gift_edit") for mod in gift.attention_modules(model).values())


def test_hook_refuses_sdpa_batches_and_unknown_layers(llama):
    model, embeds, _, layers, s_hat = llama
    edit = gift.gift_edit(SPANS, gift.multiplier(s_hat, 5.0))
    with pytest.raises(ValueError, match="attn_implementation='eager'"), \
            gift.attention_hook(_llama("sdpa"), layers, edit):
        pass
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        gift.prefill_attentions(_llama("sdpa"), inputs_embeds=embeds)
    with pytest.raises(ValueError, match="not found: \\[7\\]"), \
            gift.attention_hook(model, [7], edit):
        pass
    with pytest.raises(ValueError, match="batch 1"), \
            gift.attention_hook(model, layers, edit), torch.no_grad():
        model(inputs_embeds=embeds.repeat(2, 1, 1))


# --- the arms on the tiny VLM (stages/gift/arms.py) ----------------------------------------------

@pytest.fixture(scope="module")
def tiny_vlm():
    """A randomly initialised tiny LLaVA (4 layers, 2 sinks) and three shapes images."""
    import polars as pl

    from stages.models import vlm as vm
    from stages.tasks import shapes
    from stages.tasks.images import decode_all
    from stages.train import vlm as tv

    cfg = shapes.Config()
    rows = shapes.generate(cfg, 3, seed=0, split="train")
    freq, cooc = shapes.train_statistics(r["objects"] for r in rows)
    df = pl.DataFrame(rows, schema=shapes.SCHEMA)
    qa = pl.DataFrame(shapes.questions(cfg, rows, freq, cooc, 0, "train"),
                      schema=shapes.QUESTION_SCHEMA)
    layout = vm.Layout()
    tok = vm.build_tokenizer("word", tv.tokenizer_texts("shapes", df, qa, layout))
    torch.manual_seed(0)
    spec = vm.Spec(hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                   vision_hidden=16, vision_heads=2, max_positions=128)
    model, processor = vm.build_vlm(spec, layout, tok)
    model.eval()
    vlm = vm.VLM(model=model, processor=processor, layout=layout, sink_norm=spec.sink_norm)
    images = decode_all(df["image"], df["id"], size=(64, 64), mode="RGB", source="t")
    prompts = [vm.encode_image_prompt(layout, tok, q) for q in df["query"]]
    return vlm, prompts, images, set(cfg.colours) | set(cfg.shapes)


def _decode(tiny_vlm, arm, alpha, **kw):
    from stages.gift import arms

    vlm, prompts, images, lexicon = tiny_vlm
    return arms.decode(vlm, prompts, images, arm=arm, alpha=alpha, saliency_layer=1,
                       enhance_layers=[2, 3], lexicon=lexicon, max_new_tokens=6, **kw)


def test_every_arm_at_alpha_zero_equals_greedy_token_for_token_on_the_vlm(tiny_vlm):
    greedy = _decode(tiny_vlm, "greedy", 0.0)
    assert any(greedy)                                   # something was generated
    for arm in ("vaf", "gift_visual", "gift"):
        assert _decode(tiny_vlm, arm, 0.0) == greedy, arm
    # ... and the equality is not vacuous: a large alpha does change what the model says
    assert _decode(tiny_vlm, "gift", 50.0) != greedy


def test_batched_edit_equals_one_sample_at_a_time(tiny_vlm):
    """A batch of three gets each sample's own multiplier: the same tokens as three batches of
    one (where the single-sample hook path runs)."""
    batched = _decode(tiny_vlm, "gift", 7.0, batch_size=3)
    assert batched == _decode(tiny_vlm, "gift", 7.0, batch_size=1)


def test_the_hook_changes_the_vlm_attention_rows(tiny_vlm):
    from stages.gift import arms
    from stages.models import vlm as vm

    vlm, prompts, images, lexicon = tiny_vlm
    batch = arms.inputs(vlm, prompts, images)
    spans = arms.batch_spans(vlm, prompts)
    assert spans.n_visual == 2 + 64 and spans.sinks == (spans.v0, spans.v0 + 1)
    m = arms.multipliers(vlm, batch, spans, 1, 5.0, None)
    assert m.shape == (3, 66) and float(m.max()) == pytest.approx(math.exp(5.0), rel=1e-5)
    edit = gift.BatchEdit([gift.gift_edit(spans, m[b]) for b in range(3)])
    with torch.no_grad():
        plain = vlm.model(**batch, output_attentions=True).attentions
        with gift.attention_hook(vlm.model, [2], edit):
            hooked = vlm.model(**batch, output_attentions=True).attentions
    assert torch.equal(plain[1], hooked[1])                      # layer 1 is not enhanced
    assert not torch.allclose(plain[2][:, :, -1], hooked[2][:, :, -1])
    assert torch.allclose(hooked[2][:, :, -1].sum(-1), torch.ones(3, 4))   # renormalised
    vm.require_eager(vlm.model)                                  # restored on exit


def test_calibrate_refuses_the_test_split_and_picks_alpha_by_hand():
    from pydantic import ValidationError

    from stages.gift import calibrate

    with pytest.raises(ValidationError, match="never on test"):
        calibrate.Config(split="test")
    with pytest.raises(ValidationError, match="finite number >= 0"):
        calibrate.Config(alpha_grid=[1.0, -2.0])
    with pytest.raises(ValidationError, match="vaf_alpha_grid"):
        calibrate.Config(vaf_alpha_grid=[math.inf])
    # VAF's alpha multiplies attention weights in [0, 1] (a patch ~0.01): its grid reaches far
    # beyond GIFT's exponent grid
    cfg = calibrate.Config()
    assert max(cfg.vaf_alpha_grid) * 0.01 >= 1.0 and max(cfg.alpha_grid) <= 7.0
    results = {1.0: {"chair_sentence": 0.5, "recall": 0.80},
               3.0: {"chair_sentence": 0.3, "recall": 0.75},
               5.0: {"chair_sentence": 0.1, "recall": 0.50}}   # fewest hallucinations, says less
    assert calibrate.pick_alpha(results, greedy_recall=0.8, tolerance=0.1) == 3.0
    assert calibrate.pick_alpha(results, greedy_recall=0.8, tolerance=0.5) == 5.0
    assert calibrate.pick_alpha(results, greedy_recall=0.99, tolerance=0.0) == 1.0


def test_pope_claims_untestable_only_when_greedy_answers_constantly():
    import polars as pl

    from stages.gift.compare import constant_answers

    def pope(yes_by_seed):
        return pl.DataFrame({"arm": ["greedy"] * 6 + ["gift"] * 2,
                             "seed": [0, 0, 0, 1, 1, 1, 0, 0],
                             "pred_yes": [*yes_by_seed[0], *yes_by_seed[1], 1, 0]})

    assert constant_answers(pope([(0, 0, 0), (1, 1, 1)]))      # always no, then always yes
    assert not constant_answers(pope([(0, 0, 0), (1, 0, 1)]))  # seed 1 discriminates
    assert not constant_answers(pope([(0, 0, 0), (1, 1, 1)]).filter(pl.col("arm") == "gift"))


def test_table_cell_says_over_how_many_seeds():
    from stages.gift.compare import _cell

    m = {"a/f1_mean": 0.6667, "a/f1_std": 0.0, "a/f1_n": 1.0,
         "b/f1_mean": 0.5, "b/f1_std": 0.1, "b/f1_n": 3.0, "c/f1_mean": math.nan, "c/f1_n": 0.0}
    assert _cell(m, "a/f1", 3) == "0.667 (1/3)"
    assert _cell(m, "b/f1", 3) == "0.500 ± 0.100"
    assert _cell(m, "c/f1", 3) == "undefined"


# --- compare: the claims' statistics -------------------------------------------------------------

def test_stratified_bootstrap_keeps_each_seeds_pairs_and_the_pairing():
    """Seed 0 (3 images): every image's CHAIR-like ratio is 0.5 higher on the method; seed 1 (2
    images): no difference; the baseline varies image to image. Resampling images within each
    seed, with the same draw on both arms, every draw's difference is the weighted mean
    (3 x 0.5 + 2 x 0) / 5 = 0.3 exactly; pooling the pairs lets the seed mix vary."""
    from stages.evaluate.hallucination import paired_ratio_bootstrap

    def stratified_ratio_bootstrap(strata, *columns, **kw):
        return paired_ratio_bootstrap(*columns, strata=strata, **kw)

    seeds = [0, 0, 0, 1, 1]
    nb = [0.0, 1.0, 0.0, 1.0, 2.0]
    nm = [1.0, 2.0, 1.0, 1.0, 2.0]
    den = [2.0] * 5
    diff, low, high, per_pair = stratified_ratio_bootstrap(seeds, nm, den, nb, den, draws=500)
    assert diff == pytest.approx(0.3) and low == pytest.approx(0.3) and high == pytest.approx(0.3)
    assert sum(per_pair) / 5 == pytest.approx(0.3)
    _, pooled_low, pooled_high, _ = paired_ratio_bootstrap(nm, den, nb, den, draws=500)
    assert pooled_low < 0.3 - 0.05 and pooled_high > 0.3 + 0.05
    # relative: the point estimate is the difference over the baseline's ratio (4 / 10)
    rel, *_ = stratified_ratio_bootstrap(seeds, nm, den, nb, den, relative=True, draws=200)
    assert rel == pytest.approx(0.3 / 0.4)
    with pytest.raises(ValueError, match="equally long"):
        stratified_ratio_bootstrap(seeds[:4], nm, den, nb, den)


def test_pope_claims_are_noninferiority_claims():
    from stages.core import stats
    from stages.gift import compare

    pope = {k: v for k, v in compare.CLAIMS.items() if v[2].startswith("pope_")}
    assert len(pope) == 3 and all(v[5] == "noninferior" and v[4] == 1 for v in pope.values())
    assert all(v[5] == "differs" for k, v in compare.CLAIMS.items() if k not in pope)
    assert compare.Config().pope_margin == 0.01
    # a tiny F1 loss inside the margin holds; a loss beyond it fails; straddling is open
    c = stats.claim_from_ci(-0.001, -0.002, -0.0002, n=1500, mde_value=0.002)
    assert c.verdict == -1                                   # the old "F1 rises" rule
    assert stats.noninferiority(c.low, c.high, 0.01) == 1    # the paper's "does not fall"
    assert stats.noninferiority(-0.03, -0.02, 0.01) == -1
    assert stats.noninferiority(-0.02, 0.01, 0.01) == 0


def test_pope_claim_skipped_only_when_both_arms_give_the_same_constant_answers():
    import polars as pl

    from stages.gift.compare import untestable_pope

    def pope(greedy, gift):
        n = len(greedy)
        return pl.DataFrame({"arm": ["greedy"] * n + ["gift"] * n, "seed": [0] * (2 * n),
                             "image_id": [f"i{k}" for k in range(n)] * 2,
                             "negative": ["positive", "random"] * (n // 2) * 2,
                             "pred_yes": [*greedy, *gift]})

    assert untestable_pope(pope([0, 0, 0, 0], [0, 0, 0, 0]), "gift", "greedy")
    # greedy always says no, GIFT always says yes: constant both, but F1 moved (0 -> 0.67)
    assert not untestable_pope(pope([0, 0, 0, 0], [1, 1, 1, 1]), "gift", "greedy")
    # greedy constant, GIFT discriminates: the claim must be tested
    assert not untestable_pope(pope([0, 0, 0, 0], [1, 0, 1, 0]), "gift", "greedy")
