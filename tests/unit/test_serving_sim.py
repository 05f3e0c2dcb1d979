"""The serving simulator's mechanics on hand-made cases with hand-computed timings, and its
invariants on random ones: local-prefill stalls charged to every running request, atomic KV
admission, recompute preemption, multi-round KV reuse, the two-way KV transfer of a remote
incremental prefill, FIFO links, chunked prefill, staged reservation release, migration, and
macro steps equal to single steps (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from stages.serving.latency import LatencyProfile
from stages.serving.sim import (ClusterConfig, InstanceSpec, Policy, Route, SimError, Simulator,
                                simulate)
from stages.serving.workload import Trace


def profile(**kw) -> LatencyProfile:
    """Round numbers: a prefill costs 10 ms per token, a decode step 100 ms, KV moves free."""
    base = dict(name="hand", source="unit test", prefill_s0=0.0, prefill_s_per_token=0.01,
                decode_s0=0.1, decode_s_per_seq=0.0, decode_s_per_ctx_token=0.0,
                kv_bytes_per_token=1, kv_block_tokens=16, link_bytes_per_s=1e15)
    return LatencyProfile(**{**base, **kw})


def trace(rows) -> Trace:
    """rows: (session, round, arrival, input, output, tool_gap)."""
    cols = list(zip(*rows))
    return Trace.from_columns(session=cols[0], round=cols[1], arrival_s=cols[2],
                              input_tokens=cols[3], output_tokens=cols[4], tool_gap_s=cols[5])


def cluster(decode=1, prefill=0, capacity=10**6, **decode_kw) -> ClusterConfig:
    specs = [InstanceSpec(role="decode", count=decode, kv_capacity_tokens=capacity, **decode_kw)]
    if prefill:
        specs.append(InstanceSpec(role="prefill", count=prefill, kv_capacity_tokens=10**6))
    return ClusterConfig(instances=specs)


class Scripted(Policy):
    """Routes from a table session -> (decode, prefill or None)."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def route(self, job, sim):
        d, p = self.table[job.session.sid]
        return Route(decode=d, prefill=p)


# --- the stall of a local prefill --------------------------------------------------------------------


def test_local_prefill_stall_is_charged_to_the_running_request():
    # A: arrives 0, prompt 10, 5 tokens. Its prefill 0-0.1 (first token 0.1), steps end at 0.2
    # and 0.3. B arrives 0.25 (prompt 20): at the step boundary 0.3 its local prefill runs for
    # 0.2 s and A's batch waits. Step 0.5-0.6 gives A its 4th and B its 2nd (last) token; A's
    # last token at 0.7. A's gaps: 0.1, 0.1, 0.3 (0.2 stall + 0.1 step), 0.1.
    res = simulate(trace([(0, 0, 0.0, 10, 5, 0.0), (1, 0, 0.25, 20, 2, 0.0)]), cluster(),
                   profile())
    r = res.rounds
    assert r["first_token_s"] == pytest.approx([0.1, 0.5])
    assert r["done_s"] == pytest.approx([0.7, 0.6])
    assert r["ttft_s"] == pytest.approx([0.1, 0.25])
    assert r["e2e_s"] == pytest.approx([0.7, 0.35])
    assert r["itl_max_s"] == pytest.approx([0.3, 0.1])
    assert r["itl_mean_s"] == pytest.approx([0.15, 0.1])           # (0.7 - 0.1) / 4
    assert r["itl_p90_s"][0] == pytest.approx(0.1 + 0.7 * 0.2)     # gaps .1 .1 .1 .3, h = 2.7
    assert list(r["tokens"]) == [5, 2] and list(r["local"]) == [True, True]
    assert res.instances[0]["stall_s"] == pytest.approx(0.2)


