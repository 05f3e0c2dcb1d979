"""`dvc metrics show` and `dvc metrics diff` as a user runs them (README "Daily use"): real DVC on
the committed metrics, and on a tmp git repo for NaN.

- Per pipeline, `dvc metrics show metrics` in its folder (the root for `base`) is a short table:
  a row per stage, lines under 250 characters, under 20 KB, and no "DVC failed to load some
  metrics" warning (its cause: a declared metrics file that is missing).
- An undefined value (NaN) written twice is not a change for `dvc metrics diff`: the files hold
  `null` (stages/core/io.py `write_metrics`), which DVC skips; a Python `NaN` token is reported
  as NaN -> NaN on every diff, since NaN != NaN.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from stages.core import io
from stages.core.runner import pipeline_dirs

REPO = Path(__file__).resolve().parents[2]
DVC = str(Path(sys.executable).parent / "dvc")
MAX_LINE, MAX_BYTES = 250, 20_000


def _dvc(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DVC, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def _show(folder: Path) -> str:
    """What `dvc metrics show metrics` prints in `folder`, rendered in-process by DVC's own
    reader and table code (the CLI builds the repo index first: seconds per call)."""
    import contextlib
    import io as textio

    from dvc.compare import show_metrics
    from dvc.repo.metrics.show import _extract_metrics

    data = {f"metrics/{f.name}": {"data": _extract_metrics(json.loads(f.read_text()), str(f))}
            for f in sorted((folder / "metrics").glob("*.json"))}
    out = textio.StringIO()
    with contextlib.redirect_stdout(out):
        show_metrics({"": {"data": data}}, precision=5, round_digits=True)
    return out.getvalue()


@pytest.mark.parametrize("pipeline", sorted(pipeline_dirs(REPO)))
def test_metrics_show_of_one_pipeline_is_a_short_table(pipeline: str):
    folder = pipeline_dirs(REPO)[pipeline]
    text = _show(folder)
    lines = text.splitlines()
    stages = sorted(p.stem for p in (folder / "metrics").glob("*.json"))
    assert [line.split()[0] for line in lines[1:]] == [f"metrics/{s}.json" for s in stages]
    assert max(map(len, lines)) < MAX_LINE, lines[0]
    assert len(text.encode()) < MAX_BYTES


def test_metrics_show_cli_prints_that_table_and_no_warning():
    """The real CLI: in a pipeline folder it prints the table `_show` renders; over the whole
    repo it loads every declared metrics file (no "DVC failed to load some metrics")."""
    folder = pipeline_dirs(REPO)["racer"]
    proc = _dvc(folder, "metrics", "show", "metrics")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout == _show(folder)
    proc = _dvc(REPO, "metrics", "show", "--json")
    assert proc.returncode == 0 and "failed to load" not in proc.stderr, proc.stderr
    for rev in json.loads(proc.stdout).values():
        assert "error" not in rev and all("error" not in f for f in rev["data"].values())


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                   check=True, capture_output=True)


def test_nan_to_nan_is_not_a_change_in_metrics_diff(tmp_path: Path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    assert _dvc(repo, "init", "-q").returncode == 0
    (repo / "dvc.yaml").write_text("metrics:\n  - ours.json\n  - python.json\n")
    values = {"acc": 0.5, "ci_low": math.nan}
    io.write_metrics(repo / "ours.json", values)
    (repo / "python.json").write_text(json.dumps(values))  # json.dumps writes the NaN token
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "metrics")
    io.write_metrics(repo / "ours.json", values)  # the same run again

    proc = _dvc(repo, "metrics", "diff")
    assert proc.returncode == 0, proc.stderr
    changed = {tuple(line.split()[:2]) for line in proc.stdout.splitlines()[1:]}
    assert changed == {("python.json", "ci_low")}  # NaN -> NaN reported only for the NaN token

    show = _dvc(repo, "metrics", "show", "ours.json")
    assert show.stdout.split() == ["Path", "acc", "ours.json", "0.5"]  # null: not shown

    io.write_metrics(repo / "ours.json", {"acc": 0.5, "ci_low": 0.25})  # now defined
    proc = _dvc(repo, "metrics", "diff", "--targets", "ours.json")
    assert proc.stdout.splitlines()[1].split() == ["ours.json", "ci_low", "-", "0.25", "-"]
