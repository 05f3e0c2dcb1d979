"""Scale-out for real: Prefect process workers, each in its own git clone, S3 (SeaweedFS) between
them and the main workspace, the controlling flow of flows/distributed.py.

One Prefect server, one `weed mini`, three workers (`cpu-1`, `cpu-2` on pool paperline-cpu,
`gpu-1` on pool paperline-gpu) shared by the tests, which run in file order: a run equal to a
sequential `dvc repro` with GPU routing and parallel branches, two runs at once, a worker killed
mid-stage, then a scan for the planted secret and for servers bound beyond 127.0.0.1.

DAG of pipeline `base` (root dvc.yaml): a, b -> join (CPU); g_1, g_2 with `meta: {gpus: 1}`.
Pipeline `slow` (pipelines/slow): one stage `partial` that writes a partial output first.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from flows import distributed, stack
from tests.conftest import drain_prefect
from tests.stack.test_s3_storage import (  # noqa: F401  (fixtures: s3, work)
    ACCESS_KEY,
    BUCKET,
    SECRET,
    _clean_env,
    _env_as,
    _git,
    s3,
    work,
)

pytestmark = [pytest.mark.stack, pytest.mark.timeout(300)]

BIN = Path(sys.executable).parent
STEP = '''
import hashlib, json, os, sys, time
from pathlib import Path
import yaml

from stages.core.proc import die_with_parent

die_with_parent()  # the stage contract (`python -m stages` does this): a stage dies with its dvc
name, out, *deps = sys.argv[1:]
params = yaml.safe_load(open("params.yaml"))
timing = os.environ.get("SYN_TIMING_DIR")
worker = os.environ.get("PAPERLINE_WORKER_NAME", "local")
started = time.time()
Path(out).parent.mkdir(parents=True, exist_ok=True)
if name == "partial":  # what a stage killed halfway leaves in its workspace
    Path(out).write_text("PARTIAL-OUTPUT\\n")
    if timing:
        Path(timing, f"partial.started.{worker}").write_text(str(os.getpid()))
if timing and name in ("a", "b"):  # on workers the two branches meet: each waits for the other
    Path(timing, f"{name}.begun").write_text(worker)
    other = Path(timing, {"a": "b", "b": "a"}[name] + ".begun")
    deadline = time.time() + 60
    while not other.exists() and time.time() < deadline:
        time.sleep(0.1)
time.sleep(float(params["sleep"]))
h = hashlib.sha256(f"{name}:{params.get(name)}".encode())
for d in deps:
    h.update(Path(d).read_bytes())
Path(out).write_text(h.hexdigest() + "\\n")
if timing:
    Path(timing, f"{name}.{worker}.{os.getpid()}.json").write_text(
        json.dumps({"name": name, "worker": worker, "span": [started, time.time()]}))
'''
SLEEP = 0.5


def _stage(name: str, out: str, deps: list[str], step: str = "step.py", meta: str = "") -> str:
    return textwrap.dedent(f"""\
      {name}:
        cmd: python {step} {name} {out} {' '.join(deps)}
        deps: [{', '.join([step, *deps])}]
        params: [{name}, sleep]
        outs: [{out}]
    """) + (f"  meta: {meta}\n" if meta else "")


def _make_origin(dest: Path, s3_endpoint: str) -> Path:
    dest.mkdir()
    env = _clean_env()
    _git(dest, "init", "-q")
    subprocess.run([str(BIN / "dvc"), "init", "-q"], cwd=dest, env=env, check=True, timeout=60)
    (dest / "step.py").write_text(STEP)
    (dest / "params.yaml").write_text(yaml.safe_dump({
        "sleep": SLEEP, "a": 1, "b": 2, "join": 3, "g_1": 4, "g_2": 5,
        "storage": {"endpoint_url": s3_endpoint, "bucket": BUCKET, "prefix": "workers"}}))
    stages = [_stage("a", "out/a.txt", []), _stage("b", "out/b.txt", []),
              _stage("join", "out/join.txt", ["out/a.txt", "out/b.txt"]),
              _stage("g_1", "out/g_1.txt", [], meta="{gpus: 1}"),
              _stage("g_2", "out/g_2.txt", [], meta="{gpus: 1}")]
    (dest / "dvc.yaml").write_text("stages:\n" + textwrap.indent("".join(stages), "  "))
    slow = dest / "pipelines" / "slow"
    slow.mkdir(parents=True)
    (slow / "params.yaml").write_text("sleep: 3.0\npartial: 1\n")
    (slow / "dvc.yaml").write_text("stages:\n" + textwrap.indent(
        _stage("partial", "out/partial.txt", [], step="../../step.py"), "  "))
    subprocess.run([str(BIN / "paperline"), "remote", "setup"], cwd=dest, env=env, check=True,
                   capture_output=True, timeout=120)
    _git(dest, "add", "-A")
    _git(dest, "commit", "-qm", "synthetic scale-out DAG")
    return dest


CMDLINES: dict[int, str] = {}   # every process of the workers and controllers seen while running


class _Sampler(threading.Thread):
    """Records the command line of every descendant of the given PIDs, every 0.3 s."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.roots: set[int] = set()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for pid in list(self.roots):
                try:
                    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
                        CMDLINES.setdefault(p.pid, " ".join(p.cmdline()))
                except psutil.Error:
                    pass
            time.sleep(0.3)


