"""The `http` provider's lookups against real servers on loopback: what they find, and that they
never say "not found" when they could not tell (docs/providers.md, "Lookups")."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox.config.settings import ProviderSettings
from outbox.core.model import FailureClass
from outbox.providers.answers import ResponseTooLarge
from outbox.providers.base import (
    Failed,
    Found,
    LookupRequest,
    NotFound,
    SendRequest,
    Succeeded,
    Verdict,
)
from outbox.providers.http.lookup import LookupFailed
from outbox.providers.http.provider import HttpProvider
from outbox.providers.registry import build_providers
from outbox.testing.apis import FakeEffectsService
from outbox.testing.http_api import ApiFault
from tests.support.cli import outbox_cli
from tests.support.dispatch import enqueue_many
from tests.support.recipes import toml_document

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
KEPT = timedelta(days=7)


def provider(base_url: str, lookup: Mapping[str, Any], **action: Any) -> HttpProvider:
    table = {"path": "/v1/effects", "lookup": dict(lookup), **action}
    options = {
        "base_url": base_url,
        "key": {"header": "Idempotency-Key", "quoting": "sf-string"},
        "actions": {"post_effect": table},
        "max_response_bytes": 64 * 1024,
    }
    ps = ProviderSettings("svc", "http", key_retention=KEPT, options=options)
    built = build_providers({"svc": ps}, {})["svc"]
    assert isinstance(built, HttpProvider)
    return built


BY_KEY = {"path": "/v1/effects?key={key}", "state": "/status", "done": ["done"]}


def ask(
    p: HttpProvider,
    keys: set[str],
    *,
    sent_ago: timedelta = timedelta(hours=1),
    payload: Mapping[str, Any] | None = None,
) -> Found | NotFound:
    current = sorted(keys)[-1]
    request = LookupRequest(
        action="post_effect",
        operation_id=1,
        idempotency_key=current,
        keys=frozenset(keys),
        first_sent_at=NOW - sent_ago,
        last_attempt_at=NOW - sent_ago,
        search_until=NOW,
        checked_now=NOW,
        payload=payload or {},
    )

    async def go() -> Found | NotFound:
        try:
            return await p.lookup(request)
        finally:
            await p.aclose()

    return asyncio.run(go())


def send(p: HttpProvider, key: str) -> str:
    request = SendRequest(1, "acme", "t", "k", "post_effect", {"n": 1}, key, None, 1, '{"n": 1}')

    async def go() -> Any:
        try:
            return await p.send(request)
        finally:
            await p.aclose()

    result = asyncio.run(go())
    assert isinstance(result, Succeeded), result
    return result.reference


@pytest.fixture
def service() -> Iterator[FakeEffectsService]:
    with FakeEffectsService() as fake:
        yield fake


def test_a_lookup_finds_the_effect_under_any_key_generation(service: FakeEffectsService) -> None:
    ref = send(provider(service.url, BY_KEY), "key-1")
    found = ask(provider(service.url, BY_KEY), {"key-1", "key-1:r2"})
    assert isinstance(found, Found)
    assert (found.reference, found.verdict, found.state) == (ref, Verdict.DONE, "done")
    asked = [r.query for r in service.received if r.method == "GET"]
    assert sorted(q["key"] for q in asked) == ["key-1", "key-1:r2"]  # every generation asked


def test_a_forgotten_key_proves_nothing_once_past_the_lookups_retention(
    service: FakeEffectsService,
) -> None:
    send(provider(service.url, BY_KEY), "key-2")
    service.forget_keys()  # the service forgot it: 404, as for a key it never saw
    within = ask(provider(service.url, BY_KEY), {"key-2"}, sent_ago=KEPT - timedelta(hours=2))
    assert isinstance(within, NotFound) and within.complete  # the provider's word, in its window
    past = ask(provider(service.url, BY_KEY), {"key-2"}, sent_ago=KEPT + timedelta(hours=1))
    assert isinstance(past, NotFound) and not past.complete
    assert past.reason is not None and "proves nothing" in past.reason


@pytest.mark.parametrize(
    "fault",
    [ApiFault.status(500), ApiFault.status(503), ApiFault.status(403), ApiFault.status(429)],
)
def test_an_answer_the_lookup_does_not_name_raises(
    service: FakeEffectsService, fault: ApiFault
) -> None:
    service.inject(fault)
    with pytest.raises(Exception, match="neither found nor not found"):
        ask(provider(service.url, BY_KEY), {"key-3"})


def test_a_lookup_of_a_server_that_is_down_raises(service: FakeEffectsService) -> None:
    service.refuse_connections()
    with pytest.raises(Exception, match=r"ConnectError|connect"):
        ask(provider(service.url, BY_KEY), {"key-4"})


class Liar:
    """A server that answers every GET with what the test set: any status, any body."""

    def __init__(self) -> None:
        self.status = 200
        self.body: bytes = b"{}"
        liar = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(liar.status)
                self.send_header("Content-Length", str(len(liar.body)))
                self.end_headers()
                self.wfile.write(liar.body)

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet."""

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, body: Any, status: int = 200) -> None:
        self.status = status
        self.body = body if isinstance(body, bytes) else json.dumps(body).encode()


