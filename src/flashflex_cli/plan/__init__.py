"""Plan schema, validation against cluster and model, diff."""
