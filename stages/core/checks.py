"""Data checks at stage boundaries: a small declarative spec run as a great-expectations suite.

A stage describes a table with a `FrameSpec` (columns with dtype, not-null, unique, range, value
set, exact distinct set; for list columns a minimum length and rules for the values inside; a
minimum row count). Producers call `validate_frame(df, spec, name)`
before declaring success; consumers call `read_parquet_checked(path, spec)` on every input, which
turns a missing, empty, truncated or corrupt file, a missing column, a wrong dtype, a null or NaN
into one `DataValidationError` naming the file, the column and the rule, before any compute.

great-expectations 1.x has no polars engine, so the suite runs on `df.to_pandas()`. Dtypes are
checked on the polars schema only (exact: Int32 vs Int64), before GE: the pandas conversion
changes them (a null turns an Int64 column into float64), so a GE type check would report a
second, spurious failure beside the real one. The rest runs in GE. GE is imported lazily
(about 4 s) and its ephemeral context is created once per process; one validation of a 20k-row
split takes tens of milliseconds after that.

Passed validations are remembered by content: a marker named by the SHA-256 of (this file, the
GE version, the spec, the frame's Arrow IPC bytes) in `$PAPERLINE_CHECK_CACHE` (default
`<repo>/.paperline/check-cache`; `off` disables it). A consumer reading the exact table its
producer validated against the same rules skips the GE import (most stages: a 7 s stage becomes
3 s). Any changed byte, rule or GE version is a miss; failures are never remembered.
"""

from __future__ import annotations

import hashlib
import io as _io
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # polars is imported where a frame is read: `python -m stages` imports this
    import polars as pl  # module for DataValidationError, also for stages that read no table

log = logging.getLogger("paperline")


class DataValidationError(ValueError):
    """Bad data at a stage boundary; the message names the file, the column and the rule."""

    def __init__(self, message: str, *, source: str = "", column: str | None = None,
                 rule: str = "") -> None:
        super().__init__(message)
        self.source, self.column, self.rule = source, column, rule


@dataclass(frozen=True)
class ColumnSpec:
    """Rules for one column. `values`: every value in this set; `distinct`: the set of distinct
    values equals this one (e.g. every difficulty level present)."""

    dtype: Any = None                      # a polars dtype, None = any
    nullable: bool = False                 # False: no null, and no NaN in float columns
    unique: bool = False
    min: float | None = None
    max: float | None = None
    values: tuple | None = None
    distinct: tuple | None = None
    max_imbalance: float | None = None     # most / least frequent value count (label balance);
                                           # counts that differ by at most one always pass
    min_len: int | None = None             # list columns: every list holds at least this many
    elements: "ColumnSpec | None" = None   # list columns: rules for the values inside the lists
                                           # (reported as column '<name>[]')


@dataclass(frozen=True)
class FrameSpec:
    columns: Mapping[str, ColumnSpec] = field(default_factory=dict)
    min_rows: int = 1


def spec_from_schema(schema: Mapping[str, Any], min_rows: int = 1,
                     **rules: dict[str, Any]) -> FrameSpec:
    """A FrameSpec with every schema column typed and not-null, plus extra rules per column:
    `spec_from_schema(SCHEMA, id={"unique": True}, answer={"min": 0})`."""
    unknown = sorted(set(rules) - set(schema))
    if unknown:
        raise KeyError(f"rules for columns not in the schema: {unknown}")
    columns = {}
    for name, dtype in schema.items():
        extra = dict(rules.get(name, {}))
        for key in ("values", "distinct"):
            if extra.get(key) is not None:
                extra[key] = tuple(extra[key])
        columns[name] = ColumnSpec(dtype=dtype, **extra)
    return FrameSpec(columns=columns, min_rows=min_rows)


# --- great-expectations, once per process -------------------------------------------------------

_GX: dict[str, Any] = {}
_GX_LOCK = threading.Lock()


