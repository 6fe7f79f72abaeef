"""The webhook provider: POST the payload as JSON to one URL with the stored Idempotency-Key; a
preset of the `http` provider (outbox.providers.http.provider), whose settings it keeps.

The body is the payload exactly as stored: PostgreSQL's JSON text of it (``payload_json``), so
that every number reaches the receiver as it was enqueued (``19.999999999999999999``, not 20.0).
The key travels as an RFC 8941 string (quoted, as the IETF Idempotency-Key draft wants), with
the Outbox-* identity headers (wire.identity_headers); any action goes, named in
Outbox-Action.

Response classes follow the IETF Idempotency-Key draft (wire.default_class): 2xx success;
409 (a request with that key is in progress), 408, 425 and 429 transient, honouring Retry-After;
401 and 403 pause the provider (our credentials are refused: nothing is spent); 422 and other
4xx permanent; every 5xx (503 included: a gateway may answer it after the receiver acted),
timeouts and resets after sending unknown, retried with the same key only inside the key window;
a refused connection transient (nothing was sent); a request that cannot be built, or whose head
h11 refuses to write, permanent and not sent (outbox.providers.building). An answer is read
within bounds (outbox.providers.answers): one over ``max_response_bytes``, undecodable or too
slow is unknown, since the receiver answered and so may have acted. The reference of a 2xx is
its ``reference_field`` when that is an identifier (``answers.reference``), else the
idempotency key. With a ``lookup``, reconciliation asks the receiver (outbox.providers.
http.lookup).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Final

import httpx

from outbox.config.settings import DEFAULT_CONCURRENCY, DEFAULT_MAX_RESPONSE_BYTES
from outbox.core.json_pointer import Pointer
from outbox.providers.http.provider import HttpOptions, HttpProvider
from outbox.providers.http.spec import ActionSpec, LookupSpec, Template
from outbox.providers.kit import ANY_ACTION, KeySpec

DEFAULT_REFERENCE_FIELD = "id"
# The key as the draft sends it, as outbox stores it: 1 to 255 visible ASCII characters.
WEBHOOK_KEY: Final = KeySpec(header="Idempotency-Key", quoting="sf-string")


@dataclass(frozen=True, slots=True)
class WebhookOptions:
    """A webhook provider's settings, secrets already read from their env or file source."""

    url: str
    timeout: timedelta
    key_retention: timedelta
    headers: Mapping[str, str] = field(default_factory=dict)
    secret_headers: Mapping[str, str] = field(default_factory=dict)
    reference_field: str = DEFAULT_REFERENCE_FIELD
    # Connections to the receiver at once: as many as the dispatcher may have calls in flight to
    # it (see connection_cap), so that no call waits for a connection behind the others.
    max_connections: int = DEFAULT_CONCURRENCY
    # The most bytes of one answer read, decoded (see outbox.providers.answers).
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    # How reconciliation asks the receiver for an effect (a path below the URL's origin).
    lookup: LookupSpec | None = None

    def __repr__(self) -> str:
        secret_names = sorted(self.secret_headers)
        return f"WebhookOptions(url={self.url!r}, secret_headers={secret_names!r})"


def preset(options: WebhookOptions) -> HttpOptions:
    """The `http` settings the webhook's come to: one action for every action name."""
    parts = urllib.parse.urlsplit(options.url)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    action = ActionSpec(
        method="POST",
        target=Template.literal(target),
        key=WEBHOOK_KEY,
        key_retention=options.key_retention,
        reference=Pointer.parse(
            "/" + options.reference_field.replace("~", "~0").replace("/", "~1")
        ),
        lookup=options.lookup,
    )
    return HttpOptions(
        base_url=f"{parts.scheme}://{parts.netloc}",
        timeout=options.timeout,
        key_retention=options.key_retention,
        actions={ANY_ACTION: action},
        headers=options.headers,
        secret_headers=options.secret_headers,
        outbox_headers=True,
        max_connections=options.max_connections,
        max_response_bytes=options.max_response_bytes,
    )


class WebhookProvider(HttpProvider):
    """POSTs each operation to one URL; the action travels as a header."""

    def __init__(
        self, name: str, options: WebhookOptions, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        super().__init__(name, preset(options), transport)
        self.options = options
