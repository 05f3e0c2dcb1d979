"""The local stack, for users who want the UIs: Prefect server, MLflow server, a process worker.

    paperline stack up        # start what is not running; prints the UI URLs
    paperline stack status    # alive/dead, PIDs, URLs
    paperline stack down      # SIGTERM each process group, then SIGKILL after a grace period

Everything binds to 127.0.0.1 and keeps its state in `.paperline/stack/` (ignored by git):
`prefect.db` (SQLite), `<name>.pid` and `<name>.log` for each process, `ports.json`. The MLflow
server serves the project's one local store, the embedded one that `dvc repro` and `paperline
repro` write without the stack (`.paperline/mlflow/mlflow.db`, artifacts in
`.paperline/mlflow/artifacts/`; new experiments' artifacts on S3, `s3://<bucket>/<prefix>/mlflow`,
when S3 storage is configured: stages/core/storage.py): what ran before `up` is in its UI, what
runs while it is up stays in the file after `down`. (Before, the stack kept a store of its own,
`.paperline/stack/mlflow.db`; `up` says so if that file is still there, and leaves it alone.) Processes are started in their own session (process group) and stopped by
PID only. Ports: arguments, else `PAPERLINE_PREFECT_PORT` / `PAPERLINE_MLFLOW_PORT`, else the
ports of the last `up`, else 4200 / 5000.

The worker serves work pool `paperline-cpu` (type `process`, created if missing) with
`PREFECT_API_URL` and `MLFLOW_TRACKING_URI` pointing at these servers, so a run started from the
Prefect UI (a deployment made by `paperline deploy`) runs here and logs to this MLflow server.

Team mode (`paperline stack up --team`): the same servers on PostgreSQL instead of SQLite. A
PostgreSQL server of the stack's own (flows/postgres.py: data in `.paperline/stack/postgres/`,
127.0.0.1, port `PAPERLINE_POSTGRES_PORT` or 5432, databases `prefect` and `mlflow`) is started
first and stopped last. Its password is generated at the first `up` and kept in
`.paperline/stack/pgpass` (0600); the servers read it through `PGPASSFILE`, so no password is on
any command line, in any URL or in the environment. With S3 storage configured, the S3 store is
checked first (a clear error naming the endpoint, never the secret) and MLflow proxies artifacts
to it: clients need no S3 credentials. While any process of the stack runs, `up` keeps its mode
(switching is refused); after `down`, plain `up` is the local stack again.

Servers bind to 127.0.0.1 unless told otherwise (`--bind` / `PAPERLINE_BIND`, e.g. 0.0.0.0 for
workers on other hosts behind your own firewall); PostgreSQL always binds to 127.0.0.1.

Team mode keeps its own MLflow database (`mlflow` on the stack's PostgreSQL): runs logged there
are not in the local file, and the other way round.

Where runs go (`tracking_uri`, used by `paperline repro|run|compare|report|tracking`):
`MLFLOW_TRACKING_URI` if set, else the running stack's MLflow server, else the embedded store.
Prefect likewise: `PREFECT_API_URL`, else the running stack's server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

STACK_DIR = Path(".paperline") / "stack"
WORK_POOL = "paperline-cpu"
DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000, "postgres": 5432}
COMPONENTS = ("prefect", "mlflow", "worker")
TEAM_COMPONENTS = ("postgres", *COMPONENTS)
HOST = "127.0.0.1"


def stack_dir(root: Path) -> Path:
    return Path(root).resolve() / STACK_DIR


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
            return True
        except OSError:
            return False


def _bin(name: str) -> str:
    """The tool from this interpreter's environment (the project's venv)."""
    here = Path(sys.executable).with_name(name)
    return str(here) if here.exists() else name


# ---------------------------------------------------------------------------------------------
# PID files: "<pid> <process create time>", so a reused PID is never mistaken for ours


def _pidfile(root: Path, name: str) -> Path:
    return stack_dir(root) / f"{name}.pid"


def _read_pid(root: Path, name: str) -> int | None:
    """The live PID of component `name`, or None; a stale PID file is removed."""
    import psutil

    path = _pidfile(root, name)
    try:
        pid_s, created_s = path.read_text().split()
        pid, created = int(pid_s), float(created_s)
    except (FileNotFoundError, ValueError):
        if path.exists():
            path.unlink()
        return None
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - created) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE:
            return pid
    except psutil.Error:
        pass
    path.unlink(missing_ok=True)  # stale: the process is gone (or the PID was reused)
    return None


def _write_pid(root: Path, name: str, pid: int) -> None:
    import psutil

    _pidfile(root, name).write_text(f"{pid} {psutil.Process(pid).create_time()}\n")


def ports(root: Path) -> dict[str, int]:
    path = stack_dir(root) / "ports.json"
    recorded = json.loads(path.read_text()) if path.is_file() else {}
    return {k: int(recorded.get(k, v)) for k, v in DEFAULT_PORTS.items()}


def _state(root: Path) -> dict[str, Any]:
    path = stack_dir(root) / "ports.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def is_team(root: Path) -> bool:
    """Whether the stack was last started in team mode (PostgreSQL)."""
    return _state(root).get("mode") == "team"


def _components(root: Path) -> tuple[str, ...]:
    return TEAM_COMPONENTS if is_team(root) else COMPONENTS


def urls(root: Path) -> dict[str, str]:
    p = ports(root)
    return {"prefect": f"http://{HOST}:{p['prefect']}", "mlflow": f"http://{HOST}:{p['mlflow']}"}


def prefect_api_url(root: Path) -> str | None:
    """The stack's Prefect API URL when its server is alive, else None."""
    return f"{urls(root)['prefect']}/api" if _read_pid(root, "prefect") else None