def test_every_running_request_is_stalled_and_a_remote_prefill_stalls_nobody():
    # A and C decode together; B's local prefill (0.2 s) lands in both their token streams
    rows = [(0, 0, 0.0, 10, 5, 0.0), (2, 0, 0.0, 10, 5, 0.0), (1, 0, 0.25, 20, 2, 0.0)]
    local = simulate(trace(rows), cluster(prefill=1), profile(),
                     Scripted({0: (0, None), 2: (0, None), 1: (0, None)})).rounds
    # A and C prefill together (20 tokens, 0-0.2): steps end 0.3, 0.4 (B arrived 0.25, so the
    # boundary at 0.3 runs B's prefill 0.3-0.5), then 0.6, 0.7
    order = np.argsort(local["session"])  # rows are sorted by arrival
    assert local["itl_max_s"][order] == pytest.approx([0.3, 0.1, 0.3])
    # the same with B prefilled on the prefill instance: no stall anywhere
    remote = simulate(trace(rows), cluster(prefill=1), profile(),
                      Scripted({0: (0, None), 2: (0, None), 1: (0, 0)})).rounds
    order = np.argsort(remote["session"])
    # B: first token 0.45, admitted at the boundary 0.5, its KV lands just after it and
    # joins at the next boundary 0.6: its own gap is 0.25, A's and C's are all 0.1
    assert remote["itl_max_s"][order] == pytest.approx([0.1, 0.25, 0.1])
    assert remote["ttft_s"][order][1] == pytest.approx(0.2)        # 20 tokens at 10 ms
    assert list(remote["local"][order]) == [True, False, True]


# --- KV blocks: atomic admission, preemption by recompute ---------------------------------------------


def test_admission_is_atomic_and_waits_for_the_whole_prompt():
    # 4 blocks of 16 tokens. A: prompt 40 (3 blocks), 5 tokens (context 44: still 3 blocks).
    # B (same size) arrives during A's prefill: 1 block free, it needs 3: no partial admission,
    # it waits until A finishes and frees its blocks.
    res = simulate(trace([(0, 0, 0.0, 40, 5, 0.0), (1, 0, 0.05, 40, 5, 0.0)]),
                   cluster(capacity=64), profile())
    r = res.rounds
    assert r["done_s"][0] == pytest.approx(0.4 + 0.4)               # prefill 0.4, 4 steps
    assert r["prefill_start_s"][1] == pytest.approx(r["done_s"][0])
    assert r["wait_local_s"][1] == pytest.approx(0.8 - 0.05)
    assert res.instances[0]["kv_peak_blocks"] == 3 and list(r["preemptions"]) == [0, 0]


def test_preemption_recomputes_the_youngest():
    # 3 blocks. A: prompt 16, 20 tokens, prefilled 0-0.16. B (prompt 16, 20 tokens) arrived at
    # 0.05; at the boundary 0.16 it fits (1 block free beside the 1 A needs for its next step)
    # and is prefilled 0.16-0.32 (A's first step waits). At 0.32 both need a 2nd block (context
    # 16 -> 17) and only 1 is free: B, the most recently admitted, is preempted; A runs its 19
    # steps (done 2.22); then B recomputes prompt + its token (17 tokens, 0.17 s) and decodes.
    res = simulate(trace([(0, 0, 0.0, 16, 20, 0.0), (1, 0, 0.05, 16, 20, 0.0)]),
                   cluster(capacity=48), profile())
    r = res.rounds
    assert list(r["preemptions"]) == [0, 1] and list(r["prefills"]) == [1, 2]
    assert list(r["tokens"]) == [20, 20]                            # none lost, none doubled
    a_done = 0.32 + 19 * 0.1
    assert r["done_s"][0] == pytest.approx(a_done)
    assert r["first_token_s"][1] == pytest.approx(0.32)
    assert r["done_s"][1] == pytest.approx(a_done + 0.17 + 18 * 0.1)
    assert r["itl_max_s"][1] == pytest.approx(a_done + 0.17 - 0.32)  # the preemption's gap
    assert r["wait_resume_s"][1] == pytest.approx(a_done - 0.32)
    assert res.instances[0]["kv_peak_blocks"] == 3 and res.instances[0]["preemptions"] == 1


