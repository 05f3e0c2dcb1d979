"""What DVC sees of a stage's numbers (stages/core/runner.py `split_metrics`): a short headline in
`metrics/<stage>.json` (DVC metrics, in git), every number in `details/<stage>.json` (a DVC
output), never a wall time in either (a tracked file that changes on every run dirties git), NaN
as null.

The committed files are checked as they are (no timing key, a short flat headline), the writer on
a toy stage run through the real runner. The DVC commands themselves are in
tests/unit/test_dvc_metrics.py.
"""

from __future__ import annotations

import importlib
import json
import math
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from stages.core import io
from stages.core.runner import pipeline_dirs, run_stage
from stages.registry import STAGES

REPO = Path(__file__).resolve().parents[2]
# The brief's own spelling of a timing, independent of io.TIMING_PART: `*seconds*`, a `_s` or
# `_ms` duration, `*per_s*`, `*time*`, ms/item.
TIMING_WORDS = re.compile(r"second|(^|_)m?s$|per_s($|_)|(^|_)time|ms/|wall|elapsed")
WALL_WORDS = re.compile(r"second|wall|elapsed")


def _tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    return set(out.splitlines())


def _declared_metrics() -> dict[str, list[str]]:
    """dvc.yaml -> every metrics file it declares (stage `metrics:` and top-level `metrics:`),
    repo-relative, `${paths.*}` of the root params resolved."""
    paths = yaml.safe_load((REPO / "params.yaml").read_text())["paths"]
    found: dict[str, list[str]] = {}
    for dvcfile in [REPO / "dvc.yaml", *sorted((REPO / "pipelines").glob("*/dvc.yaml"))]:
        spec = yaml.safe_load(dvcfile.read_text())
        entries = list(spec.get("metrics") or [])
        for stage in (spec.get("stages") or {}).values():
            entries += stage.get("metrics") or []
        names = [next(iter(e)) if isinstance(e, dict) else e for e in entries]
        names = [re.sub(r"\$\{paths\.(\w+)\}", lambda m: paths[m[1]], n) for n in names]
        base = dvcfile.parent.relative_to(REPO)
        found[str(dvcfile.relative_to(REPO))] = [str((base / n)) for n in names]
    return found


def _stage_files() -> list[tuple[str, str, Path, Path]]:
    """(pipeline, stage, metrics file, details file) of every registered stage."""
    out = []
    for pipeline, stages in STAGES.items():
        pdir = pipeline_dirs(REPO)[pipeline]
        mdir, ddir = (REPO / "metrics", REPO / "details") if pdir == REPO else (
            pdir / "metrics", pdir / "details")
        out += [(pipeline, s, mdir / f"{s}.json", ddir / f"{s}.json") for s in stages]
    return out


def test_timing_rule_catches_wall_times_and_nothing_else():
    timed = ["train_seconds", "L2/seconds_per_item", "items_per_s", "train_tokens_per_s",
             "L16/time_reduction", "train_s", "ms_per_item", "d20/seconds", "stage_seconds",
             "selector_train_tokens_per_s", "wall_time"]
    results = ["acc_mean", "tokens_per_solved_mean", "claim/rl/tokens_per_solved/a_vs_b/diff",
               "steps_to_full_mean", "n_sentences_test", "rollouts", "final_len_mean",
               "L2/token_reduction", "pass@4", "sparse_success_last10_mean"]
    assert [k for k in timed if not io.is_timing_key(k)] == []
    assert [k for k in results if io.is_timing_key(k)] == []


def test_no_tracked_metrics_or_details_file_holds_a_timing():
    tracked = _tracked()
    files = sorted(f for f in tracked if re.match(r"(pipelines/[^/]+/)?(metrics|details)/.*\.json$",
                                                  f))
    files += [f for fs in _declared_metrics().values() for f in fs if f not in files]
    assert len(files) > 60
    # a stage whose durations are its results (a simulator's latencies) keeps them; its own
    # wall times are still out (`TIMES_ARE_RESULTS`, io.is_timing_key)
    results = {str(path.relative_to(REPO)) for pipeline, stage, mfile, dfile in _stage_files()
               if getattr(importlib.import_module(STAGES[pipeline][stage]),
                          "TIMES_ARE_RESULTS", False)
               for path in (mfile, dfile)}
    assert results, "no stage declares TIMES_ARE_RESULTS: the serving stages should"

    def timed(f: str, k: str) -> bool:
        if f in results:
            return (io.is_timing_key(k, times_are_results=True)
                    or WALL_WORDS.search(k.rsplit("/", 1)[-1]) is not None)
        return io.is_timing_key(k) or TIMING_WORDS.search(k.rsplit("/", 1)[-1]) is not None

    bad = {f: [k for k in json.loads((REPO / f).read_text()) if timed(f, k)] for f in files}
    assert {f: keys for f, keys in bad.items() if keys} == {}


