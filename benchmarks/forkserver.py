"""The fork server's saving: a smoke `paperline repro --force` with and without it, side by side.

    .venv/bin/python benchmarks/forkserver.py [--repeats 2] [--pipeline base]
        [--modes server first fresh] [--write]

In a fresh clone at the smoke profile, after one build, `paperline repro <pipeline> --force`
(every stage of the pipeline and its upstream recomputed) runs in turn with the fork server
(the default), with the server importing only what the first stage waits for
(`PAPERLINE_FORKSERVER_LATE=off`: no great-expectations or TRL for the stages after it) and
with `PAPERLINE_FORKSERVER=off` (every stage a fresh interpreter, as under a plain
`dvc repro`). Reported: wall seconds and CPU seconds (user + system of the whole process
tree, the server and its forks included), medians over the repeats, and their ratios. CPU
seconds are what 2 busy cores make the suite pay, and they depend less on the machine's load
than wall time does. The outputs of the three modes are compared too (every md5 in the lock).

`--write` replaces the "Fork server" section of benchmarks/RESULTS.md ("Fork server, late
imports" when `--modes` leaves out `fresh`).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._results import write_section  # noqa: E402
from benchmarks.startup import env_for  # noqa: E402


def run(cmd: list[str], repo: Path, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the children) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def lock_md5s(repo: Path) -> list[str]:
    return sorted(line.strip() for p in sorted(repo.rglob("dvc.lock"))
                  for line in p.read_text().splitlines() if "md5:" in line)


def smoke_clone(tmp: Path) -> Path:
    """A clone of this checkout's HEAD under `tmp`, at the smoke profile."""
    repo = tmp / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    params = repo / "params.yaml"
    params.write_text(params.read_text().replace("profile: cpu", "profile: smoke", 1))
    return repo


MODES = {  # name: (row label, environment)
    "server": ("forked from the server (`paperline repro`, default)", {}),
    "first": ("forked, the server importing only torch & co. (`PAPERLINE_FORKSERVER_LATE=off`)",
              {"PAPERLINE_FORKSERVER_LATE": "off"}),
    "fresh": ("fresh interpreters (`PAPERLINE_FORKSERVER=off`, as plain `dvc repro`)",
              {"PAPERLINE_FORKSERVER": "off"}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--pipeline", default="base")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "flows.cli", "repro", args.pipeline]
    tmp = Path(tempfile.mkdtemp(prefix="paperline-forkserver-"))
    try:
        repo = smoke_clone(tmp)
        print(f"building {args.pipeline} at smoke in {repo} ...", flush=True)
        run(cli, repo, env_for(repo, PAPERLINE_FORKSERVER="off"))
        times: dict[str, list[tuple[float, float]]] = {m: [] for m in args.modes}
        md5s: dict[str, list[str]] = {}
        for i in range(args.repeats):
            for mode in args.modes:
                # an empty check cache each run: every table validated as on its first run (a
                # test's fresh copy, a user's new data), not remembered from the last repeat
                cache = tmp / f"checks-{mode}-{i}"
                env = env_for(repo, PAPERLINE_CHECK_CACHE=str(cache), **MODES[mode][1])
                times[mode].append(run([*cli, "--force"], repo, env))
                md5s[mode] = lock_md5s(repo)
            print(f"repeat {i + 1}/{args.repeats}: " + ", ".join(
                f"{m} {v[-1][0]:.1f}s wall {v[-1][1]:.1f}s cpu" for m, v in times.items()),
                flush=True)
        load = os.getloadavg()[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {m: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
           for m, v in times.items()}
    same = len({tuple(v) for v in md5s.values()}) == 1
    lines = [
        f"Command: `.venv/bin/python benchmarks/forkserver.py --repeats {args.repeats} "
        f"--pipeline {args.pipeline} --modes {' '.join(args.modes)} --write` (a fresh clone at "
        f"the smoke profile; `paperline repro {args.pipeline} --force` in turn in each mode "
        f"below, every table validated afresh; medians; load average {load:.1f} at the end)",
        "",
        "| stages started | wall s | CPU s |",
        "|---|---|---|",
        *(f"| {MODES[m][0]} | {med[m][0]:.1f} | {med[m][1]:.1f} |" for m in args.modes),
        "",
    ]
    if "server" in med and "fresh" in med:
        lines.append(f"- The server against fresh interpreters: CPU "
                     f"**{med['server'][1] / med['fresh'][1]:.2f}x**, wall "
                     f"{med['server'][0] / med['fresh'][0]:.2f}x.")
    if "server" in med and "first" in med:
        lines.append(f"- The server's second import (great-expectations, TRL) after the first "
                     f"fork: CPU **{med['server'][1] / med['first'][1]:.2f}x**, wall "
                     f"{med['server'][0] / med['first'][0]:.2f}x of the server without it.")
    lines += [
        f"- Outputs of the {len(args.modes)} modes: "
        f"{'every dvc.lock md5 equal' if same else 'DIFFER'}.",
        "",
        "Why: a model stage imports torch, transformers' Llama, its Trainer and tokenizers "
        "(several CPU seconds) before its work; the server imports them once per `paperline "
        "repro` and each stage runs in a fork of it (stages/core/forkserver.py). A stage that "
        "writes a new table imports great-expectations to validate it (4-6 s here), an RL "
        "stage TRL's GRPO trainer: the server imports those right after it forks the first "
        "stage.",
    ]
    body = "\n".join(lines)
    print(body)
    if args.write:
        # the comparison with fresh interpreters, or only of the server's late imports
        write_section("Fork server" if "fresh" in args.modes else "Fork server, late imports",
                      body)


if __name__ == "__main__":
    main()
