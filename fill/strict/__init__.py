"""mlx_fill.strict: the strict tier: rows compiled from the real chat template, guarded by call-syntax parser state (assert policy)."""
