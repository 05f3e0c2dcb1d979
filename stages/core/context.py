"""What a stage's `run(cfg, ctx)` receives besides its config: where things are and how to log."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import did_you_mean

log = logging.getLogger("paperline")


@dataclass
class Context:
    root: Path                      # repo root (folder with .dvc/ and the root params.yaml)
    pipeline: str                   # pipeline name, e.g. "base", "bis"
    stage: str                      # stage name as in dvc.yaml, e.g. "tasks"
    pipeline_dir: Path              # folder of the pipeline's dvc.yaml (the root for "base")
    profile: str                    # smoke | cpu | gpu
    seed: int
    paths: dict[str, Path]          # every declared path, absolute (root paths + pipeline paths)
    params: dict[str, Any] = field(default_factory=dict)  # merged params, read-only
    tracker: Any = None             # stages.core.tracking.StageTracker (no-op when tracking is off)

    def path(self, name: str) -> Path:
        """A declared path by name; an unknown name is an error with a suggestion."""
        if name not in self.paths:
            raise did_you_mean(name, self.paths, "path (declared under `paths:` in params)")
        return self.paths[name]

    @property
    def metrics_dir(self) -> Path:
        """`<paths.metrics>` for the shared stages; `pipelines/<slug>/metrics` for a paper's
        pipeline (its dvc.yaml declares `metrics/<stage>.json`, relative to its own folder)."""
        if self.pipeline_dir != self.root:
            return self.pipeline_dir / "metrics"
        return self.path("metrics")

    @property
    def metrics_path(self) -> Path:
        """Where the stage's headline lands for DVC: `<metrics_dir>/<stage>.json` (the module's
        `headline(metrics)`, or every number when it defines none)."""
        return self.metrics_dir / f"{self.stage}.json"

    @property
    def details_dir(self) -> Path:
        """`<paths.details>` for the shared stages; `pipelines/<slug>/details` for a paper's
        pipeline: every number a stage returned (timings aside), a DVC output (cached like the
        stage's data: a `cache: false` one would turn off DVC's run-cache for the stage), so
        `dvc metrics show` stays a short summary."""
        if self.pipeline_dir != self.root:
            return self.pipeline_dir / "details"
        return self.paths.get("details") or self.metrics_dir.parent / "details"

    @property
    def details_path(self) -> Path:
        return self.details_dir / f"{self.stage}.json"

    def stage_metrics(self, stage: str) -> dict[str, float]:
        """Every number another stage of this pipeline returned (its details file; NaN for an
        undefined value). A stage reading it lists `details/<stage>.json` in its dvc.yaml deps."""
        from .io import read_metrics

        path = self.details_dir / f"{stage}.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing; run stage {stage!r} first")
        return read_metrics(path)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, step=step)

    def log_params(self, params: dict[str, Any]) -> None:
        if self.tracker is not None:
            self.tracker.log_params(params)

    def method_run(self, group: str, method: str, seed: int,
                   params: dict[str, Any] | None = None) -> Any:
        """A context manager yielding a run for one (method, seed) of a comparison (an MLflow
        child run under the stage's run; `StageTracker.method_run`), with `log_metrics(metrics,
        step)`. Without a tracker (unit tests, tracking off) it yields a run that logs nothing."""
        if self.tracker is not None:
            return self.tracker.method_run(group=group, method=method, seed=seed, params=params)
        return contextlib.nullcontext(_NoRun())


class _NoRun:
    """The method run of an untracked stage: accepts metrics and drops them."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass
