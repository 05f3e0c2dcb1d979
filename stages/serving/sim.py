"""A discrete-event model of an LLM serving cluster: prefill and decode instances, KV links.

What is modelled (every duration from a `LatencyProfile`, see latency.py for the equations):

- **Prefill instances** run batches of prompts: a batch is formed from the queue in the
  policy's order while it fits a token budget (`max_batch_tokens`; the first prompt always
  fits) and the KV pool; it takes T_pre = s0 + a*sum(l) + b*sum(l^2 + 2 l h) and produces each
  request's first token (TTFT is measured there). The prompt's KV then waits on the prefill
  instance until its decode instance admits it, and travels over the link.
- **Decode instances** run continuous batching: every iteration all running sequences emit
  one token; a step of B sequences holding C KV tokens takes T_dec = s0' + c*B + d*C. Between
  iterations (and only there) the instance joins sequences whose KV has arrived, admits
  waiting ones, and runs local prefills.
- **KV-cache block pools** (kv.py) on every instance, with ATOMIC admission: a request is
  admitted only once all blocks for its context are allocated (and enough stay free for the
  running batch's next step); nothing is ever allocated beyond capacity. A decode step that
  needs a new block when none is free first evicts idle session KV (LRU), then PREEMPTS BY
  RECOMPUTE: the most recently admitted running sequence loses its KV, goes to the front of the
  instance's queue, and later re-prefills its prompt plus the tokens it had generated (as vLLM
  does); the recompute prefill emits its next token.
- **Local prefill on a decode instance** (AMPD's local incremental prefill, a colocated vLLM):
  it runs as its own iteration, so the decode batch does not advance meanwhile: the stall is
  in the gap between two tokens of EVERY running sequence, i.e. in each one's ITL. With
  `chunked_prefill_tokens` set (Sarathi-style chunked prefill, the colocated baseline), a chunk
  rides in the decode step instead: step time T_dec + a*l_c + b*(l_c^2 + 2 l_c h).
- **KV transfer** over directed links, one FIFO queue each: a transfer of n tokens starts when
  the link is free and takes t0 + n * bytes_per_token / bandwidth (the source's profile).
  A remote prefill of a round with history moves KV both ways (AMPD, arXiv 2602.14516 sec. 2):
  the cached history decode -> prefill, then history + new prompt prefill -> decode.
- **Multi-round sessions**: round k+1 arrives a tool gap after round k ends; its context is
  the previous context (inputs and outputs) plus its new input. Between rounds the session's
  KV stays on its decode instance (`retain_kv_between_rounds`) as evictable idle KV, so the
  next round prefills only its new tokens over the cached history; if the KV was evicted, or
  the next round goes to another decode instance, the whole context is recomputed.
- **Policies** plug in by subclassing `Policy`: where each round's prefill runs (local or
  which prefill instance), which decode instance, an optional dispatcher KV reservation (MAPS's
  B_res, released in two stages: the prompt part when the KV lands, the rest at the end), the
  order of every queue, and a hook after decode iterations (e.g. migration, `migrate`). The
  engine holds no paper code; AMPD and MAPS bring their policies from their own packages.

Metrics (metrics.py): per round TTFT (arrival to first token), every inter-token gap (ITL;
mean, P90, max), E2E (arrival to last token); per queue the time-average length and the
Little's-law check L = lambda W on every run (`SimError` if the engine's own queue integrals
and the requests' waits disagree, if a request is lost, or if KV blocks leak).

Speed: no per-token events. Sequences hold their state implicitly (the step they joined at and
their context then), so a decode iteration costs O(1); between two events that change the
batch (a sequence finishing, a KV block shortage, an arrival at the instance) all identical
steps are one "macro step" (durations form an arithmetic series in the step index, since C
grows by B per step). An arrival in the middle of a macro step cuts it at the next step end,
so the result is the same as stepping one iteration at a time (`macro_steps=False`, tested).

Not modelled: pipeline parallelism, prefix caching on prefill instances, swap-to-CPU
preemption, speculative decoding, network contention beyond per-link FIFO, scheduler overhead,
live (overlapped) migration: `migrate` is stop-and-copy.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Literal, Mapping, Sequence

import numpy as np
import simpy
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .kv import KVPool
from .latency import LatencyProfile

if TYPE_CHECKING:
    from .metrics import SimResult
    from .workload import Trace


class SimError(RuntimeError):
    """A run that cannot be simulated faithfully: a request larger than an instance, a stuck
    request, or broken accounting (lost requests, leaked KV, Little's law violated)."""


# --- configuration ---------------------------------------------------------------------------------


class InstanceSpec(BaseModel):
    """`count` identical instances of one role."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode"]
    count: int = Field(1, ge=0, description="how many instances of this spec")
    profile: str = Field("default", description="key into the profiles mapping given to simulate")
    kv_capacity_tokens: int = Field(gt=0, description="KV cache size in tokens (DistServe lists "
                                                      "66144 for OPT-13B on one A100-80GB)")
    max_batch_seqs: int = Field(256, ge=1, description="most sequences in one batch")
    max_batch_tokens: int = Field(8192, ge=1, description="prefill token budget per batch (the "
                                                          "first prompt is always taken)")
    chunked_prefill_tokens: int | None = Field(None, ge=1, description="decode role: run local "
                                               "prefills as chunks inside decode steps with this "
                                               "token budget per step (Sarathi); None: a local "
                                               "prefill is its own iteration and stalls the batch")
    reserve_output_at_admission: bool = Field(False, description="decode role: admission "
                                              "allocates the blocks of the whole output too (a KV "
                                              "admission gate on known lengths, MAPS App. A); no "
                                              "growth, no preemption")

    @model_validator(mode="after")
    def _roles(self) -> "InstanceSpec":
        if self.role == "prefill" and (self.chunked_prefill_tokens or
                                       self.reserve_output_at_admission):
            raise ValueError("chunked_prefill_tokens / reserve_output_at_admission apply to "
                             "decode instances only")
        return self


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    instances: list[InstanceSpec] = Field(min_length=1)
    retain_kv_between_rounds: bool = Field(True, description="keep a session's KV on its decode "
                                           "instance during the tool gap (evictable)")
    itl_window_s: float = Field(10.0, gt=0, description="window of the per-instance ITL "
                                                        "statistic policies may read (AMPD: 10 s)")

    @model_validator(mode="after")
    def _some_decode(self) -> "ClusterConfig":
        if not any(s.role == "decode" and s.count for s in self.instances):
            raise ValueError("the cluster needs at least one decode instance")
        return self


# --- the objects policies see ------------------------------------------------------------------------


class Session:
    __slots__ = ("sid", "rows", "context", "kv_inst", "kv_tokens", "decode")

    def __init__(self, sid: int, rows: list[int]) -> None:
        self.sid = sid
        self.rows = rows              # trace rows of its rounds, in order
        self.context = 0              # tokens of all finished rounds (inputs + outputs)
        self.kv_inst: DecodeInstance | None = None  # where its KV is kept between rounds
        self.kv_tokens = 0            # tokens of that KV
        self.decode: int | None = None  # decode instance of its last round (policies may stick)


class Job:
    """One round of a session, from its arrival to its last token."""

    __slots__ = (
        "row", "session", "round", "arrival", "input_tokens", "output_tokens", "is_last",
        "hist", "new", "prompt", "gen", "prefill", "decode", "local", "reserve_left",
        "p_blocks", "d_blocks", "d_tokens", "prefilled",
        "join_step", "join_ctx", "epoch", "grow", "marks",
        "t_first", "t_done", "t_prefill_start", "waits", "_t_in",
        "preemptions", "overtaken", "migrations", "n_prefills", "cached_tokens",
    )

    def __init__(self, row: int, session: Session, rnd: int, input_tokens: int,
                 output_tokens: int, is_last: bool) -> None:
        self.row, self.session, self.round = row, session, rnd
        self.input_tokens, self.output_tokens, self.is_last = input_tokens, output_tokens, is_last
        self.arrival = math.nan
        self.hist = 0        # cached tokens the prefill builds on
        self.new = 0         # tokens the (next) prefill computes
        self.prompt = 0      # full context before this round's output
        self.gen = 0         # tokens generated so far
        self.prefill: PrefillInstance | None = None
        self.decode: DecodeInstance | None = None
        self.local = False
        self.reserve_left = 0
        self.p_blocks = 0    # blocks held on the prefill instance
        self.d_blocks = 0    # blocks held on the decode instance (when not running)
        self.d_tokens = 0    # KV tokens those blocks hold
        self.prefilled = 0   # chunked prefill progress
        self.join_step = self.join_ctx = 0
        self.epoch = 0
        self.grow = True
        # token times in emission order: a float (a prefill's token) or a run of decode steps
        # (decode index, first step, end step) whose end times metrics.py looks up
        self.marks: list[float | tuple[int, int, int]] = []
        self.t_first = self.t_done = self.t_prefill_start = math.nan
        self.waits = {"prefill": 0.0, "ready": 0.0, "local": 0.0, "resume": 0.0}
        self._t_in = 0.0
        self.preemptions = self.overtaken = self.migrations = self.n_prefills = 0
        self.cached_tokens = 0

    def __repr__(self) -> str:
        return f"Job(session={self.session.sid}, round={self.round})"


@dataclass(frozen=True)
class Route:
    """A policy's decision for one round. `prefill=None`: prefill locally on `decode`.
    `decode=None` (remote prefill only): the policy binds the decode instance when the prefill
    ends (`Policy.bind_decode`). `reserve_tokens`: a dispatcher reservation on `decode`."""

    decode: int | None
    prefill: int | None = None
    reserve_tokens: int = 0


class Policy:
    """Routing and queue order; the defaults are the plain baseline. Subclass and override.

    - route: at each round's arrival. Default: the session keeps its decode instance (first
      round: round-robin); remote prefill round-robin when the cluster has prefill instances,
      else local.
    - bind_decode: when a remote prefill with `decode=None` ends. Default: round-robin.
    - next_prefill / next_admission: index of the next job to serve in a queue (prefill queues,
      local prefill queues; decode admission queues). Default 0 (FCFS). Only the chosen job is
      tried: if it does not fit, the queue waits (no skipping), as in vLLM.
    - on_first_token / on_round_done: observations, e.g. windowed TTFT, conformal scores.
    - after_step: called at decode iteration boundaries of `inst` (at least every
      `step_hook_every` steps when set); `sim.migrate(job, dst)` may be called from here.
    """

    step_hook_every: int | None = None

    def __init__(self) -> None:
        self._rr_decode = 0
        self._rr_prefill = 0

    def route(self, job: Job, sim: Simulator) -> Route:
        d = job.session.decode
        if d is None:
            d = self._rr_decode % len(sim.decode)
            self._rr_decode += 1
        if not sim.prefill:
            return Route(decode=d)
        p = self._rr_prefill % len(sim.prefill)
        self._rr_prefill += 1
        return Route(decode=d, prefill=p)

    def bind_decode(self, job: Job, sim: Simulator) -> int:
        d = self._rr_decode % len(sim.decode)
        self._rr_decode += 1
        return d

    def next_prefill(self, queue: Sequence[Job], inst: Instance, now: float) -> int:
        return 0

    def next_admission(self, queue: Sequence[Job], inst: DecodeInstance, now: float) -> int:
        return 0

    def on_first_token(self, job: Job, now: float) -> None:
        pass

    def on_round_done(self, job: Job, now: float) -> None:
        pass

    def after_step(self, inst: DecodeInstance, now: float) -> None:
        pass


# --- instances ------------------------------------------------------------------------------------


class Queue(deque):
    """A deque that integrates its length over time (for Little's law and queue-length metrics)
    and charges each job's wait to `job.waits[kind]`."""

    def __init__(self, sim: Simulator, kind: str) -> None:
        super().__init__()
        self.sim, self.kind = sim, kind
        self.area = 0.0
        self.last = 0.0
        self.entered = 0

    def _tick(self) -> None:
        now = self.sim.env.now
        self.area += len(self) * (now - self.last)
        self.last = now

    def push(self, job: Job, front: bool = False) -> None:
        self._tick()
        job._t_in = self.last
        self.entered += 1
        self.appendleft(job) if front else self.append(job)

    def take_at(self, i: int) -> Job:
        self._tick()
        job = self[i]
        del self[i]
        job.waits[self.kind] += self.last - job._t_in
        if i:  # the jobs it overtook
            for k in range(i):
                self[k].overtaken += 1
        return job


class Instance:
    role = ""

    def __init__(self, sim: Simulator, index: int, spec: InstanceSpec,
                 profile: LatencyProfile) -> None:
        self.sim, self.index, self.spec, self.profile = sim, index, spec, profile
        self.name = f"{self.role}{index}"
        self.pool = KVPool(spec.kv_capacity_tokens, profile.kv_block_tokens)
        self.busy_s = 0.0
        self.usage: list[tuple[float, int]] = []

    def _record_usage(self) -> None:
        if self.sim.record_usage:
            self.usage.append((self.sim.env.now, self.pool.used))


class PrefillInstance(Instance):
    """A prefill worker: batches of prompts, one at a time."""

    role = "prefill"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.queue = Queue(self.sim, "prefill")
        self.busy_until = 0.0           # end of the batch in flight (<= now when idle)
        self.queued_tokens = 0          # new tokens waiting in the queue
        self._busy = False
        self._wake = False

    def enqueue(self, job: Job) -> None:
        self.queue.push(job)
        self.queued_tokens += job.new
        self.kick()

    def kick(self) -> None:
        if not self._busy and not self._wake and self.queue:
            self._wake = True
            self.sim._later(0.0, self._start)

    def _start(self) -> None:
        self._wake = False
        if self._busy or not self.queue:
            return
        sim, pool, spec = self.sim, self.pool, self.spec
        now = sim.env.now
        batch: list[Job] = []
        tokens = 0
        while self.queue and len(batch) < spec.max_batch_seqs:
            i = sim.policy.next_prefill(self.queue, self, now)
            job = self.queue[i]
            if batch and tokens + job.new > spec.max_batch_tokens:
                break
            need = pool.blocks(job.hist + job.new)
            if need > pool.free:
                break  # waits for a KV transfer out of this instance to free blocks
            pool.take(need)
            job.p_blocks = need
            self.queue.take_at(i)
            self.queued_tokens -= job.new
            tokens += job.new
            batch.append(job)
        if not batch:
            return
        dur = self.profile.prefill_batch_time([j.new for j in batch], [j.hist for j in batch])
        for job in batch:
            job.t_prefill_start = now if math.isnan(job.t_prefill_start) else job.t_prefill_start
        self._busy = True
        self.busy_until = now + dur
        self.busy_s += dur
        self._record_usage()
        sim._later(dur, self._finish, batch)

    def _finish(self, batch: list[Job]) -> None:
        sim = self.sim
        now = sim.env.now
        self._busy = False
        for job in batch:
            job.n_prefills += 1
            sim._emit_token(job, now)
            if job.gen >= job.output_tokens:
                self.pool.give(job.p_blocks)
                job.p_blocks = 0
                sim._round_done(job)
                continue
            if job.decode is None:
                sim._bind(job, sim.policy.bind_decode(job, sim))
            job.decode.enqueue_ready(job)
        self._record_usage()
        self.kick()

    def transfer_out_done(self, job: Job) -> None:
        self.pool.give(job.p_blocks)
        job.p_blocks = 0
        self.kick()


class DecodeInstance(Instance):
    """A decode worker with continuous batching, local prefills and preemption (module doc)."""

    role = "decode"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        sim = self.sim
        self.ready = Queue(sim, "ready")      # prefilled elsewhere, waiting for admission
        self.local = Queue(sim, "local")      # waiting for a local prefill
        self.resume = Queue(sim, "resume")    # preempted, waiting for recompute (served first)
        self.joining: list[Job] = []          # KV arrived, join at the next boundary
        self.chunking: list[Job] = []         # chunked prefills in progress (blocks taken)
        self.inflight = 0                     # admitted, KV in transfer
        self.running: dict[Job, None] = {}    # admission order (last = youngest)
        self.step = 0                         # index of the next decode step
        self.ctx_sum = 0                      # total KV tokens of running sequences at `step`
        # buckets[r]: growing sequences that need a new block at steps s with s % bs == r
        self.buckets: list[set[Job]] = [set() for _ in range(self.profile.kv_block_tokens)]
        self.blen = [0] * len(self.buckets)   # their sizes (summed over slices: fast)
        self.n_grow = 0                       # sequences in the buckets
        self.finish_heap: list[tuple[int, int, int, Job]] = []  # (last step, seq, epoch, job)
        self.runs: list[tuple[float, int, float, float]] = []   # (t0, steps, base, inc)
        # recent iterations for itl_window: (t_end, steps, seconds, t0, base, inc)
        self.window: deque[tuple[float, int, float, float, float, float]] = deque()
        self.window_steps = 0
        self.window_time = 0.0
        self.preemptions = self.evictions = 0
        self.stall_s = 0.0
        self._state = "idle"                  # idle | boundary | macro | prefill
        self._macro: tuple | None = None      # (t0, K, base, inc, gen, chunk plan)
        self._prefill_end = 0.0
        self._prefill_dur = 0.0
        self._gen = 0
        self._wake = False
        self._hook_every = sim.policy.step_hook_every
        self._has_hook = type(sim.policy).after_step is not Policy.after_step
        self._seq = 0

    # --- what policies read ---------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return len(self.running)

    def busy_until(self) -> float:
        """End of the iteration in flight (now when idle): AMPD's residual iteration time."""
        now = self.sim.env.now
        if self._state == "prefill":
            return self._prefill_end
        if self._state == "macro":
            t0, K, base, inc = self._macro[:4]
            i = min(self._steps_done(now) + 1, K)
            return t0 + i * base + inc * i * (i - 1) / 2
        return now

    def _in_flight(self, now: float) -> tuple[int, float]:
        """(steps, seconds) of the macro step in flight that have ended by `now`."""
        if self._state != "macro":
            return 0, 0.0
        t0, K, base, inc = self._macro[:4]
        i = self._steps_done(now)
        return i, i * base + inc * i * (i - 1) / 2

    def free_blocks(self, now: float) -> int:
        """Free KV blocks as a step-by-step engine would see them now (`pool.free` lags
        inside a macro step, whose growth is booked when it ends)."""
        return self.pool.free - (self._need(self._in_flight(now)[0]) if self._state == "macro"
                                 else 0)

    def context_tokens(self, now: float) -> int:
        """KV tokens of the running batch now (C in T_dec)."""
        return self.ctx_sum + len(self.running) * self._in_flight(now)[0]

    def itl_window(self, now: float) -> tuple[float, int]:
        """(mean gap between decode iterations, iterations) over iterations that ended in the
        last `itl_window_s` seconds (AMPD's windowed ITL); a local-prefill stall counts in the
        gap it opens. (nan, 0) when empty. Exact per step, also inside macro steps."""
        horizon = now - self.sim.cluster.itl_window_s
        win = self.window
        while win and win[0][0] < horizon:
            _, n, s, *_ = win.popleft()
            self.window_steps -= n
            self.window_time -= s
        steps, seconds = self.window_steps, self.window_time
        if self._state == "macro":  # its steps that ended in [horizon, now]
            t0, K, base, inc = self._macro[:4]
            i = self._steps_by(t0, K, base, inc, now)
            early = self._steps_by(t0, K, base, inc, horizon, strict=True)
            steps += i - early
            seconds += (i * base + inc * i * (i - 1) / 2
                        - early * base - inc * early * (early - 1) / 2)
        if win and win[0][1] > 1:  # the oldest run may have begun before the horizon
            _, n, _, t0, base, inc = win[0]
            early = self._steps_by(t0, n, base, inc, horizon, strict=True)
            steps -= early
            seconds -= early * base + inc * early * (early - 1) / 2
        if steps <= 0:
            return math.nan, 0
        return seconds / steps, steps

    # --- arrivals at this instance ----------------------------------------------------------------

    def enqueue_ready(self, job: Job) -> None:
        job.local = False
        self.ready.push(job)
        self.poke()

    def enqueue_local(self, job: Job) -> None:
        job.local = True
        self.local.push(job)
        self.poke()

    def poke(self) -> None:
        """Something changed: reach the next iteration boundary (now if idle)."""
        if self._state == "idle":
            if not self._wake:
                self._wake = True
                self.sim._later(0.0, self._boundary)
        elif self._state == "macro":
            self._cut_macro()

    # --- iteration boundary -----------------------------------------------------------------------

    def _boundary(self) -> None:
        """Between two iterations: join, admit, hook, then start the next iteration."""
        self._wake = False
        self._state = "boundary"
        self._macro = None
        now = self.sim.env.now
        if self.joining:
            for job in self.joining:
                self._join(job)
            self.joining.clear()
        self._admit_ready(now)
        if self._has_hook and self.running:
            self.sim.policy.after_step(self, now)
        self._record_usage()
        if self.spec.chunked_prefill_tokens is None and self._start_local_prefill(now):
            return
        self._start_steps(now)

    def _headroom(self) -> int:
        """Blocks the running batch needs for its next step: kept free at admission."""
        return self.blen[self.step % len(self.blen)] if self.running else 0

    def _try_take(self, need: int, keep: int | None = None) -> bool:
        """Atomic allocation of `need` blocks (evicting idle session KV, but not session
        `keep`'s, if that makes room)."""
        pool = self.pool
        want = need + self._headroom()
        if want > pool.free:
            for sid in pool.evict_idle(want, keep):
                self.sim._evicted(sid, self)
            if want > pool.free:
                return False
        pool.take(need)
        return True

    def _slots(self) -> int:
        return (self.spec.max_batch_seqs - len(self.running) - self.inflight - len(self.joining)
                - len(self.chunking))

    def _extra_out(self, job: Job) -> int:
        return job.output_tokens - job.gen if self.spec.reserve_output_at_admission else 0

    def _admit_ready(self, now: float) -> None:
        if self.resume:
            return  # preempted sequences are served first; while they wait, so do others
        sim = self.sim
        while self.ready and self._slots() > 0:
            i = sim.policy.next_admission(self.ready, self, now)
            job = self.ready[i]
            ctx = job.hist + job.new
            need = self.pool.blocks(ctx + self._extra_out(job)) - job.d_blocks
            if not self._try_take(need):
                break
            self.ready.take_at(i)
            job.d_blocks += need
            job.d_tokens = ctx
            self.inflight += 1
            # AMPD: the prefill instance sends back history + new prompt (l_h + l_i)
            sim._transfer(job.prefill, self, ctx, self._kv_arrived, job)

    def _kv_arrived(self, job: Job) -> None:
        job.prefill.transfer_out_done(job)
        self.inflight -= 1
        self.joining.append(job)
        self.poke()

    def _pick_local(self, now: float, budget: int, slots: int) -> list[Job]:
        """Jobs to prefill here now, their blocks taken: the resume queue first (in order, and
        nothing overtakes a waiting preempted sequence), then the local queue in policy order."""
        picked: list[Job] = []
        tokens = 0
        for queue in (self.resume, self.local):
            while queue and len(picked) < slots:
                i = 0 if queue is self.resume else self.sim.policy.next_prefill(queue, self, now)
                job = queue[i]
                if picked and tokens + job.new > budget:
                    return picked
                # the session's KV kept here since its last round is used if it is still
                # cached now (it stays evictable while the round waits in the queue)
                sess = job.session
                cached = queue is self.local and sess.kv_inst is self
                kv_blocks = self.pool.idle[sess.sid] if cached else 0
                need = self.pool.blocks(job.prompt + job.gen + self._extra_out(job)) - kv_blocks
                if not self._try_take(need, sess.sid if cached else None):
                    return picked
                queue.take_at(i)
                if cached:
                    del self.pool.idle[sess.sid]
                    job.hist = sess.kv_tokens
                    sess.kv_inst, sess.kv_tokens = None, 0
                elif queue is self.local:
                    job.hist = 0
                job.new = job.prompt + job.gen - job.hist
                job.cached_tokens = job.hist if queue is self.local else job.cached_tokens
                job.d_blocks = kv_blocks + need
                job.d_tokens = job.hist + job.new
                if math.isnan(job.t_prefill_start):
                    job.t_prefill_start = now
                tokens += job.new
                picked.append(job)
            if queue is self.resume and queue:
                return picked
        return picked

    def _start_local_prefill(self, now: float) -> bool:
        if not (self.resume or self.local) or self._slots() <= 0:
            return False
        batch = self._pick_local(now, self.spec.max_batch_tokens, self._slots())
        if not batch:
            return False
        dur = self.profile.prefill_batch_time([j.new for j in batch], [j.hist for j in batch])
        self._state = "prefill"
        self._prefill_end = now + dur
        self._prefill_dur = dur
        self.busy_s += dur
        self.sim._later(dur, self._local_prefill_done, batch)
        return True

    def _local_prefill_done(self, batch: list[Job]) -> None:
        self._state = "boundary"
        now = self.sim.env.now
        if self.running:  # the stall: a gap in every running sequence's token stream
            self.stall_s += self._prefill_dur
            self._window_add(now, 0, self._prefill_dur)
        for job in batch:
            self._prefilled(job, now)
        self._boundary()

    def _prefilled(self, job: Job, now: float) -> None:
        """A local (or recompute) prefill of `job` ended at `now`: it emitted a token."""
        job.n_prefills += 1
        job.prefilled = 0
        self.sim._emit_token(job, now)
        if job.gen >= job.output_tokens:
            self.sim._round_done(job)
        else:
            self._join(job)

    def _window_add(self, t_end: float, steps: int, seconds: float, t0: float = 0.0,
                    base: float = 0.0, inc: float = 0.0) -> None:
        self.window.append((t_end, steps, seconds, t0, base, inc))
        self.window_steps += steps
        self.window_time += seconds

    # --- running sequences ------------------------------------------------------------------------

    def _join(self, job: Job) -> None:
        """Add a sequence whose KV (prompt + gen - 1 tokens) is here, at step `self.step`."""
        if job.reserve_left:  # staged release (MAPS): the prompt part once the KV has landed
            part = min(job.reserve_left, self.pool.blocks(job.prompt))
            job.reserve_left -= part
            self.pool.reserved -= part
        ctx = job.prompt + job.gen - 1
        job.join_step, job.join_ctx = self.step, ctx
        job.epoch += 1
        job.grow = not self.spec.reserve_output_at_admission
        self.running[job] = None
        self.ctx_sum += ctx
        if job.grow:  # needs a new block at steps s where ctx + (s - step) is a multiple of bs
            r = (self.step - ctx) % len(self.buckets)
            self.buckets[r].add(job)
            self.blen[r] += 1
            self.n_grow += 1
        self._seq += 1
        last = self.step + job.output_tokens - job.gen - 1
        heapq.heappush(self.finish_heap, (last, self._seq, job.epoch, job))

    def _leave(self, job: Job) -> int:
        """Remove a running sequence at the boundary `self.step`; returns its KV tokens."""
        del self.running[job]
        steps = self.step - job.join_step
        ctx = job.join_ctx + steps
        self.ctx_sum -= ctx
        if job.grow:
            r = (job.join_step - job.join_ctx) % len(self.buckets)
            self.buckets[r].remove(job)
            self.blen[r] -= 1
            self.n_grow -= 1
            job.d_blocks = self.pool.blocks(ctx)
        job.d_tokens = ctx
        if steps:
            job.marks.append((self.index, job.join_step, self.step))
        job.gen += steps
        job.epoch += 1
        return ctx

    def _need(self, k: int) -> int:
        """Blocks the running batch allocates over the next k steps."""
        bs = len(self.blen)
        full, rest = divmod(k, bs)
        n = full * self.n_grow
        if rest:
            s = self.step % bs
            if s + rest <= bs:
                n += sum(self.blen[s:s + rest])
            else:
                n += sum(self.blen[s:]) + sum(self.blen[:s + rest - bs])
        return n

    def _steps_affordable(self, wanted: int) -> int:
        """Most steps (at most `wanted`) the running batch can take from free blocks."""
        per_period = self.n_grow
        free = self.pool.free
        bs = len(self.blen)
        if per_period * (wanted // bs + 1) <= free:
            return wanted  # the common case: plenty of room
        full, left = divmod(free, per_period)
        k = full * bs
        s = self.step % bs
        for i in range(bs):
            n = self.blen[(s + i) % bs]
            if n > left:
                break
            left -= n
            k += 1
        return min(k, wanted)

    def _preempt_for_next_step(self) -> None:
        """Make room for the next step: evict idle session KV, then preempt the youngest."""
        need = self._need(1)
        if need <= self.pool.free:
            return
        for sid in self.pool.evict_idle(need):
            self.sim._evicted(sid, self)
        while self.running and self._need(1) > self.pool.free:
            victim = next(reversed(self.running))  # the most recently admitted
            ctx = self._leave(victim)
            self.pool.give(victim.d_blocks)
            victim.d_blocks = victim.d_tokens = 0
            victim.preemptions += 1
            self.preemptions += 1
            # recompute: the prompt and every generated token, from scratch (vLLM's recompute)
            victim.hist, victim.new = 0, ctx + 1
            self.resume.push(victim, front=True)

    def _start_steps(self, now: float) -> None:
        """The next decode iteration(s): a macro step of K identical steps, or one hybrid
        step carrying prefill chunks (chunked prefill)."""
        self._preempt_for_next_step()
        B = len(self.running)
        plan: list[tuple[Job, int]] = []
        extra = 0.0
        budget = self.spec.chunked_prefill_tokens
        if budget is not None and (self.chunking or self.resume or self.local):
            plan, extra = self._plan_chunks(now, budget - B)
        if B == 0 and not plan:
            self._state = "idle"
            return
        p = self.profile
        base = (p.decode_step_time(B, self.ctx_sum) if B else p.prefill_s0) + extra
        inc = p.decode_s_per_ctx_token * B
        if plan or not self.sim.macro_steps:
            K = 1
        else:
            K = self._steps_affordable(self._first_finish() - self.step + 1)
            if self._hook_every:
                K = min(K, self._hook_every)
            K = max(K, 1)
        self._gen += 1
        self._state = "macro"
        self._macro = (now, K, base, inc, self._gen, plan)
        self.sim._later(K * base + inc * K * (K - 1) / 2, self._macro_end, self._gen)

    def _plan_chunks(self, now: float, budget: int) -> tuple[list[tuple[Job, int]], float]:
        """Sarathi: fill the step's token budget with prefill chunks in queue order; a job's
        blocks are all taken when its first chunk is scheduled. Returns (plan, extra seconds)."""
        plan: list[tuple[Job, int]] = []
        extra = 0.0
        p = self.profile
        i = 0
        while budget > 0:
            if i == len(self.chunking):
                got = self._pick_local(now, 1 << 60, min(1, self._slots()))
                if not got:
                    break
                self.chunking.extend(got)
            job = self.chunking[i]
            n = min(job.new - job.prefilled, budget)
            budget -= n
            plan.append((job, n))
            done = job.hist + job.prefilled
            extra += p.prefill_s_per_token * n + p.prefill_s_per_token2 * n * (n + 2 * done)
            i += 1
        return plan, extra

    def _first_finish(self) -> int:
        heap = self.finish_heap
        while heap and heap[0][2] != heap[0][3].epoch:
            heapq.heappop(heap)
        return heap[0][0] if heap else self.step

    def _steps_done(self, now: float) -> int:
        """Steps of the macro step in flight that have ended by `now`."""
        t0, K, base, inc = self._macro[:4]
        return self._steps_by(t0, K, base, inc, now)

    @staticmethod
    def _steps_by(t0: float, K: int, base: float, inc: float, t: float,
                  strict: bool = False) -> int:
        """How many of K steps starting at t0 end by t (before t when `strict`): step i ends
        at t0 + i*base + inc*i*(i-1)/2."""
        def ended(i: int) -> bool:
            end = t0 + i * base + inc * i * (i - 1) / 2
            return end < t if strict else end <= t

        x = t - t0
        if inc > 0:  # solve inc/2 i^2 + (base - inc/2) i = x for i
            b = base - inc / 2
            i = int((-b + math.sqrt(max(b * b + 2 * inc * x, 0.0))) / inc)
        else:
            i = int(x / base) if base > 0 else K
        i = max(0, min(i, K))
        while i > 0 and not ended(i):
            i -= 1
        while i < K and ended(i + 1):
            i += 1
        return i

    def _cut_macro(self) -> None:
        """Something arrived mid macro step: end it after the step now in progress."""
        t0, K, base, inc, _, plan = self._macro
        if K <= 1:
            return
        i = self._steps_done(self.sim.env.now)
        if i + 1 >= K:
            return
        K = i + 1
        self._gen += 1
        self._macro = (t0, K, base, inc, self._gen, plan)
        end = t0 + K * base + inc * K * (K - 1) / 2
        self.sim._later(end - self.sim.env.now, self._macro_end, self._gen)

    def _macro_end(self, gen: int) -> None:
        if self._macro is None or gen != self._macro[4]:
            return  # the stale end of a macro step that was cut
        t0, K, base, inc, _, plan = self._macro
        self._state, self._macro = "boundary", None
        now = self.sim.env.now
        self.pool.take(self._need(K))
        dur = K * base + inc * K * (K - 1) / 2
        self.runs.append((t0, K, base, inc))
        self._window_add(now, K, dur, t0, base, inc)
        self.busy_s += dur
        self.step += K
        self.ctx_sum += len(self.running) * K
        heap = self.finish_heap
        while heap and heap[0][0] < self.step:  # their last token came in this macro step
            _, _, epoch, job = heapq.heappop(heap)
            if epoch == job.epoch:
                self._leave(job)
                self.sim._round_done(job)
        for job, n in plan:
            job.prefilled += n
            if job.prefilled >= job.new:
                self.chunking.remove(job)
                self._prefilled(job, now)
        self._boundary()


# --- the simulator -----------------------------------------------------------------------------------

class Simulator:
    """One run: a trace, a cluster, profiles and a policy. `run()` returns a SimResult."""

    def __init__(self, trace: Trace, cluster: ClusterConfig,
                 profiles: LatencyProfile | Mapping[str, LatencyProfile], policy: Policy, *,
                 macro_steps: bool = True, record_usage: bool = False) -> None:
        if isinstance(profiles, LatencyProfile):
            profiles = {"default": profiles}
        self.trace, self.cluster, self.policy = trace, cluster, policy
        self.macro_steps, self.record_usage = macro_steps, record_usage
        self.env = simpy.Environment()
        self.prefill: list[PrefillInstance] = []
        self.decode: list[DecodeInstance] = []
        for spec in cluster.instances:
            if spec.profile not in profiles:
                raise SimError(f"instance profile {spec.profile!r} not among the profiles given: "
                               f"{', '.join(sorted(profiles))}")
            for _ in range(spec.count):
                if spec.role == "prefill":
                    self.prefill.append(PrefillInstance(self, len(self.prefill), spec,
                                                        profiles[spec.profile]))
                else:
                    self.decode.append(DecodeInstance(self, len(self.decode), spec,
                                                      profiles[spec.profile]))
        self.link_free: dict[tuple[str, str], float] = {}
        self.link_wait_s = 0.0
        self.transfers = 0
        self.sessions: dict[int, Session] = {}
        self.jobs: list[Job] = []
        self.done = 0

    @property
    def now(self) -> float:
        return self.env.now

    # --- event plumbing --------------------------------------------------------------------------

    def _later(self, delay: float, fn: Callable, arg=None) -> None:
        ev = simpy.Timeout(self.env, delay if delay > 0 else 0.0)
        if arg is None:
            ev.callbacks.append(lambda _e: fn())
        else:
            ev.callbacks.append(lambda _e: fn(arg))

    def link_free_at(self, src: Instance, dst: Instance) -> float:
        """When the link src -> dst can start a new transfer (FIFO)."""
        return max(self.env.now, self.link_free.get((src.name, dst.name), 0.0))

    def _transfer(self, src: Instance, dst: Instance, tokens: int,
                  done: Callable[[Job], None], job: Job) -> None:
        now = self.env.now
        start = self.link_free_at(src, dst)
        end = start + src.profile.kv_transfer_time(tokens)
        self.link_free[(src.name, dst.name)] = end
        self.link_wait_s += start - now
        self.transfers += 1
        self._later(end - now, done, job)

    # --- rounds --------------------------------------------------------------------------------

    def _arrive(self, job: Job) -> None:
        now = self.env.now
        job.arrival = now
        sess = job.session
        job.prompt = sess.context + job.input_tokens
        route = self.policy.route(job, self)
        self._check_route(job, route)
        # the session's KV kept since its last round (idle, evictable)
        kv, kv_tokens = sess.kv_inst, sess.kv_tokens
        if kv is not None and (route.prefill is not None or kv.index != route.decode):
            kv_blocks = kv.pool.idle.pop(sess.sid)  # moved or sent: no longer a cache
            sess.kv_inst, sess.kv_tokens = None, 0
        else:
            kv_blocks = 0
        if route.prefill is None:
            self._bind(job, route.decode)
            if kv is job.decode:  # stays cached (and evictable) until the prefill is admitted
                job.hist = kv_tokens
            else:                 # elsewhere, or evicted: recompute the whole context
                self._drop(kv, kv_blocks)
                job.hist = 0
            job.new = job.prompt - job.hist
            self._reserve(job, route.reserve_tokens)
            job.decode.enqueue_local(job)
            return
        p = self.prefill[route.prefill]
        job.prefill = p
        if route.decode is not None:
            self._bind(job, route.decode)
            self._reserve(job, route.reserve_tokens)
        if kv is None:
            job.hist, job.new = 0, job.prompt
            p.enqueue(job)
            return
        # AMPD: the history's KV goes decode -> prefill first and the prefill builds on it; the
        # decode copy is freed once sent (the prefill instance returns history + new prompt)
        job.hist = job.cached_tokens = kv_tokens
        job.new = job.prompt - job.hist

        def history_sent(j: Job) -> None:
            self._drop(kv, kv_blocks)
            p.enqueue(j)

        self._transfer(kv, p, kv_tokens, history_sent, job)

    @staticmethod
    def _drop(inst: DecodeInstance | None, blocks: int) -> None:
        if inst is not None and blocks:
            inst.pool.give(blocks)
            inst.poke()

    def _reserve(self, job: Job, tokens: int) -> None:
        if tokens:
            n = job.decode.pool.blocks(tokens)
            job.decode.pool.reserved += n
            job.reserve_left = n

    def _bind(self, job: Job, d: int) -> None:
        if not isinstance(d, int) or not 0 <= d < len(self.decode):
            raise SimError(f"{job}: policy chose decode instance {d!r}; there are "
                           f"{len(self.decode)}")
        job.decode = self.decode[d]
        job.session.decode = d
        need = job.prompt + job.output_tokens
        if job.decode.pool.blocks(need) > job.decode.pool.capacity:
            raise SimError(f"{job}: context {job.prompt} + output {job.output_tokens} tokens "
                           f"exceeds {job.decode.name}'s KV capacity "
                           f"({job.decode.spec.kv_capacity_tokens} tokens)")

    def _check_route(self, job: Job, route: Route) -> None:
        if route.prefill is None and route.decode is None:
            raise SimError(f"{job}: a local prefill needs a decode instance")
        if route.prefill is not None:
            if not 0 <= route.prefill < len(self.prefill):
                raise SimError(f"{job}: policy chose prefill instance {route.prefill!r}; there "
                               f"are {len(self.prefill)}")
            p = self.prefill[route.prefill]
            if p.pool.blocks(job.prompt) > p.pool.capacity:
                raise SimError(f"{job}: context {job.prompt} tokens exceeds {p.name}'s KV "
                               f"capacity ({p.spec.kv_capacity_tokens} tokens)")
        if route.reserve_tokens and route.decode is None:
            raise SimError(f"{job}: a reservation needs the decode instance at routing time")

    def _emit_token(self, job: Job, now: float) -> None:
        first = job.gen == 0
        job.gen += 1
        job.marks.append(now)
        if first:
            job.t_first = now
            self.policy.on_first_token(job, now)

    def _round_done(self, job: Job) -> None:
        now = self.env.now
        job.t_done = now
        self.done += 1
        d, sess = job.decode, job.session
        if job.reserve_left:
            d.pool.reserved -= job.reserve_left
            job.reserve_left = 0
        sess.context = job.prompt + job.output_tokens
        # the KV this round leaves on its decode instance: kept for the next round, or freed
        if d is not None and job.d_blocks:
            if self.cluster.retain_kv_between_rounds and not job.is_last:
                d.pool.idle[sess.sid] = job.d_blocks
                sess.kv_inst, sess.kv_tokens = d, job.d_tokens
            else:
                self._drop(d, job.d_blocks)
        job.d_blocks = job.d_tokens = 0
        self.policy.on_round_done(job, now)
        if not job.is_last:
            nxt = self.jobs[job.row + 1]
            self._later(self._gaps[job.row], self._arrive, nxt)

    def _evicted(self, sid: int, inst: DecodeInstance) -> None:
        inst.evictions += 1
        sess = self.sessions[sid]
        sess.kv_inst, sess.kv_tokens = None, 0

    # --- migration (for policies such as Llumnix) ---------------------------------------------

    def migrate(self, job: Job, dst: int) -> bool:
        """Move a running sequence of the instance at its boundary (call from after_step) to
        decode instance `dst`: stop, copy its KV over the link, resume there. False when `dst`
        cannot take its blocks now."""
        src = job.decode
        target = self.decode[dst]
        if target is src or job not in src.running or src._state != "boundary":
            return False
        ctx = job.join_ctx + (src.step - job.join_step)
        need = target.pool.blocks(ctx + target._extra_out(job))
        if target._state == "macro" and target._need(target._macro[1]) + need > target.pool.free:
            return False  # the blocks its macro step in flight counts on
        if not target._try_take(need):
            return False
        src._leave(job)
        held = job.d_blocks
        job.d_blocks, job.d_tokens = need, ctx
        job.migrations += 1
        if job.reserve_left:
            src.pool.reserved -= job.reserve_left
            job.reserve_left = 0
        job.decode = target
        job.session.decode = dst
        target.inflight += 1

        def arrived(j: Job) -> None:
            src.pool.give(held)
            src.poke()
            target.inflight -= 1
            target.joining.append(j)
            target.poke()

        self._transfer(src, target, ctx, arrived, job)
        return True

    # --- run -------------------------------------------------------------------------------------

    def run(self, until: float | None = None) -> "SimResult":
        from .metrics import collect

        tr = self.trace
        n = len(tr)
        sess = tr.session
        # rows of a session must be consecutive and in round order (`job.row + 1` is the next)
        starts = np.flatnonzero(np.r_[True, sess[1:] != sess[:-1]]) if n else np.zeros(0, int)
        ends = np.r_[starts[1:], n].astype(np.int64)
        if (np.unique(sess).size != starts.size
                or (tr.round != np.arange(n) - np.repeat(starts, ends - starts)).any()):
            raise SimError("trace rows of a session must be consecutive, in round order "
                           "(build traces with workload.Trace.from_columns)")
        sids, inputs, outputs = sess.tolist(), tr.input_tokens.tolist(), tr.output_tokens.tolist()
        rounds, arrivals = tr.round.tolist(), tr.arrival_s.tolist()
        self._gaps = tr.tool_gap_s.tolist()
        last = set((ends - 1).tolist())
        jobs = []
        for a, b in zip(starts.tolist(), ends.tolist()):
            session = Session(sids[a], list(range(a, b)))
            self.sessions[session.sid] = session
            for i in range(a, b):
                jobs.append(Job(i, session, rounds[i], inputs[i], outputs[i], i in last))
        self.jobs = jobs
        for a in starts.tolist():
            self._later(arrivals[a], self._arrive, jobs[a])
        self.env.run(until=until)
        return collect(self, complete=until is None)


def simulate(trace: Trace, cluster: ClusterConfig,
             profiles: LatencyProfile | Mapping[str, LatencyProfile], policy: Policy | None = None,
             *, macro_steps: bool = True, record_usage: bool = False) -> "SimResult":
    """Run one simulation; the default policy is `Policy()` (round-robin, FCFS)."""
    return Simulator(trace, cluster, profiles, policy or Policy(), macro_steps=macro_steps,
                     record_usage=record_usage).run()
