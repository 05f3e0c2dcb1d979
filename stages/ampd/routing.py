"""AMPD online coordinator: where each (incremental) prefill runs, and in what order a prefill
worker runs its queue. Pure functions of plain numbers, so any simulator can call them.

The method (He et al., ICML 2026, arXiv 2602.14516, §2 "Online coordinator" and "Prefill
reordering"). In a multi-round session (prefill -> decode -> tool -> incremental prefill -> ...)
a request is bound to one decode worker d, which owns its KV cache. Each prefill can run
  - remotely on a prefill worker p: it queues there, needs the history KV moved d -> p (unless p
    still holds it) and the new KV moved back p -> d (a BIDIRECTIONAL transfer, spec §6), or
  - locally on d: no transfer and no prefill queue, but it pauses d's decode batch, and that
    stall lands on the ITL of EVERY request running on d (spec §6).

Routing rule [reconstructed in the spec from a secondary digest: "prefill side not busy ->
remote; prefill side busy but decode has ITL slack -> local; both busy -> the cheaper option"]:

    est_remote(p) = wait_p + T_kv(l_h: d→p)·[l_h > 0 and KV not on p] + T_pre(θ_p) + T_kv(l_h+l_i: p→d)
    est_local     = residual_iter_d + T_pre(θ_d)
    p* = argmin_p est_remote(p)
    if W_TTFT(p*) ≤ α·SLO_TTFT and est_remote(p*) ≤ SLO_TTFT:                      remote(p*)
    elif W_ITL(d) + T_pre(θ_d)/max(1, tokens_in_window_d) ≤ β·SLO_ITL
         and est_local ≤ SLO_TTFT:                                                 local
    else: the option with fewer expected SLO violations
          remote: 1[est_remote > SLO_TTFT]
          local:  1[est_local > SLO_TTFT] + #co-running requests whose ITL budget the stall breaks

W_TTFT / W_ITL are the coordinator's windowed means (last 10 s). α = β = 0.8 to start (the
paper studies their sensitivity). A tie in the last branch goes to the smaller estimated TTFT,
then to remote [reconstructed]. "Whose ITL budget the stall breaks": each co-running request
carries the delay its ITL SLO can still absorb (`itl_slack_s`, computed by the simulator from
its per-request P90 ITL budget); the stall breaks it when it exceeds that slack.

Reordering per prefill worker, lookahead w = 3 [secondary; slack formula reconstructed]:

    slack_k = (t_arrive,k + SLO_TTFT - now) - T_pre,k - T_kv,k
    among the first w queued tasks run the one with the smallest non-negative slack;
    if all are negative, run the FIFO head.

Without a bound a task can be passed forever (spec §6: "assert the maximum number of overtakes
≤ w - 1"). The window alone does not ensure that (a head with negative slack is passed for as
long as newcomers have non-negative slack), so a task already overtaken w - 1 times runs next:
`pop_next` counts overtakes and enforces it [reconstructed].
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Hashable, Literal, Sequence


@dataclass(frozen=True)
class RemoteOption:
    """One prefill worker p as this prefill would see it."""

    wait_s: float            # queued prefill work ahead of it on p
    prefill_s: float         # T_pre(l_h, l_i; θ_p)
    kv_in_s: float           # T_kv(l_h: d→p); 0 when l_h = 0 or p still holds the KV
    kv_out_s: float          # T_kv(l_h + l_i: p→d)
    window_ttft_s: float     # W_TTFT(p): mean TTFT of p's recent prefills

    @property
    def est_s(self) -> float:
        return self.wait_s + self.kv_in_s + self.prefill_s + self.kv_out_s


@dataclass(frozen=True)
class LocalOption:
    """The request's decode worker d as a place to prefill."""

    residual_iter_s: float                # time left in d's running decode iteration
    prefill_s: float                      # T_pre(l_h, l_i; θ_d): also the stall it causes
    window_itl_s: float                   # W_ITL(d): mean ITL of d's recent tokens
    tokens_in_window: int                 # tokens d decoded in that window
    itl_slack_s: tuple[float, ...] = ()   # per co-running request: delay its ITL SLO absorbs

    @property
    def est_s(self) -> float:
        return self.residual_iter_s + self.prefill_s


@dataclass(frozen=True)
class Route:
    where: Literal["remote", "local"]
    prefill_worker: int | None      # index into the remote options when remote
    est_ttft_s: float
    rule: str                       # prefill_free | decode_slack | fewer_violations | only_*


def best_remote(remote: Sequence[RemoteOption]) -> int:
    """p* = argmin_p est_remote(p) (ties: lower index). The Dynamo-like arm routes here always."""
    if not remote:
        raise ValueError("no prefill workers")
    return min(range(len(remote)), key=lambda p: (remote[p].est_s, p))


