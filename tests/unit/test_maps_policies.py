"""The MAPS arms as simulator policies: Algorithm 1's reservation, SJF with its guard, migration."""

from __future__ import annotations

import numpy as np
import pytest

from stages.maps.policies import ARMS, Maps, RoundRobin, make_policy
from stages.serving.latency import load_profile
from stages.serving.sim import ClusterConfig, InstanceSpec, Job, Session, Simulator, simulate
from stages.serving.workload import make_trace, sharegpt_like

A100 = load_profile("a100")
CLUSTER = ClusterConfig(instances=[InstanceSpec(role="prefill", kv_capacity_tokens=40_000),
                                   InstanceSpec(role="decode", kv_capacity_tokens=40_000),
                                   InstanceSpec(role="decode", kv_capacity_tokens=25_000)])


def _job(sid: int, prompt: int, out: int) -> Job:
    job = Job(sid, Session(sid, [sid]), 0, prompt, out, True)
    job.prompt = prompt
    return job


def test_maps_reserves_b_need_on_the_shortest_feasible_queue():
    trace = make_trace(sharegpt_like(4, 1.0), 0)
    pred = np.array([100.0, 200.0, 300.0, 400.0])
    policy = Maps(2, pred, calibration=np.full(20, 30.0), window=20)   # q_alpha = 30
    sim = Simulator(trace, CLUSTER, A100, policy)
    policy.outstanding = [3, 1]
    route = policy.choose(_job(1, 100, 999), sim)
    # B_need = ceil((100 + 200 + 30) / 16) = 21 blocks, on decoder 1 (shorter queue, it fits)
    assert route.decode == 1 and route.reserve_tokens == 21 * 16
    assert policy.upper[1] == 230.0
    # MC routing: the decoder with the most effective blocks instead
    mc = Maps(2, pred, calibration=np.full(20, 30.0), window=20, routing="mc")
    mc.outstanding = [3, 1]
    assert mc.choose(_job(1, 100, 999), Simulator(trace, CLUSTER, A100, mc)).decode == 0
    # without UAC the bound is the point prediction
    bare = Maps(2, pred, uac=False)
    bare.choose(_job(2, 10, 999), Simulator(trace, CLUSTER, A100, bare))
    assert bare.upper[2] == 300.0


def test_sjf_admits_shortest_bound_unless_one_waited_too_long():
    policy = Maps(2, np.zeros(3), uac=False, max_wait_s=1.0)
    jobs = [_job(i, 10, 10) for i in range(3)]
    policy.upper[:] = [500.0, 50.0, 200.0]
    for j, t in zip(jobs, (0.0, 0.2, 0.4)):
        j.t_queued = t
    assert policy.next_admission(jobs, None, now=0.5) == 1          # shortest L̂_up
    assert policy.next_admission(jobs, None, now=1.5) == 0          # waited > 1 s: promoted
    fcfs = Maps(2, np.zeros(3), uac=False, order="fcfs")
    assert fcfs.next_admission(jobs, None, now=0.5) == 0


def test_online_uac_learns_from_finished_requests():
    trace = make_trace(sharegpt_like(300, 12.0), 1)
    true = trace.output_tokens.astype(float)
    policy = Maps(2, true * 0.5, calibration=np.zeros(50), window=50)  # starts over-confident
    res = simulate(trace, CLUSTER, A100, policy)
    cov_late = np.mean(true[150:] <= policy.upper[150:])
    assert policy.uac.q > 0 and cov_late > 0.7                         # the window caught up
    assert not np.isnan(policy.upper).any()
    assert res.rounds["e2e_s"].size == 300


def test_llumnix_migrates_only_and_every_arm_runs_within_capacity():
    trace = make_trace(sharegpt_like(400, 14.0), 2)
    true = trace.output_tokens.astype(float)
    for arm in ARMS:
        policy = make_policy(arm, 2, pred=true * 1.1, pred_weak=true * 0.9, true=true,
                             calibration=np.zeros(20), calibration_weak=np.zeros(20), alpha=0.1,
                             window=20, max_wait_s=1.0, block_tokens=16,
                             migrate_threshold=0.9, migrate_every=4)
        res = simulate(trace, CLUSTER, A100, policy)
        for inst in res.instances:
            assert inst["kv_peak_blocks"] <= inst["kv_capacity_blocks"]
        migrated = int(res.rounds["migrations"].sum())
        assert (migrated > 0) == (arm == "llumnix"), (arm, migrated)
    rr = simulate(trace, CLUSTER, A100, RoundRobin(2))
    assert abs(np.mean(rr.rounds["decode_instance"] == 0) - 0.5) < 0.01
    with pytest.raises(ValueError, match="unknown arm"):
        make_policy("mapz", 2, pred=true, pred_weak=None, true=true, calibration=true,
                    calibration_weak=None, alpha=0.1, window=20, max_wait_s=1.0,
                    block_tokens=16, migrate_threshold=0.9, migrate_every=4)


def test_one_token_requests_end_at_the_prefill_without_dispatch():
    """A request of one output token is done when its prefill emits that token: no decoder is
    ever bound (the real predictor's workload has such requests)."""
    from stages.serving.workload import Trace

    base = make_trace(sharegpt_like(60, 8.0), 3)
    out = base.output_tokens.copy()
    out[::3] = 1
    trace = Trace.from_columns(session=base.session, round=base.round, arrival_s=base.arrival_s,
                               input_tokens=base.input_tokens, output_tokens=out,
                               tool_gap_s=base.tool_gap_s)
    true = out.astype(float)
    for arm in ("round_robin", "least_request", "llumnix", "maps", "oracle"):
        policy = make_policy(arm, 2, pred=true, pred_weak=None, true=true,
                             calibration=np.zeros(20), calibration_weak=None, alpha=0.1,
                             window=20, max_wait_s=1.0, block_tokens=16,
                             migrate_threshold=0.9, migrate_every=4)
        res = simulate(trace, CLUSTER, A100, policy)
        assert (res.rounds["decode_instance"][out == 1] == -1).all()
        assert policy.outstanding == [0, 0]