@pytest.fixture
def liar() -> Iterator[Liar]:
    server = Liar()
    yield server
    server.server.shutdown()
    server.server.server_close()


BY_REFERENCE = {
    "path": "/payments?reference={/reference}",
    "items": "/data",
    "match": {"at": "/reference", "is": "{/reference}"},
    "state": "/status",
    "done": ["Authorized"],
    "refused": ["Declined"],
    "absent": ["Voided"],
}
MINE = {"reference": "order-17"}


def test_a_list_that_ignores_its_filter_hands_over_no_other_operations_effect(liar: Liar) -> None:
    liar.answer({"data": [{"id": "pay_1", "reference": "order-170", "status": "Authorized"}]})
    found = ask(provider(liar.url, BY_REFERENCE), {"k"}, payload=MINE)
    # Not this operation's, and no proof of absence either: the filter was not applied.
    assert isinstance(found, NotFound) and not found.complete
    assert found.reason is not None and "another operation's object" in found.reason
    liar.answer({"data": [{"id": "pay_2", "reference": "order-17", "status": "Authorized"}]})
    mine = ask(provider(liar.url, BY_REFERENCE), {"k"}, payload=MINE)
    assert isinstance(mine, Found) and mine.reference == "pay_2"


@pytest.mark.parametrize(
    ("states", "verdict"),
    [
        (["Authorized"], Verdict.DONE),
        (["Declined"], Verdict.REFUSED),
        (["Pending"], Verdict.UNDECIDED),
        (["Declined", "Authorized"], Verdict.DONE),
        (["Voided"], None),  # the object exists; the effect did not happen
    ],
)
def test_each_state_means_what_the_table_says(
    liar: Liar, states: list[str], verdict: Verdict | None
) -> None:
    items = [{"id": f"pay_{n}", "reference": "order-17", "status": s} for n, s in enumerate(states)]
    liar.answer({"data": items})
    found = ask(provider(liar.url, BY_REFERENCE), {"k"}, payload=MINE)
    if verdict is None:
        assert isinstance(found, NotFound) and found.complete
        return
    assert isinstance(found, Found) and found.verdict is verdict
    # Two effects of one operation: the other is named, for a person to look into.
    assert len(found.duplicates) == len(states) - 1


@pytest.mark.parametrize(
    ("body", "raised", "says"),
    [
        (b"not json", LookupFailed, "not JSON"),
        ({"data": {"not": "a list"}}, LookupFailed, "no list of at most 100"),
        ({"data": [{"reference": "order-17", "status": "Done"}] * 101}, LookupFailed, "at most"),
        ({"data": ["order-17"]}, LookupFailed, "holds no objects"),
        # Over the answer cap: the bounds refuse it while it is read.
        ({"data": [{"reference": "order-17", "status": "x" * 300_000}]}, ResponseTooLarge, "bytes"),
    ],
    ids=["not-json", "no-list", "too-many", "no-objects", "too-large"],
)
def test_an_answer_the_lookup_cannot_read_raises(
    liar: Liar, body: Any, raised: type[Exception], says: str
) -> None:
    liar.answer(body)
    with pytest.raises(raised, match=says):
        ask(provider(liar.url, BY_REFERENCE), {"k"}, payload=MINE)


def test_a_found_object_with_no_identifier_is_known_by_the_key(liar: Liar) -> None:
    liar.answer({"status": "done", "id": {"an": "object"}})
    found = ask(provider(liar.url, BY_KEY), {"key-9"})
    assert isinstance(found, Found) and found.reference == "key-9"


def test_without_a_state_only_an_identified_object_is_an_effect(liar: Liar) -> None:
    """A 200 whose body is an error ({"error": "no such key"}) is no effect: it raises."""
    bare = {"path": "/v1/effects?key={key}"}
    liar.answer({"error": "no such key"})
    with pytest.raises(Exception, match="no identifier at /id"):
        ask(provider(liar.url, bare), {"key-10"})
    liar.answer({"id": "eff_3"})
    found = ask(provider(liar.url, bare), {"key-10"})
    assert isinstance(found, Found) and found.reference == "eff_3"


@pytest.mark.parametrize(
    "body",
    [
        {"data": [], "has_more": True},
        {"data": [{"reference": "x", "status": "Authorized"}], "total_count": 2},
    ],
    ids=["has-more", "total-count"],
)
def test_a_page_of_a_longer_list_proves_nothing(liar: Liar, body: Any) -> None:
    liar.answer(body)
    paged = {**BY_REFERENCE, "more": "/has_more", "total": "/total_count"}
    found = ask(provider(liar.url, paged), {"k"}, payload=MINE)
    assert isinstance(found, NotFound) and not found.complete


def test_a_not_found_that_is_no_json_is_a_proxys_and_proves_nothing(liar: Liar) -> None:
    liar.answer(b"<html>404 Not Found</html>", status=404)
    with pytest.raises(Exception, match="not JSON"):
        ask(provider(liar.url, BY_KEY), {"key-11"})