def stall_violations(local: LocalOption) -> int:
    """Co-running requests on d whose ITL budget a stall of `prefill_s` breaks."""
    return sum(1 for slack in local.itl_slack_s if local.prefill_s > slack)


def route_prefill(remote: Sequence[RemoteOption], local: LocalOption | None, *,
                  slo_ttft_s: float, slo_itl_s: float, alpha: float = 0.8,
                  beta: float = 0.8) -> Route:
    """AMPD's decision for one prefill (initial or incremental); see the module docstring."""
    if slo_ttft_s <= 0 or slo_itl_s <= 0 or alpha <= 0 or beta <= 0:
        raise ValueError("SLOs and the thresholds alpha, beta must be > 0")
    if not remote and local is None:
        raise ValueError("neither a prefill worker nor a local option")
    if local is None:
        p = best_remote(remote)
        return Route("remote", p, remote[p].est_s, "only_remote")
    if not remote:                   # colocated deployment: nowhere else to go
        return Route("local", None, local.est_s, "only_local")
    p = best_remote(remote)
    r = remote[p]
    if r.window_ttft_s <= alpha * slo_ttft_s and r.est_s <= slo_ttft_s:
        return Route("remote", p, r.est_s, "prefill_free")
    amortised_itl = local.window_itl_s + local.prefill_s / max(1, local.tokens_in_window)
    if amortised_itl <= beta * slo_itl_s and local.est_s <= slo_ttft_s:
        return Route("local", None, local.est_s, "decode_slack")
    cost_remote = int(r.est_s > slo_ttft_s)
    cost_local = int(local.est_s > slo_ttft_s) + stall_violations(local)
    if (cost_local, local.est_s) < (cost_remote, r.est_s):
        return Route("local", None, local.est_s, "fewer_violations")
    return Route("remote", p, r.est_s, "fewer_violations")


# --- prefill reordering with lookahead ------------------------------------------------------------

@dataclass(frozen=True)
class PrefillTask:
    """A prefill waiting at a prefill worker."""

    id: Hashable
    arrival_s: float          # when this round's prefill request arrived (its TTFT clock starts)
    prefill_s: float          # T_pre on this worker
    kv_s: float = 0.0         # KV transfer still needed before its first token (T_kv)
    overtaken: int = 0        # times a later task ran before it


def slack_s(task: PrefillTask, now_s: float, slo_ttft_s: float) -> float:
    """slack = (t_arrive + SLO_TTFT - now) - T_pre - T_kv: time to spare if it started now."""
    return (task.arrival_s + slo_ttft_s - now_s) - task.prefill_s - task.kv_s


def pick_next(queue: Sequence[PrefillTask], now_s: float, slo_ttft_s: float,
              lookahead: int = 3) -> int:
    """Index of the task to run: an overdue-for-overtaking task first (overtaken ≥ w - 1), else
    the smallest non-negative slack among the first w, else the FIFO head (index 0)."""
    if not queue:
        raise ValueError("empty queue")
    if lookahead < 1:
        raise ValueError(f"lookahead = {lookahead}: must be >= 1")
    window = range(min(lookahead, len(queue)))
    for i in window:
        if queue[i].overtaken >= lookahead - 1:
            return i
    slacks = [(slack_s(queue[i], now_s, slo_ttft_s), i) for i in window]
    ok = [(s, i) for s, i in slacks if s >= 0]
    return min(ok)[1] if ok else 0


def pop_next(queue: Sequence[PrefillTask], now_s: float, slo_ttft_s: float,
             lookahead: int = 3) -> tuple[PrefillTask, list[PrefillTask]]:
    """(task to run, the rest of the queue with overtake counts updated)."""
    k = pick_next(queue, now_s, slo_ttft_s, lookahead)
    rest = [replace(t, overtaken=t.overtaken + 1) if i < k else t
            for i, t in enumerate(queue) if i != k]
    return queue[k], rest


def kv_transfer_s(tokens: float, kv_bytes_per_token: float, link_bytes_per_s: float,
                  fixed_s: float = 0.0) -> float:
    """T_kv = d0 + l · bytes_per_token / BW (spec §2); 0 for no tokens (nothing to move)."""
    if tokens < 0 or kv_bytes_per_token < 0 or link_bytes_per_s <= 0 or fixed_s < 0:
        raise ValueError("tokens, bytes and the fixed cost must be >= 0, bandwidth > 0")
    return 0.0 if tokens == 0 else fixed_s + tokens * kv_bytes_per_token / link_bytes_per_s


__all__ = ["RemoteOption", "LocalOption", "Route", "best_remote", "stall_violations",
           "route_prefill", "PrefillTask", "slack_s", "pick_next", "pop_next", "kv_transfer_s"]
