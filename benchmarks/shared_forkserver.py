"""A fork server per `paperline repro` against one shared by several, side by side.

    .venv/bin/python benchmarks/shared_forkserver.py [--rounds 2] [--pipelines ddr racer cotfsm]
        [--write]

The test suite runs ~30 smoke `paperline repro`s on each pytest worker. Each starts a fork
server that imports torch, transformers, great-expectations (and TRL) again; with
`PAPERLINE_FORKSERVER_SHARED` (stages/core/forkserver.py; tests/conftest.py starts one per
pytest worker) they all use one server that imported them once. In a fresh clone at the smoke
profile, after one build, each round runs the same sequence of `paperline repro <p> --force`
(every stage of each pipeline and of `base` recomputed), once with a server per repro and once
with one server started before the sequence and stopped after it (its start, imports and forks
counted), alternating which goes first. Reported: wall and CPU seconds (user + system of the
whole process tree) of each sequence, medians over the rounds, the saving per repro, and
whether every dvc.lock md5 is the same after both sequences.

`--write` replaces the "Fork server, shared" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._results import write_section  # noqa: E402
from benchmarks.forkserver import lock_md5s, run, smoke_clone  # noqa: E402
from benchmarks.startup import env_for  # noqa: E402


def sequence(repo: Path, pipelines: list[str], shared: bool) -> tuple[float, float]:
    """(wall s, CPU s) of `paperline repro <p> --force` for each pipeline in turn."""
    import resource

    from stages.core import forkserver

    env = env_for(repo, PAPERLINE_CHECK_CACHE=str(repo / f".checks-{time.time_ns()}"))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    with (forkserver.running(repo, env) if shared else contextlib.nullcontext(env)) as server_env:
        if shared:
            env[forkserver.SHARED_ENV] = server_env[forkserver.ENV]
            while not forkserver.listening(env[forkserver.SHARED_ENV]):  # or the first repro
                time.sleep(0.05)                                         # starts its own
        for p in pipelines:
            run([sys.executable, "-m", "flows.cli", "repro", p, "--force"], repo, env)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the shared server was waited for
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pipelines", nargs="+", default=["ddr", "racer", "cotfsm"])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="paperline-shared-fs-"))
    try:
        repo = smoke_clone(tmp)
        print(f"building {' '.join(args.pipelines)} at smoke in {repo} ...", flush=True)
        for p in args.pipelines:
            run([sys.executable, "-m", "flows.cli", "repro", p], repo,
                env_for(repo, PAPERLINE_FORKSERVER="off"))
        times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        md5s: dict[bool, list[str]] = {}
        for i in range(args.rounds):
            for shared in ((False, True) if i % 2 == 0 else (True, False)):
                times[shared].append(sequence(repo, args.pipelines, shared))
                md5s[shared] = lock_md5s(repo)
            print(f"round {i + 1}/{args.rounds}: " + ", ".join(
                f"{'shared' if m else 'own'} {v[-1][0]:.1f}s wall {v[-1][1]:.1f}s cpu"
                for m, v in times.items()), flush=True)
        load = os.getloadavg()[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {m: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
           for m, v in times.items()}
    n = len(args.pipelines)
    label = {False: "a server per repro (`paperline repro`, default)",
             True: "one shared server (`PAPERLINE_FORKSERVER_SHARED`, the test session's)"}
    body = "\n".join([
        f"Command: `.venv/bin/python benchmarks/shared_forkserver.py --rounds {args.rounds} "
        f"--pipelines {' '.join(args.pipelines)} --write` (a fresh clone at the smoke profile; "
        f"per round, `paperline repro <p> --force` for each of the {n} pipelines in turn, `base` "
        f"recomputed with each, in both modes alternating; medians over the rounds; every table "
        f"validated afresh; load average {load:.1f} at the end)",
        "",
        f"| stages forked from | wall s ({n} repros) | CPU s ({n} repros) |",
        "|---|---|---|",
        *(f"| {label[m]} | {med[m][0]:.1f} | {med[m][1]:.1f} |" for m in (False, True)),
        "",
        f"- Shared against a server per repro: CPU **{med[True][1] / med[False][1]:.2f}x**, "
        f"wall {med[True][0] / med[False][0]:.2f}x; "
        f"**{(med[False][1] - med[True][1]) / n:.1f} CPU s** and "
        f"{(med[False][0] - med[True][0]) / n:.1f} wall s saved per repro.",
        f"- Outputs: {'every dvc.lock md5 equal' if md5s[False] == md5s[True] else 'DIFFER'}.",
        "",
        "Why: each `paperline repro` starts a fork server that imports torch, transformers, "
        "great-expectations (and TRL for a GRPO pipeline) before its stages can fork; a shared "
        "server has them imported already. The test session starts one per pytest worker "
        "(tests/conftest.py `shared_forkserver`).",
    ])
    print(body)
    if args.write:
        write_section("Fork server, shared", body)


if __name__ == "__main__":
    main()
