"""Fake providers on loopback, for tests and `outbox demo`: real HTTP servers that keep the
idempotency semantics of a careful webhook receiver (the IETF Idempotency-Key draft) and of
Stripe, inject faults on request, and keep a ledger of the effects they applied."""
