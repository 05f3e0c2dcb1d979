"""AMPD's six arms as simulator policies, the SLOs, and how a run is scored.

How AMPD serves an agent session (He et al., ICML 2026, arXiv 2602.14516). A session alternates
prefill -> decode -> tool call -> incremental prefill -> decode -> ... Each session is bound, at
its first round, to one decode worker d (the one with the most free KV memory); d keeps the
session's KV cache between rounds and runs all its decodes. Every prefill, the first one and
every incremental one, is then placed by `routing.route_prefill`:

- REMOTE on a prefill worker p: it waits in p's queue, the history KV travels d -> p first and
  history + new prompt travel back p -> d (a bidirectional transfer), but d's decode batch never
  pauses;
- LOCAL on d: no transfer and no prefill queue, but d's decode batch pauses for the whole
  prefill, and that stall lands in the inter-token gap of EVERY sequence running on d.

The coordinator decides from estimates (queue wait, T_pre, T_kv) and windowed statistics (the
mean TTFT of p's last 10 s of prefills, the mean ITL of d's last 10 s of iterations): remote while
the prefill side is not busy, local while d has ITL slack, else the option with fewer expected
SLO violations. A prefill worker may also REORDER its queue (`routing.pick_next`): among the
first w = 3 tasks run the one with the least non-negative TTFT slack, never passing a task more
than w - 1 times. Offline, an ILP (`plan.py`) picks how many prefill and decode replicas of which
tensor-parallel degree to deploy.

The arms (spec §4), each a `stages.serving.sim.Policy` on a cluster of the same GPU budget:

    (a) dynamo     Dynamo-like: every prefill remote (least estimated TTFT), FIFO queues
    (b) local      always-local incremental prefill (PPD-like): the first prefill of a session
                   remote, every later round's prefill on its decode worker
    (c) colocated  vLLM-like: no prefill workers; every GPU a decode worker that runs prefills
                   as chunks inside decode steps (Sarathi chunked prefill)
    (d) routing    AMPD's routing rule, FIFO prefill queues
    (e) reorder    (d) + prefill reordering with lookahead 3
    (f) planned    (e) on the replica plan of the ILP (stage `plan`)

(a)-(e) share one prefill/decode split (`ClusterParams.prefill_instances`); (c) has the same
number of instances, all decode.

SLOs (spec §4): TTFT <= 5x the unloaded prefill time of the median first prompt; ITL P90 <= 3x
the unloaded decode step (a batch of one holding the median prompt's context). A round meets the
SLO when both hold for it (a one-token output has no ITL: TTFT only). A session attains its SLO
when EVERY one of its rounds does (spec §2 "SLO attainment"): rounds after the first carry the
incremental prefill, where AMPD acts, so scoring the first round only would hide the method.

[reconstructed] pieces (named in the README): the estimate of queued prefill work (one batch of
all queued tokens: s0 + a * tokens); a request's ITL slack for the last routing branch (a P90 per
round lets 10% of gaps exceed the SLO: with the shortest output of the workload, `stall_allowance`
stalls are absorbed, after that the slack is SLO_ITL minus the current step time); the slack of
reordering has no KV term (here the first token comes out of the prefill, before the KV moves).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from stages.serving.latency import LatencyProfile
from stages.serving.sim import (ClusterConfig, DecodeInstance, InstanceSpec, Job, Policy, Route,
                                Simulator)
from stages.serving.workload import Trace

from . import routing
from .plan import Strategy, tp_strategies

ARMS = ("dynamo", "local", "colocated", "routing", "reorder", "planned")
ARM_LETTERS = dict(zip(ARMS, "abcdef"))
INF = math.inf


# --- SLOs and capacity ---------------------------------------------------------------------------

@dataclass(frozen=True)
class SLO:
    ttft_s: float
    itl_s: float

    @classmethod
    def from_profile(cls, profile: LatencyProfile, median_prompt: int, ttft_factor: float = 5.0,
                     itl_factor: float = 3.0) -> "SLO":
        """5x the unloaded prefill of the median prompt, 3x the unloaded decode step (spec §4)."""
        return cls(ttft_factor * profile.prefill_time(median_prompt),
                   itl_factor * profile.decode_step_time(1, median_prompt))


@dataclass(frozen=True)
class WorkloadShape:
    """Per-session means of a workload (measured on a large sample of it, clipping included)."""

    mean_prompt: float            # first-round input tokens
    mean_increment: float         # input tokens of a later round
    prefill_tokens: float         # W_pre: new tokens prefilled per session, all rounds
    decode_tokens: float          # W_dec: output tokens per session
    mean_decode_context: float    # mean KV context of a sequence while it decodes

    @classmethod
    def of(cls, trace: Trace) -> "WorkloadShape":
        first = trace.round == 0
        n = trace.n_sessions
        # context of each round before its output: everything earlier + its own input
        before = np.zeros(len(trace))
        ctx = 0.0
        for i in range(len(trace)):
            if first[i]:
                ctx = 0.0
            before[i] = ctx + trace.input_tokens[i]
            ctx = before[i] + trace.output_tokens[i]
        w = trace.output_tokens.astype(float)
        return cls(float(trace.input_tokens[first].mean()),
                   float(trace.input_tokens[~first].mean()) if (~first).any() else 0.0,
                   float(trace.input_tokens.sum() / n), float(w.sum() / n),
                   float(((before + w / 2) * w).sum() / w.sum()))


def strategies(profiles: dict[str, tuple[int, LatencyProfile]], shape: WorkloadShape, slo: SLO,
               kv_tokens_per_gpu: int) -> list[Strategy]:
    """One planner strategy per (name -> (GPUs, profile)): what one replica delivers with the
    profile's own constants (a TP profile already holds its TP speed-up), its KV capacity the
    GPUs' together. The decode operating batch keeps the step within 0.8 SLO_ITL (plan.py)."""
    out = []
    for name, (gpus, p) in profiles.items():
        s = tp_strategies(prefill_s0=p.prefill_s0, prefill_s_per_token=p.prefill_s_per_token,
                          prefill_s_per_token2=p.prefill_s_per_token2, decode_s0=p.decode_s0,
                          decode_s_per_seq=p.decode_s_per_seq,
                          decode_s_per_ctx_token=p.decode_s_per_ctx_token,
                          mean_prompt_tokens=shape.mean_prompt,
                          mean_context_tokens=shape.mean_decode_context,
                          kv_tokens_per_gpu=gpus * kv_tokens_per_gpu, slo_itl_s=slo.itl_s,
                          tp_degrees=(1,))[0]
        out.append(s.model_copy(update={"name": name, "gpus": gpus}))
    return out


