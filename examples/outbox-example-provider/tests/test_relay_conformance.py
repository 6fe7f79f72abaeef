"""outbox's conformance suite against the Relay provider and FakeRelay: one case per check."""

from __future__ import annotations

from outbox.testing.conformance_pytest import conformance_tests

from outbox_example_provider.harness import relay_harness

test_relay_conforms = conformance_tests(relay_harness)
