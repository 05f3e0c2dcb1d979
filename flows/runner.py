"""Run a pipeline's DVC DAG through Prefect: a task per stage (or per chain of stages that can
only run one after the other), independent stages in parallel.

    paperline run <pipeline> [--stage S]... [--max-parallel 2] [--retries 1] [--force]
    run_pipeline(root, "base")                      # the same, from Python
    pipeline_flow(pipeline="base")                  # the Prefect flow (deployments call this)

The DAG is read from DVC (`dvc.repo.Repo`, the stages of the pipeline's dvc.yaml plus every
upstream stage they depend on, e.g. the shared stages of the root dvc.yaml); nothing is declared
twice. Whether a stage must run is DVC's own change detection (`Stage.changed()`), taken once at
the start: a stage that is unchanged, and whose upstream stages are all unchanged, is reported
`skipped` and starts no process.

Why workspaces. DVC holds a repo lock and rewrites dvc.lock, so two `dvc repro` cannot share one
workspace. Each running stage therefore gets its own workspace, `.paperline/workspaces/<n>`: a
copy of the repo's source files (`git ls-files -co --exclude-standard` + `.dvc/config`, never
outputs or .venv), re-synced before every stage, whose `.dvc/config.local` points `cache.dir` at
the main repo's cache. There `dvc repro <dvc.yaml>:<stage>` restores the upstream stages from the
shared run-cache (they ran earlier in this flow) and computes the stage, which commits its outputs
to the cache and its entry to the run-cache. A last `dvc repro` in the main workspace then restores
every output from the run-cache without recomputing, so the end state (outputs and dvc.lock) is
the one a sequential `dvc repro` gives. Workspaces are reused (each file-locked while in use), link
from the cache (`cache.type = reflink,hardlink,copy`, so they cost no disk for upstream outputs)
and run with `core.no_scm`; the main repo's DVC skips them as nested repos. A stage process runs
with `PAPERLINE_ROOT` and `PYTHONPATH` set to its workspace, so it runs the code DVC hashed.

Chains. Stages that could only run one after the other (a stage to run whose only upstream is a
stage to run with no other downstream) form a chain (`chains`), run as ONE `dvc repro` of its
last stage in one workspace and shown as one Prefect task (`a → b → c`); each stage keeps its
own state and seconds in the run's table, read from DVC's messages (`chain_outcomes`). This
pays DVC's start-up, the workspace sync and the upstream restore once per chain instead of once
per stage; a retry of a failed chain restarts at the stage that failed (the others restore from
the run-cache). Fan-outs, joins, GPU stages and stages DVC cannot run-cache stay on their own.

Run-cache rule (what dvc.yaml files must follow so nothing is computed twice): a stage is
run-cacheable only when it has a `cmd`, at least one dep and at least one out (metrics/plots
count), all local paths inside the repo, no `persist: true` out and no `always_changed: true`.
`cache: false` metrics and plots ARE saved in and restored from the run-cache; any other
`cache: false` out makes DVC skip the run-cache for the stage (which is why every stage's
`details/<stage>.json` is a cached out; tests/unit/test_metrics_files.py). A stage that
breaks the rule still runs correctly here but is computed a second time by the final `dvc repro`
(a warning names it).

Resources. `meta: {gpus: N}` on a stage makes it hold N slots of the Prefect global concurrency
limit `paperline-gpu` (created, active, with `gpu_slots` slots, default `PAPERLINE_GPU_SLOTS` or 1)
while it runs, so GPU stages never oversubscribe the GPUs of this machine. A GPU stage waits for
its GPU slots before it takes a workspace (one of `max_parallel`), so CPU stages never queue
behind GPU stages waiting for a GPU. `max_parallel` bounds the stage processes running at once
(the workspaces in use); the Prefect thread pool has a thread per stage, because a task waiting on
its upstream (`wait_for`) holds a thread. Routing a GPU stage to a separate GPU work pool, with
each worker in its own clone, is flows/distributed.py (`paperline run --distributed`), through
`route_stage()`.

Tracking. One MLflow parent run per execution (`start_parent_run`, tags `prefect.flow_run_id`,
`paperline.profile`); every stage process gets `PAPERLINE_PARENT_RUN_ID`, `PAPERLINE_FLOW_RUN_ID`
and an explicit `MLFLOW_TRACKING_URI` (the main repo's store: a workspace must not log into a store
of its own). Prefect result caching is off (`NO_CACHE`, no persisted results): DVC is the only
cache.

`force=True` recomputes every stage of the plan in the workspaces. The final `dvc repro` in the
main workspace keeps DVC's change detection: where the main workspace was already up to date it
keeps its outputs (identical for deterministic stages).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from stages.core.config import did_you_mean, find_root, read_yaml
from stages.core.io import clean_repo_tmp, clean_stale_tmp_in
from stages.core.proc import kill_with_parent, pipeline_lock

GPU_LIMIT = "paperline-gpu"
WORKSPACES = Path(".paperline") / "workspaces"
MANIFEST = ".paperline-synced.json"


@dataclass
class StagePlan:
    """One DVC stage as the flow schedules it."""

    name: str                  # task run name: the stage name; `<pipeline>:<stage>` if upstream
    target: str                # what `dvc repro` takes: `<dvc.yaml relpath>:<stage name>`
    addressing: str            # how DVC names it in its own messages
    upstream: list[str]        # targets of the direct upstream stages within the plan
    action: str                # "run" (changed, or downstream of a change) | "skip"
    gpus: int = 0
    run_cacheable: bool = True


class RunSummary(dict):
    """stage name -> {"state": ran|restored|skipped|failed|blocked, "seconds": float}, plus the
    Prefect flow run id, the MLflow parent run id and the wall time as attributes."""

    def __init__(self, stages: dict[str, dict[str, Any]], flow_run_id: str | None = None,
                 parent_run_id: str | None = None, seconds: float = 0.0):
        super().__init__(stages)
        self.flow_run_id = flow_run_id
        self.parent_run_id = parent_run_id
        self.seconds = seconds


class PipelineFailed(RuntimeError):
    def __init__(self, message: str, summary: dict[str, Any]):
        super().__init__(message)
        self.summary = summary


# ---------------------------------------------------------------------------------------------
# The plan: read from DVC


def dvcfile_of(root: Path, pipeline: str) -> str:
    from stages.core.runner import pipeline_dir

    return str((pipeline_dir(root, pipeline) / "dvc.yaml").relative_to(root))


def _display_name(root: Path, stage: Any, own_dvcfile: str) -> str:
    rel = str(Path(stage.path).relative_to(root))
    if rel == own_dvcfile:
        return stage.name
    parent = Path(rel).parent
    owner = "base" if parent == Path(".") else parent.name
    return f"{owner}:{stage.name}"


def _can_run_cache(stage: Any) -> bool:
    """DVC's run-cache rule (`dvc.stage.cache._can_hash`, and `Stage.run`'s: no `cache: false`
    out other than metrics and plots), without its check that every dep exists already (an
    upstream output appears only once the upstream stage ran)."""
    try:
        if stage.is_callback or stage.always_changed:
            return False
        if not (stage.cmd and stage.deps and stage.outs):
            return False
        if any(d.protocol != "local" or not d.def_path for d in stage.deps):
            return False
        return all(o.protocol == "local" and o.def_path and not o.persist and o.is_in_repo
                   and (o.use_cache or o.is_metric or o.is_plot) for o in stage.outs)
    except Exception:
        return False


def load_plan(root: Path, pipeline: str, targets: list[str] | None = None,
              force: bool = False) -> list[StagePlan]:
    """The stages to execute, dependencies first, with DVC's verdict on what changed."""
    import networkx as nx
    from dvc.repo import Repo

    root = Path(root).resolve()
    dvcfile = dvcfile_of(root, pipeline)  # unknown pipeline: 'did you mean'
    with Repo(str(root)) as repo:
        dvcfile_abs = str(root / dvcfile)  # targets resolve against the cwd: pass them absolute
        own = repo.stage.collect(dvcfile_abs)
        names = {s.name for s in own}
        selected: set[Any] = set()
        for t in targets or [None]:
            if t is not None and t not in names:
                raise did_you_mean(t, names, f"stage of pipeline {pipeline!r}")
            spec = dvcfile_abs if t is None else f"{dvcfile_abs}:{t}"
            selected.update(repo.stage.collect(spec, with_deps=True))
        graph = repo.index.graph.subgraph(selected)  # edges: stage -> its dependency
        # dependencies first; ties in name order, so runs list stages the same way every time
        order = list(nx.lexicographical_topological_sort(
            graph.reverse(copy=False), key=lambda s: f"{s.path}:{s.name}"))
        with repo.lock:
            changed = {s: (not s.frozen and s.changed()) for s in order}

        def target(s: Any) -> str:
            return f"{Path(s.path).relative_to(root)}:{s.name}"

        def addressing(s: Any) -> str:  # as DVC prints it when run from the repo root
            rel = str(Path(s.path).relative_to(root))
            return s.name if rel == "dvc.yaml" else f"{rel}:{s.name}"

        plan: list[StagePlan] = []
        runs: set[Any] = set()
        for s in order:
            ups = list(graph.successors(s))
            if not s.frozen and (force or changed[s] or any(u in runs for u in ups)):
                runs.add(s)
            gpus = int((s.meta or {}).get("gpus", 0) or 0) if isinstance(s.meta, dict) else 0
            plan.append(StagePlan(
                name=_display_name(root, s, dvcfile), target=target(s), addressing=addressing(s),
                upstream=sorted(target(u) for u in ups), action="run" if s in runs else "skip",
                gpus=gpus, run_cacheable=_can_run_cache(s)))
    return plan


