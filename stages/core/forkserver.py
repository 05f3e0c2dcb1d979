"""Warm stage start-up: a fork server for `python -m stages`.

Every DVC stage is a fresh `python -m stages <pipeline> <stage>` process, and a stage that loads
a model spends seconds importing torch and transformers before its work starts (a tiny `smoke`
stage often spends most of its life there; `benchmarks/RESULTS.md` "Stage start-up"). Under
`paperline repro`, one server process imports those libraries once (when the first stage asks;
great-expectations, and TRL where a pipeline trains with GRPO, right after it forks that stage),
and each stage process asks it for a forked copy of itself to run the stage in:

    dvc ── sh -c ── python -m stages p s  (the *client*: what DVC started and waits for)
                          │  unix socket: argv, cwd, environment, and its stdin/stdout/stderr
    paperline ── server ──┴── fork ── the stage runs here: `stages.__main__.main(argv)`

What the stage computes does not change: the child starts from the state the server reached by
importing third-party libraries only (the few project modules the server itself runs are
forgotten in the child, which imports the project from wherever a fresh `python -m stages` in
the client's working directory would: sys.path[0], PYTHONPATH, the editable install; so a code
change is always seen), with the client's working directory, environment, CPU affinity, umask,
argv and standard streams, under the same `PYTHONHASHSEED` (stages/core/proc.py), and seeds
everything it uses as it does in a fresh process. No torch op runs in the server, so no thread
pool exists to be lost in the fork.

Life and death are the client's, as DVC sees them: the client forwards SIGINT, SIGTERM, SIGHUP
and SIGQUIT to the child and exits with the child's status (killed by a signal: the client kills
itself with the same signal); the child dies when the client dies (it watches the client the way
`proc.die_with_parent` watches a stage's owner, so `proc.check_owner` still refuses to write for
an abandoned run), and the server dies with `paperline repro` (a shared server, named by
$PAPERLINE_FORKSERVER_SHARED, with whoever started it: the test session, tests/conftest.py).
Where no server answers (plain `dvc repro`, a server still importing, a Prefect worker) the
client runs the stage itself, as before: the server is an optimisation only, never a
requirement.

Only processes of this user can connect: the socket lives in a private (0700) directory and the
server checks each peer's uid (SO_PEERCRED).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from collections.abc import Iterator

from stages.core.proc import AVX2_KERNELS  # standard library only

ENV = "PAPERLINE_FORKSERVER"  # the socket's path, set for stage processes by `paperline repro`
# The socket of a server that outlives one `paperline repro`, started by whoever runs many of
# them (the test session: tests/conftest.py): `running` hands it to the stages instead of
# starting a server of its own, so torch & co. are imported once for all the repros, not once
# for each (`benchmarks/RESULTS.md` "Fork server, shared").
SHARED_ENV = "PAPERLINE_FORKSERVER_SHARED"
# What a model stage imports before its work (torch, transformers' Llama, its Trainer and
# tokenizers, the data stack). Third-party only: project modules are imported by each child.
# DVC's Repo: every stage reads its own deps through it for its tracking key (core/tracking.py).
PRELOAD = ("numpy", "polars", "pydantic", "yaml", "dvc.repo", "torch", "safetensors.torch",
           "transformers", "transformers.models.llama.modeling_llama", "transformers.trainer",
           "transformers.models.auto.tokenization_auto")
# Imported right after the first stage is forked (that stage does not wait for them), for the
# stages after it: great-expectations, which every stage that writes a new table imports to
# validate it (about 4-6 s here, as long as torch and transformers together), and TRL's GRPO
# trainer (2-2.5 s here with the MLflow it imports; every RL stage). Measured with
# PYTHONPROFILEIMPORTTIME:
# the stages of a smoke `paperline repro hsir --force` imported GE 8 times, 38 s of its 126 s;
# side by side: 0.69x the CPU of the server without them (`benchmarks/RESULTS.md` "Fork server,
# late imports").
GE_IMPORTS = ("great_expectations", "great_expectations.expectations",
              "great_expectations.data_context.types.base")
TRL_IMPORTS = ("trl.trainer.grpo_trainer",)  # only where a stage trains with GRPO (late_imports)
PRELOAD_AFTER_FIRST = GE_IMPORTS + TRL_IMPORTS  # the default when nobody says which
# The server's late imports, in its environment: unset, empty or `on`, PRELOAD_AFTER_FIRST;
# `off`, none (PRELOAD only: the benchmark's baseline, benchmarks/forkserver.py); else a
# comma-separated list of modules (what `paperline repro` asks for: late_imports).
LATE_ENV = "PAPERLINE_FORKSERVER_LATE"
# What decides which code a fresh interpreter imports, fixed when the server started: a client
# whose values differ (a Prefect workspace's PYTHONPATH, say) runs its stage itself.
# So are the CPU kernels the libraries pick (read once, when torch and MKL load):
# stages/core/proc.py.
# So are what the libraries read when imported or loaded: Hugging Face's cache and offline
# settings, the thread pools' sizes, the visible GPUs (a shared server outlives the environment
# of the repro that started it: each client must match the one it was started with).
SAME_ENV = ("PYTHONPATH", "PYTHONHASHSEED", "PYTHONHOME", "PYTHONSAFEPATH", "VIRTUAL_ENV",
            "PAPERLINE_CPU_ISA", *AVX2_KERNELS, "HF_HOME", "HF_HUB_CACHE",
            "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "XDG_CACHE_HOME",
            "HF_DATASETS_CACHE", "HF_DATASETS_OFFLINE",
            "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
            "CUDA_VISIBLE_DEVICES")
# A connect never waits: a listening server's backlog takes it at once, and a full backlog (a
# server that stopped accepting) refuses it at once (a Unix socket with a timeout does not
# block in connect), so the client runs the stage itself. A server that accepts and never
# answers is not guarded against: once it may have forked, running the stage here too would
# run it twice.
CONNECT_TIMEOUT = 10.0
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_HEADER = struct.Struct("!I")


def _send(sock: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    msg = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [msg], fds)
    else:
        sock.sendall(msg)


def _recv_exact(sock: socket.socket, n: int, fds: list[int] | None = None) -> bytes:
    buf = b""
    while len(buf) < n:
        if fds is not None and not buf:
            chunk, got, _, _ = socket.recv_fds(sock, n - len(buf), 8)
            fds.extend(got)
        else:
            chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("fork server connection closed")
        buf += chunk
    return buf


def _recv(sock: socket.socket, fds: list[int] | None = None) -> dict:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, fds))
    return json.loads(_recv_exact(sock, size))


# ---------------------------------------------------------------------------------------------
# Client: the `python -m stages` process DVC started


def _process_state() -> dict:
    """What a process inherits besides its environment and that a stage's result can depend
    on: the CPUs it may run on (torch's thread count follows them, stages/models/base.py) and
    the umask its files are created with. The child takes the client's."""
    state: dict = {"umask": os.umask(0o022)}
    os.umask(state["umask"])
    if hasattr(os, "sched_getaffinity"):
        state["cpus"] = sorted(os.sched_getaffinity(0))
    return state


def delegate(argv: list[str]) -> int | None:
    """Run the stage in a forked child of the server named by $PAPERLINE_FORKSERVER and return
    its exit code; None when no server answers (the caller then runs the stage itself)."""
    path = os.environ.get(ENV)
    if not path:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT)  # a full backlog: run here (CONNECT_TIMEOUT)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    sock.settimeout(None)  # the answer comes after the server's first imports: seconds
    try:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        _send(sock, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ),
                     "client": os.getpid(), **_process_state()}, [0, 1, 2])
        child = int(_recv(sock)["pid"])
    except (OSError, EOFError, ValueError, KeyError):
        sock.close()
        return None  # the server could not fork: run here

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        status = _recv(sock)
    except (OSError, EOFError):  # the server died with the child: as if killed
        status = {"signal": int(signal.SIGKILL)}
    if "signal" in status:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(status["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), status["signal"])
        time.sleep(1)  # SIGKILL/SIGTERM land before this returns
        return 128 + int(status["signal"])
    return int(status["exit"])


# ---------------------------------------------------------------------------------------------
# Server


def _run_child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: become the stage process the client would have been, run the
    stage, exit. Never returns."""
    code = 1
    try:
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        for stream in (sys.stdin, sys.stdout, sys.stderr):  # fresh buffers on the new fds
            with contextlib.suppress(Exception):
                stream.flush()
        os.chdir(request["cwd"])
        if "umask" in request:
            os.umask(int(request["umask"]))
        if request.get("cpus") and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, request["cpus"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [sys.argv[0], *request["argv"]]
        sys.path[0] = request["cwd"]
        # the project's own modules come from where a fresh `python -m stages` in this cwd
        # finds them (sys.path[0], PYTHONPATH, the editable install), not from the server's
        # start: forget the few it imported
        for name in [n for n in sys.modules if n == "stages" or n.startswith("stages.")]:
            del sys.modules[name]
        for sig in FORWARDED + (signal.SIGCHLD,):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        conn.close()  # the server keeps its end; the child watches the client by pid
        from stages.core import proc

        proc.guard_owner(int(request["client"]))
        main_module = importlib.import_module("stages.__main__")
        sys.modules["__main__"] = main_module  # what `spawn` workers re-import, as under -m
        code = main_module.main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 (what the interpreter does with an uncaught error)
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        import atexit
        import logging

        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


def _await_child(conn: socket.socket, pid: int) -> None:
    """In the server: tell the client the child's exit status."""
    with contextlib.closing(conn):
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            if os.WIFSIGNALED(status):
                _send(conn, {"signal": os.WTERMSIG(status)})
            else:
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})


