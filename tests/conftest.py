"""Shared fixtures. Tools write inside the work tree; nothing reaches a model hub."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
# One state folder per pytest-xdist worker (`make test` runs two) and per concurrent session
# (`make test` runs the server tests beside them with PAPERLINE_TEST_STATE=servers): no shared
# Prefect database.
STATE = REPO / ".paperline" / "test-state" / (os.environ.get("PAPERLINE_TEST_STATE")
                                              or os.environ.get("PYTEST_XDIST_WORKER", "main"))

os.environ.setdefault("PREFECT_HOME", str(STATE / "prefect"))
os.environ.setdefault("HF_HOME", str(STATE / "hf"))
os.environ.setdefault("DVC_SITE_CACHE_DIR", str(STATE / "dvc-site"))
os.environ.setdefault("MPLCONFIGDIR", str(STATE / "mpl"))
os.environ.setdefault("SB3_LOGDIR", str(STATE / "sb3"))  # SB3 models built in tests
# Passed data checks shared by every repo copy of this worker (keyed by content and rules)
os.environ.setdefault("PAPERLINE_CHECK_CACHE", str(STATE / "check-cache"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(STATE / "torchinductor"))
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.pop("MLFLOW_TRACKING_URI", None)  # tests use the repo copy's embedded store
# The venv's bin first, so `dvc` and `python -m stages` resolve to the project's install.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"

# What a fresh clone has: tracked and untracked-but-not-ignored files.
_SKIP = {".git", ".venv", ".paperline", "data", "models", "metrics", "details", "plots", "reports",
         ".pytest_cache", ".hypothesis", "__pycache__"}


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})


def copy_repo(dest: Path, profile: str = "smoke") -> Path:
    """A fresh, committed copy of the project's sources (no outputs, no caches) at `profile`:
    the files git tracks or would track (`git ls-files -co --exclude-standard`), as a clean
    clone has them. A work tree's DVC outputs (a cpu run's `data/`, a measured profile) are
    gitignored and stay out, so a test sees what CI sees."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        parts = Path(rel).parts
        if parts[0] in _SKIP or "__pycache__" in parts:
            continue
        src, out = REPO / rel, dest / rel
        if not (src.exists() or src.is_symlink()):
            continue  # deleted in the work tree, not yet committed
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            out.symlink_to(src.readlink())
        else:
            shutil.copy2(src, out)
    (dest / ".dvc" / "cache").mkdir(parents=True, exist_ok=True)
    set_params(dest, profile=profile)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    _git(dest, "add", "-A")
    _git(dest, "commit", "-qm", "test copy")
    return dest