def chains(plan: list[StagePlan]) -> list[list[StagePlan]]:
    """The plan cut into the units the flow schedules, in plan order: a stage to run whose only
    upstream in the plan is a stage to run with no other downstream joins that stage's chain.

    A chain runs as ONE `dvc repro` of its last stage in one workspace (one DVC start-up, one
    workspace sync, one upstream restore, one Prefect task), and nothing is lost: its stages
    could only have run one after the other anyway. Stages that fan out or join, skipped stages,
    GPU stages (they hold the GPU limit alone) and stages DVC cannot run-cache stay on their own.
    """
    downstream: dict[str, int] = {}
    for s in plan:
        for u in s.upstream:
            downstream[u] = downstream.get(u, 0) + 1
    by_target = {s.target: s for s in plan}

    def fusable(s: StagePlan) -> bool:
        return s.action == "run" and s.gpus == 0 and s.run_cacheable

    out: list[list[StagePlan]] = []
    chain_of: dict[str, list[StagePlan]] = {}
    for s in plan:
        up = by_target.get(s.upstream[0]) if len(s.upstream) == 1 else None
        if (up is not None and fusable(s) and fusable(up) and downstream.get(up.target) == 1
                and chain_of[up.target][-1] is up):
            chain = chain_of[up.target]
            chain.append(s)
        else:
            chain = [s]
            out.append(chain)
        chain_of[s.target] = chain
    return out


