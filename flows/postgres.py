"""A PostgreSQL server for the team stack (`paperline stack up --team`): initdb, start, stop by PID.

Debian's `postgresql` binaries (`initdb`, `postgres`; found on PATH or under
/usr/lib/postgresql/<version>/bin). The cluster lives in a data folder inside the work tree
(`.paperline/stack/postgres/`), listens on 127.0.0.1 (or `host`) on one TCP port, keeps its unix
socket inside the data folder, and has one role, `paperline`, that owns the databases.

Postgres refuses to run as root: as root the server runs as the `postgres` system user (the data
folder is chowned to it; every folder above it must be searchable by it), otherwise as the
current user.

The password is generated per stack and never reaches a command line: it is written once to
`pgpass` (mode 0600, libpq's `host:port:db:user:password` format) and clients (Prefect through
asyncpg, MLflow through psycopg2) read it via `PGPASSFILE`. Connection URLs carry no password.
initdb reads it from a 0600 file owned by the server's user that is deleted right after.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

USER = "paperline"
SYSTEM_USER = "postgres"


class PostgresError(RuntimeError):
    pass


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / name).exists():
            return str(d / name)
    raise PostgresError(f"PostgreSQL's `{name}` not found (on PATH or /usr/lib/postgresql/*/bin):"
                        " install Debian's `postgresql` package")


@dataclass(frozen=True)
class Server:
    data: Path          # the cluster's data folder (owned by the server's user)
    pgpass: Path        # libpq password file, 0600, owned by the caller
    host: str
    port: int

    def url(self, database: str, driver: str = "postgresql+psycopg2") -> str:
        """A connection URL without password (clients read it from PGPASSFILE)."""
        return f"{driver}://{USER}@{self.host}:{self.port}/{database}"

    def client_env(self) -> dict[str, str]:
        return {"PGPASSFILE": str(self.pgpass)}


def _run_as() -> tuple[int, int] | None:
    """(uid, gid) to drop to when we are root, else None (run as ourselves)."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        entry = pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        raise PostgresError(f"running as root, and there is no `{SYSTEM_USER}` system user to run "
                            "PostgreSQL as (postgres refuses root)") from None
    return entry.pw_uid, entry.pw_gid


def _popen_user(ids: tuple[int, int] | None) -> dict:
    return {} if ids is None else {"user": ids[0], "group": ids[1], "extra_groups": []}


def _check_reachable(data: Path, ids: tuple[int, int] | None) -> None:
    """Every folder above `data` must be searchable by the server's user."""
    if ids is None:
        return
    for parent in data.parents:
        st = parent.stat()
        if not (st.st_mode & 0o001 or (st.st_uid == ids[0] and st.st_mode & 0o100)
                or (st.st_gid == ids[1] and st.st_mode & 0o010)):
            raise PostgresError(f"the `{SYSTEM_USER}` user cannot reach {data}: {parent} is not "
                                f"searchable by it (mode {oct(st.st_mode & 0o777)}); keep the "
                                "stack inside a world-searchable folder")


def read_password(pgpass: Path) -> str:
    return pgpass.read_text().strip().rsplit(":", 1)[1]


