"""The layout space, without costs: the device graph and its fast-link islands, level-1 partitions into
pipelines, TP groups, and the exact splits of layers over stages and micro-batches over pipelines."""
