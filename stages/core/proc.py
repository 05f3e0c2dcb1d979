"""Processes: a stage dies with what started it, runs with a fixed hash seed, and one run of a
pipeline at a time.

Why. `dvc repro` runs a stage as its child (through `$SHELL -c`, or `/bin/sh -c` when SHELL is
unset; dash keeps the shell as the stage's parent, bash execs). Killed, dvc does not take the stage
with it: the orphan ran on, overwrote outputs that dvc had already recorded as cached, and
`dvc status` stayed clean. So:

- `die_with_parent()` (called first thing by `python -m stages`): the kernel sends SIGKILL to the
  stage when its parent dies (Linux `PR_SET_PDEATHSIG`). When the parent is a `sh -c` shell that
  stays, the shell is not what matters: a thread waits for the process above the shell(s) (the
  owner, dvc) to exit and then kills the stage. Where prctl is missing, the same thread watches
  the parent. `owner_alive()` is the last defence: `io.atomic_path` refuses to rename a finished
  output into place once the owner is gone.
- `kill_with_parent()`: a `preexec_fn` for the `dvc` processes that flows/ start, so a killed
  `paperline repro` / `paperline run` / worker flow run takes its dvc (and, through the line above,
  the stage) with it.
- `fixed_process_env()`: a stage re-executes itself under `fixed_env()`, so its bytes do not depend
  on what the caller had set. Pickled sets and dict-of-set orders depend on `PYTHONHASHSEED` (-> 0).
  Float results depend on the CPU's vector kernels: torch picks AVX-512 kernels where the CPU has
  them and AVX2 ones elsewhere, and softmax, GELU and the like then round differently, so a model
  trained on an AVX-512 machine (measured: AMD EPYC Zen 4) had other bytes, and after a few hundred
  steps another train loss, than the same run under AVX2 kernels. On x86-64 CPUs with AVX2 the
  kernels are pinned to AVX2 for torch (`ATEN_CPU_CAPABILITY`), MKL (`MKL_CBWR`, its conditional
  numerical reproducibility branch) and oneDNN (`DNNL_MAX_CPU_ISA`), and likewise for what numpy,
  scipy and scikit-learn compute with: the OpenBLAS that numpy and scipy bundle picks its GEMM
  kernels by CPU (`OPENBLAS_CORETYPE=Haswell`), and numpy its own loops for log, exp and the like
  (`NPY_DISABLE_CPU_FEATURES`: the AVX-512 targets off). Without those two, models trained
  byte for byte alike on two CPUs while a probe or a ridge head fitted on them with numpy or
  scikit-learn did not (measured: maps' length predictor, whose every output is byte-identical to the
  first machine's only with them). One set of kernels that every x86-64 machine of the last
  decade runs. `PAPERLINE_CPU_ISA=native` leaves the choice to
  the libraries (faster on some CPUs; the bytes are then this CPU's own). Not pinned: other
  architectures (ARM has its own kernels) and GPUs (cuBLAS/cuDNN choose by device).
- `pipeline_lock()`: `paperline repro` / `paperline run` of one pipeline take turns (an `flock` on
  `.paperline/locks/<pipeline>.lock`, released by the kernel when its holder dies) instead of
  failing halfway on DVC's "is busy, it is being blocked by" error.

Standard library only: this runs before any heavy import of a stage.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

PR_SET_PDEATHSIG = 1
SHELLS = {"sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "busybox"}
LOCKS = Path(".paperline") / "locks"
HASH_SEED = "0"
ISA_ENV = "PAPERLINE_CPU_ISA"  # "avx2" (the default) or "native"
# numpy's AVX-512 dispatch targets, by their names in numpy 2.x (X86_V4, ...) and 1.x (AVX512F,
# ...): disabled, its loops (log, exp, ...) take the AVX2 (X86_V3) path; an unknown name is ignored
NUMPY_AVX512 = ("X86_V4 AVX512F AVX512CD AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL "
                "AVX512_ICL AVX512_SPR")
# the kernel variables of each library, pinned to its AVX2 code path
AVX2_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
                "OPENBLAS_CORETYPE": "Haswell", "NPY_DISABLE_CPU_FEATURES": NUMPY_AVX512}


class OrphanedError(RuntimeError):
    """The process that started this stage is gone: its outputs must not land."""


# ---------------------------------------------------------------------------------------------
# Hash seed


def _cpu_has_avx2(cpuinfo: str = "/proc/cpuinfo") -> bool:
    try:
        with open(cpuinfo) as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


def fixed_env(environ: dict[str, str] | os._Environ[str] | None = None) -> dict[str, str]:
    """The variables every stage process runs under (see the module docstring): the hash seed,
    and on an x86-64 CPU with AVX2 the AVX2 kernels unless `PAPERLINE_CPU_ISA=native`."""
    environ = os.environ if environ is None else environ
    isa = environ.get(ISA_ENV, "avx2").lower()
    if isa not in ("avx2", "native"):
        raise ValueError(f"{ISA_ENV}={environ[ISA_ENV]!r}: expected 'avx2' or 'native'")
    fixed = {"PYTHONHASHSEED": HASH_SEED}
    if isa == "avx2" and sys.platform.startswith("linux") and _cpu_has_avx2():
        fixed.update(AVX2_KERNELS)
    return fixed


def fixed_process_env() -> None:
    """Re-execute this interpreter, same pid and arguments, under `fixed_env()` unless it runs
    under it already. Call before any heavy import: the first interpreter is thrown away."""
    fixed = fixed_env()
    if all(os.environ.get(k) == v for k, v in fixed.items()):
        return
    os.environ.update(fixed)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


# ---------------------------------------------------------------------------------------------
# Dying with the parent


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


_PRCTL = _prctl()  # resolved once: `kill_with_parent` runs between fork and exec


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel for `sig` when the parent (the thread that forked us) exits."""
    return _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