def chain_name(chain: list[StagePlan]) -> str:
    """The Prefect task run name of a chain: its stages, shortened past three."""
    names = [s.name for s in chain]
    if len(names) <= 3:
        return " → ".join(names)
    return f"{names[0]} → … → {names[-1]} ({len(names)} stages)"


def route_stage(stage: StagePlan, pools: dict[str, str] | None = None) -> str:
    """Where a stage runs. Without `pools` (this module's flow): "local", this flow's process, GPU
    stages under the `paperline-gpu` limit. With `pools` ({"cpu": ..., "gpu": ...}, the workers
    of flows/distributed.py): the work pool, `pools["gpu"]` for stages with `meta: {gpus: N}`."""
    if pools is None:
        return "local"
    return pools["gpu"] if stage.gpus > 0 else pools["cpu"]


# ---------------------------------------------------------------------------------------------
# Workspaces


def source_files(root: Path, plan_outs: set[str]) -> list[str]:
    """Relative paths of the repo's source files: what a fresh clone has, minus stage outputs."""
    root = Path(root)
    files: list[str] | None = None
    if shutil.which("git") and (root / ".git").exists():
        proc = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                              capture_output=True, timeout=60)
        if proc.returncode == 0:
            files = [f for f in proc.stdout.decode().split("\0") if f]
    if files is None:  # not a git checkout: walk, skipping what git would ignore here
        skip_dirs = {".git", ".venv", ".paperline", "__pycache__", ".pytest_cache"}
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            rel = Path(dirpath).relative_to(root)
            dirnames[:] = [d for d in dirnames if d not in skip_dirs
                           and not (rel == Path(".") and d == ".dvc")]
            files.extend(str(rel / f) for f in filenames)
    files.append(".dvc/config")

    def is_out(f: str) -> bool:
        return any(f == o or f.startswith(o + "/") for o in plan_outs)

    keep = []
    for f in dict.fromkeys(files):
        if f.startswith((".paperline/", ".dvc/cache/", ".dvc/tmp/")) or f == ".dvc/config.local":
            continue
        if is_out(f) or not (root / f).is_file():
            continue
        keep.append(f)
    return keep


