"""Checkpoint I/O: torch.distributed.checkpoint saves and loads that reshard across plans, and Hugging Face export."""
