"""Loopback fakes of five HTTP APIs that take an idempotency key, built on
``outbox.testing.http_api``: each module is one API's profile (its routes, its key rules, its
documented retention) and a :class:`~outbox.testing.http_api.FakeHttpApi` subclass with the
test helpers that API needs. Each module's docstring says what the API documents and what the
fake assumes where it is silent.

* :class:`FakePayPal`: Orders v2 and Payments v2 captures, ``PayPal-Request-Id``.
* :class:`FakeAdyen`: Checkout API ``POST /v71/payments``, ``Idempotency-Key``.
* :class:`FakeCheckoutCom`: ``POST /payments``, ``Cko-Idempotency-Key``, and the lookups by id
  and by reference.
* :class:`FakeSquare`: ``POST /v2/payments`` with ``idempotency_key`` in the body.
* :class:`FakeEffectsService`: a generic internal service shaped as the IETF draft
  recommends, with a lookup by key that forgets what its keys forget.
"""

from outbox.testing.apis.adyen import FakeAdyen
from outbox.testing.apis.checkout_com import FakeCheckoutCom
from outbox.testing.apis.effects import FakeEffectsService
from outbox.testing.apis.paypal import FakePayPal
from outbox.testing.apis.square import FakeSquare

__all__ = ["FakeAdyen", "FakeCheckoutCom", "FakeEffectsService", "FakePayPal", "FakeSquare"]
