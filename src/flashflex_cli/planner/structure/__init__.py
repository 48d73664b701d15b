"""Level 2: the best stage structure (TP groups and their order) of one pipeline's devices, searched best-first
by exact lower bounds (`stage_search.best_pipeline`)."""