def repo_outs(root: Path) -> set[str]:
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return {str(Path(o.fs_path).relative_to(root)) for o in repo.index.outs
                if Path(o.fs_path).is_relative_to(root)}


def sync_workspace(root: Path, ws: Path, files: list[str], cache_dir: str) -> int:
    """Make `ws` hold exactly `files` of `root` (copies, never links); returns files copied."""
    ws.mkdir(parents=True, exist_ok=True)
    copied = 0
    for rel in files:
        src, dst = root / rel, ws / rel
        st = src.stat()
        try:
            dt = dst.stat()
            if dt.st_size == st.st_size and dt.st_mtime_ns == st.st_mtime_ns:
                continue
        except FileNotFoundError:
            pass
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        copied += 1
    manifest = ws / MANIFEST
    if manifest.is_file():  # a source file deleted in root is deleted here too
        for rel in set(json.loads(manifest.read_text())) - set(files):
            with contextlib.suppress(FileNotFoundError):
                (ws / rel).unlink()
    manifest.write_text(json.dumps(files))
    local = ws / ".dvc" / "config.local"
    # links, not copies, from the shared cache: a workspace costs no disk for upstream outputs
    # (DVC makes linked files read-only and removes a stage's outs before running it)
    text = ("[core]\n    no_scm = true\n    check_update = false\n"
            f"[cache]\n    dir = {cache_dir}\n    type = reflink,hardlink,copy\n")
    if not local.is_file() or local.read_text() != text:
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(text)
    return copied


class WorkspacePool:
    """At most `size` workspaces in use by this run; each one file-locked while in use, so two
    runs on the same repo never share one (a busy one is skipped for the next free index)."""

    def __init__(self, root: Path, size: int):
        self.base = Path(root) / WORKSPACES
        self.base.mkdir(parents=True, exist_ok=True)
        (self.base / ".gitignore").write_text("*\n")
        self._sem = threading.BoundedSemaphore(size)
        self._mutex = threading.Lock()

    @contextlib.contextmanager
    def slot(self) -> Iterator[Path]:
        with self._sem:
            with self._mutex:
                n = 0
                while True:
                    fh = open(self.base / f"{n}.lock", "w")
                    try:
                        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        fh.close()
                        n += 1
            try:
                yield self.base / str(n)
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
                fh.close()


# ---------------------------------------------------------------------------------------------
# Stage processes


def dvc_executable() -> str:
    here = Path(sys.executable).with_name("dvc")
    return str(here) if here.exists() else (shutil.which("dvc") or "dvc")


def _stream(cmd: list[str], cwd: Path, env: dict[str, str], logger: Any,
            progress_every: float = 2.0,
            times: list[float] | None = None) -> tuple[int, list[str]]:
    """Run `cmd`, sending each output line (stdout and stderr) to `logger` as it comes.

    Carriage-return updates (progress bars) are forwarded at most every `progress_every` s.
    `times`, if given, receives the monotonic time each returned line arrived.
    """
    # the dvc process (and through it its stage, stages/core/proc.py) dies with this process
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            preexec_fn=kill_with_parent())
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    lines: list[str] = []
    buf = b""
    last_progress = 0.0
    pending_progress: str | None = None
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
        while True:
            cut = min((i for i in (buf.find(b"\n"), buf.find(b"\r")) if i >= 0), default=-1)
            if cut < 0:
                break
            piece, sep, buf = buf[:cut], buf[cut:cut + 1], buf[cut + 1:]
            text = piece.decode(errors="replace").rstrip()
            if not text:
                continue
            if sep == b"\r":
                pending_progress = text
                if time.monotonic() - last_progress >= progress_every:
                    logger.info(text)
                    last_progress, pending_progress = time.monotonic(), None
            else:
                if pending_progress is not None and text != pending_progress:
                    pending_progress = None
                logger.info(text)
                lines.append(text)
                if times is not None:
                    times.append(time.monotonic())
    if buf.strip():
        logger.info(buf.decode(errors="replace").rstrip())
        lines.append(buf.decode(errors="replace").rstrip())
        if times is not None:
            times.append(time.monotonic())
    return proc.wait(), lines


def outcome_of(lines: list[str], addressing: str) -> str:
    """ran | restored | unchanged, from DVC's own messages about the stage."""
    for line in lines:
        if line.startswith(f"Running stage '{addressing}'"):
            return "ran"
        if line.startswith(f"Stage '{addressing}' is cached"):
            return "restored"
    return "unchanged"


