"""Activation hooks (stages/models/hooks.py) on a real, randomly initialised LlamaForCausalLM:
reading equals `output_hidden_states`, a zero steering vector changes nothing, a nonzero one
changes only the chosen positions and what follows them, cached generation sees the same
columns as a full forward, and every hook is gone after its `with` block, on an exception too."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stages.models.hooks import (ActivationAddition, at_tokens, num_layers, read_residual,
                                 residual_module, steer)

LAYERS, D, VOCAB = 3, 32, 40


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=64,
                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=True, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, VOCAB, (2, 12), generator=g)


def all_hooks(model) -> dict[str, int]:
    return {name: len(m._forward_hooks) + len(m._forward_pre_hooks)
            for name, m in model.named_modules()}


@pytest.mark.parametrize("layer", range(LAYERS + 1))
def test_read_activations_equal_output_hidden_states(model, ids, layer):
    with torch.no_grad(), read_residual(model, layer) as acts:
        out = model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == LAYERS + 1
    torch.testing.assert_close(acts.sequence(), out.hidden_states[layer], rtol=0, atol=0)


def test_zero_vector_changes_nothing_in_forward_and_generation(model, ids):
    with torch.no_grad():
        ref = model(ids).logits
        ref_gen = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    everywhere = torch.ones(2, 64, dtype=torch.bool)
    for orthogonal in (False, True):
        add = ActivationAddition(torch.zeros(D), everywhere, alpha=3.0, orthogonal=orthogonal)
        with torch.no_grad(), steer(model, 1, add):
            logits = model(ids).logits
            gen = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(logits, ref)
        assert torch.equal(gen, ref_gen)
        assert add.interventions.tolist() == [12 + 12 + 5] * 2  # full pass, prefill, 5 steps


@pytest.mark.parametrize("layer", [0, 1, LAYERS])
def test_steering_changes_the_chosen_position_and_only_what_follows(model, ids, layer):
    p = 5
    where = torch.zeros(2, ids.shape[1], dtype=torch.bool)
    where[0, p] = True                                    # row 0, column 5 only
    v = torch.randn(D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
        with steer(model, layer, ActivationAddition(v, where, alpha=4.0)):
            out = model(ids, output_hidden_states=True)
    assert torch.equal(out.logits[1], ref.logits[1])              # the other row: untouched
    assert torch.equal(out.logits[0, :p], ref.logits[0, :p])      # before p: untouched
    changed = (out.logits[0] - ref.logits[0]).abs().amax(-1) > 1e-5
    assert changed[p]
    if layer < LAYERS:  # attention carries it on; at the final norm only the LM head reads it
        assert changed[p:].all()
    else:
        assert not changed[p + 1:].any()
    # Below the steered layer nothing moved; at it, exactly alpha * v at (row 0, column p).
    for below in range(layer):
        assert torch.equal(out.hidden_states[below], ref.hidden_states[below])
    delta = out.hidden_states[layer] - ref.hidden_states[layer]
    torch.testing.assert_close(delta[0, p], 4.0 * v)
    delta[0, p] = 0
    assert not delta.any()


def test_cached_generation_steers_the_same_columns_as_a_full_forward(model, ids):
    """A prefill of 7 columns and a cached continuation of 5, steered at columns 3 and 9 by the
    token-id rule, give the logits of one steered full forward."""
    v = torch.randn(D, generator=torch.Generator().manual_seed(3))
    where = torch.zeros(2, 12, dtype=torch.bool)
    where[:, [3, 9]] = True
    with torch.no_grad():
        with steer(model, 2, ActivationAddition(v, where, alpha=2.0)):
            full = model(ids).logits
            first = model(ids[:, :7], use_cache=True)
            rest = model(ids[:, 7:], cache=first.past_key_values, use_cache=True)
        plain = model(ids).logits
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], dim=1), full)
    assert not torch.allclose(full, plain)
    # a token-id rule: steer wherever the token is ids[0, 4]; interventions counted per row
    token = int(ids[0, 4])
    rule = ActivationAddition(v, at_tokens([token]), alpha=2.0)
    with torch.no_grad(), steer(model, 2, rule):
        model(ids)
    assert rule.interventions.tolist() == (ids == token).sum(1).tolist()


def test_orthogonal_addition_is_orthogonal_to_the_current_state(model, ids):
    v = torch.randn(D, generator=torch.Generator().manual_seed(4))
    where = torch.zeros(2, 12, dtype=torch.bool)
    where[:, 6] = True
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states[2]
        with steer(model, 2, ActivationAddition(v, where, orthogonal=True)):
            out = model(ids, output_hidden_states=True).hidden_states[2]
    delta = out[:, 6] - ref[:, 6]
    assert delta.norm(dim=-1).min() > 0.1
    torch.testing.assert_close((delta * ref[:, 6]).sum(-1), torch.zeros(2), atol=1e-4, rtol=0)


def test_hooks_are_removed_after_the_block_also_on_an_exception(model, ids):
    with torch.no_grad():
        model(ids, output_hidden_states=True)  # transformers installs its own capture hooks once
    before = all_hooks(model)
    with torch.no_grad(), read_residual(model, 1), steer(model, 2, lambda h, s: None):
        assert all_hooks(model) != before
        model(ids)
    assert all_hooks(model) == before
    with pytest.raises(RuntimeError, match="boom"):
        with read_residual(model, 1), steer(model, 1, ActivationAddition(torch.ones(D),
                                                                          at_tokens([5]))):
            raise RuntimeError("boom")
    assert all_hooks(model) == before

    def bad_edit(hidden, site):
        raise KeyError("inside the forward")

    with pytest.raises(KeyError):
        with torch.no_grad(), steer(model, 0, bad_edit):
            model(ids)
    assert all_hooks(model) == before
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits)


def test_bad_layer_and_shapes_are_named(model, ids):
    assert num_layers(model) == LAYERS
    assert residual_module(model, LAYERS) is model.model.norm
    for bad in (-1, LAYERS + 1, 1.0, True):
        with pytest.raises(ValueError, match=rf"layer = .*expected an int in \[0, {LAYERS}\]"):
            read_residual(model, bad).__enter__()
    with pytest.raises(ValueError, match="bool mask"):
        ActivationAddition(torch.ones(D), torch.ones(2, 12))
    add = ActivationAddition(torch.ones(D + 1), torch.ones(2, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match="d = 33, the residual stream d = 32"):
        with torch.no_grad(), steer(model, 1, add):
            model(ids)
