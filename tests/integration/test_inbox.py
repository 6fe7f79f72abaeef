"""The inbox in process: InboxMiddleware around a small Starlette app on a real PostgreSQL, and
the SQL functions of sql/0042 under the worker's own role (issue 40).

Each test counts the handler's effects (rows of ``effects``, written on the delivery's
connection) and the inbox's records after the fact.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, MutableMapping
from datetime import timedelta
from typing import Any, Literal, LiteralString

import httpx
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from outbox.inbox import (
    Decision,
    External,
    Identity,
    Inbox,
    InboxMiddleware,
    NoOutcome,
    claimed,
    delivery,
)
from tests.integration.test_roles import WORKER, apply_roles, as_role
from tests.support.invoice_worker import count

EFFECTS = "SELECT count(*) FROM effects"
CREATE_EFFECTS = "CREATE TABLE effects (id serial PRIMARY KEY, tenant_id text, key text, body text)"

Answer = Callable[[Request], Response]


def setup_effects(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(CREATE_EFFECTS)
        conn.execute("GRANT ALL ON effects, effects_id_seq TO PUBLIC")


@pytest.fixture
async def pool(db_url: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    setup_effects(db_url)
    async with AsyncConnectionPool(db_url, min_size=1, max_size=8, open=False) as opened:
        yield opened


def app_with(
    inbox: Inbox,
    answer: Answer,
    delay: float = 0.0,
    *,
    external: bool = False,
    fails: Callable[[], bool] = lambda: False,
    **options: Any,
) -> InboxMiddleware:
    """A route that writes one effect on the delivery's connection (``external``: on its
    claim's final transaction, as an External route), then answers ``answer``, or raises when
    ``fails()`` says so."""

    async def handle(request: Request) -> Response:
        if external:
            conn = await claimed(request).transaction()
            identity = claimed(request).identity
        else:
            d = delivery(request)
            assert d.conn is not None
            conn, identity = d.conn, d.identity
        body = (await request.body()).decode()
        await conn.execute(
            "INSERT INTO effects (tenant_id, key, body) VALUES (%s, %s, %s)",
            (identity.tenant_id, identity.key, body),
        )
        if delay:
            await asyncio.sleep(delay)
        if fails():
            raise RuntimeError("the handler failed after its write")
        return answer(request)

    starlette = Starlette(routes=[Route("/work", handle, methods=["POST"])])
    route = External("work") if external else "work"
    return InboxMiddleware(starlette, inbox=inbox, routes={"POST /work": route}, **options)


def client(app: InboxMiddleware) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker")


def send(c: httpx.AsyncClient, key: str, body: object, tenant: str = "acme") -> Any:
    headers = {
        "Content-Type": "application/json",
        "Idempotency-Key": key,
        "Outbox-Tenant-Id": tenant,
    }
    return c.post("/work", content=json.dumps(body), headers=headers)


def created(request: Request) -> Response:
    return Response(b'{"ok": true}', status_code=201, media_type="application/json")


async def test_a_5xx_or_a_raise_records_nothing_and_undoes_the_handlers_writes(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    inbox = Inbox(pool)

    def unavailable(request: Request) -> Response:
        return Response(b"busy", status_code=503)

    def broken(request: Request) -> Response:
        raise RuntimeError("the handler's bug")

    async with client(app_with(inbox, unavailable)) as c:
        busy = await send(c, "k", {"n": 1})
    async with client(app_with(inbox, broken)) as c:
        failed = await send(c, "k", {"n": 1})
    assert (busy.status_code, busy.content) == (503, b"busy")
    assert failed.status_code == 500
    assert (count(db_url, EFFECTS), count(db_url, "SELECT count(*) FROM outbox.inbox")) == (0, 0)
    async with client(app_with(inbox, created)) as c:
        done = await send(c, "k", {"n": 1})
        again = await send(c, "k", {"n": 1})
    assert (done.status_code, again.headers["Outbox-Inbox-Decision"]) == (201, "replayed")
    assert count(db_url, EFFECTS) == 1


async def test_a_commit_that_fails_is_never_answered_as_success(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """The handler's writes break a deferred constraint, checked only at COMMIT: the answer is
    a 5xx, and neither the write nor the record exists."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE parents (id int PRIMARY KEY)")
        conn.execute(
            "CREATE TABLE children (parent int REFERENCES parents DEFERRABLE INITIALLY DEFERRED)"
        )

    async def orphan(request: Request) -> Response:
        d = delivery(request)
        assert d.conn is not None
        await d.conn.execute("INSERT INTO children VALUES (1)")
        return Response(b"{}", status_code=201)

    starlette = Starlette(routes=[Route("/work", orphan, methods=["POST"])])
    app = InboxMiddleware(starlette, inbox=Inbox(pool), routes={"POST /work": "work"})
    async with client(app) as c:
        answer = await send(c, "k", {})
    assert answer.status_code == 500
    assert count(db_url, "SELECT count(*) FROM children") == 0
    assert count(db_url, "SELECT count(*) FROM outbox.inbox") == 0


