"""The files a clone of the repository carries beside the package, for the commands that read
them: the committed fixture models (``fixtures/models/``, assembled by
:mod:`mlx_fill.assets.fixtures` and :mod:`mlx_fill.assets.smollm2`) and the recorded agent
transcripts (``fixtures/transcripts/dev.jsonl.gz``, the default of ``mlx-fill study``) and the
strict-row audit corpus (``fixtures/audit/``, the default of ``mlx-fill audit``).

They are files of the checkout an editable install runs from, not of the package: an installed
wheel has none of them, and the commands that need them say so (``FixtureMissing``, a missing
transcripts file). Nothing else in the package reads the checkout.
"""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MODELS = FIXTURES / "models"
TRANSCRIPTS = FIXTURES / "transcripts" / "dev.jsonl.gz"
AUDIT = FIXTURES / "audit"
