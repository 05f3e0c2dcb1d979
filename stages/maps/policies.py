"""The MAPS arms as serving-simulator policies: what MAPS does, and what it is compared with.

MAPS (Zhang et al., ICML 2026, arXiv 2609.15359) serves LLM requests on a prefill/decode-
disaggregated cluster: a prefiller computes the prompt, then one of several decoders generates
the output. Decoders are memory-bound: a request holds KV cache for its prompt and for every
token it has generated, and nobody knows on arrival how many tokens that will be. Round-robin
dispatch therefore piles long requests onto one decoder while another idles, and a decoder that
runs out of KV must preempt (and later recompute) requests. MAPS fixes this with four pieces:

1. A **length predictor** gives L̂ for each request (on the user's device, hidden behind the
   cloud prefill). Here: `stages.maps.predictor` (a real regressor on the base model's hidden
   state) or the spec's noise model (`predictor.noise_predictions`, two quality levels).
2. **UAC** turns L̂ into an upper bound L̂_up = L̂ + q_α with P(L <= L̂_up) >= 1 - α, q_α the
   conformal quantile of the one-sided residuals max(0, L - L̂) over the last n = 500 finished
   requests (`stages.maps.uac.OnlineUAC`, seeded with an offline calibration set).
3. **Global dispatch** (Algorithm 1, `stages.maps.dispatch.maps_dispatch`): the request needs
   B_need = ceil((L_prompt + L̂_up) / S) KV blocks; among the decoders whose effective free
   blocks B_eff = B_free - B_res fit it, take the one with the shortest queue ("MQ"); if none
   fits, the one with the most B_eff; then reserve B_need there (B_res), released in two stages
   (the prompt part when the KV lands, the rest when the request ends: the simulator does it).
4. **Local SJF** on each decoder (`dispatch.next_request`): admit the request with the smallest
   L̂_up first, but any request that has waited longer than max-wait (1 s) goes first.

How it maps onto the simulator (`stages.serving.sim`): every arm prefills on the one prefiller
(FCFS) and binds the decoder when the prefill ends (`bind_decode`), which is when MAPS's
dispatcher runs: the prediction was computed during the prefill (the paper's β = 1 s wait never
binds here: a prediction is always ready by then [reconstructed: the device-side predictor takes
tens to hundreds of ms against a prefill of hundreds of ms to seconds, paper §2 "Overheads"]).
The decoder-local order is `next_admission` on the decoder's ready queue. Q_k, the queue length
the runtime-state store tracks, counts requests bound to decoder k and not finished (waiting,
in transfer or running) [reconstructed: the paper says "queue length"].

Arms (spec §4):
- `round_robin`: the vLLM / SGLang Mooncake-PD default; FCFS admission.
- `least_request`: the decoder with the fewest unfinished requests; FCFS.
- `llumnix`: Llumnix-like: the decoder with the most free KV; every `migrate_every` iterations a
  decoder at >= 90% KV use migrates its youngest running request to the decoder with the most
  free KV, if it fits there (stop-and-copy: cost = KV bytes / link bandwidth, `sim.migrate`).
- `maps`: predictor + UAC + MQ + SJF (the method).
- `maps_no_uac`: L̂ instead of L̂_up (q_α = 0).
- `maps_mc`: MC routing: the feasible decoder with the most B_eff instead of the shortest queue.
- `maps_fcfs`: FCFS instead of SJF on the decoders.
- `oracle`: MAPS with the true lengths (L̂_up = L), the paper's upper reference.
- `maps_sp160m`: MAPS with the degraded noise predictor (the paper's SP-160M) where the workload
  has one; `maps` then uses the good level (SP-7B).
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import numpy as np

from stages.maps.dispatch import DecoderState, Queued, maps_dispatch, next_request
from stages.maps.uac import OnlineUAC
from stages.serving.sim import Job, Policy, Route, Simulator

ARMS = ("round_robin", "least_request", "llumnix", "maps", "maps_no_uac", "maps_mc",
        "maps_fcfs", "oracle", "maps_sp160m")


class _Counting(Policy):
    """Bind the decoder after the prefill, and keep Q_k: requests bound to k and not done."""

    def __init__(self, n_decoders: int) -> None:
        super().__init__()
        self.outstanding = [0] * n_decoders

    def route(self, job: Job, sim: Simulator) -> Route:
        p = self._rr_prefill % len(sim.prefill)
        self._rr_prefill += 1
        return Route(decode=None, prefill=p)

    def choose(self, job: Job, sim: Simulator) -> int | Route:
        raise NotImplementedError

    def bind_decode(self, job: Job, sim: Simulator) -> int | Route:
        chosen = self.choose(job, sim)
        d = chosen.decode if isinstance(chosen, Route) else int(chosen)
        self.outstanding[d] += 1
        return chosen

    def on_round_done(self, job: Job, now: float) -> None:
        if job.decode is not None:   # a one-token request ends at its prefill, never dispatched
            self.outstanding[job.decode.index] -= 1


class RoundRobin(_Counting):
    def choose(self, job: Job, sim: Simulator) -> int:
        d = self._rr_decode % len(sim.decode)
        self._rr_decode += 1
        return d


class LeastRequest(_Counting):
    def choose(self, job: Job, sim: Simulator) -> int:
        return min(range(len(sim.decode)), key=lambda k: (self.outstanding[k], k))


class LlumnixLike(_Counting):
    """Most free memory at dispatch; migration off a decoder at >= `threshold` KV use."""

    def __init__(self, n_decoders: int, threshold: float = 0.9, migrate_every: int = 16) -> None:
        super().__init__(n_decoders)
        self.threshold = threshold
        self.step_hook_every = migrate_every
        self.sim: Simulator | None = None

    def choose(self, job: Job, sim: Simulator) -> int:
        self.sim = sim
        now = sim.now
        return min(range(len(sim.decode)), key=lambda k: (-sim.decode[k].free_blocks(now), k))

    def after_step(self, inst, now: float) -> None:
        sim = self.sim
        if sim is None or len(inst.running) < 2:
            return
        cap = inst.pool.capacity
        if 1.0 - inst.free_blocks(now) / cap < self.threshold:
            return
        others = [d for d in sim.decode if d is not inst]
        dst = max(others, key=lambda d: d.free_blocks(now) / d.pool.capacity)
        if 1.0 - dst.free_blocks(now) / dst.pool.capacity >= self.threshold:
            return
        youngest = next(reversed(inst.running))
        if sim.migrate(youngest, dst.index):
            self.outstanding[inst.index] -= 1
            self.outstanding[dst.index] += 1


class Maps(_Counting):
    """MAPS: dispatch on L̂_up (Algorithm 1) + decoder-local SJF with the max-wait guard.

    `pred[row]` is L̂ of trace row `row` (the oracle passes the true lengths); `calibration` the
    offline residuals L - L̂ that seed the online UAC window; `uac=False` uses L̂ itself."""

    def __init__(self, n_decoders: int, pred: Sequence[float], *, calibration: Sequence[float] = (),
                 uac: bool = True, routing: Literal["mq", "mc"] = "mq",
                 order: Literal["sjf", "fcfs"] = "sjf", alpha: float = 0.1, window: int = 500,
                 max_wait_s: float = 1.0, block_tokens: int = 16) -> None:
        super().__init__(n_decoders)
        self.pred = np.asarray(pred, dtype=np.float64)
        self.uac = OnlineUAC(window=window, alpha=alpha, initial=calibration) if uac else None
        self.routing, self.order = routing, order
        self.max_wait_s, self.block_tokens = max_wait_s, block_tokens
        self.upper = np.full(len(self.pred), math.nan)   # L̂_up used at dispatch, per row
        self.fallbacks = 0

    def choose(self, job: Job, sim: Simulator) -> Route:
        now = sim.now
        lhat = float(self.pred[job.session.sid])
        up = self.uac.upper(lhat) if self.uac is not None else lhat
        self.upper[job.session.sid] = up
        states = [DecoderState(d.free_blocks(now), d.pool.reserved, self.outstanding[k])
                  for k, d in enumerate(sim.decode)]
        disp = maps_dispatch(states, job.prompt, None if math.isinf(up) else up,
                             block_tokens=self.block_tokens, routing=self.routing,
                             rr_counter=self._rr_decode)
        if disp.rule == "round_robin":
            self._rr_decode += 1
            return Route(decode=disp.decoder)
        self.fallbacks += disp.rule == "fallback"
        # the simulator reserves ceil(tokens / S) blocks: exactly B_need
        return Route(decode=disp.decoder, reserve_tokens=disp.blocks * self.block_tokens)

    def next_admission(self, queue, inst, now: float) -> int:
        if self.order == "fcfs" or len(queue) == 1:
            return 0
        items = [Queued(j.t_queued, self.upper[j.session.sid]) for j in queue]
        return next_request(items, now, order="sjf", max_wait_s=self.max_wait_s)

    def on_round_done(self, job: Job, now: float) -> None:
        super().on_round_done(job, now)
        if self.uac is not None:   # online UAC: the finished request's residual joins the window
            self.uac.observe(job.output_tokens, float(self.pred[job.session.sid]))


def make_policy(arm: str, n_decoders: int, *, pred: np.ndarray, pred_weak: np.ndarray | None,
                true: np.ndarray, calibration: np.ndarray, calibration_weak: np.ndarray | None,
                alpha: float, window: int, max_wait_s: float, block_tokens: int,
                migrate_threshold: float, migrate_every: int) -> Policy:
    """The policy of one arm (module docstring), fresh for one run."""
    common = dict(alpha=alpha, window=window, max_wait_s=max_wait_s, block_tokens=block_tokens)
    if arm == "round_robin":
        return RoundRobin(n_decoders)
    if arm == "least_request":
        return LeastRequest(n_decoders)
    if arm == "llumnix":
        return LlumnixLike(n_decoders, migrate_threshold, migrate_every)
    if arm == "maps":
        return Maps(n_decoders, pred, calibration=calibration, **common)
    if arm == "maps_no_uac":
        return Maps(n_decoders, pred, uac=False, **common)
    if arm == "maps_mc":
        return Maps(n_decoders, pred, calibration=calibration, routing="mc", **common)
    if arm == "maps_fcfs":
        return Maps(n_decoders, pred, calibration=calibration, order="fcfs", **common)
    if arm == "oracle":
        return Maps(n_decoders, true, uac=False, **common)
    if arm == "maps_sp160m":
        if pred_weak is None or calibration_weak is None:
            raise ValueError("arm maps_sp160m needs the weak predictor's predictions")
        return Maps(n_decoders, pred_weak, calibration=calibration_weak, **common)
    raise ValueError(f"unknown arm {arm!r}; arms: {', '.join(ARMS)}")
