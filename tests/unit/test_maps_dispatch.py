"""MAPS Algorithm 1 (memory-aware dispatch, MQ and MC routing, fallback, round-robin without a
prediction), the atomic reservation with staged release, and the decoder-local SJF queue with its
max-wait guard, on hand-made cluster states."""

from __future__ import annotations

import math

import pytest

from stages.maps.dispatch import (DecoderState, Queued, blocks_needed, least_request,
                                  make_reservation, maps_dispatch, most_free_memory, next_request,
                                  release, reserve, round_robin)

# Decoder 0: big and busy; decoder 1: small and idle; decoder 2: medium, one request queued.
CLUSTER = [DecoderState(free_blocks=2500, reserved_blocks=500, queue_len=6),   # B_eff 2000
           DecoderState(free_blocks=120, reserved_blocks=20, queue_len=0),     # B_eff 100
           DecoderState(free_blocks=900, reserved_blocks=100, queue_len=1)]    # B_eff 800


def test_blocks_needed_is_the_ceiling_over_block_size():
    assert blocks_needed(100, 60, 16) == 10          # 160 / 16
    assert blocks_needed(100, 61, 16) == 11          # 161 / 16 -> 11 blocks
    assert blocks_needed(0, 0.5, 16) == 1
    with pytest.raises(ValueError, match="infinite"):
        blocks_needed(100, math.inf)


def test_mq_picks_the_shortest_queue_among_decoders_the_request_fits():
    # 1000 + 580 tokens = 99 blocks of 16 -> fits all three; shortest queue: decoder 1
    d = maps_dispatch(CLUSTER, 1000, 580.0, block_tokens=16)
    assert (d.decoder, d.blocks, d.rule) == (1, 99, "mq")
    # 1000 + 700 -> 107 blocks: decoder 1 (B_eff 100) no longer fits -> decoder 2 (queue 1)
    d = maps_dispatch(CLUSTER, 1000, 700.0, block_tokens=16)
    assert (d.decoder, d.blocks, d.rule) == (2, 107, "mq")
    # 20000 tokens -> 1250 blocks: only decoder 0 fits, busy as it is
    assert maps_dispatch(CLUSTER, 15000, 5000.0).decoder == 0


def test_mc_picks_the_most_effective_memory_among_feasible():
    d = maps_dispatch(CLUSTER, 1000, 580.0, routing="mc")
    assert (d.decoder, d.rule) == (0, "mc")


def test_the_upper_bound_changes_the_choice_against_the_point_prediction():
    # without UAC (L̂ = 580) the small idle decoder looks fine; with L̂_up = 580 + 120 it does not
    assert maps_dispatch(CLUSTER, 1000, 580.0).decoder == 1
    assert maps_dispatch(CLUSTER, 1000, 580.0 + 120.0).decoder == 2


def test_fallback_when_no_decoder_fits_and_round_robin_without_a_prediction():
    d = maps_dispatch(CLUSTER, 40000, 1000.0)        # 2563 blocks > every B_eff
    assert (d.decoder, d.rule) == (0, "fallback")    # argmax B_eff
    for counter, want in [(0, 0), (1, 1), (5, 2)]:
        d = maps_dispatch(CLUSTER, 1000, None, rr_counter=counter)
        assert (d.decoder, d.blocks, d.rule) == (want, None, "round_robin")
    assert maps_dispatch(CLUSTER, 1000, math.inf, rr_counter=4).rule == "round_robin"
    with pytest.raises(ValueError, match="routing"):
        maps_dispatch(CLUSTER, 10, 10.0, routing="random")


def test_ties_are_broken_by_memory_then_index():
    twins = [DecoderState(100, 0, 2), DecoderState(300, 0, 2), DecoderState(300, 0, 2)]
    assert maps_dispatch(twins, 16, 16.0).decoder == 1          # equal Q: more B_eff, lower index
    assert maps_dispatch(twins, 16, 16.0, routing="mc").decoder == 1


def test_baseline_rules():
    assert round_robin(3, 7) == 1
    assert least_request(CLUSTER) == 1
    assert most_free_memory(CLUSTER) == 0


def test_reservation_is_refused_beyond_capacity_and_released_in_stages():
    r = make_reservation(prompt_tokens=100, output_tokens=61, block_tokens=16)
    assert (r.prompt_blocks, r.output_blocks, r.blocks) == (7, 4, 11)
    state = DecoderState(free_blocks=20, reserved_blocks=5, queue_len=0)   # B_eff 15
    state = reserve(state, r.blocks)
    assert (state.reserved_blocks, state.effective_blocks, state.queue_len) == (16, 4, 1)
    with pytest.raises(ValueError, match="overbooks"):
        reserve(state, 5)                            # a second dispatch cannot overbook it
    state = release(state, r.prompt_blocks)          # KV transfer landed
    assert (state.reserved_blocks, state.queue_len) == (9, 1)
    state = release(state, r.output_blocks, finished=True)
    assert (state.reserved_blocks, state.queue_len) == (5, 0)
    with pytest.raises(ValueError, match="reserved"):
        release(state, 6)


def test_sjf_serves_the_smallest_bound_unless_someone_waited_past_max_wait():
    queue = [Queued(enqueued_s=0.0, upper_tokens=900), Queued(0.2, 50), Queued(0.3, 20)]
    assert next_request(queue, now_s=0.5) == 2                   # SJF: 20 tokens
    assert next_request(queue, now_s=1.2) == 0                   # the 900-token one waited 1.2 s
    assert next_request(queue, now_s=1.2, max_wait_s=5.0) == 2   # a longer guard: SJF again
    assert next_request(queue, now_s=0.5, order="fcfs") == 0
    with pytest.raises(ValueError, match="empty"):
        next_request([], 0.0)
