"""stages.core.pool.map_jobs: results in job order from spawned workers, the same as a plain
loop; a job's exception reaches the stage; bad worker counts refused; a killed stage takes its
workers with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def _write_pid_and_sleep(job: str) -> None:
    Path(job).write_text(str(os.getpid()))
    time.sleep(120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "State:\tZ" in status.read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_stage_takes_its_workers_with_it(tmp_path: Path):
    """A stage killed mid-pool (SIGKILL: no cleanup of its own runs) leaves no worker behind."""
    root = Path(__file__).resolve().parents[2]
    files = [tmp_path / "a", tmp_path / "b"]
    code = ("import sys; from stages.core.pool import map_jobs; "
            "from tests.unit.test_pool import _write_pid_and_sleep; "
            f"map_jobs(_write_pid_and_sleep, {[str(f) for f in files]!r}, workers=2)")
    stage = subprocess.Popen([sys.executable, "-c", code], cwd=root)
    try:
        deadline = time.time() + 120
        while not all(f.exists() and f.read_text() for f in files):
            assert stage.poll() is None and time.time() < deadline, "workers never started"
            time.sleep(0.2)
        workers = [int(f.read_text()) for f in files]
        assert all(_alive(w) for w in workers)
        stage.send_signal(signal.SIGKILL)
        stage.wait(30)
        deadline = time.time() + 30
        while any(_alive(w) for w in workers) and time.time() < deadline:
            time.sleep(0.2)
        assert not [w for w in workers if _alive(w)], "a worker outlived its stage"
    finally:
        stage.kill()
        for f in files:
            if f.exists() and f.read_text():
                try:
                    os.kill(int(f.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass
