"""MLflow tracking for stages: one experiment per pipeline, a child run per stage.

- Tracking URI: `MLFLOW_TRACKING_URI` if set, else an embedded SQLite database inside the repo
  (`.paperline/mlflow/mlflow.db`, artifacts beside it; ignored by git). With S3 storage
  configured (`stages/core/storage.py`), new experiments of the embedded store keep their
  artifacts on S3 instead; a server decides for itself (`--artifacts-destination`).
- The parent run (one per pipeline execution) is created by `paperline run|repro` and handed to
  stage processes in `PAPERLINE_PARENT_RUN_ID` (deliberately not `MLFLOW_RUN_ID`, which would make
  every stage log into the parent itself). A plain `dvc repro` has no parent: stages log
  top-level runs.
- Each stage run is tagged with `dvc.stage_key`: the hash of the stage's command, dependency
  contents and params, i.e. what DVC's run-cache keys on. A stage that DVC restores from its cache
  never runs, so it logs nothing and creates no duplicate.
- A tracking failure never loses a finished stage's outputs: errors are logged as warnings and the
  stage carries on (the gap is reported in the stage log and in the metrics as `tracking_ok = 0`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("paperline.tracking")

PARENT_ENV = "PAPERLINE_PARENT_RUN_ID"
FLOW_RUN_ENV = "PAPERLINE_FLOW_RUN_ID"


def tracking_uri(root: Path) -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    db = root / ".paperline" / "mlflow" / "mlflow.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"


def configure(root: Path) -> str:
    """Point MLflow at the project's tracking store; returns the URI."""
    import mlflow

    from .storage import apply_mlflow_env

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    apply_mlflow_env(root)  # S3 storage configured: artifacts of S3 experiments reach the store
    uri = tracking_uri(root)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return uri


def experiment_id(root: Path, pipeline: str) -> str:
    """Get or create the pipeline's experiment (artifacts inside the repo for the local store)."""
    import mlflow

    exp = mlflow.get_experiment_by_name(pipeline)
    if exp is not None:
        return exp.experiment_id
    location = None
    uri = mlflow.get_tracking_uri()
    if uri.startswith("sqlite:///"):
        from .storage import experiment_artifact_location

        # S3 storage configured (params `storage:` / PAPERLINE_S3_*): artifacts on the store.
        location = experiment_artifact_location(root, pipeline)
        if location is None:
            # A local store has no artifact server: keep artifacts beside the database (inside
            # the main repo, also when a stage runs in a Prefect workspace), never in ./mlruns.
            art = Path(uri[len("sqlite:///"):]).parent / "artifacts" / pipeline
            art.mkdir(parents=True, exist_ok=True)
            location = art.as_uri()
    try:
        return mlflow.create_experiment(pipeline, artifact_location=location)
    except Exception:  # created concurrently by a sibling stage
        exp = mlflow.get_experiment_by_name(pipeline)
        if exp is None:
            raise
        return exp.experiment_id


def git_commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _hash_path(path: Path, h: "hashlib._Hash") -> None:
    if path.is_dir():
        for p in sorted(path.rglob("*")):
            if p.is_file() and ".tmp-" not in p.name:
                h.update(str(p.relative_to(path)).encode())
                h.update(hashlib.md5(p.read_bytes()).digest())
    elif path.is_file():
        h.update(hashlib.md5(path.read_bytes()).digest())
    else:
        h.update(b"<missing>")


def model_fingerprint(model_dir: Path) -> str:
    """Content hash of a saved model folder (weights, config, tokenizer files)."""
    h = hashlib.sha256()
    _hash_path(Path(model_dir), h)
    return h.hexdigest()[:32]


def stage_key(ctx: Any, cfg: Any) -> str:
    """Hash of what determines the stage's outputs: its code, declared inputs and params.

    Read from the stage's own dvc.yaml entry (deps resolved by DVC's templating), so it changes
    exactly when DVC would rerun the stage.
    """
    h = hashlib.sha256()
    h.update(f"{ctx.pipeline}/{ctx.stage}/{ctx.profile}/{ctx.seed}".encode())
    h.update(json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode())
    for dep in stage_deps(ctx):
        h.update(str(dep.relative_to(ctx.root) if dep.is_relative_to(ctx.root) else dep).encode())
        _hash_path(dep, h)
    return h.hexdigest()[:32]


def stage_deps(ctx: Any) -> list[Path]:
    """The stage's `deps` as DVC resolves them (templated paths), absolute."""
    try:
        from dvc.repo import Repo

        with Repo(str(ctx.root), uninitialized=False) as repo:
            dvcfile = ctx.pipeline_dir / "dvc.yaml"
            rel = dvcfile.relative_to(ctx.root)
            stages = repo.stage.collect(f"{rel}:{ctx.stage}")
            deps = []
            for st in stages:
                deps.extend(Path(d.fs_path) for d in st.deps)
            return sorted(set(deps))
    except Exception as exc:  # never block a stage on key computation
        log.debug("could not read deps of %s from DVC: %s", ctx.stage, exc)
        return []


