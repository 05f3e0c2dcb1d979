"""Crash safety on the smoke repo with real processes: a killed `dvc repro` takes its stage with it
(and the stage runs with PYTHONHASHSEED=0), dead stages' temporaries are removed by the next
`paperline repro`, and two `paperline repro` of one pipeline take turns."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import dvc, set_params

pytestmark = pytest.mark.timeout(600)

OUTS = ["metrics/evaluate.json", "data/eval/base_samples.parquet", "plots/base_accuracy.csv"]


@pytest.fixture
def crash_repo(smoke_copy: Path) -> Path:
    """A copy of the reproduced smoke repo (cache, MLflow store and all) this test may break."""
    return smoke_copy


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None


def _stage_pid(ancestor: int, args: bytes, timeout: float = 120.0) -> int:
    """The pid of the process below `ancestor` whose command line holds `args`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if args not in cmdline or b" -c " in cmdline:  # the stage, not a `sh -c` around it
                continue
            pid, up = int(entry.name), _ppid(int(entry.name))
            while up and up > 1:
                if up == ancestor:
                    return pid
                up = _ppid(up)
        time.sleep(0.2)
    raise AssertionError(f"no process {args!r} below pid {ancestor} within {timeout} s")


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _digest(repo: Path) -> dict[str, str | None]:
    return {o: hashlib.sha256((repo / o).read_bytes()).hexdigest() if (repo / o).exists() else None
            for o in OUTS}


