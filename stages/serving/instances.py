"""The instances of the serving model: prefill workers, decode workers, their queues.

sim.py describes the model; this module holds its mechanics. A decode instance keeps each
running sequence's state implicitly (the step it joined at and its KV length then): at step s
its KV holds join_ctx + (s - join_step) tokens, it needs a new block exactly at the steps where
that is a multiple of the block size (one bucket per residue, so a step's block demand is a
bucket's size), and its last token comes at step join_step + remaining - 1 (a heap). So K
identical steps cost O(1) to plan and to book: their durations are
    T_i = s0 + c*B + d*(C + i*B),  i = 0..K-1,   sum = K*base + d*B*K*(K-1)/2,
and a macro step runs until the first of: a sequence finishing, the free blocks running out
(then the next boundary preempts), or `step_hook_every`. Anything arriving meanwhile cuts the
macro step after the step in progress, so every boundary a step-by-step engine would act at is
one here too.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import TYPE_CHECKING

from .kv import KVPool
from .latency import LatencyProfile

if TYPE_CHECKING:
    from .sim import InstanceSpec, Job, Simulator


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
        job.t_queued = self.last
        self.entered += 1
        self.appendleft(job) if front else self.append(job)

    def take_at(self, i: int) -> Job:
        self._tick()
        job = self[i]
        del self[i]
        job.waits[self.kind] += self.last - job.t_queued
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
        self._busy_end = 0.0            # end of the batch in flight
        self.queued_tokens = 0          # new tokens waiting in the queue
        self._busy = False
        self._wake = False

    def busy_until(self) -> float:
        """End of the batch in flight (now when idle)."""
        return self._busy_end if self._busy else self.sim.env.now

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
        self._busy_end = now + dur
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
                sim._bind_after_prefill(job)
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
        # blen[r]: growing sequences that need a new block at the steps s with s % bs == r
        self.blen = [0] * self.profile.kv_block_tokens
        self.n_grow = 0                       # sum(blen)
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
        self._has_hook = sim.has_step_hook
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

    def effective_blocks(self, now: float) -> int:
        """Free blocks minus dispatcher reservations (MAPS's B_eff = B_free - B_res)."""
        return self.free_blocks(now) - self.pool.reserved

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
        if job.reserve_prompt:  # staged release (MAPS): the prompt part once the KV has landed
            job.reserve_left -= job.reserve_prompt
            self.pool.reserved -= job.reserve_prompt
            job.reserve_prompt = 0
        ctx = job.prompt + job.gen - 1
        job.join_step, job.join_ctx = self.step, ctx
        job.epoch += 1
        job.grow = not self.spec.reserve_output_at_admission
        self.running[job] = None
        self.ctx_sum += ctx
        if job.grow:  # needs a new block at steps s where ctx + (s - step) is a multiple of bs
            r = (self.step - ctx) % len(self.blen)
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
            r = (job.join_step - job.join_ctx) % len(self.blen)
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