def _gx() -> dict[str, Any]:
    """The GE modules and an ephemeral context with one pandas whole-frame batch definition."""
    with _GX_LOCK:
        if not _GX:
            os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
            # GE logs hundreds of INFO lines while importing: quiet it before the import.
            logging.getLogger("great_expectations").setLevel(logging.WARNING)
            started = time.perf_counter()
            import great_expectations as gx
            import great_expectations.expectations as gxe
            from great_expectations.data_context.types.base import (
                DataContextConfig,
                InMemoryStoreBackendDefaults,
                ProgressBarsConfig,
            )

            # In memory only: no temporary data-docs site written to /tmp.
            config = DataContextConfig(
                store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False))
            # GE's modules turn this on when imported; the fork server imports them and turns it
            # off again for the stages that never validate (stages/core/forkserver.py _preload)
            logging.captureWarnings(True)
            context = gx.get_context(mode="ephemeral", project_config=config)
            context.variables.progress_bars = ProgressBarsConfig(globally=False)
            asset = context.data_sources.add_pandas("paperline").add_dataframe_asset("frame")
            _GX.update(gx=gx, gxe=gxe, context=context,
                       batch_definition=asset.add_batch_definition_whole_dataframe("whole"))
            log.debug("great-expectations ready in %.2fs", time.perf_counter() - started)
    return _GX


# Failure order in messages: the most basic broken rule first.
_RULES = {  # GE expectation type -> (rule name, priority)
    "expect_column_to_exist": ("column exists", 0),
    "expect_table_row_count_to_be_between": ("row count", 1),
    "expect_column_values_to_not_be_null": ("not null", 2),
    "expect_column_values_to_be_unique": ("unique", 4),
    "expect_column_values_to_be_between": ("value range", 5),
    "expect_column_values_to_be_in_set": ("value set", 6),
    "expect_column_distinct_values_to_equal_set": ("distinct values", 7),
}


def build_suite(spec: FrameSpec, name: str) -> Any:
    """The GE ExpectationSuite for a spec (not stored in any context)."""
    g = _gx()
    gx, gxe = g["gx"], g["gxe"]
    suite = gx.ExpectationSuite(name=name)
    suite.add_expectation(gxe.ExpectTableRowCountToBeBetween(min_value=spec.min_rows))
    for col, rules in spec.columns.items():
        suite.add_expectation(gxe.ExpectColumnToExist(column=col))
        # no GE type check: check_schema compared the exact polars dtypes already
        if not rules.nullable:
            suite.add_expectation(gxe.ExpectColumnValuesToNotBeNull(column=col))
        if rules.unique:
            suite.add_expectation(gxe.ExpectColumnValuesToBeUnique(column=col))
        if rules.min is not None or rules.max is not None:
            suite.add_expectation(gxe.ExpectColumnValuesToBeBetween(
                column=col, min_value=rules.min, max_value=rules.max))
        if rules.values is not None:
            suite.add_expectation(gxe.ExpectColumnValuesToBeInSet(column=col, value_set=list(rules.values)))
        if rules.distinct is not None:
            suite.add_expectation(gxe.ExpectColumnDistinctValuesToEqualSet(
                column=col, value_set=list(rules.distinct)))
    return suite


def check_schema(schema: Mapping[str, Any], spec: FrameSpec, name: str) -> None:
    """Columns present with the right polars dtype (cheap; works on a parquet footer alone)."""
    for col, rules in spec.columns.items():
        if col not in schema:
            raise DataValidationError(
                f"{name}: column {col!r}: rule 'column exists' failed: missing "
                f"(columns present: {', '.join(schema) or 'none'})",
                source=name, column=col, rule="column exists")
        if rules.dtype is not None and schema[col] != rules.dtype:
            raise DataValidationError(
                f"{name}: column {col!r}: rule 'dtype' failed: dtype is {schema[col]}, "
                f"expected {rules.dtype}", source=name, column=col, rule="dtype")


