"""Read and steer the residual stream of a Hugging Face decoder with forward hooks.

CoT-FSM (arXiv 2510.22437) decodes reasoning states from hidden states at one layer and steers by
activation addition at sentence ends: `h <- h + alpha * v` at that one position and layer, where v
is a difference of mean activations (optionally made orthogonal to the current h). This module
gives the two primitives on the project's real `LlamaForCausalLM` (and any model whose
`get_decoder()` has `.embed_tokens`, `.layers` and `.norm`), as context managers that always
remove their hooks, on an exception too:

    with read_residual(model, layer=2) as acts:      # read
        model(input_ids)
    h = acts.sequence()                              # (batch, columns, d)

    add = ActivationAddition(v, where=at_tokens(sentence_end_ids), alpha=0.8)
    with steer(model, layer=2, edit=add):            # steer, also inside model.generate(...)
        out = model.generate(**batch)
    add.interventions                                # edited positions per row

Layer index = the index into `output_hidden_states`, l in [0, L] for L blocks:
    l = 0         the token embeddings (what block 0 reads)
    0 < l < L     the output of block l-1, i.e. the residual stream entering block l
    l = L         the final normed state (transformers ties hidden_states[-1] to it)
so what `read_residual(model, l)` records equals `hidden_states[l]` (tested), and steering at l
changes what block l (or the LM head, for l = L) reads. Steering hooks run before any other
forward hook of that module, so `output_hidden_states` reports the steered stream.

Positions are absolute columns of the token sequence (left padding included). In cached
generation each forward sees only the new tokens; a pre-hook on the model reads the cache length
and gives the edit the columns it is at, so one rule means the same thing in a full forward and
in `generate` (tested: a cached steered continuation equals the full steered forward). Steering a
position changes that position and, through attention, only later ones (causal models).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch


@dataclass
class Site:
    """Where a hook fires: the absolute columns of this forward's tokens and their ids."""

    columns: torch.Tensor              # (T,) long
    input_ids: torch.Tensor | None     # (B, T) or None when the model got inputs_embeds


Edit = Callable[[torch.Tensor, Site], "torch.Tensor | None"]


def _decoder(model: Any) -> Any:
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model
    for name in ("embed_tokens", "layers", "norm"):
        if not hasattr(inner, name):
            raise TypeError(f"{type(model).__name__}: its decoder "
                            f"({type(inner).__name__}) has no `.{name}`; hooks expect a "
                            f"Llama-style decoder (embed_tokens, layers, norm)")
    return inner


def num_layers(model: Any) -> int:
    """L, the number of decoder blocks: valid layer indices are 0..L."""
    return len(_decoder(model).layers)


def residual_module(model: Any, layer: int) -> torch.nn.Module:
    """The module whose output is `hidden_states[layer]` (see the module docstring)."""
    inner = _decoder(model)
    n = len(inner.layers)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= n:
        raise ValueError(f"layer = {layer!r}: expected an int in [0, {n}] (0: embeddings, "
                         f"{n}: the final normed state) for this {n}-block model")
    if layer == 0:
        return inner.embed_tokens
    if layer == n:
        return inner.norm
    return inner.layers[layer - 1]