@pytest.fixture(scope="module")
def prefect_api(work: Path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = work / "prefect-server"
    home.mkdir()
    stack.up(home, prefect_port=stack.free_port(), components=("prefect",), timeout=120,
             quiet=True)
    try:
        with temporary_settings(updates={PREFECT_API_URL: stack.prefect_api_url(home)}):
            yield stack.prefect_api_url(home), home
    finally:
        try:
            drain_prefect()  # send queued logs and events while the server is still there
        finally:
            stack.down(home, quiet=True)


@pytest.fixture(scope="module")
def cluster(work: Path, s3, prefect_api):
    """The main workspace (origin of the clones) and three workers, each in its own clone."""
    origin = _make_origin(work / "main", s3.endpoint)
    timing = work / "timing"
    timing.mkdir()
    sampler = _Sampler()
    sampler.start()
    # heartbeat 4 s: a worker counts as lost after 3 missed beats + 5 s = 17 s; at 2 s (11 s) a
    # worker on a loaded 2-core box missed beats while it started a flow-run process
    env = _clean_env(PREFECT_WORKER_HEARTBEAT_SECONDS="4", PREFECT_WORKER_QUERY_SECONDS="1",
                     SYN_TIMING_DIR=str(timing), PREFECT_API_URL=prefect_api[0])
    names = {"cpu-1": "paperline-cpu", "cpu-2": "paperline-cpu", "gpu-1": "paperline-gpu"}
    threads = [threading.Thread(target=distributed.start_worker, args=(origin, n),
                                kwargs={"pool": p, "env": env, "timeout": 90})
               for n, p in names.items()]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        pids = {n: distributed.worker_pid(origin, n) for n in names}
        assert all(pids.values()), (pids, {n: (distributed.worker_dir(origin, n) / "worker.log")
                                           .read_text()[-2000:] for n in names})
        sampler.roots.update(pids.values())
        yield {"origin": origin, "timing": timing, "env": env, "pids": pids, "sampler": sampler}
    finally:
        sampler.stop.set()
        for n in names:
            distributed.stop_worker(origin, n, grace=3)


def _spans(timing: Path, name: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(timing.glob(f"{name}.*.json"))]


def _lock(repo: Path, dvcfile: str = "dvc.lock") -> dict:
    return yaml.safe_load((repo / dvcfile).read_text())


def _outs(repo: Path, d: str = "out") -> dict[str, str]:
    return {str(p.relative_to(repo)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted((repo / d).rglob("*")) if p.is_file() and p.name != ".gitignore"}


def _sequential(work: Path, origin: Path, name: str, *targets: str) -> Path:
    """A fresh clone of the main workspace's commit, reproduced by plain sequential `dvc repro`."""
    seq = work / name
    subprocess.run(["git", "clone", "-q", str(origin), str(seq)], check=True, timeout=60)
    subprocess.run([str(BIN / "dvc"), "repro", *targets], cwd=seq, env=_clean_env(),
                   check=True, capture_output=True, timeout=120)
    return seq


def _flow_runs(tag: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[tag])))


def _window(stage: str) -> tuple[float, float]:
    """When the stage's (only) flow run on a worker started and ended."""
    (run,) = _flow_runs(f"stage:{stage}")
    return run.start_time.timestamp(), run.end_time.timestamp()