def late_imports(dvcfiles: list[Path]) -> tuple[str, ...] | None:
    """What the server of a `paperline repro` of these pipelines (their dvc.yaml files) imports
    after the first fork: great-expectations always (most stages validate a table), TRL only
    when one of them has a stage that depends on the GRPO trainer (2-2.5 s of CPU, MLflow
    included, that 17 of 22 pipelines would never use). Upstream pipelines' files are not
    read: no pipeline's GRPO stage is upstream of another today, and a miss costs time only.
    None (the default list) when a file cannot be read: this never fails a repro."""
    try:
        grpo = any(b"stages/train/grpo_trainer.py" in Path(f).read_bytes() for f in dvcfiles)
    except OSError:
        return None
    return GE_IMPORTS + (TRL_IMPORTS if grpo else ())


def _late_from_env(value: str | None) -> tuple[str, ...]:
    if value is None or value.strip().lower() in ("", "on", "1", "true"):
        return PRELOAD_AFTER_FIRST
    if value.strip().lower() in ("off", "0", "false"):
        return ()
    return tuple(n.strip() for n in value.split(",") if n.strip())


def _preload(names: tuple[str, ...], *, keep_warning_state: bool = False) -> None:
    """Import `names` here, each stage forked later then finds them imported. An import that
    fails is left to the stages that need it (they import it themselves, as without a server).

    `keep_warning_state` (the late set): the process-wide warning state is left as it was.
    Importing GE turns on `logging.captureWarnings` and some libraries add warning filters, and
    a stage that never imports them must see what a fresh process sees (stages/core/checks.py
    `_gx` turns the capture on in the stages that validate, as GE's import would). Not for
    PRELOAD: every model stage imports torch and transformers, whose filters (e.g. torch's
    lr_scheduler UserWarnings ignored) a fresh process would have too."""
    import logging
    import warnings

    # the project's setting (stages/core/tracking.py), read when MLflow is imported: TRL does
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    logging.getLogger("great_expectations").setLevel(logging.WARNING)  # as checks._gx does
    capturing = logging._warnings_showwarning is not None  # type: ignore[attr-defined]
    # catch_warnings restores the filters and showwarning on exit
    with warnings.catch_warnings() if keep_warning_state else contextlib.nullcontext():
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 (an optimisation only)
                print(f"paperline fork server: {name} not preloaded: {exc!r}", file=sys.stderr)
        if keep_warning_state:
            logging.captureWarnings(capturing)
    for stream in (sys.stdout, sys.stderr):  # nothing of ours left buffered for a child's fds
        stream.flush()


