"""mlx_fill.spec: the speculative roster (draft sources) on the shared append-and-rewind primitive."""
