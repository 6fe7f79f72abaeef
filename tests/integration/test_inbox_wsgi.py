"""The inbox's WSGI twin: InboxWSGIMiddleware around a real Flask app, served by werkzeug's
threaded server on loopback and driven over HTTP, on a real PostgreSQL (issue 40).

Each test counts the handler's effects (rows of ``effects``, written on the delivery's
connection) and the inbox's records after the fact, as tests/integration/test_inbox.py does for
the ASGI middleware.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import httpx
import psycopg
import pytest
from flask import Flask, Response, request
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool
from werkzeug.serving import WSGIRequestHandler, make_server

from outbox.inbox import InboxWSGIMiddleware, SyncInbox, wsgi_delivery
from tests.integration.test_inbox import EFFECTS, setup_effects
from tests.support.invoice_worker import count, wait_for

RECORDS = "SELECT count(*) FROM outbox.inbox"
COMPLETED = "SELECT count(*) FROM outbox.inbox WHERE state = 'completed'"

Answer = Callable[[], Response]


class _Quiet(WSGIRequestHandler):
    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # a line per request would bury the test's own output


@pytest.fixture
def pool(db_url: str) -> Iterator[ConnectionPool[Any]]:
    setup_effects(db_url)
    with ConnectionPool(db_url, min_size=1, max_size=8, open=True) as opened:
        yield opened


def flask_app(answer: Answer, delay: float = 0.0) -> Flask:
    """A route that writes one effect on the delivery's connection, then answers ``answer``."""
    app = Flask(__name__)

    @app.post("/work")
    def work() -> Response:
        d = wsgi_delivery(request)
        assert d.conn is not None
        d.conn.execute(
            "INSERT INTO effects (tenant_id, key, body) VALUES (%s, %s, %s)",
            (d.identity.tenant_id, d.identity.key, request.get_data(as_text=True)),
        )
        time.sleep(delay)
        return answer()

    return app


def wrapped(app: Flask, inbox: SyncInbox, **options: Any) -> Flask:
    # Flask's own idiom for WSGI middleware: the app stays a Flask app.
    app.wsgi_app = InboxWSGIMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, inbox=inbox, routes={"POST /work": "work"}, **options
    )
    return app


@contextmanager
def serving(app: Flask) -> Iterator[str]:
    """``app`` under werkzeug's threaded server on a free loopback port; its base URL."""
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(10)
        server.server_close()


def headers(key: str | None, tenant: str | None = "acme") -> dict[str, str]:
    sent = {"Content-Type": "application/json"}
    if key is not None:
        sent["Idempotency-Key"] = key
    if tenant is not None:
        sent["Outbox-Tenant-Id"] = tenant
    return sent


def send(
    url: str,
    key: str | None,
    body: object,
    tenant: str | None = "acme",
    client: httpx.Client | None = None,
) -> httpx.Response:
    # One client shared by the threads of a burst: a client of its own each takes long enough to
    # make (its TLS context) to spread the burst out.
    post = client.post if client is not None else httpx.post
    return post(f"{url}/work", content=json.dumps(body), headers=headers(key, tenant), timeout=30)


def created() -> Response:
    answer = Response(b'{"ok": true}', status=201, content_type="application/json")
    answer.headers["Location"] = "/work/1"
    answer.set_cookie("session", "secret")
    return answer


def test_a_delivery_is_handled_once_and_every_repeat_replays_it_byte_for_byte(
    db_url: str, pool: ConnectionPool[Any]
) -> None:
    """The repeat gets the status, the kept headers and the body of the first answer, marked
    as a replay, also when its body comes chunked (no Content-Length); no cookie is replayed."""
    with serving(wrapped(flask_app(created), SyncInbox(pool))) as url:
        first = send(url, "k", {"n": 1, "m": 2})
        again = send(url, "k", {"m": 2, "n": 1})
        chunked = httpx.post(
            f"{url}/work",
            content=iter([b'{"n": 1,', b' "m": 2}']),
            headers=headers("k"),
            timeout=30,
        )
    assert "chunked" in chunked.request.headers.get("Transfer-Encoding", "")
    assert (first.status_code, first.headers["Outbox-Inbox-Decision"]) == (201, "new")
    assert "set-cookie" in first.headers  # the live answer is the app's own
    for replay in (again, chunked):
        assert (replay.status_code, replay.content) == (201, first.content)
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.headers["Outbox-Inbox-Decision"] == "replayed"
        assert replay.headers["Content-Type"] == first.headers["Content-Type"]
        assert replay.headers["Location"] == "/work/1"
        assert "set-cookie" not in replay.headers
    assert (count(db_url, EFFECTS), count(db_url, COMPLETED)) == (1, 1)


