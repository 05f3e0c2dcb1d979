"""The tiny VLM reading two images and, for the causal arms, BridgeVLM's Causal Tokens.

A prompt is built piece by piece (each piece tokenized on its own, as stages/models/vlm.py does):

    [bos] before : <image> x N  after : <image> x N  [<causal> x (m + g)]  <query>  answer :

`kinds` marks each position: 0 text, 1 visual (the projected patch tokens of the before image,
then of the after image), 2 causal. The forward fills kind-1 positions with the LLaVA's own
projected image features and kind-2 positions with the causal module's tokens, then runs the
LLaVA's decoder on `inputs_embeds` (the LLaVA merge, done here because a second kind of
token is spliced in). The oracle arm reads the true levels as text where the images were.
With the in-decoder RAMP (`CausalModule.decoder_ramp`), forward hooks on the decoder layers
in `CausalSpec.decoder_layers` update the node-token positions after those layers
(`BridgeVLM.decoder_ramp`): in the training forward and in the prompt pass of greedy decoding,
whose KV cache then holds the updated node states for every later token.

Targets: the answer (`answer_only`, BridgeVLM and its ablations, the oracle) or, for the
prompt-level arm (spec §3 (c)), the textual graph and a trace before the answer:

    graph : angle > shadow_len , ... ; changed : angle shadow_len ; => angle

Training rows of an SCM whose edges are held out (`edge_label_scms`) get `=> angle` alone and
no structure question (stages/bridgevlm/train.py `build_examples`). `parse_answer` reads
what follows the last `=>` (the whole text for the other arms).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from stages.bridgevlm.causal import CausalModule
from stages.tasks import pendulum

BEFORE, AFTER, TAIL, ARROW = "before :", "after :", " answer :", "=>"
QUESTION_KINDS = ("intervention", "counterfactual", "structure")


def graph_text(scm: str) -> str:
    return " , ".join(f"{pendulum.VARIABLES[i]} > {pendulum.VARIABLES[j]}"
                      for i, j in pendulum.SCMS[scm][0])


def trace_target(row: dict[str, Any], kind: str, graph: bool = True) -> str:
    """The prompt-level target: true graph, a one-line trace, then `=> answer`. `graph` False
    (rows of an SCM whose edges are held out): `=> answer` alone, since the graph text and the
    traces (descendants, the changed variables, the edge asked about) would spell out its
    edges."""
    if not graph:
        return f"{ARROW} {answer_of(row, kind)}"
    names = pendulum.VARIABLES
    if kind == "intervention":
        changed = [names[k] for k in range(len(names)) if row["before"][k] != row["after"][k]]
        trace, answer = "changed : " + " ".join(changed), row["intervention_answer"]
    elif kind == "counterfactual":
        c = names.index(row["cf_var"])
        desc = descendants(row["scm"], c)
        trace = "descendants : " + (" ".join(names[k] for k in desc) if desc else "none")
        answer = row["cf_answer"]
    else:
        trace, answer = f"edge : {row['struct_cause']} > {row['struct_effect']}", \
            row["struct_answer"]
    return f"graph : {graph_text(row['scm'])} ; {trace} ; {ARROW} {answer}"


def descendants(scm: str, k: int) -> list[int]:
    """Variables downstream of k, in the SCM's topological order."""
    edges, order, _ = pendulum.SCMS[scm]
    down = {k}
    for v in order:
        if any(i in down and j == v for i, j in edges):
            down.add(v)
    return [v for v in order if v in down and v != k]


def answer_of(row: dict[str, Any], kind: str) -> str:
    return {"intervention": row["intervention_answer"], "counterfactual": row["cf_answer"],
            "structure": row["struct_answer"]}[kind]


def query_of(row: dict[str, Any], kind: str) -> str:
    return {"intervention": row["intervention_query"], "counterfactual": row["cf_query"],
            "structure": row["struct_query"]}[kind]


def parse_answer(text: str) -> str:
    return text.split(ARROW)[-1].strip()


# Token ids of each prompt piece, per tokenizer: a run encodes the same few hundred queries
# over and over (every validation pass, the test pass, the examples), and one call into the
# fast tokenizer costs ~0.1 ms of Python: ~4 s of a 50-s training run before this cache. A
# tokenizer must not gain tokens after its first prompt (`build_tokenizer` adds them all first).
_PIECES: "weakref.WeakKeyDictionary[Any, dict[str, list[int]]]" = weakref.WeakKeyDictionary()


def _piece(tok: Any, text: str) -> list[int]:
    if not text.strip():
        return []
    cache = _PIECES.setdefault(tok, {})
    if text not in cache:
        cache[text] = tok(text, add_special_tokens=False)["input_ids"]
    return list(cache[text])


def encode_prompt(tok: Any, query: str, image_tokens: int, causal_tokens: int,
                  values: tuple[Sequence[int], Sequence[int]] | None = None
                  ) -> tuple[list[int], list[int]]:
    """(ids, kinds) of one prompt (module docstring). `values`: the oracle's (before, after)
    levels as text instead of the two images."""
    from stages.models.vlm import IMAGE_TOKEN

    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    ids, kinds = [tok.bos_token_id], [0]

    def text(t: str) -> None:
        p = _piece(tok, t)
        ids.extend(p)
        kinds.extend([0] * len(p))

    for label, k in ((BEFORE, 0), (AFTER, 1)):
        text(label)
        if values is None:
            ids.extend([image_id] * image_tokens)
            kinds.extend([1] * image_tokens)
        else:
            text(pendulum.levels_text(values[k]))
    ids.extend([tok.pad_token_id] * causal_tokens)
    kinds.extend([2] * causal_tokens)
    text(query)
    text(TAIL)
    return ids, kinds