async def test_a_cloud_tasks_target_answers_every_final_decision_with_a_2xx(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """Cloud Tasks retries every answer but a 2xx: a recorded refusal, a conflict and a
    malformed delivery are 200 (the real status beside it), in progress 429, a failure 5xx."""
    inbox = Inbox(pool, wait=timedelta(milliseconds=100))

    def refused(request: Request) -> Response:
        return Response(b"no", status_code=422)

    def unavailable(request: Request) -> Response:
        return Response(b"busy", status_code=503)

    async with client(app_with(inbox, refused, transport="cloudtasks")) as c:
        first = await send(c, "k", {"n": 1})
        again = await send(c, "k", {"n": 1})
        conflict = await send(c, "k", {"n": 2})
        no_key = await c.post("/work", content=b"{}", headers={"Outbox-Tenant-Id": "acme"})
        by_task = await c.post(
            "/work",
            content=b"{}",
            headers={
                "Outbox-Tenant-Id": "acme",
                "X-CloudTasks-TaskName": "t-1",
                "Content-Type": "application/json",
            },
        )
    async with client(app_with(inbox, unavailable, transport="cloudtasks")) as c:
        failed = await send(c, "other", {})
    holder = await psycopg.AsyncConnection.connect(db_url)
    await holder.execute(
        "SELECT outbox.inbox_begin('acme', 'work', 'key:held', '{}', NULL, '1 s', '1 day')"
    )
    async with client(app_with(inbox, refused, transport="cloudtasks")) as c:
        held = await send(c, "held", {})
    await holder.rollback()
    await holder.close()
    answers = [
        (a.status_code, a.headers.get("Outbox-Inbox-Status"))
        for a in (first, again, conflict, no_key, by_task, failed, held)
    ]
    assert answers == [
        (200, "422"),
        (200, "422"),
        (200, "422"),
        (200, "400"),
        (200, "422"),
        (503, None),
        (429, None),
    ]
    assert count(db_url, "SELECT count(*) FROM outbox.inbox WHERE key = 'task:t-1'") == 1
    assert count(db_url, "SELECT count(*) FROM outbox.inbox_conflicts") == 1


async def test_a_replay_keeps_no_cookie_or_credential_even_when_asked_to(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    def with_headers(request: Request) -> Response:
        answer = Response(b"{}", status_code=201, media_type="application/json")
        answer.headers["Location"] = "/invoices/7"
        answer.headers["X-Trace"] = "abc"
        answer.headers["WWW-Authenticate"] = "Basic"
        answer.set_cookie("session", "secret")
        return answer

    app = app_with(Inbox(pool), with_headers, keep_headers=frozenset({"x-trace", "set-cookie"}))
    async with client(app) as c:
        first = await send(c, "k", {})
        replay = await send(c, "k", {})
    assert "set-cookie" in first.headers  # the live answer is the app's own
    assert replay.headers["location"] == "/invoices/7"
    assert replay.headers["x-trace"] == "abc"
    assert "set-cookie" not in replay.headers
    assert "www-authenticate" not in replay.headers
    stored = count(
        db_url,
        "SELECT count(*) FROM outbox.inbox, jsonb_array_elements(response_headers) h"
        " WHERE lower(h ->> 0) IN ('set-cookie', 'www-authenticate', 'authorization')",
    )
    assert stored == 0


async def test_a_response_too_large_to_record_is_a_500_and_undoes_the_handler(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    def big(request: Request) -> Response:
        return Response(b"x" * 1025, status_code=200)

    async with client(app_with(Inbox(pool), big, max_response_bytes=1024)) as c:
        answer = await send(c, "k", {})
    assert answer.status_code == 500
    assert answer.headers.get_list("Outbox-Inbox-Decision") == ["rolled_back"]
    assert (count(db_url, EFFECTS), count(db_url, "SELECT count(*) FROM outbox.inbox")) == (0, 0)


async def test_a_body_postgresql_cannot_store_is_refused_and_records_nothing(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """A lone surrogate, a NUL escape: PostgreSQL refuses them as jsonb, so 400, not 500."""
    bodies = [b'{"\\ud800": 1}', b'{"a": "\\u0000"}']
    async with client(app_with(Inbox(pool), created)) as c:
        answers = [
            await c.post(
                "/work",
                content=body,
                headers={
                    "Content-Type": "application/json",
                    "Idempotency-Key": f"k{i}",
                    "Outbox-Tenant-Id": "acme",
                },
            )
            for i, body in enumerate(bodies)
        ]
    assert [a.status_code for a in answers] == [400, 400]
    assert (count(db_url, EFFECTS), count(db_url, "SELECT count(*) FROM outbox.inbox")) == (0, 0)


async def test_a_delivery_cut_short_is_never_decided_or_handled(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """The sender hangs up after the first part of a body that is not JSON (nothing in the
    bytes can tell a part from the whole): no record, no effect; the whole delivery, sent
    again, is new and handled once."""
    app = app_with(Inbox(pool), created)
    scope = {
        "type": "http", "method": "POST", "path": "/work", "query_string": b"",
        "headers": [(b"content-type", b"application/octet-stream"),
                    (b"idempotency-key", b"k"), (b"outbox-tenant-id", b"acme")],
    }  # fmt: skip
    parts: list[dict[str, Any]] = [
        {"type": "http.request", "body": b"first half", "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        return parts.pop(0)

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    assert sent[0]["status"] == 400
    assert (count(db_url, EFFECTS), count(db_url, "SELECT count(*) FROM outbox.inbox")) == (0, 0)
    async with client(app) as c:
        whole = await c.post(
            "/work", content=b"first half, second half",
            headers={"Content-Type": "application/octet-stream", "Idempotency-Key": "k",
                     "Outbox-Tenant-Id": "acme"},
        )  # fmt: skip
    assert whole.headers["Outbox-Inbox-Decision"] == "new"
    assert count(db_url, EFFECTS) == 1


async def test_a_new_delivery_that_records_no_outcome_is_rolled_back(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    inbox = Inbox(pool)

    async def forgetful_handler() -> None:
        async with inbox.deliver(Identity("acme", "work", "key:k"), b"{}", is_json=True) as d:
            assert d.decision is Decision.NEW and d.conn is not None
            await d.conn.execute("INSERT INTO effects (key) VALUES ('k')")

    with pytest.raises(NoOutcome):
        await forgetful_handler()
    assert (count(db_url, EFFECTS), count(db_url, "SELECT count(*) FROM outbox.inbox")) == (0, 0)


def test_a_commit_without_an_outcome_is_refused_by_the_database(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "SELECT outbox.inbox_begin('acme', 'work', 'key:k', '{}', NULL, '1 s', '1 day')"
        )
        with pytest.raises(psycopg.Error) as raised:
            conn.commit()
    assert raised.value.sqlstate == "OB006"
    assert count(db_url, "SELECT count(*) FROM outbox.inbox") == 0


async def test_a_duplicate_waits_at_most_wait_then_hears_in_progress(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """Another process holds the identity in an open transaction: the duplicate's wait in
    PostgreSQL is bounded by ``wait``; once the holder rolls back, the next delivery is new."""
    holder = await psycopg.AsyncConnection.connect(db_url)
    await holder.execute(
        "SELECT outbox.inbox_begin('acme', 'work', 'key:k', '{}', NULL, '1 s', '1 day')"
    )
    inbox = Inbox(pool, wait=timedelta(milliseconds=300))
    started = time.monotonic()
    async with client(app_with(inbox, created)) as c:
        waiting = await asyncio.wait_for(send(c, "k", {}), 5)
        waited = time.monotonic() - started
        await holder.rollback()
        await holder.close()
        after = await send(c, "k", {})
    assert (waiting.status_code, waiting.headers["Retry-After"]) == (409, "1")
    assert 0.25 <= waited < 2.0, waited
    assert after.headers["Outbox-Inbox-Decision"] == "new"
    assert count(db_url, EFFECTS) == 1


@pytest.mark.parametrize("external", [False, True], ids=["transaction", "external"])
async def test_a_seeded_storm_of_duplicates_and_conflicts_makes_one_effect_per_identity(
    db_url: str, pool: AsyncConnectionPool[Any], external: bool
) -> None:
    """40 identities, each delivered 1 to 6 times at once, some copies with another body, by
    two inboxes (two processes' worth of single flight), a tenth of the handlers' runs failing
    after their write; then each original again until it is answered. Every identity ends with
    exactly one effect, whose body is the body of the one delivery that recorded it; in both
    modes."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    apps = [
        app_with(
            Inbox(pool),
            created,
            delay=rng.random() * 0.05,
            external=external,
            fails=lambda: rng.random() < 0.1,
        )
        for _ in range(2)
    ]
    deliveries = []
    for i in range(40):
        original = {"id": i, "amount": rng.randrange(10**6)}
        for _ in range(rng.randint(1, 6)):
            body = original if rng.random() < 0.8 else {**original, "amount": -1}
            deliveries.append((f"id-{i}", body, rng.choice(apps)))
    rng.shuffle(deliveries)
    clients = {id(app): client(app) for app in apps}
    answers = await asyncio.gather(
        *(send(clients[id(app)], key, body) for key, body, app in deliveries)
    )
    said = f"seed {seed}, {'external' if external else 'transaction'} mode"
    statuses = {
        "new": 201,
        "reclaimed": 201,
        "replayed": 201,
        "conflict": 422,
        "in_progress": 409,
        "failed": 500,
    }
    for answer in answers:
        decision = answer.headers["Outbox-Inbox-Decision"]
        assert answer.status_code == statuses.get(decision), (said, decision)
    decided = list(zip(deliveries, answers, strict=True))
    winners = {
        key: body
        for (key, body, _), a in decided
        if a.headers["Outbox-Inbox-Decision"] in ("new", "reclaimed")
    }
    # In external mode a claim whose handler failed stays, with its body: an identity nobody won
    # is answered again only with that body (any other is a conflict). In transaction mode a
    # failure rolls its record back, and that body is as good as any.
    claimed = {
        key: body for (key, body, _), a in decided if a.headers["Outbox-Inbox-Decision"] == "failed"
    }
    for i in range(40):
        key = f"id-{i}"
        body = winners.get(key) or claimed.get(key) or next(b for k, b, _ in deliveries if k == key)
        for _ in range(50):
            answer = await send(clients[id(apps[0])], key, body)
            if answer.headers["Outbox-Inbox-Decision"] not in ("in_progress", "failed"):
                break
        assert answer.status_code == 201, (said, key)
        winners.setdefault(key, body)
    for c in clients.values():
        await c.aclose()
    with psycopg.connect(db_url) as conn:
        effects = conn.execute("SELECT key, body FROM effects").fetchall()
    assert sorted(k for k, _ in effects) == sorted(f"key:id-{i}" for i in range(40)), said
    for key, body in effects:
        winner = winners.get(key.removeprefix("key:"))
        if winner is not None:
            assert json.loads(body) == winner, (said, key)


# jsonb stores no U+0000 and no lone surrogate: such a body is refused (a test below), not a
# spelling of anything.
SURROGATES: tuple[Literal["Cs"]] = ("Cs",)
NO_NUL = st.characters(exclude_characters="\x00", exclude_categories=SURROGATES)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(NO_NUL, max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(NO_NUL, max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    body=st.dictionaries(st.text(NO_NUL, max_size=6), json_values, min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_any_spelling_of_the_same_json_replays_and_any_change_conflicts(
    db_url: str, body: dict[str, Any], seed: int
) -> None:
    """The digest is jsonb's canonical text, as enqueue's fingerprint reads a payload: key
    order and spacing never make a conflict; another value always does."""
    rng = random.Random(seed)
    key = f"key:{uuid.uuid4()}"  # the database is the test's, shared by every example
    items = list(body.items())
    rng.shuffle(items)
    respelled = json.dumps(
        dict(items), indent=rng.choice([None, 1, 4]), ensure_ascii=rng.random() < 0.5
    )
    changed = json.dumps({**body, next(iter(body)): ["changed", rng.random()]})
    with psycopg.connect(db_url) as conn:
        decision, inbox_id, token = begin(conn, key, json.dumps(body))
        assert decision == "new"
        conn.execute("SELECT outbox.inbox_complete(%s, %s, 200, '[]', '')", (inbox_id, token))
        conn.commit()
        assert begin(conn, key, respelled)[0] == "replayed"
        assert begin(conn, key, changed)[0] == "conflict"
        conn.commit()


def begin(
    conn: psycopg.Connection[Any], key: str, body: str, tenant: str = "acme"
) -> tuple[Any, ...]:
    row = conn.execute(
        "SELECT decision, inbox_id, token FROM outbox.inbox_begin(%s, 'work', %s, %s, NULL,"
        " '1 s', '1 day')",
        (tenant, key, body),
    ).fetchone()
    assert row is not None
    return tuple(row)


def test_prune_deletes_only_completed_records_past_their_retention(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        for key in ("old", "young"):
            _, inbox_id, token = begin(conn, f"key:{key}", "{}")
            conn.execute("SELECT outbox.inbox_complete(%s, %s, 200, '[]', '')", (inbox_id, token))
            conn.commit()
        conn.execute(
            "UPDATE outbox.inbox SET expires_at = now() - interval '1 s' WHERE key = 'key:old'"
        )
        conn.commit()
        # A delivery under way while the prune runs: neither waits for the other.
        _, inbox_id, token = begin(conn, "key:under-way", "{}")
        with psycopg.connect(db_url, autocommit=True) as other:
            pruned = other.execute("SELECT outbox.inbox_prune(100)").fetchone()
        conn.execute("SELECT outbox.inbox_complete(%s, %s, 200, '[]', '')", (inbox_id, token))
        conn.commit()
        keys = [k for (k,) in conn.execute("SELECT key FROM outbox.inbox ORDER BY key")]
    assert pruned == (1,)
    assert keys == ["key:under-way", "key:young"]


def test_the_workers_role_records_deliveries_and_can_do_nothing_else(
    db_url: str, pg_server: str
) -> None:
    apply_roles(pg_server, db_url, tenant_rls=True)
    setup_effects(db_url)
    worker = as_role(db_url, WORKER)
    with psycopg.connect(db_url) as owner:  # tenant beta's record, unbound: the owner sees all
        _, beta_id, beta_token = begin(owner, "key:b", "{}", tenant="beta")
        owner.execute("SELECT outbox.inbox_complete(%s, %s, 200, '[]', '')", (beta_id, beta_token))
        owner.commit()
    with psycopg.connect(worker) as conn:
        decision, inbox_id, token = begin(conn, "key:a", "{}")
        assert decision == "new"
        # Another tenant's record is invisible to a transaction bound to acme, token or not.
        other = conn.execute(
            "SELECT outbox.inbox_complete(%s, %s, 200, '[]', '')", (beta_id, beta_token)
        ).fetchone()
        stale = conn.execute(
            "SELECT outbox.inbox_complete(%s, gen_random_uuid(), 200, '[]', '')", (inbox_id,)
        ).fetchone()
        assert (other, stale) == ((False,), (False,))
        with pytest.raises(psycopg.Error) as five_xx:
            conn.execute("SELECT outbox.inbox_complete(%s, %s, 500, '[]', '')", (inbox_id, token))
        assert five_xx.value.sqlstate == "22023"
        conn.rollback()
        refused = {}
        queries: dict[str, LiteralString] = {
            "read": "SELECT * FROM outbox.inbox",
            "delete": "DELETE FROM outbox.inbox",
            "update": "UPDATE outbox.inbox SET state = 'completed'",
            "conflicts": "SELECT * FROM outbox.inbox_conflicts",
            "enqueue": "SELECT * FROM outbox.enqueue('acme', 't', 'k', 'hook', 'a', '{}'::jsonb)",
        }
        for name, query in queries.items():
            try:
                conn.execute(query)
            except psycopg.Error as exc:
                refused[name] = exc.sqlstate
            conn.rollback()
        assert set(refused.values()) == {"42501"} and len(refused) == 5, refused
        _, inbox_id, token = begin(conn, "key:a", "{}")
        conn.execute("INSERT INTO effects (key) VALUES ('a')")
        conn.execute("SELECT outbox.inbox_complete(%s, %s, 201, '[]', 'ok')", (inbox_id, token))
        conn.commit()
    with psycopg.connect(worker) as conn:  # an external claim binds its transaction as well
        conn.execute(
            "SELECT decision FROM outbox.inbox_claim('acme', 'work', 'key:c', '{}', NULL,"
            " '30 s', 5, '1 day')"
        )
        bound = conn.execute("SELECT current_setting('outbox.tenant_id', true)").fetchone()
        assert bound == ("acme",)
        conn.rollback()
    assert count(db_url, "SELECT count(*) FROM outbox.inbox WHERE state = 'completed'") == 2
    assert count(db_url, EFFECTS) == 1


@pytest.mark.parametrize("seed", [7, 1913])
def test_a_flood_of_other_bodies_under_one_key_keeps_a_bounded_count(
    db_url: str, seed: int
) -> None:
    """A sender that changes its body on every try (a timestamp in the payload, or one built to
    hurt) adds at most 32 distinct rows and one overflow row per record, whatever it sends;
    the total seen stays exact and the record keeps its first outcome (sql/0043)."""
    rng = random.Random(seed)
    bodies = [json.dumps({"n": rng.randrange(40), "at": i // 3}) for i in range(300)]
    with psycopg.connect(db_url) as conn:
        _, inbox_id, token = begin(conn, "key:flood", json.dumps({"first": True}))
        conn.execute("SELECT outbox.inbox_complete(%s, %s, 201, '[]', 'one')", (inbox_id, token))
        conn.commit()
        decisions = [begin(conn, "key:flood", body)[0] for body in bodies]
        conn.commit()
        rows = conn.execute(
            "SELECT count(*), sum(seen), count(*) FILTER (WHERE body_digest = '') "
            "FROM outbox.inbox_conflicts WHERE inbox_id = %s",
            (inbox_id,),
        ).fetchone()
        stored = conn.execute(
            "SELECT response_status, response_body FROM outbox.inbox WHERE id = %s", (inbox_id,)
        ).fetchone()
    assert set(decisions) == {"conflict"}
    distinct = len(set(bodies))
    assert rows == (min(distinct, 32) + (distinct > 32), len(bodies), int(distinct > 32))
    assert stored == (201, b"one")
