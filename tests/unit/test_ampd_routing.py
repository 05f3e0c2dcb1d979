"""AMPD online coordinator on hand-made states: the local-vs-remote prefill rule (each branch),
the stall charged to co-running decodes, prefill reordering with lookahead and its overtake
bound, and the KV transfer time."""

from __future__ import annotations

import random

import pytest

from stages.ampd.routing import (LocalOption, PrefillTask, RemoteOption, best_remote, kv_transfer_s,
                                 pick_next, pop_next, route_prefill, slack_s, stall_violations)

SLO = dict(slo_ttft_s=2.0, slo_itl_s=0.05)   # α = β = 0.8: TTFT window ≤ 1.6 s, ITL ≤ 0.04 s

# p0 must first receive the history KV (0.1 s); p1 still holds it. est: p0 1.0 s, p1 0.5 s.
P0 = RemoteOption(wait_s=0.5, prefill_s=0.3, kv_in_s=0.1, kv_out_s=0.1, window_ttft_s=1.0)
P1 = RemoteOption(wait_s=0.0, prefill_s=0.4, kv_in_s=0.0, kv_out_s=0.1, window_ttft_s=1.2)
# d: local est 0.02 + 0.3 = 0.32 s; amortised ITL 0.03 + 0.3/100 = 0.033 ≤ 0.04
LOCAL = LocalOption(residual_iter_s=0.02, prefill_s=0.3, window_itl_s=0.03, tokens_in_window=100,
                    itl_slack_s=(0.5, 0.1, 0.2))


def test_remote_when_the_prefill_side_is_not_busy():
    assert best_remote([P0, P1]) == 1
    r = route_prefill([P0, P1], LOCAL, **SLO)
    assert (r.where, r.prefill_worker, r.rule) == ("remote", 1, "prefill_free")
    assert r.est_ttft_s == pytest.approx(0.5)


def test_local_when_prefill_is_busy_and_decode_has_itl_slack():
    busy = RemoteOption(wait_s=0.0, prefill_s=0.4, kv_in_s=0.0, kv_out_s=0.1, window_ttft_s=1.9)
    r = route_prefill([busy], LOCAL, **SLO)
    assert (r.where, r.rule) == ("local", "decode_slack") and r.est_ttft_s == pytest.approx(0.32)


def test_both_busy_counts_expected_violations_including_the_stall_on_co_running_decodes():
    late = RemoteOption(wait_s=2.0, prefill_s=0.4, kv_in_s=0.0, kv_out_s=0.1, window_ttft_s=1.9)
    hot = LocalOption(residual_iter_s=0.02, prefill_s=0.3, window_itl_s=0.045,
                      tokens_in_window=100, itl_slack_s=(0.5, 0.1, 0.2))
    # the 0.3 s stall breaks the two requests with 0.1 and 0.2 s of ITL slack
    assert stall_violations(hot) == 2
    r = route_prefill([late], hot, **SLO)           # remote: 1 (TTFT 2.5 > 2); local: 0 + 2
    assert (r.where, r.rule) == ("remote", "fewer_violations")
    calm = LocalOption(**{**hot.__dict__, "itl_slack_s": (0.5,)})
    r = route_prefill([late], calm, **SLO)          # local: 0 + 0 < remote 1
    assert (r.where, r.rule) == ("local", "fewer_violations")


def test_equal_violations_go_to_the_faster_option():
    # remote meets TTFT but its window is busy (1.9 > 1.6); local meets TTFT, ITL window is hot,
    # no co-running request breaks: 0 vs 0 violations -> the smaller estimate (local 0.32 s)
    busy = RemoteOption(wait_s=0.0, prefill_s=0.4, kv_in_s=0.0, kv_out_s=0.1, window_ttft_s=1.9)
    hot = LocalOption(residual_iter_s=0.02, prefill_s=0.3, window_itl_s=0.045,
                      tokens_in_window=100)
    assert route_prefill([busy], hot, **SLO).where == "local"
    slow_local = LocalOption(residual_iter_s=0.02, prefill_s=0.9, window_itl_s=0.045,
                             tokens_in_window=100)
    assert route_prefill([busy], slow_local, **SLO).where == "remote"


