"""The prompts of the structurer and the reader, and the word-level tokenizer both use.

The tokenizer is word-level over the corpus vocabulary (every word of every split's turns,
passages, facts and questions, plus the prompts' words): the corpus is generated from closed
word lists, so nothing is unknown, and a name is one token, which the reader copies in one step
(a character-level tiny model must spell it). A token is a word or a punctuation mark with its
leading space, if any (as GPT-2's), or a newline; glued back exactly on decode (`Fuse`), so
`**Statement:**` round-trips. It is
the reader's tokenizer that counts memory tokens in the prompt.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

PIECE = r" ?\w+| ?[^\w\s]|\s"
SCAFFOLD = "Turn: Facts: NONE **Statement:** **Tags:** [, ] Memory: Question: Answer: (none)"


def structurer_prompt(text: str) -> str:
    return f"Turn: {text}\nFacts:"


def reader_prompt(memory: list[str], question: str) -> str:
    """Memory items one per line (oldest first), then the question."""
    block = "\n".join(memory) if memory else "(none)"
    return f"Memory:\n{block}\nQuestion: {question}\nAnswer:"


def memory_block(memory: list[str]) -> str:
    """The memory part of the reader's prompt, whose tokens are the arm's memory cost."""
    return "\n".join(memory)


def build_word_tokenizer(texts: Iterable[str]) -> Any:
    """A `PreTrainedTokenizerFast`: one token per word, space, newline or punctuation mark of
    `texts` (plus <pad> <bos> <eos> <unk>), saved and loaded like any HF tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ("<pad>", "<bos>", "<eos>", "<unk>")
    vocab = {tok: i for i, tok in enumerate(specials)}
    pieces = set(re.findall(PIECE, SCAFFOLD + " \n"))
    for t in texts:
        pieces.update(re.findall(PIECE, t))
    # each word and mark with and without its leading space: a question or a fact starts a
    # line in one prompt and follows a space in another
    pieces |= {p.lstrip(" ") for p in pieces if p.strip()} | {" " + p.lstrip(" ")
                                                               for p in pieces if p.strip()}
    for p in sorted(pieces):
        vocab.setdefault(p, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        unk_token="<unk>", padding_side="left", clean_up_tokenization_spaces=False,
        model_max_length=4096)


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0
