"""Hardware description: device catalog, cluster schema, synthetic specs, probes."""
