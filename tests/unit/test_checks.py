"""Data checks: each kind of bad input fails with a message naming the file, column and rule."""

from __future__ import annotations

import logging
from pathlib import Path

import polars as pl
import pytest

from stages.core.checks import (
    ColumnSpec,
    DataValidationError,
    FrameSpec,
    read_parquet_checked,
    spec_from_schema,
    validate_frame,
)

SCHEMA = {"id": pl.String, "label": pl.String, "answer": pl.Int64, "score": pl.Float64}
SPEC = spec_from_schema(
    SCHEMA, id={"unique": True}, label={"values": ["good", "bad"], "max_imbalance": 1.5},
    answer={"min": -100, "max": 100}, score={"min": 0.0, "max": 1.0})


def good_frame(n: int = 20) -> pl.DataFrame:
    return pl.DataFrame({
        "id": [f"r{i}" for i in range(n)],
        "label": ["good" if i % 2 else "bad" for i in range(n)],
        "answer": list(range(n)),
        "score": [i / n for i in range(n)],
    }, schema=SCHEMA)


def write(tmp_path: Path, df: pl.DataFrame, name: str = "data.parquet") -> Path:
    path = tmp_path / name
    df.write_parquet(path)
    return path


def expect_error(path: Path, spec: FrameSpec, rule: str, column: str | None = None) -> str:
    with pytest.raises(DataValidationError) as info:
        read_parquet_checked(path, spec)
    msg = str(info.value)
    assert str(path) in msg, msg
    assert rule in msg, msg
    assert info.value.rule == rule
    assert info.value.source == str(path)
    if column is not None:
        assert f"column {column!r}" in msg, msg
        assert info.value.column == column
    assert isinstance(info.value, ValueError)
    return msg


@pytest.fixture(autouse=True)
def _own_check_cache(tmp_path, monkeypatch):
    """Each test starts with an empty cache of passed validations (GE really runs)."""
    monkeypatch.setenv("PAPERLINE_CHECK_CACHE", str(tmp_path / "check-cache"))


def test_a_passed_validation_is_remembered_by_content_and_rules(tmp_path, caplog):
    first = validate_frame(good_frame(), SPEC, "memory")
    assert first["cached"] is False and "result" in first
    again = validate_frame(good_frame(), SPEC, "memory")
    assert again["cached"] is True and again["evaluated"] == first["evaluated"]
    # the file a producer validated, read back by a consumer: the same content, a hit
    path = write(tmp_path, good_frame())
    with caplog.at_level(logging.INFO, logger="paperline"):
        assert read_parquet_checked(path, SPEC).equals(good_frame())
    assert "same data and rules as a passed validation" in caplog.text
    # one changed value, or one changed rule: GE runs again
    changed = good_frame().with_columns(pl.when(pl.col("id") == "r3").then(7).otherwise(
        pl.col("answer")).alias("answer"))
    assert validate_frame(changed, SPEC, "memory")["cached"] is False
    stricter = spec_from_schema(SCHEMA, id={"unique": True}, answer={"min": 0, "max": 50})
    assert validate_frame(good_frame(), stricter, "memory")["cached"] is False
    # a failure is never remembered: the same bad data fails every time
    bad = good_frame().with_columns(pl.lit(500).cast(pl.Int64).alias("answer"))
    for _ in range(2):
        with pytest.raises(DataValidationError, match="value range"):
            validate_frame(bad, SPEC, "memory")
    assert len(list((tmp_path / "check-cache").iterdir())) == 3


def test_check_cache_off(monkeypatch):
    monkeypatch.setenv("PAPERLINE_CHECK_CACHE", "off")
    for _ in range(2):
        assert validate_frame(good_frame(), SPEC, "memory")["cached"] is False


def test_good_file_passes_and_is_returned(tmp_path, capsys, caplog):
    path = write(tmp_path, good_frame())
    with caplog.at_level(logging.INFO, logger="paperline"):
        df = read_parquet_checked(path, SPEC)
    assert df.equals(good_frame())
    assert "expectations passed on 20 rows" in caplog.text
    out = capsys.readouterr()
    assert "Calculating Metrics" not in out.out + out.err        # GE progress bars are off
    assert not [r for r in caplog.records if r.name.startswith("great_expectations")
                and r.levelno < logging.WARNING]


