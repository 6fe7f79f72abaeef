"""How the reconciler finds what an operation did at Stripe (issue 19).

Two sources, each read within a page cap, each matching on the operation's exact keys:

* the **objects** of the action's type created in the window, narrowed by the list filters the
  payload allows (a PaymentIntent's ``customer``, a refund's ``payment_intent``...), matched on
  the metadata the send path adds: the operation id and the key;
* the **events** of their creation (``payment_intent.created``...), matched on
  ``request.idempotency_key``: Stripe lists events for 30 days, and keeps those of objects since
  deleted (a customer, a draft invoice), which drop out of the object lists.

Either source searched to its end over the whole window proves an absence; when both stop
short, the finding is undecided, with why. Never the Search API: it can lag by an hour.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import stripe

from outbox.providers.base import NotFound

METADATA_OPERATION_ID: Final = "outbox_operation_id"
METADATA_IDEMPOTENCY_KEY: Final = "outbox_idempotency_key"
LOOKUP_PAGE: Final = 100
# The most pages one source reads in one check (100 objects each): a lying server answering
# has_more for ever, or an account with more objects in the window, ends the search undecided.
LOOKUP_MAX_PAGES: Final = 10
# How long Stripe lists events; a little less, so that the oldest page is not half expired.
EVENTS_KEPT: Final = timedelta(days=30) - timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class Searchable:
    """Where an action's effect is listed: its service, the event of its creation, and the
    payload fields that are also filters of its list (same name, same meaning)."""

    service: str
    event: str | None  # None: Stripe makes no event of its creation
    filters: tuple[str, ...] = ()
    always: tuple[tuple[str, str], ...] = ()  # list parameters every search takes


LOOKUPS: Final[Mapping[str, Searchable]] = {
    "payment_intents.create": Searchable(
        "payment_intents", "payment_intent.created", ("customer",)
    ),
    "refunds.create": Searchable("refunds", "refund.created", ("payment_intent", "charge")),
    "customers.create": Searchable("customers", "customer.created", ("email",)),
    "transfers.create": Searchable(
        "transfers", "transfer.created", ("destination", "transfer_group")
    ),
    "payouts.create": Searchable("payouts", "payout.created", ("destination",)),
    "invoices.create": Searchable("invoices", "invoice.created", ("customer", "subscription")),
    # Canceled subscriptions are left out of the list without status=all.
    "subscriptions.create": Searchable(
        "subscriptions", "customer.subscription.created", ("customer",), (("status", "all"),)
    ),
    "setup_intents.create": Searchable("setup_intents", "setup_intent.created", ("customer",)),
    # Stripe makes no event of a Checkout Session's creation: its list is the only source.
    "checkout.sessions.create": Searchable("checkout.sessions", None, ("customer",)),
}


@dataclass(frozen=True, slots=True)
class Match:
    """Whether an object or event is this operation's."""

    operation_id: int
    keys: frozenset[str]
    current_key: str
    family: frozenset[str] = field(init=False)  # the current key's, hashed once per lookup

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", key_family(self.current_key))

    def key(self, key: object) -> bool:
        # The stored keys are exact; the family also covers a generation whose attempt row was
        # never written (a worker that died mid-send).
        return isinstance(key, str) and (key in self.keys or bool(key_family(key) & self.family))

    def object(self, fields: Mapping[str, Any]) -> bool:
        metadata = fields.get("metadata") or {}
        # The id alone could be another database's operation: the key must match too.
        return metadata.get(METADATA_OPERATION_ID) == str(self.operation_id) and self.key(
            metadata.get(METADATA_IDEMPOTENCY_KEY)
        )

    def event(self, fields: Mapping[str, Any]) -> bool:
        request = fields.get("request") or {}
        if not isinstance(request, Mapping) or not self.key(request.get("idempotency_key")):
            return False
        data = fields.get("data") or {}
        obj = data.get("object") if isinstance(data, Mapping) else None
        metadata = (obj.get("metadata") if isinstance(obj, Mapping) else None) or {}
        named = metadata.get(METADATA_OPERATION_ID)
        return named is None or named == str(self.operation_id)


@dataclass(frozen=True, slots=True)
class Stripe:
    """The client a lookup reads through, in the API version of the operation's first send."""

    client: stripe.StripeClient
    version: str
    account: str | None  # the connected account the operation was sent for (None: the platform)
    pace: Callable[[], Awaitable[None]] | None = None  # the provider's rate limit

    async def _paced(self) -> None:
        if self.pace is not None:
            await self.pace()

    def service(self, name: str) -> Any:
        service = self.client.v1
        for part in name.split("."):  # checkout.sessions
            service = getattr(service, part)
        return service

    @property
    def options(self) -> Any:
        return {"stripe_version": self.version, "stripe_account": self.account}

    async def list(self, service: str, params: dict[str, Any]) -> Any:
        await self._paced()
        return await self.service(service).list_async(params=params, options=self.options)

    async def retrieve(self, service: str, object_id: str) -> Any:
        await self._paced()
        return await self.service(service).retrieve_async(object_id, options=self.options)


