"""Evidence ledger: promotion only after N agreements and none against, demotion, persistence."""

from __future__ import annotations

import json

import pytest

from mlx_fill.sources.ledger import AUDIT_EVERY, Ledger, ledger_path, load_ledger

ROW = "echo:corroborated"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_FILL_CACHE", str(tmp_path))


def test_promotion_needs_n_agreements_and_eligibility():
    led = Ledger("m", "t", promote_after=3, eligible=frozenset({ROW}))
    for i in range(3):
        assert not led.promoted(ROW)
        led.record(ROW, True)
    assert led.promoted(ROW)
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


def test_a_promoted_claim_is_verified_again_after_every_few_asserts():
    """A promoted row is written unchecked, so its evidence goes stale: every AUDIT_EVERY-th
    firing since the claim's last verified outcome is a verify, and the model no longer
    writing the row (its first disagreement) demotes it for good."""
    led = Ledger("m", "t", promote_after=2, eligible=frozenset({ROW}))
    assert not led.asserts(ROW)
    for _ in range(2):
        led.record(ROW, True)
    firings = [led.asserts(ROW) for _ in range(2 * AUDIT_EVERY)]
    assert firings[:AUDIT_EVERY] == [True] * (AUDIT_EVERY - 1) + [False]
    assert not any(firings[AUDIT_EVERY:])  # no verified outcome yet: still checking
    led.record(ROW, True)  # the check agreed
    assert [led.asserts(ROW) for _ in range(AUDIT_EVERY)] == [True] * (AUDIT_EVERY - 1) + [False]
    led.record(ROW, False)  # the check disagreed
    assert not any(led.asserts(ROW) for _ in range(3 * AUDIT_EVERY))
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
    assert again.claims[ROW].agreements == 2 and again.promoted(ROW)
    assert load_ledger("other-model", "{{ template }}").claims == {}


def test_two_servers_sharing_a_ledger_file_lose_none_of_each_others_counts():
    """Each save adds what its process recorded since it last read the file: a disagreement
    one server recorded is never overwritten by another's save (it would let a demoted row be
    promoted again)."""
    first = load_ledger("m", "t", promote_after=2, eligible=frozenset({ROW}))
    second = load_ledger("m", "t", promote_after=2, eligible=frozenset({ROW}))
    first.record(ROW, False)
    first.save()
    for _ in range(3):
        second.record(ROW, True)
    second.save()
    assert not second.promoted(ROW)  # the save read the other server's disagreement
    first.record(ROW, True)
    first.save()
    again = load_ledger("m", "t", promote_after=2, eligible=frozenset({ROW}))
    assert (again.claims[ROW].agreements, again.claims[ROW].disagreements) == (4, 1)
    assert not again.promoted(ROW)


def test_a_save_that_cannot_take_the_lock_gives_up_and_the_next_save_writes_its_counts(monkeypatch):
    """A process holding the ledger's lock (stopped, say) delays a save by at most
    LOCK_WAIT_S; what that save would have written is written by the next one."""
    import fcntl
    from mlx_fill.sources import ledger
    monkeypatch.setattr(ledger, "LOCK_WAIT_S", 0.1)
    led = load_ledger("m", "t")
    led.record(ROW, False)
    path = ledger_path("m", "t")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(TimeoutError, match="held by another process"):
            led.save()
        fcntl.flock(held, fcntl.LOCK_UN)
    assert not path.exists()
    led.record(ROW, True)
    led.save()
    again = load_ledger("m", "t")
    assert (again.claims[ROW].agreements, again.claims[ROW].disagreements) == (1, 1)


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


class _Tok:
    chat_template = "{{ messages }}"


def test_server_ledger_reads_promotion_env(monkeypatch):
    from mlx_fill.session import check_env, server_ledger

    monkeypatch.setenv("MLX_FILL_PROMOTE", "strict:, echo:corroborated")
    monkeypatch.setenv("MLX_FILL_PROMOTE_AFTER", "2")
    led = server_ledger("fixture-model", _Tok())
    assert led.eligible == frozenset({"strict:", ROW}) and led.promote_after == 2
    assert led.template == _Tok.chat_template
    led.record("strict:scaffold", True)
    led.record("strict:scaffold", True)
    assert led.promoted("strict:scaffold")
    monkeypatch.delenv("MLX_FILL_PROMOTE")
    assert not server_ledger("fixture-model", _Tok()).is_eligible("strict:scaffold")
    monkeypatch.setenv("MLX_FILL_PROMOTE_AFTER", "0")
    with pytest.raises(ValueError, match="MLX_FILL_PROMOTE_AFTER"):
        check_env()


@pytest.mark.parametrize("entry", ["strict", "strict:key", "strict:close:bash", "echo", "strict:na"])
def test_a_promote_entry_that_names_no_assertable_row_is_refused(monkeypatch, entry):
    """A typo or a ``likely`` kind in MLX_FILL_PROMOTE would promote nothing, silently: the
    server refuses to start and names the entry."""
    from mlx_fill.session import BadEnvironment, check_env

    monkeypatch.setenv("MLX_FILL_PROMOTE", f"strict:name:bash, {entry}")
    with pytest.raises(BadEnvironment, match=f"{entry} can never be asserted"):
        check_env()
    monkeypatch.setenv("MLX_FILL_PROMOTE", "strict:name:bash, strict:scaffold, echo:")
    check_env()


def test_server_patch_ledger_fails_open_on_a_corrupt_file(caplog):
    from mlx_fill.adapters import server_patch

    path = ledger_path("corrupt-model", _Tok.chat_template)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    state = server_patch.ServerFill("strict")
    assert state.ledger_for("corrupt-model", _Tok()) is None
    assert "evidence ledger disabled" in caplog.text
    assert state.ledger_for("fresh-model", _Tok()) is not None
