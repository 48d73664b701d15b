"""Hugging Face checkpoints in and out: name mapping, per-rank sliced loading, config checks, export."""
