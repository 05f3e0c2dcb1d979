"""The tiny vision-language model every vision paper builds on: a LLaVA of a few hundred k params.

What it is: a Hugging Face `LlavaForConditionalGeneration` built from small configs, so it is
saved with `save_pretrained` (one safetensors file: vision tower, projector and decoder) and
loaded with `AutoModelForImageTextToText` / `AutoProcessor` like any real LLaVA:

    image (64x64) -> CLIP patch encoder (8x8 patches -> 64 patch tokens, `vision_layers` ViT
    layers) -> 2-layer GELU projector -> 64 visual embeddings that replace the 64 `<image>`
    tokens of the prompt -> the project's Llama decoder (4 layers, d=128, 4 heads), which reads
    `inputs_embeds` (LLaVA merges them inside its forward).

Tokenizers are built locally (`build_tokenizer`): words (shapes), characters, or character
pairs (rendered text: one text token per two glyph cells = per visual token). Prompts are
encoded piece by piece (`encode_image_prompt`, `encode_text_prompt`) so a piece's tokens never
depend on its neighbours.

Prompt layout (GIFT spec §2), one string per query:

    [system "image :"][visual: <sink> x k, <image> x 64][query "is there a red circle ?"]
    [tail " answer :"]

`prompt_spans` returns v0..v1 (visual, sinks included) and q0..q1 (query), inclusive as in the
spec, and checks them against the decoded tokens. The `k` attention-sink tokens (GIFT spec §4:
"2-4 constant high-norm sink tokens") are a special token `<sink>` whose embedding row is a fixed
vector of norm `sink_norm`, identical for every image and never trained (`restore_sinks` after
each optimiser step): a visual token that carries nothing about the image, which is what a sink
in a real VLM is.

Attention: the decoder runs `eager` attention. SDPA and flash attention never materialise the
attention probabilities, so a method that hooks them (GIFT) would silently do nothing;
`require_eager(model)` raises instead.

At the `gpu` profile `load_vlm(path)` loads a real local LLaVA-style folder (e.g.
llava-hf/llava-1.5-7b-hf downloaded ahead of time) through the same two Auto classes, with
`local_files_only=True` and `trust_remote_code=False`; its prompt layout (system, separator and
tail of the chat template) comes from params instead of `paperline_vlm.json`, and it has no
added sinks (a real model has its own). Text-only input (the CoRe text-conditioned policy) is
the same model without `pixel_values` or `<image>` tokens.

    python -m stages vlm train_shapes          # builds, trains, saves one model per seed
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

IMAGE_TOKEN = "<image>"
SINK_TOKEN = "<sink>"
LAYOUT_FILE = "paperline_vlm.json"   # the prompt layout saved beside the weights


class EagerAttentionRequired(RuntimeError, ValueError):
    """A method hooks attention probabilities but the model does not run eager attention (a
    ValueError too: it is a bad model argument, named before any compute)."""


class PromptSpanError(ValueError):
    """A prompt's tokens do not follow the layout (the spans would point at the wrong tokens)."""


class Layout(BaseModel):
    """The prompt template: `{system}{<sink> x sinks}{<image> x n}{sep}{query}{tail}`."""

    model_config = ConfigDict(extra="forbid")

    system: str = Field("image :", description="text before the visual tokens")
    sep: str = Field(" ", description="text between the visual tokens and the query")
    tail: str = Field(" answer :", description="text after the query (the chat template's tail)")
    text_system: str = Field("text :", description="text-only prompts: text before the content")
    sink_tokens: int = Field(2, ge=0, le=16, description="constant <sink> tokens per image")
    image_tokens: int = Field(64, ge=1, description="<image> tokens per image (patch tokens)")


