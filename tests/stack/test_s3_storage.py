"""S3 storage for real: a SeaweedFS server (`weed mini`, 127.0.0.1, random ports) that checks
credentials, a tiny DVC pipeline pushed and pulled into a fresh clone, the failures a team meets
(wrong secret, unreachable endpoint, missing bucket), MLflow artifacts on S3 (proxied by a server,
and direct from the embedded store), and a planted secret hunted in everything the run left.

The tests share one server and one repo and run in file order; the last one scans what the others
produced (it skips when run alone).
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from stages.core import storage
from tests.conftest import _git

pytestmark = [pytest.mark.stack, pytest.mark.timeout(300)]

SECRET = "PLANTED-SECRET-7f3a"          # the planted credential: must never show up anywhere
WRONG_SECRET = "WRONG-SECRET-91bd"      # a wrong credential: must not be echoed either
ACCESS_KEY = "paperline-test"
BUCKET = "paperline"
BIN = Path(sys.executable).parent

OUTPUTS: list[str] = []                 # stdout/stderr of every command the tests ran
CMDLINES: dict[str, list[str]] = {}     # command lines of the servers, read while they ran
RUN_RECORDS: list[str] = []             # MLflow params, tags and run info of every run logged


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "PAPERLINE_S3_", "MLFLOW_S3_"))}
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET,
               DVC_NO_ANALYTICS="1", GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    env.update(extra)
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 120,
         check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    OUTPUTS.append(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


class _env_as:
    """This process's environment replaced for a block and restored after it, exactly."""

    def __init__(self, **values: str):
        self.values = values

    def __enter__(self) -> None:
        self.saved = dict(os.environ)
        for k in list(os.environ):
            if k.startswith(("AWS_", "PAPERLINE_S3_", "MLFLOW_S3_")):
                del os.environ[k]
        os.environ.update(self.values)

    def __exit__(self, *exc: object) -> None:
        os.environ.clear()
        os.environ.update(self.saved)


def _stop(pid: int, grace: float) -> None:
    """SIGINT (weed stops in ~4 s on SIGINT, 12-20 s on SIGTERM), then SIGKILL, by PID."""
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGINT)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


class S3Server:
    def __init__(self, endpoint: str, pid: int, log: Path, data: Path):
        self.endpoint, self.pid, self.log, self.data = endpoint, pid, log, data

    def client(self, secret: str = SECRET):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=secret,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))

    def keys(self, prefix: str) -> dict[str, bytes]:
        c = self.client()
        out = {}
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            for obj in page.get("Contents", []):
                out[obj["Key"]] = c.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read()
        return out


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("s3")


@pytest.fixture(scope="module")
def s3(work: Path):
    """`weed mini` on 127.0.0.1, every port random, credentials from the environment only."""
    data = work / "weed-data"
    data.mkdir()
    p = _free_ports(10)
    cmd = [str(BIN / "weed"), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
           f"-master.port={p[0]}", f"-master.port.grpc={p[1]}", f"-volume.port={p[2]}",
           f"-volume.port.grpc={p[3]}", f"-filer.port={p[4]}", f"-filer.port.grpc={p[5]}",
           f"-s3.port={p[6]}", f"-s3.port.grpc={p[7]}", f"-admin.port={p[8]}",
           f"-admin.port.grpc={p[9]}", "-admin.ui=false", "-webdav=false",
           "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
           "-master.volumeSizeLimitMB=64", f"-bucket={BUCKET}"]
    log = work / "weed.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=work, env=_clean_env(), stdout=fh,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{p[6]}", proc.pid, log, data)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"weed exited:\n{log.read_text()[-3000:]}"
            try:
                server.client().head_bucket(Bucket=BUCKET)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise AssertionError(f"weed not ready in 60 s:\n{log.read_text()[-3000:]}")
                time.sleep(0.3)
        CMDLINES["weed"] = psutil.Process(proc.pid).cmdline()
        # the secret really is planted: the server holds it, in its environment
        assert psutil.Process(proc.pid).environ().get("AWS_SECRET_ACCESS_KEY") == SECRET
        yield server
    finally:
        _stop(proc.pid, grace=10)
        assert proc.poll() is not None


MAKE_PY = """import pathlib, yaml
n = yaml.safe_load(open("params.yaml"))["n"]
out = pathlib.Path("out")
out.mkdir(exist_ok=True)
(out / "rows.txt").write_text("".join(f"row {i}\\n" for i in range(n)))
"""


@pytest.fixture(scope="module")
def repo(work: Path, s3: S3Server) -> Path:
    """A tiny DVC pipeline (one stage, one output folder), S3 settings in its params.yaml."""
    r = work / "origin"
    r.mkdir()
    env = _clean_env()
    _git(r, "init", "-q")
    _run([str(BIN / "dvc"), "init", "-q"], r, env)
    (r / "params.yaml").write_text(yaml.safe_dump({
        "n": 3, "storage": {"endpoint_url": s3.endpoint, "bucket": BUCKET, "prefix": "t1"}}))
    (r / "make.py").write_text(MAKE_PY)
    (r / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"make": {
        "cmd": f"{sys.executable} make.py", "deps": ["make.py"], "params": ["n"],
        "outs": ["out"]}}}))
    _run([str(BIN / "dvc"), "repro", "-q"], r, env)
    return r


