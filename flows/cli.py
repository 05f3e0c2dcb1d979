"""`paperline`: run pipelines (DVC or Prefect), compare methods, regenerate reports, run the stack.

    paperline list                      pipelines and their stages
    paperline check <pipeline>          validate every stage's params, compute nothing
    paperline repro <pipeline>|--all    sequential `dvc repro` under one MLflow parent run, then results
    paperline run <pipeline> [--stage S]...   the same DAG through Prefect (parallel branches, retries)
    paperline compare <pipeline>        registered models and method runs side by side (MLflow)
    paperline report [<pipeline>]       regenerate README results tables from DVC metrics
    paperline deploy                    one Prefect deployment per pipeline (work pool paperline-cpu)
    paperline stack up|down|status      local Prefect server + worker + MLflow server, by PID
                                        (`up --team`: both servers on PostgreSQL)
    paperline tracking gaps|sync        stages tracked while MLflow was down: list / replay
    paperline remote setup|check|push|pull   DVC remote + MLflow artifacts on S3 (credentials
                                        only from the environment; preflight before transfers)
    paperline worker start|stop|status  Prefect process workers, each in its own clone (scale-out);
                                        `paperline run <pipeline> --distributed` runs on them
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from stages.core.config import ParamsError, UnknownNameError, did_you_mean, find_root
from stages.core.proc import PipelineBusy, kill_with_parent, pipeline_lock


def _root() -> Path:
    return find_root(os.environ.get("PAPERLINE_ROOT") or None)


def _pipelines(root: Path, name: str | None, all_: bool) -> list[str]:
    from stages.core.runner import pipeline_dirs

    dirs = pipeline_dirs(root)
    if all_ or not name:
        return list(dirs)
    if name not in dirs:
        raise did_you_mean(name, dirs, "pipeline")
    return [name]


def _dvcfile(root: Path, pipeline: str) -> str:
    from stages.core.runner import pipeline_dir

    return str((pipeline_dir(root, pipeline) / "dvc.yaml").relative_to(root))


def _check(root: Path, pipeline: str, *, device: bool = True) -> None:
    """Every stage's params; `device`: also $PAPERLINE_DEVICE, which only matters where the
    stages run (not for a `--distributed` controller: workers keep their own environment)."""
    from stages.core.config import active_profile, read_yaml
    from stages.core.runner import (
        build_context,
        check_key,
        checked_before,
        mark_checked,
        validate_pipeline,
    )

    key = check_key(root, pipeline, device=device)
    if checked_before(root, pipeline, key):
        return  # same params, same stage code as the last check that passed
    ctx, params, source = build_context(root, pipeline, "check")
    validate_pipeline(pipeline, params, active_profile(read_yaml(root / "params.yaml")), source,
                      check_device=device, root=root)
    mark_checked(root, pipeline, key)


def cmd_list(args: argparse.Namespace) -> int:
    from stages.core.runner import pipeline_dirs
    from stages.registry import STAGES

    root = _root()
    for name, d in pipeline_dirs(root).items():
        stages = ", ".join(STAGES.get(name, {})) or "(no stages registered)"
        print(f"{name:<14} {str((d / 'dvc.yaml').relative_to(root)):<32} {stages}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    root = _root()
    for p in _pipelines(root, args.pipeline, args.all):
        _check(root, p)
        print(f"{p}: params valid")
    return 0


def cmd_repro(args: argparse.Namespace) -> int:
    """Sequential `dvc repro` of each pipeline, each under one MLflow parent run; one run of a
    pipeline at a time (a second waits for the first, or with --no-wait refuses)."""
    root = _root()
    pipelines = _pipelines(root, args.pipeline, args.all)
    for p in pipelines:  # every params error surfaces before any compute
        _check(root, p)
    with contextlib.ExitStack() as locks:
        for p in sorted(pipelines):  # one order for everyone: two `--all` never deadlock
            locks.enter_context(pipeline_lock(root, p, wait=not args.no_wait,
                                              what=f"paperline repro {p}"))
        from stages.core.io import clean_repo_tmp

        clean_repo_tmp(root)  # what killed stages left (a restore from the cache would not)
        return _repro(root, pipelines, args)


def _repro(root: Path, pipelines: list[str], args: argparse.Namespace) -> int:
    from flows.results import results_table, update_readme
    from stages.core.tracking import (
        MODE_ENV,
        PARENT_ENV,
        finish_spooled_parent,
        spool_parent,
        start_parent_run,
        tracking_mode,
        warm_for_replay,
    )

    from flows import stack

    stack.use_tracking(root)  # `paperline stack up`: through its server (the same store)
    from stages.core.tracking import list_gaps, sync_gaps

    if list_gaps(root):  # stages that ran while MLflow was down: replay them first
        sync_gaps(root)
    dvc = shutil.which("dvc") or str(Path(sys.executable).with_name("dvc"))
    spool = tracking_mode() == "on"  # stages spool, replayed here (tracking.py docstring)
    from stages.core import forkserver

    # one process imports torch & co. once; each stage runs in a fork of it (forkserver.py)
    late = forkserver.late_imports([root / _dvcfile(root, p) for p in pipelines])
    with forkserver.running(root, dict(os.environ), late) as stage_env:
        for p in pipelines:
            env = dict(stage_env)
            if spool:
                parent = spool_parent(root, p, tags={"paperline.executor": "dvc repro"})
                env[MODE_ENV] = "spool"
            else:
                parent = start_parent_run(root, p, tags={"paperline.executor": "dvc repro"})
            if parent:
                env[PARENT_ENV] = parent
            cmd = [dvc, "repro", _dvcfile(root, p), *(["--force"] if args.force else [])]
            print(f"$ {' '.join(cmd[1:])}", flush=True)
            # a killed `paperline repro` takes its dvc, and dvc its stage, along (core/proc.py);
            # the warming thread starts after the fork (preexec_fn runs in the child)
            with subprocess.Popen(cmd, cwd=root, env=env, preexec_fn=kill_with_parent()) as proc:
                try:
                    with warm_for_replay(root) if spool else contextlib.nullcontext():
                        rc = proc.wait()
                except BaseException:  # what subprocess.run does: the child does not outlive us
                    proc.kill()
                    raise
            if spool:
                parent = finish_spooled_parent(root, parent, rc == 0).get("parent_run_id")
            else:
                _close_parent(root, parent, rc == 0)
            if rc != 0:
                print(f"error: `dvc repro` of pipeline {p!r} failed (exit {rc})",
                      file=sys.stderr)
                return rc
            update_readme(root, p)
            if parent:  # the execution's summary in MLflow: results table, plots, metrics
                from flows.results import log_results

                log_results(root, p, parent)
    for p in pipelines:
        print(f"\n## Results: {p}\n")
        print(results_table(root, p))
    if gaps := list_gaps(root):
        print(f"\nwarning: {len(gaps)} stage run(s) not fully tracked (MLflow was unreachable): "
              "`paperline tracking gaps` lists them, `paperline tracking sync` replays them",
              file=sys.stderr)
    return 0


def _close_parent(root: Path, parent: str | None, ok: bool) -> None:
    """End the parent run; a run with no stage underneath (everything up to date) is removed."""
    from stages.core.tracking import end_parent_run

    if not parent:
        return
    end_parent_run(root, parent, ok)
    try:
        from mlflow import MlflowClient

        client = MlflowClient()
        run = client.get_run(parent)
        children = client.search_runs([run.info.experiment_id],
                                      filter_string=f"tags.mlflow.parentRunId = '{parent}'",
                                      max_results=1)
        if not children and ok:
            client.delete_run(parent)
    except Exception as exc:  # tracking must never fail a finished pipeline
        logging.getLogger("paperline").warning("could not tidy parent run: %s", exc)


def cmd_run(args: argparse.Namespace) -> int:
    from flows.runner import run_pipeline

    root = _root()
    pipeline = _pipelines(root, args.pipeline, False)[0]
    _check(root, pipeline, device=not args.distributed)
    if args.distributed:
        from flows.distributed import run_distributed

        summary = run_distributed(root, pipeline, targets=args.stage or None,
                                  retries=args.retries, force=args.force,
                                  stage_timeout=args.stage_timeout)
        failed = [s for s, v in summary.items() if v.get("state") in ("failed", "blocked")]
        return 1 if failed else 0
    summary = run_pipeline(root, pipeline, targets=args.stage or None,
                           max_parallel=args.max_parallel, retries=args.retries, force=args.force,
                           gpu_slots=args.gpu_slots, wait=not args.no_wait)
    failed = [s for s, v in summary.items() if isinstance(v, dict) and v.get("state") == "failed"]
    return 1 if failed else 0


def cmd_compare(args: argparse.Namespace) -> int:
    from flows.results import compare

    from flows import stack

    root = _root()
    stack.use_tracking(root, quiet=True)
    table, written = compare(root, _pipelines(root, args.pipeline, False)[0])
    print(table)
    print("saved: " + ", ".join(str(p.relative_to(root)) for p in written))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from flows.results import missing_details, update_readme

    root = _root()
    for p in _pipelines(root, args.pipeline, not args.pipeline):
        readme = update_readme(root, p)
        if readme is None:
            gone = missing_details(root, p)
            print(f"kept the README of {p}: {len(gone)} details file(s) missing ({gone[0]}, "
                  f"...): run the pipeline or `dvc pull` first", file=sys.stderr)
            continue
        print(f"updated {readme.relative_to(root)}")
    from flows.overview import update_root_readme

    print(f"updated {update_root_readme(root).relative_to(root)} (pipeline table)")
    return 0


def cmd_deps(args: argparse.Namespace) -> int:
    from stages.core import codedeps

    root = _root()
    if args.write:
        for path in codedeps.write(root):
            print(f"rewrote the code deps of {path}")
    problems = codedeps.check(root)
    for dvcfile, stages in problems.items():
        for stage, diff in stages.items():
            for kind in ("missing", "extra"):
                for path in diff[kind]:
                    print(f"{dvcfile}:{stage}: {kind} code dep {path}")
    if problems:
        print("code deps differ from the imports: run `paperline deps --write`", file=sys.stderr)
        return 1
    print("code deps: every stage declares exactly the project modules it imports")
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    from flows.deploy import deploy_all

    for name in deploy_all(_root(), work_pool=args.work_pool):
        print(f"deployed {name}")
    return 0


def cmd_stack(args: argparse.Namespace) -> int:
    from flows import stack

    root = _root()
    if args.action == "up":
        try:
            stack.up(root, team=True if args.team else None, bind=args.bind)
        except Exception as exc:  # S3 unreachable, PostgreSQL missing, mode clash: say what
            from flows.postgres import PostgresError
            from stages.core.storage import StorageError

            if not isinstance(exc, (StorageError, PostgresError, RuntimeError)):
                raise
            print(f"error: {exc}", file=sys.stderr)
            return 2
    elif args.action == "down":
        stack.down(root)
    else:
        print(stack.describe(stack.status(root)))
    return 0


def cmd_tracking(args: argparse.Namespace) -> int:
    """MLflow tracking gaps (stages that ran while MLflow was unreachable): list or replay."""
    from flows import stack
    from stages.core import tracking

    root = _root()
    stack.use_tracking(root, quiet=True)  # where `paperline repro` logs (and so its gaps)
    if args.action == "gaps":
        gaps = tracking.list_gaps(root)
        for path, gap in gaps:
            print(f"{gap['experiment']}/{gap['run_name']}  run {gap.get('run_id') or '-'}  "
                  f"failed at {gap['failed_at']}  {len(gap['ops'])} calls  "
                  f"({path.relative_to(root)})")
        print(f"{len(gaps)} gap(s)" + (": `paperline tracking sync` replays them" if gaps else ""))
        return 0
    result = tracking.sync_gaps(root)
    print(f"replayed {result['replayed']} gap(s), {result['left']} left")
    return 0 if result["left"] == 0 else 1


def cmd_remote(args: argparse.Namespace) -> int:
    from stages.core import storage

    root = _root()
    try:
        settings = storage.require_settings(root)
        if args.action == "setup":
            path = storage.setup_remote(root, settings, local=args.local)
            print(f"DVC remote {settings.remote!r} -> {settings.dvc_url} written to "
                  f"{path.relative_to(root)} (no credentials)")
            print(storage.describe(root, settings))
            return 0
        if args.action == "check":
            print(storage.describe(root, settings))
            storage.preflight(settings, write=True)
            print(f"ok: {settings.where}: reachable, credentials accepted, bucket writable")
            return 0
        return storage.transfer(root, args.action, args.targets, settings, jobs=args.jobs)
    except storage.StorageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def cmd_worker(args: argparse.Namespace) -> int:
    from flows import distributed

    root = _root()
    if args.action == "start":
        if not args.name:
            raise FileNotFoundError("paperline worker start needs a NAME (e.g. cpu-1)")
        pid = distributed.start_worker(root, args.name, pool=args.pool, repo_url=args.repo,
                                       clone=Path(args.clone) if args.clone else None)
        print(f"worker {args.name}: pid {pid}, pool {args.pool}, clone "
              f"{args.clone or distributed.worker_dir(root, args.name) / 'repo'}")
    elif args.action == "stop":
        names = [args.name] if args.name else list(distributed.worker_status(root))
        for name in names:
            print(f"worker {name}: {distributed.stop_worker(root, name)}")
    else:
        for name, info in distributed.worker_status(root).items():
            print(f"{name:<12} {info['state']:<6} pid {info['pid'] or '-':<8} pool {info['pool']}"
                  f"  clone {info['clone']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paperline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("list", help="pipelines and their stages").set_defaults(func=cmd_list)

    p = sub.add_parser("check", help="validate params of a pipeline (or --all)")
    p.add_argument("pipeline", nargs="?")
    p.add_argument("--all", action="store_true")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("repro", help="sequential dvc repro under one MLflow parent run")
    p.add_argument("pipeline", nargs="?")
    p.add_argument("--all", action="store_true", help="every pipeline")
    p.add_argument("--force", action="store_true", help="dvc repro --force")
    p.add_argument("--no-wait", action="store_true",
                   help="refuse at once when another run of the pipeline holds its lock")
    p.set_defaults(func=cmd_repro)

    p = sub.add_parser("run", help="run a pipeline's DAG through Prefect")
    p.add_argument("pipeline")
    p.add_argument("--stage", action="append", help="only this stage and its upstream (repeatable)")
    p.add_argument("--max-parallel", type=int, default=2)
    p.add_argument("--retries", type=int, default=1)
    p.add_argument("--force", action="store_true")
    p.add_argument("--gpu-slots", type=int, default=None,
                   help="slots of the paperline-gpu concurrency limit (stages with meta.gpus)")
    p.add_argument("--distributed", action="store_true",
                   help="run each stage on a Prefect worker in its own clone (pools paperline-cpu"
                        " / paperline-gpu by meta.gpus; needs S3 storage and a clean git tree)")
    p.add_argument("--stage-timeout", type=float, default=3600.0,
                   help="--distributed: seconds a stage may take, queueing included")
    p.add_argument("--no-wait", action="store_true",
                   help="refuse at once when another run of the pipeline holds its lock")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("compare", help="registered models and runs side by side")
    p.add_argument("pipeline")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("report", help="regenerate README results tables from metrics")
    p.add_argument("pipeline", nargs="?")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("deps", help="check (or --write) every stage's code deps against its "
                                     "imports")
    p.add_argument("--write", action="store_true",
                   help="rewrite the code entries of every dvc.yaml's deps from the imports")
    p.set_defaults(func=cmd_deps)

    p = sub.add_parser("deploy", help="create a Prefect deployment per pipeline")
    p.add_argument("--work-pool", default="paperline-cpu")
    p.set_defaults(func=cmd_deploy)

    p = sub.add_parser("stack", help="local Prefect server, worker and MLflow server")
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--team", action="store_true",
                   help="up: servers on PostgreSQL (started by the stack), artifacts on S3 when "
                        "configured")
    p.add_argument("--bind", default=None,
                   help="up: address the Prefect and MLflow servers listen on (default "
                        "PAPERLINE_BIND or 127.0.0.1)")
    p.set_defaults(func=cmd_stack)

    p = sub.add_parser("tracking", help="MLflow tracking gaps: list or replay them")
    p.add_argument("action", choices=["gaps", "sync"],
                   help="gaps: stages whose tracking did not reach MLflow; sync: replay them")
    p.set_defaults(func=cmd_tracking)

    p = sub.add_parser("remote", help="S3 storage: DVC remote and MLflow artifacts")
    p.add_argument("action", choices=["setup", "check", "push", "pull"],
                   help="setup: write the DVC remote into .dvc/config; check: preflight; "
                        "push/pull: preflight, then dvc push/pull --run-cache")
    p.add_argument("targets", nargs="*", help="push/pull: DVC targets (default: everything)")
    p.add_argument("--local", action="store_true",
                   help="setup: write .dvc/config.local (this machine only)")
    p.add_argument("--jobs", type=int, default=None, help="push/pull: parallel transfers")
    p.set_defaults(func=cmd_remote)

    p = sub.add_parser("worker", help="Prefect process workers, each in its own clone")
    p.add_argument("action", choices=["start", "stop", "status"])
    p.add_argument("name", nargs="?", help="worker name (stop: default all)")
    p.add_argument("--pool", default="paperline-cpu", help="paperline-cpu | paperline-gpu")
    p.add_argument("--repo", default=None, help="git URL to clone (default: this repo)")
    p.add_argument("--clone", default=None,
                   help="the worker's clone (default .paperline/workers/<name>/repo)")
    p.set_defaults(func=cmd_worker)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "matplotlib", "alembic", "botocore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ParamsError, UnknownNameError, FileNotFoundError, PipelineBusy) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
