"""The shared serving engine: a discrete-event LLM-serving simulator and what checks it.

Used by the serving papers (AMPD, MAPS); it holds no paper code. Papers bring their routing
and queue-order policies as `sim.Policy` subclasses from their own packages.

    latency.py   LatencyProfile: prefill / decode-step / KV-transfer times (DistServe/Vidur
                 linear forms); load_profile("a100") or a measured JSON file
    profiles/    shipped profiles: a100, a100_tp2, a100_tp4 (OPT-13B, DistServe's constants)
    workload.py  Trace (one row per round), make_trace(WorkloadConfig, seed), sharegpt_like,
                 agentic_sessions, read_trace / write_trace (checked parquet)
    sim.py       the model and its API: ClusterConfig, InstanceSpec, Job, Route, Policy,
                 Simulator, simulate(...) -> metrics.SimResult
    instances.py prefill and decode instances: batching, KV pools, preemption, macro steps
    kv.py        KVPool: blocks, idle session KV, dispatcher reservations
    metrics.py   SimResult: per-round TTFT / ITL / E2E, queues, Little's law on every run
    queueing.py  M/M/1, M/D/1, M/G/1 (Pollaczek-Khinchine), M/G/1-PS, Little, Kleinrock
    engine.py    a batched KV-cache engine on transformers (prefill / decode of a running batch)
    profile.py   stage `profile_engine`: measures the engine, fits the latency forms
    server.py    a continuous-batching HTTP server on the engine + a Poisson load driver
                 (check 2: the simulator against a real server)
"""