class Spec(BaseModel):
    """Architecture of a tiny VLM (init: scratch)."""

    model_config = ConfigDict(extra="forbid")

    image_size: int = Field(64, ge=8, le=1024, description="square input side, pixels")
    patch_size: int = Field(8, ge=2, le=64, description="patch side: (image/patch)^2 tokens")
    channels: int = Field(3, ge=1, le=4, description="input channels (greyscale is converted)")
    vision_hidden: int = Field(64, ge=8, le=4096, description="patch encoder width")
    vision_layers: int = Field(1, ge=1, le=48, description="ViT layers over the patches")
    vision_heads: int = Field(4, ge=1, le=64, description="ViT attention heads")
    hidden_size: int = Field(128, ge=16, le=8192, description="decoder width d")
    num_layers: int = Field(4, ge=1, le=128, description="decoder layers")
    num_heads: int = Field(4, ge=1, le=128, description="decoder attention heads")
    intermediate_size: int = Field(256, ge=16, le=32768, description="decoder MLP width")
    max_positions: int = Field(256, ge=32, le=32768, description="longest sequence, tokens")
    sink_norm: float = Field(20.0, gt=0, le=1e4,
                             description="L2 norm of each sink embedding (a real token's "
                                         "embedding starts near 0.2)")
    attn_implementation: str = Field("eager", description="decoder attention: eager (hookable)")

    @model_validator(mode="after")
    def _check(self) -> "Spec":
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size "
                             f"{self.patch_size}")
        for width, heads, name in ((self.hidden_size, self.num_heads, "hidden_size"),
                                   (self.vision_hidden, self.vision_heads, "vision_hidden")):
            if width % heads:
                raise ValueError(f"{name} {width} is not divisible by its heads ({heads})")
        return self

    @property
    def patch_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2


# --- tokenizers -----------------------------------------------------------------------------

