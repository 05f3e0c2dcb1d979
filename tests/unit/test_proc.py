"""stages/core/proc.py with real processes: a stage dies with what started it (through a shell that
stays or one that execs), the dvc that flows/ start dies with its flow, an orphan never renames an
output into place, a fixed hash seed, and the per-pipeline lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stages.core import io, proc

REPO = Path(__file__).resolve().parents[2]

# What `python -m stages` does first, then a long sleep (a stage computing); prints its pid.
STAGE = textwrap.dedent(f"""
    import os, sys, time
    sys.path.insert(0, {str(REPO)!r})
    from stages.core import proc
    proc.die_with_parent()
    print(os.getpid(), flush=True)
    time.sleep(60)
""")

# A parent that runs a command the way `dvc repro` does (Popen from its main thread, waits) and
# prints its child's output through.
DVC_LIKE = textwrap.dedent("""
    import subprocess, sys
    subprocess.run(sys.argv[1:])
""")


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            raw = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):  # gone between open and read
            return True
        if raw.rsplit(")", 1)[1].split()[0] == "Z":  # exited, waiting for its (new) parent
            return True
        time.sleep(0.1)
    return False


def _stage_under(parent_argv: list[str]) -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen(parent_argv, stdout=subprocess.PIPE, text=True)
    line = parent.stdout.readline().strip()
    assert line.isdigit(), line
    return parent, int(line)


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_stage_dies_with_its_dvc(shell: str, tmp_path: Path):
    """dash (`sh -c`) stays as the stage's parent, bash execs: either way a killed dvc-like parent
    takes the stage with it within seconds."""
    script = tmp_path / "stage.py"
    script.write_text(STAGE)
    cmd = f"{sys.executable} {script}"
    dvc, stage = _stage_under([sys.executable, "-c", DVC_LIKE, shell, "-c", cmd])
    assert not _gone(stage, 1.0), "the stage should run while its dvc runs"
    dvc.kill()
    dvc.wait(timeout=10)
    assert _gone(stage, 5.0), f"stage pid {stage} outlived its killed dvc ({shell} -c)"


def test_dvc_started_by_a_flow_dies_with_it(tmp_path: Path):
    """flows.runner._stream (paperline run, the final repro, distributed stage flows): the process
    it starts dies with the process that called it, and the stage below with that one."""
    script = tmp_path / "stage.py"
    script.write_text(STAGE)
    flow = textwrap.dedent(f"""
        import logging, sys, threading
        sys.path.insert(0, {str(REPO)!r})
        from flows.runner import _stream

        class Say:
            def info(self, text, *a):
                print(text % a if a else text, flush=True)

        # from a thread, as Prefect runs tasks; the thread waits for its process
        t = threading.Thread(target=_stream, args=([{sys.executable!r}, "-c", {DVC_LIKE!r},
                             "sh", "-c", "{sys.executable} {script}"], ".", None, Say()))
        t.start(); t.join()
    """)
    flow_proc, stage = _stage_under([sys.executable, "-c", flow])
    time.sleep(0.5)
    flow_proc.kill()
    flow_proc.wait(timeout=10)
    assert _gone(stage, 8.0), f"stage pid {stage} outlived the killed flow process"


def test_orphan_does_not_rename_its_output(tmp_path: Path, monkeypatch):
    """The last defence: once the owner is gone, the finished temporary is dropped, the target
    keeps its previous content."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setattr(proc, "_GUARD", proc._Guard(os.getppid(), gone.pid))
    target = tmp_path / "metrics.json"
    target.write_text("before\n")
    with pytest.raises(proc.OrphanedError, match=f"pid {gone.pid}"):
        io.write_json(target, {"value": 1})
    assert target.read_text() == "before\n"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]
    monkeypatch.setattr(proc, "_GUARD", None)  # unguarded (tests, library use): writes as before
    io.write_json(target, {"value": 1})
    assert '"value": 1' in target.read_text()


def test_hash_seed_is_fixed_whatever_the_caller_had():
    snippet = textwrap.dedent(f"""
        import pickle, sys
        sys.path.insert(0, {str(REPO)!r})
        from stages.core import proc
        proc.fixed_process_env()
        print(sys.flags.hash_randomization, pickle.dumps({{"a", "b", "c", "d", "e", "f"}}).hex())
    """)
    outs = set()
    for seed in ("1", "2", "random", None):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        if seed is not None:
            env["PYTHONHASHSEED"] = seed
        out = subprocess.run([sys.executable, "-c", snippet], env=env, capture_output=True,
                             text=True, check=True).stdout
        assert out.startswith("0 "), out
        outs.add(out)
    assert len(outs) == 1, outs


ISA_SNIPPET = textwrap.dedent(f"""
    import hashlib, os, sys
    sys.path.insert(0, {str(REPO)!r})
    from stages.core import proc
    if os.environ.get("FIX") == "1":
        proc.fixed_process_env()
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.randn(64, 257)
    out = torch.cat([torch.softmax(x, -1), torch.nn.functional.gelu(x)])
    print(torch.backends.cpu.get_cpu_capability(), hashlib.md5(out.numpy().tobytes()).hexdigest())
""")


def _snippet_run(snippet: str, **env: str) -> tuple[str, str]:
    """The snippet's two printed words, in a fresh interpreter with none of the pinned kernel
    variables of this process, plus `env`."""
    full = {k: v for k, v in os.environ.items() if k not in (*proc.AVX2_KERNELS, proc.ISA_ENV)}
    out = subprocess.run([sys.executable, "-c", snippet], env=dict(full, **env),
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], out[1]


def _isa_run(**env: str) -> tuple[str, str]:
    return _snippet_run(ISA_SNIPPET, **env)


