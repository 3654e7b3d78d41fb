"""Fixture-model training: data from the recorded transcripts, OpenBLAS restart, training-only kernels
equal to mlx-lm's ops. Run from the repository root: ``python -m scripts.training.train_fixture NAME``."""
