"""mlx-fill: lossless token fast-forward for MLX decoding (strict fill, echo, speculative roster)."""

__version__ = "0.1.0"
