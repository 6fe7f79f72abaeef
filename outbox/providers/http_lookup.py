"""Reconciliation for `http` providers: ask the provider for an operation's effect, by its key or
by what its payload names, and read the answer as the action's lookup says (docs/providers.md,
"Lookups").

"Not found" is said only when every question was answered with a status the configuration names
as not found, and only while the provider still keeps what the lookup finds by (its
``retention``): past it, a key the provider forgot looks exactly like a key it never saw, so the
search is incomplete and a person decides. Any other answer, an unreadable one, or a transport
error raises: the check is tried again later and proves nothing meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import httpx

from outbox.durations import format_duration
from outbox.providers import http_wire
from outbox.providers.answers import reference
from outbox.providers.base import Found, LookupRequest, NotFound, Verdict
from outbox.providers.http_spec import ActionSpec, LookupSpec
from outbox.providers.json_pointer import MISSING

# The most candidates one answer may hold that are read: a list endpoint answering thousands of
# objects for one key is no answer about one operation.
MAX_CANDIDATES: Final = 100


class LookupFailed(Exception):
    """The provider's answer says neither found nor not found."""


@dataclass(frozen=True, slots=True)
class Asker:
    """One lookup's means: a client, the base URL, the action and the operation."""

    client: httpx.AsyncClient
    base: str
    spec: ActionSpec
    request: LookupRequest


@dataclass(frozen=True, slots=True)
class _Candidate:
    reference: str
    verdict: Verdict | None  # None: the object exists, the effect did not happen
    state: str | None


async def look_up(asker: Asker) -> Found | NotFound:
    lookup = asker.spec.lookup
    if lookup is None:
        raise LookupError("the action has no lookup")
    request = asker.request
    candidates: list[_Candidate] = []
    sources: list[str] = []
    for key in _keys(asker):
        target = lookup.target.render(request.payload, key=key, operation_id=request.operation_id)
        sources.append(f"{lookup.method} {lookup.target.text}")
        candidates += await _ask(asker, lookup, target, key)
    effects = [c for c in candidates if c.verdict is not None]
    if effects:
        return _found(effects)
    return _not_found(lookup, request, tuple(dict.fromkeys(sources)))


def _keys(asker: Asker) -> list[str]:
    """The wire keys to ask by: every generation that may have reached the provider, or one
    question when the lookup does not ask by key."""
    spec, request = asker.spec, asker.request
    assert spec.lookup is not None  # noqa: S101 (look_up checked)
    if not spec.lookup.target.uses_key:
        return [spec.key.wire(request.idempotency_key)]
    stored = sorted(request.keys) or [request.idempotency_key]
    return [spec.key.wire(k) for k in stored]


async def _ask(asker: Asker, lookup: LookupSpec, target: str, key: str) -> list[_Candidate]:
    if asker.request.pace is not None:
        await asker.request.pace()
    response = await asker.client.request(lookup.method, asker.base + target)
    status = response.status_code
    if status in lookup.not_found:
        return []
    if status not in lookup.found:
        raise LookupFailed(f"HTTP {status}: the lookup names it neither found nor not found")
    body = http_wire.json_body(response)
    if body is None:
        raise LookupFailed(f"HTTP {status}: the answer is not JSON")
    items: Any = [body] if lookup.items is None else lookup.items.read(body)
    if not isinstance(items, list) or len(items) > MAX_CANDIDATES:
        raise LookupFailed(f"HTTP {status}: no list of at most {MAX_CANDIDATES} at {lookup.items}")
    return [
        _candidate(asker.spec, lookup, item, key)
        for item in items
        if _matches(lookup, item, asker.request, key)
    ]


def _matches(lookup: LookupSpec, item: Any, request: LookupRequest, key: str) -> bool:
    """Whether a candidate is of this operation, where the lookup says how to tell."""
    if lookup.match_at is None or lookup.match is None:
        return True
    expected = lookup.match.render(
        request.payload, key=key, operation_id=request.operation_id, escape=False
    )
    value = lookup.match_at.read(item)
    return isinstance(value, str | int) and not isinstance(value, bool) and str(value) == expected


def _candidate(spec: ActionSpec, lookup: LookupSpec, item: Any, key: str) -> _Candidate:
    pointer = lookup.reference or spec.reference
    ref = reference(pointer.read(item)) or key
    if lookup.state is None:
        return _Candidate(ref, Verdict.DONE, None)
    raw = lookup.state.read(item)
    state = None if raw is MISSING or raw is None else str(raw)[:200]
    if state is not None and state in lookup.done:
        return _Candidate(ref, Verdict.DONE, state)
    if state is not None and state in lookup.refused:
        return _Candidate(ref, Verdict.REFUSED, state)
    if state is not None and state in lookup.absent:
        return _Candidate(ref, None, state)
    return _Candidate(ref, Verdict.UNDECIDED, state)


def _found(effects: list[_Candidate]) -> Found:
    """The best-decided effect; other effects found for the operation are its duplicates."""
    order = {Verdict.DONE: 0, Verdict.REFUSED: 1, Verdict.UNDECIDED: 2}
    ranked = sorted(effects, key=lambda c: order[c.verdict] if c.verdict else 3)
    best = ranked[0]
    others = tuple(dict.fromkeys(c.reference for c in ranked[1:] if c.reference != best.reference))
    assert best.verdict is not None  # noqa: S101 (effects have a verdict)
    details = {} if best.state is None else {"state": best.state}
    return Found(best.reference, others, best.verdict, best.state, details)


def _not_found(lookup: LookupSpec, request: LookupRequest, sources: tuple[str, ...]) -> NotFound:
    since, until = request.first_sent_at, request.search_until
    retention = lookup.retention
    if retention is not None and request.checked_now - request.first_sent_at > retention:
        reason = (
            f"the provider keeps what this lookup finds by for {format_duration(retention)}, "
            "and the first send is older: not finding it proves nothing"
        )
        return NotFound(sources, since, until, complete=False, reason=reason)
    return NotFound(sources, since, until)