class StageTracker:
    """Context manager around one stage's MLflow child run; every call is failure-tolerant."""

    def __init__(self, ctx: Any, cfg: Any):
        self.ctx = ctx
        self.cfg = cfg
        self.run_id: str | None = None
        self.ok = True
        self._mlflow = None

    def _fail(self, what: str, exc: BaseException) -> None:
        if self.ok:
            log.warning("MLflow tracking unavailable (%s): %s; outputs are still written", what, exc)
        self.ok = False

    def __enter__(self) -> "StageTracker":
        if os.environ.get("PAPERLINE_TRACKING", "on") == "off":
            self.ok = False
            return self
        try:
            import mlflow

            configure(self.ctx.root)
            exp_id = experiment_id(self.ctx.root, self.ctx.pipeline)
            tags = {
                "paperline.pipeline": self.ctx.pipeline,
                "paperline.stage": self.ctx.stage,
                "paperline.profile": self.ctx.profile,
                "paperline.seed": str(self.ctx.seed),
                "dvc.stage_key": stage_key(self.ctx, self.cfg),
                "git.commit": git_commit(self.ctx.root),
            }
            parent = os.environ.get(PARENT_ENV)
            if parent:
                tags["mlflow.parentRunId"] = parent
            if os.environ.get(FLOW_RUN_ENV):
                tags["prefect.flow_run_id"] = os.environ[FLOW_RUN_ENV]
            os.environ.setdefault("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "2")
            run = mlflow.start_run(experiment_id=exp_id, run_name=self.ctx.stage, tags=tags,
                                   log_system_metrics=True)
            self.run_id = run.info.run_id
            self._mlflow = mlflow
            flat = _flatten(self.cfg.model_dump(mode="json"))
            flat.update({"profile": self.ctx.profile, "seed": self.ctx.seed})
            mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})
        except Exception as exc:
            self._fail("start", exc)
        return self

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if not (self.ok and self._mlflow):
            return
        try:
            self._mlflow.log_metrics({mlflow_key(k): float(v) for k, v in metrics.items()},
                                    step=step)
        except Exception as exc:
            self._fail("log_metrics", exc)

    def log_params(self, params: dict[str, Any]) -> None:
        if not (self.ok and self._mlflow):
            return
        try:
            self._mlflow.log_params({mlflow_key(k): str(v)[:500]
                                    for k, v in _flatten(params).items()})
        except Exception as exc:
            self._fail("log_params", exc)

    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None:
        if not (self.ok and self._mlflow):
            return
        try:
            self._mlflow.log_artifacts(str(local_dir), artifact_path)
        except Exception as exc:
            self._fail("log_artifacts", exc)

    def register_model(self, local_dir: Path, name: str, aliases: list[str],
                       tags: dict[str, str] | None = None,
                       artifact_path: str = "model") -> str | None:
        """Log a Hugging Face model folder and register it as a new version of `name`.

        The artifact is the `save_pretrained` folder itself, so `models:/<name>@<alias>` downloads
        to a folder that `from_pretrained` loads.
        """
        if not (self.ok and self._mlflow):
            return None
        try:
            from mlflow import MlflowClient

            self._mlflow.log_artifacts(str(local_dir), artifact_path)
            client = MlflowClient()
            tags = {"paperline.pipeline": self.ctx.pipeline, "paperline.profile": self.ctx.profile,
                    "paperline.seed": str(self.ctx.seed), **(tags or {}),
                    "paperline.model_sha": model_fingerprint(Path(local_dir))}
            try:
                client.create_registered_model(name)
            except Exception:
                pass  # exists already
            source = f"{self._mlflow.get_artifact_uri(artifact_path)}"
            version = client.create_model_version(name, source=source, run_id=self.run_id,
                                                  tags=tags)
            for alias in aliases:
                client.set_registered_model_alias(name, alias, version.version)
            self._mlflow.set_tag(f"paperline.registered.{name}", version.version)
            return version.version
        except Exception as exc:
            self._fail("register_model", exc)
            return None

    def annotate_model(self, local_dir: Path, metrics: dict[str, float]) -> int:
        """Tag every registered version whose weights equal `local_dir` with `metric.<k>` values.

        This is how an evaluation stage attaches its scores to the model in the registry, so the
        MLflow UI and `paperline compare` show them side by side. Returns the versions tagged.
        """
        if not (self.ok and self._mlflow):
            return 0
        try:
            from mlflow import MlflowClient

            client = MlflowClient()
            sha = model_fingerprint(Path(local_dir))
            versions = client.search_model_versions(f"tags.`paperline.model_sha` = '{sha}'")
            for v in versions:
                for k, val in metrics.items():
                    client.set_model_version_tag(v.name, v.version, f"metric.{mlflow_key(k)}",
                                                 f"{float(val):.6g}")
            return len(versions)
        except Exception as exc:
            self._fail("annotate_model", exc)
            return 0

    @contextlib.contextmanager
    def method_run(self, group: str, method: str, seed: int,
                   params: dict[str, Any] | None = None) -> Iterator["MethodRun"]:
        """A child run for one (method, seed) of a comparison, e.g. one RL arm on one seed.

        `paperline compare` puts runs with the same `group` in one table, methods as columns,
        mean +- std over seeds. The stage's own run is then tagged `paperline.aggregate` so it
        does not show up as a one-column table of its own. A no-op when tracking is off.
        """
        run = MethodRun(self, group, method, seed, params)
        try:
            yield run
        except BaseException:
            run.end("FAILED")
            raise
        run.end("FINISHED")

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._mlflow is None:
            return
        try:
            self._mlflow.end_run(status="FINISHED" if exc_type is None else "FAILED")
        except Exception as err:
            self._fail("end_run", err)


