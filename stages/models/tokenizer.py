"""Stage `tokenizer`: a character-level tokenizer built locally from the task data.

Every character of the train split's prompts and targets becomes one token (plus `<pad>`,
`<bos>`, `<eos>`, `<unk>`; optionally all printable ASCII so later task families never hit
`<unk>`). Built with `tokenizers` (WordLevel over a one-character split, Fuse decoder) and saved
as a `PreTrainedTokenizerFast`, so `AutoTokenizer.from_pretrained(path)` loads it offline like
any Hugging Face tokenizer. Encoding prepends `<bos>`; `<eos>` is appended by the training code
to each target, and generation stops on it.

    python -m stages base tokenizer          # reads <paths.tasks>/<family>/train.parquet
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.core import io

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)  # ids 0..3, in this order


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    families: list[str] = Field(
        default_factory=lambda: ["arith"], min_length=1,
        description="task families whose train split characters make up the vocabulary")
    columns: list[str] = Field(
        default_factory=lambda: ["prompt", "target"], min_length=1,
        description="text columns of the train split scanned for characters")
    add_printable_ascii: bool = Field(
        True, description="also add every printable ASCII character (costs ~100 vocabulary "
                          "rows; later families with new symbols then never map to <unk>)")


def build_tokenizer(chars: set[str] | str) -> Any:
    """A `PreTrainedTokenizerFast` over `chars` (one token each) plus the four specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(set(chars) - set(SPECIALS)):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # One piece per character (spaces included), glued back together on decode.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        padding_side="left", clean_up_tokenization_spaces=False, model_max_length=4096)


def train_chars(tasks_dir: Path, families: list[str], columns: list[str]) -> set[str]:
    from stages.tasks import load_split

    chars: set[str] = set()
    for family in families:
        # Validated at the stage boundary: a missing, truncated or schema-violating split fails
        # here naming the file, column and rule.
        df = load_split(tasks_dir, family, "train").select(columns)
        for col in columns:
            for text in df[col].unique().to_list():
                chars.update(text)
    return chars


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    chars = train_chars(ctx.path("tasks"), cfg.families, cfg.columns)
    data_chars = len(chars)
    if cfg.add_printable_ascii:
        chars |= set(string.printable) - set("\t\n\r\x0b\x0c")
    tokenizer = build_tokenizer(chars)
    with io.atomic_path(ctx.path("tokenizer"), is_dir=True) as tmp:
        tokenizer.save_pretrained(str(tmp))
    return {"vocab_size": float(len(tokenizer)), "data_chars": float(data_chars)}


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the vocabulary size; the characters seen in the data in
    details/tokenizer.json."""
    return {k: metrics[k] for k in ("vocab_size",) if k in metrics}