@pytest.mark.skipif(not proc._cpu_has_avx2(), reason="the AVX2 pin applies to x86-64 CPUs with AVX2")
def test_cpu_kernels_are_pinned_whatever_the_caller_had():
    """Softmax and GELU round differently under torch's DEFAULT (scalar), AVX2 and AVX-512
    kernels; a stage process computes with the AVX2 ones whatever its caller set."""
    unpinned = {isa: _isa_run(ATEN_CPU_CAPABILITY=isa) for isa in ("default", "avx2")}
    assert unpinned["default"][1] != unpinned["avx2"][1]  # the choice changes the bytes
    pinned = {_isa_run(FIX="1", ATEN_CPU_CAPABILITY=isa) for isa in ("default", "avx512", "avx2")}
    pinned.add(_isa_run(FIX="1"))
    assert len(pinned) == 1 and next(iter(pinned))[0] == "AVX2", pinned
    native = _isa_run(FIX="1", ATEN_CPU_CAPABILITY="default", **{proc.ISA_ENV: "native"})
    assert native == ("DEFAULT", unpinned["default"][1])  # native: the caller's choice stands


NUMPY_SNIPPET = textwrap.dedent(f"""
    import hashlib, os, sys
    sys.path.insert(0, {str(REPO)!r})
    from stages.core import proc
    if os.environ.get("FIX") == "1":
        proc.fixed_process_env()
    import numpy as np
    rng = np.random.default_rng(0)
    x = rng.random(100_003) * 10
    a = rng.random((300, 200))
    # numpy's own loop (log) and OpenBLAS's GEMM + LAPACK (solve), as a probe or ridge head uses
    print(hashlib.md5(np.log(x).tobytes()).hexdigest(),
          hashlib.md5(np.linalg.solve(a[:200] @ a[:200].T + np.eye(200), a[:200, :5])
                      .tobytes()).hexdigest())
""")


def _numpy_run(**env: str) -> tuple[str, str]:
    return _snippet_run(NUMPY_SNIPPET, **env)


@pytest.mark.skipif(not proc._cpu_has_avx2(), reason="the AVX2 pin applies to x86-64 CPUs with AVX2")
def test_numpy_and_openblas_kernels_are_pinned_whatever_the_caller_had():
    """numpy's log and OpenBLAS's GEMM round differently under their AVX-512 and AVX2 kernels
    (measured on a Zen 4); a stage process computes with the AVX2 ones whatever its caller set."""
    avx2 = _numpy_run(OPENBLAS_CORETYPE="Haswell",
                      NPY_DISABLE_CPU_FEATURES=proc.NUMPY_AVX512)
    callers = [{}, {"OPENBLAS_CORETYPE": "SkylakeX"}, {"NPY_DISABLE_CPU_FEATURES": ""},
               {"OPENBLAS_CORETYPE": "Prescott", "NPY_DISABLE_CPU_FEATURES": "X86_V3"}]
    assert {_numpy_run(FIX="1", **c) for c in callers} == {avx2}
    if "avx512f" in Path("/proc/cpuinfo").read_text():    # here the choice changes the bytes
        unpinned = _numpy_run()
        assert unpinned[0] != avx2[0] and unpinned[1] != avx2[1], (unpinned, avx2)


def test_cpu_isa_setting_is_checked():
    with pytest.raises(ValueError, match="PAPERLINE_CPU_ISA='avx512'"):
        proc.fixed_env({proc.ISA_ENV: "avx512"})
    assert proc.fixed_env({proc.ISA_ENV: "native"}) == {"PYTHONHASHSEED": "0"}


def test_stale_temporaries_of_dead_pids_only(tmp_path: Path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = os.getpid()
    metrics, data = tmp_path / "metrics", tmp_path / "data"
    planted = {
        metrics / f".solver_check.json.tmp-{dead.pid}-x": False,
        metrics / f".solver_check.json.tmp-{live}-1a2b3c4d": True,
        data / f".items.tmp-{dead.pid}-1a2b3c4d": False,
        data / f".judges.tmp-{dead.pid}-0f0f0f0f" / "direct" / "model.safetensors": False,
        data / f".items.tmp-{live}-deadbeef": True,
        data / ".notes.tmp": True,  # not our naming: never touched
    }
    for p in planted:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x")
    removed = io.clean_stale_tmp_in([metrics, data / "items", data / "judges"])
    assert removed == 3
    for p, kept in planted.items():
        assert p.exists() == kept, p
    assert not (data / f".judges.tmp-{dead.pid}-0f0f0f0f").exists()


LOCKER = textwrap.dedent(f"""
    import sys, time
    sys.path.insert(0, {str(REPO)!r})
    from stages.core import proc
    with proc.pipeline_lock(sys.argv[1], "base", wait=sys.argv[2] == "wait"):
        print("locked", flush=True)
        time.sleep(float(sys.argv[3]))
""")


def test_pipeline_lock_waits_refuses_and_dies_with_its_holder(tmp_path: Path):
    holder = subprocess.Popen([sys.executable, "-c", LOCKER, str(tmp_path), "wait", "60"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    refused = subprocess.run([sys.executable, "-c", LOCKER, str(tmp_path), "no", "0"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
    assert f"is being run by pid {holder.pid}" in refused.stderr
    waiter = subprocess.Popen([sys.executable, "-c", LOCKER, str(tmp_path), "wait", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    assert waiter.poll() is None, "the second run must wait for the first"
    holder.send_signal(signal.SIGKILL)  # the kernel releases a dead holder's lock
    holder.wait(timeout=10)
    out, err = waiter.communicate(timeout=30)
    assert waiter.returncode == 0 and out.strip() == "locked"
    assert f"pipeline 'base' is being run by pid {holder.pid}" in err and "waiting" in err