class _ColumnTracker:
    """Pre-hook on the model: the columns and token ids of the forward that is running."""

    def __init__(self) -> None:
        self.site: Site | None = None

    def before(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        width = ids.shape[1] if ids is not None else embeds.shape[1]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        offset = int(cache.get_seq_length()) if cache is not None else 0
        device = (ids if ids is not None else embeds).device
        self.site = Site(torch.arange(offset, offset + width, device=device), ids)

    def after(self, module: Any, args: tuple, output: Any) -> None:
        self.site = None

    def current(self, hidden: torch.Tensor) -> Site:
        if self.site is not None and self.site.columns.numel() == hidden.shape[1]:
            return self.site
        # The decoder was called directly, not through the hooked model: assume no cache.
        return Site(torch.arange(hidden.shape[1], device=hidden.device), None)


@contextlib.contextmanager
def _hooked(model: Any, module: torch.nn.Module, on_output: Callable[..., Any],
            prepend: bool) -> Iterator[None]:
    tracker = _ColumnTracker()
    handles = []
    try:
        handles.append(model.register_forward_pre_hook(tracker.before, with_kwargs=True))
        handles.append(model.register_forward_hook(tracker.after))
        handles.append(module.register_forward_hook(
            lambda mod, args, output: on_output(output, tracker), prepend=prepend))
        yield
    finally:
        for h in handles:
            h.remove()


def _hidden_of(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _with_hidden(output: Any, hidden: torch.Tensor) -> Any:
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


class Activations:
    """What `read_residual` recorded: one (columns, hidden (B, T, d)) per forward call."""

    def __init__(self, device: str | torch.device | None):
        self.device = device
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _record(self, output: Any, tracker: _ColumnTracker) -> None:
        hidden = _hidden_of(output).detach()
        site = tracker.current(hidden)
        hidden = hidden.to(self.device) if self.device is not None else hidden.clone()
        self.calls.append((site.columns.to(hidden.device), hidden))

    def sequence(self) -> torch.Tensor:
        """(B, columns, d) of the latest sequence: the calls since the last one that started at
        column 0 (one full forward, or a prefill and its cached decoding steps), concatenated."""
        if not self.calls:
            raise ValueError("read_residual recorded nothing: was the model called inside "
                             "the `with` block?")
        starts = [i for i, (cols, _) in enumerate(self.calls) if int(cols[0]) == 0]
        parts = self.calls[starts[-1] if starts else 0:]
        cols = torch.cat([c for c, _ in parts])
        if not torch.equal(cols, torch.arange(int(cols[0]), int(cols[0]) + cols.numel(),
                                              device=cols.device)):
            raise ValueError("recorded calls are not one contiguous sequence; use `.calls`")
        return torch.cat([h for _, h in parts], dim=1)


@contextlib.contextmanager
def read_residual(model: Any, layer: int, *, device: str | torch.device | None = None
                  ) -> Iterator[Activations]:
    """Record `hidden_states[layer]` of every forward inside the block (detached; moved to
    `device` when given, e.g. "cpu" to keep GPU memory free)."""
    acts = Activations(device)
    with _hooked(model, residual_module(model, layer), lambda out, tr: acts._record(out, tr),
                 prepend=False):
        yield acts


@contextlib.contextmanager
def steer(model: Any, layer: int, edit: Edit) -> Iterator[None]:
    """Inside the block, `edit(hidden, site)` may replace `hidden_states[layer]` (B, T, d) of
    every forward: it returns the new tensor (same shape) or None to leave it as it is."""

    def on_output(output: Any, tracker: _ColumnTracker) -> Any:
        hidden = _hidden_of(output)
        new = edit(hidden, tracker.current(hidden))
        if new is None:
            return None
        if new.shape != hidden.shape:
            raise ValueError(f"steering edit returned shape {tuple(new.shape)} for hidden "
                             f"states of shape {tuple(hidden.shape)}")
        return _with_hidden(output, new)

    with _hooked(model, residual_module(model, layer), on_output, prepend=True):
        yield


def at_tokens(token_ids: Iterable[int]) -> Callable[[Site], torch.Tensor]:
    """A `where` rule: every position whose token is one of `token_ids` (e.g. the tokenizer's
    sentence-final tokens)."""
    ids = torch.tensor(sorted(set(int(t) for t in token_ids)), dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("at_tokens: no token ids given")

    def where(site: Site) -> torch.Tensor:
        if site.input_ids is None:
            raise ValueError("at_tokens needs input_ids; the model was called with "
                             "inputs_embeds")
        return torch.isin(site.input_ids, ids.to(site.input_ids.device))
    return where


class ActivationAddition:
    """The edit `h <- h + alpha * v` at the positions `where` selects.

    vector: (d,) or one per row (B, d). alpha: a number or one per row (B,).
    where:  a bool mask (B, columns) over absolute columns (columns past its width are never
            steered), or a rule `Site -> (B, T) bool` such as `at_tokens(...)`.
    orthogonal: add v_perp = v - (v . h_hat) h_hat, h_hat = h / (|h| + eps), made orthogonal to
            the CURRENT hidden state at each position (CoT-FSM; not to a mean state).
    `interventions` counts the edited positions per row over all forwards.
    """

    def __init__(self, vector: torch.Tensor, where: torch.Tensor | Callable[[Site], torch.Tensor],
                 alpha: float | torch.Tensor = 1.0, orthogonal: bool = False, eps: float = 1e-6):
        if vector.dim() not in (1, 2):
            raise ValueError(f"steering vector of shape {tuple(vector.shape)}: expected (d,) "
                             f"or (batch, d)")
        if isinstance(where, torch.Tensor) and (where.dim() != 2 or where.dtype != torch.bool):
            raise ValueError(f"where: expected a bool mask (batch, columns), got "
                             f"{where.dtype} of shape {tuple(where.shape)}")
        self.vector, self.where, self.alpha = vector, where, alpha
        self.orthogonal, self.eps = orthogonal, eps
        self.interventions: torch.Tensor | None = None

    def _mask(self, hidden: torch.Tensor, site: Site) -> torch.Tensor:
        if callable(self.where) and not isinstance(self.where, torch.Tensor):
            mask = self.where(site)
        else:
            cols = site.columns.to(self.where.device)
            inside = cols < self.where.shape[1]
            mask = torch.zeros(self.where.shape[0], cols.numel(), dtype=torch.bool,
                               device=self.where.device)
            mask[:, inside] = self.where[:, cols[inside]]
        if mask.shape != hidden.shape[:2]:
            raise ValueError(f"steering positions of shape {tuple(mask.shape)} for hidden "
                             f"states of shape {tuple(hidden.shape[:2])} (batch, tokens)")
        return mask.to(hidden.device)

    def __call__(self, hidden: torch.Tensor, site: Site) -> torch.Tensor | None:
        mask = self._mask(hidden, site)
        count = mask.sum(dim=1).cpu()
        self.interventions = count if self.interventions is None else self.interventions + count
        if not mask.any():
            return None
        d = hidden.shape[-1]
        if self.vector.shape[-1] != d:
            raise ValueError(f"steering vector has d = {self.vector.shape[-1]}, the residual "
                             f"stream d = {d}")
        v = self.vector.to(hidden.device, hidden.dtype)
        v = v.expand(hidden.shape[0], d) if v.dim() == 1 else v          # (B, d)
        v = v[:, None, :].expand_as(hidden)                              # (B, T, d)
        if self.orthogonal:
            h_hat = hidden / (hidden.norm(dim=-1, keepdim=True) + self.eps)
            v = v - (v * h_hat).sum(-1, keepdim=True) * h_hat
        alpha = torch.as_tensor(self.alpha, dtype=hidden.dtype, device=hidden.device)
        alpha = alpha.reshape(-1, 1, 1) if alpha.dim() == 1 else alpha  # (B, 1, 1) or scalar
        return torch.where(mask[..., None], hidden + alpha * v, hidden)
