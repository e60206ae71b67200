"""Per-sequence caches the packed forward writes and `commit(length)` rolls back: KV (one
shape, or grouped by shape), static GPU slots, and the hybrid models' recurrent state."""
