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
live (overlapped) migration: `migrate` is stop-and-copy. Simplifications: a preempted
sequence's recompute runs on its own decode instance; a round routed to another decode
instance than its session's KV recomputes that history (remote prefills read it first).

Engine: SimPy 4 (`simpy.Environment`, `Timeout` events with callbacks rather than one
generator process per instance: an instance must cut its own macro step when something
arrives, which a stale-event check does cheaply and a process interrupt would not). This file
holds the model's API (configs, Job, Route, Policy, Simulator); instances.py its mechanics.

    from stages.serving.sim import ClusterConfig, InstanceSpec, Policy, simulate
    result = simulate(trace, ClusterConfig(instances=[...]), load_profile("a100"), MyPolicy())
    result.rounds["ttft_s"], result.to_polars(), result.queues, result.instances
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal, Mapping, Sequence

import numpy as np
import simpy
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .instances import DecodeInstance, Instance, PrefillInstance
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
        "reserve_prompt",
        "p_blocks", "d_blocks", "d_tokens", "prefilled",
        "join_step", "join_ctx", "epoch", "grow", "marks",
        "t_first", "t_done", "t_prefill_start", "waits", "t_queued",
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
        self.reserve_left = 0    # dispatcher reservation still held (blocks)
        self.reserve_prompt = 0  # its prompt part, released when the KV lands
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
        self.t_queued = 0.0  # when it entered the queue it is in (SJF max-wait guards)
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
    - bind_decode: when a remote prefill with `decode=None` ends: a decode index, or a Route
      whose `decode` and `reserve_tokens` are used. Default: round-robin.
    - next_prefill / next_admission: index of the next job to serve in a queue (prefill queues,
      local prefill queues; decode admission queues). Default 0 (FCFS). Only the chosen job is
      tried: if it does not fit, the queue waits (no skipping), as in vLLM.
    - on_first_token / on_round_done: observations, e.g. windowed TTFT, conformal scores.
    - after_step: called at decode iteration boundaries of `inst` (at least every
      `step_hook_every` steps when set); `sim.migrate(job, dst)` may be called from here.

    What a policy may read. The simulator: `now`, `prefill[i]` and `decode[i]`,
    `link_free_at(src, dst)`. A prefill instance: `queue`, `queued_tokens`, `busy_until()`,
    `pool`, `profile`. A decode instance: `running` (jobs, admission order), `batch_size`,
    `ready` / `local` / `resume` queues, `free_blocks(now)`, `effective_blocks(now)` (free minus
    reservations), `context_tokens(now)`, `busy_until()` (end of the iteration in flight),
    `itl_window(now)` (mean gap between iterations over the last `itl_window_s`), `pool`,
    `profile`; read these methods rather than `pool.free`, which lags inside a macro step. A
    job: `row` (its trace row: key per-request data such as predicted lengths by it),
    `session` (`sid`, `decode`, `kv_inst`, `kv_tokens`), `round`, `arrival`, `prompt` (whole
    context), `hist` / `new` (cached and to-compute tokens of its next prefill), `input_tokens`,
    `t_queued`, `gen`. `output_tokens` is the true length: only an oracle may read it.
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

    def bind_decode(self, job: Job, sim: Simulator) -> int | Route:
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
        self.has_step_hook = type(policy).after_step is not Policy.after_step
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
        if kv is not None and (route.prefill is not None or kv.index != int(route.decode)):
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
        p = self.prefill[operator.index(route.prefill)]
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

    def _bind_after_prefill(self, job: Job) -> None:
        bound = self.policy.bind_decode(job, self)
        if isinstance(bound, Route):
            self._bind(job, bound.decode)
            self._reserve(job, bound.reserve_tokens)
        else:
            self._bind(job, bound)

    def _reserve(self, job: Job, tokens: int) -> None:
        if tokens:
            n = job.decode.pool.blocks(tokens)
            job.decode.pool.reserved += n
            job.reserve_left = n
            job.reserve_prompt = min(n, job.decode.pool.blocks(job.prompt))

    @staticmethod
    def _index(job: Job, value, n: int, what: str) -> int:
        try:
            i = operator.index(value)  # ints and numpy integers (a policy's argmin)
        except TypeError:
            i = -1
        if not 0 <= i < n:
            raise SimError(f"{job}: policy chose {what} instance {value!r}; there are {n}")
        return i

    def _bind(self, job: Job, d: int) -> None:
        d = self._index(job, d, len(self.decode), "decode")
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
        if route.decode is not None:
            self._index(job, route.decode, len(self.decode), "decode")
        if route.prefill is not None:
            p = self.prefill[self._index(job, route.prefill, len(self.prefill), "prefill")]
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
            job.reserve_left = job.reserve_prompt = 0
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
            job.reserve_left = job.reserve_prompt = 0
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