def kill_with_parent() -> Callable[[], None] | None:
    """A `subprocess.Popen(preexec_fn=...)` that makes the child die with this process (None where
    prctl is missing). Launch from a thread that waits for the child: the signal fires when the
    forking thread ends."""
    if _PRCTL is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above took effect
            os._exit(137)

    return preexec


def _start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot, from /proc); None when it is not running (no
    such process, or a zombie: exited, not yet reaped) or /proc is unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _ppid(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        return int(raw[raw.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _is_command_shell(pid: int) -> bool:
    """`sh -c '...'` (how dvc runs a cmd): a shell that only waits for its command."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    name = os.path.basename(argv[0].decode(errors="replace")).lstrip("-")
    return name in SHELLS and b"-c" in argv[1:]


def owner_of(parent: int) -> int:
    """The first process above `parent`, `parent` included, that is not a `sh -c` shell."""
    pid = parent
    for _ in range(8):  # nested `sh -c "bash -c ..."`; never loop on a broken /proc
        if pid <= 1 or not _is_command_shell(pid):
            return pid
        up = _ppid(pid)
        if up is None:
            return pid
        pid = up
    return pid


class _Guard:
    def __init__(self, parent: int, owner: int):
        self.parent, self.owner = parent, owner
        self.owner_started = _start_time(owner)


_GUARD: _Guard | None = None


def owner_alive() -> bool:
    """True unless this process was guarded by `die_with_parent` and its owner is gone."""
    g = _GUARD
    if g is None:
        return True
    if os.getppid() != g.parent:  # our own parent died: reparented
        return False
    if g.owner == g.parent:
        return True
    if g.owner_started is not None:  # same pid and start time: the same process, running
        return _start_time(g.owner) == g.owner_started
    try:
        os.kill(g.owner, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def check_owner(what: str) -> None:
    """Raise `OrphanedError` when the process that started this stage is gone."""
    if not owner_alive():
        owner = _GUARD.owner if _GUARD else "?"
        raise OrphanedError(f"the process that started this stage (pid {owner}) is gone: "
                            f"{what} is not written (its run was abandoned)")


def _watch(g: _Guard) -> None:
    """Wait for the owner to exit (a pidfd where the kernel has them, else polling every
    0.5 s), then kill this process the way the kernel would."""
    fd = None
    if g.owner != g.parent and hasattr(os, "pidfd_open"):
        with contextlib.suppress(OSError):
            fd = os.pidfd_open(g.owner)
    if fd is not None and owner_alive():  # opened on the right process (no pid reuse)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while True:
            poller.poll(2000)  # readable once the owner exited; the timeout re-checks the parent
            if not owner_alive():
                break
    else:
        while owner_alive():
            time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent() -> int:
    """Make this process die with whatever started it (see module docstring). Returns the pid of
    the owner it watches."""
    global _GUARD
    parent = os.getppid()
    owner = owner_of(parent)
    armed = set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the kernel watched it
        os.kill(os.getpid(), signal.SIGKILL)
    _GUARD = _Guard(parent, owner)
    if owner != parent or not armed:
        threading.Thread(target=_watch, args=(_GUARD,), name="paperline-owner-watch",
                         daemon=True).start()
    return owner


def guard_owner(owner: int) -> None:
    """`die_with_parent` for a stage forked by the fork server (stages/core/forkserver.py): its
    owner is the client process DVC started, not its parent (the server); it dies with either."""
    global _GUARD
    _GUARD = _Guard(os.getppid(), owner)
    threading.Thread(target=_watch, args=(_GUARD,), name="paperline-owner-watch",
                     daemon=True).start()


# ---------------------------------------------------------------------------------------------
# One run of a pipeline at a time


class PipelineBusy(RuntimeError):
    pass


def _holder(path: Path) -> str:
    with contextlib.suppress(OSError):
        text = path.read_text().strip()
        if text:
            return text
    return "another process"


@contextlib.contextmanager
def pipeline_lock(root: Path, pipeline: str, *, wait: bool = True, what: str = "paperline",
                  say: Callable[[str], None] | None = None, poll: float = 0.5) -> Iterator[Path]:
    """Hold `.paperline/locks/<pipeline>.lock` (flock; the kernel releases it when the holder
    dies). Held by someone else: say who and wait, or with `wait=False` raise `PipelineBusy`."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    locks = Path(root) / LOCKS
    locks.mkdir(parents=True, exist_ok=True)
    path = locks / f"{pipeline}.lock"
    fh = open(path, "a+")
    try:
        told = None
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _holder(path)
                if not wait:
                    raise PipelineBusy(
                        f"pipeline {pipeline!r} is being run by {holder} (lock {path}); "
                        "wait for it, or run again without --no-wait to queue behind it"
                    ) from None
                if holder != told:
                    say(f"pipeline {pipeline!r} is being run by {holder}: waiting for it to "
                        f"finish (lock {path}; --no-wait refuses instead)")
                    told = holder
                time.sleep(poll)
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} ({what}, since {time.strftime('%H:%M:%S')})\n")
        fh.flush()
        try:
            yield path
        finally:
            with contextlib.suppress(OSError):
                fh.seek(0)
                fh.truncate()
            fcntl.flock(fh, fcntl.LOCK_UN)
    finally:
        fh.close()
