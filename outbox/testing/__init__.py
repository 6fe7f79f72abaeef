"""Test servers for tests and demos: fake providers on loopback, never used by ``outbox run``.

outbox's own tests, ``outbox demo`` and your tests of code that enqueues can point the real
providers (or the real ``stripe`` SDK, or any HTTP client) at these instead of the internet.
Each fake is a real HTTP server on 127.0.0.1, on an ephemeral port, in a thread of the process
that starts it, so its ledger outlives a dispatcher subprocess that a test kills. Use one as a
context manager (or ``start()``/``stop()``) and read ``url``:

* :class:`FakeStripe` (``outbox.testing.stripe``): Stripe's v1 API for a handful of resources
  (PaymentIntents, refunds, customers, transfers, payouts, invoices, subscriptions,
  SetupIntents, Checkout Sessions, and the events their creation makes), with retrieval, lists
  and their filters, and the state changes Stripe documents (confirm, capture, cancel,
  finalize, pay, void; ``outbox.testing.stripe_changes``). It keeps Stripe's idempotency
  semantics: the first POST with an ``Idempotency-Key`` executes and its answer is saved (500s
  included once execution began); the same key and parameters replay that answer
  (``Idempotent-Replayed: true``) and create nothing; the same key with other parameters gets
  400 ``idempotency_error``, and while the first still executes 409; validation failures, 401s
  and 429s are not saved; a key is forgotten ``key_retention`` seconds after its first use
  (24 hours by default, as at Stripe), after which it creates a second object.
* :class:`FakeWebhookReceiver` (``outbox.testing.webhook``): a webhook endpoint that honours
  ``Idempotency-Key`` as the IETF draft says (one :class:`Effect` per key, replays of the same
  body, 422 for another body, 409 while in progress, keys forgotten after ``key_retention``).
* Fakes of five more APIs that take an idempotency key, for the configurable ``http``
  provider (``outbox.testing.apis``): :class:`FakePayPal` (Orders v2 and Payments v2
  captures, ``PayPal-Request-Id``), :class:`FakeAdyen` (``POST /v71/payments``),
  :class:`FakeCheckoutCom` (``POST /payments``, ``Cko-Idempotency-Key``, lookups by id and by
  reference), :class:`FakeSquare` (``POST /v2/payments``, the key in the body) and
  :class:`FakeEffectsService` (a generic internal service shaped as the IETF draft
  recommends, with a lookup by key that forgets what its keys forget). Each keeps its API's
  documented semantics (replays, what another body and a request in progress get, how long keys
  are kept, what a 500 after the effect leaves) and says in its module where it had to assume.
  They are profiles of one engine, :class:`FakeHttpApi` (``outbox.testing.http_api``): another
  API is a small :class:`~outbox.testing.http_api.ApiProfile`, not a new server. Their ``url``
  is the bare base URL; they record :class:`ApiCall` and :class:`ApiEffect` and take
  :class:`ApiFault`.

All of them record every request (:class:`StripeRequest`, :class:`WebhookRequest`) and the effects
they applied, inject faults on request (:class:`StripeFault`, :class:`WebhookFault`: error
statuses, TCP resets, delays and bad answers such as compression bombs, before or after the
effect; :class:`BadAnswer`), pause a key between "effect applied" and "answer sent"
(:class:`Hold`), refuse and accept connections on the same port, and forget keys on demand.
What the servers share is ``outbox.testing.loopback``.

Nothing of the dispatcher, the daemon or the CLI is imported here, and the real providers import
nothing from here (the import contracts in pyproject.toml).
"""

from outbox.testing.apis import (
    FakeAdyen,
    FakeCheckoutCom,
    FakeEffectsService,
    FakePayPal,
    FakeSquare,
)
from outbox.testing.http_api import ApiCall, ApiEffect, ApiFault, FakeHttpApi
from outbox.testing.loopback import BadAnswer, Hold
from outbox.testing.stripe import FakeStripe, StripeFault, StripeFaultKind, StripeRequest
from outbox.testing.webhook import (
    Effect,
    FakeWebhookReceiver,
    WebhookFault,
    WebhookFaultKind,
    WebhookRequest,
)

__all__ = [
    "ApiCall",
    "ApiEffect",
    "ApiFault",
    "BadAnswer",
    "Effect",
    "FakeAdyen",
    "FakeCheckoutCom",
    "FakeEffectsService",
    "FakeHttpApi",
    "FakePayPal",
    "FakeSquare",
    "FakeStripe",
    "FakeWebhookReceiver",
    "Hold",
    "StripeFault",
    "StripeFaultKind",
    "StripeRequest",
    "WebhookFault",
    "WebhookFaultKind",
    "WebhookRequest",
]