def test_a_match_on_the_key_accepts_any_generation(liar: Liar) -> None:
    """Asked once, by a payload value; the object carries the first generation's key."""
    by_value = {**BY_REFERENCE, "match": {"at": "/metadata/key", "is": "{key}"}}
    item = {"id": "pay_9", "reference": "order-17", "status": "Authorized"}
    liar.answer({"data": [{**item, "metadata": {"key": "gen-1"}}]})
    found = ask(provider(liar.url, by_value), {"gen-1", "gen-1:r2"}, payload=MINE)
    assert isinstance(found, Found) and found.reference == "pay_9"


def test_a_state_a_database_cannot_store_is_no_state(liar: Liar) -> None:
    liar.answer({"status": "do\u0000ne", "id": "eff_4"})
    found = ask(provider(liar.url, BY_KEY), {"key-12"})
    assert isinstance(found, Found) and found.verdict is Verdict.UNDECIDED and found.state is None


def test_an_action_without_a_lookup_is_left_to_a_person(
    db_url: str, tmp_path: Path, service: FakeEffectsService
) -> None:
    """The provider has a lookup, but not for this operation's action: `reconcile check` asks
    nothing and says what a person does; the operation stays reconciling, nothing is sent."""
    (op,) = enqueue_many(db_url, 1)  # provider "hook", action "invoice.paid"
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'reconciling', "
            "status_reason = 'key_window_passed'"
        )
    actions = {
        "invoice.paid": {"path": "/v1/effects"},
        "refund": {"path": "/v1/effects", "lookup": BY_KEY},
    }
    table = {"type": "http", "base_url": service.url, "actions": actions}
    config = tmp_path / "outbox.toml"
    config.write_text(toml_document({"providers": {"hook": table}}))
    env = {**os.environ, "OUTBOX_DATABASE_URL": db_url}
    asked = outbox_cli(env, "reconcile", "check", str(op), "--config", str(config))
    assert asked.returncode == 0, asked.stderr
    assert "retry --force" in asked.stdout
    assert service.received == []  # no lookup and no send
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT status::text FROM outbox.operations WHERE id = %s", (op,))
        assert row.fetchone() == ("reconciling",)


@pytest.mark.parametrize("fault", [ApiFault.reset_after_apply(), ApiFault.status(502)])
def test_retry_unknown_false_sends_what_may_have_acted_to_reconciliation(
    service: FakeEffectsService, fault: ApiFault
) -> None:
    """For a provider that keeps only successes under a key, no unknown outcome is retried."""
    p = provider(service.url, BY_KEY, retry_unknown=False)
    service.inject(fault)
    request = SendRequest(1, "acme", "t", "k", "post_effect", {"n": 1}, "key-5", None, 1, "{}")

    async def go() -> Any:
        try:
            return await p.send(request)
        finally:
            await p.aclose()

    result = asyncio.run(go())
    assert isinstance(result, Failed) and result.failure is FailureClass.UNKNOWN
    assert result.reconcile  # to reconciliation at once, never to a retry


def test_a_webhook_with_a_lookup_settles_its_own_in_doubt_operations(
    service: FakeEffectsService,
) -> None:
    """The webhook preset takes a lookup below its URL's origin, and keeps its settings."""
    options = {"url": service.url + "/v1/effects", "lookup": BY_KEY}
    ps = ProviderSettings("hook", "webhook", key_retention=KEPT, options=options)
    hook = build_providers({"hook": ps}, {})["hook"]
    assert isinstance(hook, HttpProvider) and hook.looks_up("any.event")
    ref = send(hook, "key-6")
    hook = build_providers({"hook": ps}, {})["hook"]
    assert isinstance(hook, HttpProvider)
    found = ask(hook, {"key-6"})
    assert isinstance(found, Found) and found.reference == ref
    assert service.received[0].headers["idempotency-key"] == '"key-6"'  # quoted, as always


def test_a_lookup_after_the_keys_settings_changed_proves_nothing(
    service: FakeEffectsService,
) -> None:
    """The first send went with the key quoted; the config now sends it bare, so a lookup by
    the (bare) key does not find it, and must not say it is absent."""
    first = provider(service.url, BY_KEY)
    scope = first.scope("post_effect", {})
    send(first, "key-13")
    service.forget_keys()  # as if the lookup could not find it by this key
    request_scope = scope.replace("sf-string", "none")
    found = asyncio.run(_ask_scoped(provider(service.url, BY_KEY), "key-13", request_scope))
    assert isinstance(found, NotFound) and not found.complete
    assert found.reason is not None and "changed since the first send" in found.reason


async def _ask_scoped(p: HttpProvider, key: str, scope: str) -> Found | NotFound:
    request = LookupRequest(
        action="post_effect",
        operation_id=1,
        idempotency_key=key,
        keys=frozenset({key}),
        first_sent_at=NOW - timedelta(hours=1),
        last_attempt_at=NOW - timedelta(hours=1),
        search_until=NOW,
        checked_now=NOW,
        sent_scope=scope,
    )
    try:
        return await p.lookup(request)
    finally:
        await p.aclose()
