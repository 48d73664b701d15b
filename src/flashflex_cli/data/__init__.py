"""Training data preparation: document readers (.txt, .jsonl, .parquet, globs) and streaming tokenization."""
