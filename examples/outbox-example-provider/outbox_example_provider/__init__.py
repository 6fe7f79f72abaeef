"""An example outbox provider plug-in: SMS through Relay, a fictional HTTP API.

``provider.factory`` is registered in the entry point group ``outbox.providers`` as
``relay_sms``; ``fake.FakeRelay`` is a loopback fake of the API; ``harness.relay_harness`` runs
outbox's conformance suite against the two (see README.md).
"""

from outbox_example_provider.provider import RelayProvider, factory

__all__ = ["RelayProvider", "factory"]
