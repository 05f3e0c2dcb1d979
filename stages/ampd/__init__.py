"""AMPD: multi-round LLM inference over prefill/decode-disaggregated serving
(He et al., ICML 2026, arXiv 2602.14516).

- `routing`  the online coordinator: local vs remote (incremental) prefill, and prefill
             reordering with lookahead w and an overtake bound
- `plan`     the offline planner: the replica ILP (HiGHS) and its brute-force oracle
"""
