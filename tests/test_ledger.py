"""Evidence ledger: promotion only after N agreements and none against, demotion, persistence."""

from __future__ import annotations

import json

import pytest

from mlx_fill.ledger import Ledger, ledger_path, load_ledger

ROW = "echo:corroborated"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_FILL_CACHE", str(tmp_path))


def test_promotion_needs_n_agreements_eligibility_and_temperature_zero():
    led = Ledger("m", "t", promote_after=3, eligible=frozenset({ROW}))
    for i in range(3):
        assert not led.promoted(ROW)
        led.record(ROW, True)
    assert led.promoted(ROW)
    assert not led.promoted(ROW, temperature=0.1)
    other = Ledger("m", "t", promote_after=3)  # echo is off by default
    for _ in range(10):
        other.record(ROW, True)
    assert not other.promoted(ROW)


def test_first_disagreement_demotes_for_good():
    led = Ledger("m", "t", promote_after=2, eligible=frozenset({ROW}))
    for _ in range(5):
        led.record(ROW, True)
    led.record(ROW, False)
    assert not led.promoted(ROW)
    for _ in range(100):
        led.record(ROW, True)
    assert not led.promoted(ROW)


def test_persisted_under_user_cache_dir_and_reloaded(tmp_path):
    led = load_ledger("mlx-community/Qwen3-0.6B", "{{ template }}", promote_after=2,
                      eligible=frozenset({ROW}))
    led.record(ROW, True)
    led.record(ROW, True)
    path = led.save()
    assert path.parent == tmp_path / "ledger" and path == ledger_path(led.model, led.template)
    again = load_ledger("mlx-community/Qwen3-0.6B", "{{ template }}", promote_after=2,
                        eligible=frozenset({ROW}))
    assert again.rows[ROW].agreements == 2 and again.promoted(ROW)
    assert load_ledger("other-model", "{{ template }}").rows == {}


def test_corrupt_or_foreign_ledger_is_an_error_not_a_reset():
    path = ledger_path("m", "t")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        load_ledger("m", "t")
    path.write_text(json.dumps({"model": "x", "template": "t", "rows": {}}))
    with pytest.raises(ValueError, match="another"):
        load_ledger("m", "t")
    with pytest.raises(ValueError):
        Ledger("m", "t", promote_after=0)