def capacity(strategy: Strategy, shape: WorkloadShape, n_prefill: int, n_decode: int) -> dict:
    """Sessions/s a split of one strategy serves within the ITL SLO: prefill side, decode side,
    and the smaller of the two (the reference for the rate grid)."""
    pre = n_prefill * strategy.prefill_tokens_per_s / shape.prefill_tokens
    dec = n_decode * strategy.decode_tokens_per_s / shape.decode_tokens
    return {"prefill": pre, "decode": dec, "cluster": min(pre, dec)}


# --- clusters ------------------------------------------------------------------------------------

class ClusterParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpus: int = Field(8, ge=2, le=4096, description="GPU budget of every arm (spec: 8 A100s)")
    prefill_instances: int = Field(4, ge=1, description="prefill workers of arms a, b, d, e "
                                   "(the rest decode) [reconstructed: an even split]")
    kv_capacity_tokens: int = Field(66144, ge=256, description="KV tokens per GPU (DistServe's "
                                    "OPT-13B on A100-80GB)")
    chunked_prefill_tokens: int = Field(512, ge=16, description="arm c: prefill chunk per "
                                        "decode step (Sarathi / vLLM default)")
    max_batch_tokens: int = Field(8192, ge=256, description="prefill token budget per batch")
    itl_window_s: float = Field(10.0, gt=0, description="windowed TTFT/ITL statistics (paper: "
                                "10 s)")