def set_params(repo: Path, **updates: object) -> None:
    """Set top-level or dotted keys in the repo copy's params.yaml (comments are not kept)."""
    path = repo / "params.yaml"
    params = yaml.safe_load(path.read_text())
    for dotted, value in updates.items():
        keys = dotted.split(".")
        node = params
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def assert_bad_param_rejected(pipeline_dir: Path, pipeline: str, stage: str, dotted: str,
                              value: object, named: str, untouched: Path) -> None:
    """Set `dotted` in the pipeline's params.yaml to a bad `value`, run the stage's process and
    assert it fails naming the parameter's section and `named`, before compute: `untouched` (an
    output of an earlier run) is not rewritten. params.yaml is restored whatever happens."""
    params = pipeline_dir / "params.yaml"
    original = params.read_text()
    before = untouched.stat().st_mtime_ns
    try:
        data = yaml.safe_load(original)
        node = data
        *sections, key = dotted.split(".")
        for k in sections:
            node = node[k]
        node[key] = value
        params.write_text(yaml.safe_dump(data, sort_keys=False))
        proc = subprocess.run([sys.executable, "-m", "stages", pipeline, stage], cwd=pipeline_dir,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0, proc.stdout[-2000:]
        assert key in proc.stderr and named in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    finally:
        params.write_text(original)
    assert untouched.stat().st_mtime_ns == before


def dvc(repo: Path, *args: str, check: bool = True, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(Path(sys.executable).parent / "dvc"), *args], cwd=repo,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"dvc {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def drain_prefect(timeout: float = 20.0) -> int:
    """Send what this process's Prefect log and event workers still hold; return what is left.

    Call it while the server the flows talked to is still up. Prefect drains these services at
    interpreter exit with no timeout, so items left for a server that is gone keep pytest from
    ever exiting (a CI run hit its 90-minute limit this way, after all tests had passed).
    """
    if "prefect" not in sys.modules:
        return 0
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    left = 0
    for service in (APILogWorker, EventsWorker):
        _, pending = service.drain_all(timeout=timeout, at_exit=False)
        left += len(pending)
    return left


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """The report is out; do not let a Prefect service waiting on a dead server hang the exit."""
    left = drain_prefect(timeout=10.0)
    if left:
        sys.stderr.write(f"conftest: {left} Prefect service(s) still sending to a server that is "
                         "gone; exiting without waiting for them\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1] if _EXIT_STATUS else 1)


@pytest.fixture(scope="session", autouse=True)
def shared_forkserver() -> Iterator[None]:
    """One fork server for every `paperline repro` of this test process (stages/core/forkserver.py
    `SHARED_ENV`): torch, transformers, great-expectations and TRL are imported once per pytest
    worker instead of once per repro (~30 repros in `make test`; `benchmarks/RESULTS.md` "Fork
    server, shared"). What a stage computes does not change (each child imports the project's
    code as a fresh `python -m stages` in its working directory would, on the client's CPUs,
    and a client whose interpreter settings differ runs the stage itself); tests of the server
    itself start their own (tests/unit/test_forkserver.py), and so does one end-to-end repro
    (tests/pipelines/test_crash.py, two repros taking turns).
    `PAPERLINE_FORKSERVER_SHARED=off`: every repro starts its own, as a user's does."""
    from stages.core import forkserver

    if os.environ.get(forkserver.SHARED_ENV):  # off, or a server someone else started
        yield
        return
    with forkserver.running(REPO, dict(os.environ)) as env:
        if forkserver.ENV in env:  # not with PAPERLINE_FORKSERVER=off
            deadline = time.monotonic() + 60  # listening before the first repro asks
            while not forkserver.listening(env[forkserver.ENV]) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.environ[forkserver.SHARED_ENV] = env[forkserver.ENV]
        try:
            yield
        finally:
            os.environ.pop(forkserver.SHARED_ENV, None)


@pytest.fixture(scope="session")
def smoke_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project copied once per session and reproduced at `smoke` (shared, read-mostly).

    Through `paperline repro base`: real `dvc repro` under one MLflow parent run.
    """
    repo = copy_repo(tmp_path_factory.mktemp("smoke") / "repo")
    proc = paperline(repo, "repro", "base")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return repo


@pytest.fixture(scope="session")
def vision_repo(smoke_repo: Path) -> Path:
    """`smoke_repo` with the shared vision substrate built once per session (worker):
    `paperline repro vlm`. The pipelines on the tiny VLM (gift, core, same, bridgevlm) reproduce
    their own stages on top, as the other pipelines do on `smoke_repo`, instead of each copying
    the project and training the substrate again (tests/pipelines/test_vlm_pipeline.py keeps a
    fresh copy of its own: it shows the substrate needs no other pipeline)."""
    import time

    started = time.perf_counter()
    proc = paperline(smoke_repo, "repro", "vlm", timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(f"paperline repro vlm at smoke (shared): {time.perf_counter() - started:.1f} s")
    return smoke_repo


def method_runs(client, pipeline: str, methods_only: bool = True) -> list:
    """Every MLflow run of `pipeline` (only its method runs, unless `methods_only` is False) in
    a store that other pipelines share: filtered by the run tag in the query, not by scanning
    the first N runs of every experiment."""
    ids = [e.experiment_id for e in client.search_experiments()]
    return [r for r in client.search_runs(
        ids, filter_string=f"tags.`paperline.pipeline` = '{pipeline}'", max_results=50_000)
        if r.data.tags.get("paperline.method") or not methods_only]


@pytest.fixture
def smoke_copy(smoke_repo: Path, tmp_path: Path) -> Path:
    """A copy of the reproduced smoke repo (cache, MLflow store and all) a test may change: a
    test that needs `base` built starts here instead of reproducing it again."""
    dest = tmp_path / "repo"
    shutil.copytree(smoke_repo, dest, symlinks=True)
    return dest


def paperline(repo: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "paperline"), *args], cwd=repo,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    return copy_repo(tmp_path / "repo")