def test_simulated_times_are_results_wall_times_are_not():
    kept = ["e2e_mean_s", "bursty/maps/load0.5/e2e_p99_s", "slo_ttft_s", "capacity_sessions_per_s",
            "decode_s_per_seq", "max_norm_latency"]
    wall = ["wall_s", "max_run_wall_s", "rounds_per_wall_s", "sim_seconds", "ilp_seconds",
            "serve_seconds"]
    assert [k for k in kept if io.is_timing_key(k, times_are_results=True)] == []
    assert [k for k in wall if not io.is_timing_key(k, times_are_results=True)] == []
    assert all(io.is_timing_key(k) for k in ["e2e_mean_s", "slo_ttft_s", "max_norm_latency", *wall])


def test_every_declared_metrics_file_is_tracked_by_git():
    """A declared metrics file git does not have (never committed, or deleted with its stage
    still in dvc.yaml) is what makes `dvc metrics show` start with `DVC failed to load some
    metrics for following revisions: ''` in a fresh clone."""
    tracked = _tracked()
    missing = {dvcfile: [f for f in files if f not in tracked]
               for dvcfile, files in _declared_metrics().items()}
    assert {k: v for k, v in missing.items() if v} == {}


def test_each_stage_headline_is_short_and_flat():
    """metrics/<stage>.json of every registered stage: a handful of keys, no deep paths (the
    details are in details/<stage>.json, a DVC output)."""
    long = {}
    for pipeline, stage, mfile, _ in _stage_files():
        assert mfile.is_file(), f"{mfile}: not committed"
        keys = sorted(json.loads(mfile.read_text()))
        if len(keys) > 8 or any(k.count("/") > 1 for k in keys):
            long[f"{pipeline}/{stage}"] = keys
    assert long == {}


def test_every_stage_keeps_the_run_cache():
    """DVC keeps no run-cache for a stage with a `cache: false` output that is neither metrics
    nor plots (dvc/stage/__init__.py `no_cache_outs`): its results could not be restored, and
    `paperline run` restores every stage of its workspaces from the run-cache. So
    details/<stage>.json are cached outputs, not `cache: false` ones."""
    from dvc.repo import Repo

    with Repo(str(REPO)) as repo:
        stages = list(repo.index.stages)
        blocked = [s.addressing for s in stages if any(
            o.persist or not (o.use_cache or o.is_metric or o.is_plot) for o in s.outs)]
        details = {s.addressing for s in stages
                   if any(o.def_path.endswith(f"details/{s.name}.json") for o in s.outs)}
    assert blocked == []
    assert details == {s.addressing for s in stages}   # every stage declares its details
    from flows.runner import _can_run_cache            # what `paperline run` plans with

    assert all(_can_run_cache(s) for s in stages)


def test_the_flow_knows_an_uncached_plain_out_blocks_the_run_cache(tmp_path: Path):
    from dvc.repo import Repo

    from flows.runner import _can_run_cache

    Repo.init(str(tmp_path), no_scm=True)
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n"
        "  ok: {cmd: x, deps: [a], outs: [o], metrics: [{m.json: {cache: false}}]}\n"
        "  blocked: {cmd: x, deps: [a], outs: [{d.json: {cache: false}}]}\n")
    with Repo(str(tmp_path)) as repo:
        got = {s.name: _can_run_cache(s) for s in repo.index.stages}
    assert got == {"ok": True, "blocked": False}


def test_undefined_values_are_written_as_null_and_read_back_as_nan(tmp_path: Path):
    path = io.write_metrics(tmp_path / "m.json",
                            {"b": float("nan"), "a": 0.5, "c": float("inf")})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"a": 0.5, "b": None, "c": None}
    back = io.read_metrics(path)
    assert back["a"] == 0.5 and math.isnan(back["b"]) and math.isnan(back["c"])


TOY = textwrap.dedent('''
    from pydantic import BaseModel, ConfigDict

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def run(cfg, ctx):
        return {"acc": 0.5, "ci_low": float("nan"), "train_seconds": 12.0,
                "train_tokens_per_s": 900.0, "L2/time_reduction": 0.3, "ms_per_item": 4.0}

    def headline(m):
        return {"acc": m["acc"], "ci_low": m["ci_low"], "wall_seconds": 1.0}
''')


def test_the_runner_writes_headline_and_details_without_timings(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch):
    """A stage that returns wall times (and a headline that makes one up): both files are free
    of them, the headline holds what `headline` picked, details every other number."""
    root = tmp_path / "repo"
    (root / ".dvc").mkdir(parents=True)
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    (root / "pipelines" / "toy").mkdir(parents=True)
    (root / "pipelines/toy/dvc.yaml").write_text("stages: {}\n")
    (root / "pipelines/toy/params.yaml").write_text("step: {}\n")
    (tmp_path / "toy_stage.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(STAGES, "toy", {"step": "toy_stage"})
    monkeypatch.setenv("PAPERLINE_TRACKING", "off")

    summary = run_stage("toy", "step", root=root)
    metrics = json.loads((root / "pipelines/toy/metrics/step.json").read_text())
    details = json.loads((root / "pipelines/toy/details/step.json").read_text())
    assert metrics == {"acc": 0.5, "ci_low": None} and summary.keys() == {"acc", "ci_low"}
    assert details == {"acc": 0.5, "ci_low": None}
