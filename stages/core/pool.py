"""Independent jobs of one stage in spawned worker processes.

A tiny model keeps one core busy better in its own process than with two torch threads (the
stages that use this measured it: two threads on the shared 2-core box ran slower than one), so
a stage with several independent jobs (training seeds, search arms) can run them side by side.

    results = map_jobs(job_fn, jobs, workers=cfg.workers)

`job_fn` must be a module-level function (it is pickled by name) and each job picklable. The
workers are spawned, not forked: a fork would copy torch's and MLflow's threads in whatever
state they were. Results come back in the order of `jobs`, whatever order they finish in, and
each job must seed whatever it draws from itself, so the results do not depend on `workers`;
only the wall time does. A job's exception is raised here, in the stage, with its traceback.
With `workers` 1 (or a single job) everything runs in this process, as a plain loop.

A worker dies with the stage (`_die_with_stage`, the kernel's `PR_SET_PDEATHSIG`, as the stage
dies with dvc: stages/core/proc.py). Without it, a killed stage (a killed `paperline repro`)
left its spawned workers behind, each finishing the job in hand at full speed on cores that the
next run was being timed on, then waiting forever on a queue nobody reads.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Callable, Sequence


def map_jobs(job_fn: Callable[[Any], Any], jobs: Sequence[Any], workers: int) -> list[Any]:
    """[job_fn(job) for job in jobs], in up to `workers` spawned processes (module docstring)."""
    if workers < 1:
        raise ValueError(f"workers = {workers}: expected >= 1")
    if workers == 1 or len(jobs) < 2:
        return [job_fn(job) for job in jobs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(min(workers, len(jobs)),
                             mp_context=multiprocessing.get_context("spawn"),
                             initializer=_die_with_stage, initargs=(os.getpid(),)) as pool:
        return list(pool.map(job_fn, jobs))


def _die_with_stage(stage_pid: int) -> None:
    """Worker initializer: SIGKILL from the kernel when the stage that spawned us exits (the
    stage's main thread started the workers and lives as long as the stage), or at once if it
    is already gone."""
    from stages.core import proc

    proc.set_pdeathsig(signal.SIGKILL)
    if os.getppid() != stage_pid:        # the stage died before the kernel watched it
        os.kill(os.getpid(), signal.SIGKILL)