_BAD_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-. :/]")


def mlflow_key(key: str) -> str:
    """MLflow allows only alphanumerics, `_-. :/` in names: `pass@4` becomes `pass_at_4`."""
    return _BAD_KEY_CHARS.sub("_", key.replace("@", "_at_"))


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def start_parent_run(root: Path, pipeline: str, tags: dict[str, str] | None = None) -> str | None:
    """Create the parent run of one pipeline execution; returns its id (None if tracking is down).

    Pass the id to stage processes in `PAPERLINE_PARENT_RUN_ID`.
    """
    try:
        from mlflow import MlflowClient

        configure(root)
        exp_id = experiment_id(root, pipeline)
        all_tags = {"paperline.pipeline": pipeline, "paperline.kind": "pipeline",
                    "git.commit": git_commit(root)}
        all_tags.update(tags or {})
        run = MlflowClient().create_run(exp_id, tags=all_tags, run_name=f"{pipeline}-pipeline")
        return run.info.run_id
    except Exception as exc:
        log.warning("MLflow tracking unavailable (parent run): %s", exc)
        return None


def end_parent_run(root: Path, run_id: str | None, ok: bool) -> None:
    if not run_id:
        return
    try:
        from mlflow import MlflowClient

        configure(root)
        MlflowClient().set_terminated(run_id, status="FINISHED" if ok else "FAILED")
    except Exception as exc:
        log.warning("MLflow tracking unavailable (end parent run): %s", exc)


class MethodRun:
    """One (method, seed) child run under a stage run; see `StageTracker.method_run`."""

    def __init__(self, tracker: StageTracker, group: str, method: str, seed: int,
                 params: dict[str, Any] | None):
        self.tracker = tracker
        self.run_id: str | None = None
        if not (tracker.ok and tracker._mlflow and tracker.run_id):
            return
        try:
            from mlflow import MlflowClient

            client = MlflowClient()
            parent = client.get_run(tracker.run_id)
            client.set_tag(tracker.run_id, "paperline.aggregate", "true")
            tags = {"mlflow.parentRunId": tracker.run_id, "mlflow.runName": f"{method}/seed{seed}",
                    "paperline.pipeline": tracker.ctx.pipeline, "paperline.stage": group,
                    "paperline.method": method, "paperline.seed": str(seed),
                    "paperline.profile": tracker.ctx.profile,
                    "paperline.source_stage": tracker.ctx.stage,
                    "dvc.stage_key": parent.data.tags.get("dvc.stage_key", "")}
            run = client.create_run(parent.info.experiment_id, tags=tags)
            self.run_id = run.info.run_id
            self._client = client
            if params:
                for k, v in _flatten(params).items():
                    client.log_param(self.run_id, mlflow_key(k), str(v)[:500])
        except Exception as exc:
            tracker._fail("method_run", exc)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self.run_id is None:
            return
        try:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            self._client.log_batch(self.run_id, metrics=[
                Metric(mlflow_key(k), float(v), now, int(step or 0)) for k, v in metrics.items()])
        except Exception as exc:
            self.tracker._fail("method_run.log_metrics", exc)

    def end(self, status: str) -> None:
        if self.run_id is None:
            return
        try:
            self._client.set_terminated(self.run_id, status=status)
        except Exception as exc:
            self.tracker._fail("method_run.end", exc)
        self.run_id = None
