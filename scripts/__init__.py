"""Developer scripts run from the repository root (``python -m scripts.…``); not part of the package."""