def build_cluster(arm: str, cp: ClusterParams, plan: dict | None = None) -> ClusterConfig:
    """The cluster an arm runs on; `plan` (arm f): {"prefill": {name: n}, "decode": {name: n},
    "gpus_per_replica": {name: g}} from stage `plan`; its profiles are keyed by strategy name."""
    common = dict(max_batch_tokens=cp.max_batch_tokens)
    if arm == "colocated":
        specs = [InstanceSpec(role="decode", count=cp.gpus, kv_capacity_tokens=cp.kv_capacity_tokens,
                              chunked_prefill_tokens=cp.chunked_prefill_tokens, **common)]
    elif arm == "planned":
        if plan is None:
            raise ValueError("arm 'planned' needs the replica plan of stage `plan`")
        g = plan["gpus_per_replica"]
        specs = [InstanceSpec(role=role, count=n, profile=name,
                              kv_capacity_tokens=g[name] * cp.kv_capacity_tokens, **common)
                 for role in ("prefill", "decode") for name, n in plan[role].items() if n]
    else:
        if cp.prefill_instances >= cp.gpus:
            raise ValueError(f"prefill_instances = {cp.prefill_instances} leaves no decode "
                             f"instance of {cp.gpus} GPUs")
        specs = [InstanceSpec(role="prefill", count=cp.prefill_instances,
                              kv_capacity_tokens=cp.kv_capacity_tokens, **common),
                 InstanceSpec(role="decode", count=cp.gpus - cp.prefill_instances,
                              kv_capacity_tokens=cp.kv_capacity_tokens, **common)]
    return ClusterConfig(instances=specs, itl_window_s=cp.itl_window_s)


# --- the policies --------------------------------------------------------------------------------

class ArmPolicy(Policy):
    """What every arm shares: a session's first round binds it to the decode worker with the most
    free KV blocks (ties: lowest index); later rounds stay there, where its KV is kept."""

    arm = ""

    def __init__(self, slo: SLO, *, window_s: float = 10.0) -> None:
        super().__init__()
        self.slo = slo
        self.window_s = window_s
        self.ttft_windows: dict[int, deque] = {}   # prefill worker -> (time, TTFT) of recent

    def _decode_for(self, job: Job, sim: Simulator) -> int:
        if job.session.decode is not None:
            return job.session.decode
        now = sim.now
        return max(range(len(sim.decode)), key=lambda i: (sim.decode[i].effective_blocks(now), -i))

    def _remote_options(self, job: Job, sim: Simulator) -> list[routing.RemoteOption]:
        """est_remote's terms for every prefill worker. Queued work ahead of the task: the rest of
        the batch in flight plus the queued tokens as one batch [reconstructed]."""
        now = sim.now
        sess = job.session
        hist = sess.kv_tokens if sess.kv_inst is not None else 0
        new = job.prompt - hist
        out = []
        for p in sim.prefill:
            prof = p.profile
            queued = (prof.prefill_s0 + prof.prefill_s_per_token * p.queued_tokens
                      if p.queued_tokens else 0.0)
            out.append(routing.RemoteOption(
                wait_s=max(0.0, p.busy_until() - now) + queued,
                prefill_s=prof.prefill_time(new, hist),
                kv_in_s=sess.kv_inst.profile.kv_transfer_time(hist) if hist else 0.0,
                kv_out_s=prof.kv_transfer_time(hist + new),
                window_ttft_s=self.window_ttft(p.index, now)))
        return out

    def _best_remote(self, job: Job, sim: Simulator) -> int:
        return routing.best_remote(self._remote_options(job, sim))

    # windowed TTFT per prefill worker (the coordinator's shared-memory statistic)
    def window_ttft(self, p: int, now: float) -> float:
        win = self.ttft_windows.get(p)
        if not win:
            return 0.0
        horizon = now - self.window_s
        while win and win[0][0] < horizon:
            win.popleft()
        return sum(t for _, t in win) / len(win) if win else 0.0

    def on_first_token(self, job: Job, now: float) -> None:
        if job.prefill is not None and not job.local:
            self.ttft_windows.setdefault(job.prefill.index, deque()).append(
                (now, now - job.arrival))


