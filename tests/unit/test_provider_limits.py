"""The circuit breaker's state machine, on a clock the test moves."""

from __future__ import annotations

from datetime import timedelta

import httpx

from outbox.dispatch.breaker import ALONE_RECENT, Breaker, State, Verdict, verdict
from outbox.providers.base import Failed, transient, unknown
from outbox.providers.http.provider import _classify
from outbox.providers.http.webhook import WebhookOptions, WebhookProvider

FAILING, HEALTHY, NEUTRAL, REFUSED = (
    Verdict.FAILING,
    Verdict.HEALTHY,
    Verdict.NEUTRAL,
    Verdict.REFUSED,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def breaker(
    clock: Clock, failures: int = 3, open_for: float = 10.0, rate: float = 0.8, window: int = 10
) -> Breaker:
    return Breaker("p", failures, timedelta(seconds=open_for), clock, rate=rate, window=window)


def fail_until_open(b: Breaker, times: int = 3) -> None:
    for op in range(times):
        b.record(op, FAILING)


def state(b: Breaker) -> State:
    """The state now (a call, so that mypy does not narrow it across records)."""
    return b.state


def probe(b: Breaker, op: int, *, fresh: bool = True) -> None:
    assert b.awaits_probe
    assert b.allowance() == 0  # the ordinary claim takes none: the probe is claimed apart
    b.claimed(op, fresh=fresh)
    assert not b.awaits_probe  # exactly one probe
    assert b.may_send(op)


def test_failures_open_it_only_as_a_high_share_of_the_last_calls() -> None:
    b = breaker(Clock())
    for op in range(10):
        b.record(op, HEALTHY)
    # Seven of the last ten calls failing is 70 %: closed; the eighth makes 80 %.
    for op in range(100, 107):
        b.record(op, FAILING)
        assert (b.state, b.allowance()) == (State.CLOSED, None)
    b.record(107, FAILING)
    assert (b.state, b.reason, b.allowance()) == (State.OPEN, "failures", 0)
    assert not b.may_send(7)  # claimed before it opened: goes back unsent


def test_a_fresh_breaker_opens_after_its_threshold_of_failures() -> None:
    b = breaker(Clock())
    b.record(1, FAILING)
    b.record(1, FAILING)  # the same operation again: no success in between, so it counts
    assert (b.state, b.allowance()) == (State.CLOSED, None)
    b.record(2, FAILING)
    assert (b.state, b.allowance()) == (State.OPEN, 0)


def test_an_operation_failing_again_after_others_succeeded_fails_alone() -> None:
    """The bug of issue 37: a few operations that always fail must not close the provider to
    the rest. Each fails once, the provider succeeds for others, each fails again: from then on
    their failures are theirs alone."""
    b = breaker(Clock(), failures=3)
    bad = [1, 2]
    for round_ in range(50):
        for op in bad:
            b.record(op, FAILING)
        b.record(1000 + round_, HEALTHY)
        assert b.state is State.CLOSED, round_
    assert b.failing_alone == 2
    assert b.failure_rate < 0.5
    # A success ends the mark: a later failure counts again.
    b.record(1, HEALTHY)
    assert b.failing_alone == 1


def test_one_operation_failing_with_no_other_traffic_never_opens_it() -> None:
    b = breaker(Clock())
    for _ in range(50):
        b.record(1, FAILING)
    assert (b.state, b.failure_rate) == (State.CLOSED, 1.0)
    b.record(2, FAILING)  # a second operation fails too: the provider, then
    assert b.state is State.OPEN


def test_operations_failing_alone_never_open_it_while_the_provider_works_for_others() -> None:
    clock = Clock()
    b = breaker(clock, failures=3)
    for op in range(20):  # the first failures of twenty bad operations, among successes
        b.record(op, FAILING)
        b.record(100 + op, HEALTHY)
    for round_ in range(10):  # then only their retries, the healthy ones all delivered
        clock.now += 30
        for op in range(20):
            b.record(op, FAILING)
        assert state(b) is State.CLOSED, round_
    assert b.failing_alone == 20


def test_permanent_answers_neither_count_nor_reset() -> None:
    b = breaker(Clock())
    b.record(1, FAILING)
    b.record(2, FAILING)
    for op in range(3, 20):
        b.record(op, NEUTRAL)
    assert (b.state, b.allowance()) == (State.CLOSED, None)
    b.record(20, FAILING)
    assert (b.state, b.allowance()) == (State.OPEN, 0)


def test_half_open_after_the_period_one_probe_closes_on_success() -> None:
    clock = Clock()
    b = breaker(clock)
    fail_until_open(b)
    clock.now += 9.9
    assert not b.awaits_probe
    clock.now += 0.1
    probe(b, 42)
    assert b.state is State.HALF_OPEN
    b.record(42, HEALTHY)
    assert (b.state, b.reason, b.allowance()) == (State.CLOSED, None, None)


def test_a_success_while_open_for_failures_closes_it() -> None:
    """A call in flight when it opened that then succeeds: the provider works."""
    b = breaker(Clock())
    fail_until_open(b)
    b.record(77, HEALTHY)
    assert (b.state, b.allowance()) == (State.CLOSED, None)
    assert b.released(77)  # its end wakes the claim


def test_failed_probes_double_the_period_up_to_the_cap_and_a_close_resets_it() -> None:
    clock = Clock()
    b = breaker(clock, open_for=60.0)
    fail_until_open(b)
    waits = []
    for op in range(100, 106):
        waited = 0.0
        while not b.awaits_probe:
            clock.now += 1.0
            waited += 1.0
        waits.append(waited)
        probe(b, op)
        b.record(op, FAILING)
    assert waits == [60, 120, 240, 300, 300, 300]  # BREAKER_OPEN_MAX is 5 minutes
    clock.now += 300
    probe(b, 200)
    b.record(200, NEUTRAL)  # it answered: closed
    # The provider worked after all: it weighs twice its window before it may open again.
    fail_until_open(b, 19)
    assert state(b) is State.CLOSED
    fail_until_open(b, 20)
    assert state(b) is State.OPEN
    clock.now += 59
    assert not b.awaits_probe
    clock.now += 1
    assert b.awaits_probe


def test_a_failed_probe_that_had_failed_before_does_not_lengthen_the_period() -> None:
    clock = Clock()
    b = breaker(clock, open_for=60.0)
    fail_until_open(b)
    for op in range(3):
        clock.now += 60
        probe(b, op, fresh=False)  # only the rows that opened it are left
        b.record(op, FAILING)
        assert b.next_probe_in() == 60
    clock.now += 60
    probe(b, 9)
    b.record(9, FAILING)  # a fresh operation fails too: the provider is sick
    assert b.next_probe_in() == 120


def test_a_probe_that_was_not_sent_lets_another_be_claimed() -> None:
    clock = Clock()
    b = breaker(clock)
    fail_until_open(b)
    clock.now += 10
    probe(b, 7)
    assert b.released(7)  # handed back unsent (shutdown, key window)
    assert b.awaits_probe
    assert not b.released(8)


def test_refused_credentials_open_at_once_and_only_a_probe_closes() -> None:
    clock = Clock()
    b = breaker(clock, failures=5)
    b.record(1, REFUSED)
    assert (b.state, b.reason) == (State.OPEN, "credentials")
    b.record(2, HEALTHY)  # a call sent before the key was revoked proves nothing about it now
    assert b.state is State.OPEN
    for op in (10, 11, 12):
        clock.now += 10  # credentials are probed at the base period, never less often
        probe(b, op)
        b.record(op, FAILING if op == 11 else REFUSED)  # a 503 does not clear the reason
        assert (b.state, b.reason) == (State.OPEN, "credentials")
    clock.now += 10
    probe(b, 13)
    b.record(13, HEALTHY)
    assert (b.state, b.reason) == (State.CLOSED, None)


def test_a_refusal_while_open_for_failures_makes_credentials_the_reason() -> None:
    b = breaker(Clock())
    fail_until_open(b)
    b.record(9, REFUSED)
    assert (b.state, b.reason) == (State.OPEN, "credentials")


def test_a_requests_own_trouble_says_nothing_of_the_providers_health() -> None:
    """A key in use (409), a rate limit (429) or an answer the provider replayed for this key
    came from a provider that answered: such failures neither open the breaker nor reset it."""
    own = [
        transient("http_409", "HTTP 409", http_status=409, request_only=True),
        transient("http_429", "HTTP 429", http_status=429, request_only=True),
        unknown("http_500", "HTTP 500", http_status=500, reconcile=True, request_only=True),
    ]
    assert {verdict(result) for result in own} == {NEUTRAL}
    assert verdict(unknown("http_503", "HTTP 503", http_status=503)) is FAILING
    b = breaker(Clock())
    b.record(1, FAILING)
    b.record(2, FAILING)
    for op in range(3, 40):
        b.record(op, verdict(own[op % 3]))
    assert (b.state, b.allowance()) == (State.CLOSED, None)
    b.record(40, FAILING)
    assert b.state is State.OPEN


def test_the_webhook_provider_says_which_failures_are_the_requests_own() -> None:
    provider = WebhookProvider(
        "hook", WebhookOptions("http://x", timedelta(seconds=1), timedelta(hours=1))
    )
    spec = provider.spec("a")
    assert spec is not None

    def classify(status: int, **headers: str) -> Failed:
        result = _classify(spec, httpx.Response(status, headers=headers), "key")
        assert isinstance(result, Failed)
        return result

    assert classify(409).request_only and classify(429).request_only
    assert not classify(408).request_only and not classify(503).request_only
    replayed = classify(500, **{"Idempotent-Replayed": "true"})
    assert replayed.request_only and replayed.reconcile  # it will only ever say this again
    fresh = classify(500)
    assert not fresh.request_only and not fresh.reconcile


def test_one_tenant_failing_while_another_succeeds_is_that_tenant_s_own() -> None:
    """A review's flood: one tenant's operations all fail, another's keep succeeding."""
    b = breaker(Clock(), failures=3)
    for op in range(100):
        b.record(op, FAILING, "evil")
        if op % 9 == 0:
            b.record(1000 + op, HEALTHY, "good")
    assert state(b) is State.CLOSED
    for op in range(200, 230):  # the good tenant's calls fail too now: the provider
        b.record(op, FAILING, "good")
    assert state(b) is State.OPEN


def test_a_tenant_alone_on_the_provider_can_still_open_it() -> None:
    b = breaker(Clock(), failures=3)
    for op in range(3):
        b.record(op, FAILING, "only")
    assert b.state is State.OPEN


def test_a_probe_that_succeeds_doubles_the_calls_weighed_before_the_next_opening() -> None:
    """Bad payloads queued ahead of good ones: each time a probe gets through, the breaker
    weighs twice as many calls before it opens again, so the bad rows are tried and spend
    their own attempts in a few episodes, not one window at a time."""
    clock = Clock()
    b = breaker(clock, failures=3, open_for=10.0, window=10)
    op, weighed = 0, []
    for _episode in range(4):
        calls = 0
        while state(b) is State.CLOSED:
            b.record(op, FAILING)
            op, calls = op + 1, calls + 1
        weighed.append(calls)
        clock.now += 10
        probe(b, 10_000 + op)
        b.record(10_000 + op, HEALTHY)
    assert weighed == [3, 20, 40, 80]
    clock.now += 3601  # an hour closed: back to its window
    b.record(1, FAILING)
    b.record(2, FAILING)
    b.record(3, FAILING)
    assert b.state is State.OPEN


def test_in_an_outage_operations_that_failed_alone_before_count_again() -> None:
    """A review's case: a spell of failures among successes marks some operations alone; then
    the provider goes down with only their retries to send. Once it has succeeded for no one in
    ALONE_RECENT, their failures count, and the breaker opens instead of letting them spend
    every attempt."""
    clock = Clock()
    b = breaker(clock, failures=5, window=20)
    for op in range(30):  # a spell: each fails, others succeed
        b.record(op, FAILING)
        b.record(1000 + op, HEALTHY)
    for op in range(30):  # a second failure after a success: alone
        b.record(op, FAILING)
    assert b.failing_alone == 30 and state(b) is State.CLOSED
    clock.now += ALONE_RECENT  # down since: no success for ten minutes
    spent = 0
    while state(b) is State.CLOSED and spent < 300:  # only their retries now
        b.record(spent % 30, FAILING)
        spent += 1
    assert 1 <= spent <= 20, spent
    assert b.failing_alone == 0  # sick: every failure counts again
