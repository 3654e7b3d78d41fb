"""Benchmarks (``python -m scripts.bench``, ``python -m scripts.bench.draft``) and the replay A/B script
(``bash scripts/bench/ab_fixture.sh``). Speed is measured here, never asserted in tests."""