def test_a_request_larger_than_an_instance_is_refused_before_running():
    with pytest.raises(SimError, match=r"context 100 \+ output 5 tokens exceeds decode0's KV "
                                       r"capacity \(64 tokens\)"):
        simulate(trace([(0, 0, 0.0, 100, 5, 0.0)]), cluster(capacity=64), profile())


def test_a_policy_naming_a_missing_instance_is_an_error():
    with pytest.raises(SimError, match="policy chose decode instance 3; there are 1"):
        simulate(trace([(0, 0, 0.0, 10, 5, 0.0)]), cluster(), profile(), Scripted({0: (3, None)}))


def test_bad_cluster_configs_are_rejected():
    with pytest.raises(ValidationError, match="decode instances only"):
        InstanceSpec(role="prefill", kv_capacity_tokens=100, chunked_prefill_tokens=64)
    with pytest.raises(ValidationError, match="at least one decode instance"):
        ClusterConfig(instances=[InstanceSpec(role="prefill", kv_capacity_tokens=100)])
    with pytest.raises(SimError, match="instance profile 'big' not among the profiles given"):
        Simulator(trace([(0, 0, 0.0, 1, 1, 0.0)]), ClusterConfig(instances=[
            InstanceSpec(role="decode", kv_capacity_tokens=100, profile="big")]), profile(),
            Policy())


# --- multi-round sessions and KV transfer ---------------------------------------------------------


def test_next_round_prefills_only_its_new_tokens_over_the_kept_history():
    # round 0: prompt 10, 3 tokens: prefill 0.1, steps end 0.2, 0.3 -> its KV holds 12 tokens
    # (the last token's KV is never computed). Tool gap 1 s: round 1 arrives 1.3 with 5 new
    # tokens; context 18 = 10 + 3 + 5; the local prefill computes 6 tokens (0.06 s).
    rows = [(0, 0, 0.0, 10, 3, 1.0), (0, 1, 0.0, 5, 2, 0.0)]
    r = simulate(trace(rows), cluster(), profile()).rounds
    assert r["arrival_s"] == pytest.approx([0.0, 1.3])
    assert list(r["prompt_tokens"]) == [10, 18] and list(r["cached_tokens"]) == [0, 12]
    assert r["ttft_s"] == pytest.approx([0.1, 0.06])
    # without KV retention the second round recomputes all 18 tokens
    no_keep = ClusterConfig(instances=cluster().instances, retain_kv_between_rounds=False)
    r = simulate(trace(rows), no_keep, profile()).rounds
    assert list(r["cached_tokens"]) == [0, 0] and r["ttft_s"][1] == pytest.approx(0.18)


def test_remote_incremental_prefill_moves_kv_both_ways():
    # every transfer costs 0.05 s. Round 0 remote: prefill 0-0.1, KV to decode 0.1-0.15, steps
    # end 0.25, 0.35. Round 1 arrives 1.35: history (12 tokens) decode -> prefill 1.35-1.40,
    # prefill of 6 tokens 1.40-1.46 (TTFT 0.11), history + new (18 tokens) back 1.46-1.51,
    # one step: done 1.61.
    rows = [(0, 0, 0.0, 10, 3, 1.0), (0, 1, 0.0, 5, 2, 0.0)]
    res = simulate(trace(rows), cluster(prefill=1), profile(transfer_s0=0.05))
    r = res.rounds
    assert r["ttft_s"] == pytest.approx([0.1, 0.11])
    assert r["done_s"] == pytest.approx([0.35, 1.61])
    assert list(r["cached_tokens"]) == [0, 12] and res.transfers == 3