def test_validate_frame_summary():
    summary = validate_frame(good_frame(), SPEC, "memory")
    assert summary["success"] and summary["rows"] == 20
    assert summary["evaluated"] == 1 + 4 * 2 + 4    # rows; exist/not-null x4; unique, set, 2 ranges
    assert summary["result"]["success"] is True


def test_missing_file(tmp_path):
    expect_error(tmp_path / "nope.parquet", SPEC, "file exists")


def test_directory_instead_of_file(tmp_path):
    (tmp_path / "dir.parquet").mkdir()
    expect_error(tmp_path / "dir.parquet", SPEC, "file exists")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.parquet"
    path.touch()
    assert "0 bytes" in expect_error(path, SPEC, "non-empty file")


def test_truncated_parquet(tmp_path):
    path = write(tmp_path, good_frame(500))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert "truncated or corrupt" in expect_error(path, SPEC, "readable parquet")


def test_not_parquet_at_all(tmp_path):
    path = tmp_path / "text.parquet"
    path.write_text("id,answer\n1,2\n")
    expect_error(path, SPEC, "readable parquet")


def test_missing_column(tmp_path):
    path = write(tmp_path, good_frame().drop("answer"))
    msg = expect_error(path, SPEC, "column exists", "answer")
    assert "columns present: id, label, score" in msg


def test_wrong_dtype(tmp_path):
    path = write(tmp_path, good_frame().with_columns(pl.col("answer").cast(pl.Int32)))
    msg = expect_error(path, SPEC, "dtype", "answer")
    assert "Int32" in msg and "Int64" in msg
    path = write(tmp_path, good_frame().with_columns(pl.col("answer").cast(pl.String)), "s.parquet")
    expect_error(path, SPEC, "dtype", "answer")


def test_null_in_int_column(tmp_path):
    df = good_frame().with_columns(pl.when(pl.col("answer") == 3).then(None)
                                   .otherwise(pl.col("answer")).alias("answer"))
    msg = expect_error(write(tmp_path, df), SPEC, "not null", "answer")
    assert "1 of 20 values" in msg


def test_nan_in_float_column(tmp_path):
    df = good_frame().with_columns(pl.when(pl.col("answer") == 3).then(float("nan"))
                                   .otherwise(pl.col("score")).alias("score"))
    assert df["score"].null_count() == 0                      # NaN, not null, in polars
    expect_error(write(tmp_path, df), SPEC, "not null", "score")


def test_duplicate_key(tmp_path):
    df = good_frame().with_columns(pl.lit("same").alias("id"))
    expect_error(write(tmp_path, df), SPEC, "unique", "id")


def test_value_out_of_range(tmp_path):
    df = good_frame().with_columns((pl.col("score") + 5).alias("score"))
    expect_error(write(tmp_path, df), SPEC, "value range", "score")


def test_value_not_in_set(tmp_path):
    df = good_frame().with_columns(pl.lit("ugly").alias("label"))
    expect_error(write(tmp_path, df), SPEC, "value set", "label")


def test_zero_rows(tmp_path):
    path = write(tmp_path, good_frame().head(0))
    assert "observed 0" in expect_error(path, SPEC, "row count")


def test_label_imbalance(tmp_path):
    df = good_frame().with_columns(
        pl.when(pl.col("answer") < 16).then(pl.lit("good")).otherwise(pl.lit("bad")).alias("label"))
    expect_error(write(tmp_path, df), SPEC, "balance", "label")


def test_distinct_set_names_missing_values():
    spec = FrameSpec({"label": ColumnSpec(dtype=pl.String, distinct=("good", "bad", "meh"))})
    with pytest.raises(DataValidationError, match="values never seen: \\['meh'\\]") as info:
        validate_frame(good_frame(), spec, "mem.parquet")
    assert info.value.rule == "distinct values"


def test_first_reported_failure_is_the_most_basic():
    # nulls turn an int column into float64 in pandas: report 'not null', not 'dtype'
    df = good_frame().with_columns(pl.lit(None, dtype=pl.Int64).alias("answer"))
    with pytest.raises(DataValidationError) as info:
        validate_frame(df, SPEC, "x.parquet")
    assert info.value.rule == "not null"
    assert str(info.value).startswith("x.parquet: data validation failed")
    # ... and only that: the pandas float64 is not reported as a second, spurious 'dtype' rule
    assert "dtype" not in str(info.value) and "float64" not in str(info.value)
    assert "(1 of " in str(info.value)


