"""MAPS global dispatch (Algorithm 1) and decoder-local scheduling, as pure functions.

The method (Zhang et al., ICML 2026, arXiv 2609.15359, §2 "Global dispatch", Algorithm 1, and
"Local scheduling"). Decoder k's KV cache is split into blocks of S tokens; a runtime-state store
keeps, per decoder, the free blocks B_free_k, the blocks reserved for dispatched requests whose
KV has not landed yet B_res_k, and the queue length Q_k:

    B_eff_k = B_free_k - B_res_k
    B_need  = ceil((L_prompt + L̂_up) / S)                 L̂_up from UAC (stages.maps.uac)
    F       = {k : B_need ≤ B_eff_k}
    d*      = argmin_{k∈F} Q_k    if F ≠ ∅                 "MQ": the feasible decoder with the
                                                             shortest queue
            = argmax_k B_eff_k    otherwise                 fallback: most effective memory
    atomically reserve B_need on d*
    no L̂_up within β = 1 s  ->  round-robin

Variants (the paper's ablations, §3): "MC" routing picks argmax_{k∈F} B_eff_k (max capacity)
instead of the shortest queue; "without UAC" passes L̂ instead of L̂_up (q_α = 0); "oracle"
passes the true length. Ties [reconstructed]: MQ breaks a queue-length tie by more B_eff, MC a
B_eff tie by the shorter queue, then the lower index (deterministic).

Local scheduling on each decoder: its ready queue is served shortest-L̂_up-first (SJF), except
that any request that has waited longer than max-wait (1 s; the paper reports flat results for
0.5-5 s) is promoted, oldest first: the guard that keeps SJF from starving long requests (spec
§6). The "FCFS" ablation serves by arrival.

These functions only decide; the simulator owns the state. Reservation must be atomic (spec §6:
two concurrent dispatches must not overbook a decoder): in a discrete-event simulator that means
deciding and reserving in the same event, with `reserve` refusing to go below zero. The staged
release (the prompt part of a reservation is freed from B_res once the KV transfer lands and the
blocks are really allocated; the output part when the request finishes) is `Reservation`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, Sequence

Routing = Literal["mq", "mc"]


@dataclass(frozen=True)
class DecoderState:
    """What the runtime-state store knows about one decoder."""

    free_blocks: int       # B_free: KV blocks not allocated to running requests
    reserved_blocks: int   # B_res: blocks promised to dispatched requests not yet resident
    queue_len: int         # Q: requests waiting on or running at this decoder

    @property
    def effective_blocks(self) -> int:
        """B_eff = B_free - B_res."""
        return self.free_blocks - self.reserved_blocks


@dataclass(frozen=True)
class Dispatch:
    decoder: int
    blocks: int | None    # B_need reserved on it (None: round-robin without a prediction)
    rule: str             # "mq" | "mc" | "fallback" | "round_robin"


def blocks_needed(prompt_tokens: int, output_tokens: float, block_tokens: int = 16) -> int:
    """B_need = ceil((L_prompt + L_out) / S); L_out is L̂_up (MAPS), L̂ (no UAC) or L (oracle)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens = {block_tokens}: must be >= 1")
    if prompt_tokens < 0 or not output_tokens >= 0:
        raise ValueError(f"prompt_tokens {prompt_tokens}, output_tokens {output_tokens}: "
                         "must be >= 0")
    if math.isinf(output_tokens):
        raise ValueError("output_tokens is infinite (no conformal bound yet): dispatch without "
                         "a prediction (upper=None) instead")
    return math.ceil((prompt_tokens + output_tokens) / block_tokens)


