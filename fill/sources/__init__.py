"""mlx_fill.sources: proposal sources on the core: echo of earlier ids, Predicted Outputs, and the ledger that promotes verify to assert."""
