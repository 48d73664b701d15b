"""The layer profiler behind `flashflex profile --model`: times one decoder layer (and the loss path) on this host's devices."""
