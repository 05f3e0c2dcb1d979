"""What a simulated run measured: per-round latencies, per-instance load, and Little's law.

Per round (one row of `SimResult.rounds`):
- TTFT = first token - round arrival. The first token comes out of the prefill (remote or
  local), so for rounds after the first it includes the incremental prefill (AMPD's point:
  TTFT must be measured per round).
- Token times: the first token, every decode step the sequence took part in (the step's end),
  and the token of each recompute prefill after a preemption. ITL = the gaps between
  consecutive token times, so a local prefill or a preemption that delays a sequence shows up
  in its ITL; itl_mean = (last - first) / (n - 1), itl_p90 (numpy's linear interpolation),
  itl_max; NaN for one-token outputs.
- E2E = last token - round arrival.

Little's law, L = lambda W, checked on every run (a SimError when it fails):
- the system: the time-average number of rounds in the system, integrated from the sorted
  arrival and departure events, against (rounds / horizon) * mean sojourn;
- every queue kind (prefill, ready, local, resume): the length integral the engine's queues
  keep as they change, against the waits the requests accumulated. Both sides come from
  different bookkeeping, so a lost request, a double count or a wait charged to the wrong
  queue breaks the equality.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .sim import Simulator

QUEUE_KINDS = ("prefill", "ready", "local", "resume")
LITTLE_RTOL = 1e-6


@dataclass
class SimResult:
    rounds: dict[str, np.ndarray]
    instances: list[dict[str, Any]]
    queues: dict[str, dict[str, float]]
    little: dict[str, float]
    horizon_s: float
    transfers: int
    link_wait_s: float
    usage: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def to_polars(self):
        import polars as pl

        return pl.DataFrame(self.rounds)


def _gap_stats(times: np.ndarray, group: np.ndarray, n_groups: int):
    """Per group: mean, P90 and max of the gaps between consecutive token times (`times` are
    grouped by job and in emission order within a group)."""
    same = group[1:] == group[:-1]
    gaps, gg = np.diff(times)[same], group[1:][same]
    mean = np.full(n_groups, np.nan)
    p90 = np.full(n_groups, np.nan)
    mx = np.full(n_groups, np.nan)
    if gaps.size == 0:
        return mean, p90, mx
    # sort the gaps within each group: one float key (group, gap); gaps are < 2 * span
    span = 2.0 * float(gaps.max()) + 1.0
    o = np.argsort(gg * span + gaps, kind="stable")
    gaps, gg = gaps[o], gg[o]
    starts = np.flatnonzero(np.r_[True, gg[1:] != gg[:-1]])
    counts = np.diff(np.r_[starts, gaps.size])
    ids = gg[starts]
    mean[ids] = np.add.reduceat(gaps, starts) / counts
    mx[ids] = gaps[starts + counts - 1]
    h = 0.9 * (counts - 1)  # numpy's default (linear) percentile
    lo = np.floor(h).astype(np.int64)
    hi = np.minimum(lo + 1, counts - 1)
    p90[ids] = gaps[starts + lo] + (h - lo) * (gaps[starts + hi] - gaps[starts + lo])
    return mean, p90, mx


def _step_ends(inst) -> np.ndarray:
    """End time of every decode step of an instance, from its macro-step runs."""
    if not inst.runs:
        return np.zeros(0)
    t0, k, base, inc = (np.array(c) for c in zip(*inst.runs))
    k = k.astype(np.int64)
    rep = np.repeat(np.arange(len(k)), k)
    i = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k) + 1
    return t0[rep] + i * base[rep] + inc[rep] * i * (i - 1) / 2


def _check_little(name: str, lhs: float, rhs: float) -> None:
    if abs(lhs - rhs) > LITTLE_RTOL * max(1.0, abs(lhs), abs(rhs)):
        from .sim import SimError

        raise SimError(f"Little's law fails for {name}: L*T = {lhs!r} but sum of waits = {rhs!r}")


def collect(sim: "Simulator", complete: bool = True) -> SimResult:
    from .sim import SimError

    jobs = sim.jobs
    n = len(jobs)
    done = np.array([not math.isnan(j.t_done) for j in jobs])
    if complete and not done.all():
        stuck = [j for j in jobs if math.isnan(j.t_done) and not math.isnan(j.arrival)][:5]
        where = "; ".join(f"{j} gen {j.gen}/{j.output_tokens} on "
                          f"{getattr(j.decode, 'name', None)} / {getattr(j.prefill, 'name', None)}"
                          for j in stuck)
        raise SimError(f"{int((~done).sum())} of {n} rounds never finished (the event queue ran "
                       f"empty; a request that can never be admitted?): {where}")
    if complete:
        for inst in [*sim.prefill, *sim.decode]:
            if inst.pool.used or inst.pool.reserved or inst.pool.idle:
                raise SimError(f"KV leak on {inst.name}: {inst.pool.used} blocks used, "
                               f"{inst.pool.reserved} reserved, {len(inst.pool.idle)} idle "
                               f"sessions after every request finished")

    arrival = np.array([j.arrival for j in jobs])
    t_done = np.array([j.t_done for j in jobs])
    t_first = np.array([j.t_first for j in jobs])
    t_end = float(np.nanmax(t_done)) if done.any() else sim.env.now
    t_start = float(np.nanmin(arrival)) if n else 0.0
    horizon = max(t_end - t_start, 1e-300)

    # token times, job by job in emission order: prefill tokens and runs of decode steps, as
    # pieces of one array [every decode step's end time..., every prefill token's time...]
    ends = [_step_ends(d) for d in sim.decode]
    offsets = np.cumsum([0] + [e.size for e in ends])
    singles: list[float] = []
    p_job, p_start, p_len = [], [], []
    base = int(offsets[-1])
    for idx, j in enumerate(jobs):
        for m in j.marks:
            p_job.append(idx)
            if isinstance(m, tuple):
                p_start.append(int(offsets[m[0]]) + m[1])
                p_len.append(m[2] - m[1])
            else:
                p_start.append(base + len(singles))
                p_len.append(1)
                singles.append(m)
    source = np.concatenate([*ends, np.array(singles, dtype=float)])
    lengths = np.array(p_len, dtype=np.int64)
    first = np.cumsum(lengths) - lengths
    pos = (np.repeat(np.array(p_start, dtype=np.int64), lengths)
           + np.arange(int(lengths.sum())) - np.repeat(first, lengths))
    group = np.repeat(np.array(p_job, dtype=np.int64), lengths)
    itl_mean, itl_p90, itl_max = _gap_stats(source[pos], group, n)
    tokens = np.bincount(group, minlength=n)

    out = np.array([j.output_tokens for j in jobs])
    rounds = {
        "session": np.array([j.session.sid for j in jobs], dtype=np.int64),
        "round": np.array([j.round for j in jobs], dtype=np.int64),
        "arrival_s": arrival,
        "prefill_start_s": np.array([j.t_prefill_start for j in jobs]),
        "first_token_s": t_first,
        "done_s": t_done,
        "ttft_s": t_first - arrival,
        "e2e_s": t_done - arrival,
        "input_tokens": np.array([j.input_tokens for j in jobs], dtype=np.int64),
        "output_tokens": out,
        "prompt_tokens": np.array([j.prompt for j in jobs], dtype=np.int64),
        "cached_tokens": np.array([j.cached_tokens for j in jobs], dtype=np.int64),
        "local": np.array([j.local for j in jobs]),
        "prefill_instance": np.array([-1 if j.local or j.prefill is None else j.prefill.index
                                      for j in jobs], dtype=np.int64),
        "decode_instance": np.array([-1 if j.decode is None else j.decode.index for j in jobs],
                                    dtype=np.int64),
        "itl_mean_s": itl_mean,
        "itl_p90_s": itl_p90,
        "itl_max_s": itl_max,
        "tokens": tokens,
        "tpot_s": np.where(out > 1, (t_done - t_first) / np.maximum(out - 1, 1), np.nan),
        **{f"wait_{k}_s": np.array([j.waits[k] for j in jobs]) for k in QUEUE_KINDS},
        "preemptions": np.array([j.preemptions for j in jobs], dtype=np.int64),
        "overtaken": np.array([j.overtaken for j in jobs], dtype=np.int64),
        "migrations": np.array([j.migrations for j in jobs], dtype=np.int64),
        "prefills": np.array([j.n_prefills for j in jobs], dtype=np.int64),
    }

    # Little's law: the system ...
    little: dict[str, float] = {}
    if done.any():
        a, d = arrival[done], t_done[done]
        ev_t = np.concatenate([a, d])
        ev_n = np.concatenate([np.ones(a.size), -np.ones(d.size)])
        o = np.argsort(ev_t, kind="stable")
        in_sys = np.cumsum(ev_n[o])
        area = float(np.sum(in_sys[:-1] * np.diff(ev_t[o])))
        w = d - a
        _check_little("rounds in the system", area, float(w.sum()))
        little = {"L": area / horizon, "lambda": a.size / horizon, "W": float(w.mean())}
    # ... and every queue kind, engine integrals against request waits
    queues: dict[str, dict[str, float]] = {}
    for kind in QUEUE_KINDS:
        qs = [getattr(i, "queue" if kind == "prefill" else kind)
              for i in (sim.prefill if kind == "prefill" else sim.decode)]
        for q in qs:
            q._tick()
        area = sum(q.area for q in qs)
        entered = sum(q.entered for q in qs)
        waits = float(rounds[f"wait_{kind}_s"].sum())
        if complete:
            _check_little(f"the {kind} queues", area, waits)
        queues[kind] = {"mean_length": area / horizon, "arrival_rate": entered / horizon,
                        "mean_wait_s": waits / entered if entered else math.nan}

    instances = []
    for inst in [*sim.prefill, *sim.decode]:
        row = {"name": inst.name, "role": inst.role, "busy_s": inst.busy_s,
               "utilisation": inst.busy_s / horizon, "kv_capacity_blocks": inst.pool.capacity,
               "kv_peak_blocks": inst.pool.peak}
        if inst.role == "decode":
            row.update(steps=inst.step, macro_steps=len(inst.runs), stall_s=inst.stall_s,
                       preemptions=inst.preemptions, evictions=inst.evictions,
                       ready_mean_length=inst.ready.area / horizon,
                       local_mean_length=inst.local.area / horizon)
        else:
            row.update(queue_mean_length=inst.queue.area / horizon)
        instances.append(row)
    usage = {i.name: (np.array([u[0] for u in i.usage]), np.array([u[1] for u in i.usage]))
             for i in [*sim.prefill, *sim.decode]} if sim.record_usage else {}
    return SimResult(rounds=rounds, instances=instances, queues=queues, little=little,
                     horizon_s=horizon, transfers=sim.transfers, link_wait_s=sim.link_wait_s,
                     usage=usage)
