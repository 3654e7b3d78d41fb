"""mlx_fill.core: the core: one append-and-rewind primitive, dispatch plans, the proposal seam, the acceptance rule and the decode loop. Imports nothing of mlx_fill outside this package."""