LIST_SPEC = FrameSpec({"id": ColumnSpec(dtype=pl.String),
                       "scores": ColumnSpec(dtype=pl.List(pl.Float64), min_len=1,
                                            elements=ColumnSpec(dtype=pl.Float64, min=0, max=1))})


@pytest.mark.parametrize("scores, rule", [
    ([[0.5, float("nan")], [1.0]], "not null"),
    ([[0.5, None], [1.0]], "not null"),
    ([[0.5, 1.5], [1.0]], "value range"),
    ([[0.5], []], "list length"),
])
def test_list_values_are_checked_inside(scores, rule):
    df = pl.DataFrame({"id": ["a", "b"], "scores": scores},
                      schema={"id": pl.String, "scores": pl.List(pl.Float64)})
    with pytest.raises(DataValidationError) as info:
        validate_frame(df, LIST_SPEC, "lists.parquet")
    assert info.value.rule == rule and "lists.parquet" in str(info.value)
    assert info.value.column == ("scores" if rule == "list length" else "scores[]")


def test_good_lists_pass():
    df = pl.DataFrame({"id": ["a", "b"], "scores": [[0.5, 0.0], [1.0]]})
    assert validate_frame(df, LIST_SPEC, "lists.parquet")["evaluated"] == 1 + 2 * 2 + 1 + 4


def test_spec_from_schema_rejects_unknown_column():
    with pytest.raises(KeyError, match="not in the schema"):
        spec_from_schema(SCHEMA, nope={"unique": True})


# --- read_json_checked: JSON inputs (budgets, summaries, manifests) at the stage boundary ---

@pytest.mark.parametrize("text, required, kind, rule, column", [
    (None, None, dict, "file exists", None),
    ("", None, dict, "non-empty file", None),
    ('{"a": 1', None, dict, "readable JSON", None),
    ('[1, 2]', None, dict, "top level", None),
    ('{"a": 1}', {"tokens": float}, dict, "required key", "tokens"),
    ('{"tokens": "12"}', {"tokens": float}, dict, "type", "tokens"),
    ('{"tokens": true}', {"tokens": float}, dict, "type", "tokens"),
    ('{"seeds": {"a": 1}}', {"seeds": list}, dict, "type", "seeds"),
])
def test_read_json_checked_names_the_file_key_and_rule(tmp_path, text, required, kind, rule,
                                                      column):
    from stages.core.checks import read_json_checked

    path = tmp_path / "budget.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(DataValidationError) as err:
        read_json_checked(path, required, kind=kind)
    assert err.value.rule == rule and err.value.column == column
    assert str(path) in str(err.value) and f"rule '{rule}'" in str(err.value)


def test_read_json_checked_returns_the_data(tmp_path):
    from stages.core.checks import read_json_checked

    (tmp_path / "a.json").write_text('{"tokens": 12, "name": "x"}')
    assert read_json_checked(tmp_path / "a.json", {"tokens": float, "name": str}) == {
        "tokens": 12, "name": "x"}  # an int is a JSON number: accepted as float
    (tmp_path / "b.json").write_text('[{"condition": "a"}]')
    assert read_json_checked(tmp_path / "b.json", kind=list) == [{"condition": "a"}]


def test_read_array_checked_names_each_defect(tmp_path):
    import numpy as np

    from stages.core.checks import read_array_checked

    good = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.save(tmp_path / "good.npy", good)
    assert (read_array_checked(tmp_path / "good.npy", ndim=2, rows=4) == good).all()
    raw = (tmp_path / "good.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "empty.npy").write_bytes(b"")
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(tmp_path / "flat.npy", good.ravel())
    np.save(tmp_path / "ints.npy", good.astype(np.int64))
    nan = good.copy()
    nan[1, 2] = np.nan
    np.save(tmp_path / "nan.npy", nan)
    cases = {"missing.npy": ("file exists", {}), "empty.npy": ("non-empty file", {}),
             "cut.npy": ("readable npy", {}), "obj.npy": ("readable npy", {}),
             "flat.npy": ("ndim", {}), "ints.npy": ("dtype", {}), "nan.npy": ("finite", {}),
             "good.npy": ("row count", {"rows": 5})}
    for name, (rule, extra) in cases.items():
        with pytest.raises(DataValidationError) as err:
            read_array_checked(tmp_path / name, **{"ndim": 2, **extra})
        assert err.value.rule == rule and name in str(err.value), (name, str(err.value))
