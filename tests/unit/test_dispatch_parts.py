"""The pure parts of the dispatcher (outbox/dispatch/): the fairness cursor, how many claim
loops, and each provider's key window and call limit."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.config.settings import ConfigError
from outbox.db.store import Claimed
from outbox.dispatch.claims import MAX_CLAIMERS, claimers, next_cursor
from outbox.dispatch.rules import CALL_GUARD_MARGIN, NO_WINDOW, ProviderRules

NOW = datetime(2026, 12, 1, tzinfo=UTC)
GROUPS = st.tuples(st.sampled_from(["hook", "stripe"]), st.sampled_from(["a", "b", "c", "d"]))


def claimed(provider: str, tenant: str) -> Claimed:
    return Claimed(
        1,
        tenant,
        "t",
        "k",
        provider,
        "a",
        "{}",
        2,
        1 << 20,
        "key",
        None,
        None,
        1,
        0,
        None,
        uuid.uuid4(),
        None,
        NOW,
        NOW,
    )


@given(st.lists(GROUPS, max_size=30), st.none() | GROUPS)
def test_the_cursor_moves_to_a_group_just_served_or_stays(
    taken: list[tuple[str, str]], cursor: tuple[str, str] | None
) -> None:
    after = next_cursor(cursor, [claimed(*g) for g in taken])
    if not taken:
        assert after == cursor  # a claim that took nothing moves nothing
    else:
        assert after in taken


def test_the_cursor_goes_past_the_group_that_took_more_than_its_share() -> None:
    rows = [claimed("hook", "a"), claimed("hook", "b"), claimed("hook", "b"), claimed("hook", "c")]
    assert next_cursor(None, rows) == ("hook", "b")
    # each took one: after the last group served, so the ones not reached come first
    assert next_cursor(("hook", "a"), [claimed("hook", "b"), claimed("hook", "c")]) == ("hook", "c")


@given(st.integers(1, 100_000), st.integers(1, 10_000))
def test_claim_loops_are_one_to_max_and_never_more_than_batches(
    concurrency: int, batch: int
) -> None:
    loops = claimers(concurrency, batch)
    assert 1 <= loops <= MAX_CLAIMERS
    assert loops <= max(1, -(-concurrency // batch))


class _Provider:
    def __init__(self, name: str, retention: timedelta) -> None:
        self.name = name
        self.key_retention = retention


def test_rules_come_from_each_provider_itself_and_unknown_ones_have_no_window() -> None:
    providers = {
        "stripe": _Provider("stripe", timedelta(hours=24)),
        "plugin": _Provider("plugin", timedelta(hours=2)),
    }
    rules = ProviderRules(
        providers,  # type: ignore[arg-type]
        timedelta(hours=1),
        {"stripe": timedelta(seconds=30)},
    )
    # the plug-in's own retention, not a config default: the gauges read these same windows
    assert rules.closes_after() == {"stripe": timedelta(hours=23), "plugin": timedelta(hours=1)}
    assert rules.window("plugin").has_passed(NOW - timedelta(minutes=61), NOW)
    assert not rules.window("plugin").has_passed(NOW - timedelta(minutes=59), NOW)
    assert rules.window("nobody") is NO_WINDOW and rules.window("nobody").has_passed(NOW, NOW)
    assert rules.call_limit("stripe") == 30 + CALL_GUARD_MARGIN
    assert rules.call_limit("plugin") is None  # no timeout configured: no guard


class _PerAction(_Provider):
    """A provider that keeps some actions' keys longer (PayPal's Payments: 45 days)."""

    def __init__(self, name: str, retention: timedelta) -> None:
        super().__init__(name, retention)
        self.action_key_retention = {
            "capture": timedelta(days=45),
            "quick": timedelta(minutes=30),
        }


def test_an_actions_own_key_retention_is_its_window_and_the_gauge_warns_by_the_shortest() -> None:
    provider = _PerAction("paypal", timedelta(hours=6))
    with pytest.raises(ConfigError, match=r"actions\.quick\.key_retention \(30m\)"):
        ProviderRules({"paypal": provider}, timedelta(hours=1))  # type: ignore[dict-item]
    provider.action_key_retention = {"capture": timedelta(days=45)}
    rules = ProviderRules({"paypal": provider}, timedelta(hours=1))  # type: ignore[dict-item]
    five_hours_ago, a_month_ago = NOW - timedelta(hours=5, minutes=1), NOW - timedelta(days=30)
    assert rules.window("paypal", "order").has_passed(five_hours_ago, NOW)
    assert rules.window("paypal").has_passed(five_hours_ago, NOW)
    assert not rules.window("paypal", "capture").has_passed(a_month_ago, NOW)
    assert rules.window("paypal", "capture").has_passed(NOW - timedelta(days=45), NOW)
    assert rules.closes_after() == {"paypal": timedelta(hours=5)}
    # "*" is every action not named: its window, not the provider's (an http provider's).
    provider.action_key_retention = {"capture": timedelta(days=45), "*": timedelta(hours=2)}
    rules = ProviderRules({"paypal": provider}, timedelta(hours=1))  # type: ignore[dict-item]
    assert rules.window("paypal", "refund").has_passed(NOW - timedelta(hours=1, minutes=1), NOW)
    assert not rules.window("paypal", "capture").has_passed(a_month_ago, NOW)
    assert rules.closes_after() == {"paypal": timedelta(hours=1)}


def test_a_providers_own_margin_closes_its_window_and_no_other() -> None:
    providers = {
        "queue": _Provider("queue", timedelta(minutes=2)),
        "stripe": _Provider("stripe", timedelta(hours=24)),
    }
    margins = {"queue": timedelta(seconds=30)}
    rules = ProviderRules(providers, timedelta(hours=1), None, margins)  # type: ignore[arg-type]
    assert rules.closes_after() == {
        "queue": timedelta(seconds=90),
        "stripe": timedelta(hours=23),
    }
    assert rules.window("queue").has_passed(NOW - timedelta(seconds=90), NOW)
    assert not rules.window("queue").has_passed(NOW - timedelta(seconds=89), NOW)
    # Without its own margin, the dispatcher's hour leaves a 2-minute queue no window at all.
    per_action = _PerAction("queue", timedelta(minutes=2))
    per_action.action_key_retention = {"*": timedelta(minutes=2)}
    with pytest.raises(ConfigError, match=r"dispatcher\.retention_margin \(1h\)"):
        ProviderRules({"queue": per_action}, timedelta(hours=1))  # type: ignore[dict-item]
    rules = ProviderRules({"queue": per_action}, timedelta(hours=1), None, margins)  # type: ignore[dict-item]
    assert rules.window("queue", "any").margin == timedelta(seconds=30)
    with pytest.raises(ConfigError, match=r"providers\.queue\.retention_margin \(3m\)"):
        ProviderRules(
            {"queue": per_action},  # type: ignore[dict-item]
            timedelta(hours=1),
            None,
            {"queue": timedelta(minutes=3)},
        )
