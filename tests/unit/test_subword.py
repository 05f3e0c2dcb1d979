"""The subword tokenizer (stages/models/subword.py): exact round trips, every printable
character kept, merges that never cross a word or a digit, the specials' ids, determinism, and
the Early Experience world tokenizer shared by every arm (seconds, no model)."""

from __future__ import annotations

import string

import pytest
from hypothesis import assume, given, settings, strategies as st

from stages.models import subword
from stages.models.tokenizer import SPECIALS, build_tokenizer

ALPHABET = set(string.printable) - set("\t\r\n\x0b\x0c")
TEXTS = ["Task: grey hat, size L, max $10 | Observation: search page | Action: search[grey hat]",
         "Task: red bag, size M, max $35 | Observation: red bag: 1 $30 M; 2 $45 S | "
         "Action: click[1]"] * 20


@pytest.fixture(scope="module")
def tok():
    return subword.train_bpe(TEXTS, ALPHABET, 200)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=sorted(ALPHABET), max_size=80))
def test_decode_of_encode_is_the_text_and_nothing_is_unk(tok, text):
    # a special's own spelling ("<eos>") is that special, in both tokenizers
    assume(not any(sp in text for sp in SPECIALS))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_frequent_words_merge_digits_and_unseen_words_do_not(tok):
    pieces = tok.convert_ids_to_tokens(tok("Task: grey hat, max $10", add_special_tokens=False)
                                       ["input_ids"])
    assert pieces == ["Task", ":", " grey", " hat", ",", " max", " $", "1", "0"]
    # a word the texts never had is spelt from the alphabet, never <unk>
    unseen = tok.convert_ids_to_tokens(tok(" scarf", add_special_tokens=False)["input_ids"])
    assert "".join(unseen) == " scarf" and len(unseen) > 1
    # no merge crosses a word boundary: "hat," stays two pieces, " grey hat" two
    assert all(" " not in p[1:] for p in tok.get_vocab())
    assert not any(c.isdigit() and len(p) > 1 for p in tok.get_vocab() for c in p)


def test_specials_bos_and_the_character_tokenizers_conventions(tok):
    chars = build_tokenizer(ALPHABET)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id",
                 "padding_side"):
        assert getattr(tok, name) == getattr(chars, name)
    ids = tok("Task")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 2
    assert len(tok) <= 200 and len(tok) > len(ALPHABET) + 4


def test_same_texts_same_tokenizer_json_and_saved_round_trips(tok, tmp_path):
    again = subword.train_bpe(TEXTS, ALPHABET, 200)
    assert subword.to_json(again) == subword.to_json(tok)
    back = subword.from_json(subword.to_json(tok))
    s = "Task: red bag | Action: buy"
    assert back(s)["input_ids"] == tok(s)["input_ids"]
    # what generation loads: save_pretrained, then AutoTokenizer offline
    from transformers import AutoTokenizer

    tok.save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert loaded(s)["input_ids"] == tok(s)["input_ids"] and loaded.decode(
        loaded(s, add_special_tokens=False)["input_ids"]) == s


def test_merges_do_not_depend_on_hash_seed_or_threads():
    import json
    import os
    import subprocess
    import sys

    code = ("import json, string, sys; from stages.models import subword; "
            "texts = json.loads(sys.stdin.read()); "
            "alpha = set(string.printable) - set('\\t\\r\\n\\x0b\\x0c'); "
            "print(subword.to_json(subword.train_bpe(texts, alpha, 200)))")
    outs = set()
    for seed, par in (("1", "false"), ("2", "true")):
        env = {**os.environ, "PYTHONHASHSEED": seed, "TOKENIZERS_PARALLELISM": par,
               "RAYON_NUM_THREADS": "2"}
        proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(TEXTS), env=env,
                              capture_output=True, text=True, check=True)
        outs.add(proc.stdout)
    assert len(outs) == 1
    assert outs.pop().strip() == subword.to_json(subword.train_bpe(TEXTS, ALPHABET, 200))


def test_a_vocabulary_below_the_alphabet_is_refused_by_name():
    with pytest.raises(ValueError, match="vocab_size 50"):
        subword.train_bpe(TEXTS, ALPHABET, 50)


def test_early_experience_world_tokenizer_is_shared_and_shorter():
    """One vocabulary per world from every arm's texts, learnt on prompts and replies apart
    (as training and generation encode them): the reply's first word is one piece, and the
    IWM page, the SR reflection and the rejected DPO action are single pieces too."""
    from stages.agents.react import PromptFormat
    from stages.early_experience.train import Config, world_tokenizer

    fmt = PromptFormat(sep=" | ", window=0)
    prompt = "Task: grey bag, size S, max $40 | Observation: search page | "
    rows = [{"prompt": prompt, "expert_call": "search[grey bag]", "j": j, "call": c, "next": n,
             "reflection": r}
            for j, c, n, r in ((0, "search[grey bag]", "grey bag: 1 $40 S", ""),
                               (1, "back", "item grey bag $60 S", "that lists it; need S"))] * 10
    il = ([prompt] * 10, ["Action: search[grey bag]"] * 10)
    base = dict(arms=["il", "iwm"], seeds=[0, 1], steps=4, prompt=fmt, k=1)
    bpe = subword.from_json(world_tokenizer(Config(**base, tokenizer="bpe"), il, rows))
    chars = subword.from_json(world_tokenizer(Config(**base), il, rows))
    assert len(chars) == 4 + len(ALPHABET)
    assert len(bpe(prompt)["input_ids"]) < len(chars(prompt)["input_ids"]) / 2
    vocab = bpe.get_vocab()
    # "Action" starts every reply: whole when learnt apart (glued to the prompt it would be
    # " Action", and the reply's first word would be spelt)
    assert {"Action", "Observation", "Thought"} <= set(vocab)
    assert {" item", " lists", " back"} <= set(vocab)     # IWM page, reflection, rejected call
    assert bpe.decode(bpe(prompt, add_special_tokens=False)["input_ids"]) == prompt
