"""Verifier calls and wall time per problem: pure Judge vs pure GenSelect vs Hybrid (ProofVerify).

    .venv/bin/python benchmarks/proofverify_calls.py [--problems 30] [--n-j 8] [--n-s 4]
                                                     [--repeats 2] [--threads 1] [--no-write]

Uses the proofverify pipeline's trained verifiers (`pipelines/proofverify/models/{judge,selector}`)
and held-out candidates (`data/candidates/test.parquet`, n_p per problem); run
`make run PIPELINE=proofverify` first. Every arm runs the stage's own code through the local
backend, batched across problems the same way (`proofverify_select.judge_votes`,
`run_knockouts`), with FRESH calls (the Hybrid here judges its survivors itself instead of
reading the judge stage's cache, so its time is its own). Arms alternate `--repeats` times;
seconds are medians. Also prints the paper-scale call counts (n_p = 256). Writes the
"ProofVerify verifier calls" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks._results import write_section  # noqa: E402

P = ROOT / "pipelines/proofverify"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=30)
    parser.add_argument("--n-j", type=int, default=8, help="judge verdicts per solution")
    parser.add_argument("--n-s", type=int, default=4, help="hybrid survivors")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--root", default=str(ROOT), help="repo whose proofverify outputs to "
                        "use (default: this one)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    global P
    P = Path(args.root) / "pipelines/proofverify"

    import polars as pl
    import torch

    from stages.models.backend import LocalHFBackend
    from stages.proofverify import proofverify as pv
    from stages.proofverify.select import Config, judge_votes, run_knockouts, \
        scores_from_votes

    cands_path = P / "data/candidates/test.parquet"
    for p in (cands_path, P / "models/judge/config.json", P / "models/selector/config.json"):
        if not p.is_file():
            sys.exit(f"{p}: missing; run `make run PIPELINE=proofverify` first")
    torch.set_num_threads(args.threads)
    cands = pl.read_parquet(cands_path).sort(["problem_id", "index"])
    pids = cands["problem_id"].unique(maintain_order=True).to_list()[:args.problems]
    cands = cands.filter(pl.col("problem_id").is_in(pids))
    problems = [cands.filter(pl.col("problem_id") == p) for p in pids]
    n_p = problems[0].height
    judge = LocalHFBackend(P / "models/judge", batch_size=512)
    selector = LocalHFBackend(P / "models/selector", batch_size=256)
    import yaml

    params = yaml.safe_load((P / "params.yaml").read_text())   # the stages' own settings
    keep = ("prompt_style", "temperature", "max_new_tokens")
    jcfg = Config(method="judge", backend={"model": "judge"}, n_j=args.n_j, out="x",
                  **{k: params["judge"][k] for k in keep})
    gcfg = Config(method="genselect", backend={"model": "selector"}, out="x",
                  **{k: params["genselect"][k] for k in keep})

    def arm_judge(seed: int) -> int:
        votes = judge_votes(judge, cands, jcfg, seed)
        return votes.height

    def arm_genselect(seed: int) -> int:
        tours, _ = run_knockouts(selector, problems, gcfg, 1, seed)
        return sum(t.calls for t in tours)

    def arm_hybrid(seed: int) -> int:
        tours, _ = run_knockouts(selector, problems, gcfg, args.n_s, seed)
        keep = [g["candidate_id"][i] for g, t in zip(problems, tours) for i in t.winners]
        survivors = cands.filter(pl.col("candidate_id").is_in(keep))
        votes = judge_votes(judge, survivors, jcfg, seed)
        scores_from_votes(votes, args.n_j)
        return sum(t.calls for t in tours) + votes.height

    arms = {"pure Judge": arm_judge, "pure GenSelect": arm_genselect, "Hybrid": arm_hybrid}
    seconds: dict[str, list[float]] = {a: [] for a in arms}
    calls: dict[str, int] = {}
    for r in range(args.repeats):
        for name, fn in arms.items():
            started = time.perf_counter()
            calls[name] = fn(r)
            seconds[name].append(time.perf_counter() - started)
    n = len(problems)
    paper = {"pure Judge": 256 * 32, "pure GenSelect": pv.knockout_cost(256, 1),
             "Hybrid": pv.knockout_cost(256, 16) + 16 * 32}
    ours = {"pure Judge": f"n_p x n_j = {n_p} x {args.n_j}",
            "pure GenSelect": f"n_p - 1 = {n_p - 1} games",
            "Hybrid": f"(n_p - n_s) + n_s x n_j = {n_p - args.n_s} + {args.n_s} x {args.n_j}"}
    base = statistics.median(seconds["pure Judge"]) / n
    lines = [f"`.venv/bin/python benchmarks/proofverify_calls.py --problems {args.problems} "
             f"--n-j {args.n_j} --n-s {args.n_s} --repeats {args.repeats} --threads "
             f"{args.threads}`: the proofverify pipeline's tiny judge and selector "
             f"(`{'' if args.root == str(ROOT) else args.root + '/'}pipelines/proofverify/models/`, "
             f"profile "
             f"`{yaml.safe_load((Path(args.root) / 'params.yaml').read_text())['profile']}`), "
             f"{n} held-out problems x n_p = {n_p} "
             f"candidates, local backend, every call fresh, arms interleaved, "
             f"{args.threads} torch thread(s), torch {torch.__version__}.", "",
             "| arm | verifier calls / problem | formula | seconds / problem (median) | "
             "vs pure Judge | calls at the paper's n_p = 256 (n_s 16, n_j 32) |",
             "|---|---|---|---|---|---|"]
    for name in arms:
        per = statistics.median(seconds[name]) / n
        lines.append(f"| {name} | {calls[name] / n:.1f} | {ours[name]} | {per:.3f} | "
                     f"{per / base:.2f}x | {paper[name]:,} |")
    lines += ["", "With `prompt_style: check` a verdict is a step check trace plus `Verdict:` "
              "(up to 80 tokens) and a game's reply holds two traces plus `Best:` (up to 144), "
              "so a game costs about two verdicts: time does not fall as fast as calls."]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("ProofVerify verifier calls", body)


if __name__ == "__main__":
    main()