def test_transfers_queue_fifo_on_one_link():
    # two prompts prefilled in one batch (0-0.2) leave on the same link: the second transfer
    # (0.1 s each) waits 0.1 s for the first
    res = simulate(trace([(0, 0, 0.0, 10, 2, 0.0), (1, 0, 0.0, 10, 2, 0.0)]),
                   cluster(prefill=1), profile(transfer_s0=0.1))
    assert res.link_wait_s == pytest.approx(0.1)
    # first joins at 0.3, steps 0.3-0.4; the second joins at the boundary 0.4, step 0.4-0.5
    assert sorted(res.rounds["done_s"]) == pytest.approx([0.4, 0.5])


def test_chunked_prefill_spreads_the_stall_over_steps():
    # budget 11 tokens per step. A (prompt 10, 6 tokens) alone: one chunk of 10 (0-0.1). B
    # (prompt 20) arrives 0.25: from the boundary 0.3, two hybrid steps each carry A's token
    # and a 10-token chunk of B: 0.1 + 0.1 s each, ending 0.5 and 0.7 (B's first token). A's
    # gaps are 0.2 twice instead of one 0.3.
    res = simulate(trace([(0, 0, 0.0, 10, 6, 0.0), (1, 0, 0.25, 20, 2, 0.0)]),
                   cluster(chunked_prefill_tokens=11), profile())
    r = res.rounds
    assert r["first_token_s"] == pytest.approx([0.1, 0.7])
    assert r["done_s"] == pytest.approx([0.8, 0.8])
    assert r["itl_max_s"] == pytest.approx([0.2, 0.1])


# --- policies: reservations and migration ------------------------------------------------------------


class Reserving(Policy):
    """MAPS-style: reserve prompt + 64 tokens on decode 0; record the reservation it sees."""

    step_hook_every = 1

    def __init__(self):
        super().__init__()
        self.seen = {}

    def route(self, job, sim):
        return Route(decode=0, prefill=0, reserve_tokens=job.prompt + 64)

    def on_first_token(self, job, now):
        self.seen.setdefault("after_prefill", job.decode.pool.reserved)

    def after_step(self, inst, now):
        self.seen.setdefault("after_join", inst.pool.reserved)


def test_reservation_is_released_in_two_stages():
    policy = Reserving()
    res = simulate(trace([(0, 0, 0.0, 40, 30, 0.0)]), cluster(prefill=1), profile(), policy)
    # blocks(40 + 64) = 7 reserved at dispatch; the prompt's 3 released when its KV lands;
    # the other 4 when the request ends (collect() checks nothing is left reserved)
    assert policy.seen == {"after_prefill": 7, "after_join": 4}
    assert res.rounds["tokens"][0] == 30


class MoveOnce(Policy):
    step_hook_every = 4

    def __init__(self):
        super().__init__()
        self.moved = False

    def route(self, job, sim):
        return Route(decode=0)

    def after_step(self, inst, now):
        if not self.moved and inst.index == 0 and inst.step >= 4:
            self.moved = inst.sim.migrate(next(iter(inst.running)), 1)


def test_migration_moves_a_running_sequence_and_its_kv():
    # the hook runs at least every 4 steps: after 4 steps on decode0 the sequence is copied
    # (0.3 s) to decode1 and finishes its 15 remaining steps there
    res = simulate(trace([(0, 0, 0.0, 10, 20, 0.0)]), cluster(decode=2),
                   profile(transfer_s0=0.3), MoveOnce())
    r = res.rounds
    assert list(r["migrations"]) == [1] and list(r["decode_instance"]) == [1]
    assert list(r["tokens"]) == [20]
    assert r["itl_max_s"][0] == pytest.approx(0.3 + 0.1)  # the copy, then a step there
    assert res.instances[0]["steps"] == 4 and res.instances[1]["steps"] == 15


# --- invariants on random workloads ----------------------------------------------------------------


