"""mlx_fill.assets: tokenizer/template assets (resolved, fetched on first use, hash-checked) and the fixture models assembled from them."""
