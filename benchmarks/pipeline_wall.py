"""Wall time of each pipeline's last `paperline repro`, per stage, from the MLflow store.

    make run PIPELINE=<slug>                     # or: paperline repro <slug>, from its outputs
                                                 # absent (fresh clone) and the shared stages done
    .venv/bin/python benchmarks/pipeline_wall.py bis r2vpo hsir [--target-min 20]

`paperline repro` opens one MLflow parent run per execution and every stage logs a child run
under it, so the times here are the runs' own start and end times, not a stopwatch typed in.
Reports, per pipeline, the parent run's wall time (the whole `dvc repro`, including process
start-up and tracking), the profile, and each stage's wall time; a pipeline whose last run was
not on the `cpu` profile or skipped stages (already up to date) is flagged. Writes the
"Pipeline wall time" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from benchmarks._results import write_section  # noqa: E402

# The issues' targets for each pipeline's `cpu` profile on 2 cores (minutes); others: --target-min.
# The serving, vision, agent and search issues (17-21) say <= 8 min alone on 2 cores per paper,
# the vision substrate ~10 min for all seeds.
TARGETS = {"base": 15.0, "bis": 15.0, "edco": 15.0, "proofverify": 15.0, "racer": 15.0,
           "trace": 15.0, "r2vpo": 20.0, "hsir": 20.0, "vlm": 10.0,
           **dict.fromkeys(["ampd", "maps", "gift", "core", "bridgevlm", "same", "ddr",
                            "early_experience", "plugmem", "cotfsm", "refine_prover",
                            "diffureason"], 8.0)}


def retarget(row: str, default: float) -> str:
    """A kept row with its target cell recomputed from TARGETS (targets change; walls do not)."""
    cells = row.split("|")
    name, wall = cells[1].strip(), float(cells[4])
    target = TARGETS.get(name, default)
    cells[5] = f" {target:.0f}: {'met' if wall <= target else 'MISSED'} "
    return "|".join(cells)


def stage_minutes(run) -> float:
    return (run.info.end_time - run.info.start_time) / 60000


def last_full_execution(client, pipeline: str, declared: list[str], cheap_min: float = 1.0
                        ) -> tuple[object, list[object], dict[str, float]] | None:
    """The latest finished parent run of `pipeline` that ran every declared stage, except
    stages that were up to date and cheap (their own latest run took under `cheap_min`): a
    rerun of a few stages is not a pipeline's wall time. Returns the parent, its stage runs
    (oldest first) and {skipped stage: minutes of its latest run}."""
    exp = client.get_experiment_by_name(pipeline)
    if exp is None:
        return None
    parents = client.search_runs([exp.experiment_id],
                                 "tags.`paperline.kind` = 'pipeline' and status = 'FINISHED'",
                                 order_by=["attributes.start_time DESC"], max_results=50)
    for parent in parents:
        stages = client.search_runs([exp.experiment_id],
                                    f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
                                    order_by=["attributes.start_time ASC"], max_results=1000)
        stages = [s for s in stages if "paperline.stage" in s.data.tags]
        skipped: dict[str, float] = {}
        for name in set(declared) - {s.data.tags["paperline.stage"] for s in stages}:
            # the stage's own run: its method runs (one per arm or seed, seconds long) carry
            # the same `paperline.stage` tag, and the latest of them is not the stage's time
            last = [r for r in client.search_runs(
                [exp.experiment_id], f"tags.`paperline.stage` = '{name}' and status = 'FINISHED'",
                order_by=["attributes.start_time DESC"], max_results=500)
                if "paperline.method" not in r.data.tags][:1]
            skipped[name] = stage_minutes(last[0]) if last else math.inf
        if all(m < cheap_min for m in skipped.values()):
            return parent, stages, skipped
    return None


def previous_rows() -> list[str]:
    """The table rows already in the "Pipeline wall time" section of RESULTS.md: a run of this
    script for some pipelines keeps the others' measurements (each row says when it finished)."""
    from benchmarks._results import RESULTS

    if not RESULTS.exists():
        return []
    text = RESULTS.read_text()
    start = text.find("## Pipeline wall time\n")
    if start < 0:
        return []
    end = text.find("\n## ", start + 1)
    section = text[start:end if end > 0 else None]
    return [line for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| pipeline ")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pipelines", nargs="+")
    parser.add_argument("--target-min", type=float, default=20.0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    from mlflow import MlflowClient

    from stages.core.tracking import configure
    from stages.registry import STAGES

    configure(ROOT)
    client = MlflowClient()
    lines = ["| pipeline | profile | stages run / declared | wall (min) | target (min) | "
             "slowest stages (min) | finished (UTC) |", "|---|---|---|---|---|---|---|"]
    for name in args.pipelines:
        declared = list(STAGES.get(name, {}))
        found = last_full_execution(client, name, declared)
        if found is None:
            sys.exit(f"{name}: no finished `paperline repro` of every stage in the MLflow store; "
                     f"run `make run PIPELINE={name}` from its outputs absent first")
        parent, stages, skipped = found
        # stages up to date in that run count with their own latest time (all under a minute)
        wall = (parent.info.end_time - parent.info.start_time) / 60000 + sum(skipped.values())
        target = TARGETS.get(name, args.target_min)
        profiles = sorted({s.data.tags.get("paperline.profile", "?") for s in stages})
        per_stage = sorted((stage_minutes(s), s.data.tags["paperline.stage"])
                           for s in stages if s.info.end_time)
        slow = ", ".join(f"{st} {m:.1f}" for m, st in reversed(per_stage[-3:]))
        import datetime as dt

        ended = dt.datetime.fromtimestamp(parent.info.end_time / 1000, dt.timezone.utc)
        ran = f"{len(declared) - len(skipped)} / {len(declared)}" + (
            f" (+ {', '.join(sorted(skipped))} up to date)" if skipped else "")
        lines.append(f"| {name} | {'/'.join(profiles) or '?'} | {ran} "
                     f"| {wall:.1f} | {target:.0f}: {'met' if wall <= target else 'MISSED'} | {slow} "
                     f"| {ended:%Y-%m-%d %H:%M} |")
    measured = {line.split("|")[1].strip() for line in lines[2:]}
    kept = [retarget(row, args.target_min) for row in previous_rows()
            if row.split("|")[1].strip() not in measured]
    rows = sorted(lines[2:] + kept, key=lambda row: row.split("|")[1].strip())
    lines = lines[:2] + rows
    body = (f"`.venv/bin/python benchmarks/pipeline_wall.py <slugs>` (this time: "
            f"{' '.join(args.pipelines)}; rows of other pipelines are kept from earlier runs, "
            "with the date they finished): each "
            "pipeline's last `paperline repro` (= `make run PIPELINE=<slug>`) from its outputs "
            "absent, the shared stages already built, read from the MLflow runs (parent run = "
            "the whole `dvc repro`; stage runs = the stage processes; the latest run that ran every "
            "stage; a cheap stage that was up to date counts with its own latest time). 2 cores. "
            "Rows of different dates may come from different machines of the same size but not "
            "the same speed: compare a pipeline across rows only with a side-by-side measure "
            "of the two machines (the pipeline's README says where one was taken)."
            "\n\n"
            + "\n".join(lines) + "\n")
    print(body)
    if not args.no_write:
        write_section("Pipeline wall time", body)


if __name__ == "__main__":
    main()