def build_tokenizer(kind: str, texts: Sequence[str]) -> Any:
    """A `PreTrainedTokenizerFast` for the tiny VLM, built locally with `tokenizers`.

    `word`: one token per whitespace-separated word of `texts` (the shapes world: a caption of
    four objects is 15 tokens, not 60 characters); `char`: the project's character tokenizer
    (stages/models/tokenizer.py) over `texts` plus printable ASCII; `pair`: one token per two
    characters, counted from the start of each piece (every pair of the characters in `texts`,
    and each single one), so a rendered page's visual token (two glyph cells) and the text
    token of the same two characters correspond one to one (rendered text). All add the
    special tokens `<image>` and `<sink>`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from stages.models.tokenizer import BOS, EOS, PAD, SPECIALS, UNK
    from stages.models.tokenizer import build_tokenizer as build_char_tokenizer

    if kind == "char":
        chars = set("".join(texts)) | (set(string.printable) - set("\t\r\x0b\x0c"))
        tok = build_char_tokenizer(chars)
    elif kind in ("word", "pair"):
        vocab = {t: i for i, t in enumerate(SPECIALS)}
        if kind == "word":
            pieces = sorted({w for t in texts for w in t.split()})
        else:
            chars = sorted(set("".join(texts)) - {"\n"})
            pieces = chars + [a + b for a in chars for b in chars]
        for piece in pieces:
            vocab.setdefault(piece, len(vocab))
        core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
        if kind == "word":
            core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
            core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words, spaced
        else:
            core.pre_tokenizer = pre_tokenizers.Split(Regex(".{1,2}"), behavior="isolated")
            core.decoder = decoders.Fuse()
        core.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
        tok = PreTrainedTokenizerFast(
            tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
            padding_side="left", clean_up_tokenization_spaces=False, model_max_length=4096)
    else:
        raise ValueError(f"tokenizer kind {kind!r}: expected 'word', 'char' or 'pair'")
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, SINK_TOKEN]})
    return tok


# --- the model ------------------------------------------------------------------------------

def sink_vectors(k: int, d: int, norm: float) -> Any:
    """The k constant sink embeddings: fixed directions (generator seed 0, independent of the
    training seed), each of L2 norm `norm`."""
    import torch

    g = torch.Generator().manual_seed(0)
    v = torch.randn(k, d, generator=g)
    return v / v.norm(dim=-1, keepdim=True) * norm


def build_vlm(spec: Spec, layout: Layout, tokenizer: Any) -> tuple[Any, Any]:
    """(model, processor): a fresh tiny LLaVA and its LlavaProcessor (image processor + tokenizer).

    Call `torch.manual_seed` first: the weights are drawn from the global generator."""
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration)

    if layout.image_tokens != spec.patch_tokens:
        raise ValueError(f"layout.image_tokens = {layout.image_tokens} but the encoder gives "
                         f"{spec.patch_tokens} patch tokens ((image_size/patch_size)^2)")
    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
        num_hidden_layers=spec.vision_layers, num_attention_heads=spec.vision_heads,
        image_size=spec.image_size, patch_size=spec.patch_size, num_channels=3,
        projection_dim=spec.vision_hidden)
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_positions, rope_theta=10000.0,
        tie_word_embeddings=False, attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    config = LlavaConfig(
        vision_config=vision, text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=spec.patch_tokens, vision_feature_layer=-1,
        vision_feature_select_strategy="default", projector_hidden_act="gelu")
    config._attn_implementation = spec.attn_implementation
    model = LlavaForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    set_sinks(model, tokenizer, spec.sink_norm)
    return model, build_processor(spec, tokenizer)


def build_processor(spec: Spec, tokenizer: Any) -> Any:
    """LLaVA's processor: a CLIP image processor that keeps the native size (no resize or
    crop; greyscale -> RGB; pixels to [-1, 1]) and expands each `<image>` to the patch tokens."""
    from transformers import LlavaProcessor
    from transformers.models.clip import CLIPImageProcessorPil

    images = CLIPImageProcessorPil(
        do_resize=False, do_center_crop=False, do_convert_rgb=True, do_rescale=True,
        do_normalize=True, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
        size={"height": spec.image_size, "width": spec.image_size},
        crop_size={"height": spec.image_size, "width": spec.image_size})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer,
                          patch_size=spec.patch_size, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1, image_token=IMAGE_TOKEN)


def sink_ids(tokenizer: Any) -> int:
    return tokenizer.convert_tokens_to_ids(SINK_TOKEN)


def set_sinks(model: Any, tokenizer: Any, norm: float) -> None:
    """Write the constant sink vector into the `<sink>` embedding row (one row: every sink
    position of every image gets the same high-norm vector)."""
    import torch

    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        emb[sink_ids(tokenizer)] = sink_vectors(1, emb.shape[1], norm)[0].to(emb.dtype)


def restore_sinks(model: Any, tokenizer: Any, norm: float) -> None:
    """Undo any optimiser update of the sink row (weight decay moves it even with no gradient)."""
    set_sinks(model, tokenizer, norm)


def require_eager(model: Any) -> None:
    """Raise EagerAttentionRequired unless the decoder computes explicit attention probabilities:
    the model's (text) config and every decoder attention module's config must say `eager`.

    Hooks on attention probabilities (GIFT) do nothing under SDPA or flash attention, silently.
    Works on a LLaVA and on a bare language model (e.g. LlamaForCausalLM)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    impls = {getattr(config, "_attn_implementation", None)}
    impls |= {m.config._attn_implementation for m in model.modules()
              if hasattr(m, "layer_idx") and hasattr(m, "o_proj") and hasattr(m, "config")}
    if impls != {"eager"}:
        runs = ", ".join(repr(i) for i in sorted(impls, key=str))
        raise EagerAttentionRequired(
            f"the decoder runs {runs} attention: hooks on attention probabilities would be "
            f"silently ignored. Load it with attn_implementation='eager' (load_vlm(path, "
            f"attn_implementation='eager') or model.set_attn_implementation('eager'))")


# --- prompts --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spans:
    """Positions in one prompt (inclusive ends, GIFT spec §2): visual v0..v1 (sinks first, then
    patch tokens), query q0..q1; the system part is [0, v0), the tail (q1, length). The one
    definition every vision method uses (GIFT's attention edit, the gates' sink share)."""

    v0: int
    v1: int
    q0: int
    q1: int
    length: int | None = None          # the prompt's token count, where known
    sinks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.v0 <= self.v1 < self.q0 <= self.q1:
            raise PromptSpanError(f"spans must satisfy 0 <= v0 <= v1 < q0 <= q1 (visual tokens "
                                  f"before the query), got {self}")
        if self.length is not None and self.q1 >= self.length:
            raise PromptSpanError(f"the query ends at q1 = {self.q1} but the prompt has "
                                  f"{self.length} tokens")

    @property
    def n_visual(self) -> int:
        return self.v1 - self.v0 + 1

    @property
    def n_query(self) -> int:
        return self.q1 - self.q0 + 1

    @property
    def visual(self) -> slice:
        return slice(self.v0, self.v1 + 1)

    @property
    def query(self) -> slice:
        return slice(self.q0, self.q1 + 1)

    @property
    def patches(self) -> slice:
        """The image's patch tokens only (the visual span without the sinks)."""
        return slice(self.v0 + len(self.sinks), self.v1 + 1)


