"""RACER router training time: the MLP primal-dual (`train_router`) and the tabular solver.

    .venv/bin/python benchmarks/racer_router.py [--budget 3] [--seeds 0 1 2] [--iters 150]
                                                [--threads 1] [--no-write]

Uses the racer pipeline's cpu outputs (`pipelines/racer/data/{features,outcomes}`; run
`make run PIPELINE=racer` first) and its `train_router` params (cpu profile). Per arm (erm,
racer, racer_r, racer_c): wall seconds to train one router at one budget (mean over seeds),
outer iterations/s, and the best iterate's validation accuracy and cost. Then the tabular
primal-dual (Algorithm 1, damped) against cvxpy (Clarabel) on the solver check's instances:
seconds per solve and the max |p - p*|. Writes the "RACER router training" section of
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks._results import write_section  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=3.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iters", type=int, default=None, help="default: the cpu profile's")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    import numpy as np

    from stages.core.config import validate_section
    from stages.core.runner import load_params
    from stages.models.base import set_threads
    from stages.racer import racer

    pdir = ROOT / "pipelines/racer"
    fdir, odir = pdir / "data/features", pdir / "data/outcomes"
    if not (fdir / "train.npy").is_file() or not (odir / "train.parquet").is_file():
        sys.exit(f"{fdir} / {odir}: missing; run `make run PIPELINE=racer` first")
    _, params, source = load_params(ROOT, "racer")
    cfg = validate_section(racer.Config, params, "train_router", "cpu", source)
    if args.iters:
        cfg = cfg.model_copy(update={"iters": args.iters})
    threads = set_threads(args.threads)
    x, r, c, _ = racer.load_arrays(fdir, odir, "train")
    xv, rv, cv, _ = racer.load_arrays(fdir, odir, "val")

    rows = []
    for arm in cfg.arms:
        secs, accs, costs = [], [], []
        for seed in args.seeds:
            t0 = time.perf_counter()
            got = racer.train_router(x, r, c, xv, rv, cv, args.budget,
                                     tau_r=cfg.tau_r if arm.robust_reward else None,
                                     tau_c=cfg.tau_c if arm.robust_cost else None,
                                     cfg=cfg, seed=seed)
            secs.append(time.perf_counter() - t0)
            accs.append(got["best"]["val_acc"])
            costs.append(got["best"]["val_cost"])
        rows.append((arm.name, statistics.mean(secs), cfg.iters / statistics.mean(secs),
                     statistics.mean(accs), statistics.mean(costs)))
        print(rows[-1], flush=True)

    # tabular solver vs cvxpy on solver-check-sized instances of the train outcomes
    rng = np.random.default_rng(0)
    c_tok = np.stack([c[:, 0], c[:, 1]], 1)
    solve_rows = []
    for n in (40, 200):
        idx = rng.choice(len(r), size=n, replace=False)
        rr, cc = r[idx], c_tok[idx] / c_tok[idx].max()
        budget = float(np.mean(cc[:, 0] + 0.3 * (cc[:, 1] - cc[:, 0])))
        for name, (tr, tc) in {"erm": (None, None), "racer": (0.5, 1.0)}.items():
            t0 = time.perf_counter()
            ref = racer.solve_cvxpy(rr, cc, budget, beta=0.1, tau_r=tr, tau_c=tc)
            t_cvx = time.perf_counter() - t0
            m = float(np.abs(cc[:, 1] - cc[:, 0]).max())
            k = 1.0 if tc is None else math.exp(m / tc)
            t0 = time.perf_counter()
            # solve_cvxpy solves the penalised (C_tau) problem: compare like with like
            pd = racer.primal_dual(rr, cc, budget, beta=0.1, tau_r=tr, tau_c=tc, iters=20000,
                                   eta=1 / (0.1 + (m * k) ** 2 / 0.4), alpha=0.1,
                                   constraint="penalized")
            t_pd = time.perf_counter() - t0
            solve_rows.append((n, name, t_cvx, t_pd, float(np.abs(pd["p"] - ref["p"]).max())))
            print(solve_rows[-1], flush=True)

    body = (f"Command: `.venv/bin/python benchmarks/racer_router.py --budget {args.budget:g} "
            f"--seeds {' '.join(map(str, args.seeds))} --threads {args.threads}` (cpu profile "
            f"params: {cfg.iters} outer iterations x {cfg.policy_steps} Adam steps, batch "
            f"{cfg.batch_size}, MLP {cfg.layers} layers x {cfg.hidden}, {x.shape[0]} train items "
            f"x {x.shape[1]}-d MiniLM features, {threads} torch thread(s))\n\n"
            "| arm | s per router | outer iters/s | val acc (best iterate) | val cost |\n"
            "|---|---|---|---|---|\n")
    body += "".join(f"| {a} | {s:.2f} | {it:.0f} | {acc:.3f} | {co:.2f} |\n"
                    for a, s, it, acc, co in rows)
    body += ("\nTabular Algorithm 1 (20,000 iterations, eta from the Thm 4.2 constants, alpha "
             "0.1) vs cvxpy/Clarabel on the same regularised problem (beta 0.1):\n\n"
             "| items | arm | cvxpy s | primal-dual s | max abs p - p* |\n|---|---|---|---|---|\n")
    body += "".join(f"| {n} | {a} | {tc:.3f} | {tp:.3f} | {d:.1e} |\n"
                    for n, a, tc, tp, d in solve_rows)
    print(body)
    if not args.no_write:
        write_section("RACER router training", body)


if __name__ == "__main__":
    main()