@dataclass(slots=True)
class Searched:
    """One source's search: what it was called, its matches (oldest first), whether it ended."""

    source: str
    matches: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    complete: bool = False
    stopped: str | None = None


# The created-time window searched: (since, until), both inclusive.
Window = tuple[datetime, datetime]


async def search_objects(
    api: Stripe, searchable: Searchable, payload: Mapping[str, Any], match: Match, window: Window
) -> Searched:
    narrowing = {
        name: payload[name]
        for name in searchable.filters
        if isinstance(payload.get(name), str) and payload[name]
    }
    source = searchable.service + (f" ({', '.join(narrowing)})" if narrowing else "")
    params = {**dict(searchable.always), **narrowing}
    found = Searched(source)
    await _pages(
        api,
        searchable.service,
        params,
        window,
        found,
        pick=lambda f: f if match.object(f) else None,
    )
    return found


async def search_events(
    api: Stripe, searchable: Searchable, match: Match, window: Window
) -> Searched:
    if searchable.event is None:
        return Searched("")  # no source: Stripe makes no event of its creation
    found = Searched("events")
    if window[0] >= window[1]:
        found.complete = True
        return found

    def effect(fields: dict[str, Any]) -> dict[str, Any] | None:
        obj = (fields.get("data") or {}).get("object")
        return obj if match.event(fields) and isinstance(obj, dict) and "id" in obj else None

    await _pages(api, "events", {"type": searchable.event}, window, found, pick=effect)
    return found


async def _pages(
    api: Stripe,
    service: str,
    params: dict[str, Any],
    window: Window,
    found: Searched,
    *,
    pick: Callable[[dict[str, Any]], dict[str, Any] | None],
) -> None:
    """Read the list newest first, page by page, until it ends or LOOKUP_MAX_PAGES."""
    created = {"gte": int(window[0].timestamp()), "lte": int(window[1].timestamp())}
    params = {**params, "limit": LOOKUP_PAGE, "created": created}
    seen: set[str] = set()
    cursors: set[str] = set()
    for _ in range(LOOKUP_MAX_PAGES):
        page = await api.list(service, params)
        last = None
        for item in page.data:
            fields = item.to_dict()
            last = str(fields.get("id"))
            obj = pick(fields)
            if obj is not None and str(obj["id"]) not in seen:
                seen.add(str(obj["id"]))
                found.matches.append((str(obj["id"]), obj))
        if not page.has_more:
            found.complete = True
            break
        if last is None or last in cursors:  # a server going round in circles
            found.stopped = "the list said it had more but gave nothing new"
            break
        cursors.add(last)
        params["starting_after"] = last
    else:
        found.stopped = f"stopped after {LOOKUP_MAX_PAGES} pages of {LOOKUP_PAGE}"
    found.matches.reverse()  # lists are newest first: the earliest object is the effect


async def retrieve_object(api: Stripe, service: str, reference: str) -> dict[str, Any]:
    """The object as it is now (an event holds it as it was created); a 404 means deleted (a
    draft invoice leaves no trace but its events)."""
    try:
        obj = await api.retrieve(service, reference)
    except stripe.InvalidRequestError as exc:
        if exc.http_status != 404:
            raise
        return {"id": reference, "deleted": True}
    fields: dict[str, Any] = obj.to_dict()
    return fields


def not_found(
    objects: Searched, events: Searched, since: datetime, until: datetime, events_since: datetime
) -> NotFound:
    """Absence is proven by a source read to its end over the whole window: the objects (live
    ones only), or the events (deleted objects too, within Stripe's 30 days)."""
    sources = [objects.source]
    if events.source and events_since < until:
        sources.append("events" if events_since <= since else f"events from {_at(events_since)}")
    events_whole = events.complete and events_since <= since
    if objects.complete or events_whole:
        return NotFound(tuple(sources), since, until)
    why = "; ".join(f"{s.source}: {s.stopped}" for s in (objects, events) if s.stopped)
    return NotFound(tuple(sources), since, until, complete=False, reason=why or "incomplete")


def _at(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def key_family(key: str) -> frozenset[str]:
    """The forms every generation of one operation's key shares: the first key, and the hash
    later generations carry instead when the first key and its suffix pass Stripe's 255
    characters (outbox.key_for_generation, sql/0005: ``ob1_<sha256 of the first key>:rN``). Two
    keys are of one operation if their families meet."""
    first = re.sub(r":r[0-9]+$", "", key)
    return frozenset({first, "ob1_" + hashlib.sha256(first.encode()).hexdigest()})
