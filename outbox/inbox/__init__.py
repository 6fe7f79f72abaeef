"""The receiving half: a worker's deliveries converge on one recorded outcome.

A worker that outbox (or any at-least-once sender) feeds wraps its routes in
:class:`InboxMiddleware`. Each delivery's business writes and its recorded outcome commit in one
transaction; a repeat gets the recorded outcome, byte for byte, marked
``Idempotent-Replayed: true``; a delivery still in its first transaction is "in progress"
(409, ``Retry-After``), never complete; the same key with another body is a conflict (422),
never run; a body that breaks the contract its sender names (``Outbox-Contract``) is refused
before anything is decided (422), never run (docs/design.md, "The inbox", "Contracts")::

    inbox = Inbox(pool)
    app = InboxMiddleware(starlette_app, inbox=inbox, routes={"POST /invoices": "invoice.create"})

    async def create_invoice(request):
        conn = delivery(request).conn  # the delivery's open transaction: write here
        ...

A WSGI app (Flask) wraps its routes in :class:`InboxWSGIMiddleware` over a :class:`SyncInbox`
(a psycopg ``ConnectionPool``), and writes on ``wsgi_delivery(request).conn``.

A handler that calls out before it can answer (a charge, an email) runs in external-effect
mode: its route is ``External("payment.collect")``; it reads ``claimed(request)``, sends
``claim.downstream_key(step)`` with its outbound calls and writes on ``await
claim.transaction()``, which commits with its recorded answer (on WSGI, ``wsgi_claimed``).

Queue consumers: :class:`Consumer` settles each message (ack, retry later, drop) after its
transaction ended; ``outbox.inbox.jetstream.consume`` runs one on a NATS JetStream consumer.
"""

from __future__ import annotations

from outbox.inbox.adapter import External
from outbox.inbox.asgi import InboxMiddleware, claimed, delivery
from outbox.inbox.contracts import ContractBreach, ContractUnknown
from outbox.inbox.core import (
    Decision,
    Delivery,
    Identity,
    Inbox,
    InvalidDelivery,
    NoOutcome,
    Outcome,
)
from outbox.inbox.external import Claim, LeaseLost
from outbox.inbox.http import KeyFrom, TenantFrom
from outbox.inbox.queues import Claiming, Consumer, Refuse, Verdict
from outbox.inbox.sync import SyncClaim, SyncDelivery, SyncInbox
from outbox.inbox.wsgi import InboxWSGIMiddleware, wsgi_claimed, wsgi_delivery

__all__ = [
    "Claim",
    "Claiming",
    "Consumer",
    "ContractBreach",
    "ContractUnknown",
    "Decision",
    "Delivery",
    "External",
    "Identity",
    "Inbox",
    "InboxMiddleware",
    "InboxWSGIMiddleware",
    "InvalidDelivery",
    "KeyFrom",
    "LeaseLost",
    "NoOutcome",
    "Outcome",
    "Refuse",
    "SyncClaim",
    "SyncDelivery",
    "SyncInbox",
    "TenantFrom",
    "Verdict",
    "claimed",
    "delivery",
    "wsgi_claimed",
    "wsgi_delivery",
]