def _paperline(repo: Path, *args: str, env: dict[str, str] | None = None,
               check: bool = True, timeout: int = 120) -> subprocess.CompletedProcess:
    return _run([str(BIN / "paperline"), *args], repo, env or _clean_env(), timeout=timeout,
                check=check)


def _cache_snapshot(repo: Path) -> dict[str, str]:
    cache = repo / ".dvc" / "cache"
    return {str(p.relative_to(cache)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(cache.rglob("*")) if p.is_file()}


def test_push_then_pull_into_a_fresh_clone(work: Path, repo: Path, s3: S3Server):
    out = _paperline(repo, "remote", "setup").stdout
    assert "s3://paperline/t1/dvc" in out
    config = (repo / ".dvc" / "config").read_text()
    assert "url = s3://paperline/t1/dvc" in config and f"endpointurl = {s3.endpoint}" in config
    assert "secret" not in config.lower() and "access_key" not in config.lower()
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "tiny pipeline")

    assert not s3.keys("t1/dvc/")
    push = _paperline(repo, "remote", "push")
    stored = s3.keys("t1/dvc/")
    rows = (repo / "out" / "rows.txt").read_bytes()
    assert rows == b"row 0\nrow 1\nrow 2\n"
    assert rows in stored.values(), (push.stdout, sorted(stored))
    assert any("/runs/" in k for k in stored), f"run-cache not pushed: {sorted(stored)}"
    assert not s3.keys("t1/.paperline-preflight"), "the preflight probe was left behind"

    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True, timeout=60)
    assert not (clone / "out").exists()
    _paperline(clone, "remote", "pull")
    assert (clone / "out" / "rows.txt").read_bytes() == rows
    status = _run([str(BIN / "dvc"), "status"], clone, _clean_env()).stdout
    assert "up to date" in status, status


