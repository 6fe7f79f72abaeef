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

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final

import httpx

from outbox.core.durations import format_duration
from outbox.core.json_pointer import MISSING
from outbox.providers.answers import reference
from outbox.providers.base import Found, LookupRequest, NotFound, Verdict
from outbox.providers.http import wire as http_wire
from outbox.providers.http.spec import ActionSpec, LookupSpec

# The most candidates one answer may hold that are read: a list endpoint answering thousands of
# objects for one key is no answer about one operation.
MAX_CANDIDATES: Final = 100
# The most a lookup's retention is shortened by, for the clocks of outbox and the provider.
SLACK: Final = timedelta(hours=1)


class LookupFailed(Exception):
    """The provider's answer says neither found nor not found."""


@dataclass(frozen=True, slots=True)
class Asker:
    """One lookup's means: a client, the base URL, the action and the operation; ``timeout``,
    the most each of its requests may take, whole (the provider's ``timeout``; None: httpx's
    own, which bounds each read, not the answer: a header line a second never ends it)."""

    client: httpx.AsyncClient
    base: str
    spec: ActionSpec
    request: LookupRequest
    timeout: float | None = None


@dataclass(frozen=True, slots=True)
class _Candidate:
    reference: str
    verdict: Verdict | None  # None: the object exists, the effect did not happen
    state: str | None


@dataclass
class _Answers:
    """What one lookup's questions came to."""

    candidates: list[_Candidate] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    # Why a not-found would prove nothing: candidates of another operation in a list (its
    # filter ignored?), a list with more pages than the one read.
    doubts: list[str] = field(default_factory=list)


async def look_up(asker: Asker) -> Found | NotFound:
    lookup = asker.spec.lookup
    if lookup is None:
        raise LookupError("the action has no lookup")
    request, answers = asker.request, _Answers()
    for key in _keys(asker, lookup.target.uses_key):
        target = lookup.target.render(request.payload, key=key, operation_id=request.operation_id)
        answers.sources.append(f"{lookup.method} {lookup.target.text}")
        await _ask(asker, lookup, target, key, answers)
    effects = [c for c in answers.candidates if c.verdict is not None]
    if effects:
        return _found(effects)
    return _not_found(lookup, request, answers)


def _keys(asker: Asker, every: bool) -> list[str]:
    """The wire keys: of every generation that may have reached the provider (``every``), or
    the current one only, for a lookup that asks one question."""
    spec, request = asker.spec, asker.request
    stored = sorted(request.keys) or [request.idempotency_key]
    return [spec.key.wire(k) for k in stored] if every else [spec.key.wire(request.idempotency_key)]


async def _ask(asker: Asker, lookup: LookupSpec, target: str, key: str, answers: _Answers) -> None:
    if asker.request.pace is not None:
        await asker.request.pace()
    try:
        async with asyncio.timeout(asker.timeout):
            response = await asker.client.request(lookup.method, asker.base + target)
    except TimeoutError:
        raise LookupFailed(
            f"no whole answer within the provider's timeout ({asker.timeout:g} s)"
        ) from None
    status = response.status_code
    body = http_wire.json_body(response)
    if status in lookup.not_found:
        if body is None:  # a proxy's page, not the API's answer
            raise LookupFailed(f"HTTP {status} whose body is not JSON: not the API's answer?")
        return
    if status not in lookup.found:
        raise LookupFailed(f"HTTP {status}: the lookup names it neither found nor not found")
    if body is None:
        raise LookupFailed(f"HTTP {status}: the answer is not JSON")
    items = _items(lookup, body, status)
    if _more(lookup, body, len(items)):
        answers.doubts.append(f"the answer at {lookup.target.text} has more pages than one")
    for item in items:
        if _matches(lookup, item, asker, key):
            answers.candidates.append(_candidate(asker.spec, lookup, item, key))
        else:
            answers.doubts.append("the answer held another operation's object (a filter ignored?)")


def _items(lookup: LookupSpec, body: Any, status: int) -> list[Mapping[str, Any]]:
    items: Any = [body] if lookup.items is None else lookup.items.read(body)
    if not isinstance(items, list) or len(items) > MAX_CANDIDATES:
        raise LookupFailed(f"HTTP {status}: no list of at most {MAX_CANDIDATES} at {lookup.items}")
    if not all(isinstance(item, Mapping) for item in items):
        raise LookupFailed(f"HTTP {status}: the list at {lookup.items} holds no objects")
    return items


def _more(lookup: LookupSpec, body: Any, read: int) -> bool:
    """Whether the answer says there is more than the page read (``more``: a true value;
    ``total``: a count above the items read)."""
    if lookup.more is not None and lookup.more.read(body) not in (MISSING, None, False):
        return True
    total = MISSING if lookup.total is None else lookup.total.read(body)
    return isinstance(total, int) and not isinstance(total, bool) and total > read


def _matches(lookup: LookupSpec, item: Mapping[str, Any], asker: Asker, key: str) -> bool:
    """Whether a candidate is of this operation, where the lookup says how to tell: a
    ``{key}`` in ``match`` stands for any key generation of the operation."""
    if lookup.match_at is None or lookup.match is None:
        return True
    value = lookup.match_at.read(item)
    if not isinstance(value, str | int) or isinstance(value, bool):
        return False
    request = asker.request
    keys = _keys(asker, True) if lookup.match.uses_key else [key]
    expected = {
        lookup.match.render(request.payload, key=k, operation_id=request.operation_id, escape=False)
        for k in keys
    }
    return str(value) in expected


def _candidate(
    spec: ActionSpec, lookup: LookupSpec, item: Mapping[str, Any], key: str
) -> _Candidate:
    pointer = lookup.reference or spec.reference
    ref = reference(pointer.read(item))
    if lookup.state is None:
        # Nothing but the status says it is an object: without an identifier, an error body
        # ({"error": "no such key"}) would pass for the effect.
        if ref is None:
            raise LookupFailed(f"the answer has no identifier at {pointer}")
        return _Candidate(ref, Verdict.DONE, None)
    state = reference(lookup.state.read(item))  # a word: printable, bounded, or none
    ref = ref or key
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


def _trusted(retention: timedelta) -> timedelta:
    """How long after the first send a not-found is the provider's word: its retention, less a
    tenth of it (at most an hour) for the clocks of both sides."""
    return retention - min(retention / 10, SLACK)


def _not_found(lookup: LookupSpec, request: LookupRequest, answers: _Answers) -> NotFound:
    since, until = request.first_sent_at, request.search_until
    sources = tuple(dict.fromkeys(answers.sources))
    if answers.doubts:
        reason = "; ".join(dict.fromkeys(answers.doubts)) + ": not finding it proves nothing"
        return NotFound(sources, since, until, complete=False, reason=reason)
    retention = lookup.retention
    if retention is not None and request.checked_now - request.first_sent_at > _trusted(retention):
        reason = (
            f"the provider keeps what this lookup finds by for {format_duration(retention)}, "
            "and the first send is about as old or older: not finding it proves nothing"
        )
        return NotFound(sources, since, until, complete=False, reason=reason)
    return NotFound(sources, since, until)