def image_prompt(layout: Layout, query: str) -> str:
    """The prompt string of one image and one query (`<image>` expands in the processor)."""
    return f"{layout.system}{SINK_TOKEN * layout.sink_tokens}{IMAGE_TOKEN}{layout.sep}{query}" \
           f"{layout.tail}"


def text_prompt(layout: Layout, content: str, query: str) -> str:
    """A text-only prompt: the same template with the content where the image was."""
    return f"{layout.text_system}{content}{layout.sep}{query}{layout.tail}"


def _piece_ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _bos(tokenizer: Any) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def encode_image_prompt(layout: Layout, tokenizer: Any, query: str) -> list[int]:
    """Token ids of `image_prompt`, `<image>` expanded to its patch tokens, each piece
    (system, separator, query, tail) tokenized on its own, so a piece's tokens never depend on
    its neighbours (for the word and character tokenizers this is what the processor gives on
    the whole string; tests check it)."""
    ids = _bos(tokenizer) + _piece_ids(tokenizer, layout.system)
    ids += [tokenizer.convert_tokens_to_ids(SINK_TOKEN)] * layout.sink_tokens
    ids += [tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)] * layout.image_tokens
    for piece in (layout.sep, query, layout.tail):
        ids += _piece_ids(tokenizer, piece)
    return ids


def encode_text_prompt(layout: Layout, tokenizer: Any, content: str, query: str) -> list[int]:
    """Token ids of `text_prompt`, piece by piece as `encode_image_prompt`: the content's
    tokens are those of its transcription."""
    ids = _bos(tokenizer)
    for piece in (layout.text_system, content, layout.sep, query, layout.tail):
        ids += _piece_ids(tokenizer, piece)
    return ids


def prompt_spans(input_ids: Sequence[int], tokenizer: Any, layout: Layout,
                 query: str | None = None) -> Spans:
    """The spans of one prompt's ids (left padding allowed), checked against the layout.

    Visual: from the first `<sink>`/`<image>` to the last `<image>`; query: after the
    separator's tokens up to the tail's tokens, which must close the prompt. With `query`
    given, the query span must decode to it. Any mismatch raises PromptSpanError: a template
    change would otherwise shift every index silently (GIFT spec §6)."""
    ids = list(input_ids)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    sink_id = tokenizer.convert_tokens_to_ids(SINK_TOKEN)
    visual = [i for i, t in enumerate(ids) if t in (image_id, sink_id)]
    if not visual:
        raise PromptSpanError("no <image> or <sink> token in the prompt")
    v0, v1 = visual[0], visual[-1]
    if visual != list(range(v0, v1 + 1)) or ids[v1] != image_id:
        raise PromptSpanError(f"visual tokens are not one run ending in {IMAGE_TOKEN} "
                              f"(positions {v0}..{v1})")
    sinks = tuple(i for i in visual if ids[i] == sink_id)
    if sinks != tuple(range(v0, v0 + len(sinks))):
        raise PromptSpanError("sink tokens are not at the start of the visual span")
    n_images = sum(1 for i in visual if ids[i] == image_id)
    if n_images != layout.image_tokens or len(sinks) != layout.sink_tokens:
        raise PromptSpanError(f"{n_images} image and {len(sinks)} sink tokens; the layout says "
                              f"{layout.image_tokens} and {layout.sink_tokens}")
    tail = _piece_ids(tokenizer, layout.tail)
    if tail and ids[len(ids) - len(tail):] != tail:
        raise PromptSpanError(f"the prompt does not end with the tail {layout.tail!r}: "
                              f"{tokenizer.decode(ids[-len(tail):])!r}")
    q0 = v1 + 1 + len(_piece_ids(tokenizer, layout.sep))
    q1 = len(ids) - len(tail) - 1
    if q1 < q0:
        raise PromptSpanError(f"empty query span ({q0}..{q1})")
    if query is not None:
        got = tokenizer.decode(ids[q0:q1 + 1]).strip()
        if got != query.strip():
            raise PromptSpanError(f"query span decodes to {got!r}, expected {query!r}")
    return Spans(v0=v0, v1=v1, q0=q0, q1=q1, length=len(ids), sinks=sinks)


