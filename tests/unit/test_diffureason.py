"""DiffuReason and the masked-diffusion LM: hand-computed values of the objective, the commit
schedule and the value; the model is really bidirectional; the value never sees the gold
answer; the ledger charges every forward pass."""

from __future__ import annotations

import math

import pytest
import torch

from stages.diffureason import search as S
from stages.diffureason import task
from stages.models import mdlm
from stages.search.ledger import Budget, Ledger

META = {"prompt_len": 9, "response_len": 24, "block_size": 8, "n_blocks": 3}
SMALL = mdlm.Config(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                    max_positions=64)


@pytest.fixture(scope="module")
def tok():
    return task.build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return mdlm.build_mdlm(SMALL, tok).eval()


def test_task_format_and_modulus():
    assert task.solve([37, 4, 81], ["*", "+"], 100) == ("37*04=48;48+81=29;#29", 29)
    assert task.solve([3, 5], ["-"], 10) == ("3-5=8;#8", 8)
    assert task.extract_answer("3-5=8;#8") == 8
    assert task.extract_answer("3-5=8;#") is None and task.extract_answer("3-5=8") is None
    cfg = task.Config(modulus=100, min_steps=3, max_steps=6, block_size=16)
    # longest: 6 steps of 'aa*bb=cc;' (9) + '#cc' (3) + one <eos> = 58 -> 4 blocks of 16
    assert (cfg.response_len, cfg.n_blocks) == (64, 4)
    rows = task.generate(cfg.model_copy(update={"sizes": {"test": 30, "val": 5, "train": 40}}),
                         0)
    assert all(len(r["response"]) < cfg.response_len for r in rows)
    assert len({r["prompt"] for r in rows}) == len(rows)


def test_bad_params_are_named_before_compute():
    with pytest.raises(ValueError, match="operators"):
        task.Config(operators="+/")
    with pytest.raises(ValueError, match="min_steps"):
        task.Config(min_steps=5, max_steps=3)
    with pytest.raises(ValueError, match="arms"):
        S.run(S.Config(arms=["vanilla", "beam"]), ctx=None)


def test_llada_loss_weights_masked_tokens_by_one_over_t():
    # one row, 2 response positions, vocab 2; position 0 masked, position 1 not
    logits = torch.tensor([[[0.0, 0.0], [5.0, -5.0]]])
    x0 = torch.tensor([[1, 0]])
    masked = torch.tensor([[True, False]])
    t = torch.tensor([0.25])
    # CE at position 0 = log 2; weighted 1/t = 4; divided by L = 2
    assert float(mdlm.llada_loss(logits, x0, masked, t, 2)) == pytest.approx(math.log(2) * 2)


def test_llada_mask_masks_only_the_response_at_rate_t(tok):
    gen = torch.Generator().manual_seed(0)
    x0 = torch.full((400, 20), 7)
    resp = torch.zeros_like(x0, dtype=torch.bool)
    resp[:, 10:] = True
    xt, masked = mdlm.llada_mask(x0, resp, torch.full((400,), 0.3), 99, gen)
    assert not masked[:, :10].any() and (xt[:, :10] == 7).all()
    assert float(masked[:, 10:].float().mean()) == pytest.approx(0.3, abs=0.02)
    assert (xt[masked] == 99).all()


def test_block_mask_clean_before_partial_at_full_after():
    gen = torch.Generator().manual_seed(0)
    prompt, bs = 4, 3                      # response of 8 tokens: blocks 0-2 (the last short)
    x0 = torch.arange(1, 13).repeat(3000, 1)
    t = torch.tensor([0.25, 0.5]).repeat(1500)            # rows alternate t: weight is per row
    xt, masked, w = mdlm.block_mask(x0, prompt, bs, t, 99, gen)
    assert not masked[:, :prompt].any() and (w[:, :prompt] == 0).all()
    blocks = [(4, 7), (7, 10), (10, 12)]
    seen = set()
    for row in range(3000):
        m, wr = masked[row], w[row]
        # exactly one block carries weight 1/t; every position after it is masked, weight 1
        k = [b for b, (lo, hi) in enumerate(blocks) if (wr[lo:hi] == 1 / t[row]).all()]
        assert len(k) == 1
        seen.add(k[0])
        lo, hi = blocks[k[0]]
        assert not m[prompt:lo].any() and (wr[prompt:lo] == 0).all()
        assert m[hi:].all() and (wr[hi:] == 1.0).all()
    assert seen == {0, 1, 2}
    for rate in (0.25, 0.5):
        cur = (w == 1 / rate) & (t[:, None] == rate)
        assert float(masked[cur].float().mean()) == pytest.approx(rate, abs=0.02)
    assert (xt[masked] == 99).all() and (xt[~masked] == x0[~masked]).all()