def test_dozens_of_duplicates_at_once_make_one_effect_and_agree(
    db_url: str, pool: ConnectionPool[Any]
) -> None:
    """50 copies of one delivery at once while the first is in its transaction: one effect,
    one record; every answer is the first one's outcome, or "in progress"."""
    with (
        serving(wrapped(flask_app(created, delay=0.5), SyncInbox(pool))) as url,
        httpx.Client(limits=httpx.Limits(max_connections=50)) as client,
        ThreadPoolExecutor(50) as senders,
    ):
        answers = list(senders.map(lambda _: send(url, "dup", {"n": 1}, client=client), range(50)))
        settled = send(url, "dup", {"n": 1})
    decisions = [a.headers["Outbox-Inbox-Decision"] for a in answers]
    first = [a for a in answers if a.headers["Outbox-Inbox-Decision"] == "new"]
    assert len(first) == 1, decisions
    for answer in answers:
        if answer.headers["Outbox-Inbox-Decision"] == "in_progress":
            assert answer.status_code == 409
            assert int(answer.headers["Retry-After"]) >= 1
        else:
            assert (answer.status_code, answer.content) == (201, first[0].content)
    assert (settled.status_code, settled.headers["Idempotent-Replayed"]) == (201, "true")
    assert (count(db_url, EFFECTS), count(db_url, COMPLETED)) == (1, 1)


def test_duplicates_wait_for_the_first_without_holding_a_pooled_connection(
    db_url: str,
) -> None:
    """20 duplicates arrive while the first delivery is in its handler, which looks at the pool
    once all of them came in: one connection lent, the first's, and nobody waiting for one.
    Then every duplicate replays."""
    setup_effects(db_url)
    arrivals: list[str] = []
    entered = threading.Event()
    seen: dict[str, int] = {}
    with ConnectionPool(db_url, min_size=2, max_size=2) as small:

        def answer() -> Response:
            entered.set()
            wait_for(lambda: len(arrivals) == 21, 20, "the duplicates")
            time.sleep(0.5)  # for each to get as far as it goes before it waits
            seen.update(small.get_stats())
            return created()

        app = wrapped(flask_app(answer), SyncInbox(small, wait=timedelta(seconds=20)))
        inner = app.wsgi_app

        def counted(environ: dict[str, Any], start_response: Any) -> Any:
            arrivals.append(environ["PATH_INFO"])
            return inner(environ, start_response)

        app.wsgi_app = counted  # type: ignore[method-assign]
        with (
            serving(app) as url,
            httpx.Client(timeout=60) as client,
            ThreadPoolExecutor(21) as senders,
        ):
            held = senders.submit(send, url, "dup", {"n": 1}, client=client)
            assert entered.wait(10), "the first delivery reached no handler"
            duplicates = list(
                senders.map(lambda _: send(url, "dup", {"n": 1}, client=client), range(20))
            )
            first = held.result()
    assert seen["pool_size"] - seen["pool_available"] == 1, seen
    assert seen["requests_waiting"] == 0, seen
    assert first.headers["Outbox-Inbox-Decision"] == "new"
    said = [(a.status_code, a.headers["Outbox-Inbox-Decision"]) for a in duplicates]
    assert set(said) == {(201, "replayed")}, said
    assert (count(db_url, EFFECTS), count(db_url, COMPLETED)) == (1, 1)


def test_a_duplicate_waits_at_most_wait_then_hears_in_progress(
    db_url: str, pool: ConnectionPool[Any]
) -> None:
    """The first delivery holds its transaction for 1.5 s; a duplicate waits for it in process
    only ``wait`` (300 ms), then hears 409 with Retry-After, and the first still commits."""
    inbox = SyncInbox(pool, wait=timedelta(milliseconds=300))
    with (
        serving(wrapped(flask_app(created, delay=1.5), inbox)) as url,
        ThreadPoolExecutor(1) as sender,
    ):
        held = sender.submit(send, url, "k", {})
        time.sleep(0.3)  # the first is in its handler
        started = time.monotonic()
        waiting = send(url, "k", {})
        waited = time.monotonic() - started
        first = held.result()
    assert (waiting.status_code, waiting.headers["Retry-After"]) == (409, "1")
    assert waiting.headers["Outbox-Inbox-Decision"] == "in_progress"
    assert waited < 1.0, waited
    assert first.headers["Outbox-Inbox-Decision"] == "new"
    assert (count(db_url, EFFECTS), count(db_url, COMPLETED)) == (1, 1)


