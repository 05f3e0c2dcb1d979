"""A continuous-batching inference engine on a Hugging Face causal LM with a KV cache.

The three operations an iteration-level scheduler (Orca, OSDI'22; vLLM, SOSP'23) needs, on the
project's own tiny model through plain `transformers` (greedy decoding only):

    engine = Engine(model, pad_id=tokenizer.pad_token_id)
    batch, first = engine.prefill([[1, 17, 20], [1, 5]])   # newcomers: their KV cache + 1st token
    nxt = engine.decode(batch)                               # one token for every running row
    batch = Engine.merge(batch, other)                       # admit prefilled newcomers
    batch = Engine.select(batch, [0, 2])                     # drop finished rows

Both `stages.serving.profile` (what the latency model is fitted on) and `stages.serving.server`
(check 2's real server) run exactly these functions, so the fitted constants describe the
server's own iterations.

Layout of the running batch (the choice, and why): ONE batched `DynamicCache` for all running
sequences, LEFT-padded to the longest context, with a 0/1 attention mask marking the real
tokens and explicit position ids (a row's next position = its own real length). Padding is
re-done only when the membership changes (`merge`, `select`), not at every step, and columns
that every row pads are trimmed in `select`. Masked keys get exactly zero attention weight, so
a row's greedy tokens do not depend on its neighbours beyond float rounding (the test checks
them against `generate` token for token). The alternative, one cache per sequence stacked at
every step, is simpler but copies the whole KV cache once per step.

Costs this layout has that a paged-attention server (vLLM) does not: a prefill batch of mixed
prompt lengths is padded to the longest, so it computes B*max(l) tokens where the DistServe form
counts sum(l); a decode step attends over B*W cache columns, W the longest context, where the
form counts the real context C; `DynamicCache.update` concatenates, so every step copies the
cache (a cost proportional to C, inside the fitted per-context-token term).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass
class RunningBatch:
    """The KV cache and bookkeeping of the sequences decoding together (B rows, W columns)."""

    cache: Any            # transformers DynamicCache; keys/values (B, kv_heads, W, head_dim)
    mask: Any             # (B, W) long: 1 = a real token's KV, 0 = left padding
    pos: Any              # (B,) long: position id of the next token = real tokens so far
    last: Any             # (B,) long: the last token produced, the next decode step's input

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def context_tokens(self) -> int:
        """C of the decode form: real (unpadded) tokens in the cache over all rows."""
        return int(self.mask.sum())

    def kv_tensors(self) -> list[tuple[Any, Any]]:
        return [(layer.keys, layer.values) for layer in self.cache.layers]


def _cache_from(tensors: Sequence[tuple[Any, Any]]) -> Any:
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=list(tensors))


class Engine:
    """Greedy prefill / decode on `model` (eval mode, any device) with a batched KV cache."""

    def __init__(self, model: Any, pad_id: int) -> None:
        self.model = model
        self.pad_id = int(pad_id)
        self.device = next(model.parameters()).device
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))

    def prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[RunningBatch, Any]:
        """Run the prompts as one left-padded batch; return their cache and first tokens (B,)."""
        import torch

        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prefill needs at least one prompt, each of at least one token")
        width = max(len(p) for p in prompts)
        if width > self.max_positions:
            raise ValueError(f"prompt of {width} tokens: the model has "
                             f"{self.max_positions} positions")
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        # Positions count real tokens only, as `generate` does for left padding.
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                             use_cache=True, logits_to_keep=1)
        first = out.logits[:, -1].argmax(-1)
        batch = RunningBatch(cache=out.past_key_values, mask=mask, pos=mask.sum(-1), last=first)
        return batch, first

    def decode(self, batch: RunningBatch) -> Any:
        """One decode step of every row: appends to the cache, returns the new tokens (B,)."""
        import torch

        if int(batch.pos.max()) >= self.max_positions:
            raise ValueError(f"a sequence reached the model's {self.max_positions} positions")
        mask = torch.cat([batch.mask, batch.mask.new_ones((batch.size, 1))], dim=1)
        with torch.inference_mode():
            out = self.model(input_ids=batch.last[:, None], attention_mask=mask,
                             position_ids=batch.pos[:, None], cache=batch.cache,
                             use_cache=True)
        nxt = out.logits[:, -1].argmax(-1)
        # New tensors, never in-place updates: the profiler restores a batch by keeping the old
        # references (`snapshot` / `restore`).
        batch.mask, batch.pos, batch.last = mask, batch.pos + 1, nxt
        return nxt

    @staticmethod
    def merge(a: RunningBatch | None, b: RunningBatch) -> RunningBatch:
        """Rows of `a` then rows of `b` in one batch, both left-padded to the wider one."""
        import torch
        import torch.nn.functional as F

        if a is None:
            return b
        width = max(a.mask.shape[1], b.mask.shape[1])

        def pad(t: Any, w: int) -> Any:           # left-pad the sequence dimension to w
            return F.pad(t, (0, 0, w - t.shape[-2], 0)) if t.dim() == 4 else \
                F.pad(t, (w - t.shape[-1], 0))

        tensors = [(torch.cat([pad(ka, width), pad(kb, width)]),
                    torch.cat([pad(va, width), pad(vb, width)]))
                   for (ka, va), (kb, vb) in zip(a.kv_tensors(), b.kv_tensors())]
        return RunningBatch(cache=_cache_from(tensors),
                            mask=torch.cat([pad(a.mask, width), pad(b.mask, width)]),
                            pos=torch.cat([a.pos, b.pos]), last=torch.cat([a.last, b.last]))

    @staticmethod
    def select(batch: RunningBatch, keep: Sequence[int]) -> RunningBatch | None:
        """The rows `keep` (None when empty), without the columns that all of them pad."""
        import torch

        if not keep:
            return None
        idx = torch.as_tensor(list(keep), dtype=torch.long, device=batch.mask.device)
        mask = batch.mask.index_select(0, idx)
        start = int((mask.sum(0) > 0).nonzero()[0])       # first column some row uses
        tensors = [(k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:])
                   for k, v in batch.kv_tensors()]
        return RunningBatch(cache=_cache_from(tensors), mask=mask[:, start:],
                            pos=batch.pos.index_select(0, idx),
                            last=batch.last.index_select(0, idx))

    @staticmethod
    def snapshot(batch: RunningBatch) -> tuple[Any, ...]:
        """References that `restore` puts back: undoes any number of decode steps, no copy."""
        return (batch.kv_tensors(), batch.mask, batch.pos, batch.last)

    @staticmethod
    def restore(batch: RunningBatch, snap: tuple[Any, ...]) -> None:
        tensors, batch.mask, batch.pos, batch.last = snap
        for layer, (k, v) in zip(batch.cache.layers, tensors):
            layer.keys, layer.values = k, v
