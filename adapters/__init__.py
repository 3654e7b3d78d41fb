"""mlx_fill.adapters: mlx-lm loop drop-in, in-server activation and the OpenAI endpoint."""
