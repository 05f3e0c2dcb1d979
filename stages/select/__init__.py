"""Data-selection methods: which training samples to keep (BIS) or train next (EDCO)."""