def serve(path: str) -> None:
    """Fork one child per connection, forever; the heavy libraries are imported when the first
    stage asks (that stage waits about as long as it would have imported them itself), so a
    `paperline repro` with nothing to run costs nothing here; the second set right after that
    stage is forked (a stage asking meanwhile waits for the rest of that import: stages come
    one at a time under `dvc repro`, so it is the next stage, which usually validates a table
    and would have imported GE itself)."""
    preloaded = False
    late = _late_from_env(os.environ.get(LATE_ENV))
    late_done = not late
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # connectable only once listening: clients never wait
    server.listen(64)
    uid = os.getuid()
    while True:
        conn, _ = server.accept()
        fds: list[int] = []
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                    struct.calcsize("3i"))
            if struct.unpack("3i", creds)[1] != uid:
                raise PermissionError("peer of another user")
            request = _recv(conn, fds)
            differs = [k for k in SAME_ENV if request["env"].get(k) != os.environ.get(k)]
            cpus = request.get("cpus")
            if cpus and hasattr(os, "sched_getaffinity") and \
                    not set(cpus) <= os.sched_getaffinity(0):  # the child could not take them
                differs.append("CPU affinity")
            if differs:  # a fresh interpreter would import other code: let the client run it
                # (refused before the preload: a refused client does not wait for it)
                _send(conn, {"refused": f"{', '.join(differs)} differ from the server's"})
                raise ValueError(differs)
            if not preloaded:
                _preload(PRELOAD)
                preloaded = True
            pid = os.fork()
        except (OSError, EOFError, ValueError):
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        if pid == 0:
            server.close()
            _run_child(conn, request, fds)
        for fd in fds:
            os.close(fd)
        try:
            _send(conn, {"pid": pid})
        except OSError:
            pass  # the client is gone; the child watches it and dies too
        threading.Thread(target=_await_child, args=(conn, pid), daemon=True).start()
        if not late_done:
            late_done = True
            _preload(late, keep_warning_state=True)