class Dynamo(ArmPolicy):
    """(a) every prefill remote, on the worker with the least estimated TTFT; FIFO queues."""

    arm = "dynamo"

    def route(self, job: Job, sim: Simulator) -> Route:
        return Route(decode=self._decode_for(job, sim), prefill=self._best_remote(job, sim))


class AlwaysLocal(ArmPolicy):
    """(b) PPD-like: a session's first prefill remote, every incremental prefill local."""

    arm = "local"

    def route(self, job: Job, sim: Simulator) -> Route:
        d = self._decode_for(job, sim)
        if job.round > 0:
            return Route(decode=d)
        return Route(decode=d, prefill=self._best_remote(job, sim))


class Colocated(ArmPolicy):
    """(c) no prefill workers: every prefill runs chunked inside its decode worker's steps."""

    arm = "colocated"

    def route(self, job: Job, sim: Simulator) -> Route:
        if sim.prefill:
            raise ValueError("the colocated arm runs on a cluster without prefill instances")
        return Route(decode=self._decode_for(job, sim))


class AMPDRouting(ArmPolicy):
    """(d) AMPD's online routing rule (`routing.route_prefill`) on FIFO prefill queues."""

    arm = "routing"

    def __init__(self, slo: SLO, *, alpha: float = 0.8, beta: float = 0.8,
                 stall_allowance: int = 4, window_s: float = 10.0) -> None:
        super().__init__(slo, window_s=window_s)
        self.alpha, self.beta, self.stall_allowance = alpha, beta, stall_allowance
        self.stalls: dict[Job, int] = {}      # local prefills routed onto a running request's d
        self.rules: dict[str, int] = {}       # how often each branch of the rule decided

    def _local_option(self, job: Job, d: DecodeInstance, now: float) -> routing.LocalOption:
        sess = job.session
        hist = sess.kv_tokens if sess.kv_inst is d else 0
        prof = d.profile
        ahead = sum(prof.prefill_time(j.new, j.hist) for j in d.local)  # local queue first
        itl, steps = d.itl_window(now)
        step_now = prof.decode_step_time(d.batch_size, d.context_tokens(now))
        slack = tuple(INF if self.stalls.get(j, 0) < self.stall_allowance
                      else self.slo.itl_s - step_now for j in d.running)
        return routing.LocalOption(
            residual_iter_s=max(0.0, d.busy_until() - now) + ahead,
            prefill_s=prof.prefill_time(job.prompt - hist, hist),
            window_itl_s=0.0 if math.isnan(itl) else itl,
            tokens_in_window=steps * max(1, d.batch_size), itl_slack_s=slack)

    def route(self, job: Job, sim: Simulator) -> Route:
        d = self._decode_for(job, sim)
        dec = sim.decode[d]
        decision = routing.route_prefill(
            self._remote_options(job, sim), self._local_option(job, dec, sim.now),
            slo_ttft_s=self.slo.ttft_s, slo_itl_s=self.slo.itl_s, alpha=self.alpha,
            beta=self.beta)
        self.rules[decision.rule] = self.rules.get(decision.rule, 0) + 1
        if decision.where == "local":
            for j in dec.running:
                self.stalls[j] = self.stalls.get(j, 0) + 1
            return Route(decode=d)
        return Route(decode=d, prefill=decision.prefill_worker)

    def on_round_done(self, job: Job, now: float) -> None:
        self.stalls.pop(job, None)


