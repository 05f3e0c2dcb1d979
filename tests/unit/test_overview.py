"""The root README's pipeline table is generated from the registry, RESULTS.md and metrics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from flows import overview
from stages.core.runner import pipeline_dirs
from stages.registry import PAPERS

REPO = Path(__file__).resolve().parents[2]


def test_every_pipeline_has_a_paper_row():
    assert set(PAPERS) == set(pipeline_dirs(REPO))


def test_committed_root_readme_table_is_the_generated_one():
    text = (REPO / "README.md").read_text()
    block = text.split(overview.START, 1)[1].split(overview.END, 1)[0].strip()
    assert block == overview.pipeline_table(REPO), "run `paperline report`"


def test_table_counts_verdicts_and_reads_the_measured_wall(tmp_path: Path):
    root = tmp_path
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    (root / "pipelines" / "racer" / "metrics").mkdir(parents=True)
    shutil.copy(REPO / "pipelines/racer/params.yaml", root / "pipelines/racer/params.yaml")
    (root / "pipelines/racer/dvc.yaml").write_text("stages: {}\n")
    (root / "pipelines/racer/metrics/evaluate.json").write_text(json.dumps(
        {"reproduced": 2.0, "inconclusive": 0.0, "contradicted": 1.0}))
    (root / "pipelines/racer/metrics/oracle.json").write_text(json.dumps(
        {"reproduced": 0.0, "inconclusive": 1.0, "contradicted": None, "acc": 0.5}))
    (root / "pipelines/racer/details").mkdir()   # a claim's own verdict is a detail: not counted
    (root / "pipelines/racer/details/evaluate.json").write_text(json.dumps({"a/verdict": 1.0}))
    (root / "benchmarks").mkdir()
    (root / "benchmarks/RESULTS.md").write_text(
        "# x\n\n## Pipeline wall time\n\n| pipeline | profile | stages | wall (min) | target | "
        "slowest | finished (UTC) |\n|---|---|---|---|---|---|---|\n"
        "| racer | cpu | 6 / 6 | 4.9 | 15: met | a | 2026-12-04 14:14 |\n"
        "| base | smoke | 4 / 4 | 0.2 | 15: met | a | 2026-12-04 14:00 |\n\n## Next\n")
    table = overview.pipeline_table(root)
    assert "| `racer` | RACER, arXiv 2605.10805 |" in table
    assert "| 4.9 min (2026-12-04) | 2 / 1 / 1 |" in table
    # a smoke-profile row is not a cpu wall time
    assert "| `base` | (shared) |" in table and "not measured | no claim tested |" in table