def chain_outcomes(chain: list[StagePlan], lines: list[str], times: list[float], start: float,
                   end: float, failed: bool = False) -> dict[str, dict[str, Any]]:
    """Per stage of a chain run as one `dvc repro`: its state from DVC's messages and its
    seconds from the arrival of its "Running stage" line to the next stage's (or the end).
    Failed: the last stage DVC started is `failed`, those it never reached `blocked`."""
    marks: list[tuple[int, float]] = []  # (index in chain, time DVC started/restored it)
    for i, s in enumerate(chain):
        for line, t in zip(lines, times):
            if line.startswith((f"Running stage '{s.addressing}'",
                                f"Stage '{s.addressing}' is cached")):
                marks.append((i, t))
                break
    marks.sort(key=lambda m: m[1])
    seconds = {i: (marks[k + 1][1] if k + 1 < len(marks) else end) - (t if k else start)
               for k, (i, t) in enumerate(marks)}
    last = marks[-1][0] if marks else -1
    out: dict[str, dict[str, Any]] = {}
    for i, s in enumerate(chain):
        if failed and i == max(last, 0):
            state = "failed"
        elif failed and i > last:
            state = "blocked"
        else:
            state = outcome_of(lines, s.addressing)
            state = "skipped" if state == "unchanged" else state
        out[s.target] = {"state": state, "seconds": round(seconds.get(i, 0.0), 2)}
    return out


@dataclass
class _Run:
    """What every stage task of one flow run shares (kept out of Prefect task parameters)."""

    root: Path
    env: dict[str, str]
    pool: WorkspacePool
    files: list[str]
    cache_dir: str
    force: bool
    stages: dict[str, StagePlan] = field(default_factory=dict)
    outs: list[str] = field(default_factory=list)  # every DVC output, relative to the root
    partial: dict[str, dict[str, Any]] = field(default_factory=dict)  # a failed chain's stages


_RUNS: dict[str, _Run] = {}


def _stage_env(run: _Run, ws: Path) -> dict[str, str]:
    # the workspace's code runs (what DVC hashed), stages resolve their root to the workspace
    env = dict(run.env)
    env["PAPERLINE_ROOT"] = str(ws)
    env["PYTHONPATH"] = os.pathsep.join([str(ws), *filter(None, [run.env.get("PYTHONPATH")])])
    return env


@task(cache_policy=NO_CACHE, persist_result=False, log_prints=False)
def _stage_task(run_key: str, targets: list[str]) -> dict[str, dict[str, Any]]:
    """One chain (`chains`): a single stage, or consecutive stages run by one `dvc repro`.
    Returns target -> {state, seconds}."""
    run = _RUNS[run_key]
    chain = [run.stages[t] for t in targets]
    first, last = chain[0], chain[-1]
    logger = get_run_logger()
    if len(chain) == 1 and first.action == "skip":
        logger.info("%s is up to date (DVC): skipped", first.addressing)
        return {first.target: {"state": "skipped", "seconds": 0.0}}
    assert all(route_stage(s) == "local" for s in chain)
    gpu = contextlib.nullcontext()
    if first.gpus:  # a GPU stage is never chained
        from prefect.concurrency.sync import concurrency

        logger.info("waiting for %d slot(s) of concurrency limit %r", first.gpus, GPU_LIMIT)
        gpu = concurrency(GPU_LIMIT, occupy=first.gpus, strict=True)
    lines: list[str] = []
    times: list[float] = []
    with gpu, run.pool.slot() as ws:
        started = time.monotonic()  # the stage's own time, not its wait for a slot
        sync_workspace(run.root, ws, run.files, run.cache_dir)
        clean_stale_tmp_in(ws / o for o in run.outs)  # a killed earlier run's stage left them
        env = _stage_env(run, ws)
        dvc = dvc_executable()
        logger.info("workspace %s", ws.relative_to(run.root))
        if run.force and first.upstream:  # upstream restored (ran earlier), the stages forced
            rc, _ = _stream([dvc, "repro", *first.upstream], ws, env, logger)
            if rc != 0:
                raise RuntimeError(f"restoring upstream of {first.name} failed (exit {rc})")
            started = time.monotonic()
        if run.force:
            cmd = [dvc, "repro", "--force", "--single-item", *targets]
        else:
            cmd = [dvc, "repro", last.target]  # DVC runs the chain, upstream from the run-cache
        rc, lines = _stream(cmd, ws, env, logger, times=times)
    results = chain_outcomes(chain, lines, times, started, time.monotonic(), failed=rc != 0)
    for target, result in results.items():  # a retry restores what its first attempt ran
        before = run.partial.get(target)
        if before and before["state"] == "ran" and result["state"] in ("restored", "skipped"):
            results[target] = before
    if rc != 0:
        run.partial.update(results)
        tail = "\n".join(lines[-5:])
        raise RuntimeError(f"{chain_name(chain)}: `{' '.join(cmd[1:])}` failed (exit {rc}) "
                           f"in {ws.relative_to(run.root)}:\n{tail}")
    return results


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="dvc repro (main workspace)")
def _final_repro(run_key: str, targets: list[str], single_item: bool) -> list[str]:
    """Restore every output into the main workspace from the run-cache; returns stages that DVC
    had to compute again here (not run-cacheable)."""
    run = _RUNS[run_key]
    logger = get_run_logger()
    env = dict(run.env, PAPERLINE_ROOT=str(run.root))
    cmd = [dvc_executable(), "repro", *targets, *(["--single-item"] if single_item else [])]
    rc, lines = _stream(cmd, run.root, env, logger)
    if rc != 0:
        raise RuntimeError(f"`dvc repro` in the main workspace failed (exit {rc})")
    return [line.split("'")[1] for line in lines if line.startswith("Running stage '")]