class AMPDReorder(AMPDRouting):
    """(e) (d) + reordering of every prefill worker's queue, lookahead w, at most w - 1
    overtakes per task (`routing.pick_next`). Local prefill queues stay FIFO."""

    arm = "reorder"

    def __init__(self, slo: SLO, *, lookahead: int = 3, **kw) -> None:
        super().__init__(slo, **kw)
        self.lookahead = lookahead

    def next_prefill(self, queue: Sequence[Job], inst, now: float) -> int:
        if inst.role != "prefill" or len(queue) < 2:
            return 0
        prof = inst.profile
        tasks = [routing.PrefillTask(id=i, arrival_s=j.arrival,
                                     prefill_s=prof.prefill_time(j.new, j.hist),
                                     overtaken=j.overtaken)
                 for i, j in zip(range(self.lookahead), queue)]
        return routing.pick_next(tasks, now, self.slo.ttft_s, self.lookahead)


class Planned(AMPDReorder):
    """(f) (e) on the ILP's replica plan (the policy is (e)'s; the cluster differs)."""

    arm = "planned"


def make_policy(arm: str, slo: SLO, *, alpha: float = 0.8, beta: float = 0.8,
                lookahead: int = 3, stall_allowance: int = 4, window_s: float = 10.0
                ) -> ArmPolicy:
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; arms: {', '.join(ARMS)}")
    w = dict(window_s=window_s)
    ampd = dict(alpha=alpha, beta=beta, stall_allowance=stall_allowance, **w)
    return {"dynamo": lambda: Dynamo(slo, **w), "local": lambda: AlwaysLocal(slo, **w),
            "colocated": lambda: Colocated(slo, **w),
            "routing": lambda: AMPDRouting(slo, **ampd),
            "reorder": lambda: AMPDReorder(slo, lookahead=lookahead, **ampd),
            "planned": lambda: Planned(slo, lookahead=lookahead, **ampd)}[arm]()


# --- scoring -------------------------------------------------------------------------------------

def round_meets(rounds: dict[str, np.ndarray], slo: SLO) -> np.ndarray:
    """Per round: TTFT within its SLO and ITL P90 within its SLO (no ITL: TTFT only)."""
    itl = rounds["itl_p90_s"]
    return (rounds["ttft_s"] <= slo.ttft_s) & (np.isnan(itl) | (itl <= slo.itl_s))


def score(rounds: dict[str, np.ndarray], slo: SLO) -> dict[str, float]:
    """One run's numbers: session attainment (every round meets the SLO), round attainment,
    TTFT / ITL attainment on their own, the share of prefills run locally (all rounds, and
    rounds with history), mean TTFT of first and later rounds, mean P90 ITL, worst overtakes."""
    ok = round_meets(rounds, slo)
    sess = rounds["session"]
    _, inverse = np.unique(sess, return_inverse=True)
    per_session = np.bincount(inverse, weights=~ok) == 0
    later = rounds["round"] > 0
    itl = rounds["itl_p90_s"]
    local = rounds["local"].astype(bool)
    return {
        "attainment": float(per_session.mean()),
        "round_attainment": float(ok.mean()),
        "ttft_attainment": float((rounds["ttft_s"] <= slo.ttft_s).mean()),
        "itl_attainment": float((np.isnan(itl) | (itl <= slo.itl_s)).mean()),
        "later_round_attainment": float(ok[later].mean()) if later.any() else math.nan,
        "local_fraction": float(local.mean()),
        "local_fraction_history": float(local[later].mean()) if later.any() else math.nan,
        "ttft_first_s": float(rounds["ttft_s"][~later].mean()),
        "ttft_later_s": float(rounds["ttft_s"][later].mean()) if later.any() else math.nan,
        "itl_p90_s": float(np.nanmean(itl)),
        "itl_max_s": float(np.nanmean(rounds["itl_max_s"])),
        "max_overtaken": float(rounds["overtaken"].max()),
    }

