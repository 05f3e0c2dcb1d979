"""AMPD: multi-round LLM inference over prefill/decode-disaggregated serving
(He et al., ICML 2026, arXiv 2602.14516).

- `arms`     the method as it runs here, and the six arms of the comparison as
             `stages.serving.sim.Policy` subclasses; SLOs, capacity, scoring (read first)
- `routing`  the online coordinator: local vs remote (incremental) prefill, and prefill
             reordering with lookahead w and an overtake bound
- `plan`     the offline planner: the replica ILP (HiGHS) and its brute-force oracle

Stages of pipeline `ampd`: `workload` (traces, SLOs, rate grid), `planner` (stage `plan`),
`simulate` (every arm on every trace), `compare` (attainment, claims, README table).
"""
