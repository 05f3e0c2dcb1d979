"""Stage start-up and a no-op `paperline repro`, each against its yardstick in the same run.

    .venv/bin/python benchmarks/startup.py [--repeats 5] [--pipeline racer] [--write]

In a fresh clone of this repo at the smoke profile, after one `paperline repro <pipeline>` has
built everything, the commands below run interleaved (machine noise hits all alike) and their
medians are compared:

1. Stage start-up: process start to process end of `python -m stages base tasks`, a stage that
   needs no model (so its time is the contract's own: imports, params of the whole pipeline,
   the data check, tracking), with the tracking `paperline repro` gives its stages
   (`PAPERLINE_TRACKING=spool`: recorded, replayed by the parent) and with live tracking (what a
   plain `dvc repro` gets), against a bare `python -c "import torch"`.
   Target (issue 14): <= 1.5 s on a quiet machine, or <= 1.3x the bare torch import.
2. No-op repro: `paperline repro <pipeline>` with everything up to date against
   `dvc repro pipelines/<pipeline>/dvc.yaml`. Target: <= 1.5x.

`--write` replaces the "Stage start-up" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
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


def env_for(repo: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(repo), "PREFECT_HOME": str(repo / ".paperline/prefect"),
           "HF_HOME": str(repo / ".paperline/hf"), "HF_HUB_OFFLINE": "1",
           "DVC_SITE_CACHE_DIR": str(repo / ".paperline/dvc-site"),
           "MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false",
           # dvc runs `python -m stages`: this interpreter's, as `make` puts it first on PATH
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           **extra}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("PAPERLINE_PARENT_RUN_ID", None)
    env.pop("PAPERLINE_FORKSERVER_SHARED", None)  # each repro starts its own, as a user's does
    return env


def timed(cmd: list[str], repo: Path, env: dict[str, str]) -> float:
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pipeline", default="racer")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    py = sys.executable
    dvc = str(Path(py).with_name("dvc"))
    tmp = Path(tempfile.mkdtemp(prefix="paperline-startup-"))
    try:
        repo = tmp / "repo"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
        params = repo / "params.yaml"
        params.write_text(params.read_text().replace("profile: cpu", "profile: smoke", 1))
        env = env_for(repo)
        cli = [py, "-m", "flows.cli"]
        print(f"building {args.pipeline} at smoke in {repo} ...", flush=True)
        timed([*cli, "repro", args.pipeline], repo, env)
        dvcfile = f"pipelines/{args.pipeline}/dvc.yaml"
        # the no-op repros first in each round: the stage runs below leave spooled records that
        # a `paperline repro` would replay (what it is for, but not a no-op)
        cmds = {
            "paperline_noop": ([*cli, "repro", args.pipeline], env),
            "dvc_noop": ([dvc, "repro", dvcfile], env),
            "torch": ([py, "-c", "import torch"], env),
            "stage_spool": ([py, "-m", "stages", "base", "tasks"],
                            env_for(repo, PAPERLINE_TRACKING="spool")),
            "stage_live": ([py, "-m", "stages", "base", "tasks"], env),
        }
        times: dict[str, list[float]] = {k: [] for k in cmds}
        for i in range(args.repeats):
            for name, (cmd, e) in cmds.items():
                times[name].append(timed(cmd, repo, e))
            shutil.rmtree(repo / ".paperline/tracking-gaps", ignore_errors=True)  # spooled above
            print(f"repeat {i + 1}/{args.repeats}: " +
                  ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        load = os.getloadavg()[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def row(name: str, label: str) -> str:
        v = times[name]
        return f"| {label} | {med[name]:.2f} | {min(v):.2f} | {max(v):.2f} |"

    body = "\n".join([
        f"Command: `.venv/bin/python benchmarks/startup.py --repeats {args.repeats} "
        f"--pipeline {args.pipeline} --write` (a fresh clone at the smoke profile, everything "
        f"built once first; the commands interleaved, medians; load average {load:.1f} at the "
        "end)",
        "",
        "| command | median s | min s | max s |",
        "|---|---|---|---|",
        row("torch", "`python -c 'import torch'` (yardstick)"),
        row("stage_spool", "`python -m stages base tasks`, tracking spooled (`paperline repro`)"),
        row("stage_live", "`python -m stages base tasks`, live tracking (plain `dvc repro`)"),
        row("paperline_noop", f"no-op `paperline repro {args.pipeline}`"),
        row("dvc_noop", f"no-op `dvc repro {dvcfile}`"),
        "",
        f"- Stage start-up under `paperline repro`: **{med['stage_spool']:.2f} s, "
        f"{med['stage_spool'] / med['torch']:.2f}x a bare torch import** (target <= 1.5 s "
        "quiet or <= 1.3x); with live MLflow logging (plain `dvc repro`) "
        f"{med['stage_live']:.2f} s, {med['stage_live'] / med['torch']:.2f}x.",
        f"- No-op `paperline repro {args.pipeline}` / no-op `dvc repro`: "
        f"**{med['paperline_noop'] / med['dvc_noop']:.2f}x** (target <= 1.5x).",
        "",
        "Where the time went before (issue 14): importing MLflow and opening its SQLite store in "
        "every stage process (~2.5 s of a trivial stage under load), importing every stage "
        "module of the pipeline (torch among them) to validate params in `paperline repro`, and "
        "creating and closing an MLflow parent run even when nothing ran. Now the stages of "
        "`paperline repro` spool their tracking and the parent replays it after `dvc repro` "
        "(stages/core/tracking.py), the parent run is created only when a stage ran, and a "
        "params check is skipped when neither params nor stage code changed since the last "
        "successful one (stages/core/runner.py `check_key`), also in the stage processes.",
    ])
    print(body)
    if args.write:
        write_section("Stage start-up", body)


if __name__ == "__main__":
    main()
