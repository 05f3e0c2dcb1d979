"""Run a pipeline on Prefect workers that each have their own clone of the repo (scale-out).

    paperline worker start cpu-1 --pool paperline-cpu --repo <git url>   # on each worker host
    paperline worker start gpu-1 --pool paperline-gpu --repo <git url>   # one per GPU
    paperline run <pipeline> --distributed        # from the main workspace (clean git tree)
    paperline worker status | stop <name>

Three pieces:

- **Workers.** A worker is a real `prefect worker start --type process --limit 1` whose working
  directory is its own clone of the repo, as a separate host would have (`start_worker`; its clone
  defaults to `.paperline/workers/<name>/repo`). `--limit 1`: a clone is one working tree, so it
  runs one stage at a time. The worker's environment carries the S3 credentials (never its
  command line) and `PAPERLINE_WORKER_NAME`; its clone gets the DVC remote in
  `.dvc/config.local` (`paperline remote setup --local`).
- **`stage_flow`** (flow `paperline-stage`, deployments `paperline-stage/paperline-cpu` and
  `paperline-stage/paperline-gpu`, entrypoint `flows.distributed.stage_flow`, no pull steps: the
  orchestration code is the worker's installed paperline; the stage runs in the worker's clone,
  `PAPERLINE_ROOT`, with that clone's code). It runs ONE stage: `git fetch` + `git checkout
  --force --detach <commit>` (the commit the controlling flow pinned), a read-only S3 preflight,
  `dvc repro --pull <stage>` (upstream stages are restored from the remote run-cache, the stage
  itself runs, or is restored when someone already ran it), and only when that exits 0,
  `dvc push --run-cache <stage>`. A stage killed halfway therefore never reaches the remote: its
  outputs enter the cache only through DVC's commit after the command succeeded, and the push
  comes after that. The flow run ends `Completed` with a JSON message (ran|restored, seconds,
  worker).
- **`distributed_flow`** (flow `paperline-distributed`), in the main workspace. It reads the plan
  from DVC (`flows.runner.load_plan`, the same as the local runner), refuses a git tree with
  uncommitted source changes (workers would compute another version), pins `HEAD`, pushes the
  outputs of up-to-date upstream stages so workers can restore them, and submits one Prefect task
  per stage (upstream first). A task sends its stage with `run_deployment` to the pool that
  `flows.runner.route_stage` picks: `meta: {gpus: N}` -> `paperline-gpu`, else `paperline-cpu`;
  CPU stages never queue behind GPU stages, whose pool has its own workers. Independent stages run
  at once, on as many workers as the pools have. Last, under a file lock on the main workspace,
  `dvc repro --pull` there restores every output from the remote run-cache, so outputs and
  `dvc.lock` equal a sequential local `dvc repro`.

Faults. The controlling task watches its stage's flow run. A run that fails or crashes (the
worker reports it) is retried (`retries`, as a new flow run: on any worker of the pool). A worker
that dies with its stage (host lost, `kill -9`) cannot report anything: its flow run carries the
tag `worker:<name>` and the worker stops heart-beating (`PREFECT_WORKER_HEARTBEAT_SECONDS`); once
its last heartbeat is older than 3 intervals + 5 s, the run is marked `Crashed` and the stage is
retried. Two flow runs of the same pipeline at once: both compute (identical, content-addressed
pushes), and their main-workspace phases take turns (`.paperline/distributed.lock`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.runner import (
    PipelineFailed,
    RunSummary,
    StagePlan,
    _base_env,
    _stream,
    _table,
    dvc_executable,
    dvcfile_of,
    load_plan,
    outcome_of,
    route_stage,
)
from stages.core.config import find_root

CPU_POOL = "paperline-cpu"
GPU_POOL = "paperline-gpu"
POOLS = {"cpu": CPU_POOL, "gpu": GPU_POOL}
STAGE_FLOW = "paperline-stage"
ENTRYPOINT = "flows.distributed.stage_flow"     # a module path: no pull steps, the clone's cwd
WORKER_ENV = "PAPERLINE_WORKER_NAME"
WORKERS = Path(".paperline") / "workers"
MAIN_LOCK = Path(".paperline") / "distributed.lock"


# ---------------------------------------------------------------------------------------------
# Git: the main workspace must be what the workers check out


def _git(root: Path, *args: str, timeout: int = 120) -> str:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"`git {' '.join(args)}` in {root} failed: {proc.stderr.strip()}")
    return proc.stdout


def uncommitted_sources(root: Path) -> list[str]:
    """Changed or untracked (not ignored) files other than what DVC itself writes (`dvc.lock`,
    `.gitignore`, stage outputs such as `cache: false` metrics): with any of them, workers
    would compute another version."""
    from flows.runner import repo_outs

    out = _git(root, "status", "--porcelain", "--untracked-files=all")
    paths = [line[3:].split(" -> ")[-1].strip('"') for line in out.splitlines() if line]
    paths = [p for p in paths if Path(p).name not in ("dvc.lock", ".gitignore")
             and not p.startswith(".paperline/")]  # paperline's own state: locks, workers
    if paths:
        outs = repo_outs(Path(root).resolve())
        paths = [p for p in paths if not any(p == o or p.startswith(o + "/") for o in outs)]
    return paths


def pinned_commit(root: Path) -> str:
    dirty = uncommitted_sources(root)
    if dirty:
        shown = ", ".join(dirty[:5]) + (f" (+{len(dirty) - 5} more)" if len(dirty) > 5 else "")
        raise RuntimeError(f"uncommitted changes in {root}: {shown}. Workers check out a commit: "
                           f"commit (and push) them first, or run locally (`paperline run`)")
    return _git(root, "rev-parse", "HEAD").strip()


# ---------------------------------------------------------------------------------------------
# The stage flow: one stage, in a worker's own clone


def _tag_self(worker: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if not flow_run.id:
        return
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run.id)
        client.update_flow_run(flow_run.id, tags=sorted({*run.tags, f"worker:{worker}"}))


@flow(name=STAGE_FLOW, persist_result=False, log_prints=False)
def stage_flow(commit: str, target: str, addressing: str, force: bool = False,
               upstream: list[str] | None = None,
               tracking: dict[str, str] | None = None) -> Any:
    """Run one DVC stage (`target`, `<dvc.yaml path>:<name>`) at git `commit` in this worker's
    clone (`PAPERLINE_ROOT`, else the working directory) and push its outputs and run-cache."""
    from prefect.states import Completed

    from stages.core import storage

    logger = get_run_logger()
    started = time.monotonic()
    if os.environ.get("PREFECT__FLOW_RUN_ID"):  # a worker's flow-run process
        # kill -9 of the worker (a lost host) must not leave this process finishing the stage
        # behind the retry's back: it dies with the worker; its dvc dies with it
        # (`kill_with_parent` in `_stream`), and the stage with its dvc (`python -m stages`).
        from stages.core.proc import die_with_parent

        die_with_parent()
    root = Path(os.environ.get("PAPERLINE_ROOT") or os.getcwd()).resolve()
    worker = os.environ.get(WORKER_ENV) or socket.gethostname()
    _tag_self(worker)
    logger.info("worker %s, clone %s, commit %s", worker, root, commit[:12])
    _git(root, "fetch", "-q", "origin")
    try:
        _git(root, "checkout", "-q", "--force", "--detach", commit)
    except RuntimeError as exc:
        raise RuntimeError(f"commit {commit} is not in the worker's origin: push it ({exc})")
    settings = storage.require_settings(root)
    storage.preflight(settings)  # unreachable store / refused credentials: say so, before work

    env = _base_env(root)
    env["PAPERLINE_ROOT"] = str(root)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    if tracking:  # an MLflow server both sides reach: stage runs go under the parent run
        from stages.core.tracking import FLOW_RUN_ENV, PARENT_ENV

        env["MLFLOW_TRACKING_URI"] = tracking["uri"]
        env[PARENT_ENV] = tracking.get("parent", "")
        env[FLOW_RUN_ENV] = tracking.get("flow_run", "")
    dvc = dvc_executable()
    lines: list[str] = []
    if force and upstream:
        rc, lines = _stream([dvc, "repro", "--pull", *upstream], root, env, logger)
        if rc != 0:
            raise RuntimeError(f"restoring the upstream of {addressing} failed (exit {rc})")
    cmd = [dvc, "repro", "--pull", target, *(["--force", "--single-item"] if force else [])]
    rc, out = _stream(cmd, root, env, logger)
    lines += out
    if rc != 0:  # nothing was pushed: the remote never sees a failed or partial stage
        tail = "\n".join(lines[-5:])
        raise RuntimeError(f"`dvc repro {target}` failed (exit {rc}) on worker {worker}:\n{tail}")
    rc, _ = _stream([dvc, "push", "--run-cache", "-r", settings.remote, target], root, env, logger)
    if rc != 0:
        raise RuntimeError(f"`dvc push` of {addressing} to {settings.where} failed (exit {rc})")
    state = outcome_of(lines, addressing)
    result = {"state": "skipped" if state == "unchanged" else state,
              "seconds": round(time.monotonic() - started, 2), "worker": worker}
    return Completed(message=json.dumps(result))


def ensure_stage_deployments(pools: dict[str, str] | None = None) -> list[str]:
    """Work pools (type process) and deployment `paperline-stage/<pool>` on each; returns names."""
    from prefect.client.orchestration import get_client
    from prefect.utilities.callables import parameter_schema

    from flows.deploy import ensure_work_pool

    names = []
    schema = parameter_schema(stage_flow.fn).model_dump()
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name(STAGE_FLOW)
        for pool in dict.fromkeys((pools or POOLS).values()):
            ensure_work_pool(pool)
            client.create_deployment(  # an upsert by (flow, name)
                flow_id=flow_id, name=pool, work_pool_name=pool, entrypoint=ENTRYPOINT,
                pull_steps=[], parameter_openapi_schema=schema, tags=["paperline"],
                description="one DVC stage in the worker's own clone (flows/distributed.py)")
            names.append(f"{STAGE_FLOW}/{pool}")
    return names


# ---------------------------------------------------------------------------------------------
# The controlling flow


@dataclass
class _DRun:
    root: Path
    commit: str
    pools: dict[str, str]
    force: bool
    stage_timeout: float
    tracking: dict[str, str] | None
    stages: dict[str, StagePlan] = field(default_factory=dict)


_DRUNS: dict[str, _DRun] = {}


@contextlib.contextmanager
def main_lock(root: Path) -> Iterator[None]:
    """Phases that touch the main workspace's DVC state take turns across flow runs."""
    path = Path(root) / MAIN_LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def worker_offline(client: Any, pool: str, name: str) -> bool:
    """True when worker `name` of `pool` stopped heart-beating (3 intervals + 5 s)."""
    workers = [w for w in client.read_workers_for_work_pool(pool, limit=200) if w.name == name]
    if not workers:
        return True
    w = workers[0]
    interval = float(w.heartbeat_interval_seconds or 30)
    last = w.last_heartbeat_time
    if last is None:
        return True
    age = (datetime.now(timezone.utc) - last).total_seconds()
    return age > 3 * interval + 5