def mlflow_url(root: Path) -> str | None:
    return urls(root)["mlflow"] if _read_pid(root, "mlflow") else None


def tracking_uri(root: Path) -> str:
    """Where MLflow runs go: `MLFLOW_TRACKING_URI`, else the running stack's MLflow server, else
    the embedded store (which that server serves in local mode)."""
    from stages.core.tracking import embedded_uri

    return (os.environ.get("MLFLOW_TRACKING_URI") or mlflow_url(root)
            or embedded_uri(root, create=True))


def use_tracking(root: Path, quiet: bool = False) -> str:
    """Point this process, and the stage processes it starts, at `tracking_uri(root)` (sets
    `MLFLOW_TRACKING_URI` when the stack's server is the answer); returns the URI."""
    uri = tracking_uri(root)
    if not os.environ.get("MLFLOW_TRACKING_URI") and uri.startswith("http"):
        os.environ["MLFLOW_TRACKING_URI"] = uri
        if not quiet:
            print(f"using the stack's MLflow server {uri}")
    return uri


# ---------------------------------------------------------------------------------------------


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return resp.status == 200
    except Exception:
        return False


def _worker_online(api: str, pool: str) -> bool:
    req = urllib.request.Request(f"{api}/work_pools/{pool}/workers/filter", data=b"{}",
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=3) as resp:
            return any(w.get("status") == "ONLINE" for w in json.loads(resp.read()))
    except Exception:
        return False


def _log_tail(root: Path, name: str, n: int = 30) -> str:
    path = stack_dir(root) / f"{name}.log"
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.is_file() else ""


def _spawn(root: Path, name: str, cmd: list[str], env: dict[str, str]) -> int:
    log = open(stack_dir(root) / f"{name}.log", "ab")
    log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} $ {' '.join(cmd)}\n".encode())
    log.flush()
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    _write_pid(root, name, proc.pid)
    return proc.pid