# ---------------------------------------------------------------------------------------------
# The flow


def ensure_gpu_limit(slots: int) -> int:
    """Create the `paperline-gpu` global concurrency limit if missing; returns its slot count."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(GPU_LIMIT)
            return int(limit.limit)
        except ObjectNotFound:
            client.create_global_concurrency_limit(
                GlobalConcurrencyLimitCreate(name=GPU_LIMIT, limit=slots, active=True))
            return slots


def _profile(root: Path) -> str | None:
    try:
        value = read_yaml(root / "params.yaml").get("profile")
        return None if value is None else str(value)
    except Exception:
        return None


def _table(summary: dict[str, dict[str, Any]], seconds: float) -> str:
    width = max([len(s) for s in summary] + [5])
    rows = [f"{'stage':<{width}}  {'state':<9} {'seconds':>8}"]
    for name, info in summary.items():
        rows.append(f"{name:<{width}}  {info['state']:<9} {info['seconds']:>8.1f}")
    rows.append(f"{'total':<{width}}  {'':<9} {seconds:>8.1f}")
    return "\n".join(rows)


def _base_env(root: Path) -> dict[str, str]:
    from stages.core.tracking import tracking_uri

    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "")])  # `python` in dvc.yaml cmds
    env["MLFLOW_TRACKING_URI"] = tracking_uri(root)  # workspaces log to the MAIN repo's store
    env.setdefault("DVC_NO_ANALYTICS", "1")
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    return env


def _delete_if_empty(root: Path, parent: str | None) -> None:
    """A parent run with no stage run below it (everything restored or skipped) is noise."""
    if not parent:
        return
    try:
        from mlflow import MlflowClient

        from stages.core.tracking import configure

        configure(root)
        client = MlflowClient()
        run = client.get_run(parent)
        kids = client.search_runs([run.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent}'",
                                  max_results=1)
        if not kids:
            client.delete_run(parent)
    except Exception as exc:
        get_run_logger().warning("could not tidy the MLflow parent run: %s", exc)


@flow(name="paperline", persist_result=False, log_prints=False)
def pipeline_flow(pipeline: str, root: str | None = None, targets: list[str] | None = None,
                  max_parallel: int = 2, retries: int = 1, force: bool = False,
                  gpu_slots: int | None = None, profile: str | None = None,
                  wait: bool = True) -> dict[str, Any]:
    """Execute pipeline `pipeline` (a folder under pipelines/, or `base`) of the repo at `root`
    (default: `PAPERLINE_ROOT`, else the working directory) as its DVC DAG; see module docstring.
    One run of a pipeline at a time: a second waits for the first (`wait=False`: fails).

    Args:
        pipeline: the pipeline's slug (a folder under pipelines/, or `base`).
        root: the repo (default: `PAPERLINE_ROOT`, else the working directory).
        targets: only these stages of the pipeline and what they depend on (default: all).
        max_parallel: stage processes running at once.
        retries: attempts after a stage fails.
        force: recompute every stage of the plan, even those DVC finds up to date.
        gpu_slots: slots of the `paperline-gpu` limit when it is created.
        profile: smoke, cpu or gpu, written to params.yaml first (and kept, as dvc exp run -S
            does); empty: the profile params.yaml has.
        wait: when another run of this pipeline holds its lock, wait for it (else fail).
    """
    repo = find_root(root or os.environ.get("PAPERLINE_ROOT") or None)
    dvcfile_of(repo, pipeline)  # an unknown pipeline: 'did you mean', before taking its lock
    logger = get_run_logger()
    with pipeline_lock(repo, pipeline, wait=wait, what=f"paperline run {pipeline}",
                       say=logger.warning):
        clean_repo_tmp(repo)  # what killed stages left (a restore from the cache would not)
        return _pipeline_flow(repo, pipeline, targets, max_parallel, retries, force, gpu_slots,
                              profile)


def _pipeline_flow(repo: Path, pipeline: str, targets: list[str] | None, max_parallel: int,
                   retries: int, force: bool, gpu_slots: int | None,
                   profile: str | None) -> dict[str, Any]:
    from prefect.runtime import flow_run
    from prefect.task_runners import ThreadPoolTaskRunner

    from stages.core.tracking import FLOW_RUN_ENV, PARENT_ENV, end_parent_run, start_parent_run

    logger = get_run_logger()
    started = time.monotonic()
    if max_parallel < 1:
        raise ValueError(f"max_parallel = {max_parallel}: expected at least 1")
    if profile is not None:
        from flows.deploy import apply_profile

        apply_profile(repo, profile, logger)
    plan = load_plan(repo, pipeline, targets, force)
    todo = [s for s in plan if s.action == "run"]
    logger.info("pipeline %s: %d stages, %d to run, %d up to date", pipeline, len(plan),
                len(todo), len(plan) - len(todo))
    for s in todo:
        if not s.run_cacheable:
            logger.warning("stage %s is not run-cacheable (needs cmd, deps and outs, no persist, "
                           "not always_changed): the final `dvc repro` computes it again", s.name)

    gpu_stages = [s for s in todo if s.gpus]
    if gpu_stages:
        slots = ensure_gpu_limit(gpu_slots or int(os.environ.get("PAPERLINE_GPU_SLOTS", "1")))
        too_big = [s.name for s in gpu_stages if s.gpus > slots]
        if too_big:
            raise ValueError(f"stages {too_big} ask for more GPUs than the {slots} slot(s) of "
                             f"concurrency limit {GPU_LIMIT!r}")

    flow_run_id = str(flow_run.id) if flow_run.id else None
    env = _base_env(repo)
    parent = None
    if todo:
        tags = {"prefect.flow_run_id": flow_run_id or "", "paperline.executor": "prefect"}
        if _profile(repo):
            tags["paperline.profile"] = _profile(repo)  # type: ignore[assignment]
        parent = start_parent_run(repo, pipeline, tags=tags)
        if parent:
            env[PARENT_ENV] = parent
    if flow_run_id:
        env[FLOW_RUN_ENV] = flow_run_id

    key = uuid.uuid4().hex
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        cache_dir = str(Path(r.cache.local_cache_dir).resolve())
    outs = repo_outs(repo) if todo else set()
    files = source_files(repo, outs) if todo else []
    run = _Run(root=repo, env=env, pool=WorkspacePool(repo, max_parallel), files=files,
               cache_dir=cache_dir, force=force, stages={s.target: s for s in plan},
               outs=sorted(outs))
    _RUNS[key] = run
    summary: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    ok = False
    try:
        futures: dict[str, Any] = {}  # stage target -> the future of its chain
        units = chains(plan)
        # A thread per chain: in Prefect 3 a task waiting on `wait_for` (or on the GPU limit)
        # holds its thread, so a pool of `max_parallel` threads would leave ready branches idle.
        # `max_parallel` bounds what matters, the stage processes (workspaces) running at once.
        with ThreadPoolTaskRunner(max_workers=max(len(units), 1)) as runner:
            for chain in units:
                name = chain_name(chain)
                t = _stage_task.with_options(name=name, task_run_name=name,
                                             retries=retries, retry_delay_seconds=1)
                future = runner.submit(
                    t, {"run_key": key, "targets": [s.target for s in chain]},
                    wait_for=list({id(futures[u]): futures[u] for u in chain[0].upstream}
                                  .values()))
                for s in chain:
                    futures[s.target] = future
            for chain in units:
                future = futures[chain[0].target]
                future.wait()
                state = future.state
                for s in chain:
                    if state.is_completed():
                        summary[s.name] = state.result()[s.target]
                    elif (state.is_failed() or state.is_crashed()) and s.target in run.partial:
                        summary[s.name] = dict(run.partial[s.target])
                        if summary[s.name]["state"] == "failed":
                            summary[s.name]["error"] = str(state.message)
                    elif state.is_failed() or state.is_crashed():
                        summary[s.name] = {"state": "failed", "seconds": 0.0,
                                           "error": str(state.message)}
                    else:  # upstream failed: never started
                        summary[s.name] = {"state": "blocked", "seconds": 0.0}
        summary = {s.name: summary[s.name] for s in plan}  # plan order, chains or not
        failed = [n for n, v in summary.items() if v["state"] in ("failed", "blocked")]
        done = [s for s in plan if summary[s.name]["state"] in ("ran", "restored")]
        if done:
            if failed:  # keep what finished: restore exactly those stages, in DAG order
                recomputed = _final_repro(key, [s.target for s in done], True)
            else:
                dvcfile = dvcfile_of(repo, pipeline)
                tgts = [f"{dvcfile}:{t}" for t in targets] if targets else [dvcfile]
                recomputed = _final_repro(key, tgts, False)
            for s in plan:
                if s.addressing in recomputed:
                    logger.warning("stage %s was computed again in the main workspace", s.name)
                    summary[s.name]["state"] = "ran"
        ok = not failed
    finally:
        _RUNS.pop(key, None)
        end_parent_run(repo, parent, ok)
        if ok and parent and not any(v["state"] == "ran" for v in summary.values()):
            _delete_if_empty(repo, parent)
    seconds = round(time.monotonic() - started, 2)
    logger.info("pipeline %s:\n%s", pipeline, _table(summary, seconds))
    from flows.results import publish_results

    publish_results(repo, pipeline, _table(summary, seconds), ok=not failed)
    result = {"stages": summary, "flow_run_id": flow_run_id, "parent_run_id": parent,
              "seconds": seconds}
    if failed:
        raise PipelineFailed(f"pipeline {pipeline}: stages failed: {', '.join(failed)}", result)
    return result


@contextlib.contextmanager
def stack_endpoints(root: Path) -> Iterator[None]:
    """While the local stack (`paperline stack up`) is up, runs go to its servers, unless
    `PREFECT_API_URL` / `MLFLOW_TRACKING_URI` say otherwise."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows import stack

    updates = {}
    if not PREFECT_API_URL.value() and (url := stack.prefect_api_url(root)):
        updates[PREFECT_API_URL] = url
        print(f"using the stack's Prefect server {url}")
    mlflow_url = None
    if not os.environ.get("MLFLOW_TRACKING_URI") and (mlflow_url := stack.mlflow_url(root)):
        os.environ["MLFLOW_TRACKING_URI"] = mlflow_url
        print(f"using the stack's MLflow server {mlflow_url}")
    try:
        with temporary_settings(updates=updates):
            yield
    finally:
        if mlflow_url:
            os.environ.pop("MLFLOW_TRACKING_URI", None)


def run_pipeline(root: Path, pipeline: str, *, targets: list[str] | None = None,
                 max_parallel: int = 2, retries: int = 1, force: bool = False,
                 gpu_slots: int | None = None, wait: bool = True) -> RunSummary:
    """Run the Prefect flow in this process; returns stage -> {state, seconds} (never raises for
    a failed stage: its state is `failed`, its downstream stages `blocked`).

    Raises the 'did you mean' error for an unknown pipeline or stage before starting Prefect.
    """
    root = Path(root).resolve()
    load_plan(root, pipeline, targets)  # unknown names fail here, before Prefect starts
    with stack_endpoints(root):
        state = pipeline_flow(pipeline=pipeline, root=str(root), targets=targets,
                              max_parallel=max_parallel, retries=retries, force=force,
                              gpu_slots=gpu_slots, wait=wait, return_state=True)
    value = state.result(raise_on_failure=False)
    if isinstance(value, PipelineFailed):
        value = value.summary
    elif isinstance(value, BaseException):
        raise value
    return RunSummary(value["stages"], flow_run_id=value["flow_run_id"],
                      parent_run_id=value["parent_run_id"], seconds=value["seconds"])
