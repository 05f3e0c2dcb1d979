"""Inputs the compare/correlate stages read go through the checked loader: a corrupt, truncated
or NaN-holding file is a DataValidationError naming the file and the rule, not a traceback."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest

from stages.core.checks import DataValidationError
from stages.edco.compare import _load_arm
from stages.trace.compare import final_acc_by_seed

CURVE = pl.DataFrame({"seed": [0, 0], "round": [0, 1], "acc": [0.2, 0.3],
                      "noisy_frac": [float("nan"), 0.1], "new_items": [None, 5.0]})


def _arm(tmp_path: Path, frame: pl.DataFrame | None, raw: bytes | None = None) -> Path:
    folder = tmp_path / "arm"
    folder.mkdir()
    (folder / "budget.json").write_text("{}")
    if raw is not None:
        (folder / "curve.parquet").write_bytes(raw)
    else:
        frame.write_parquet(folder / "curve.parquet")
    return folder


def test_edco_curve_reads_with_round_zero_nans(tmp_path: Path):
    frame, budget = _load_arm(_arm(tmp_path, CURVE), "sft_edco")
    assert frame.height == 2 and budget == {}


@pytest.mark.parametrize("frame, raw, rule", [
    (CURVE.with_columns(pl.lit(float("nan")).alias("acc")), None, "not null"),
    (CURVE.with_columns(pl.lit(1.5).alias("acc")), None, "acc"),
    (CURVE.drop("acc"), None, "acc"),
    (None, b"PAR1 truncated", "readable parquet"),
])
def test_edco_curve_defects_are_named(tmp_path: Path, frame, raw, rule):
    with pytest.raises(DataValidationError, match=rule) as err:
        _load_arm(_arm(tmp_path, frame, raw), "sft_edco")
    assert "curve.parquet" in str(err.value)


def test_trace_finals_defects_are_named(tmp_path: Path):
    ctx = SimpleNamespace(path=lambda name: tmp_path)
    (tmp_path / "rl_acc").mkdir()
    pl.DataFrame({"seed": [0, 1], "final_acc": [0.5, 0.6]}).write_parquet(
        tmp_path / "rl_acc" / "finals.parquet")
    assert final_acc_by_seed(ctx, "runs", "rl_acc") == {0: 0.5, 1: 0.6}
    pl.DataFrame({"seed": [0, 0], "final_acc": [0.5, float("nan")]}).write_parquet(
        tmp_path / "rl_acc" / "finals.parquet")
    with pytest.raises(DataValidationError, match="finals.parquet") as err:
        final_acc_by_seed(ctx, "runs", "rl_acc")
    assert "unique" in str(err.value) and "not null" in str(err.value)
