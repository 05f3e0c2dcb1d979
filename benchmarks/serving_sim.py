"""Serving simulator speed: simulated requests (rounds) per second of wall and CPU time.

    .venv/bin/python benchmarks/serving_sim.py [--sessions 1000] [--repeats 2] [--no-write]

Scenarios, all on the shipped `a100` profile (OPT-13B, DistServe constants), default policy:
- agentic: AMPD-shaped sessions (3-8 rounds, prompt median 1.5k, tool gaps) on 2 prefill + 4
  decode instances (66k KV tokens each, DistServe's OPT-13B/A100 capacity), every prefill
  remote, at a light and a heavy session rate;
- colocated: the same sessions on 4 decode instances with chunked prefill (512 tokens);
- chat: ShareGPT-like single-round requests, 1 prefill + 2 decode instances of unequal KV
  (40k and 25k tokens, MAPS's step 2), Poisson and bursty (gamma, CV 3);
- queue: the M/M/1 check's single server (20k one-token requests).
Each run is timed `--repeats` times (median); macro steps against single steps once on the
heavy agentic run (same results, see tests/unit/test_serving_sim.py). The projection for a
paper's cpu profile: 10 seeds x 5 rates x 8 arms of the heavy agentic run, on 2 processes.
Writes the "Serving simulator" section of benchmarks/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._results import write_section  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    import numpy as np

    from stages.serving.latency import LatencyProfile, load_profile
    from stages.serving.sim import ClusterConfig, InstanceSpec, simulate
    from stages.serving.workload import Trace, agentic_sessions, make_trace, sharegpt_like

    a100 = load_profile("a100")
    cap = 66144
    disagg = ClusterConfig(instances=[InstanceSpec(role="prefill", count=2, kv_capacity_tokens=cap),
                                      InstanceSpec(role="decode", count=4, kv_capacity_tokens=cap)])
    coloc = ClusterConfig(instances=[InstanceSpec(role="decode", count=4, kv_capacity_tokens=cap,
                                                  chunked_prefill_tokens=512)])
    maps = ClusterConfig(instances=[InstanceSpec(role="prefill", kv_capacity_tokens=cap),
                                    InstanceSpec(role="decode", kv_capacity_tokens=40_000),
                                    InstanceSpec(role="decode", kv_capacity_tokens=25_000)])
    n = args.sessions
    rng = np.random.default_rng(0)
    mm1 = Trace.from_columns(session=np.arange(20_000), round=np.zeros(20_000),
                             arrival_s=np.cumsum(rng.exponential(2.0, 20_000)),
                             input_tokens=rng.geometric(1e-3, 20_000),
                             output_tokens=np.ones(20_000, dtype=int),
                             tool_gap_s=np.zeros(20_000))
    queue_profile = LatencyProfile(name="queue", source="benchmark", prefill_s0=0.0,
                                   prefill_s_per_token=1e-3, decode_s0=0.0, decode_s_per_seq=0.0,
                                   decode_s_per_ctx_token=0.0, kv_bytes_per_token=1,
                                   link_bytes_per_s=1e12)
    single = ClusterConfig(instances=[
        InstanceSpec(role="prefill", kv_capacity_tokens=10**9, max_batch_seqs=1),
        InstanceSpec(role="decode", kv_capacity_tokens=10**9)])
    scenarios = [
        ("agentic, light (0.5 sessions/s)", make_trace(agentic_sessions(n, 0.5), 0), disagg, a100),
        ("agentic, heavy (1.5 sessions/s)", make_trace(agentic_sessions(n, 1.5), 0), disagg, a100),
        ("colocated chunked (1.0 sessions/s)", make_trace(agentic_sessions(n, 1.0), 0), coloc, a100),
        ("chat, Poisson (8 req/s)", make_trace(sharegpt_like(4 * n, 8.0), 0), maps, a100),
        ("chat, bursty CV 3 (8 req/s)", make_trace(sharegpt_like(4 * n, 8.0, bursty_cv=3.0), 0),
         maps, a100),
        ("queue: M/M/1, 20k requests", mm1, single, queue_profile),
    ]

    def timed(trace, cluster, profile, macro=True):
        walls, cpus = [], []
        for _ in range(args.repeats):
            w, c = time.perf_counter(), time.process_time()
            res = simulate(trace, cluster, profile, macro_steps=macro)
            walls.append(time.perf_counter() - w)
            cpus.append(time.process_time() - c)
        return res, statistics.median(walls), statistics.median(cpus)

    rows = []
    heavy = None
    for name, trace, cluster, profile in scenarios:
        res, wall, cpu = timed(trace, cluster, profile)
        steps = sum(i.get("steps", 0) for i in res.instances)
        events = sum(i.get("macro_steps", 0) for i in res.instances)
        tokens = int(res.rounds["output_tokens"].sum())
        rows.append((name, len(trace), tokens, steps, events, wall, cpu))
        print(f"{name}: {len(trace)} rounds, {tokens} tokens, {steps} decode steps in {events} "
              f"macro steps: {wall:.2f} s wall, {cpu:.2f} s CPU, {len(trace) / cpu:,.0f} rounds/CPU s",
              flush=True)
        if name.startswith("agentic, heavy"):
            heavy = (trace, cluster, profile, wall, cpu)
    trace, cluster, profile, wall_macro, cpu_macro = heavy
    _, wall_single, cpu_single = timed(trace, cluster, profile, macro=False)
    print(f"single steps on the heavy agentic run: {wall_single:.2f} s wall, {cpu_single:.2f} s CPU "
          f"({cpu_single / cpu_macro:.1f}x the macro-step run)")
    runs = 10 * 5 * 8
    projection = runs * cpu_macro / 2 / 60

    body = ["Simulated rounds (a request, or one round of a session) per second; `a100` profile, "
            f"default policy, {args.repeats} repeats (median). CPU seconds are the process's own "
            "(robust to a loaded machine), wall seconds as measured.", "",
            "| scenario | rounds | output tokens | decode steps | macro steps | wall s | CPU s | "
            "rounds / CPU s |", "|---|---|---|---|---|---|---|---|"]
    for name, nr, tok, st, ev, w, c in rows:
        body.append(f"| {name} | {nr} | {tok} | {st} | {ev} | {w:.2f} | {c:.2f} | {nr / c:,.0f} |")
    body += ["", f"Single steps instead of macro steps on the heavy agentic run: {cpu_single:.2f} CPU s "
             f"({cpu_single / cpu_macro:.1f}x). A paper's cpu profile of {runs} such runs (10 seeds x "
             f"5 rates x 8 arms, {len(trace)} rounds each) on 2 processes: about "
             f"{projection:.1f} min of CPU per core."]
    print("\n".join(body))
    if not args.no_write:
        write_section("Serving simulator", "\n".join(body))


if __name__ == "__main__":
    main()
