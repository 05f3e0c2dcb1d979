"""The `tasks` stage: config messages, the written splits, determinism, atomic output."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from stages.core.checks import DataValidationError, read_parquet_checked
from stages.core.config import ParamsError, validate_section
from stages.core.context import Context
from stages.tasks import arith, build

SMOKE = {"n_train": 200, "n_val": 50, "n_test": 100}


def make_ctx(root: Path, seed: int = 0) -> Context:
    return Context(root=root, pipeline="base", stage="tasks", pipeline_dir=root, profile="smoke",
                   seed=seed, paths={"tasks": root / "data" / "tasks", "metrics": root / "metrics"})


def read_splits(root: Path) -> dict[str, pl.DataFrame]:
    folder = root / "data" / "tasks" / "arith"
    return {s: pl.read_parquet(folder / f"{s}.parquet") for s in ("train", "val", "test")}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict[str, float]]:
    root = tmp_path_factory.mktemp("tasks")
    metrics = build.run(build.Config(**SMOKE), make_ctx(root))
    return root, metrics


# --- config ---------------------------------------------------------------------------------------

def section(values: dict) -> build.Config:
    return validate_section(build.Config, {"tasks": values}, "tasks", "smoke", "params.yaml")


def test_config_defaults_and_nested_family_settings():
    cfg = section({"families": ["arith"], "arith": {"max_operands": 3, "operators": "-+"}})
    assert cfg.arith.max_operands == 3 and cfg.arith.operators == "+-"
    assert (cfg.n_train, cfg.n_val, cfg.n_test) == (20_000, 500, 600)


@pytest.mark.parametrize("values, message", [
    ({"families": ["arth"]}, "unknown task family 'arth'. Did you mean 'arith'?"),
    ({"families": []}, "tasks.families = []"),
    ({"families": ["arith", "arith"]}, "list a family twice"),
    ({"n_trian": 10}, "did you mean 'n_train' (tasks.n_train) instead of 'n_trian'?"),
    ({"n_train": 0}, "tasks.n_train = 0: Input should be greater than or equal to 1"),
    ({"arith": {"max_operands": 9}}, "tasks.arith.max_operands = 9"),
    ({"arith": {"min_operands": 4, "max_operands": 3}}, "min_operands (4) must be <= max_operands (3)"),
    ({"arith": {"operator": "+"}}, "tasks.arith.operator = '+': unknown key"),
])
def test_config_errors_name_key_value_and_rule(values, message):
    with pytest.raises(ParamsError) as info:
        section(values)
    assert message in str(info.value)


# --- the written splits ---------------------------------------------------------------------------

def test_splits_written_with_schema_sizes_and_checks(built):
    root, metrics = built
    frames = read_splits(root)
    for split, df in frames.items():
        assert df.schema == pl.Schema(arith.SCHEMA)
        assert df.height == SMOKE[f"n_{split}"]
        assert set(df["split"]) == {split}
        path = root / "data" / "tasks" / "arith" / f"{split}.parquet"
        read_parquet_checked(path, arith.expectations(arith.Config(), split))  # downstream's view
    questions = [set(df["question"]) for df in frames.values()]
    assert sum(map(len, questions)) == len(set().union(*questions)) == 350
    assert metrics["arith_train_rows"] == 200 and metrics["arith_test_rows"] == 100
    assert {metrics[f"arith_val_rows_d{d}"] for d in (2, 3, 4)} <= {16, 17}
    assert metrics["seconds"] > 0 and "validation_seconds" in metrics
    leftovers = [p.name for p in (root / "data").iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def test_training_text_format(built):
    root, _ = built
    row = read_splits(root)["train"].row(0, named=True)
    text = row["prompt"] + row["target"]
    assert text == f"Q: {row['question']}=? A: " + row["target"][1:]
    assert row["target"].startswith(" ") and row["target"].endswith(f" #### {row['answer']}")
    assert arith.verify_answer(row, row["target"]) and all(arith.verify_steps(row, row["target"]))


def test_same_seed_same_data_other_seed_other_data(built, tmp_path):
    root, _ = built
    build.run(build.Config(**SMOKE), make_ctx(tmp_path / "a", seed=0))
    build.run(build.Config(**SMOKE), make_ctx(tmp_path / "b", seed=1))
    same, other, first = read_splits(tmp_path / "a"), read_splits(tmp_path / "b"), read_splits(root)
    assert all(same[s].equals(first[s]) for s in first)
    assert not any(other[s].equals(first[s]) for s in first)


# --- failures leave the previous output ------------------------------------------------------------

def test_killed_write_keeps_previous_output(built, tmp_path, monkeypatch):
    root = tmp_path
    build.run(build.Config(**SMOKE), make_ctx(root))
    before = read_splits(root)
    real = build.io.write_parquet

    def dies_on_train(path, df):
        if Path(path).name == "train.parquet":
            raise KeyboardInterrupt("killed mid-stage")
        return real(path, df)

    monkeypatch.setattr(build.io, "write_parquet", dies_on_train)
    with pytest.raises(KeyboardInterrupt):
        build.run(build.Config(**{**SMOKE, "n_val": 60}), make_ctx(root, seed=5))
    after = read_splits(root)
    assert all(after[s].equals(before[s]) for s in before)
    assert [p.name for p in (root / "data").iterdir()] == ["tasks"]   # no temporaries left


def test_bad_data_fails_before_writing(tmp_path, monkeypatch):
    real = arith.expectations

    def wrong_spec(cfg, split):
        return real(arith.Config(min_operands=5, max_operands=5), split)

    monkeypatch.setattr(arith, "expectations", wrong_spec)
    with pytest.raises(DataValidationError) as info:
        build.run(build.Config(**SMOKE), make_ctx(tmp_path))
    assert "data/tasks/arith/test.parquet" in str(info.value)
    assert info.value.column == "n_operands" and info.value.rule == "value set"
    assert not (tmp_path / "data" / "tasks").exists()
