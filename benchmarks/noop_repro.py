"""No-op `dvc repro` of every pipeline vs bare `dvc status`, measured side by side in one run.

    .venv/bin/python benchmarks/noop_repro.py [--repeats 5]

Run after `make run` (everything up to date). Interleaves the two commands so machine noise hits
both alike, and writes the median times and their ratio into benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._results import write_section  # noqa: E402
from stages.core.runner import pipeline_dirs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dvc = str(Path(sys.executable).with_name("dvc"))
    files = [str((d / "dvc.yaml").relative_to(ROOT)) for d in pipeline_dirs(ROOT).values()]
    status = subprocess.run([dvc, "status", *files], cwd=ROOT, capture_output=True, text=True)
    if "up to date" not in status.stdout:
        raise SystemExit("pipelines are not up to date: run `make run` first\n" + status.stdout)
    repro, stat = [], []
    for _ in range(args.repeats):
        repro.append(timed([dvc, "repro", *files]))
        stat.append(timed([dvc, "status", *files]))
    r, s = statistics.median(repro), statistics.median(stat)
    body = (f"Command: `.venv/bin/python benchmarks/noop_repro.py --repeats {args.repeats}` "
            f"({len(files)} pipeline(s): {', '.join(files)}; interleaved, medians)\n\n"
            "| command | median s | min s | max s |\n|---|---|---|---|\n"
            f"| no-op `dvc repro` | {r:.2f} | {min(repro):.2f} | {max(repro):.2f} |\n"
            f"| `dvc status` | {s:.2f} | {min(stat):.2f} | {max(stat):.2f} |\n\n"
            f"Ratio no-op repro / status: **{r / s:.2f}x**\n")
    write_section("No-op repro vs status", body)
    print(body)


if __name__ == "__main__":
    main()