# --- save / load ----------------------------------------------------------------------------

@dataclass
class VLM:
    """What `load_vlm` returns: the model, its processor (tokenizer inside) and prompt layout."""

    model: Any
    processor: Any
    layout: Layout
    sink_norm: float | None = None     # tiny models: the constant the sink row must keep

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer


def save_vlm(vlm: VLM, path: str | Path) -> Path:
    """`save_pretrained` of model and processor plus the layout, written atomically."""
    from stages.core import io

    with io.atomic_path(path, is_dir=True) as tmp:
        vlm.model.save_pretrained(str(tmp))
        vlm.processor.save_pretrained(str(tmp))
        (tmp / LAYOUT_FILE).write_text(json.dumps(
            {"layout": vlm.layout.model_dump(), "sink_norm": vlm.sink_norm}, indent=2) + "\n")
    return Path(path)


def load_vlm(path: str | Path, *, attn_implementation: str = "eager",
             layout: Layout | dict | None = None, device: str | None = None,
             dtype: Any = None) -> VLM:
    """A tiny VLM saved by `save_vlm`, or a real local LLaVA-style folder (gpu profile).

    Both go through `AutoModelForImageTextToText` / `AutoProcessor`, offline and without
    remote code. A folder without `paperline_vlm.json` needs `layout` (its chat template's
    system / separator / tail, and its image token count)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from stages.models.generate import default_device

    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json; expected a save_pretrained VLM "
                                f"folder (nothing is downloaded)")
    saved: dict[str, Any] = {}
    if (folder / LAYOUT_FILE).is_file():
        from stages.core.checks import read_json_checked

        saved = read_json_checked(folder / LAYOUT_FILE, {"layout": dict})
    if layout is None and "layout" not in saved:
        raise ValueError(f"{folder}: no {LAYOUT_FILE}; pass the prompt layout of this model "
                         f"(system, sep, tail, sink_tokens=0, image_tokens)")
    lay = Layout.model_validate(layout if layout is not None else saved["layout"])
    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False,
                              "attn_implementation": attn_implementation}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForImageTextToText.from_pretrained(str(folder), **kwargs)
    processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True,
                                              trust_remote_code=False)
    if processor.tokenizer.pad_token_id is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    processor.tokenizer.padding_side = "left"
    model.to(device or default_device())
    model.eval()
    return VLM(model=model, processor=processor, layout=lay, sink_norm=saved.get("sink_norm"))


# --- inputs ---------------------------------------------------------------------------------

def pixel_values(processor: Any, images: Sequence[Any]) -> Any:
    """uint8 (H, W, 3) or (H, W) arrays -> the model's `pixel_values`, through the processor's
    own image processor: the tiny model's (greyscale -> RGB, [-1, 1]) or a real VLM's (which
    also resizes to its input size). One path for training, evaluation and every model."""
    from PIL import Image

    return processor.image_processor(images=[Image.fromarray(a) for a in images],
                                     return_tensors="pt")["pixel_values"]


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Any, Any]:
    """Left-padded ids and attention mask (generation continues at the right edge)."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


def generate(vlm: VLM, prompts: Sequence[Sequence[int]], images: Sequence[Any] | None = None,
             *, max_new_tokens: int = 32, batch_size: int = 64) -> list[str]:
    """Greedy completions of pre-encoded prompts (with one image each, or none), decoded
    without special tokens."""
    import torch

    tok = vlm.tokenizer
    out: list[str] = []
    device = vlm.model.device
    for i in range(0, len(prompts), batch_size):
        ids, mask = left_pad(prompts[i:i + batch_size], tok.pad_token_id)
        kwargs: dict[str, Any] = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        if images is not None:
            kwargs["pixel_values"] = pixel_values(vlm.processor,
                                                  images[i:i + batch_size]).to(device)
        with torch.no_grad():
            seqs = vlm.model.generate(**kwargs, max_new_tokens=max_new_tokens, do_sample=False,
                                      pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id)
        out += tok.batch_decode(seqs[:, ids.shape[1]:], skip_special_tokens=True)
    return out
