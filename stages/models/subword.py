"""A subword (BPE) tokenizer learnt on a task's own text, for tiny models trained from scratch.

The project's default tokenizer (`stages.models.tokenizer`) gives every character a token. On
text made of a small closed vocabulary (an agent's goals, pages and actions) that spends most of
a tiny model's compute on spelling: `Task: grey hat, size L, max $10 | Observation: search page`
is 60 characters but 20 words and symbols. Byte-pair encoding (Sennrich, Haddow & Birch 2016,
arXiv 1508.07909) merges the most frequent adjacent pieces until `vocab_size` is reached or
every piece is whole (on a small closed vocabulary every word then is one token, even a word
seen once), so the model reads ~3x shorter sequences. Learn it on the texts as they will be
encoded: a prompt and its completion apart, if training encodes them apart.

What is kept from the character tokenizer, so nothing downstream changes:
- every printable character is in the vocabulary as a token of its own (`alphabet`): a word
  the training text never had (an OOD category such as `scarf`) is still spelt, never `<unk>`;
- the pieces a merge may join never cross a word boundary: a word with its leading space
  (` grey`), one digit (`$35` is `$`, `3`, `5`: numbers stay compositional, a price the text
  never had is still written digit by digit), one other symbol with its leading space, or a
  lone space; decoding concatenates the pieces (`Fuse`), so decode(encode(s)) == s exactly;
- the four specials with the same ids (`<pad>` 0, `<bos>` 1, `<eos>` 2, `<unk>` 3), `<bos>`
  prepended by the post-processor, left padding: the SFT engine, `generate` and the LLM
  backend use it as they use the character tokenizer.

Saved with the model (`save_pretrained`, a `tokenizer.json` any `AutoTokenizer` loads offline);
`to_json` / `from_json` move it between processes as one string. The learnt merges depend only
on the texts: `tokenizers` sums the word and pair counts and breaks ties by pair id, so neither
its thread count nor Python's hash seed changes them (`test_subword.py` trains in two processes
with different hash seeds and thread settings and compares the JSON).
"""

from __future__ import annotations

from typing import Any, Iterable

from stages.models.tokenizer import BOS, EOS, PAD, SPECIALS, UNK

# one piece: a word with its leading space, one digit, one other symbol (with its leading
# space), or a lone space; every character of any string falls in exactly one piece
PIECES = r" ?[A-Za-z]+|[0-9]| ?[^A-Za-z0-9 ]| "


def train_bpe(texts: Iterable[str], alphabet: Iterable[str], vocab_size: int) -> Any:
    """A `PreTrainedTokenizerFast`: BPE merges learnt on `texts` over the single characters of
    `alphabet` (each a token whatever the texts hold), at most `vocab_size` tokens in all."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    chars = sorted(set(alphabet) - set(SPECIALS))
    if vocab_size < len(SPECIALS) + len(chars):
        raise ValueError(f"subword vocab_size {vocab_size}: below the {len(SPECIALS)} specials "
                         f"+ {len(chars)} characters of the alphabet")
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PIECES), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=chars, limit_alphabet=len(chars),
                                  show_progress=False)
    tok.train_from_iterator(list(texts), trainer)
    return _wrap(tok)


def _wrap(tok: Any) -> Any:
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    ids = [tok.token_to_id(s) for s in SPECIALS]
    if ids != list(range(len(SPECIALS))):
        raise ValueError(f"subword tokenizer: specials {SPECIALS} must have ids 0..3, got {ids}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, ids[1])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        padding_side="left", clean_up_tokenization_spaces=False, model_max_length=4096)


def to_json(tokenizer: Any) -> str:
    """The tokenizer as one JSON string (its `tokenizer.json`)."""
    return tokenizer.backend_tokenizer.to_str()


def from_json(text: str) -> Any:
    """The `PreTrainedTokenizerFast` that `to_json` wrote."""
    from tokenizers import Tokenizer

    return _wrap(Tokenizer.from_str(text))
