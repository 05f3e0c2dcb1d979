"""stages.core.pool.map_jobs: results in job order from spawned workers, the same as a plain
loop; a job's exception reaches the stage; bad worker counts refused."""

from __future__ import annotations

import os

import pytest

from stages.core.pool import map_jobs


def _square_and_pid(job: int) -> tuple[int, int]:
    if job < 0:
        raise ValueError(f"job {job} is negative")
    return job * job, os.getpid()


def test_map_jobs_keeps_job_order_and_runs_in_other_processes():
    jobs = [5, 1, 4, 2, 3]
    serial = map_jobs(_square_and_pid, jobs, workers=1)
    assert [r for r, _ in serial] == [25, 1, 16, 4, 9]
    assert {pid for _, pid in serial} == {os.getpid()}
    spawned = map_jobs(_square_and_pid, jobs, workers=2)
    assert [r for r, _ in spawned] == [r for r, _ in serial]
    pids = {pid for _, pid in spawned}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


def test_map_jobs_raises_the_jobs_error_and_refuses_zero_workers():
    with pytest.raises(ValueError, match="job -3 is negative"):
        map_jobs(_square_and_pid, [1, -3, 2], workers=2)
    with pytest.raises(ValueError, match="workers = 0"):
        map_jobs(_square_and_pid, [1], workers=0)
