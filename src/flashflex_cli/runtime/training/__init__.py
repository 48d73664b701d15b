"""The training loop on one rank: the worker entry points, the engine, optimizer, loss scaling, data, metrics and out-of-memory reports."""