def test_llada_loss_per_position_weight():
    logits = torch.zeros(1, 3, 2)          # CE log 2 everywhere
    x0 = torch.tensor([[0, 1, 0]])
    masked = torch.tensor([[False, True, True]])
    weight = torch.tensor([[2.0, 4.0, 1.0]])   # the unmasked position's weight must not count
    got = mdlm.llada_loss(logits, x0, masked, torch.tensor([0.25]), 3, weight)
    assert float(got) == pytest.approx(math.log(2) * 5 / 3)


def test_train_mdlm_block_schedule_runs_and_names_bad_input(tok):
    model = mdlm.build_mdlm(mdlm.Config(hidden_size=16, num_layers=1, num_heads=2,
                                        intermediate_size=16, max_positions=32), tok)
    rows = torch.randint(5, len(tok) - 1, (8, 20))
    got = mdlm.train_mdlm(model, rows, 10, tok.mask_token_id, steps=2, batch_size=4, lr=1e-3,
                          seed=0, schedule="block", block_size=4)
    assert math.isfinite(got["train_loss"]) and got["train_loss"] > 0
    with pytest.raises(ValueError, match="block_size >= 1"):
        mdlm.train_mdlm(model, rows, 10, tok.mask_token_id, steps=1, batch_size=4, lr=1e-3,
                        seed=0, schedule="block")
    with pytest.raises(ValueError, match="'blocks'"):
        mdlm.train_mdlm(model, rows, 10, tok.mask_token_id, steps=1, batch_size=4, lr=1e-3,
                        seed=0, schedule="blocks")


def test_commit_schedule_spreads_the_remainder_first():
    got = mdlm.commit_schedule(torch.tensor([8, 7, 2]), 4)
    assert got.tolist() == [[2, 2, 2, 2], [2, 2, 2, 1], [1, 1, 0, 0]]


def test_the_diffusion_lm_is_bidirectional_the_ar_twin_is_not(tok, model):
    """Changing a LATER token changes the diffusion LM's prediction at an earlier position (no
    causal mask); the AR twin's prediction there does not move."""
    row = torch.tensor([mdlm.encode(tok, "1+2=", "1+2=3;#3", 9, 24)])
    pos = 9 + 1                                    # an early response position
    later = row.clone()
    later[0, 9 + 6] = tok.convert_tokens_to_ids("7")
    with torch.no_grad():
        a = model(input_ids=row).logits[0, pos]
        b = model(input_ids=later).logits[0, pos]
    assert (a - b).abs().max() > 1e-4
    torch.manual_seed(0)
    ar = mdlm.build_ar_twin(SMALL, tok).eval()
    with torch.no_grad():
        c = ar(input_ids=row).logits[0, pos]
        d = ar(input_ids=later).logits[0, pos]
    assert torch.allclose(c, d, atol=1e-6)


def test_saved_model_loads_with_the_hf_auto_class(tok, model, tmp_path):
    from stages.core import io

    io.save_model(model, tok, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").is_file()
    loaded, tok2 = mdlm.load_mdlm(tmp_path / "m")
    row = torch.tensor([mdlm.encode(tok2, "1+2=", None, 9, 24)])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=row).logits, model(input_ids=row).logits)


def test_fill_commits_the_schedule_and_nothing_outside_allowed(tok, model):
    dec = S.Decoder(model, tok, META, seed=0)
    x, conf = dec.init_rows(["1+2=", "3-4="])
    allowed = dec.block_mask([0, 1])
    before = (x == dec.mask).sum(1)
    x1, c1 = dec.fill(x, conf, allowed, 1, 0.0)
    # one pass with 1 step commits the whole block; nothing else moves
    assert ((x1 == dec.mask) & allowed).sum() == 0
    assert ((x1 != x) & ~allowed).sum() == 0
    assert ((x == dec.mask).sum(1) - (x1 == dec.mask).sum(1)).tolist() == [8, 8]
    assert (c1[allowed] > 0).all() and before.tolist() == [24, 24]
    assert not torch.isin(x1[allowed], torch.tensor(dec.banned)).any()