def _describe_failure(result: Any) -> tuple[str | None, str, str]:
    cfg = result.expectation_config
    rule, _ = _RULES.get(cfg.type, (cfg.type, 99))
    column = cfg.kwargs.get("column")
    r = result.result or {}
    if r.get("unexpected_count"):
        detail = (f"{r['unexpected_count']} of {r.get('element_count', '?')} values break it, "
                  f"e.g. {r.get('partial_unexpected_list', [])[:5]}")
    elif r.get("partial_missing_list"):
        detail = f"values never seen: {r['partial_missing_list'][:10]}"
    elif "observed_value" in r:
        detail = f"observed {r['observed_value']!r}"
    else:
        detail = "failed"
    if result.exception_info and result.exception_info.get("raised_exception"):
        detail += f" ({result.exception_info.get('exception_message')})"
    args = {k: v for k, v in cfg.kwargs.items() if k not in ("column", "batch_id") and v is not None}
    if args:
        detail += f"; expected {args}"
    return column, rule, f"{detail} [{cfg.type}]"


def _cache_dir() -> Path | None:
    setting = os.environ.get("PAPERLINE_CHECK_CACHE", "")
    if setting.lower() == "off":
        return None
    if setting:
        return Path(setting)
    from stages.core.config import find_root

    try:
        return find_root() / ".paperline" / "check-cache"
    except Exception:  # not inside a paperline checkout: no cache
        return None


def validation_key(df: pl.DataFrame, spec: FrameSpec) -> str:
    """SHA-256 of what decides the outcome: the rules' code, GE's version, the spec, the data."""
    from importlib.metadata import version

    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    h.update(version("great_expectations").encode())
    h.update(repr(spec).encode())
    buf = _io.BytesIO()
    df.rechunk().write_ipc(buf, compression="uncompressed")
    h.update(buf.getvalue())
    return h.hexdigest()


def validate_frame(df: pl.DataFrame, expectations: FrameSpec, name: str) -> dict[str, Any]:
    """Run `expectations` on `df` as a GE suite; raise DataValidationError on any failure.

    `name` identifies the data in messages and logs (use the file path). Returns a summary:
    success, evaluated expectations, rows, seconds, and GE's own result dict (absent when the
    same data passed the same rules before: `cached` is then True).
    """
    started = time.perf_counter()
    check_schema(df.schema, expectations, name)
    cache = _cache_dir()
    marker = cache / validation_key(df, expectations) if cache is not None else None
    if marker is not None and marker.is_file():
        evaluated = int(marker.read_text().split()[0])
        seconds = time.perf_counter() - started
        log.info("%s: %d expectations passed on %d rows (same data and rules as a passed "
                 "validation: %s)", name, evaluated, df.height, marker.name[:12])
        return {"success": True, "evaluated": evaluated, "rows": df.height, "seconds": seconds,
                "cached": True}
    result = _run_suite(df, expectations, name)
    _check_balance(df, expectations, name)
    evaluated = len(result.results) + _check_lists(df, expectations, name)
    seconds = time.perf_counter() - started
    log.info("%s: %d expectations passed on %d rows in %.3fs", name, evaluated, df.height,
             seconds)
    if marker is not None:
        _remember(marker, f"{evaluated} {name}\n")
    return {"success": True, "evaluated": evaluated, "rows": df.height,
            "seconds": seconds, "cached": False, "result": result.describe_dict()}