def maps_dispatch(decoders: Sequence[DecoderState], prompt_tokens: int, upper: float | None, *,
                  block_tokens: int = 16, routing: Routing = "mq",
                  rr_counter: int = 0) -> Dispatch:
    """Algorithm 1: the decoder for one request. `upper` is L̂_up, or None when the prediction
    did not arrive within β (or q_α is still infinite): then round-robin on `rr_counter`."""
    if not decoders:
        raise ValueError("no decoders")
    if upper is None or math.isinf(upper):
        return Dispatch(rr_counter % len(decoders), None, "round_robin")
    need = blocks_needed(prompt_tokens, upper, block_tokens)
    feasible = [k for k, d in enumerate(decoders) if need <= d.effective_blocks]
    if feasible:
        if routing == "mq":
            k = min(feasible, key=lambda k: (decoders[k].queue_len,
                                             -decoders[k].effective_blocks, k))
        elif routing == "mc":
            k = min(feasible, key=lambda k: (-decoders[k].effective_blocks,
                                             decoders[k].queue_len, k))
        else:
            raise ValueError(f"routing {routing!r}: expected 'mq' or 'mc'")
        return Dispatch(k, need, routing)
    k = min(range(len(decoders)), key=lambda k: (-decoders[k].effective_blocks, k))
    return Dispatch(k, need, "fallback")


# --- the baselines' dispatch rules (same inputs, for the simulator's arms) ----------------------

def round_robin(n_decoders: int, counter: int) -> int:
    return counter % n_decoders


def least_request(decoders: Sequence[DecoderState]) -> int:
    """The decoder with the fewest requests (ties: lower index)."""
    return min(range(len(decoders)), key=lambda k: (decoders[k].queue_len, k))


def most_free_memory(decoders: Sequence[DecoderState]) -> int:
    """Llumnix-like placement: the decoder with the most free KV (ties: lower index).
    Llumnix's migration is the simulator's business."""
    return min(range(len(decoders)), key=lambda k: (-decoders[k].effective_blocks, k))


# --- atomic reservation with staged release ------------------------------------------------------

@dataclass(frozen=True)
class Reservation:
    """B_need split into the prompt part (released from B_res when the KV transfer lands) and
    the output part (released when the request finishes)."""

    prompt_blocks: int
    output_blocks: int

    @property
    def blocks(self) -> int:
        return self.prompt_blocks + self.output_blocks


def make_reservation(prompt_tokens: int, output_tokens: float, block_tokens: int = 16) -> Reservation:
    total = blocks_needed(prompt_tokens, output_tokens, block_tokens)
    prompt = min(total, math.ceil(prompt_tokens / block_tokens))
    return Reservation(prompt, total - prompt)


def reserve(state: DecoderState, blocks: int) -> DecoderState:
    """B_res += blocks, refused if it would overbook (B_eff < 0): the atomic check-and-reserve."""
    if blocks < 0:
        raise ValueError(f"blocks = {blocks}: must be >= 0")
    if blocks > state.effective_blocks:
        raise ValueError(f"reserving {blocks} blocks overbooks the decoder "
                         f"(B_eff = {state.effective_blocks})")
    return replace(state, reserved_blocks=state.reserved_blocks + blocks,
                   queue_len=state.queue_len + 1)


def release(state: DecoderState, blocks: int, *, finished: bool = False) -> DecoderState:
    """B_res -= blocks (one stage of the staged release); `finished` also leaves the queue."""
    if not 0 <= blocks <= state.reserved_blocks:
        raise ValueError(f"releasing {blocks} blocks, only {state.reserved_blocks} reserved")
    return replace(state, reserved_blocks=state.reserved_blocks - blocks,
                   queue_len=state.queue_len - (1 if finished else 0))


# --- decoder-local scheduling ---------------------------------------------------------------------

@dataclass(frozen=True)
class Queued:
    """A request in a decoder's ready queue."""

    enqueued_s: float      # when it joined this queue
    upper_tokens: float    # L̂_up (the SJF key)


def next_request(queue: Sequence[Queued], now_s: float, *, order: Literal["sjf", "fcfs"] = "sjf",
                 max_wait_s: float = 1.0) -> int:
    """Index of the request to serve next. SJF by L̂_up with the max-wait guard: any request
    waiting longer than `max_wait_s` goes first (oldest first); FCFS: the oldest."""
    if not queue:
        raise ValueError("empty queue")
    oldest = min(range(len(queue)), key=lambda i: (queue[i].enqueued_s, i))
    if order == "fcfs":
        return oldest
    if order != "sjf":
        raise ValueError(f"order {order!r}: expected 'sjf' or 'fcfs'")
    if now_s - queue[oldest].enqueued_s > max_wait_s:
        return oldest
    return min(range(len(queue)), key=lambda i: (queue[i].upper_tokens, queue[i].enqueued_s, i))
