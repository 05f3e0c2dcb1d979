"""BridgeVLM (arXiv 2606.11745): Causal Tokens from an induced soft DAG, RAMP message passing, M3S."""