def test_workers_run_branches_in_parallel_and_route_gpu_stages(work: Path, cluster):
    origin, timing = cluster["origin"], cluster["timing"]
    stages = ["a", "b", "g_1", "g_2"]  # `join` (restored upstream on a worker): next test
    with _env_as(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET):
        summary = distributed.run_distributed(origin, "base", targets=stages, retries=1,
                                              stage_timeout=120)
    assert {k: v["state"] for k, v in summary.items()} == {s: "ran" for s in stages}, summary
    assert len(_outs(origin)) == 4  # equal to a sequential `dvc repro`: the last test
    status = subprocess.run([str(BIN / "dvc"), "status", *stages], cwd=origin,
                            capture_output=True, text=True, timeout=60)
    assert "up to date" in status.stdout, status.stdout

    # routing: GPU stages ran on the GPU pool's worker, CPU stages on the CPU workers
    spans = {n: _spans(timing, n) for n in stages}
    assert all(len(v) == 1 for v in spans.values()), spans
    assert {spans[g][0]["worker"] for g in ("g_1", "g_2")} == {"gpu-1"}
    # one each: `a` and `b` wait for each other (up to 60 s) and a worker runs one flow at a time
    # (`--limit 1`), so this fails only if the second CPU worker never took the other branch
    assert {spans[c][0]["worker"] for c in ("a", "b")} == {"cpu-1", "cpu-2"}
    assert {summary[g]["pool"] for g in ("g_1", "g_2")} == {"paperline-gpu"}
    assert {summary[c]["pool"] for c in ("a", "b")} == {"paperline-cpu"}
    # the two CPU branches ran at the same time, in separate clones
    win = {n: _window(n) for n in stages}
    assert max(win["a"][0], win["b"][0]) < min(win["a"][1], win["b"][1]), win
    # CPU stages did not wait behind the GPU queue: one GPU worker runs g_1, g_2 one after the
    # other, and a CPU stage started before the second GPU stage did (not both: the second CPU
    # worker's first poll can come late, which once put `a` 0.8 s after `g_2` in CI)
    first, second = sorted((win["g_1"], win["g_2"]))
    assert first[1] <= second[0], "two GPU stages overlapped on one GPU worker"
    assert min(win["a"][0], win["b"][0]) < second[0], win
    # each worker has its own working tree, at the pinned commit
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=origin, capture_output=True,
                          text=True).stdout.strip()
    for n in ("cpu-1", "gpu-1"):
        clone = distributed.worker_dir(origin, n) / "repo"
        assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True,
                              text=True).stdout.strip() == head
    gpu_clone = distributed.worker_dir(origin, "gpu-1") / "repo"
    assert (gpu_clone / "out" / "g_1.txt").is_file() or (gpu_clone / "out" / "g_2.txt").is_file()
    assert not (gpu_clone / "out" / "a.txt").exists()