def test_the_same_key_with_another_body_is_a_conflict_and_never_runs(
    db_url: str, pool: ConnectionPool[Any]
) -> None:
    with serving(wrapped(flask_app(created), SyncInbox(pool))) as url:
        first = send(url, "k", {"amount": 100})
        changed = send(url, "k", {"amount": 999})
        changed_again = send(url, "k", {"amount": 999})
    assert first.status_code == 201
    assert [changed.status_code, changed_again.status_code] == [422, 422]
    assert changed.headers["Outbox-Inbox-Decision"] == "conflict"
    assert count(db_url, EFFECTS) == 1
    assert count(db_url, "SELECT sum(seen) FROM outbox.inbox_conflicts") == 2


def test_a_delivery_without_key_or_tenant_is_refused_and_records_nothing(
    db_url: str, pool: ConnectionPool[Any]
) -> None:
    with serving(wrapped(flask_app(created), SyncInbox(pool))) as url:
        no_key = send(url, None, {})
        no_tenant = send(url, "k", {}, tenant=None)
        not_json = httpx.post(f"{url}/work", content=b'{"n": ', headers=headers("k"))
        elsewhere = httpx.post(f"{url}/other", content=b"{}", headers=headers("k"))
    answers = [a.status_code for a in (no_key, no_tenant, not_json)]
    assert answers == [400, 400, 400]
    assert elsewhere.status_code == 404  # an undeclared route is the app's
    assert (count(db_url, EFFECTS), count(db_url, RECORDS)) == (0, 0)


def test_a_raise_or_a_5xx_records_nothing_and_the_redelivery_creates_once(
    db_url: str, pool: ConnectionPool[Any]
) -> None:
    """A raise that Flask turns into its own 500, one it lets through (PROPAGATE_EXCEPTIONS) and
    a 503: nothing recorded, nothing written; the redelivery is new, once. Every pooled
    connection goes back as the pool gave it."""
    behaviour = {"now": "raise"}

    def answer() -> Response:
        if behaviour["now"] == "raise":
            raise RuntimeError("the handler's bug")
        if behaviour["now"] == "busy":
            return Response(b"busy", status=503)
        return created()

    app = wrapped(flask_app(answer), SyncInbox(pool))
    with serving(app) as url:
        caught = send(url, "k", {"n": 1})
        app.config["PROPAGATE_EXCEPTIONS"] = True
        raised = send(url, "k", {"n": 1})
        behaviour["now"] = "busy"
        busy = send(url, "k", {"n": 1})
        assert (count(db_url, EFFECTS), count(db_url, RECORDS)) == (0, 0)
        behaviour["now"] = "created"
        done = send(url, "k", {"n": 1})
        again = send(url, "k", {"n": 1})
    assert caught.status_code == 500  # Flask's own error page, passed on
    assert (raised.status_code, raised.headers["Outbox-Inbox-Decision"]) == (500, "failed")
    assert (busy.status_code, busy.content) == (503, b"busy")
    assert busy.headers["Outbox-Inbox-Decision"] == "rolled_back"
    assert (done.headers["Outbox-Inbox-Decision"], again.headers["Outbox-Inbox-Decision"]) == (
        "new",
        "replayed",
    )
    assert (count(db_url, EFFECTS), count(db_url, COMPLETED)) == (1, 1)
    with pool.connection() as conn:
        assert conn.autocommit is False
        assert conn.info.transaction_status == TransactionStatus.IDLE


