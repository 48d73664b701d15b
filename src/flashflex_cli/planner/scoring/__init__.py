"""The fast score: the cost model's figures (`flashflex_cli.cost`) for device groups, pipelines, the
data-parallel reduction and whole candidates, memoised per planning question (`cost_cache.CostCache`)."""