def _run_suite(df: pl.DataFrame, spec: FrameSpec, name: str) -> Any:
    """GE's validation result of `spec` on `df`; a DataValidationError listing every failure,
    the most basic first."""
    g = _gx()
    suite = build_suite(spec, name)
    batch = g["batch_definition"].get_batch(batch_parameters={"dataframe": df.to_pandas()})
    result = batch.validate(suite)
    failures = sorted((r for r in result.results if not r.success),
                      key=lambda r: _RULES.get(r.expectation_config.type, ("", 99))[1])
    if failures:
        described = [_describe_failure(r) for r in failures]
        column, rule, _ = described[0]
        lines = [f"{name}: data validation failed ({len(failures)} of {len(result.results)} rules):"]
        for col, rul, detail in described:
            where = f"column {col!r}" if col else "table"
            lines.append(f"  {where}: rule {rul!r} failed: {detail}")
        log.error("%s", "\n".join(lines))
        raise DataValidationError("\n".join(lines), source=name, column=column, rule=rule)
    return result


def _check_lists(df: pl.DataFrame, spec: FrameSpec, name: str) -> int:
    """List columns: each list's length, then the values inside all lists, as column '<name>[]'
    (a NaN score inside a list is as bad as one in a plain column). Returns rules evaluated."""
    import polars as pl

    evaluated = 0
    for col, rules in spec.columns.items():
        if rules.min_len is not None:
            evaluated += 1
            lengths = df[col].list.len()
            short = df.filter(lengths < rules.min_len)
            if short.height:
                raise DataValidationError(
                    f"{name}: column {col!r}: rule 'list length' failed: {short.height} of "
                    f"{df.height} lists hold fewer than {rules.min_len} values (lengths "
                    f"{sorted(set(lengths.filter(lengths < rules.min_len).to_list()))[:5]})",
                    source=name, column=col, rule="list length")
        if rules.elements is not None:
            inner = df.select(pl.col(col).explode(empty_as_null=False, keep_nulls=False)
                              .alias(f"{col}[]"))
            inner_spec = FrameSpec({f"{col}[]": rules.elements}, min_rows=0)
            check_schema(inner.schema, inner_spec, name)
            evaluated += len(_run_suite(inner, inner_spec, name).results)
    return evaluated