def listening(path: str) -> bool:
    """Whether a server accepts connections on the socket `path` (it reads the empty request
    as a client gone and goes on)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT)
    try:
        sock.connect(path)
        return True
    except OSError:
        return False
    finally:
        sock.close()


@contextlib.contextmanager
def running(root: Path, env: dict[str, str],
            late: tuple[str, ...] | None = None) -> Iterator[dict[str, str]]:
    """A fork server for the stages of one `paperline repro`: yields `env` with $ENV set (a stage
    that comes before the server listens starts normally); stops it by its PID on exit.
    `PAPERLINE_FORKSERVER=off` in `env` turns it off; $PAPERLINE_FORKSERVER_SHARED naming a
    server that listens: that one, none started (its late imports are its own). `late`: what
    the server imports after the first fork (default PRELOAD_AFTER_FIRST);
    $PAPERLINE_FORKSERVER_LATE in `env` wins."""
    if env.get(ENV, "").lower() in ("off", "0", "false") or not hasattr(socket, "send_fds"):
        yield {k: v for k, v in env.items() if k != ENV}
        return
    shared = env.get(SHARED_ENV, "")
    # a server that outlives this repro: its owner stops it
    if shared.lower() not in ("", "off", "0", "false") and listening(shared):
        yield dict(env, **{ENV: shared})
        return
    from stages.core.proc import fixed_env, kill_with_parent

    folder = tempfile.mkdtemp(prefix="paperline-fs-")  # 0700: only this user connects
    path = os.path.join(folder, "sock")
    server_env = dict(env, **fixed_env(env))  # what every stage runs under
    server_env.pop(ENV, None)
    if late is not None and not env.get(LATE_ENV, "").strip():  # the user's setting wins
        server_env[LATE_ENV] = ",".join(late) or "off"
    proc = subprocess.Popen([sys.executable, "-m", "stages.core.forkserver", path],
                            cwd=root, env=server_env, stdin=subprocess.DEVNULL,
                            preexec_fn=kill_with_parent())
    try:
        yield dict(env, **{ENV: path})
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for name in ("sock", "sock.tmp"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
        with contextlib.suppress(OSError):
            os.rmdir(folder)


if __name__ == "__main__":
    from stages.core import proc as _proc

    _proc.fixed_process_env()
    _proc.die_with_parent()
    serve(sys.argv[1])
