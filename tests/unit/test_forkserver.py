"""The fork server of `paperline repro` (stages/core/forkserver.py): a stage asked of it runs in a
fork of the server with the client's streams, exit code and life; with no server the client runs
the stage itself. That the bytes do not depend on it: tests/pipelines/test_same_bytes_clones.py
(run 1 forked, run 2 not)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from stages.core import forkserver

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _own_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests start and watch servers of their own, not the session's (tests/conftest.py)."""
    monkeypatch.delenv(forkserver.SHARED_ENV, raising=False)


def _wait_ready(path: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, "fork server never listened"
        time.sleep(0.2)


def _stage(cwd: Path, env: dict, *argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "stages", *argv], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _server(env_path: str) -> psutil.Process:
    (server,) = [p for p in psutil.Process().children(recursive=True)
                 if "stages.core.forkserver" in " ".join(p.cmdline())
                 and env_path in p.cmdline()]
    return server


def test_errors_come_back_through_the_clients_streams_and_exit_code():
    base = {**os.environ, forkserver.LATE_ENV: "off"}  # nothing here needs GE
    with forkserver.running(REPO, base) as env:
        path = env[forkserver.ENV]
        _wait_ready(path)
        forked = _stage(REPO, env, "nosuch", "tasks")
        out, err = forked.communicate(timeout=120)
        plain = _stage(REPO, {**base, forkserver.ENV: "off"}, "nosuch", "tasks")
        p_out, p_err = plain.communicate(timeout=120)
        server = _server(path)
    assert forked.returncode == plain.returncode == 2
    assert "nosuch" in err and err == p_err and out == p_out
    # the server is stopped by its PID and its private folder removed
    assert not psutil.pid_exists(server.pid) or server.status() == psutil.STATUS_ZOMBIE
    assert not Path(path).parent.exists()


def test_no_server_the_client_runs_the_stage_itself(tmp_path: Path):
    env = {**os.environ, forkserver.ENV: str(tmp_path / "gone.sock")}
    proc = _stage(REPO, env, "nosuch", "tasks")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "nosuch" in err


@pytest.mark.slow
def test_a_killed_client_takes_its_forked_stage_along(smoke_copy: Path):
    """`base`'s training stage asked of the server: it runs as the server's child (not the
    client's), and a SIGKILL of the client (what a killed dvc does to its stage) kills it
    before it writes its model."""
    model = smoke_copy / "models" / "base"
    before = {p.name: p.stat().st_mtime_ns for p in model.iterdir()}
    with forkserver.running(smoke_copy, dict(os.environ)) as env:
        path = env[forkserver.ENV]
        _wait_ready(path)
        client = _stage(smoke_copy, env, "base", "base")
        server = _server(path)
        deadline = time.monotonic() + 300  # the server imports torch & co. first
        while not server.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = server.children()
        assert child.pid not in {c.pid for c in psutil.Process(client.pid).children()}
        client.send_signal(signal.SIGKILL)
        client.wait(30)
        child.wait(30)  # raises TimeoutExpired if the stage outlived its client
    assert {p.name: p.stat().st_mtime_ns for p in model.iterdir()} == before
    assert not list(model.parent.glob(".*tmp*")) and not list(model.glob("*.tmp*"))


def test_a_client_that_would_import_other_code_runs_the_stage_itself(tmp_path: Path):
    """A client whose PYTHONPATH names other code (a Prefect workspace's) is refused by the
    server, whose children would import the server's code, and runs the stage in its own
    interpreter: here a copy of `stages` whose `main` says so."""
    shadow = tmp_path / "shadow"
    shutil.copytree(REPO / "stages", shadow / "stages",
                    ignore=shutil.ignore_patterns("__pycache__"))
    main = shadow / "stages" / "__main__.py"
    text = main.read_text()
    marker = "def main(argv: list[str] | None = None) -> int:\n"
    assert marker in text
    main.write_text(text.replace(marker, marker + "    print('shadow stages', flush=True)\n"))
    with forkserver.running(REPO, dict(os.environ)) as env:
        _wait_ready(env[forkserver.ENV])
        proc = _stage(REPO / "pipelines" / "racer", {**env, "PYTHONPATH": str(shadow)},
                      "nosuch", "tasks")
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "nosuch" in err
    assert "shadow stages" in out, (out, err)


def _shadow_stages(root: Path) -> Path:
    """A copy of `stages` under `root` whose `main` prints the pid that runs it."""
    shutil.copytree(REPO / "stages", root / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    main = root / "stages" / "__main__.py"
    text = main.read_text()
    marker = "def main(argv: list[str] | None = None) -> int:\n"
    assert marker in text
    main.write_text(text.replace(marker, marker + (
        "    import os\n"
        "    mask = os.umask(0); os.umask(mask)\n"
        "    print('shadow stages in', os.getpid(), sorted(os.sched_getaffinity(0)), oct(mask),"
        " flush=True)\n")))
    return root


def _narrowed() -> None:  # in the client, before it runs: one CPU, a strict umask
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    os.umask(0o077)


def test_a_forked_stage_runs_the_clients_code_on_the_clients_cpus(tmp_path: Path):
    """The server imported `stages` (its own module, `proc`) from where it started; a stage
    asked from another clone runs that clone's code, as a fresh `python -m stages` there
    would: the child forgets the project modules it inherited (a shared server serves every
    repo copy of a test session). It also runs on the client's CPUs (torch sizes its thread
    pool by them) with the client's umask, not the server's."""
    shadow = _shadow_stages(tmp_path / "clone")
    (shadow / ".dvc").mkdir()  # a repo root, as a clone is
    shutil.copy(REPO / "params.yaml", shadow / "params.yaml")
    with forkserver.running(REPO, {**os.environ, forkserver.LATE_ENV: "off"}) as env:
        _wait_ready(env[forkserver.ENV])
        proc = _stage(shadow, env, "nosuch", "tasks", preexec_fn=_narrowed)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "nosuch" in err, (out, err)
    (line,) = [ln for ln in out.splitlines() if ln.startswith("shadow stages in")]
    assert int(line.split()[3]) != proc.pid  # run by the forked child, not by the client
    assert line.endswith(f" [{min(os.sched_getaffinity(0))}] 0o77"), line


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_a_client_on_cpus_the_server_lacks_runs_the_stage_itself(tmp_path: Path):
    """A server confined to one CPU cannot give its child the client's two: it refuses, and
    the client runs the stage in its own interpreter (a stage never fails for the server)."""
    shadow = _shadow_stages(tmp_path / "clone")
    (shadow / ".dvc").mkdir()
    shutil.copy(REPO / "params.yaml", shadow / "params.yaml")
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mine)})  # the server inherits one CPU
    try:
        with forkserver.running(REPO, {**os.environ, forkserver.LATE_ENV: "off"}) as env:
            os.sched_setaffinity(0, mine)
            _wait_ready(env[forkserver.ENV])
            proc = _stage(shadow, env, "nosuch", "tasks")
            out, err = proc.communicate(timeout=120)
    finally:
        os.sched_setaffinity(0, mine)
    assert proc.returncode == 2 and "nosuch" in err, (out, err)
    (line,) = [ln for ln in out.splitlines() if ln.startswith("shadow stages in")]
    assert int(line.split()[3]) == proc.pid, line  # run by the client itself


