"""MAPS: memory-aware predictive scheduling for prefill/decode-disaggregated serving
(Zhang et al., ICML 2026, arXiv 2609.15359).

- `uac`        one-sided conformal upper bound on output length (UAC), quality metrics
- `predictor`  the output-length predictor: a regressor on the base model's prompt hidden state,
               trained on lengths the model really generates; the spec's noise-model predictor
- `dispatch`   Algorithm 1 (memory-aware dispatch with MQ / MC routing) and the decoder-local
               SJF queue with its max-wait guard (and the FCFS variant)
"""
