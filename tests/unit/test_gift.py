"""GIFT's method core on hand-computed values, its attention hook on a tiny random Llama fed
`inputs_embeds`, and the CHAIR / POPE counting."""

from __future__ import annotations

import math

import pytest
import torch

from stages.gift import gift, metrics
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


def test_vaf_row_boosts_all_visual_attention_in_proportion():
    row = gift.vaf_row(ROW, SPANS6, alpha=1.0)
    head0 = torch.tensor([0.1, 0.6, 0.2, 0.2, 0.2, 0.2]) / 1.5
    head1 = torch.tensor([0.35, 0.2, 0.2, 0.0, 0.15, 0.3]) / 1.2
    assert torch.allclose(row, torch.stack([head0, head1]).float(), atol=1e-6)


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


# --- CHAIR and POPE ------------------------------------------------------------------------------

VOCAB = ["red circle", "blue square", "green triangle", "yellow cross"]


def test_chair_counts_mentions_and_hallucinations_by_hand():
    captions = ["A red circle and a blue square.",
                "Two red circles and a green triangle.",  # plural; green triangle is not there
                "Some yellow crosses, and a circle.",  # plural -es; a bare shape names nothing
                "A bred circle."]  # whole words only: no mention
    objects = [["red circle", "blue square"], ["red circle", "red circle"], ["blue square"], []]
    records = metrics.chair_per_image(captions, objects, VOCAB)
    assert [(r["mentioned"], r["hallucinated"], r["chair_sentence"]) for r in records] == [
        (2, 0, 0.0), (2, 1, 1.0), (1, 1, 1.0), (0, 0, 0.0)]
    assert records[1]["hallucinated_objects"] == ["green triangle"]
    assert metrics.chair(records) == {"chair_sentence": 0.5, "chair_instance": 0.4}  # 2/4 captions, 2/5 mentions
    assert metrics.chair(records, [1, 1]) == {"chair_sentence": 1.0, "chair_instance": 0.5}
    with pytest.raises(ValueError, match="purple star"):
        metrics.chair_per_image(["x"], [["purple star"]], VOCAB)


def test_pope_counts_by_hand():
    answers = ["Yes, there is.", "no", "Yes", "I think so", "No."]
    labels = [True, True, False, False, False]
    result = metrics.pope(metrics.pope_per_item(answers, labels))
    # tp 1, predicted yes 2, labelled yes 2; correct: 1st, 4th (unparsed = not yes), 5th
    assert result == pytest.approx({"accuracy": 0.6, "precision": 0.5, "recall": 0.5, "f1": 0.5,
                                    "yes_ratio": 0.4, "unparsed": 0.2})


def test_paired_bootstrap_resamples_the_same_images_on_both_sides():
    base = metrics.chair_per_image(["a red circle"] * 10, [["blue square"]] * 10, VOCAB)
    same = metrics.paired_bootstrap(lambda r, i: metrics.chair(r, i)["chair_sentence"], base, base)
    assert same == (0.0, 0.0, 0.0)
    fixed = metrics.chair_per_image(["a blue square"] * 10, [["blue square"]] * 10, VOCAB)
    drop = metrics.paired_bootstrap(lambda r, i: metrics.chair(r, i)["chair_sentence"], fixed, base,
                                    relative=True, draws=200)
    assert drop == (-1.0, -1.0, -1.0)
