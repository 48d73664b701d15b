"""Layer profiles (flashflex.layers/1): measured per-layer costs of one model shape on one device type."""