def test_value_is_majority_share_times_confidence_and_blind_to_gold(tok, model):
    dec = S.Decoder(model, tok, META, seed=0)
    cfg = S.Config(m=4, value_steps=1, conf_weight=1.0)
    sr = S.Searcher(cfg, dec, revise=False)
    x, conf = dec.init_rows(["1+2="])
    x, conf = dec.fill(x, conf, dec.block_mask([0]), 4, 0.0)
    state = S.State("p", x[0], conf[0], 1)
    v, sketch, nfe = sr.values([state], [False])
    assert nfe == [4]                                   # M coarse completions, 1 pass each
    share = v[0] / float(conf[0][dec.block_mask([0])[0]].mean())
    assert share in (0.0, 0.25, 0.5, 0.75, 1.0) or math.isclose(share * 4, round(share * 4))
    # the value's inputs are the state's tokens only: the same state under two different
    # 'gold answers' (there is no way to pass one) gives the same value from the same seed
    dec2 = S.Decoder(model, tok, META, seed=0)
    v2, _, _ = S.Searcher(cfg, dec2, revise=False).values([state], [False])
    assert v2 == v
    assert "answer" not in S.Searcher.values.__code__.co_varnames
    # a terminal state with a parsable answer: V = its block's mean confidence
    row = torch.tensor(mdlm.encode(tok, "1+2=", "1+2=3;#3", 9, 24))
    c = torch.zeros(row.shape)
    c[9:17] = 0.5
    vt, _, n_t = sr.values([S.State("p", row, c, 1)], [True])
    assert vt == [pytest.approx(0.5)] and n_t == [0]


def test_every_arm_stays_within_budget_and_vanilla_costs_v(tok, model):
    dec = S.Decoder(model, tok, META, seed=0)
    V = S.vanilla_cost(dec)
    assert V == 3 * 4
    prompts = {"a": "1+2=", "b": "3-4=", "c": "5+5="}
    cfg = S.Config(k=2, m=2, n_sim=4)
    for arm in S.ARMS:
        for mult in (1, 4):
            ledger = Ledger()
            budget = Budget(unit="nfe", limit=mult * V)
            meters = {p: ledger.meter(arm, budget, p) for p in prompts}
            ar = S.ARDecoder(mdlm.build_ar_twin(SMALL, tok).eval(), tok, META)
            got = S.run_arm(arm, cfg, dec, ar, prompts, mult * V, meters, 0)
            assert set(got) == set(prompts)
            for p in prompts:
                spent = meters[p].spent.nfe
                assert 0 < spent <= mult * V, (arm, mult, spent)
            if arm == "vanilla" and mult == 1:
                # no <eos> from an untrained model before the last block: exactly V each
                assert all(meters[p].spent.nfe <= V for p in prompts)


def test_search_at_16x_expands_and_spends_more_than_vanilla(tok, model):
    dec = S.Decoder(model, tok, META, seed=0)
    V = S.vanilla_cost(dec)
    cfg = S.Config(k=2, m=2, n_sim=8)
    prompts = {"a": "1+2=", "b": "3-4="}
    ledger = Ledger()
    budget = Budget(unit="nfe", limit=16 * V)
    meters = {p: ledger.meter("dr", budget, p) for p in prompts}
    S.run_arm("diffureason", cfg, dec, None, prompts, 16 * V, meters, 0)
    # K = 2 children per expansion: more blocks generated than committed
    assert all(meters[p].spent.generations > dec.n_blocks for p in prompts)
    assert all(V < meters[p].spent.nfe <= 16 * V for p in prompts)
    assert all(meters[p].spent.value_calls > 0 for p in prompts)


def test_auc_hand_values():
    assert S.auc([0.1, 0.9], [False, True]) == 1.0
    assert S.auc([0.5, 0.5], [False, True]) == 0.5
    assert S.auc([0.9, 0.1, 0.5], [False, True, True]) == 0.0
    assert math.isnan(S.auc([0.1], [True]))


def test_llama_arch_is_the_ar_twins_block_without_the_causal_mask(tok, tmp_path):
    """`arch: llama` (EuroBERT's class): the AR twin's parameters one for one, but a later token
    moves an earlier prediction; it saves and reloads with AutoModelForMaskedLM."""
    from stages.core import io

    cfg = SMALL.model_copy(update={"arch": "llama"})
    torch.manual_seed(0)
    diff = mdlm.build_mdlm(cfg, tok).eval()
    ar = mdlm.build_ar_twin(cfg, tok)
    assert ({k: tuple(v.shape) for k, v in diff.model.state_dict().items()}
            == {k: tuple(v.shape) for k, v in ar.model.state_dict().items()})
    row = torch.tensor([mdlm.encode(tok, "1+2=", "1+2=3;#3", 9, 24)])
    later = row.clone()
    later[0, 9 + 6] = tok.convert_tokens_to_ids("7")
    with torch.no_grad():
        a, b = diff(input_ids=row).logits[0, 10], diff(input_ids=later).logits[0, 10]
    assert (a - b).abs().max() > 1e-4
    io.save_model(diff, tok, tmp_path / "m")
    loaded, _ = mdlm.load_mdlm(tmp_path / "m")
    assert type(loaded).__name__ == "EuroBertForMaskedLM"
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=row).logits, diff(input_ids=row).logits)
