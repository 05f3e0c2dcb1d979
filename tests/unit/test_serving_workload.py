"""stages/serving/workload.py: seeded generation with common random numbers, the shapes the
papers ask for, and trace files that are refused with a named error (file, column, rule)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from pydantic import ValidationError

from stages.core.checks import DataValidationError
from stages.serving.workload import (LengthDist, Trace, WorkloadConfig, agentic_sessions,
                                     make_trace, read_trace, sharegpt_like, write_trace)


def test_same_seed_same_trace_and_a_rate_only_rescales_time():
    cfg = agentic_sessions(200, rate=1.0)
    a, b = make_trace(cfg, seed=3), make_trace(cfg, seed=3)
    for col in ("session", "round", "arrival_s", "input_tokens", "output_tokens", "tool_gap_s"):
        np.testing.assert_array_equal(getattr(a, col), getattr(b, col))
    fast = make_trace(cfg.model_copy(update={"rate": 4.0}), seed=3)
    np.testing.assert_array_equal(fast.input_tokens, a.input_tokens)
    np.testing.assert_array_equal(fast.output_tokens, a.output_tokens)
    np.testing.assert_allclose(fast.arrival_s, a.arrival_s / 4)
    other = make_trace(cfg, seed=4)
    assert not np.array_equal(other.input_tokens, a.input_tokens)


def test_agentic_sessions_have_the_shape_ampd_evaluates():
    t = make_trace(agentic_sessions(2000, rate=2.0), seed=0)
    rounds = np.bincount(t.session)
    assert rounds.min() == 3 and rounds.max() == 8
    first, later = t.round == 0, t.round > 0
    assert np.median(t.input_tokens[first]) == pytest.approx(1500, rel=0.05)
    assert np.median(t.input_tokens[later]) == pytest.approx(400, rel=0.08)
    assert t.input_tokens[later].max() <= 4096
    assert t.output_tokens.min() >= 50 and t.output_tokens.max() <= 300
    last = np.r_[t.session[1:] != t.session[:-1], True]
    assert (t.tool_gap_s[last] == 0).all()
    assert t.tool_gap_s[~last].mean() == pytest.approx(1.0, rel=0.05)
    gaps = np.diff(np.unique(t.arrival_s))
    assert gaps.mean() == pytest.approx(0.5, rel=0.06)


def test_bursty_arrivals_have_the_requested_cv():
    cfg = sharegpt_like(20_000, rate=10.0, bursty_cv=3.0)
    gaps = np.diff(make_trace(cfg, seed=1).arrival_s)
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.1)
    poisson = np.diff(make_trace(sharegpt_like(20_000, rate=10.0), seed=1).arrival_s)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)


def test_sharegpt_like_pairs_are_correlated_and_clipped():
    t = make_trace(sharegpt_like(20_000, rate=1.0), seed=2)
    assert t.input_tokens.mean() == pytest.approx(165, rel=0.1)
    assert t.output_tokens.mean() == pytest.approx(340, rel=0.1)
    assert 4 <= t.input_tokens.min() and t.output_tokens.max() <= 2048
    r = np.corrcoef(np.log(t.input_tokens), np.log(t.output_tokens))[0, 1]
    assert 0.1 < r < 0.3


def test_bad_workload_configs_are_rejected():
    with pytest.raises(ValidationError, match="cv = 3.0 is for arrival: gamma"):
        WorkloadConfig(cv=3.0)
    with pytest.raises(ValidationError, match="rounds_max = 2 < rounds_min = 3"):
        WorkloadConfig(rounds_min=3, rounds_max=2)
    with pytest.raises(ValidationError, match="max = 5 < min = 10"):
        LengthDist(min=10, max=5)


def _rows(**override):
    cols = dict(session=[0, 0, 1], round=[0, 1, 0], arrival_s=[0.0, 0.0, 0.5],
                input_tokens=[100, 20, 50], output_tokens=[10, 5, 8], tool_gap_s=[1.0, 0.0, 0.0])
    cols.update(override)
    return cols


def test_trace_rules_name_the_column_and_rule():
    Trace.from_columns(**_rows())
    cases = [
        (dict(round=[0, 2, 0]), "column 'round': rule 'rounds 0..R-1 once each per session'"),
        (dict(arrival_s=[0.0, 0.1, 0.5]), "column 'arrival_s': rule 'one arrival per session'"),
        (dict(output_tokens=[10, 0, 8]), "column 'output_tokens': rule '>= 1 token'"),
        (dict(tool_gap_s=[1.0, float("nan"), 0.0]), "column 'tool_gap_s': rule 'finite and >= 0'"),
    ]
    for override, message in cases:
        with pytest.raises(DataValidationError, match=message):
            Trace.from_columns(source="t.parquet", **_rows(**override))


def test_trace_file_round_trip_and_malformed_files(tmp_path):
    t = make_trace(agentic_sessions(20, rate=1.0), seed=0)
    path = write_trace(t, tmp_path / "trace.parquet")
    back = read_trace(path)
    np.testing.assert_array_equal(back.arrival_s, t.arrival_s)
    np.testing.assert_array_equal(back.input_tokens, t.input_tokens)
    # a missing column and a wrong dtype are refused before the rows are read
    df = t.to_polars()
    df.drop("output_tokens").write_parquet(tmp_path / "missing.parquet")
    with pytest.raises(DataValidationError, match="output_tokens") as err:
        read_trace(tmp_path / "missing.parquet")
    assert "missing.parquet" in str(err.value)
    df.with_columns(pl.col("round").cast(pl.Float64)).write_parquet(tmp_path / "dtype.parquet")
    with pytest.raises(DataValidationError, match="round"):
        read_trace(tmp_path / "dtype.parquet")
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(DataValidationError, match="empty.parquet: rule 'non-empty file'"):
        read_trace(tmp_path / "empty.parquet")