def _remember(marker: Path, text: str) -> None:
    """Write the pass marker atomically; a cache that cannot be written is only slower."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, marker)
    except OSError as exc:
        log.debug("check cache not written (%s): %s", marker, exc)


def _check_balance(df: pl.DataFrame, spec: FrameSpec, name: str) -> None:
    """Label balance (not a GE built-in): most / least frequent value count <= max_imbalance."""
    for col, rules in spec.columns.items():
        if rules.max_imbalance is None or df.height == 0:
            continue
        counts = df[col].value_counts()["count"]
        ratio = counts.max() / counts.min()
        if counts.max() - counts.min() > 1 and ratio > rules.max_imbalance:
            raise DataValidationError(
                f"{name}: column {col!r}: rule 'balance' failed: most / least frequent value "
                f"count = {ratio:.2f} > {rules.max_imbalance} "
                f"({dict(df[col].value_counts().sort(col).iter_rows())})",
                source=name, column=col, rule="balance")


def _existing_file(path: str | os.PathLike[str]) -> tuple[Path, str]:
    """(path, its name for messages), or a DataValidationError if it is not a regular file."""
    p, name = Path(path), str(path)
    if not p.exists():
        raise DataValidationError(
            f"{name}: rule 'file exists' failed: no such file (run the stage that produces it, "
            f"e.g. `dvc repro`)", source=name, rule="file exists")
    if not p.is_file():
        raise DataValidationError(f"{name}: rule 'file exists' failed: not a regular file",
                                  source=name, rule="file exists")
    return p, name


def read_parquet_checked(path: str | os.PathLike[str], spec: FrameSpec) -> pl.DataFrame:
    """Read a parquet input and validate it against `spec`; every defect is a DataValidationError."""
    import polars as pl

    p, name = _existing_file(path)
    if p.stat().st_size == 0:
        raise DataValidationError(f"{name}: rule 'non-empty file' failed: the file is empty "
                                  f"(0 bytes), not parquet", source=name, rule="non-empty file")
    try:
        schema = pl.read_parquet_schema(p)
        check_schema(schema, spec, name)
        df = pl.read_parquet(p)
    except DataValidationError:
        raise
    except Exception as exc:  # polars/arrow raise several types for a bad footer or page
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataValidationError(
            f"{name}: rule 'readable parquet' failed: truncated or corrupt parquet "
            f"({type(exc).__name__}: {first})", source=name, rule="readable parquet") from None
    validate_frame(df, spec, name)
    return df


def read_json_checked(path: str | os.PathLike[str], required: Mapping[str, Any] | None = None,
                      *, kind: type = dict) -> Any:
    """Read a JSON input (a summary, a budget, a manifest another stage wrote) at the stage
    boundary: a missing, empty or malformed file, a top level of the wrong kind, or a missing key
    or a value of the wrong type in `required` ({key: type or tuple of types}) is a
    DataValidationError naming the file and the key, never a raw KeyError further in."""
    p, name = _existing_file(path)
    text = p.read_text()
    if not text.strip():
        raise DataValidationError(f"{name}: rule 'non-empty file' failed: the file is empty",
                                  source=name, rule="non-empty file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataValidationError(f"{name}: rule 'readable JSON' failed: {exc}", source=name,
                                  rule="readable JSON") from None
    if not isinstance(data, kind):
        raise DataValidationError(
            f"{name}: rule 'top level' failed: expected a JSON {kind.__name__}, got "
            f"{type(data).__name__}", source=name, rule="top level")
    for key, want in (required or {}).items():
        if key not in data:
            raise DataValidationError(f"{name}: rule 'required key' failed: no key {key!r}",
                                      source=name, column=key, rule="required key")
        value = data[key]
        types = want if isinstance(want, tuple) else (want,)
        if float in types and isinstance(value, int) and not isinstance(value, bool):
            continue  # JSON has one number type
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise DataValidationError(
                f"{name}: rule 'type' failed: {key!r} is {type(value).__name__}, expected "
                f"{' or '.join(t.__name__ for t in types)}", source=name, column=key,
                rule="type")
    return data


def read_array_checked(path: str | os.PathLike[str], *, ndim: int, rows: int | None = None,
                       kind: str = "f") -> Any:
    """Read a `.npy` input (features, embeddings) at the stage boundary: a missing, empty or
    corrupt file (pickled objects are refused), the wrong number of dimensions, a dtype of
    another kind (`f` float, `i` integer), a row count other than `rows`, or a NaN / inf is a
    DataValidationError naming the file and the rule."""
    import numpy as np

    p, name = _existing_file(path)
    if p.stat().st_size == 0:
        raise DataValidationError(f"{name}: rule 'non-empty file' failed: the file is empty",
                                  source=name, rule="non-empty file")
    try:
        arr = np.load(p, allow_pickle=False)
    except Exception as exc:  # a bad header, a truncated body, a pickle
        raise DataValidationError(f"{name}: rule 'readable npy' failed: {type(exc).__name__}: "
                                  f"{exc}", source=name, rule="readable npy") from None
    if arr.ndim != ndim:
        raise DataValidationError(f"{name}: rule 'ndim' failed: {arr.ndim} dimensions "
                                  f"{arr.shape}, expected {ndim}", source=name, rule="ndim")
    if arr.dtype.kind != kind:
        raise DataValidationError(f"{name}: rule 'dtype' failed: observed {arr.dtype}, expected "
                                  f"kind {kind!r}", source=name, rule="dtype")
    if rows is not None and arr.shape[0] != rows:
        raise DataValidationError(f"{name}: rule 'row count' failed: {arr.shape[0]} rows, "
                                  f"expected {rows}", source=name, rule="row count")
    if kind == "f" and not np.isfinite(arr).all():
        bad = int((~np.isfinite(arr)).sum())
        raise DataValidationError(f"{name}: rule 'finite' failed: {bad} NaN or inf values",
                                  source=name, rule="finite")
    return arr
