"""Does a BabyAI policy follow the mission, or walk to whatever is near? Read from the run.

    .venv/bin/python benchmarks/early_experience_nearest.py

A diagnostic behind the Early Experience README ("What the run shows", BabyAI): splits the
`babyai_evaluate` stage's success table (`data/babyai_runs/success.parquet`, every seed) by
whether the mission's target is the first object listed in the first view (the nearest one),
per arm and split. A policy that ignores the mission and goes to the nearest object succeeds
far more often when the target is nearest. Needs the pipeline's outputs (`paperline repro
early_experience`); trains nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import polars as pl

    from stages.core.checks import read_parquet_checked
    from stages.early_experience import babyai
    from stages.early_experience.evaluate import success_spec

    folder = ROOT / "pipelines/early_experience/data"
    succ = read_parquet_checked(folder / "babyai_runs/success.parquet", success_spec())
    envs = babyai.read_episodes(folder / "babyai")
    print("| split | arm | target nearest at start | success then | success otherwise |")
    print("|---|---|---|---|---|")
    for split in ("test", "ood"):
        nearest = []
        for env in envs[split]:
            _, obs = env.reset()
            color, kind = env.mission_target()
            first = obs.split(";")[0].split()
            nearest.append(first[:2] == [color, kind] if color else first[1:2] == [kind])
        for arm in ("il", "iwm", "sr"):
            part = succ.filter((pl.col("setting") == arm) & (pl.col("split") == split))
            flag = pl.Series([nearest[g] for g in part["goal"]])
            print(f"| {split} | {arm} | {sum(nearest)} / {len(nearest)} | "
                  f"{part.filter(flag)['success'].mean():.2f} | "
                  f"{part.filter(~flag)['success'].mean():.2f} |")


if __name__ == "__main__":
    main()
