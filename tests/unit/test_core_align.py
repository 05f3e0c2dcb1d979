"""CoRe's method core (stages/core_align): the matching loss on hand-computed values, the
stop-gradient anchor on a tiny Llama fed token ids (x_txt) and random embeddings (the stand-in for
image tokens, x_img), the SFT loss, gap recovery, and the GRPO anchor term."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch

from stages.core_align.core import (
    AnchorKLParams,
    Branch,
    CoReGRPOParams,
    CoReParams,
    EMAAnchor,
    anchor_kl,
    core_sft_loss,
    gap_recovery,
    gap_recovery_ci,
    match_loss,
    response_ce,
    response_logits,
    sft_step,
    step_ids,
    token_divergence,
    token_weights,
)

# Two positions over a 3-token vocabulary, given as probabilities (logits = log p).
P_ANC = [[0.5, 0.25, 0.25], [0.8, 0.1, 0.1]]
P_STU = [[0.25, 0.5, 0.25], [0.1, 0.8, 0.1]]


def logits(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor([probs], dtype=torch.float64).log()       # (1, T, V)


def kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q))


# --- the divergence, weights and steps by hand -----------------------------------------------

def test_forward_and_reverse_kl_by_hand():
    fwd = token_divergence(logits(P_ANC), logits(P_STU), "forward")[0]
    # position 0: .5 ln(.5/.25) + .25 ln(.25/.5) + .25 ln 1 = .25 ln 2
    assert fwd[0].item() == pytest.approx(0.25 * math.log(2))
    # position 1: .8 ln 8 + .1 ln(1/8) + .1 ln 1 = .7 ln 8
    assert fwd[1].item() == pytest.approx(0.7 * math.log(8))
    # these two pairs are swaps of each other (KL symmetric); an asymmetric pair:
    p, q = [0.7, 0.2, 0.1], [0.2, 0.2, 0.6]
    f = token_divergence(logits([p]), logits([q]), "forward").item()     # KL(p || q)
    r = token_divergence(logits([p]), logits([q]), "reverse").item()     # KL(q || p)
    assert f == pytest.approx(0.7 * math.log(3.5) + 0.1 * math.log(1 / 6))
    assert r == pytest.approx(0.2 * math.log(2 / 7) + 0.6 * math.log(6))
    assert f == pytest.approx(0.697758, abs=1e-6) and r == pytest.approx(0.824503, abs=1e-6)
    with pytest.raises(ValueError, match="divergence"):
        token_divergence(logits([p]), logits([q]), "js")


def test_kl_is_zero_for_identical_distributions_and_positive_otherwise():
    x = torch.randn(2, 4, 7, dtype=torch.float64)
    assert token_divergence(x, x).abs().max().item() < 1e-12
    assert (token_divergence(x, x + torch.randn_like(x)) > 0).all()


def test_anchor_correct_weights_keep_only_the_anchors_right_top1():
    anc = logits([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1], [0.1, 0.2, 0.7]])    # top-1: 0, 1, 2
    targets = torch.tensor([[0, 2, 2]])
    assert token_weights(anc, targets, "anchor_correct").tolist() == [[1.0, 0.0, 1.0]]
    assert token_weights(anc, targets, "uniform").tolist() == [[1.0, 1.0, 1.0]]
    stu = logits([[0.2, 0.4, 0.4]] * 3)
    d = token_divergence(anc, stu)[0]
    mask = torch.ones(1, 3)
    # (1/|y|) sum_t w_t D_t: the weights drop a term but |y| stays 3
    assert match_loss(anc, stu, targets, mask, weighting="anchor_correct").item() == \
        pytest.approx((d[0] + d[2]).item() / 3)
    assert match_loss(anc, stu, targets, mask).item() == pytest.approx(d.sum().item() / 3)


def test_padding_is_ignored_and_examples_are_averaged():
    anc = logits([[0.5, 0.25, 0.25], [0.8, 0.1, 0.1]]).repeat(2, 1, 1)
    stu = logits([[0.25, 0.5, 0.25], [0.1, 0.8, 0.1]]).repeat(2, 1, 1)
    targets = torch.zeros(2, 2, dtype=torch.long)
    mask = torch.tensor([[1, 1], [1, 0]])
    d0, d1 = 0.25 * math.log(2), kl(P_ANC[1], P_STU[1])
    # example 0: (d0 + d1) / 2; example 1: d0 / 1; then the batch mean
    assert match_loss(anc, stu, targets, mask).item() == pytest.approx(((d0 + d1) / 2 + d0) / 2)


def test_step_granularity_averages_inside_a_step_before_weighting():
    anc = logits([[0.6, 0.3, 0.1], [0.6, 0.3, 0.1], [0.6, 0.3, 0.1], [0.6, 0.3, 0.1]])
    stu = logits([[0.2, 0.4, 0.4], [0.6, 0.3, 0.1], [0.3, 0.3, 0.4], [0.1, 0.1, 0.8]])
    targets = torch.tensor([[0, 0, 1, 0]])            # the anchor's top-1 (0) misses at t = 2
    mask = torch.ones(1, 4)
    d = token_divergence(anc, stu)[0].tolist()
    spans = [[(0, 3), (3, 4)]]                         # steps {0, 1, 2} and {3}
    step_mean = [(d[0] + d[1] + d[2]) / 3, d[3]]
    assert match_loss(anc, stu, targets, mask, spans=spans).item() == \
        pytest.approx(sum(step_mean) / 2)
    # a step counts as correct only if the anchor is right on all its tokens: step 0 drops
    assert match_loss(anc, stu, targets, mask, spans=spans,
                      weighting="anchor_correct").item() == pytest.approx(d[3] / 2)
    # the token granularity weighs the long step 3x: a different number
    assert match_loss(anc, stu, targets, mask).item() == pytest.approx(sum(d) / 4)
    assert sum(d) / 4 != pytest.approx(sum(step_mean) / 2)


def test_step_spans_are_validated():
    mask = torch.tensor([[1, 1, 1, 0]])
    assert step_ids([[(0, 1), (1, 3)]], mask).tolist() == [[0, 1, 1, -1]]
    for bad, why in (([[(0, 1), (2, 3)]], "ordered"), ([[(0, 2)]], "cover 2 of its 3"),
                     ([[(0, 4)]], "ordered"), ([[(0, 0), (0, 3)]], "ordered"),
                     ([[(0, 3)], [(0, 3)]], "2 examples")):
        with pytest.raises(ValueError, match=why):
            step_ids(bad, mask)
    with pytest.raises(ValueError, match="step"):
        core_sft_loss(None, None, None, None, None, CoReParams(granularity="step"))


# --- the tiny model: x_txt as token ids, x_img as random embeddings -----------------------------

VOCAB, HIDDEN = 24, 16
TEXT_ONLY = [20, 21, 22, 23]       # tokens that only ever appear in the text context


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # untied embeddings: with tied ones every embedding row is also an output row and gets a
    # gradient from the image branch's logits, so no row would belong to the text path alone
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         attn_implementation="eager")
    return LlamaForCausalLM(config)


def toy_pair(batch: int = 2, seed: int = 0):
    """(text branch, image branch, responses, mask): same responses after either context; the
    text context uses only TEXT_ONLY tokens, the image context is random embeddings (leaf)."""
    g = torch.Generator().manual_seed(seed)
    text_ids = torch.tensor(TEXT_ONLY)[torch.randint(0, 4, (batch, 5), generator=g)]
    text_mask = torch.ones(batch, 5, dtype=torch.long)
    text_mask[1, :2] = 0                                   # left padding
    image = torch.randn(batch, 3, HIDDEN, generator=g).requires_grad_(True)
    response = torch.randint(1, 12, (batch, 4), generator=g)
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    return (Branch(input_ids=text_ids, attention_mask=text_mask),
            Branch(inputs_embeds=image, attention_mask=torch.ones(batch, 3, dtype=torch.long)),
            response, response_mask)


def test_response_logits_match_a_plain_forward_on_ids_and_on_embeddings():
    model = tiny_llama()
    text, _, response, mask = toy_pair()
    got = response_logits(model, text, response, mask)
    # row 0 has no padding: a plain forward on context + response, positions 4..7 predict y_0..3
    full = model(input_ids=torch.cat([text.input_ids[:1], response[:1]], 1)).logits
    torch.testing.assert_close(got[0], full[0, 4:8])
    # the same tokens given as embeddings: the same logits
    embeds = Branch(inputs_embeds=model.get_input_embeddings()(text.input_ids),
                    attention_mask=text.attention_mask)
    torch.testing.assert_close(response_logits(model, embeds, response, mask), got)
    # row 1 (2 pads on the left) equals its unpadded forward: padding shifts no position
    alone = model(input_ids=torch.cat([text.input_ids[1:, 2:], response[1:]], 1)).logits
    torch.testing.assert_close(got[1, :3], alone[0, 2:5])
    with pytest.raises(ValueError, match="exactly one"):
        Branch(attention_mask=text.attention_mask)


def _text_only_rows_grad(loss: torch.Tensor, model) -> torch.Tensor:
    model.zero_grad(set_to_none=False)
    loss.backward()
    return model.get_input_embeddings().weight.grad[TEXT_ONLY].abs().max()


def test_the_anchor_receives_no_gradient_from_the_matching_loss():
    """The embedding rows of TEXT_ONLY tokens are used by the text branch alone: L_match gives
    them exactly zero gradient, while the image branch's parameters (and its input) get one.
    Without the stop-gradient the same loss reaches them (the check can fail)."""
    model = tiny_llama()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    text, image, response, mask = toy_pair()
    text_logits = response_logits(model, text, response, mask)
    image_logits = response_logits(model, image, response, mask)
    loss = match_loss(text_logits, image_logits, response, mask)
    assert loss.item() > 0
    assert _text_only_rows_grad(loss, model).item() == 0.0
    assert image.inputs_embeds.grad.abs().max() > 0          # the image branch is trained
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().max() > 0
    # sensitivity: the same KL without sg(theta) moves the text-only rows
    text_logits = response_logits(model, text, response, mask)
    image_logits = response_logits(model, image, response, mask)
    no_sg = token_divergence(text_logits, image_logits).mean()
    assert _text_only_rows_grad(no_sg, model).item() > 0


def test_in_the_sft_loss_only_mu_ce_txt_trains_the_text_path():
    """With mu = 0 the whole SFT loss (CE_img + lambda L_match) leaves the text-only rows alone;
    with mu > 0 they learn, from CE(y*|x_txt) only."""
    model = tiny_llama()
    text, image, response, mask = toy_pair()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    loss, parts = core_sft_loss(model, text, image, response, mask, CoReParams(mu=0.0))
    assert parts["match"] > 0 and parts["ce_txt"] == 0.0
    assert _text_only_rows_grad(loss, model).item() == 0.0
    loss, parts = core_sft_loss(model, text, image, response, mask, CoReParams(mu=1.0))
    assert parts["loss"] == pytest.approx(parts["ce_img"] + parts["match"] + parts["ce_txt"])
    assert _text_only_rows_grad(loss, model).item() > 0


def test_the_matching_loss_is_zero_when_both_inputs_are_identical():
    model = tiny_llama()
    text, _, response, mask = toy_pair()
    same = Branch(inputs_embeds=model.get_input_embeddings()(text.input_ids).detach(),
                  attention_mask=text.attention_mask)
    for divergence in ("forward", "reverse"):
        _, parts = core_sft_loss(model, text, same, response, mask,
                                 CoReParams(divergence=divergence))
        assert abs(parts["match"]) < 1e-6
        assert parts["ce_img"] == pytest.approx(parts["ce_txt"], abs=1e-6)


def _branch_kl(model, text, image, response, mask) -> float:
    with torch.no_grad():
        return match_loss(response_logits(model, text, response, mask),
                          response_logits(model, image, response, mask), response, mask).item()


def _text_sft(seed: int):
    """A toy pair after 30 steps of text SFT: the text branch knows the responses, the image
    branch does not (the transfer gap)."""
    model = tiny_llama(seed)
    text, image, response, mask = toy_pair(seed=seed)
    image = Branch(inputs_embeds=image.inputs_embeds.detach(), attention_mask=image.attention_mask)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):
        opt.zero_grad()
        response_ce(response_logits(model, text, response, mask), response, mask).backward()
        opt.step()
    return model, (text, image, response, mask)


@pytest.mark.parametrize("anchor", ["dynamic", "ema"])
def test_a_few_sft_steps_with_the_matching_loss_close_the_gap_between_branches(anchor):
    """From the same text-SFT'd model, 20 visual SFT steps with L_match (lambda = 1) bring the
    image branch's distributions closer to the text branch's than at the start, and to under half
    the KL that 20 steps without it (lambda = 0) leave."""
    after = {}
    for lam in (0.0, 1.0):
        model, pair = _text_sft(1)
        before = _branch_kl(model, *pair)
        params = CoReParams(lam=lam, mu=0.0, anchor=anchor, ema_decay=0.5)
        ema = EMAAnchor(model, params.ema_decay) if anchor == "ema" else None
        start = None if ema is None else ema.model.lm_head.weight.clone()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(20):
            parts = sft_step(model, opt, *pair, params, ema=ema)
        assert math.isfinite(parts["loss"])
        after[lam] = _branch_kl(model, *pair)
        if ema is not None:        # the teacher moved towards the model and got no gradient
            assert all(p.grad is None for p in ema.model.parameters())
            assert not torch.equal(ema.model.lm_head.weight, start)
    # seen: start 1.39; lambda 0 -> 1.99 both; lambda 1 -> 0.52 dynamic, 0.68 EMA
    assert after[1.0] < before and after[1.0] < 0.5 * after[0.0], (before, after)


def test_ema_anchor_update_by_hand():
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema = EMAAnchor(model, decay=0.9)
    with torch.no_grad():
        model.weight.fill_(3.0)
    ema.update(model)
    assert ema.model.weight.item() == pytest.approx(0.9 * 1.0 + 0.1 * 3.0)
    with pytest.raises(ValueError, match="EMA"):
        core_sft_loss(model, None, None, None, None, CoReParams(anchor="ema"))


# --- gap recovery ------------------------------------------------------------------------------

def test_gap_recovery_by_hand_and_undefined_when_text_does_not_beat_visual():
    assert gap_recovery(0.55, 0.40, 0.60) == pytest.approx(0.75)     # 0.15 / 0.20
    assert gap_recovery(0.35, 0.40, 0.60) == pytest.approx(-0.25)    # worse than visual SFT
    assert math.isnan(gap_recovery(0.5, 0.4, 0.4))                    # gap 0
    assert math.isnan(gap_recovery(0.5, 0.5, 0.4))                    # gap < 0


def test_gap_recovery_ci_pairs_items_across_arms():
    # 20 items: visual right on 8, text on 16, CoRe on 14  ->  (0.7 - 0.4) / (0.8 - 0.4) = 0.75
    visual = [1.0] * 8 + [0.0] * 12
    text = [1.0] * 16 + [0.0] * 4
    core = [1.0] * 14 + [0.0] * 6
    g = gap_recovery_ci(core, visual, text, draws=500, seed=0)
    assert g.value == pytest.approx(0.75) and g.gap == pytest.approx(0.4) and g.n == 20
    assert g.defined and g.low < 0.75 < g.high and 0.0 < g.low and g.high <= 1.0
    assert g.describe().startswith("0.75 [")
    undefined = gap_recovery_ci(core, visual, visual, draws=50)
    assert not undefined.defined and math.isnan(undefined.low)
    assert undefined.describe().startswith("undefined")
    with pytest.raises(ValueError, match="same non-empty test items"):
        gap_recovery_ci(core, visual[:-1], text)


# --- the GRPO anchor term ----------------------------------------------------------------------

def test_anchor_kl_is_the_reverse_kl_token_mean_and_detaches_the_anchor():
    p, q = [0.7, 0.2, 0.1], [0.2, 0.2, 0.6]
    student = logits([p, q]).requires_grad_(True)
    anchor = logits([q, q]).requires_grad_(True)
    mask = torch.tensor([[1, 0]])
    value = anchor_kl(student, anchor, mask)                 # KL(student || anchor), t = 0 only
    assert value.item() == pytest.approx(kl(p, q))
    value.backward()
    assert anchor.grad is None and student.grad.abs().max() > 0
    assert CoReGRPOParams().policy_loss == "core" and AnchorKLParams().lam == 0.1


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A tiny Llama that has seen 1-digit additions (as the engine's GRPO tests use)."""
    from stages.models import base
    from stages.models.tokenizer import build_tokenizer
    from stages.tasks import arith

    torch.manual_seed(0)
    tokenizer = build_tokenizer(set("0123456789+-=;#?:QA[] "))
    cfg = base.Config(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                      max_positions=64, steps=40, batch_size=16, lr=5e-3, warmup=0.0,
                      log_every=40, group_by_length=False)
    model = base.build_model(cfg, tokenizer)
    rows = arith.generate(arith.Config(min_operands=2, max_operands=2, max_value=9), 64, 1)
    enc = base.encode_sft_rows(tokenizer, [r["prompt"] for r in rows],
                               [r["target"] for r in rows], max_len=64)
    base.train(cfg, model, tokenizer, enc, seed=0)
    folder = tmp_path_factory.mktemp("policy")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_grpo_with_the_anchor_term_trains_and_logs_the_anchor_kl(policy, tmp_path):
    """The policy reads a stand-in for x_img (the prompt wrapped in brackets: the engine has no
    image input yet), the anchor the plain prompt x_txt; the trainer is a partial that carries
    the mapping, as a stage would pass it."""
    from stages.core_align.trainer import CoReGRPOTrainer
    from stages.tasks import arith
    from stages.train.grpo import train_grpo

    def rows(n, seed):
        out = arith.generate(arith.Config(min_operands=2, max_operands=2, max_value=9), n, seed)
        return [{**r, "prompt": f"[{r['prompt']}]", "text_prompt": r["prompt"]} for r in out]

    train, test = rows(16, 3), rows(4, 4)
    anchors = {r["prompt"]: r["text_prompt"] for r in train}
    params = CoReGRPOParams(rounds=2, prompts_per_round=2, num_generations=4, minibatches=1,
                            num_iterations=1, max_completion_length=12, lr=1e-3, eval_every=None,
                            eval_rows=4, num_threads=1, beta=0.01,
                            anchor=AnchorKLParams(lam=1.0))
    logged: list[dict] = []
    out = tmp_path / "policy"
    result = train_grpo(params, policy, "arith", train, test, seed=0, out_dir=out,
                        log=lambda m, step: logged.append(m),
                        trainer_cls=functools.partial(CoReGRPOTrainer, anchor_prompts=anchors))
    kls = [m["train/core/anchor_kl"] for m in logged if "train/core/anchor_kl" in m]
    assert kls and all(math.isfinite(v) and v > 0 for v in kls)     # prompts differ: KL > 0
    assert any("train/kl" in m for m in logged)                      # lambda_ref = beta kept
    assert result["metrics"]["steps"] == 2
    assert json.loads((out / "policy_state.json").read_text())["policy_loss"] == "core"
    bare = CoReGRPOTrainer.__new__(CoReGRPOTrainer)
    bare.anchor_prompts = anchors
    assert bare.anchor_prompt({"prompt": train[0]["prompt"]}) == train[0]["text_prompt"]
    assert bare.anchor_prompt({"prompt": "x", "anchor_prompt": "y"}) == "y"
    with pytest.raises(KeyError, match="no text anchor"):
        bare.anchor_prompt({"prompt": "x"})


