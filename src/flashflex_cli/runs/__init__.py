"""Read a finished run folder back and hold it against the cost model: compare, draw, calibrate."""