class Views(Policy):
    """Deterministic routing driven by the drawn options; records what it reads of the
    instances, to compare macro steps with single steps through a policy's eyes."""

    def __init__(self, local_every: int, sjf: bool, reserve: bool, late: bool, move: bool):
        super().__init__()
        self.local_every, self.sjf, self.reserve, self.late, self.move = (
            local_every, sjf, reserve, late, move)
        self.step_hook_every = 1 if move else None  # a hook at every step: same in both modes
        self.log = []

    def route(self, job, sim):
        now = sim.now
        self.log.append([(d.free_blocks(now), d.effective_blocks(now), d.context_tokens(now),
                          d.batch_size, d.busy_until(), *d.itl_window(now)) for d in sim.decode])
        d = (job.session.sid + job.round) % len(sim.decode)
        if not sim.prefill or (job.session.sid % self.local_every == 0):
            return Route(decode=d)
        p = job.round % len(sim.prefill)
        if self.late and job.session.sid % 2:
            return Route(decode=None, prefill=p)
        return Route(decode=d, prefill=p, reserve_tokens=job.prompt + 8 if self.reserve else 0)

    def bind_decode(self, job, sim):
        return Route(decode=job.session.sid % len(sim.decode),
                     reserve_tokens=job.prompt + 8 if self.reserve else 0)

    def next_prefill(self, queue, inst, now):
        return min(range(len(queue)), key=lambda i: queue[i].new) if self.sjf else 0

    def next_admission(self, queue, inst, now):
        return min(range(len(queue)), key=lambda i: queue[i].prompt) if self.sjf else 0

    def after_step(self, inst, now):
        if self.move and len(inst.sim.decode) > 1 and inst.step % 5 == 4:
            job = next((j for j in inst.running if not j.migrations), None)  # once each: no
            if job is not None:                                               # ping-pong
                inst.sim.migrate(job, (inst.index + 1) % len(inst.sim.decode))


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 12))
    rows = []
    for s in range(n):
        arrival = draw(st.floats(0, 3))
        for k in range(draw(st.integers(1, 3))):
            rows.append((s, k, arrival, draw(st.integers(1, 60)), draw(st.integers(1, 40)),
                         draw(st.floats(0, 0.5))))
    per_session = {}
    for s, _, _, inp, out, _ in rows:
        per_session[s] = per_session.get(s, 0) + inp + out
    capacity = max(per_session.values()) + 16 * draw(st.integers(1, 6))
    chunk = draw(st.sampled_from([None, 24]))
    spec = dict(decode=draw(st.integers(1, 2)), prefill=draw(st.integers(0, 2)),
                capacity=capacity, chunked_prefill_tokens=chunk,
                max_batch_seqs=draw(st.integers(1, 8)))
    options = dict(local_every=draw(st.integers(1, 3)), sjf=draw(st.booleans()),
                   reserve=draw(st.booleans()), late=draw(st.booleans()),
                   move=draw(st.booleans()))
    return rows, spec, options


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_runs_keep_the_invariants_and_macro_steps_change_nothing(case):
    rows, spec, options = case
    prof = profile(decode_s_per_ctx_token=1e-4, prefill_s_per_token2=1e-5, transfer_s0=0.01)
    results = []
    for macro in (True, False):
        policy = Views(**options)
        res = Simulator(trace(rows), cluster(**spec), prof, policy, macro_steps=macro).run()
        results.append((res, policy.log))
        r = res.rounds
        # every round finished (run() raises otherwise, and on leaked KV, reservations left,
        # or Little's law broken) with exactly its tokens; no KV over capacity; each
        # preemption cost one more prefill
        assert (r["tokens"] == r["output_tokens"]).all()
        assert all(i["kv_peak_blocks"] <= i["kv_capacity_blocks"] for i in res.instances)
        assert (r["prefills"] == 1 + r["preemptions"]).all()
        assert (r["ttft_s"] > 0).all() and (r["e2e_s"] >= r["ttft_s"]).all()
    (a, log_a), (b, log_b) = results
    for key, col in a.rounds.items():
        np.testing.assert_allclose(col, b.rounds[key], rtol=1e-9, atol=1e-9, err_msg=key)
    assert np.allclose(np.array(log_a, dtype=float), np.array(log_b, dtype=float),
                       rtol=1e-9, atol=1e-9, equal_nan=True)
