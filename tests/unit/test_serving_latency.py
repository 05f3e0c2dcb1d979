"""stages/serving/latency.py: the latency equations on hand-computed values, the shipped A100
profiles, and profile files that must be refused with the file and the field named."""

from __future__ import annotations

import json

import pytest

from stages.serving.latency import LatencyProfile, ProfileError, load_profile, save_profile

FIELDS = dict(name="t", source="unit test", prefill_s0=0.01, prefill_s_per_token=1e-4,
              prefill_s_per_token2=1e-8, decode_s0=0.02, decode_s_per_seq=1e-4,
              decode_s_per_ctx_token=1e-6, kv_bytes_per_token=1000, kv_block_tokens=16,
              transfer_s0=0.001, link_bytes_per_s=1e9)


def test_equations_by_hand():
    p = LatencyProfile(**FIELDS)
    # prefill 1000 tokens: 0.01 + 1e-4 * 1000 + 1e-8 * 1000^2 = 0.12
    assert p.prefill_time(1000) == pytest.approx(0.12)
    # a batch of 1000 and 500: 0.01 + 1e-4 * 1500 + 1e-8 * (1e6 + 2.5e5) = 0.1725
    assert p.prefill_batch_time([1000, 500], [0, 0]) == pytest.approx(0.1725)
    # decode step, 8 sequences holding 4000 tokens: 0.02 + 8e-4 + 4e-3 = 0.0248
    assert p.decode_step_time(8, 4000) == pytest.approx(0.0248)
    # KV of 2000 tokens: 0.001 + 2e6 / 1e9 = 0.003
    assert p.kv_transfer_time(2000) == pytest.approx(0.003)
    assert p.blocks(16) == 1 and p.blocks(17) == 2


def test_incremental_prefill_costs_the_full_prefill_minus_the_history():
    # l new tokens over h cached: s0 + a l + b (l^2 + 2 l h) = T(l + h) - T(h) + s0
    p = LatencyProfile(**FIELDS)
    for new, hist in ((400, 1500), (1, 0), (64, 4096)):
        assert p.prefill_time(new, hist) == pytest.approx(
            p.prefill_time(new + hist) - p.prefill_time(hist) + p.prefill_s0)


def test_shipped_a100_profiles_carry_distserve_constants_and_their_source(tmp_path):
    p = load_profile("a100")
    # DistServe's OPT-13B TP1 prefill (16.46 ms, 0.0926 ms/token, 6.47e-6 ms/token^2)
    assert p.prefill_s0 == pytest.approx(16.456860e-3)
    assert p.prefill_s_per_token == pytest.approx(0.0926475e-3)
    assert p.prefill_s_per_token2 == pytest.approx(6.474786e-9)
    assert p.kv_bytes_per_token == 2 * 40 * 5120 * 2
    assert "DistServe" in p.source and "2401.09670" in p.source and "[reconstructed]" in p.source
    # a 1500-token prompt on an A100: about 0.17 s; a decode step of 32 x 1500: about 51 ms
    assert p.prefill_time(1500) == pytest.approx(0.170, abs=0.001)
    assert p.decode_step_time(32, 32 * 1500) == pytest.approx(0.0513, abs=0.0005)
    tp4 = load_profile("a100_tp4")
    assert tp4.prefill_time(1500) < load_profile("a100_tp2").prefill_time(1500) < p.prefill_time(1500)
    # round trip through a file, atomically written
    path = save_profile(p, tmp_path / "copy.json")
    assert load_profile(path) == p


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(decode_s0=-0.5), "decode_s0: Input should be greater than or equal to 0"),
    (lambda d: d.pop("link_bytes_per_s"), "link_bytes_per_s: Field required"),
    (lambda d: d.update(prefil_s0=0.1), "prefil_s0: Extra inputs are not permitted"),
    (lambda d: d.update(prefill_s_per_token=float("nan")), "prefill_s_per_token"),
    (lambda d: d.update(kv_block_tokens=0), "kv_block_tokens: Input should be greater than 0"),
])
def test_bad_profile_fields_are_named_with_the_file(tmp_path, edit, message):
    data = dict(FIELDS)
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message) as err:
        load_profile(path)
    assert str(path) in str(err.value)


def test_malformed_or_missing_profile_files(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"name": "x", ')
    with pytest.raises(ProfileError, match=rf"{bad}: not valid JSON"):
        load_profile(bad)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="expected a JSON object of profile fields, got list"):
        load_profile(listed)
    with pytest.raises(ProfileError, match="no such latency profile file"):
        load_profile(tmp_path / "absent.json")
    with pytest.raises(ProfileError, match="no shipped latency profile 'h100'; shipped: a100"):
        load_profile("h100")
