"""CLI command groups; each module exposes `register(app)` and holds no logic of its own."""