def init(data: Path, pgpass: Path) -> bool:
    """Create the cluster (once) and its password file; returns False when it exists already.
    The databases are created by `start`."""
    data = Path(data)
    if (data / "PG_VERSION").is_file():
        if not pgpass.is_file():
            raise PostgresError(f"{data} exists but its password file {pgpass} is gone: remove "
                                f"{data} to start over (its databases are lost)")
        return False
    ids = _run_as()
    data.mkdir(parents=True, exist_ok=True)
    _check_reachable(data, ids)
    password = secrets.token_urlsafe(24)
    pgpass.parent.mkdir(parents=True, exist_ok=True)
    pgpass.unlink(missing_ok=True)  # a leftover (or a planted link) is never reused
    fd = os.open(pgpass, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(f"*:*:*:{USER}:{password}\n")
    os.chmod(pgpass, 0o600)
    pwfile = data.parent / f".{data.name}.initpw"
    fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(password + "\n")
    try:
        if ids is not None:
            os.chown(data, *ids)
            os.chown(pwfile, *ids)
        os.chmod(data, 0o700)
        proc = subprocess.run(
            [_binary("initdb"), "-D", str(data), "-U", USER, f"--pwfile={pwfile}",
             "--auth=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8", "--no-sync"],
            capture_output=True, text=True, timeout=180, cwd=data, **_popen_user(ids))
    finally:
        pwfile.unlink(missing_ok=True)
    if proc.returncode != 0:
        raise PostgresError(f"initdb failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    with open(data / "postgresql.conf", "a") as fh:
        fh.write("\n# paperline team stack\nfsync = on\nlogging_collector = off\n"
                 "log_connections = off\nlog_statement = none\n")
    return True


def postmaster_pid(data: Path) -> int | None:
    """The running postmaster's PID from postmaster.pid, or None."""
    import psutil

    try:
        pid = int((Path(data) / "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        proc = psutil.Process(pid)
        if proc.status() != psutil.STATUS_ZOMBIE and "postgres" in proc.name():
            return pid
    except psutil.Error:
        pass
    return None


def start(data: Path, pgpass: Path, port: int, log: Path, host: str = "127.0.0.1",
          databases: tuple[str, ...] = ("prefect", "mlflow"), timeout: float = 60.0) -> Server:
    """Start the postmaster (bound to `host`:`port`), wait until it accepts connections, create
    missing databases. A no-op when it is already running on that folder."""
    data = Path(data)
    server = Server(data=data, pgpass=pgpass, host=host, port=port)
    if postmaster_pid(data) is None:
        ids = _run_as()
        _check_reachable(data, ids)
        # the unix socket inside the data folder, unless its path is too long for a socket
        sockets = str(data) if len(str(data)) + len(f"/.s.PGSQL.{port}.lock") < 107 else ""
        cmd = [_binary("postgres"), "-D", str(data), "-p", str(port),
               "-c", f"listen_addresses={host}", "-c", f"unix_socket_directories={sockets}"]
        with open(log, "ab") as fh:
            fh.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} $ {' '.join(cmd)}\n".encode())
            fh.flush()
            proc = subprocess.Popen(cmd, cwd=data, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env=_server_env(), **_popen_user(ids))
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise PostgresError(f"postgres exited ({proc.returncode}) during start-up; log "
                                    f"tail:\n{_tail(log)}")
            if _accepts(server):
                break
            if time.monotonic() > deadline:
                stop(data)
                raise PostgresError(f"postgres not ready after {timeout:.0f}s; log tail:\n"
                                    f"{_tail(log)}")
            time.sleep(0.2)
    _create_databases(server, databases)
    return server


def _server_env() -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "TZ")
    return {k: os.environ[k] for k in keep if k in os.environ}  # nothing secret reaches it


def _tail(log: Path, n: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:]) if log.is_file() else ""


def connect(server: Server, database: str = "postgres", timeout: int = 5):
    import psycopg2

    return psycopg2.connect(host=server.host, port=server.port, user=USER, dbname=database,
                            passfile=str(server.pgpass), connect_timeout=timeout)


def _accepts(server: Server) -> bool:
    try:
        connect(server, timeout=2).close()
        return True
    except Exception:
        return False


def _create_databases(server: Server, databases: tuple[str, ...]) -> None:
    conn = connect(server)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("SELECT datname FROM pg_database")
            have = {row[0] for row in cur.fetchall()}
            for name in databases:
                if name not in have:
                    cur.execute(f'CREATE DATABASE "{name}" OWNER {USER}')
    finally:
        conn.close()


def stop(data: Path, timeout: float = 30.0) -> str:
    """Fast shutdown by PID (SIGINT to the postmaster), SIGQUIT then SIGKILL after `timeout`.
    Returns stopped|killed|not running."""
    import psutil

    pid = postmaster_pid(data)
    if pid is None:
        return "not running"
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    proc.send_signal(signal.SIGINT)  # "fast" shutdown: roll back open transactions, exit cleanly
    _, alive = psutil.wait_procs([proc], timeout=timeout)
    result = "stopped"
    if alive:
        for sig in (signal.SIGQUIT, signal.SIGKILL):
            for p in [x for x in procs if x.is_running()]:
                try:
                    p.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            _, alive = psutil.wait_procs(procs, timeout=5)
            if not alive:
                break
        result = "killed"
    psutil.wait_procs(procs, timeout=5)
    return result