def test_only_one_side_available():
    assert route_prefill([], LOCAL, **SLO).rule == "only_local"          # colocated
    r = route_prefill([P0, P1], None, **SLO)                             # Dynamo-like
    assert (r.where, r.prefill_worker, r.rule) == ("remote", 1, "only_remote")
    with pytest.raises(ValueError, match="neither"):
        route_prefill([], None, **SLO)
    with pytest.raises(ValueError, match="must be > 0"):
        route_prefill([P0], LOCAL, slo_ttft_s=0.0, slo_itl_s=0.05)


# --- reordering ------------------------------------------------------------------------------

def test_slack_hand_values():
    # (8.5 + 2 - 10) - 0.25 - 0.125 = 0.125
    assert slack_s(PrefillTask("a", 8.5, 0.25, 0.125), now_s=10.0, slo_ttft_s=2.0) == 0.125


def test_pick_the_smallest_non_negative_slack_within_the_window():
    a = PrefillTask("a", 8.5, 0.25, 0.25)    # slack 0.0 (exact in binary)
    b = PrefillTask("b", 9.0, 0.5)           # slack 0.5
    c = PrefillTask("c", 9.5, 1.0, 0.2)      # slack 0.3
    d = PrefillTask("d", 9.9, 0.1)           # slack 1.8, outside a window of 3
    assert pick_next([a, b, c, d], 10.0, 2.0) == 0
    late_a = PrefillTask("a", 8.5, 0.6, 0.1)                    # slack -0.2: cannot make it
    assert pick_next([late_a, b, c, d], 10.0, 2.0) == 2         # c (0.3) before b (0.5)
    assert pick_next([late_a, b, c, d], 10.0, 2.0, lookahead=2) == 1
    assert pick_next([late_a, b, c, d], 10.0, 2.0, lookahead=1) == 0   # w = 1: FIFO
    hopeless = [PrefillTask(i, 0.0, 1.0) for i in range(3)]
    assert pick_next(hopeless, 10.0, 2.0) == 0                  # all negative: the FIFO head


def test_pop_next_counts_overtakes_and_a_task_is_passed_at_most_w_minus_1_times():
    """A head that can no longer meet its SLO is passed by newcomers that can, but only twice
    with w = 3; then it runs."""
    queue = [PrefillTask("old", 0.0, 1.0)] + [PrefillTask(f"n{i}", 9.9, 0.1) for i in range(2)]
    ran = []
    for step in range(4):
        task, queue = pop_next(queue, 10.0, 2.0, lookahead=3)
        ran.append((task.id, task.overtaken))
        queue.append(PrefillTask(f"m{step}", 9.9, 0.1))
    assert ran == [("n0", 0), ("n1", 0), ("old", 2), ("m0", 0)]
    assert [t.overtaken for t in queue] == [0, 0, 0]


def test_overtake_bound_holds_on_a_random_single_server_run():
    rng = random.Random(0)
    w, now, queue, served = 3, 0.0, [], []
    arrivals = sorted(rng.uniform(0, 60) for _ in range(300))
    i = 0
    while i < len(arrivals) or queue:
        if not queue:
            now = max(now, arrivals[i])
        while i < len(arrivals) and arrivals[i] <= now:
            queue.append(PrefillTask(i, arrivals[i], rng.expovariate(1 / 0.2)))
            i += 1
        task, queue = pop_next(queue, now, 1.0, lookahead=w)
        served.append(task)
        now += task.prefill_s
    assert len(served) == 300 and len({t.id for t in served}) == 300
    assert max(t.overtaken for t in served) <= w - 1
    assert max(t.overtaken for t in served) >= 1          # the run did reorder


def test_kv_transfer_time():
    # 1000 tokens x 800 kB at 25 GB/s = 0.032 s, + 2 ms fixed
    assert kv_transfer_s(1000, 800e3, 25e9, 0.002) == pytest.approx(0.034)
    assert kv_transfer_s(0, 800e3, 25e9, 0.002) == 0.0
    with pytest.raises(ValueError):
        kv_transfer_s(10, 1.0, 0.0)
