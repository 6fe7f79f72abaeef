"""A generic internal service: the recommended shape for an API a team controls.

``POST /v1/effects`` takes ``Idempotency-Key`` as the IETF draft says (an RFC 8941 string,
``"abc"``; a bare value is accepted too), applies one effect per key and answers 201
``{"id": "eff_N", "status": "done"}``; a repeat with the same body replays that answer with
``Idempotent-Replayed: true``; another body gets 422, a repeat while the first is processed
409; a 500 after the effect is saved and replayed. Keys are kept 7 days, and the lookup
``GET /v1/effects?key=<key>`` (the key unquoted, URL-encoded) answers 200 ``{"id", "status":
"done", "key"}`` only while the key is kept: after that it is 404 ``{"error": "no such key"}``
although the effect happened, which is the hazard a dispatcher must handle (a lookup that says
"no" after the retention is not proof that nothing was done).

Keys are at most 255 characters of printable ASCII (what an RFC 8941 string can carry); a
missing, too long or otherwise invalid key is 400.
"""

from __future__ import annotations

import re
from typing import ClassVar

from outbox.testing.http_api import (
    DAY,
    ApiProfile,
    ApiRequest,
    Applied,
    Context,
    FakeHttpApi,
    KeySpec,
    Route,
)
from outbox.testing.loopback import Reply
from outbox.testing.webhook import parse_idempotency_key

__all__ = ["EFFECTS", "EffectsServiceProfile", "FakeEffectsService"]

EFFECTS_KIND = "effects"
CREATE = "create_effect"


def create_effect(ctx: Context, request: ApiRequest) -> Reply | Applied:
    """POST /v1/effects: 201 ``{"id": "eff_N", "status": "done"}``."""
    effect_id = ctx.store.new_id("eff_")
    ctx.store.put(EFFECTS_KIND, {"id": effect_id, "status": "done", "key": request.key})
    return Applied(Reply(201, {"id": effect_id, "status": "done"}), effect_id)


def find_effect(ctx: Context, request: ApiRequest) -> Reply:
    """GET /v1/effects?key=: 200 with the effect while its key is kept, else 404."""
    key = request.query.get("key")
    if not key:
        return Reply(400, {"error": "missing key"})
    effect_id = ctx.resource_for(CREATE, key)
    effect = ctx.store.get(EFFECTS_KIND, effect_id) if effect_id is not None else None
    if effect is None:
        return Reply(404, {"error": "no such key"})
    return Reply(200, dict(effect))


class EffectsServiceProfile(ApiProfile):
    """The IETF draft's semantics (the defaults of :class:`ApiProfile`), kept 7 days."""

    name: ClassVar[str] = "effects"
    key: ClassVar[KeySpec] = KeySpec(
        "Idempotency-Key",
        255,
        characters=re.compile(r"[\x20-\x7e]+"),
        parse=parse_idempotency_key,
    )
    retention: ClassVar[float] = 7 * DAY

    def routes(self) -> tuple[Route, ...]:
        return (
            Route("POST", "/v1/effects", CREATE, create_effect, effect=True),
            Route("GET", "/v1/effects", "find_effect", find_effect),
        )

    def missing_key(self, request: ApiRequest) -> Reply | None:
        return self.error(400, "missing Idempotency-Key header")

    def bad_key(self, key: str, problem: str) -> Reply:
        if problem == "too_long":
            return self.error(400, "Idempotency-Key is longer than 255 characters")
        return self.error(400, "Idempotency-Key must be printable ASCII")

    def in_progress(self, request: ApiRequest) -> Reply:
        return self.error(409, "in progress")

    def mismatch(self, request: ApiRequest) -> Reply:
        return self.error(422, "idempotency key reused with another body")


EFFECTS = EffectsServiceProfile()


class FakeEffectsService(FakeHttpApi):
    """The generic internal service on loopback; see ``outbox.testing.apis.effects``."""

    def __init__(self, *, key_retention: float | None = None) -> None:
        super().__init__(EFFECTS, key_retention=key_retention)