@pytest.mark.parametrize("shell", ["/bin/bash", None], ids=["bash-execs", "sh-stays"])
def test_killed_dvc_takes_its_stage_along(crash_repo: Path, shell: str | None):
    """`dvc repro -f -s evaluate`, SIGKILL dvc while the stage runs: the stage is gone within
    seconds, the next `dvc repro` restores from the run-cache and nothing overwrites it later.
    With SHELL unset dvc runs the cmd through /bin/sh (dash), which stays as the stage's parent."""
    env = dict(os.environ)
    env.pop("SHELL", None)
    if shell:
        env["SHELL"] = shell
    repro = subprocess.Popen([str(Path(sys.executable).parent / "dvc"), "repro", "-f", "-s",
                              "evaluate"], cwd=crash_repo, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        stage = _stage_pid(repro.pid, b"-m stages base evaluate")
        time.sleep(3)  # the stage is importing / computing
        assert _running(stage)
        environ = Path(f"/proc/{stage}/environ").read_bytes().split(b"\0")
        assert b"PYTHONHASHSEED=0" in environ  # stages/__main__.py re-executed itself
        repro.send_signal(signal.SIGKILL)
        repro.wait(timeout=10)
        deadline = time.monotonic() + 5
        while _running(stage) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(stage), f"stage pid {stage} outlived its killed `dvc repro`"
    finally:
        if repro.poll() is None:
            repro.kill()
    out = dvc(crash_repo, "repro", "dvc.yaml").stdout
    assert "Stage 'evaluate' is cached" in out or "didn't change" in out, out
    assert "up to date" in dvc(crash_repo, "status", "dvc.yaml").stdout
    restored = _digest(crash_repo)
    assert all(restored.values()), restored
    time.sleep(5)  # an orphan would have kept computing and written here
    assert _digest(crash_repo) == restored
    assert "up to date" in dvc(crash_repo, "status", "dvc.yaml").stdout


def test_repro_removes_dead_stages_temporaries(crash_repo: Path):
    from tests.conftest import paperline

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = os.getpid()
    planted = {
        f"metrics/.evaluate.json.tmp-{dead.pid}-x": False,
        f"metrics/.evaluate.json.tmp-{live}-1a2b3c4d": True,
        f"data/.tasks.tmp-{dead.pid}-1a2b3c4d/arith/train.parquet": False,
        f"models/.base.tmp-{dead.pid}-0f0f0f0f/model.safetensors": False,
        f"data/eval/.base_samples.parquet.tmp-{live}-deadbeef": True,
        f"plots/.base_accuracy.csv.tmp-{dead.pid}-abcdef12": False,
    }
    for rel in planted:
        (crash_repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (crash_repo / rel).write_text("x")
    proc = paperline(crash_repo, "repro", "base")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for rel, kept in planted.items():
        assert (crash_repo / rel).exists() == kept, rel
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"],
                            cwd=crash_repo, capture_output=True, text=True).stdout
    assert str(dead.pid) not in status, status


def test_two_repros_of_one_pipeline_take_turns(crash_repo: Path,
                                               monkeypatch: pytest.MonkeyPatch):
    """The second `paperline repro base` waits for the first (which recomputes `evaluate`)
    instead of failing on DVC's 'is busy' error; `--no-wait` refuses at once, naming the pid.
    Each repro starts its own fork server here, as a user's does (not the test session's)."""
    monkeypatch.setenv("PAPERLINE_FORKSERVER_SHARED", "off")
    monkeypatch.delenv("PAPERLINE_FORKSERVER", raising=False)  # a user's `off` would hide it
    set_params(crash_repo, **{"evaluate.temperature": 0.7})  # only `evaluate` reruns
    exe = str(Path(sys.executable).parent / "paperline")
    first = subprocess.Popen([exe, "repro", "base"], cwd=crash_repo, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    lock = crash_repo / ".paperline/locks/base.lock"
    deadline = time.monotonic() + 120
    while not (lock.is_file() and f"pid {first.pid} " in lock.read_text()):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.1)
    import psutil

    while not any("stages.core.forkserver" in " ".join(c.cmdline())
                  for c in psutil.Process(first.pid).children()):  # its own server
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.1)
    refused = subprocess.run([exe, "repro", "base", "--no-wait"], cwd=crash_repo,
                             capture_output=True, text=True, timeout=120)
    second = subprocess.Popen([exe, "repro", "base"], cwd=crash_repo, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    out1, err1 = first.communicate(timeout=500)
    out2, err2 = second.communicate(timeout=300)
    assert first.returncode == 0, out1[-2000:] + err1[-2000:]
    assert "Running stage 'evaluate'" in out1
    assert refused.returncode == 2 and f"is being run by pid {first.pid}" in refused.stderr
    assert second.returncode == 0, out2[-2000:] + err2[-2000:]
    assert f"pipeline 'base' is being run by pid {first.pid}" in err2, err2
    assert "is busy" not in err1 + err2
    assert "Running stage" not in out2  # it waited, then found everything up to date


def test_a_stage_runs_in_a_fresh_workspace(smoke_repo: Path, tmp_path: Path):
    """What `paperline run` does with a second branch: a fresh workspace (sources only, the main
    repo's cache) where `dvc repro <stage>` restores exactly the declared upstream outputs. trace's
    `label` loaded models/base at smoke without declaring it: it passed wherever an earlier stage
    had left models/base in the workspace and failed in a fresh one (3 of 4 `paperline run trace`
    on fresh clones). A stage reading an undeclared output fails here every time."""
    from dvc.repo import Repo

    from flows.runner import repo_outs, source_files, sync_workspace

    import shutil

    with Repo(str(smoke_repo)) as r:
        shared = Path(r.cache.local_cache_dir).resolve()
    # a copy of the main cache: label's run here must not enter the shared smoke repo's
    # run-cache, or a later `paperline repro trace` there restores label instead of running it
    # (and never registers trace-tagger in that repo's MLflow store)
    cache_dir = str(tmp_path / "cache")
    shutil.copytree(shared, cache_dir)
    ws = tmp_path / "ws"
    sync_workspace(smoke_repo, ws, source_files(smoke_repo, repo_outs(smoke_repo)), cache_dir)
    assert not (ws / "models/base").exists()
    proc = dvc(ws, "repro", "pipelines/trace/dvc.yaml:label", check=False, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Stage 'base' is cached" in proc.stdout  # restored because label declares it
