"""Every table a stage reads goes through the checked loader (stages/core/checks.py
`read_parquet_checked`), so a bad input is a DataValidationError naming the file and the rule.
This scans the stage code for plain reads (an AST walk, like test_layout's import rules): a
`pl.read_parquet`, `scan_parquet`, `read_csv`, ... anywhere under stages/ but the loader fails it."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOADER = "stages/core/checks.py"  # the one place allowed to read a table file directly
READERS = {f"{verb}_{fmt}" for verb in ("read", "scan")
           for fmt in ("parquet", "csv", "ndjson", "json", "ipc", "delta", "excel", "avro",
                       "table", "feather", "pickle", "database")} | {"ParquetFile"}


def plain_reads(root: Path) -> list[str]:
    """`path:line: call` for every direct table read in root/stages outside the loader."""
    found = []
    for path in sorted((root / "stages").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == LOADER:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            name = None
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            elif isinstance(node, ast.ImportFrom):  # `from polars import read_parquet`
                name = next((a.name for a in node.names if a.name in READERS), None)
            if name in READERS:
                found.append(f"{rel}:{node.lineno}: {name}")
    return found


# Files read as JSON (`json.loads(path.read_text())`, `json.load(f)`) go through
# `read_json_checked` too; these two are their format's own checked loader (a pydantic model /
# a format version and shape check, with errors naming the file), so they read directly.
OWN_JSON_LOADERS = {"stages/serving/latency.py", "stages/maps/predictor.py"}


def plain_json_reads(root: Path) -> list[str]:
    """`path:line` of every `json.load(...)` and `json.loads(<x>.read_text())` in root/stages
    outside the core and the format loaders above (a request body read from a socket is not a
    stage input)."""
    found = []
    for path in sorted((root / "stages").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("stages/core/") or rel in OWN_JSON_LOADERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and getattr(node.func.value, "id", None) == "json"):
                continue
            arg = node.args[0] if node.args else None
            reads_file = (isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute)
                          and arg.func.attr in ("read_text", "read_bytes"))
            if node.func.attr == "load" or (node.func.attr == "loads" and reads_file):
                found.append(f"{rel}:{node.lineno}")
    return found


def test_stage_code_reads_tables_only_through_the_checked_loader():
    assert plain_reads(REPO) == [], (
        "read these through stages.core.checks.read_parquet_checked(path, spec) with a spec of "
        "what the code relies on")


def test_the_scan_finds_a_planted_plain_read(tmp_path: Path):
    pkg = tmp_path / "stages" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("import polars as pl\n\ndef run(p):\n"
                              "    return pl.read_parquet(p), pl.scan_csv(p)\n")
    (pkg / "b.py").write_text("from polars import read_parquet\n")
    (tmp_path / "stages" / "core").mkdir()
    (tmp_path / "stages" / "core" / "checks.py").write_text("pl.read_parquet(p)\n")
    assert plain_reads(tmp_path) == ["stages/demo/a.py:4: read_parquet",
                                     "stages/demo/a.py:4: scan_csv",
                                     "stages/demo/b.py:1: read_parquet"]


def plain_array_reads(root: Path) -> list[str]:
    """`path:line` of every `np.load(...)` / `numpy.load(...)` in root/stages outside the core:
    arrays are read through `read_array_checked`."""
    found = []
    for path in sorted((root / "stages").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("stages/core/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "load"
                    and getattr(node.func.value, "id", None) in ("np", "numpy")):
                found.append(f"{rel}:{node.lineno}")
    return found


def test_stage_code_reads_arrays_only_through_the_checked_loader(tmp_path: Path):
    assert plain_array_reads(REPO) == [], "read these through checks.read_array_checked"
    (tmp_path / "stages" / "demo").mkdir(parents=True)
    (tmp_path / "stages" / "demo" / "a.py").write_text("import numpy as np\nx = np.load(p)\n")
    assert plain_array_reads(tmp_path) == ["stages/demo/a.py:2"]


def test_stage_code_reads_json_files_only_through_the_checked_loader():
    assert plain_json_reads(REPO) == [], (
        "read these through stages.core.checks.read_json_checked(path, {key: type})")


def test_the_json_scan_finds_a_planted_plain_read(tmp_path: Path):
    pkg = tmp_path / "stages" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("import json\n\ndef run(p, f, sock):\n"
                              "    a = json.loads(p.read_text())\n"
                              "    b = json.load(f)\n"
                              "    return a, b, json.loads(sock.read())\n")
    assert plain_json_reads(tmp_path) == ["stages/demo/a.py:4", "stages/demo/a.py:5"]