def test_a_shared_server_serves_each_repro_and_outlives_it(monkeypatch, tmp_path: Path):
    """$PAPERLINE_FORKSERVER_SHARED naming a listening server: `running` starts none and hands
    that one to the stages; naming a socket nobody listens on: it starts its own as usual."""
    clone = _shadow_stages(tmp_path / "clone")
    (clone / ".dvc").mkdir()
    shutil.copy(REPO / "params.yaml", clone / "params.yaml")
    with forkserver.running(REPO, {**os.environ, forkserver.LATE_ENV: "off"}) as env:
        path = env[forkserver.ENV]
        _wait_ready(path)
        server = _server(path)
        real_popen = subprocess.Popen
        monkeypatch.setattr(forkserver.subprocess, "Popen", _FakeServer)  # a start is recorded
        _FakeServer.started.clear()
        with forkserver.running(REPO, {**os.environ, forkserver.SHARED_ENV: path}) as stage_env:
            assert stage_env[forkserver.ENV] == path
            proc = real_popen([sys.executable, "-m", "stages", "nosuch", "tasks"], cwd=clone,
                              env=stage_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 2 and "nosuch" in err
            (line,) = [ln for ln in out.splitlines() if ln.startswith("shadow stages in")]
            assert int(line.split()[3]) != proc.pid  # forked by the shared server
        assert _FakeServer.started == [] and forkserver.listening(path)
        assert server.is_running()
        gone = str(tmp_path / "gone.sock")
        with forkserver.running(REPO, {**os.environ, forkserver.SHARED_ENV: gone}) as stage_env:
            assert stage_env[forkserver.ENV] != gone
        assert len(_FakeServer.started) == 1
    assert not psutil.pid_exists(server.pid) or server.status() == psutil.STATUS_ZOMBIE


def test_trl_is_imported_late_only_for_pipelines_that_train_with_grpo():
    """GE for every pipeline; TRL (and the MLflow it imports) only where a stage depends on the
    GRPO trainer; the environment's setting wins, `off` meaning nothing late."""
    dvcfile = {p: REPO / "pipelines" / p / "dvc.yaml" for p in ("hsir", "ddr", "gift")}
    assert forkserver.late_imports([dvcfile["ddr"]]) == forkserver.GE_IMPORTS
    assert forkserver.late_imports([dvcfile["ddr"], dvcfile["gift"]]) == forkserver.GE_IMPORTS
    with_trl = forkserver.late_imports([dvcfile["ddr"], dvcfile["hsir"]])
    assert with_trl == forkserver.GE_IMPORTS + forkserver.TRL_IMPORTS
    assert forkserver.late_imports([REPO / "dvc.yaml"]) == forkserver.GE_IMPORTS  # base
    assert forkserver.late_imports([REPO / "pipelines" / "nosuch" / "dvc.yaml"]) is None
    for default in (None, "", " ", "on", "1", "true"):
        assert forkserver._late_from_env(default) == forkserver.PRELOAD_AFTER_FIRST
    for off in ("off", "OFF", "0", "false"):
        assert forkserver._late_from_env(off) == ()
    assert forkserver._late_from_env(",".join(with_trl)) == with_trl


class _FakeServer:
    """Stands in for the server process only to see the environment `running` starts it with."""
    started: list[dict] = []

    def __init__(self, args: list[str], **kw: object) -> None:
        _FakeServer.started.append(dict(kw["env"]))  # type: ignore[arg-type]

    def terminate(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int:
        return 0


def test_the_late_list_reaches_the_server_only_and_the_users_setting_wins(monkeypatch):
    monkeypatch.setattr(forkserver.subprocess, "Popen", _FakeServer)
    base = {k: v for k, v in os.environ.items() if k != forkserver.LATE_ENV}
    cases = [({}, forkserver.GE_IMPORTS, ",".join(forkserver.GE_IMPORTS)),
             ({}, (), "off"),
             ({forkserver.LATE_ENV: "off"}, forkserver.GE_IMPORTS, "off"),
             ({forkserver.LATE_ENV: ""}, forkserver.GE_IMPORTS, ",".join(forkserver.GE_IMPORTS)),
             ({}, None, None)]
    for user, late, server_sees in cases:
        _FakeServer.started.clear()
        with forkserver.running(REPO, {**base, **user}, late) as stage_env:
            # the stages get the user's environment, never the list meant for the server
            assert stage_env.get(forkserver.LATE_ENV) == user.get(forkserver.LATE_ENV)
        (server_env,) = _FakeServer.started
        assert server_env.get(forkserver.LATE_ENV) == server_sees, (user, late)


def _imported(stderr: str, module: str) -> bool:
    """Whether a process run with PYTHONPROFILEIMPORTTIME=1 imported `module`, at any depth
    (`import time: self | cumulative |   <indent>name`)."""
    return any(line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == module
               for line in stderr.splitlines())


@pytest.mark.slow
def test_stages_after_the_first_find_great_expectations_imported(smoke_copy: Path):
    """The server imports great-expectations right after it forks the first stage (not before:
    the first stage does not wait for it), so a later stage validates its tables without
    importing GE itself (4-6 s a stage on these machines). A forked child inherits the
    server's import-time flag, so its imports show on the client's stderr."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1", "PAPERLINE_CHECK_CACHE": "off",
           "PAPERLINE_TRACKING": "off"}
    with forkserver.running(smoke_copy, env) as env:
        _wait_ready(env[forkserver.ENV])
        runs = []
        for _ in range(2):  # `tasks` validates every split it writes (the same bytes again)
            proc = _stage(smoke_copy, env, "base", "tasks")
            runs.append((proc.communicate(timeout=300), proc.returncode))
    (_, first_err), first_rc = runs[0]
    (_, second_err), second_rc = runs[1]
    assert first_rc == second_rc == 0, (first_err[-2000:], second_err[-2000:])
    assert _imported(first_err, "great_expectations")  # what this check sees when GE loads
    assert not _imported(first_err, "torch")  # forked: the server had imported torch already
    assert not _imported(second_err, "great_expectations")


def test_the_late_imports_leave_the_warning_state_the_first_ones_keep_theirs(tmp_path: Path):
    """A module that adds a warning filter and turns on logging's capture of warnings (as GE's
    modules do), preloaded as the late set: both undone, so a stage that never imports it sees
    what a fresh process sees; preloaded as the first set (torch, transformers: every model
    stage imports them): kept, as a fresh process that imports them has them."""
    (tmp_path / "noisy_mod.py").write_text(
        "import logging, warnings\n"
        "warnings.filterwarnings('ignore', message='paperline-test')\n"
        "logging.captureWarnings(True)\n")
    probe = ("import logging, sys, warnings\n"
             "from stages.core import forkserver\n"
             "n = len(warnings.filters)\n"
             "forkserver._preload(('noisy_mod',), keep_warning_state=sys.argv[1] == 'late')\n"
             "print(len(warnings.filters) - n, logging._warnings_showwarning is not None)\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    got = {}
    for which in ("late", "first"):
        proc = subprocess.run([sys.executable, "-c", probe, which], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        got[which] = proc.stdout.split()
    assert got == {"late": ["0", "False"], "first": ["1", "True"]}