def test_wrong_credentials_fail_clearly_and_keep_the_cache(repo: Path, s3: S3Server):
    from tests.conftest import set_params

    set_params(repo, n=5)
    _run([str(BIN / "dvc"), "repro", "-q"], repo, _clean_env())
    new_rows = (repo / "out" / "rows.txt").read_bytes()
    before = _cache_snapshot(repo)
    assert new_rows not in s3.keys("t1/dvc/").values()

    bad = _clean_env(AWS_SECRET_ACCESS_KEY=WRONG_SECRET)
    t0 = time.monotonic()
    proc = _paperline(repo, "remote", "push", env=bad, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 30
    err = proc.stderr
    assert "rejected the credentials" in err and s3.endpoint in err and "'paperline'" in err, err
    assert WRONG_SECRET not in proc.stdout + err and SECRET not in proc.stdout + err

    # plain `dvc push` with the wrong secret fails too, and does not echo it
    plain = _run([str(BIN / "dvc"), "push"], repo, bad, check=False, timeout=120)
    assert plain.returncode != 0
    assert WRONG_SECRET not in plain.stdout + plain.stderr

    assert _cache_snapshot(repo) == before, "the local cache changed after a failed push"
    assert (repo / "out" / "rows.txt").read_bytes() == new_rows
    assert new_rows not in s3.keys("t1/dvc/").values()
    _paperline(repo, "remote", "push")  # the right secret: the same cache goes up
    assert new_rows in s3.keys("t1/dvc/").values()


def test_unreachable_endpoint_and_missing_bucket(repo: Path, s3: S3Server):
    dead = f"http://127.0.0.1:{_free_ports(1)[0]}"
    before = _cache_snapshot(repo)
    t0 = time.monotonic()
    proc = _paperline(repo, "remote", "check", env=_clean_env(PAPERLINE_S3_ENDPOINT_URL=dead),
                      check=False)
    assert proc.returncode == 2 and time.monotonic() - t0 < 30
    assert "S3 unreachable" in proc.stderr and dead in proc.stderr, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr

    proc = _paperline(repo, "remote", "push", env=_clean_env(PAPERLINE_S3_ENDPOINT_URL=dead),
                      check=False)
    assert proc.returncode == 2 and dead in proc.stderr, proc.stderr
    assert _cache_snapshot(repo) == before

    with _env_as(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET):
        missing = storage.Settings(bucket="no-such-bucket", endpoint_url=s3.endpoint)
        with pytest.raises(storage.StorageError, match="bucket does not exist") as exc:
            storage.preflight(missing)
        assert "'no-such-bucket'" in str(exc.value) and s3.endpoint in str(exc.value)
    with _env_as():
        with pytest.raises(storage.StorageError, match="no credentials") as exc:
            storage.preflight(storage.Settings(bucket=BUCKET, endpoint_url=s3.endpoint))
        assert s3.endpoint in str(exc.value)


def _run_records(client) -> list[str]:
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert runs
    return [repr(r.data.params) + repr(r.data.tags) + repr(r.info) for r in runs]


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except Exception:
            time.sleep(0.5)
    raise AssertionError(f"{url} not ready in {timeout:.0f}s:\n{log.read_text()[-3000:]}")


def test_mlflow_server_proxies_artifacts_to_s3(work: Path, repo: Path, s3: S3Server):
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    settings = storage.load_settings(repo, env={})
    port = _free_ports(1)[0]
    env = _clean_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", **storage.mlflow_client_env(settings))
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1", "--backend-store-uri", f"sqlite:///{work / 'server.db'}",
           *storage.mlflow_server_args(settings)]
    log = work / "mlflow-server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(f"{url}/health", proc, log, timeout=120)
        CMDLINES["mlflow server"] = psutil.Process(proc.pid).cmdline()
        for child in psutil.Process(proc.pid).children(recursive=True):
            CMDLINES[f"mlflow server child {child.pid}"] = child.cmdline()
        with _env_as():  # the client holds no S3 credentials at all: the server proxies
            client = MlflowClient(tracking_uri=url, registry_uri=url)
            exp = client.create_experiment("s3-proxy")
            run = client.create_run(exp)
            client.log_param(run.info.run_id, "profile", "smoke")
            client.set_tag(run.info.run_id, "paperline.stage", "make")
            client.log_artifact(run.info.run_id, str(repo / "out" / "rows.txt"), "out")
            client.set_terminated(run.info.run_id)
            RUN_RECORDS.extend(_run_records(client))  # read now: the server stops below
            back = download_artifacts(run_id=run.info.run_id, artifact_path="out/rows.txt",
                                      dst_path=str(work / "download"), tracking_uri=url)

        stored = s3.keys("t1/mlflow/")
        rows = (repo / "out" / "rows.txt").read_bytes()
        assert [k for k, v in stored.items() if v == rows and k.endswith("out/rows.txt")], \
            sorted(stored)
        assert Path(back).read_bytes() == rows
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def test_embedded_store_logs_artifacts_to_s3(repo: Path, s3: S3Server):
    import mlflow
    from mlflow import MlflowClient

    from stages.core import tracking

    previous = mlflow.get_tracking_uri()
    saved_uri = os.environ.pop("MLFLOW_TRACKING_URI", None)
    try:
        with _env_as(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET):
            uri = tracking.configure(repo)  # the repo's params: storage on S3
            assert uri.startswith("sqlite:///")
            assert os.environ["MLFLOW_S3_ENDPOINT_URL"] == s3.endpoint
            exp_id = tracking.experiment_id(repo, "tiny")
            client = MlflowClient(tracking_uri=uri)
            location = client.get_experiment(exp_id).artifact_location
            assert location == "s3://paperline/t1/mlflow/tiny"
            run = client.create_run(exp_id)
            client.log_param(run.info.run_id, "n", "5")
            client.log_artifact(run.info.run_id, str(repo / "out" / "rows.txt"))
            client.set_terminated(run.info.run_id)
            RUN_RECORDS.extend(_run_records(client))
    finally:
        mlflow.set_tracking_uri(previous)
        if saved_uri is not None:
            os.environ["MLFLOW_TRACKING_URI"] = saved_uri
    key = f"t1/mlflow/tiny/{run.info.run_id}/artifacts/rows.txt"
    assert s3.keys(key) == {key: (repo / "out" / "rows.txt").read_bytes()}


def test_planted_secret_appears_nowhere(work: Path, s3: S3Server):
    if not (OUTPUTS and RUN_RECORDS and "mlflow server" in CMDLINES):
        pytest.skip("scans what the other tests of this module produced: run the whole module")
    needle = SECRET.encode()
    # files: params, .dvc/config*, DVC's own tmp/logs, git, MLflow stores, server logs; not the
    # S3 server's data directory (its credential store is allowed to know its credential)
    scanned = []
    for p in work.rglob("*"):
        if p.is_file() and s3.data not in p.parents:
            scanned.append(p)
            assert needle not in p.read_bytes(), f"secret found in {p}"
    names = {p.name for p in scanned}
    assert {"params.yaml", "config", "weed.log", "mlflow-server.log", "mlflow.db"} <= names
    for text in OUTPUTS:
        assert SECRET not in text and WRONG_SECRET not in text, text[-2000:]
    assert len(RUN_RECORDS) >= 2 and "paperline.stage" in "".join(RUN_RECORDS)
    for record in RUN_RECORDS:
        assert SECRET not in record, record
    # command lines: the servers' (read while they ran) and every process's now
    assert CMDLINES["weed"] and CMDLINES["mlflow server"]
    for name, cmdline in CMDLINES.items():
        assert SECRET not in " ".join(cmdline), name
    ps = subprocess.run(["ps", "-eww", "-o", "args="], capture_output=True, text=True).stdout
    assert "weed mini" in ps and SECRET not in ps
