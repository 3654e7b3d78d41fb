"""mlx_fill.adapters.server: the OpenAI-compatible endpoint (``mlx-fill serve``): request parsing, template variables, the app."""
