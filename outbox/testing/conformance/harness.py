"""What a plug-in author supplies to the conformance suite: a *harness* around their provider and
their fake of its API, and the fixed vocabulary of faults the suite asks that fake for.

The suite never talks to an API itself: it asks the harness for a fresh provider pointed at the
fake, for a valid request, for what the fake saw (effects per key, keys as received), and for one
fault at a time. A fault the fake cannot make is answered ``False`` (or ``Unsupported`` with a
reason), and the check that needed it is reported as skipped, never as passed.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from datetime import datetime
from typing import Final, Protocol, runtime_checkable

from outbox.providers.base import LookupRequest, Provider, SendRequest

# The Retry-After (seconds) a RATE_LIMITED answer carries, and the least the provider must hand
# outbox back as ``Failed.retry_after``.
RETRY_AFTER_SECONDS: Final = 7
# The least a HUGE_ANSWER holds, in multiples of the harness's ``max_response_bytes``.
HUGE_ANSWER_FACTOR: Final = 64
# The least a GZIP_BOMB decodes to.
GZIP_BOMB_BYTES: Final = 1 << 30


class Unsupported(Exception):
    """Raised by a harness method for what its fake or provider cannot do: the check that asked
    is skipped, with this message as its reason."""


class Fault(enum.Enum):
    """What the fake does to the next request carrying a key (``Harness.arm``). The value says
    what the fake must do; ``acts`` whether the fake applies the request's effect first."""

    REFUSED = "refuse the connection: nothing is sent"
    RESET_BEFORE_ACTING = "reset the TCP connection once the request arrived, without acting"
    RESET_AFTER_ACTING = "act, then reset the TCP connection instead of answering"
    TIMEOUT_AFTER_ACTING = "act, then send no answer within the provider's timeout"
    ERROR_AFTER_ACTING = "act, then answer a 5xx"
    UNAVAILABLE_BEFORE_ACTING = "answer 503 without acting"
    RATE_LIMITED = f"answer 429 with Retry-After: {RETRY_AFTER_SECONDS}, without acting"
    KEY_IN_USE = "answer 409: a request with this key is still in progress (no effect)"
    CREDENTIALS_REFUSED = "answer 401: the provider's credentials are refused"
    PERMANENT_REFUSAL = "answer a 4xx the API documents as final (a validation error), no effect"
    HUGE_ANSWER = f"act, then answer at least {HUGE_ANSWER_FACTOR} x max_response_bytes"
    GZIP_BOMB = f"act, then answer gzip that decodes to at least {GZIP_BOMB_BYTES} bytes"
    UNDECODABLE_ANSWER = "act, then answer a body that cannot be decoded (gzip that is not)"

    @property
    def acts(self) -> bool:
        """Whether the fake applies the effect before it misbehaves."""
        return self in _ACTING


_ACTING: Final = frozenset(
    {
        Fault.RESET_AFTER_ACTING,
        Fault.TIMEOUT_AFTER_ACTING,
        Fault.ERROR_AFTER_ACTING,
        Fault.HUGE_ANSWER,
        Fault.GZIP_BOMB,
        Fault.UNDECODABLE_ANSWER,
    }
)


class LookupFault(enum.Enum):
    """What the fake does to the next lookup (``LookupHarness.arm_lookup``)."""

    ERROR = "answer the lookup's request with a 5xx"
    TIMEOUT = "send no answer to the lookup's request within the provider's timeout"
    REFUSED = "refuse the lookup's connection"
    FORGOTTEN_KEY = "forget every idempotency key, as after its retention (effects stay)"


@runtime_checkable
class Harness(Protocol):
    """A provider under test and the fake it talks to, ready to use (the fake started).

    Every method is called from the check's own event loop (``asyncio.run``), so ``provider()``
    may build clients bound to it; the others must be quick and must not block for long.
    """

    @property
    def name(self) -> str:
        """What reports call the provider under test."""
        ...

    @property
    def timeout(self) -> float:
        """Seconds: the call timeout of the providers ``provider()`` builds."""
        ...

    @property
    def max_response_bytes(self) -> int:
        """The cap on one answer of the providers ``provider()`` builds (the huge answers are
        sized against it)."""
        ...

    def provider(self) -> Provider:
        """A fresh provider pointed at the fake; the suite closes it (``aclose``)."""
        ...

    def send_request(self, key: str, attempt: int) -> SendRequest:
        """A valid request carrying ``key`` as its idempotency key, for attempt ``attempt``:
        the same operation (id, payload) for every attempt of one key."""
        ...

    def unknown_action(self) -> str | None:
        """An action the provider does not know, or None when every action is valid to it (a
        webhook's action is an event name)."""
        ...

    def effects(self, key: str) -> int:
        """How many effects the fake applied for requests carrying ``key``."""
        ...

    def keys_received(self) -> Sequence[str | None]:
        """The idempotency key of every send that reached the fake, in order of arrival, as it
        arrived (None: the request carried none). Lookups are left out."""
        ...

    def arm(self, fault: Fault, key: str) -> bool:
        """Make the fake do ``fault`` to the next request carrying ``key`` (a refused connection:
        to every connection until ``restore``); False when it cannot."""
        ...

    def restore(self) -> None:
        """End any fault that lasts (refused connections): normal service again."""
        ...


@runtime_checkable
class LookupHarness(Harness, Protocol):
    """A harness whose provider also implements ``Lookup`` and whose fake can be asked about."""

    def lookup_request(
        self, sent: SendRequest, first_sent_at: datetime, now: datetime
    ) -> LookupRequest:
        """The LookupRequest the reconciler would make for the operation of ``sent``, first sent
        at ``first_sent_at`` and last attempted before ``now`` (both UTC)."""
        ...

    def arm_lookup(self, fault: LookupFault) -> bool:
        """Make the fake do ``fault`` to the next lookup; False when it cannot."""
        ...
