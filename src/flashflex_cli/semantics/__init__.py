"""Semantics the runtime and the cost model share, torch-free: what runs is what gets charged."""