def test_the_core_policy_loss_is_the_engines_plus_lambda_times_the_anchor_kl(policy):
    """On one hand-made batch: CoRe's loss = the engine's clipped loss + lambda * token-mean
    KL(pi(.|x) || pi(.|x_txt)) computed here with plain forwards; 0 KL when x_txt == x."""
    from datasets import Dataset
    from trl import GRPOConfig

    from stages.core_align.trainer import CoReGRPOTrainer
    from stages.models.generate import load_model
    from stages.train.grpo import verifier_reward
    from stages.train.grpo_trainer import GRPOTrainer

    model, tok = load_model(policy)
    model.train()
    args = GRPOConfig(output_dir="/tmp/paperline-core-test", max_steps=1,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      loss_type="bnpo", report_to="none", use_cpu=True, bf16=False,
                      gradient_checkpointing=False, save_strategy="no", disable_tqdm=True)
    ds = Dataset.from_list([{"prompt": "Q: 1+2=? A:", "answer": 3}] * 4)
    params = CoReGRPOParams(anchor=AnchorKLParams(lam=0.5))

    def trainer(cls):
        t = cls(model=model, processing_class=tok, reward_funcs=[verifier_reward("arith")],
                args=args, train_dataset=ds, params=params)
        t.current_gradient_accumulation_steps = 1
        return t

    core, clip = trainer(CoReGRPOTrainer), trainer(GRPOTrainer)
    prompt = torch.tensor(tok(["[Q: 1+2=? A:]"])["input_ids"])
    text = torch.tensor(tok(["Q: 1+2=? A:"])["input_ids"])
    completion = torch.tensor(tok([" 1+2=3 #### 3"], add_special_tokens=False)["input_ids"])
    mask = torch.ones_like(completion)
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt),
              "completion_ids": completion, "completion_mask": mask,
              "advantages": torch.tensor([1.0]), "num_items_in_batch": mask.sum(),
              "anchor_prompt_ids": text, "anchor_prompt_mask": torch.ones_like(text)}
    with torch.no_grad():
        n = completion.shape[1]
        student = model(input_ids=torch.cat([prompt, completion], 1)).logits[:, -n - 1:-1]
        anchor = model(input_ids=torch.cat([text, completion], 1)).logits[:, -n - 1:-1]
        by_hand = token_divergence(anchor, student, "reverse").mean().item()
        got = core.policy_loss(model, inputs).item()
        base = clip.policy_loss(model, inputs).item()
        same = core.policy_loss(model, {**inputs, "anchor_prompt_ids": prompt,
                                        "anchor_prompt_mask": torch.ones_like(prompt)}).item()
    assert by_hand > 0.01
    assert got == pytest.approx(base + 0.5 * by_hand, rel=1e-5)
    assert same == pytest.approx(base, abs=1e-6)
    assert core._metrics["train"]["core/anchor_kl"][0] == pytest.approx(by_hand, rel=1e-5)