def _wait(root: Path, name: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if _read_pid(root, name) is None:
            raise RuntimeError(f"{name} exited during start-up; log tail:\n{_log_tail(root, name)}")
        time.sleep(0.5)
    raise TimeoutError(f"{name} not ready after {timeout:.0f}s; log tail:\n{_log_tail(root, name)}")


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    env.setdefault("DVC_NO_ANALYTICS", "1")
    return env


def up(root: Path, prefect_port: int | None = None, mlflow_port: int | None = None, *,
       components: tuple[str, ...] | None = None, timeout: float = 180.0,
       quiet: bool = False, team: bool | None = None, bind: str | None = None,
       postgres_port: int | None = None) -> dict[str, dict[str, Any]]:
    """Start the stack's processes that are not running; a no-op (that says so) when all are.

    `team`: PostgreSQL-backed servers (None: the mode of the running stack, else local SQLite).
    `bind`: the address Prefect and MLflow listen on (default `PAPERLINE_BIND` or 127.0.0.1).
    """
    root = Path(root).resolve()
    sdir = stack_dir(root)
    sdir.mkdir(parents=True, exist_ok=True)
    state = _state(root)
    alive = [c for c in TEAM_COMPONENTS if _read_pid(root, c)]
    if team is None:  # keep the mode of a stack that is (partly) up; else the local stack
        team = bool(alive) and state.get("mode") == "team"
    elif alive and team != (state.get("mode") == "team"):
        raise RuntimeError(f"the stack is up in {state.get('mode', 'local')} mode "
                           f"({', '.join(alive)}): `paperline stack down` first to switch")
    if components is None:
        components = TEAM_COMPONENTS if team else COMPONENTS
    elif team and "postgres" not in components:
        components = ("postgres", *components)
    unknown = set(components) - set(TEAM_COMPONENTS if team else COMPONENTS)
    if unknown:
        from stages.core.config import did_you_mean

        raise did_you_mean(sorted(unknown)[0], TEAM_COMPONENTS if team else COMPONENTS,
                           "stack component")
    say = (lambda *a: None) if quiet else print
    running = {c: _read_pid(root, c) for c in components}
    if all(running.values()):
        say(f"stack already up ({', '.join(f'{c} pid {p}' for c, p in running.items())})")
        return status(root)

    p = ports(root)
    asked = {"prefect": prefect_port or os.environ.get("PAPERLINE_PREFECT_PORT"),
             "mlflow": mlflow_port or os.environ.get("PAPERLINE_MLFLOW_PORT"),
             "postgres": postgres_port or os.environ.get("PAPERLINE_POSTGRES_PORT")}
    for k, v in asked.items():
        if v and not _read_pid(root, k):
            p[k] = int(v)
    bind = bind or (state.get("bind") if alive else None) or os.environ.get("PAPERLINE_BIND") \
        or HOST
    if bind not in (HOST, "localhost", "::1"):  # say it: these servers have no authentication
        print(f"warning: Prefect and MLflow will listen on {bind} (not loopback): anyone who "
              "reaches it can use both APIs, and MLflow's artifact proxy with the server's S3 "
              "credentials; put them behind an authenticating proxy", file=sys.stderr)
    for k in ("prefect", "mlflow", "postgres"):
        if k in components and not running.get(k) and not _port_free(p[k]):
            env_name = f"PAPERLINE_{k.upper()}_PORT"
            raise RuntimeError(f"port {p[k]} for {k} is in use on {HOST}: stop what holds it, or "
                               f"choose another port ({env_name}=<port>)")
    s3 = None
    if "mlflow" in components and not running["mlflow"]:
        from stages.core import storage

        if s3 := storage.load_settings(root):  # S3 storage configured: proxy artifacts there
            storage.preflight(s3)  # unreachable / wrong credentials: say so now, with the endpoint
    from stages.core.tracking import embedded_uri

    # `mlflow_store`: the local server serves the embedded store (stages.core.tracking.store_of)
    (sdir / "ports.json").write_text(json.dumps({
        **p, "mode": "team" if team else "local", "bind": bind,
        "mlflow_store": None if team else embedded_uri(root, create=True)}))
    u = urls(root)
    env = _base_env()
    started: list[str] = []
    try:
        pg = None
        if team:
            pg = _postgres_up(root, p["postgres"], timeout)
            if not running["postgres"]:
                started.append("postgres")
        if "prefect" in components and not running["prefect"]:
            db = (pg.url("prefect", "postgresql+asyncpg") if pg
                  else f"sqlite+aiosqlite:///{sdir / 'prefect.db'}")
            penv = dict(env, PREFECT_API_DATABASE_CONNECTION_URL=db,
                        **(pg.client_env() if pg else {}))
            penv.pop("PREFECT_API_URL", None)
            for k in [k for k in penv if k.startswith(("AWS_", "PAPERLINE_S3_"))]:
                del penv[k]  # the Prefect server never needs S3 credentials
            # The UI asks `/ui-settings` where the API is; by default that names port 4200
            # whatever `--port` says, and the UI then shows only "Can't connect to Server API".
            # A path relative to the page works on every port and every address a browser uses.
            penv["PREFECT_UI_API_URL"] = "/api"
            _spawn(root, "prefect", [_bin("prefect"), "server", "start", "--host", bind,
                                     "--port", str(p["prefect"])], penv)
            started.append("prefect")
        if "mlflow" in components and not running["mlflow"]:
            from stages.core import storage

            menv = dict(env, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
                        **(pg.client_env() if pg else {}))
            menv.pop("MLFLOW_TRACKING_URI", None)
            local = Path(embedded_uri(root, create=True)[len("sqlite:///"):])
            art = local.parent / "artifacts"
            art.mkdir(exist_ok=True)
            # Local mode: the embedded store's own file and artifact folder, so experiments made
            # here or by a stage without the server keep their artifacts in one place (file://,
            # readable with or without the server: the stack is on this machine).
            artifacts = ["--default-artifact-root", art.as_uri(),
                         "--artifacts-destination", str(art)]
            if s3:
                artifacts = storage.mlflow_server_args(s3)
                menv.update(storage.mlflow_client_env(s3))  # credentials: inherited environment
            store = pg.url("mlflow", "postgresql+psycopg2") if pg else f"sqlite:///{local}"
            if not pg and (sdir / "mlflow.db").is_file():
                say(f"note: {(sdir / 'mlflow.db').relative_to(root)} (the stack's own store "
                    f"before it served {local.relative_to(root)}) is no longer served; "
                    "left as it is")
            _spawn(root, "mlflow", [_bin("mlflow"), "server", "--host", bind,
                                    "--port", str(p["mlflow"]), "--workers", "1",
                                    "--backend-store-uri", store, *artifacts], menv)
            started.append("mlflow")
        if "prefect" in components:
            _wait(root, "prefect", lambda: _healthy(f"{u['prefect']}/api/health"), timeout)
        if "mlflow" in components:
            _wait(root, "mlflow", lambda: _healthy(f"{u['mlflow']}/health"), timeout)
        if "worker" in components and not running["worker"]:
            if not _read_pid(root, "prefect"):
                raise RuntimeError("the worker needs the stack's Prefect server: "
                                   "start it too (components include 'prefect')")
            wenv = dict(env, PREFECT_API_URL=f"{u['prefect']}/api",
                        MLFLOW_TRACKING_URI=u["mlflow"], PAPERLINE_ROOT=str(root),
                        PREFECT_WORKER_QUERY_SECONDS=env.get("PREFECT_WORKER_QUERY_SECONDS", "3"))
            _spawn(root, "worker", [_bin("prefect"), "worker", "start", "--pool", WORK_POOL,
                                    "--type", "process", "--name", f"{WORK_POOL}-{p['prefect']}"],
                   wenv)
            started.append("worker")
            _wait(root, "worker", lambda: _worker_online(f"{u['prefect']}/api", WORK_POOL),
                  timeout)
    except BaseException:
        for name in reversed(started):
            _stop(root, name, 10.0)
        raise
    # MLflow 3 opens in its GenAI view unless told (or its sidebar switch was clicked once):
    # these are training runs, so the printed link asks for the classic view
    parts = {"prefect": f"Prefect UI {u['prefect']}",
             "mlflow": f"MLflow UI {u['mlflow']}/#/experiments?workflowType=machine_learning",
             "worker": f"worker pool {WORK_POOL}",
             "postgres": f"PostgreSQL {HOST}:{p['postgres']}"}
    say(f"stack up{' (team)' if team else ''}: "
        f"{'  '.join(parts[c] for c in TEAM_COMPONENTS if c in components)}  "
        f"(state in {sdir.relative_to(root)})")
    return status(root)


def _postgres_up(root: Path, port: int, timeout: float):
    """The stack's PostgreSQL server, initialised at the first `up` (flows.postgres.Server)."""
    from flows import postgres

    sdir = stack_dir(root)
    data, pgpass = sdir / "postgres", sdir / "pgpass"
    postgres.init(data, pgpass)
    server = postgres.start(data, pgpass, port, sdir / "postgres.log", host=HOST,
                            timeout=min(timeout, 120.0))
    pid = postgres.postmaster_pid(data)
    if pid and _read_pid(root, "postgres") != pid:
        _write_pid(root, "postgres", pid)
    return server


def _stop(root: Path, name: str, timeout: float) -> str:
    """SIGTERM the component's process group and its descendants, wait, then SIGKILL."""
    import psutil

    pid = _read_pid(root, name)
    if name == "postgres":  # fast shutdown (SIGINT), by the postmaster's PID (from its own
        from flows import postgres  # postmaster.pid: set even if `up` failed before our pidfile)

        if pid is None and postgres.postmaster_pid(stack_dir(root) / "postgres") is None:
            return "not running"
        result = postgres.stop(stack_dir(root) / "postgres", timeout)
        _pidfile(root, name).unlink(missing_ok=True)
        return result
    if pid is None:
        return "not running"
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []

    def signal_all(sig: signal.Signals, targets: list[Any]) -> None:
        try:
            os.killpg(pid, sig)  # started with start_new_session: its group id is its pid
        except ProcessLookupError:
            pass
        for proc in targets:  # descendants that left the group (e.g. a new session)
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    signal_all(signal.SIGTERM, procs)
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    result = "stopped"
    if alive:
        signal_all(signal.SIGKILL, alive)
        psutil.wait_procs(alive, timeout=10)
        result = "killed"
    _pidfile(root, name).unlink(missing_ok=True)
    return result


def down(root: Path, timeout: float = 30.0, quiet: bool = False) -> dict[str, str]:
    """Stop the worker, then the servers (PostgreSQL last); returns component ->
    stopped|killed|not running."""
    root = Path(root).resolve()
    out = {name: _stop(root, name, timeout) for name in ("worker", "mlflow", "prefect")}
    if is_team(root) or _read_pid(root, "postgres"):
        out["postgres"] = _stop(root, "postgres", timeout)
    if not quiet:
        print("stack down: " + ", ".join(f"{k} {v}" for k, v in out.items()))
    return out


def status(root: Path) -> dict[str, dict[str, Any]]:
    """component -> {state: alive|dead, pid, url (servers) / pool (worker), healthy}."""
    root = Path(root).resolve()
    u = urls(root)
    out: dict[str, dict[str, Any]] = {}
    for name in _components(root):
        pid = _read_pid(root, name)
        info: dict[str, Any] = {"state": "alive" if pid else "dead", "pid": pid}
        if name == "postgres":
            info["url"] = f"postgresql://{HOST}:{ports(root)['postgres']}"
            info["healthy"] = bool(pid)
        elif name == "prefect":
            info["url"] = u["prefect"]
            info["healthy"] = bool(pid) and _healthy(f"{u['prefect']}/api/health")
        elif name == "mlflow":
            info["url"] = u["mlflow"]
            info["healthy"] = bool(pid) and _healthy(f"{u['mlflow']}/health")
        else:
            info["pool"] = WORK_POOL
            info["healthy"] = bool(pid)
        info["log"] = str((stack_dir(root) / f"{name}.log").relative_to(root))
        out[name] = info
    return out


def describe(info: dict[str, dict[str, Any]]) -> str:
    """`status()` as lines for a terminal."""
    lines = []
    for name, i in info.items():
        where = i.get("url") or f"pool {i.get('pool')}"
        pid = f"pid {i['pid']}" if i["pid"] else "-"
        lines.append(f"{name:<8} {i['state']:<6} {pid:<11} {where}  (log {i['log']})")
    return "\n".join(lines)