def test_two_runs_at_once_both_finish(work: Path, cluster):
    origin = cluster["origin"]
    params = yaml.safe_load((origin / "params.yaml").read_text())
    params.update(join=30)  # one stage to run, its upstream up to date in the main workspace
    (origin / "params.yaml").write_text(yaml.safe_dump(params))
    _git(origin, "commit", "-qam", "new join")
    # two controlling flows at once (threads of this process: each its own Prefect flow run)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    results: dict[int, object] = {}

    def controller(i: int) -> None:
        try:
            with temporary_settings(updates={PREFECT_API_URL: cluster["env"]["PREFECT_API_URL"]}):
                results[i] = distributed.run_distributed(origin, "base", stage_timeout=120)
        except BaseException as exc:  # reported below
            results[i] = exc

    with _env_as(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET):
        threads = [threading.Thread(target=controller, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    joins_state = []
    for i in range(2):
        summary = results[i]
        assert isinstance(summary, dict), summary
        assert {v["state"] for k, v in summary.items() if k != "join"} == {"skipped"}, summary
        # each controller dispatched `join` to a worker (`worker` in its summary); the worker
        # computed it ("ran"), pulled the other's push ("restored"), or found its own clone
        # already holding the result of the other controller's run ("skipped": both runs
        # landed on the same worker one after the other)
        assert summary["join"]["state"] in ("ran", "restored", "skipped"), summary
        assert summary["join"].get("worker") in ("cpu-1", "cpu-2"), summary
        joins_state.append(summary["join"]["state"])
    assert "ran" in joins_state, joins_state
    assert "up to date" in subprocess.run([str(BIN / "dvc"), "status", "dvc.yaml"], cwd=origin,
                                          capture_output=True, text=True).stdout
    # `join` was computed once per "ran" (the later flow may restore the earlier one's push)
    joins = _spans(cluster["timing"], "join")
    assert len(joins) == joins_state.count("ran"), (joins, joins_state)
    assert {j["worker"] for j in joins} <= {"cpu-1", "cpu-2"}
    assert len(_flow_runs("stage:join")) == 2


def test_killed_worker_stage_is_retried_and_nothing_partial_is_pushed(work: Path, cluster, s3):
    origin, timing = cluster["origin"], cluster["timing"]
    killed: list[str] = []

    orphans: list[psutil.Process] = []

    def kill_when_started() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            for marker in timing.glob("partial.started.*"):
                name = marker.name.rsplit(".", 1)[1]
                killed.append(name)
                # kill -9 of the worker process ALONE: its flow-run process, the dvc under it
                # and the stage must not live on and finish the stage behind the retry's back
                pid = distributed.worker_pid(origin, name)
                orphans.extend(psutil.Process(pid).children(recursive=True))
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_when_started, daemon=True)
    killer.start()
    with _env_as(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET):
        summary = distributed.run_distributed(origin, "slow", retries=1, stage_timeout=120)
    killer.join(5)
    assert killed and killed[0] in ("cpu-1", "cpu-2"), killed
    _, alive = psutil.wait_procs(orphans, timeout=10)
    assert len(orphans) >= 3 and not alive, (orphans, [p.cmdline() for p in alive])
    distributed.stop_worker(origin, killed[0], kill=True)  # tidy its pid file
    assert summary["partial"]["state"] == "ran", summary
    survivor = {"cpu-1": "cpu-2", "cpu-2": "cpu-1"}[killed[0]]
    assert summary["partial"]["worker"] == survivor
    assert [s["worker"] for s in _spans(timing, "partial")] == [survivor]  # one finished attempt

    runs = _flow_runs("stage:partial")
    assert sorted(r.state.type.value for r in runs) == ["COMPLETED", "CRASHED"], runs
    crashed = next(r for r in runs if r.state.is_crashed())
    assert f"worker {killed[0]}" in crashed.state.message
    # the killed worker's clone holds the partial output; the remote never got it
    dead_clone = distributed.worker_dir(origin, killed[0]) / "repo"
    assert (dead_clone / "pipelines/slow/out/partial.txt").read_text() == "PARTIAL-OUTPUT\n"
    stored = s3.keys("workers/")
    assert stored and not any(b"PARTIAL-OUTPUT" in v for v in stored.values())


def test_main_workspace_equals_sequential_repro(work: Path, cluster):
    """Everything the flows above left in the main workspace (pipelines base and slow: outputs
    and dvc.lock files) equals a plain sequential `dvc repro` of a fresh clone of its commit."""
    origin = cluster["origin"]
    assert not distributed.uncommitted_sources(origin)
    seq = _sequential(work, origin, "sequential", "dvc.yaml", "pipelines/slow/dvc.yaml")
    for lock in ("dvc.lock", "pipelines/slow/dvc.lock"):
        assert _lock(origin, lock) == _lock(seq, lock), lock
    for d in ("out", "pipelines/slow/out"):
        assert _outs(origin, d) == _outs(seq, d), d
    assert len(_outs(origin)) == 5 and len(_outs(origin, "pipelines/slow/out")) == 1
    assert "PARTIAL" not in (origin / "pipelines/slow/out/partial.txt").read_text()


def test_no_secret_in_prefect_or_command_lines_and_loopback_only(cluster, prefect_api, s3):
    from prefect.client.orchestration import get_client

    origin = cluster["origin"]
    assert len(CMDLINES) >= 6
    joined = "\n".join(CMDLINES.values())
    # what was sampled: the workers, their flow-run processes, DVC and the stage commands
    for seen in ("worker start", "dvc", "step.py partial"):
        assert seen in joined, (seen, joined[:3000])
    for pid, line in CMDLINES.items():
        assert SECRET not in line and ACCESS_KEY not in line, (pid, line)
    ps = subprocess.run(["ps", "-eww", "-o", "args="], capture_output=True, text=True).stdout
    assert SECRET not in ps

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(limit=200)
        logs, offset = [], 0
        while True:
            page = client.read_logs(limit=200, offset=offset)
            logs += page
            offset += len(page)
            if len(page) < 200:
                break
    assert len(runs) >= 10 and len(logs) >= 50
    text = "\n".join(log.message for log in logs)
    assert "Running stage 'a'" in text  # the stages' DVC output did reach Prefect
    assert SECRET not in text
    for r in runs:
        assert SECRET not in json.dumps(r.parameters) + repr(r.job_variables) + r.name
    for n in ("cpu-1", "cpu-2", "gpu-1"):
        wdir = distributed.worker_dir(origin, n)
        for p in [wdir / "worker.log", *(wdir / "repo" / ".dvc").glob("config*"),
                  wdir / "repo" / "params.yaml"]:
            assert SECRET.encode() not in p.read_bytes(), p

    # servers listen on 127.0.0.1 only; workers listen nowhere else either
    server_pid = stack._read_pid(prefect_api[1], "prefect")
    checked = 0
    for pid in [server_pid, s3.pid, *cluster["pids"].values()]:
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue  # the worker killed by the previous test
        for p in procs:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    checked += 1
                    assert c.laddr.ip == "127.0.0.1", (p.cmdline()[:3], c.laddr)
    assert checked >= 2
