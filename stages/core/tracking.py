"""MLflow tracking for stages: one experiment per pipeline, a child run per stage.

- Tracking URI: `MLFLOW_TRACKING_URI` if set, else an embedded SQLite database inside the repo
  (`.paperline/mlflow/mlflow.db`, artifacts beside it; ignored by git). `paperline stack up`
  serves that same file (flows/stack.py), and the CLI points `MLFLOW_TRACKING_URI` at that server
  while it runs: one store (`store_of` says which URIs reach it). Experiments are created as
  classic ML experiments (`mlflow.experimentKind`), not MLflow 3's GenAI view. With S3 storage
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
  stage carries on. Against a server, each request is retried briefly (`MLFLOW_HTTP_REQUEST_*`,
  defaults here: 3 retries, about 7 s in all) to ride out a restart; a longer outage is a *gap*:
  from the first failed call on, what the stage meant to log (tags, params, metrics, artifacts,
  model registrations, method runs) is recorded in `.paperline/tracking-gaps/<id>.json` of the
  main repo, and the stage log says so at the end (WARNING, with the file). `paperline tracking
  sync` (also run by `paperline repro` before it starts) replays the gaps into MLflow once it is
  back: into the run the stage had created, or into a new one tagged `paperline.stage_run_id`,
  so a replay that is repeated or interrupted creates no duplicate. `paperline tracking gaps`
  lists them.
- Spooled tracking (`PAPERLINE_TRACKING=spool`, what `paperline repro` gives its stages): the
  stage process does not talk to MLflow at all (importing MLflow and opening its store cost a
  trivial stage most of its start-up); everything it would log is recorded like a gap, with the
  stage's start and end times, and the parent replays it into MLflow right after `dvc repro`
  (`sync_gaps`), so the runs show up as if logged live. The parent run itself is created only
  when the first spooled stage is replayed (`PAPERLINE_PARENT_RUN_ID=spool:<token>`): a no-op
  repro touches MLflow not at all. `PAPERLINE_TRACKING=on` (the default for a plain `dvc repro`)
  logs live; `off` logs nothing.
- No run is left RUNNING: closing a parent run (`end_parent_run`, `finish_spooled_parent`)
  marks the runs below it still RUNNING as KILLED (the stage process that would have closed them
  is gone); a close that does not reach MLflow is recorded as a gap and replayed; the parent of
  a `paperline repro` that was killed is closed KILLED by the next sync.
- No duplicate runs after a failure: a stage that runs again with the same stage key under the
  same parent run (a Prefect retry, a rerun after a crash) resumes that earlier run instead of
  creating another; with no parent (plain `dvc repro`) only an unfinished earlier run is resumed.
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
import uuid
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("paperline.tracking")

PARENT_ENV = "PAPERLINE_PARENT_RUN_ID"
FLOW_RUN_ENV = "PAPERLINE_FLOW_RUN_ID"
MODE_ENV = "PAPERLINE_TRACKING"  # on (default) | spool | off; see the module docstring
MODES = ("on", "spool", "off")
SPOOL_PARENT = "spool:"  # PAPERLINE_PARENT_RUN_ID prefix: a parent run created at replay


def tracking_mode(environ: Any = os.environ) -> str:
    mode = environ.get(MODE_ENV, "on").strip().lower() or "on"
    if mode not in MODES:
        raise ValueError(f"${MODE_ENV} = {mode!r}: expected one of {', '.join(MODES)}")
    return mode


EMBEDDED_DB = Path(".paperline") / "mlflow" / "mlflow.db"  # the project's one local store
STACK_STATE = Path(".paperline") / "stack" / "ports.json"  # written by flows/stack.py `up`
# MLflow 3 opens an experiment without this tag in its GenAI view (traces, judges, "Evaluation
# runs"); `custom_model_development` is the classic view: runs table, charts, Compare.
KIND_TAG, CLASSIC_ML = "mlflow.experimentKind", "custom_model_development"


def embedded_uri(root: Path, create: bool = False) -> str:
    """The embedded SQLite store of the main repo (also what `paperline stack up` serves)."""
    db = main_root(root) / EMBEDDED_DB
    if create:
        db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"


def tracking_uri(root: Path) -> str:
    """`MLFLOW_TRACKING_URI`, else the embedded store. A stage process asks this; the CLI first
    points `MLFLOW_TRACKING_URI` at the running stack's server (`flows.stack.use_tracking`), which
    serves the same store."""
    return os.environ.get("MLFLOW_TRACKING_URI") or embedded_uri(root, create=True)


def store_of(root: Path, uri: str) -> str:
    """Which store `uri` reaches: the embedded SQLite URI for that URI itself and for the local
    stack's MLflow server (which serves that file), else `uri` (credentials removed). Gaps are
    replayed only into the store they were recorded against."""
    uri = _redact(uri).rstrip("/")
    local = embedded_uri(root)
    if uri == local:
        return local
    try:
        state = json.loads((main_root(root) / STACK_STATE).read_text())
    except (OSError, ValueError):
        return uri
    if state.get("mlflow_store") == local and uri in (
            f"http://127.0.0.1:{state.get('mlflow')}", f"http://localhost:{state.get('mlflow')}"):
        return local
    return uri


# MLflow's own defaults retry a dead server for about 4 minutes per call (7 retries, backoff 2,
# 120 s timeout): a stage would stall. A few seconds rides out a restart; longer is a gap.
HTTP_RETRY_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
                       "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                       "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def configure(root: Path) -> str:
    """Point MLflow at the project's tracking store; returns the URI."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # read when MLflow is imported
    import mlflow

    from .storage import apply_mlflow_env

    for key, value in HTTP_RETRY_DEFAULTS.items():
        os.environ.setdefault(key, value)
    apply_mlflow_env(root)  # S3 storage configured: artifacts of S3 experiments reach the store
    uri = tracking_uri(root)
    # mlflow.set_*_uri also export MLFLOW_TRACKING_URI / MLFLOW_REGISTRY_URI to os.environ "for
    # subprocesses"; `tracking_uri` reads that variable as the user's choice, so one process that
    # configures two repos (a Prefect worker, a test session) would log the second into the first
    # repo's store. Keep the environment as the user set it; stage processes get theirs explicitly.
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    try:
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return uri