def test_a_commit_that_fails_is_never_answered_as_success(
    db_url: str, pool: ConnectionPool[Any]
) -> None:
    """The handler's write breaks a deferred constraint, checked only at COMMIT: the answer is a
    5xx, and neither the write nor the record exists."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE parents (id int PRIMARY KEY)")
        conn.execute(
            "CREATE TABLE children (parent int REFERENCES parents DEFERRABLE INITIALLY DEFERRED)"
        )
    app = Flask(__name__)

    @app.post("/work")
    def orphan() -> Response:
        conn = wsgi_delivery(request).conn
        assert conn is not None
        conn.execute("INSERT INTO children VALUES (1)")
        return Response(b"{}", status=201)

    with serving(wrapped(app, SyncInbox(pool))) as url:
        answer = send(url, "k", {})
    assert (answer.status_code, answer.headers["Outbox-Inbox-Decision"]) == (500, "failed")
    assert count(db_url, "SELECT count(*) FROM children") == 0
    assert count(db_url, RECORDS) == 0


def test_a_response_too_large_to_record_is_a_500_and_is_not_read_to_its_end(
    db_url: str, pool: ConnectionPool[Any]
) -> None:
    """A streamed answer of 64 chunks of 1 KiB, over a 1 KiB bound: the middleware stops
    reading past the bound and closes the app's iterable; 500, nothing written or recorded."""
    chunks = {"read": 0, "closed": False}

    def stream() -> Iterator[bytes]:
        try:
            for _ in range(64):
                chunks["read"] += 1
                yield b"x" * 1024
        finally:
            chunks["closed"] = True

    def big() -> Response:
        return Response(stream(), status=200, content_type="application/octet-stream")

    with serving(wrapped(flask_app(big), SyncInbox(pool), max_response_bytes=1024)) as url:
        answer = send(url, "k", {})
    assert answer.status_code == 500
    assert answer.headers.get_list("Outbox-Inbox-Decision") == ["rolled_back"]
    assert chunks == {"read": 2, "closed": True}
    assert (count(db_url, EFFECTS), count(db_url, RECORDS)) == (0, 0)


def test_a_body_cut_short_is_never_decided_or_handled(
    db_url: str, pool: ConnectionPool[Any]
) -> None:
    """The sender promises 23 bytes, sends 10 and stops (a body that is not JSON: nothing in
    the bytes can tell a part from the whole): no record, no effect; the whole delivery, sent
    again, is new and handled once."""
    with serving(wrapped(flask_app(created), SyncInbox(pool))) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /work HTTP/1.1\r\nHost: worker\r\nContent-Length: 23\r\n"
                b"Content-Type: application/octet-stream\r\nIdempotency-Key: k\r\n"
                b"Outbox-Tenant-Id: acme\r\nConnection: close\r\n\r\nfirst half"
            )
            sock.shutdown(socket.SHUT_WR)
            heard = sock.recv(64)
        assert heard.startswith(b"HTTP/1.1 400"), heard
        assert (count(db_url, EFFECTS), count(db_url, RECORDS)) == (0, 0)
        whole = httpx.post(
            f"{url}/work",
            content=b"first half, second half",
            headers={
                "Content-Type": "application/octet-stream",
                "Idempotency-Key": "k",
                "Outbox-Tenant-Id": "acme",
            },
        )
    assert whole.headers["Outbox-Inbox-Decision"] == "new"
    assert count(db_url, EFFECTS) == 1


def test_a_cloud_tasks_target_answers_every_final_decision_with_a_2xx(
    db_url: str, pool: ConnectionPool[Any]
) -> None:
    """As the ASGI middleware does: a recorded refusal, a conflict and a malformed delivery are
    200 with the real status beside it, in progress 429, a failure 5xx; the task name keys a
    delivery without outbox's headers."""
    behaviour = {"status": 422}

    def answer() -> Response:
        return Response(b"no", status=behaviour["status"])

    inbox = SyncInbox(pool, wait=timedelta(milliseconds=100))
    with serving(wrapped(flask_app(answer), inbox, transport="cloudtasks")) as url:
        first = send(url, "k", {"n": 1})
        again = send(url, "k", {"n": 1})
        conflict = send(url, "k", {"n": 2})
        no_key = send(url, None, {})
        by_task = httpx.post(
            f"{url}/work",
            content=b"{}",
            headers={**headers(None), "X-CloudTasks-TaskName": "t-1"},
        )
        behaviour["status"] = 503
        failed = send(url, "other", {})
        with psycopg.connect(db_url) as holder:
            holder.execute(
                "SELECT outbox.inbox_begin('acme', 'work', 'key:held', '{}', NULL, '1 s', '1 day')"
            )
            held = send(url, "held", {})
            holder.rollback()
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
    assert count(db_url, "SELECT count(*) FROM effects WHERE key = 'key:other'") == 0