def _watch(flow_run_id: Any, pool: str, timeout: float, logger: Any) -> dict[str, Any]:
    """Wait for the stage's flow run; raise (so the task retries) if it fails, crashes, loses its
    worker or outlasts `timeout`."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Crashed

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            state = run.state
            if state is not None and state.is_final():
                if state.is_completed():
                    return json.loads(state.message or "{}")
                raise RuntimeError(f"stage flow run {run.name} ({flow_run_id}) ended "
                                   f"{state.type.value}: {state.message}")
            workers = [t.split(":", 1)[1] for t in run.tags if t.startswith("worker:")]
            if state is not None and state.is_running() and workers \
                    and worker_offline(client, pool, workers[0]):
                msg = f"worker {workers[0]} of pool {pool} stopped heart-beating"
                # not forced: a run that finished meanwhile (a loaded worker heart-beats late)
                # keeps its final state, and the next round reads it
                result = client.set_flow_run_state(flow_run_id, Crashed(message=msg))
                if result.status.value == "ACCEPT":
                    raise RuntimeError(f"stage flow run {run.name} ({flow_run_id}): {msg}")
                continue
            if time.monotonic() > deadline:
                client.set_flow_run_state(flow_run_id, Cancelled(message="stage timeout"),
                                          force=True)
                raise TimeoutError(f"stage flow run {run.name} ({flow_run_id}) did not finish in "
                                   f"{timeout:.0f} s (is a worker serving pool {pool!r}?)")
            time.sleep(1.0)


@task(cache_policy=NO_CACHE, persist_result=False, log_prints=False)
def _dispatch_task(run_key: str, target: str) -> dict[str, Any]:
    from prefect.deployments import run_deployment

    run = _DRUNS[run_key]
    stage = run.stages[target]
    logger = get_run_logger()
    if stage.action == "skip":
        logger.info("%s is up to date (DVC): skipped", stage.addressing)
        return {"state": "skipped", "seconds": 0.0}
    pool = route_stage(stage, run.pools)
    fr = run_deployment(
        f"{STAGE_FLOW}/{pool}", timeout=0, flow_run_name=stage.name,
        tags=["paperline", f"stage:{stage.name}"],
        parameters={"commit": run.commit, "target": stage.target,
                    "addressing": stage.addressing, "force": run.force,
                    "upstream": stage.upstream, "tracking": run.tracking})
    logger.info("%s -> pool %s (flow run %s)", stage.name, pool, fr.id)
    result = _watch(fr.id, pool, run.stage_timeout, logger)
    result["pool"] = pool
    result["flow_run_id"] = str(fr.id)
    return result


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="dvc repro --pull (main)")
def _restore_main(root: str, targets: list[str], single_item: bool) -> list[str]:
    """Restore the outputs into the main workspace from the remote run-cache; returns the stages
    DVC had to compute here (not run-cacheable)."""
    logger = get_run_logger()
    repo = Path(root)
    env = dict(_base_env(repo), PAPERLINE_ROOT=str(repo))
    cmd = [dvc_executable(), "repro", "--pull", *targets,
           *(["--single-item"] if single_item else [])]
    with main_lock(repo):
        rc, lines = _stream(cmd, repo, env, logger)
    if rc != 0:
        raise RuntimeError(f"`dvc repro --pull` in the main workspace failed (exit {rc})")
    return [line.split("'")[1] for line in lines if line.startswith("Running stage '")]


def _push_upstream(repo: Path, plan: list[StagePlan], remote: str, logger: Any) -> None:
    """Up-to-date stages that running stages depend on: their outputs and run-cache go to the
    remote first, so a worker restores instead of recomputing them."""
    needed = {u for s in plan if s.action == "run" for u in s.upstream}
    skip = [s.target for s in plan if s.action == "skip" and s.target in needed]
    if not skip:
        return
    env = dict(_base_env(repo), PAPERLINE_ROOT=str(repo))
    rc, _ = _stream([dvc_executable(), "push", "--run-cache", "-r", remote, *skip], repo, env,
                    logger)
    if rc != 0:
        raise RuntimeError(f"pushing up-to-date upstream stages failed (exit {rc})")


@flow(name="paperline-distributed", persist_result=False, log_prints=False)
def distributed_flow(pipeline: str, root: str | None = None, targets: list[str] | None = None,
                     retries: int = 1, force: bool = False, stage_timeout: float = 3600.0,
                     cpu_pool: str = CPU_POOL, gpu_pool: str = GPU_POOL) -> dict[str, Any]:
    """Execute pipeline `pipeline` on the workers of `cpu_pool` / `gpu_pool`; see module doc."""
    from prefect.runtime import flow_run
    from prefect.task_runners import ThreadPoolTaskRunner

    from stages.core import storage
    from stages.core.tracking import end_parent_run, start_parent_run

    logger = get_run_logger()
    started = time.monotonic()
    repo = find_root(root or os.environ.get("PAPERLINE_ROOT") or None)
    pools = {"cpu": cpu_pool, "gpu": gpu_pool}
    settings = storage.require_settings(repo)
    storage.preflight(settings, write=True)
    commit = pinned_commit(repo)
    with main_lock(repo):
        plan = load_plan(repo, pipeline, targets, force)
        _push_upstream(repo, plan, settings.remote, logger)
    todo = [s for s in plan if s.action == "run"]
    logger.info("pipeline %s at %s: %d stages, %d to run on pools %s", pipeline, commit[:12],
                len(plan), len(todo), sorted({route_stage(s, pools) for s in todo}))
    flow_run_id = str(flow_run.id) if flow_run.id else None
    parent = None
    tracking = None
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    # A parent run only on an MLflow server, which the workers reach too: with the embedded
    # store (a file in the main workspace) no stage of a worker could log under it.
    if todo and uri.startswith(("http://", "https://")):
        parent = start_parent_run(repo, pipeline, tags={
            "prefect.flow_run_id": flow_run_id or "", "paperline.executor": "prefect-workers"})
        if parent:
            tracking = {"uri": uri, "parent": parent, "flow_run": flow_run_id or ""}
    key = uuid.uuid4().hex
    _DRUNS[key] = _DRun(root=repo, commit=commit, pools=pools, force=force,
                        stage_timeout=stage_timeout, tracking=tracking,
                        stages={s.target: s for s in plan})
    summary: dict[str, dict[str, Any]] = {}
    ok = False
    try:
        futures: dict[str, Any] = {}
        with ThreadPoolTaskRunner(max_workers=max(len(plan), 1)) as runner:
            for s in plan:
                t = _dispatch_task.with_options(name=s.name, task_run_name=s.name,
                                                retries=retries, retry_delay_seconds=1)
                futures[s.target] = runner.submit(
                    t, {"run_key": key, "target": s.target},
                    wait_for=[futures[u] for u in s.upstream])
            for s in plan:
                futures[s.target].wait()
                state = futures[s.target].state
                if state.is_completed():
                    summary[s.name] = state.result()
                elif state.is_failed() or state.is_crashed():
                    summary[s.name] = {"state": "failed", "seconds": 0.0,
                                       "error": str(state.message)}
                else:
                    summary[s.name] = {"state": "blocked", "seconds": 0.0}
        failed = [n for n, v in summary.items() if v["state"] in ("failed", "blocked")]
        done = [s for s in plan if summary[s.name]["state"] in ("ran", "restored")]
        if done:
            if failed:
                recomputed = _restore_main(str(repo), [s.target for s in done], True)
            else:
                dvcfile = dvcfile_of(repo, pipeline)
                tgts = [f"{dvcfile}:{t}" for t in targets] if targets else [dvcfile]
                recomputed = _restore_main(str(repo), tgts, False)
            for s in plan:
                if s.addressing in recomputed:
                    logger.warning("stage %s was computed again in the main workspace", s.name)
        ok = not failed
    finally:
        _DRUNS.pop(key, None)
        end_parent_run(repo, parent, ok)
    seconds = round(time.monotonic() - started, 2)
    logger.info("pipeline %s:\n%s", pipeline, _table(summary, seconds))
    result = {"stages": summary, "flow_run_id": flow_run_id, "parent_run_id": parent,
              "seconds": seconds, "commit": commit}
    if failed:
        raise PipelineFailed(f"pipeline {pipeline}: stages failed: {', '.join(failed)}", result)
    return result


def run_distributed(root: Path, pipeline: str, *, targets: list[str] | None = None,
                    retries: int = 1, force: bool = False, stage_timeout: float = 3600.0,
                    pools: dict[str, str] | None = None) -> RunSummary:
    """`distributed_flow` in this process against the configured Prefect server (or the local
    stack's); creates the pools and stage deployments first. Never raises for a failed stage."""
    from flows.runner import stack_endpoints

    root = Path(root).resolve()
    pools = {**POOLS, **(pools or {})}
    load_plan(root, pipeline, targets)  # unknown names fail here, before Prefect starts
    with stack_endpoints(root):
        ensure_stage_deployments(pools)
        state = distributed_flow(pipeline=pipeline, root=str(root), targets=targets,
                                 retries=retries, force=force, stage_timeout=stage_timeout,
                                 cpu_pool=pools["cpu"], gpu_pool=pools["gpu"],
                                 return_state=True)
    value = state.result(raise_on_failure=False)
    if isinstance(value, PipelineFailed):
        value = value.summary
    elif isinstance(value, BaseException):
        raise value
    return RunSummary(value["stages"], flow_run_id=value["flow_run_id"],
                      parent_run_id=value["parent_run_id"], seconds=value["seconds"])


# ---------------------------------------------------------------------------------------------
# Workers: `prefect worker start --type process --limit 1` in a clone of their own


def worker_dir(root: Path, name: str) -> Path:
    return Path(root).resolve() / WORKERS / name


def _api_url(root: Path) -> str:
    from prefect.settings import PREFECT_API_URL

    from flows import stack

    url = PREFECT_API_URL.value() or stack.prefect_api_url(root)
    if not url:
        raise RuntimeError("no Prefect server: start one with `paperline stack up` "
                           "or set PREFECT_API_URL")
    return url


def _worker_online(api: str, pool: str, name: str) -> bool:
    import httpx

    try:
        resp = httpx.post(f"{api}/work_pools/{pool}/workers/filter", json={}, timeout=3)
        return any(w.get("name") == name and w.get("status") == "ONLINE" for w in resp.json())
    except Exception:
        return False


def start_worker(root: Path, name: str, pool: str = CPU_POOL, repo_url: str | None = None,
                 clone: Path | None = None, env: dict[str, str] | None = None,
                 heartbeat_s: float = 5.0, poll_s: float = 2.0, timeout: float = 120.0) -> int:
    """Clone the repo (once) and start a process worker on `pool` in that clone; returns its PID.

    `env` (default: this process's environment) must hold the S3 credentials; they reach the
    worker as environment variables only. PID file and log in `.paperline/workers/<name>/`.
    """
    import psutil

    from stages.core import storage

    root = Path(root).resolve()
    wdir = worker_dir(root, name)
    wdir.mkdir(parents=True, exist_ok=True)
    if (pid := worker_pid(root, name)) is not None:
        raise RuntimeError(f"worker {name!r} is already running (pid {pid})")
    clone = Path(clone or wdir / "repo").resolve()
    if not (clone / ".git").exists():
        subprocess.run(["git", "clone", "-q", repo_url or str(root), str(clone)], check=True,
                       capture_output=True, timeout=300)
    if settings := storage.load_settings(clone):
        storage.setup_remote(clone, settings, local=True)
    api = (env or {}).get("PREFECT_API_URL") or _api_url(root)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api}):
        ensure_stage_deployments({"cpu": pool} if pool != GPU_POOL else {"gpu": pool})
    wenv = dict(os.environ if env is None else env)
    wenv["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), wenv.get("PATH", "")])
    wenv.update(PREFECT_API_URL=api, PAPERLINE_ROOT=str(clone), **{WORKER_ENV: name})
    wenv.setdefault("PREFECT_WORKER_HEARTBEAT_SECONDS", str(heartbeat_s))
    wenv.setdefault("PREFECT_WORKER_QUERY_SECONDS", str(poll_s))
    wenv.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    wenv.setdefault("DVC_NO_ANALYTICS", "1")
    cmd = [str(Path(sys.executable).with_name("prefect")), "worker", "start", "--pool", pool,
           "--type", "process", "--limit", "1", "--name", name]
    with open(wdir / "worker.log", "ab") as log:
        proc = subprocess.Popen(cmd, cwd=clone, env=wenv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    (wdir / "worker.pid").write_text(f"{proc.pid} {psutil.Process(proc.pid).create_time()} "
                                     f"{pool}\n")
    deadline = time.monotonic() + timeout
    while not _worker_online(api, pool, name):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_worker(root, name)
            tail = (wdir / "worker.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"worker {name!r} did not come online:\n{tail}")
        time.sleep(0.5)
    return proc.pid


def worker_pid(root: Path, name: str) -> int | None:
    import psutil

    path = worker_dir(root, name) / "worker.pid"
    try:
        pid_s, created_s, _ = path.read_text().split()
        proc = psutil.Process(int(pid_s))
        if abs(proc.create_time() - float(created_s)) < 1.0 and \
                proc.status() != psutil.STATUS_ZOMBIE:
            return int(pid_s)
    except (FileNotFoundError, ValueError, psutil.Error):
        pass
    path.unlink(missing_ok=True)
    return None


def stop_worker(root: Path, name: str, grace: float = 5.0, kill: bool = False) -> str:
    """SIGTERM the worker and everything it started (SIGKILL right away with `kill`, the way a
    lost host looks), SIGKILL what is left after `grace` s: an idle Prefect worker can ignore
    SIGTERM for minutes. Returns stopped|killed|not running."""
    import psutil

    pid = worker_pid(root, name)
    if pid is None:
        return "not running"
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=0.5 if kill else grace)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    (worker_dir(root, name) / "worker.pid").unlink(missing_ok=True)
    return "killed" if kill or alive else "stopped"


def worker_status(root: Path) -> dict[str, dict[str, Any]]:
    base = Path(root).resolve() / WORKERS
    out = {}
    for d in sorted(base.iterdir()) if base.is_dir() else []:
        pidfile = d / "worker.pid"
        pool = pidfile.read_text().split()[2] if pidfile.is_file() else "-"
        pid = worker_pid(root, d.name)
        out[d.name] = {"state": "alive" if pid else "dead", "pid": pid, "pool": pool,
                       "clone": str(d / "repo"), "log": str(d / "worker.log")}
    return out