def panel_of_patch(side: int) -> list[int]:
    """Which dashboard panel (= variable, row-major 2x2) each patch token lies in."""
    half = side // 2
    return [(r >= half) * 2 + (c >= half) for r in range(side) for c in range(side)]


class BridgeVLM(nn.Module):
    """A tiny LLaVA (`vlm.model`) plus, for the causal arms, a CausalModule; an auxiliary patch
    head (training only, not saved) names the level each visual token's panel shows."""

    def __init__(self, vlm: Any, causal: CausalModule | None, patch_head: nn.Module | None):
        super().__init__()
        self.llava, self.causal, self.patch_head = vlm.model, causal, patch_head
        self.vlm = vlm

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.llava.model.get_image_features(
            pixel_values=pixel_values, vision_feature_layer=-1,
            vision_feature_select_strategy="default", return_dict=True)
        return torch.stack(list(out.pooler_output))            # (B, N, d)

    def embed(self, ids: torch.Tensor, kinds: torch.Tensor,
              images: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, dict]:
        """inputs_embeds with the visual and causal positions filled; extras: the visual
        features and the causal module's outputs."""
        emb = self.llava.get_input_embeddings()(ids)
        extra: dict[str, Any] = {}
        if images is not None:
            fb, fa = self.image_features(images[0]), self.image_features(images[1])
            vis = torch.cat([fb, fa], dim=1).to(emb.dtype)     # row-major: before, after
            mask = (kinds == 1).unsqueeze(-1).expand_as(emb)
            emb = emb.masked_scatter(mask, vis)
            extra["features"] = (fb, fa)
            if self.causal is not None:
                out = self.causal(fb, fa)
                mask = (kinds == 2).unsqueeze(-1).expand_as(emb)
                emb = emb.masked_scatter(mask, out["tokens"].to(emb.dtype))
                extra["causal"] = out
        return emb, extra

    @contextmanager
    def decoder_ramp(self, kinds: torch.Tensor | None, extra: dict) -> Iterator[None]:
        """While open, the decoder layers in `CausalSpec.decoder_layers` apply the RAMP residual
        (`CausalModule.decoder_update`) to the node-token positions of a forward over the whole
        prompt, with the A that built this batch's Causal Tokens (`extra['causal']`). A no-op
        for a model without the in-decoder RAMP."""
        if self.causal is None or not self.causal.decoder_ramp:
            yield
            return
        if kinds is None or "causal" not in extra:
            raise ValueError("this model runs RAMP inside its decoder: pass the batch's `kinds` "
                             "and the `extra` of `embed` (with the causal module's output)")
        a, m = extra["causal"]["a"], self.causal.spec.nodes
        causal = kinds == 2
        nodes = causal & (causal.long().cumsum(-1) <= m)   # node tokens come first: [H; G]
        layers = self.llava.model.language_model.layers

        def hook(k: int) -> Any:
            def update(_module: Any, _args: Any, out: torch.Tensor) -> torch.Tensor | None:
                if out.shape[1] != nodes.shape[1]:         # a cached step: no node positions
                    return None
                b, _, d = out.shape
                x = self.causal.decoder_update(k, out[nodes].reshape(b, m, d), a.to(out.dtype))
                return out.masked_scatter(nodes.unsqueeze(-1).expand_as(out), x.reshape(-1, d))
            return update

        handles = [layers[layer].register_forward_hook(hook(k))
                   for k, layer in enumerate(self.causal.spec.decoder_layers)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def logits(self, emb: torch.Tensor, mask: torch.Tensor, kinds: torch.Tensor | None = None,
               extra: dict | None = None) -> torch.Tensor:
        """Next-token logits over a batch; a model with the in-decoder RAMP needs `kinds` and
        `extra` (from `embed`), and refuses to run without them."""
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        with self.decoder_ramp(kinds, extra or {}):
            h = self.llava.model.language_model(inputs_embeds=emb, attention_mask=mask,
                                                position_ids=pos).last_hidden_state
        return self.llava.lm_head(h)

    @torch.no_grad()
    def greedy(self, ids: torch.Tensor, kinds: torch.Tensor, mask: torch.Tensor,
               images: tuple[torch.Tensor, torch.Tensor] | None, max_new_tokens: int,
               eos_id: int) -> tuple[list[list[int]], dict]:
        """Greedy continuations of left-padded prompts, with the decoder's KV cache."""
        emb, extra = self.embed(ids, kinds, images)
        table = self.llava.get_input_embeddings()
        lm = self.llava.model.language_model
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        with self.decoder_ramp(kinds, extra):
            res = lm(inputs_embeds=emb, attention_mask=mask, position_ids=pos, use_cache=True)
        cache, last = res.cache, res.last_hidden_state[:, -1]
        nxt_pos = pos[:, -1:] + 1
        out: list[list[int]] = [[] for _ in range(ids.shape[0])]
        done = torch.zeros(ids.shape[0], dtype=torch.bool)
        for _ in range(max_new_tokens):
            nxt = self.llava.lm_head(last).argmax(-1)
            for i, t in enumerate(nxt.tolist()):
                if not done[i]:
                    if t == eos_id:
                        done[i] = True
                    else:
                        out[i].append(t)
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            res = lm(inputs_embeds=table(nxt)[:, None], attention_mask=mask,
                     position_ids=nxt_pos, cache=cache, use_cache=True)
            cache, last = res.cache, res.last_hidden_state[:, -1]
            nxt_pos = nxt_pos + 1
        return out, extra