def experiment_id(root: Path, pipeline: str, client: Any = None) -> str:
    """Get or create the pipeline's experiment (artifacts inside the repo for the local store),
    a classic ML experiment (`KIND_TAG`). `client`: an MlflowClient, else the fluent API's
    tracking URI."""
    if client is None:
        from mlflow import MlflowClient

        client = MlflowClient()
    exp = client.get_experiment_by_name(pipeline)
    if exp is not None:
        kind = exp.tags.get(KIND_TAG, "")
        if kind in ("", "no_inferred_type") or kind.endswith("_inferred"):  # made before
            with contextlib.suppress(Exception):  # paperline set the kind, or guessed by the UI
                client.set_experiment_tag(exp.experiment_id, KIND_TAG, CLASSIC_ML)
        return exp.experiment_id
    location = None
    if store_of(root, client.tracking_uri).startswith("sqlite:///"):
        from .storage import experiment_artifact_location

        # S3 storage configured (params `storage:` / PAPERLINE_S3_*): artifacts on the store.
        location = experiment_artifact_location(root, pipeline)
        if location is None:
            # A local store has no artifact server of its own: keep artifacts beside the database
            # (inside the main repo, also when a stage runs in a Prefect workspace, and the same
            # folder whether the store is opened directly or through the stack's server), never
            # in ./mlruns.
            db = store_of(root, client.tracking_uri)[len("sqlite:///"):]
            art = Path(db).parent / "artifacts" / pipeline
            art.mkdir(parents=True, exist_ok=True)
            location = art.as_uri()
    try:
        return client.create_experiment(pipeline, artifact_location=location,
                                        tags={KIND_TAG: CLASSIC_ML})
    except Exception:  # created concurrently by a sibling stage
        exp = client.get_experiment_by_name(pipeline)
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
        self.stage_run_id = uuid.uuid4().hex  # this execution of the stage (gaps, replays)
        self.gap: dict[str, Any] | None = None  # what could not be logged (see module docstring)
        self.gap_file: Path | None = None
        self._tags: dict[str, str] = {}
        self._params: dict[str, str] = {}
        self._exp_id: str | None = None
        self._model_paths: set[str] = set()   # artifact paths register_model used in this run

    def _fail(self, what: str, exc: BaseException) -> None:
        if self.ok:
            error = _redact(f"{type(exc).__name__}: {exc}")  # MLflow's message carries the URL
            log.warning("MLflow tracking unavailable (%s): %s; outputs are still written, the "
                        "rest of this stage's tracking is recorded as a gap", what, error)
            self.gap = {"failed_at": what, "error": error[:500], "ops": []}
        self.ok = False

    def _record(self, op: str, **args: Any) -> None:
        """After a failure: keep what the stage meant to log, for `paperline tracking sync`.
        Files to log (artifacts, a model to register) are kept as they are now: a stage writes
        them in a temporary folder that is renamed, and may be rewritten, before the replay."""
        if self.gap is None:
            return
        if op in ("artifacts", "register_model") and "local_dir" in args:
            args["local_dir"] = snapshot(Path(args["local_dir"]), self.ctx.root,
                                         self.stage_run_id, len(self.gap["ops"]))
        self.gap["ops"].append({"op": op, **args})

    def __enter__(self) -> "StageTracker":
        self.mode = tracking_mode()
        self._started_ms = _now_ms()
        if self.mode == "off":
            self.ok = False
            return self
        tags = {"paperline.pipeline": self.ctx.pipeline, "paperline.stage": self.ctx.stage,
                "paperline.profile": self.ctx.profile, "paperline.seed": str(self.ctx.seed),
                "paperline.stage_run_id": self.stage_run_id}
        try:
            tags["dvc.stage_key"] = stage_key(self.ctx, self.cfg)
            tags["git.commit"] = git_commit(self.ctx.root)
            parent = os.environ.get(PARENT_ENV)
            if parent:
                tags["mlflow.parentRunId"] = parent
            if os.environ.get(FLOW_RUN_ENV):
                tags["prefect.flow_run_id"] = os.environ[FLOW_RUN_ENV]
            self._tags = tags
            flat = _flatten(self.cfg.model_dump(mode="json"))
            flat.update({"profile": self.ctx.profile, "seed": self.ctx.seed})
            self._params = {k: str(v)[:500] for k, v in flat.items()}
            if self.mode == "spool":  # everything is recorded for the parent to replay
                self.ok = False
                self.gap = {"failed_at": "spool", "error": "", "ops": []}
                self._record("params", params=self._params)
                return self

            import mlflow

            configure(self.ctx.root)
            self._exp_id = exp_id = experiment_id(self.ctx.root, self.ctx.pipeline)
            earlier = find_stage_run(exp_id, tags["dvc.stage_key"], parent)
            os.environ.setdefault("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "2")
            if earlier is not None:  # a retry / rerun of this stage: resume, no duplicate run
                run = mlflow.start_run(run_id=earlier.info.run_id, log_system_metrics=True)
                self.run_id, self._mlflow = run.info.run_id, mlflow
                tries = int(earlier.data.tags.get("paperline.attempts", "1")) + 1
                mlflow.set_tags({"paperline.attempts": str(tries),
                                 "paperline.stage_run_id": self.stage_run_id})
                log.info("resuming MLflow run %s of an earlier attempt (attempt %d)",
                         earlier.info.run_id, tries)
            else:
                run = mlflow.start_run(experiment_id=exp_id, run_name=self.ctx.stage, tags=tags,
                                       log_system_metrics=True)
                self.run_id, self._mlflow = run.info.run_id, mlflow
            mlflow.log_params(self._params)
        except Exception as exc:
            self._fail("start", exc)
            self._record("params", params=self._params)
        return self

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        values = {mlflow_key(k): float(v) for k, v in metrics.items()}
        if not (self.ok and self._mlflow):
            self._record("metrics", metrics=values, step=step, timestamp=_now_ms())
            return
        try:
            self._mlflow.log_metrics(values, step=step)
        except Exception as exc:
            self._fail("log_metrics", exc)
            self._record("metrics", metrics=values, step=step, timestamp=_now_ms())

    def log_params(self, params: dict[str, Any]) -> None:
        values = {mlflow_key(k): str(v)[:500] for k, v in _flatten(params).items()}
        if not (self.ok and self._mlflow):
            self._record("params", params=values)
            return
        try:
            self._mlflow.log_params(values)
        except Exception as exc:
            self._fail("log_params", exc)
            self._record("params", params=values)

    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None:
        if not (self.ok and self._mlflow):
            self._record("artifacts", local_dir=str(Path(local_dir).resolve()),
                         artifact_path=artifact_path)
            return
        try:
            self._mlflow.log_artifacts(str(local_dir), artifact_path)
        except Exception as exc:
            self._fail("log_artifacts", exc)
            self._record("artifacts", local_dir=str(Path(local_dir).resolve()),
                         artifact_path=artifact_path)

    def register_model(self, local_dir: Path, name: str, aliases: list[str],
                       tags: dict[str, str] | None = None,
                       artifact_path: str = "model") -> str | None:
        """Log a Hugging Face model folder and register it as a new version of `name`.

        The artifact is the `save_pretrained` folder itself, so `models:/<name>@<alias>` downloads
        to a folder that `from_pretrained` loads. A single file (a fitted profile JSON) is logged
        as the one file of `artifact_path`, so the version downloads to a folder holding it.
        Several models registered by one run each get their own artifact path: a repeated
        `artifact_path` is suffixed with the version's name and aliases.
        """
        if artifact_path in self._model_paths:
            # a second model of this run under the same path would land in the same artifact
            # folder as the first (files merged, the earlier version's source overwritten): give
            # it a path of its own, named after the version (deterministic, like the call)
            suffix = "-".join([name, *aliases])
            artifact_path = f"{artifact_path}-{re.sub(r'[^A-Za-z0-9_.-]+', '-', suffix)}"
        self._model_paths.add(artifact_path)
        tags = {"paperline.pipeline": self.ctx.pipeline, "paperline.profile": self.ctx.profile,
                "paperline.seed": str(self.ctx.seed), **(tags or {}),
                "paperline.model_sha": model_fingerprint(Path(local_dir))}
        record = {"local_dir": str(Path(local_dir).resolve()), "name": name,
                  "aliases": list(aliases), "tags": tags, "artifact_path": artifact_path}
        if not (self.ok and self._mlflow):
            self._record("register_model", **record)
            return None
        try:
            from mlflow import MlflowClient

            version = _register(MlflowClient(), self.run_id, **record)
            return version
        except Exception as exc:
            self._fail("register_model", exc)
            self._record("register_model", **record)
            return None

    def annotate_model(self, local_dir: Path, metrics: dict[str, float]) -> int:
        """Tag every registered version whose weights equal `local_dir` with `metric.<k>` values.

        This is how an evaluation stage attaches its scores to the model in the registry, so the
        MLflow UI and `paperline compare` show them side by side. Returns the versions tagged.
        """
        record = {"sha": model_fingerprint(Path(local_dir)),
                  "metrics": {mlflow_key(k): float(v) for k, v in metrics.items()}}
        if not (self.ok and self._mlflow):
            self._record("annotate_model", **record)
            return 0
        try:
            from mlflow import MlflowClient

            return _annotate(MlflowClient(), **record)
        except Exception as exc:
            self._fail("annotate_model", exc)
            self._record("annotate_model", **record)
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
        status = "FINISHED" if exc_type is None else "FAILED"
        if self._mlflow is not None:
            try:
                if self.ok:
                    self._mlflow.end_run(status=status)
                else:
                    _drop_active_run(self.run_id)
            except Exception as err:
                self._fail("end_run", err)
                _drop_active_run(self.run_id)
        if self.gap is not None:
            self._record("end", status=status, end_ms=_now_ms())
            spooled = self.gap["failed_at"] == "spool"
            uri = _redact(tracking_uri(main_root(self.ctx.root))) if spooled else _safe_uri()
            self.gap_file = write_gap(self.ctx.root, {
                "stage_run_id": self.stage_run_id, "run_id": self.run_id,
                "experiment": self.ctx.pipeline, "run_name": self.ctx.stage,
                "tracking_uri": uri, "store": store_of(self.ctx.root, uri),
                "tags": self._tags, "params": self._params,
                "started_ms": self._started_ms,
                "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **self.gap})
            if spooled:
                log.info("tracking of %s/%s spooled to %s (replayed by the parent)",
                         self.ctx.pipeline, self.ctx.stage, self.gap_file)
                return
            log.warning("MLflow tracking gap: stage %s/%s %s, its outputs are written, but %d "
                        "tracking call(s) from `%s` on did not reach MLflow (%s); recorded in %s: "
                        "run `paperline tracking sync` once MLflow is back",
                        self.ctx.pipeline, self.ctx.stage,
                        "finished" if exc_type is None else "failed", len(self.gap["ops"]),
                        self.gap["failed_at"], self.gap["error"][:200], self.gap_file)


def _now_ms() -> int:
    return int(time.time() * 1000)


def find_stage_run(exp_id: str, key: str, parent: str | None, client: Any = None) -> Any:
    """An earlier run of the same stage (same `dvc.stage_key`) to resume instead of duplicating:
    under a parent run any such run of that parent; without one only an unfinished run."""
    from mlflow import MlflowClient

    client = client or MlflowClient()
    where = f"tags.`dvc.stage_key` = '{key}'"
    if parent:
        where += f" and tags.`mlflow.parentRunId` = '{parent}'"
    runs = client.search_runs([exp_id], filter_string=where, max_results=20,
                              order_by=["attributes.start_time DESC"])
    for run in runs:
        if run.data.tags.get("paperline.method"):
            continue  # a method run under a stage run carries its stage's key too
        if parent or (run.info.status != "FINISHED"
                      and "mlflow.parentRunId" not in run.data.tags):
            return run
    return None


def _register(client: Any, run_id: str, local_dir: str, name: str, aliases: list[str],
              tags: dict[str, str], artifact_path: str) -> str:
    if Path(local_dir).is_file():  # a single-file artefact (a JSON profile): its own folder
        client.log_artifact(run_id, str(local_dir), artifact_path)
    else:
        client.log_artifacts(run_id, str(local_dir), artifact_path)
    try:
        client.create_registered_model(name)
    except Exception:
        pass  # exists already
    source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"
    version = client.create_model_version(name, source=source, run_id=run_id, tags=tags)
    for alias in aliases:
        client.set_registered_model_alias(name, alias, version.version)
    client.set_tag(run_id, f"paperline.registered.{name}", version.version)
    return version.version


def _annotate(client: Any, sha: str, metrics: dict[str, float]) -> int:
    versions = client.search_model_versions(f"tags.`paperline.model_sha` = '{sha}'")
    for v in versions:
        for k, val in metrics.items():
            client.set_model_version_tag(v.name, v.version, f"metric.{k}", f"{float(val):.6g}")
    return len(versions)


def _drop_active_run(run_id: str | None) -> None:
    """Forget the fluent API's active run (and stop its system-metrics thread) without a server."""
    with contextlib.suppress(Exception):
        from mlflow.tracking import fluent

        stack = fluent._active_run_stack.get()
        if stack and stack[-1].info.run_id == run_id:
            stack.pop()
        monitor = fluent.run_id_to_system_metrics_monitor.pop(run_id, None)
        if monitor is not None:
            monitor.finish()


def _redact(text: str) -> str:
    """Any `scheme://user:password@host` in `text` without its user:password part."""
    return re.sub(r"//[^/@\s]*@", "//", text)


def _safe_uri() -> str:
    """The tracking URI without any user:password part."""
    try:
        import mlflow

        return re.sub(r"//[^/@]*@", "//", mlflow.get_tracking_uri())
    except Exception:
        return ""


# ---------------------------------------------------------------------------------------------
# Gaps: what a stage could not log while MLflow was unreachable, replayed by `sync_gaps`


def main_root(root: Path) -> Path:
    """The main repo, also for a stage in a Prefect workspace `<main>/.paperline/workspaces/<n>`
    (removed after the run)."""
    root = Path(root).resolve()
    if root.parent.name == "workspaces" and root.parent.parent.name == ".paperline":
        root = root.parents[2]
    return root


def snapshot(local: Path, root: Path, stage_run_id: str, n: int) -> str:
    """A copy of `local` (a folder or a file) under `.paperline/tracking-gaps/files/`, hard-linked
    where the file system allows (no disk, no time: the stage writes new files, it never edits
    them in place), removed once its gap is replayed."""
    import shutil

    local = Path(local).resolve()
    dest = gaps_dir(root) / "files" / stage_run_id / str(n) / local.name
    if not local.exists():
        return str(local)  # the replay reports it as gone
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
    for f in files:
        target = dest if local.is_file() else dest / f.relative_to(local)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(f, target)
        except OSError:
            shutil.copy2(f, target)
    return str(dest)


def gaps_dir(root: Path) -> Path:
    """`.paperline/tracking-gaps` of the main repo."""
    return main_root(root) / ".paperline" / "tracking-gaps"


def write_gap(root: Path, record: dict[str, Any]) -> Path:
    from .io import write_json

    path = gaps_dir(root) / f"{record['experiment']}.{record['run_name']}." \
                            f"{record['stage_run_id']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, record)
    return path


def list_gaps(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    d = gaps_dir(root)
    if not d.is_dir():
        return []
    gaps = [(p, json.loads(p.read_text())) for p in d.glob("*.json")]
    # replay in recording order: a stage that registers a model before the one annotating it
    return sorted(gaps, key=lambda g: (g[1].get("recorded", ""), g[0].name))


class GapNotReady(Exception):
    """A gap that cannot be replayed faithfully yet (or any more): kept, reported, not retried
    as if MLflow were down."""


def _replay(client: Any, gap: dict[str, Any], root: Path | None = None) -> str:
    """Replay one gap; returns the run id it went into. Idempotent: the run is found again by
    its id, or by the `paperline.stage_run_id` tag it is created with."""
    from mlflow.entities import Param

    run_id = gap.get("run_id")
    spooled = gap["failed_at"] == "spool"
    if not run_id:
        exp_id = experiment_id(root or Path.cwd(), gap["experiment"], client)
        found = client.search_runs(
            [exp_id], filter_string=f"tags.`paperline.stage_run_id` = '{gap['stage_run_id']}'",
            max_results=1)
        tags = dict(gap["tags"])
        parent = tags.get("mlflow.parentRunId")
        if parent and parent.startswith(SPOOL_PARENT):
            parent = tags["mlflow.parentRunId"] = spooled_parent(client, exp_id, parent, gap,
                                                                 root or Path.cwd())
        rerun = (find_stage_run(exp_id, tags["dvc.stage_key"], parent, client)
                 if parent and tags.get("dvc.stage_key") else None)
        if found:
            run_id = found[0].info.run_id
        elif rerun is not None and spooled:  # a retry of a spooled stage: resume that run
            run_id = rerun.info.run_id
            tries = int(rerun.data.tags.get("paperline.attempts", "1")) + 1
            client.set_tag(run_id, "paperline.attempts", str(tries))
            client.set_tag(run_id, "paperline.stage_run_id", gap["stage_run_id"])
        elif rerun is not None:  # the stage ran again under the same parent after recovery
            return rerun.info.run_id  # superseded: that run is the record, no second one
        else:
            if not spooled:
                tags["paperline.replayed"] = "true"
            run_id = client.create_run(exp_id, tags=tags, run_name=gap["run_name"],
                                       start_time=gap.get("started_ms")).info.run_id
    if not spooled:
        client.set_tag(run_id, "paperline.tracking_gap", f"replayed: failed at {gap['failed_at']}")
    have = client.get_run(run_id).data.params
    status, end_ms = "FINISHED", None
    for op in gap["ops"]:
        kind = op["op"]
        if kind == "params":
            new = [Param(k, v) for k, v in op["params"].items() if k not in have]
            for i in range(0, len(new), 100):
                client.log_batch(run_id, params=new[i:i + 100])
            have.update({p.key: p.value for p in new})
        elif kind == "metrics":
            _log_new_metrics(client, run_id, op["metrics"], op["timestamp"], op["step"])
        elif kind == "artifacts":
            # a replay repeated after its snapshot was removed: done already if logged
            if not Path(op["local_dir"]).exists():
                if client.list_artifacts(run_id, op["artifact_path"]):
                    continue
                raise GapNotReady(f"{op['local_dir']} is gone: its artifacts cannot be logged")
            client.log_artifacts(run_id, op["local_dir"], op["artifact_path"])
        elif kind == "register_model":
            if _registered(client, run_id, op["name"], op["artifact_path"]):
                continue  # registered by an earlier replay (its snapshot may be gone since)
            local = Path(op["local_dir"])
            sha = op["tags"].get("paperline.model_sha")
            if not local.exists() or (sha and model_fingerprint(local) != sha):
                raise GapNotReady(f"{local} is gone or changed since the stage ran: model "
                                  f"{op['name']} would be registered from other weights")
            _register(client, run_id, **{k: v for k, v in op.items() if k != "op"})
        elif kind == "annotate_model":
            if _annotate(client, op["sha"], op["metrics"]) == 0:
                raise GapNotReady(f"no registered model version has sha {op['sha']} yet")
        elif kind == "method_run":
            _replay_method_run(client, run_id, gap, op)
        elif kind == "end":
            status, end_ms = op["status"], op.get("end_ms")
    run = client.get_run(run_id)
    own = run.data.tags.get("paperline.stage_run_id") in (None, gap["stage_run_id"])
    if own or run.info.status == "RUNNING":  # never overwrite a retry's own final status
        client.set_terminated(run_id, status=status, end_time=end_ms)
    if any(op["op"] == "close_children" for op in gap["ops"]):  # a parent's close (a gap)
        kill_running_children(client, run_id, end_ms)
    return run_id


def _parent_file(root: Path, token: str) -> Path:
    name = re.sub(r"[^A-Za-z0-9_-]", "_", token)
    return gaps_dir(root).parent / "tracking-parents" / f"{name}.json"


def spool_parent(root: Path, pipeline: str, tags: dict[str, str] | None = None) -> str:
    """A token standing for the parent run of one execution whose stages spool their tracking;
    MLflow is not touched: the run is created when the first stage is replayed
    (`spooled_parent`), with these tags and this start time."""
    from .io import write_json

    token = f"{SPOOL_PARENT}{uuid.uuid4().hex}"
    write_json(_parent_file(root, token), {
        "pipeline": pipeline, "token": token, "started_ms": _now_ms(),
        "pid": _process_id(os.getpid()),
        "tags": {"paperline.pipeline": pipeline, "paperline.kind": "pipeline",
                 "git.commit": git_commit(root), **(tags or {})}})
    return token


@contextlib.contextmanager
def warm_for_replay(root: Path, poll_s: float = 0.5) -> Iterator[None]:
    """While `paperline repro` waits on `dvc repro`: once a stage has spooled its run, import
    MLflow and open the tracking store in a thread, so that `finish_spooled_parent` starts warm
    (import and store set-up cost ~5 s on 2 cores, after every execution). A repro with nothing
    to run never imports MLflow, as before. The thread logs nothing; opening an embedded SQLite
    store creates its file and tables, as the replay would. On a normal exit it is joined before
    the caller goes on (the replay then finds the store cached); on an exception (Ctrl-C) it is
    left behind, a daemon."""
    import sys
    import threading

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # read when MLflow is imported
    stop = threading.Event()
    spool = gaps_dir(root)

    def warm() -> None:
        while not stop.wait(poll_s):
            if any(spool.glob("*.json")):
                with contextlib.suppress(Exception):  # the replay reports any real problem
                    from mlflow import MlflowClient

                    MlflowClient(tracking_uri=tracking_uri(root))  # the store, cached by URI
                return

    thread = threading.Thread(target=warm, name="paperline-mlflow-warm", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        if sys.exc_info()[0] is None:
            thread.join()


def finish_spooled_parent(root: Path, token: str, ok: bool) -> dict[str, int]:
    """After the execution: replay what its stages spooled (and any older gap) and close its
    parent run. Nothing ran (everything up to date): no run is created and MLflow is not
    touched. Returns `sync_gaps`'s counts, and `parent_run_id` when a parent run was made."""
    from .io import write_json

    record_file = _parent_file(root, token)
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    write_json(record_file, {**record, "status": "FINISHED" if ok else "FAILED",
                             "end_ms": _now_ms()})
    out = {"replayed": 0, "left": 0}
    if any(g["tags"].get("mlflow.parentRunId") == token for _, g in list_gaps(root)):
        out = sync_gaps(root, quiet=True)
        with contextlib.suppress(Exception):  # created by an earlier sync, before the end
            from mlflow import MlflowClient

            client = MlflowClient()
            exp = client.get_experiment_by_name(record.get("pipeline", ""))
            for run in client.search_runs([exp.experiment_id], filter_string=(
                    f"tags.`paperline.spool_parent` = '{token}'"), max_results=1):
                out["parent_run_id"] = run.info.run_id
                if run.info.status == "RUNNING":
                    close_run(client, run.info.run_id, "FINISHED" if ok else "FAILED")
    if not any(g["tags"].get("mlflow.parentRunId") == token for _, g in list_gaps(root)):
        record_file.unlink(missing_ok=True)  # replayed (or nothing to replay): done
    return out


def _process_id(pid: int) -> str:
    """`<pid> <create time>`: a reused PID is never taken for the process that wrote it."""
    try:
        import psutil

        return f"{pid} {psutil.Process(pid).create_time()}"
    except Exception:
        return f"{pid} ?"


def _gone(record: dict[str, Any]) -> bool:
    """Whether the execution that wrote a spooled parent's record has ended without closing it
    (`paperline repro` killed): its process is gone."""
    if record.get("status") or not record.get("pid"):
        return False
    pid = int(record["pid"].split()[0])
    return _process_id(pid) != record["pid"]


def close_abandoned_parents(client: Any, root: Path) -> int:
    """Parent runs of spooled executions whose `paperline repro` died before closing them: KILLED
    (their stage runs, replayed, keep their own status). Returns how many were closed."""
    closed = 0
    pending = {g["tags"].get("mlflow.parentRunId") for _, g in list_gaps(root)}
    for path in sorted((gaps_dir(root).parent / "tracking-parents").glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        token = record.get("token")
        if not token or not _gone(record):
            continue
        exp = client.get_experiment_by_name(record.get("pipeline", ""))
        found = client.search_runs([exp.experiment_id], filter_string=(
            f"tags.`paperline.spool_parent` = '{token}'"), max_results=1) if exp else []
        if found and found[0].info.status == "RUNNING":
            close_run(client, found[0].info.run_id, "KILLED")
            closed += 1
        if token not in pending:
            path.unlink(missing_ok=True)
    return closed


def spooled_parent(client: Any, exp_id: str, token: str, gap: dict[str, Any],
                   root: Path) -> str:
    """The parent run of a spooled execution (`PAPERLINE_PARENT_RUN_ID=spool:<token>`): found by
    its token, or created now from the record `spool_parent` left (closed at once when the
    execution has ended)."""
    found = client.search_runs([exp_id], filter_string=f"tags.`paperline.spool_parent` = "
                                                        f"'{token}'", max_results=1)
    if found:
        return found[0].info.run_id
    record_file = _parent_file(root, token)
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    tags = {"paperline.pipeline": gap["experiment"], "paperline.kind": "pipeline",
            **record.get("tags", {}), "paperline.spool_parent": token}
    run_id = client.create_run(exp_id, tags=tags, run_name=f"{gap['experiment']}-pipeline",
                               start_time=record.get("started_ms", gap.get("started_ms"))
                               ).info.run_id
    if record.get("status"):
        client.set_terminated(run_id, status=record["status"], end_time=record.get("end_ms"))
    elif _gone(record):  # its `paperline repro` was killed: no one else will close it
        client.set_terminated(run_id, status="KILLED")
    return run_id


def _registered(client: Any, run_id: str, name: str, artifact_path: str) -> bool:
    """Whether `run_id` already registered `artifact_path` as a version of `name` (several arms
    register versions of one name from one run, each under its own artifact path)."""
    try:
        versions = client.search_model_versions(f"name = '{name}'")
    except Exception:
        return False
    return any(v.run_id == run_id and (v.source or "").rstrip("/").endswith("/" + artifact_path)
               for v in versions)


def _replay_method_run(client: Any, parent_id: str, gap: dict[str, Any], op: dict) -> None:
    run_id = op.get("run_id")
    key = f"{gap['stage_run_id']}/{op['group']}/{op['method']}/{op['seed']}"
    if not run_id:
        parent = client.get_run(parent_id)
        found = client.search_runs([parent.info.experiment_id],
                                   filter_string=f"tags.`paperline.method_run_key` = '{key}'",
                                   max_results=1)
        if found:
            run_id = found[0].info.run_id
        else:
            client.set_tag(parent_id, "paperline.aggregate", "true")
            tags = {"mlflow.parentRunId": parent_id,
                    "mlflow.runName": f"{op['method']}/seed{op['seed']}",
                    "paperline.pipeline": gap["experiment"], "paperline.stage": op["group"],
                    "paperline.method": op["method"], "paperline.seed": str(op["seed"]),
                    "paperline.profile": gap["tags"].get("paperline.profile", ""),
                    "paperline.source_stage": gap["run_name"],
                    "dvc.stage_key": gap["tags"].get("dvc.stage_key", ""),
                    "paperline.method_run_key": key}
            run_id = client.create_run(parent.info.experiment_id, tags=tags).info.run_id
    # the params the run lacks, also when an earlier replay made the run and stopped part-way
    from mlflow.entities import Param

    have = client.get_run(run_id).data.params
    params = [Param(k, str(v)) for k, v in op["params"].items() if k not in have]
    for i in range(0, len(params), 100):  # one write per 100, not one per param
        client.log_batch(run_id, params=params[i:i + 100])
    for m in op["metrics"]:
        _log_new_metrics(client, run_id, m["metrics"], m["timestamp"], m["step"])
    client.set_terminated(run_id, status=op.get("status", "FINISHED"))


def _log_new_metrics(client: Any, run_id: str, metrics: dict[str, float], timestamp: int,
                     step: int | None) -> None:
    """Log the values the run does not hold yet (same key, step and value): a replay repeated, or
    a call that timed out on the client but reached the server, adds nothing."""
    from mlflow.entities import Metric

    logged = client.get_run(run_id).data.metrics  # a key absent here has no history to read
    new = []
    for k, v in metrics.items():
        have = {(m.step, m.value) for m in client.get_metric_history(run_id, k)} \
            if k in logged else set()
        if (int(step or 0), float(v)) not in have:
            new.append(Metric(k, float(v), timestamp, int(step or 0)))
    if new:
        client.log_batch(run_id, metrics=new)


def sync_gaps(root: Path, quiet: bool = False) -> dict[str, int]:
    """Replay every recorded gap into MLflow; a replayed gap's file is removed. Returns
    {"replayed": n, "left": n}. Safe to run again (see `_replay`)."""
    gaps = list_gaps(root)
    out = {"replayed": 0, "left": len(gaps)}
    if not gaps:
        return out
    from mlflow import MlflowClient

    uri = configure(root)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    here = store_of(root, uri)
    for path, gap in gaps:
        # the local stack's server and the embedded file are one store (`store_of`)
        there = gap.get("store") or (gap.get("tracking_uri") and store_of(root,
                                                                         gap["tracking_uri"]))
        if there and there != here:
            log.warning("gap %s was recorded against %s, not %s: left for that server",
                        path.name, there, here)
            continue
        try:
            run_id = _replay(client, gap, root)
        except GapNotReady as exc:
            log.warning("gap %s kept (`paperline tracking gaps` lists it): %s", path.name, exc)
            continue
        except Exception as exc:
            log.warning("MLflow still unreachable, gap %s left for later: %s", path.name,
                        _redact(str(exc)))
            break
        path.unlink()
        import shutil

        shutil.rmtree(gaps_dir(root) / "files" / str(gap.get("stage_run_id")), ignore_errors=True)
        out["replayed"] += 1
        out["left"] -= 1
        if not quiet:
            print(f"replayed {gap['experiment']}/{gap['run_name']} ({len(gap['ops'])} calls) "
                  f"into run {run_id}")
    with contextlib.suppress(Exception):  # parents of a killed `paperline repro`: not RUNNING
        close_abandoned_parents(client, root)
    return out


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


_PARENT_PIPELINE: dict[str, str] = {}  # parent run id -> pipeline, for a gap of its close


def start_parent_run(root: Path, pipeline: str, tags: dict[str, str] | None = None) -> str | None:
    """Create the parent run of one pipeline execution; returns its id (None if tracking is down).

    Pass the id to stage processes in `PAPERLINE_PARENT_RUN_ID`.
    """
    try:
        from mlflow import MlflowClient

        configure(root)
        exp_id = experiment_id(root, pipeline, MlflowClient())
        all_tags = {"paperline.pipeline": pipeline, "paperline.kind": "pipeline",
                    "git.commit": git_commit(root)}
        all_tags.update(tags or {})
        run = MlflowClient().create_run(exp_id, tags=all_tags, run_name=f"{pipeline}-pipeline")
        _PARENT_PIPELINE[run.info.run_id] = pipeline
        return run.info.run_id
    except Exception as exc:
        log.warning("MLflow tracking unavailable (parent run): %s", exc)
        return None


def end_parent_run(root: Path, run_id: str | None, ok: bool) -> None:
    """Close the parent run, FINISHED or FAILED, and mark its runs still RUNNING as KILLED
    (`close_run`). MLflow unreachable: the close is recorded as a gap, and `paperline tracking
    sync` (or the next `paperline repro`) does it with this end time: no run is left RUNNING."""
    if not run_id:
        return
    status, end_ms = ("FINISHED" if ok else "FAILED"), _now_ms()
    try:
        from mlflow import MlflowClient

        configure(root)
        close_run(MlflowClient(), run_id, status, end_ms)
    except Exception as exc:
        error = _redact(f"{type(exc).__name__}: {exc}")
        pipeline = _PARENT_PIPELINE.get(run_id, "pipeline")
        uri = _safe_uri()
        path = write_gap(root, {
            "stage_run_id": uuid.uuid4().hex, "run_id": run_id, "experiment": pipeline,
            "run_name": f"{pipeline}-pipeline", "tracking_uri": uri, "store": store_of(root, uri),
            "tags": {}, "params": {}, "started_ms": end_ms,
            "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "failed_at": "end_parent_run", "error": error[:500],
            "ops": [{"op": "end", "status": status, "end_ms": end_ms}, {"op": "close_children"}]})
        log.warning("MLflow tracking unavailable (end parent run): %s; the close (%s) is recorded "
                    "in %s: `paperline tracking sync` replays it", error[:200], status, path)


def close_run(client: Any, run_id: str, status: str, end_ms: int | None = None) -> int:
    """Terminate `run_id` with `status`, and every run below it (stage runs, their method runs)
    that is still RUNNING as KILLED: when a parent closes, the processes that would have closed
    them are gone (a stage killed mid-run, a retry that was restored from the cache instead).
    Returns how many runs below were killed."""
    client.set_terminated(run_id, status=status, end_time=end_ms)
    return kill_running_children(client, run_id, end_ms)


def kill_running_children(client: Any, run_id: str, end_ms: int | None = None) -> int:
    exp_id = client.get_run(run_id).info.experiment_id
    todo, killed = [run_id], 0
    while todo:
        below = client.search_runs([exp_id], f"tags.mlflow.parentRunId = '{todo.pop()}'",
                                   max_results=5000)
        for run in below:
            todo.append(run.info.run_id)
            if run.info.status in ("RUNNING", "SCHEDULED"):
                client.set_terminated(run.info.run_id, status="KILLED", end_time=end_ms)
                client.set_tag(run.info.run_id, "paperline.closed_by",
                               "its parent run closed while it was still running")
                killed += 1
    if killed:
        log.warning("%d run(s) under %s were still RUNNING when it closed: marked KILLED",
                    killed, run_id)
    return killed


class MethodRun:
    """One (method, seed) child run under a stage run; see `StageTracker.method_run`."""

    def __init__(self, tracker: StageTracker, group: str, method: str, seed: int,
                 params: dict[str, Any] | None):
        self.tracker = tracker
        self.run_id: str | None = None
        self.record: dict[str, Any] = {"group": group, "method": method, "seed": seed,
                                       "params": {mlflow_key(k): str(v)[:500] for k, v in
                                                  _flatten(params or {}).items()},
                                       "metrics": []}
        self._gap = False
        if not (tracker.ok and tracker._mlflow and tracker.run_id):
            self._gap = tracker.gap is not None
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
            self.run_id, self._gap = None, True  # replayed whole (a partial run stays partial)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        now = _now_ms()
        values = {mlflow_key(k): float(v) for k, v in metrics.items()}
        self.record["metrics"].append({"metrics": values, "step": int(step or 0),
                                       "timestamp": now})
        if self.run_id is None or not self.tracker.ok:  # down: recorded, replayed later
            if self.run_id is not None and not self._gap:
                self.record["run_id"], self._gap = self.run_id, True
            return
        try:
            from mlflow.entities import Metric

            self._client.log_batch(self.run_id, metrics=[
                Metric(k, v, now, int(step or 0)) for k, v in values.items()])
        except Exception as exc:
            self.tracker._fail("method_run.log_metrics", exc)
            self.record["run_id"], self._gap = self.run_id, True  # replay into this run

    def end(self, status: str) -> None:
        if self._gap:
            self.tracker._record("method_run", **self.record, status=status)
        if self.run_id is None:
            return
        try:
            self._client.set_terminated(self.run_id, status=status)
        except Exception as exc:
            self.tracker._fail("method_run.end", exc)
            if not self._gap:
                self.tracker._record("method_run", **self.record, run_id=self.run_id,
                                     status=status)
        self.run_id = None
