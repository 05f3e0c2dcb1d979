"""Verification methods: process-level metrics and checkers of model outputs (e.g. TRACE)."""
