"""`outbox web` (issue 43), in process against a real PostgreSQL: who may do what (sign-in,
roles, form tokens, cross-site requests, read-only), that each page shows what the database
holds (counts, groups, pages, searches), that actions go through the CLI's functions with the
operator's name in the audit, and that no input a person or an attacker can send makes a page
fail with a 500. The browser's own tests are in test_web_browser.py."""

from __future__ import annotations

import random
import re
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg_pool import AsyncConnectionPool

from outbox.config.loader import settings_from_mapping
from outbox.core.model import Status
from outbox.providers.base import Provider
from outbox.testing.stripe import FakeStripe, StripeFault
from outbox.web import bulk, reads
from outbox.web.app import Console, Options, open_pool
from outbox.web.auth import Credentials, Role, User, hash_password, read_credentials
from outbox.web.pages import create_app
from tests.integration.test_bulk_actions import quarantine_population, random_filters
from tests.integration.test_inbox_cli import record
from tests.integration.test_reconcile import unknown_then_past_the_window
from tests.integration.test_roles import OPERATOR, apply_roles, as_role
from tests.support.dispatch import stripe_provider
from tests.support.web import served

PASSWORD = "correct horse battery staple"  # noqa: S105 (the tests' own)
_HASH = hash_password(PASSWORD)  # one scrypt for the module: each costs about 50 ms


@pytest.fixture(scope="module")
def credentials_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("web") / "people"
    path.write_text(f"# the console's people\nvera viewer {_HASH}\notto operator {_HASH}\n")
    return path


def console(db_url: str, **options: Any) -> Console:
    settings = settings_from_mapping(
        {"providers": {"hook": {"type": "noop"}, "hook2": {"type": "noop"}}}, environ={}
    )
    return Console(open_pool(db_url, size=2), settings, Options(**options), dsn=db_url)


@pytest.fixture
def signed_console(db_url: str, credentials_file: Path) -> Console:
    return console(db_url, credentials=Credentials.load(credentials_file))


@pytest.fixture
def signed(signed_console: Console) -> Iterator[httpx.Client]:
    """A console with the credentials file; no one is signed in on the client yet."""
    with served(create_app(signed_console)) as client:
        yield client


def token_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert found, "the page has no form token"
    return found.group(1)


def audit_count(db_url: str, operation_id: int) -> int:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM outbox.audit WHERE operation_id = %s", (operation_id,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def status_of(db_url: str, operation_id: int) -> str:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT status FROM outbox.operations WHERE id = %s", (operation_id,)
        ).fetchone()
    assert row is not None
    return str(row[0])


# --- who may do what ------------------------------------------------------------------------


def test_no_page_without_credentials_and_a_wrong_password_is_refused(
    signed: httpx.Client,
) -> None:
    for path in ("/", "/operations", "/failures", "/reconcile", "/live/overview"):
        answer = signed.get(path)
        assert answer.status_code == 401, path
        assert answer.headers["www-authenticate"].startswith("Basic")
    assert signed.get("/", auth=("otto", "wrong")).status_code == 401
    assert signed.get("/", auth=("nobody", PASSWORD)).status_code == 401
    shown = signed.get("/", auth=("vera", PASSWORD))
    assert shown.status_code == 200 and "vera · viewer" in shown.text


def test_a_viewers_forged_post_changes_nothing(
    signed: httpx.Client, signed_console: Console, db_url: str
) -> None:
    (op,) = quarantine_population(db_url, random.Random(1), 1)
    page = signed.get(f"/operations/{op['id']}", auth=("vera", PASSWORD))
    assert page.status_code == 200
    assert 'name="action"' not in page.text  # a viewer is offered no action
    # Even with a token as valid as the console would issue to her, she changes nothing.
    token = signed_console.tokens.issue(User("vera", Role.VIEWER))
    forged = {"csrf": token, "action": "cancel", "reason": "forged"}
    answer = signed.post(f"/operations/{op['id']}/act", data=forged, auth=("vera", PASSWORD))
    assert answer.status_code == 403 and "viewer" in answer.text
    assert status_of(db_url, op["id"]) == "quarantined"
    assert audit_count(db_url, op["id"]) == 0


def test_a_post_without_the_operators_own_token_or_from_another_site_is_refused(
    signed: httpx.Client, signed_console: Console, db_url: str
) -> None:
    (op,) = quarantine_population(db_url, random.Random(2), 1)
    otto = ("otto", PASSWORD)
    url = f"/operations/{op['id']}/act"
    page = signed.get(f"/operations/{op['id']}", auth=otto).text
    veras = signed_console.tokens.issue(User("vera", Role.VIEWER))
    form = {"action": "cancel", "reason": "test"}
    assert signed.post(url, data=form, auth=otto).status_code == 403  # no token
    assert signed.post(url, data={**form, "csrf": veras}, auth=otto).status_code == 403
    assert signed.post(url, data={**form, "csrf": "0" * 64}, auth=otto).status_code == 403
    cross = {"sec-fetch-site": "cross-site"}
    sent = {**form, "csrf": token_of(page)}
    assert signed.post(url, data=sent, auth=otto, headers=cross).status_code == 403
    assert status_of(db_url, op["id"]) == "quarantined" and audit_count(db_url, op["id"]) == 0
    # The same form, the operator's own, from the console: acted on, audited under their name.
    done = signed.post(url, data=sent, auth=otto, follow_redirects=False)
    assert done.status_code == 303
    assert status_of(db_url, op["id"]) == "cancelled"
    with psycopg.connect(db_url) as conn:
        audit = conn.execute(
            "SELECT actor, action, reason FROM outbox.audit WHERE operation_id = %s", (op["id"],)
        ).fetchall()
    assert audit == [("otto", "cancel", "test")]


def test_a_read_only_console_refuses_an_operator_and_offers_nothing(
    db_url: str, credentials_file: Path
) -> None:
    (op,) = quarantine_population(db_url, random.Random(3), 1)
    read_only = console(db_url, credentials=Credentials.load(credentials_file), read_only=True)
    with served(create_app(read_only)) as client:
        page = client.get(f"/operations/{op['id']}", auth=("otto", PASSWORD))
        assert "read-only" in page.text and 'name="action"' not in page.text
        form = {
            "csrf": read_only.tokens.issue(User("otto", Role.OPERATOR)),
            "action": "cancel",
            "reason": "x",
        }
        answer = client.post(f"/operations/{op['id']}/act", data=form, auth=("otto", PASSWORD))
    assert answer.status_code == 403 and "read-only" in answer.text
    assert status_of(db_url, op["id"]) == "quarantined" and audit_count(db_url, op["id"]) == 0


def test_a_trusted_proxy_names_the_person_and_their_role(db_url: str) -> None:
    (op,) = quarantine_population(db_url, random.Random(4), 1)
    proxied = console(db_url, proxy_user_header="X-Forwarded-User", proxy_role_header="X-Role")
    with served(create_app(proxied)) as client:
        assert client.get("/").status_code == 403  # no name: no one
        as_viewer = {"X-Forwarded-User": "pat"}
        assert "pat · viewer" in client.get("/", headers=as_viewer).text
        as_operator = {"X-Forwarded-User": "ana", "X-Role": "operator"}
        page = client.get(f"/operations/{op['id']}", headers=as_operator).text
        form = {"csrf": token_of(page), "action": "replay", "reason": "fixed"}
        viewer_form = {**form, "csrf": proxied.tokens.issue(User("pat", Role.VIEWER))}
        url = f"/operations/{op['id']}/act"
        assert client.post(url, data=viewer_form, headers=as_viewer).status_code == 403
        done = client.post(url, data=form, headers=as_operator, follow_redirects=False)
    assert done.status_code == 303 and status_of(db_url, op["id"]) == "pending"


def test_without_sign_in_configured_everyone_is_a_viewer(db_url: str) -> None:
    (op,) = quarantine_population(db_url, random.Random(5), 1)
    anyone = console(db_url)
    with served(create_app(anyone)) as client:
        page = client.get(f"/operations/{op['id']}")
        assert page.status_code == 200 and "anonymous · viewer" in page.text
        form = {
            "csrf": anyone.tokens.issue(User("anonymous", Role.VIEWER)),
            "action": "cancel",
            "reason": "x",
        }
        assert client.post(f"/operations/{op['id']}/act", data=form).status_code == 403
    assert status_of(db_url, op["id"]) == "quarantined"


def test_a_credentials_file_that_is_not_one_is_refused_without_quoting_a_hash(
    tmp_path: Path,
) -> None:
    path = tmp_path / "people"
    for text, said in [
        ("otto operator\n", "expected `name role hash`"),
        (f"otto admin {_HASH}\n", "viewer or operator"),
        ("otto operator hunter2\n", "not a hash"),
        (f"otto operator {_HASH}\notto viewer {_HASH}\n", "named twice"),
    ]:
        path.write_text(text)
        with pytest.raises(Exception, match=said) as caught:
            read_credentials(path)
        assert "hunter2" not in str(caught.value) and _HASH not in str(caught.value)


# --- what the pages show --------------------------------------------------------------------


def test_the_overview_counts_what_the_database_holds(db_url: str) -> None:
    rng = random.Random(6)
    quarantine_population(db_url, rng, 7)
    quarantine_population(db_url, rng, 4, status="reconciling", prefix="r-")
    with served(create_app(console(db_url))) as client:
        page = client.get("/live/overview").text
    with psycopg.connect(db_url) as conn:
        held: dict[str, int] = dict(
            conn.execute("SELECT status, count(*) FROM outbox.operations GROUP BY 1").fetchall()
        )
    for status in Status:
        shown = re.search(rf'data-status="{status.value}">\s*<span class="n">~?(\d+)</span>', page)
        assert shown, status
        assert int(shown.group(1)) == held.get(status.value, 0), status


def test_failure_groups_sum_to_the_waiting_and_each_groups_dry_run_counts_the_group(
    db_url: str,
) -> None:
    rng = random.Random(7)
    population = quarantine_population(db_url, rng, 40)
    with served(create_app(console(db_url))) as client:
        page = client.get("/failures").text
        links = re.findall(r'class="bulk" href="[^"]*/bulk\?([^"]+)"', page)
        counts = [int(n) for n in re.findall(r'<td class="num">(\d+)</td>', page)]
        assert sum(counts) == len(population) and len(links) == len(counts)
        for link, count in zip(links, counts, strict=True):
            dry = client.get("/bulk?" + link.replace("&amp;", "&")).text
            shown = re.search(r'<strong id="count">(\d+)</strong>', dry)
            assert shown and int(shown.group(1)) == count, link
    with psycopg.connect(db_url) as conn:  # a dry run changes nothing
        assert conn.execute("SELECT count(*) FROM outbox.audit").fetchone() == (0,)


def test_every_page_of_a_filter_lists_each_operation_once(db_url: str) -> None:
    rng = random.Random(8)
    population = quarantine_population(db_url, rng, 130)
    wanted = {p["id"] for p in population if p["tenant"] == "acme"}
    seen: list[int] = []
    url = "/operations?status=quarantined&tenant=acme"
    with served(create_app(console(db_url))) as client:
        while url:
            page = client.get(url).text
            seen += [int(i) for i in re.findall(r'<tr data-id="(\d+)">', page)]
            more = re.search(r'<a href="\?([^"]+)" rel="next">', page)
            url = "/operations?" + more.group(1).replace("&amp;", "&") if more else ""
    assert sorted(seen) == sorted(wanted) and len(seen) == len(set(seen))
    assert seen == sorted(seen, reverse=True)  # newest first


def test_search_finds_an_operation_by_each_of_its_names(db_url: str) -> None:
    (op,) = quarantine_population(db_url, random.Random(9), 1)
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET provider_ref = 'pi_42', correlation_id = 'req-7' "
            "WHERE id = %s",
            (op["id"],),
        )
        row = conn.execute(
            "SELECT tenant_id, operation_type, operation_key, idempotency_key "
            "FROM outbox.operations WHERE id = %s",
            (op["id"],),
        ).fetchone()
    assert row is not None
    names = [str(op["id"]), f"{row[0]}/{row[1]}/{row[2]}", row[3], "pi_42", "req-7"]
    with served(create_app(console(db_url))) as client:
        for name in names:
            found = client.get("/operations", params={"q": name}, follow_redirects=False)
            assert found.status_code == 303, name
            assert found.headers["location"].endswith(f"/operations/{op['id']}"), name
        missing = client.get("/operations", params={"q": "no-such-thing"})
    assert missing.status_code == 200 and "0 found" in missing.text


def test_the_payload_is_hidden_until_asked_for_and_its_secrets_stay_masked(db_url: str) -> None:
    secret = "sk_live_abcdefghijklmnop"  # noqa: S105 (a marker to look for)
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT operation_id FROM outbox.enqueue('t', 'charge', 'k', 'hook', 'x', %s::jsonb)",
            ('{"amount": 1250, "api_key": "' + secret + '", "nested": {"token": "tok_9"}}',),
        ).fetchone()
    assert row is not None
    with served(create_app(console(db_url))) as client:
        hidden = client.get(f"/operations/{row[0]}").text
        shown = client.get(f"/operations/{row[0]}?payload=1").text
    assert "1250" not in hidden and "Show the payload" in hidden
    assert "1250" in shown and "[redacted]" in shown
    assert secret not in shown and "tok_9" not in shown


# --- actions --------------------------------------------------------------------------------


def test_a_bulk_action_acts_on_what_the_dry_run_counted_and_skips_what_left(
    signed: httpx.Client, db_url: str
) -> None:
    population = quarantine_population(db_url, random.Random(10), 12)
    otto = ("otto", PASSWORD)
    dry = signed.get("/bulk", params={"status": "quarantined", "provider": "hook"}, auth=otto)
    counted = int(re.search(r'<strong id="count">(\d+)</strong>', dry.text).group(1))  # type: ignore[union-attr]
    chosen = [p["id"] for p in population if p["provider"] == "hook"]
    assert counted == len(chosen) > 1
    selection = re.search(r'name="selection" value="([^"]+)"', dry.text)
    assert selection
    # One of them leaves the status between the count and the confirmation.
    with psycopg.connect(db_url) as conn:
        conn.execute("SELECT outbox.replay_operation(%s, 'meanwhile', 'cli')", (chosen[0],))
    # A later one that matches the filter is not taken: only what was counted.
    late = quarantine_population(db_url, random.Random(11), 3, prefix="late-")
    form = {"csrf": token_of(dry.text), "selection": selection.group(1), "reason": "bulk"}
    started = signed.post("/bulk", data={**form, "action": "cancel"}, auth=otto)
    assert started.status_code == 200 and "/jobs/" in str(started.url)
    job_url = str(started.url)
    for _ in range(200):
        state = signed.get(job_url + "?live=1", auth=otto).text
        if 'data-state="finished"' in state:
            break
        threading.Event().wait(0.05)
    assert 'data-state="finished"' in state
    assert f"{len(chosen) - 1}</span> done, 1 skipped" in state
    with psycopg.connect(db_url) as conn:
        audited = conn.execute(
            "SELECT operation_id, actor FROM outbox.audit WHERE action = 'cancel'"
        ).fetchall()
    assert sorted(audited) == sorted((i, "otto") for i in chosen[1:])
    assert all(status_of(db_url, p["id"]) == "quarantined" for p in late)
    # The same confirmation again finds no selection: it was taken.
    again = signed.post("/bulk", data={**form, "action": "cancel"}, auth=otto)
    assert again.status_code == 409


def test_a_stopped_job_stops_between_two_operations(db_url: str) -> None:
    population = quarantine_population(db_url, random.Random(12), 5)
    pool = open_pool(db_url, size=1)
    pool.open()
    gate, entered = threading.Event(), threading.Event()

    def slow_cancel(conn: psycopg.Connection[Any], operation_id: int) -> Status:
        entered.set()
        gate.wait(10)
        row = conn.execute(
            "SELECT outbox.cancel_operation(%s, 'stop test', 'otto')", (operation_id,)
        ).fetchone()
        conn.commit()
        assert row is not None
        return Status.parse(row[0])

    try:
        jobs = bulk.Jobs(pool)
        job = jobs.start("cancel", [p["id"] for p in population], slow_cancel, "otto")
        assert entered.wait(10)
        job.stop.set()
        gate.set()
        for _ in range(100):
            if job.finished:
                break
            threading.Event().wait(0.05)
    finally:
        pool.close()
    assert job.finished and job.state() == "stopped"
    assert job.done == 1 and job.skipped == 0
    with psycopg.connect(db_url) as conn:
        assert conn.execute(
            "SELECT count(*) FROM outbox.operations WHERE status = 'cancelled'"
        ).fetchone() == (1,)


def test_the_console_works_with_no_more_than_the_operator_role(pg_server: str, db_url: str) -> None:
    apply_roles(pg_server, db_url)
    population = quarantine_population(db_url, random.Random(13), 3)
    quarantine_population(db_url, random.Random(14), 2, status="reconciling", prefix="r-")
    app = create_app(
        console(as_role(db_url, OPERATOR), proxy_user_header="X-User", proxy_role_header="X-Role")
    )
    who = {"X-User": "ana", "X-Role": "operator"}
    with served(app) as client:
        for path in (
            "/",
            "/operations",
            "/failures",
            "/reconcile",
            f"/operations/{population[0]['id']}?payload=1",
            "/bulk?status=quarantined",
            "/operations?q=k-1",
        ):
            assert client.get(path, headers=who).status_code == 200, path
        page = client.get(f"/operations/{population[0]['id']}", headers=who).text
        assert 'id="overprivileged"' not in page  # the role is what the console asks for
        form = {"csrf": token_of(page), "action": "replay", "reason": "as the role"}
        done = client.post(
            f"/operations/{population[0]['id']}/act", data=form, headers=who, follow_redirects=False
        )
    assert done.status_code == 303 and status_of(db_url, population[0]["id"]) == "pending"


def test_a_console_connected_as_a_superuser_says_so_on_every_page(db_url: str) -> None:
    with served(create_app(console(db_url))) as client:
        pages = [client.get(path).text for path in ("/", "/operations", "/failures")]
    for page in pages:
        said = re.search(r'id="overprivileged">The console connects as (\w+)', page)
        assert said is not None and said.group(1) == "postgres"


# --- hostile input --------------------------------------------------------------------------

_TEXT = st.text(st.characters(codec="utf-8"), max_size=300)
_PARAMS = st.dictionaries(
    st.sampled_from(
        [
            "status",
            "provider",
            "status_reason",
            "error",
            "tenant",
            "operation_type",
            "since",
            "before",
            "q",
            "payload",
            "live",
        ]
    ),
    _TEXT | st.integers(-(2**70), 2**70).map(str),
    max_size=5,
)


@pytest.fixture
def anonymous(db_url: str) -> Iterator[httpx.Client]:
    with served(create_app(console(db_url))) as client:
        yield client


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(
        ["/", "/operations", "/failures", "/reconcile", "/bulk", "/operations/1", "/jobs/x"]
    ),
    params=_PARAMS,
)
def test_no_query_string_makes_a_page_fail(
    anonymous: httpx.Client, path: str, params: dict[str, str]
) -> None:
    answer = anonymous.get(path, params=params, follow_redirects=False)
    assert answer.status_code in (200, 303, 400, 404), (path, params, answer.text[:300])


def test_a_database_that_does_not_answer_is_said_not_hung_on(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
    dead = f"postgresql://outbox:secret-pw@127.0.0.1:{port}/outbox"
    settings_ = settings_from_mapping({}, environ={})
    pool = open_pool(dead, size=1, timeout=2)
    app = create_app(Console(pool, settings_, Options(), dsn=dead))
    with served(app) as client:
        answer = client.get("/")
    assert answer.status_code == 503
    assert "does not answer" in answer.text and "secret-pw" not in answer.text


@pytest.fixture
async def impatient(fake: FakeStripe) -> AsyncIterator[Provider]:
    """Stripe at the fake, giving up on an answer after 0.3 s: an unknown outcome."""
    p = stripe_provider("stripe", fake.url, timeout=0.3)
    yield p
    await p.aclose()


async def test_a_check_from_the_console_finds_the_effect_and_names_the_operator(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    impatient: Provider,
    credentials_file: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake.inject(StripeFault.delay_after_apply(1.0))  # applied, but the answer comes too late
    op = await unknown_then_past_the_window(db_url, pool, fake, impatient)
    monkeypatch.setenv("TEST_STRIPE_KEY", "sk_test_fake")
    settings = settings_from_mapping(
        {
            "providers": {
                "stripe": {"type": "stripe", "api_key_env": "TEST_STRIPE_KEY", "api_base": fake.url}
            }
        },
        environ={},
    )
    checking = Console(
        open_pool(db_url, size=2),
        settings,
        Options(credentials=Credentials.load(credentials_file)),
        dsn=db_url,
    )
    otto = ("otto", PASSWORD)
    with served(create_app(checking)) as client:
        page = client.get(f"/operations/{op}", auth=otto)
        assert 'value="check"' in page.text
        form = {"csrf": token_of(page.text), "action": "check"}
        done = client.post(f"/operations/{op}/act", data=form, auth=otto)
    assert done.status_code == 200 and "check: found" in done.text
    (obj,) = fake.objects()
    with psycopg.connect(db_url) as conn:
        found = conn.execute("SELECT status, provider_ref FROM outbox.operations").fetchone()
        audit = conn.execute("SELECT actor, action, to_status FROM outbox.audit").fetchall()
    assert found == ("succeeded", obj["id"]) and fake.object_count() == 1
    assert audit == [("otto", "check", "succeeded")]


HOSTILE = '"><xss-marker onerror=alert(1)>'


def test_what_a_hostile_provider_or_producer_wrote_is_shown_as_text_never_as_markup(
    db_url: str,
) -> None:
    """A provider controls its error messages, request ids and the state a check finds; a
    producer its correlation id and payload. None of it becomes markup on any page."""
    (op,) = quarantine_population(db_url, random.Random(15), 1)
    (doubt,) = quarantine_population(db_url, random.Random(16), 1, "reconciling", prefix="d-")
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.attempt_log SET provider_request_id = %(h)s, error_message = %(h)s, "
            "error_class = %(h)s",
            {"h": HOSTILE},
        )
        conn.execute(
            "UPDATE outbox.operations SET correlation_id = %(h)s, last_error = %(h)s, "
            "check_state = %(h)s, check_finding = 'not_found', checked_at = now(), "
            "check_details = jsonb_build_object(%(h)s::text, %(h)s::text)",
            {"h": HOSTILE},
        )
    paths = [
        "/",
        "/operations",
        f"/operations/{op['id']}?payload=1",
        f"/operations/{doubt['id']}",
        "/failures",
        "/reconcile",
        "/bulk?status=quarantined",
        "/operations?" + urlencode({"q": HOSTILE}),
        "/operations?" + urlencode({"provider": HOSTILE, "error": HOSTILE}),
        "/bulk?" + urlencode({"status": "reconciling", "error": HOSTILE}),
    ]
    with served(create_app(console(db_url))) as client:
        for path in paths:
            answer = client.get(path)
            assert answer.status_code == 200, path
            assert "<xss-marker" not in answer.text, path
            assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]
        shown = client.get(f"/operations/{op['id']}").text
    assert "&lt;xss-marker" in shown  # shown, as text


def test_the_overview_shows_the_inbox_claims_and_conflicts(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        record(conn, "key:ok", 201)
        # The same key with another body: a conflict, recorded for operators.
        conn.execute(
            "SELECT outbox.inbox_begin('acme', 'invoice.create', 'key:ok', '{\"a\": 2}', NULL,"
            " '1 s', '1 day')"
        )
        # An external claim in progress (a lease of a minute), on another handler.
        conn.execute(
            "SELECT outbox.inbox_claim('acme', 'invoice.mail', 'key:m', '{}', NULL, '1 minute',"
            " 3, '1 day')"
        )
        conn.commit()
    with served(create_app(console(db_url))) as client:
        page = client.get("/live/overview").text
    assert re.search(r"<td>invoice\.mail</td><td class=\"num\">1</td>", page), page
    assert re.search(r'id="inbox-conflicts">1\s+conflict seen', page), page


def test_a_bulk_action_refuses_a_filter_it_would_not_apply(db_url: str) -> None:
    """The list filters by operation type; a bulk action cannot: it says so rather than act on
    every type."""
    quarantine_population(db_url, random.Random(17), 5)
    with served(create_app(console(db_url))) as client:
        listed = client.get("/operations", params={"status": "quarantined", "tenant": "acme"})
        link = re.search(r'href="[^"]*/bulk\?([^"]+)"', listed.text)
        assert link is not None  # offered, with exactly the list's filters
        dry = client.get("/bulk?" + link.group(1).replace("&amp;", "&"))
        assert dry.status_code == 200
        typed = client.get(
            "/operations", params={"status": "quarantined", "operation_type": "invoice.charge"}
        )
        assert "/bulk?" not in typed.text  # not offered
        refused = client.get(
            "/bulk", params={"status": "quarantined", "operation_type": "invoice.charge"}
        )
    assert refused.status_code == 400 and "operation_type" in refused.text


def test_the_operation_page_says_how_long_the_key_is_honoured_on_the_database_clock(
    db_url: str,
) -> None:
    """Each provider's window is its key_retention less the margin, measured from the first
    send on the database's clock: one sent half a window ago, one two windows ago, one never."""
    ops = quarantine_population(db_url, random.Random(18), 3)
    shown = console(db_url)
    windows = [shown.windows[op["provider"]] for op in ops]
    sent = [windows[0] / 2, windows[1] * 2, None]
    with psycopg.connect(db_url) as conn:
        for op, ago in zip(ops, sent, strict=True):
            conn.execute(
                "UPDATE outbox.operations SET first_sent_at = now() - %s::interval WHERE id = %s",
                (ago, op["id"]),
            )
    with served(create_app(shown)) as client:
        pages = [client.get(f"/operations/{op['id']}").text for op in ops]
    said = []
    for page in pages:
        found = re.search(r'id="key-window">([^<]+)</dd>', page)
        assert found is not None
        said.append(found.group(1))
    assert said[0].startswith("until ") and "left" in said[0], said[0]
    assert said[1].startswith("no longer: the window closed"), said[1]
    assert said[2] == "not sent yet", said[2]


_FORMS = st.fixed_dictionaries(
    {},
    optional={
        "action": st.sampled_from(
            [
                "replay",
                "reconcile",
                "cancel",
                "request-cancel",
                "retry",
                "no-effect",
                "resolve",
                "check",
                "nonsense",
                "",
            ]
        )
        | _TEXT,
        "reason": _TEXT,
        "provider_ref": _TEXT,
        "force": st.sampled_from(["1", "0", ""]) | _TEXT,
        "selection": _TEXT,
    },
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(target=st.sampled_from(["/operations/1/act", "/operations/999/act", "/bulk"]), form=_FORMS)
def test_no_form_an_operator_can_post_makes_an_action_fail(
    signed: httpx.Client, signed_console: Console, db_url: str, target: str, form: dict[str, str]
) -> None:
    """Every POST with the operator's own token answers as an action does (done, refused,
    conflict, not found), never with a 500, whatever its fields hold: on an operation that
    exists (first quarantined, then wherever the examples moved it) and on one that does not."""
    with psycopg.connect(db_url) as conn:
        empty = conn.execute("SELECT NOT EXISTS (SELECT FROM outbox.operations)").fetchone()
    if empty == (True,):
        quarantine_population(db_url, random.Random(19), 1)
    token = signed_console.tokens.issue(User("otto", Role.OPERATOR))
    answer = signed.post(
        target, data={**form, "csrf": token}, auth=("otto", PASSWORD), follow_redirects=False
    )
    assert answer.status_code in (303, 400, 404, 409), (target, form, answer.text[:300])


def test_a_nul_anywhere_is_refused_by_name(signed: httpx.Client, signed_console: Console) -> None:
    op = 1
    token = signed_console.tokens.issue(User("otto", Role.OPERATOR))
    otto = ("otto", PASSWORD)
    for path, params in [
        ("/operations", {"q": "a\x00b"}),
        ("/operations", {"tenant": "\x00"}),
        ("/bulk", {"status": "quarantined", "provider": "x\x00"}),
    ]:
        answer = signed.get(path, params=params, auth=otto)
        assert answer.status_code == 400 and "NUL" in answer.text, (path, params)
    posted = signed.post(
        f"/operations/{op}/act",
        data={"csrf": token, "action": "cancel", "reason": "why\x00"},
        auth=otto,
    )
    assert posted.status_code == 400 and "NUL" in posted.text


def test_a_bulk_retry_says_and_takes_only_those_found_without_effect(
    signed: httpx.Client, db_url: str
) -> None:
    doubt = quarantine_population(db_url, random.Random(20), 5, "reconciling", prefix="d-")
    found_nothing = [d["id"] for d in doubt[:2]]
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET check_finding = 'not_found', checked_at = now() "
            "WHERE id = ANY(%s)",
            (found_nothing,),
        )
    otto = ("otto", PASSWORD)
    dry = signed.get("/bulk", params={"status": "reconciling"}, auth=otto)
    said = re.search(r'id="retryable">(\d+) of them', dry.text)
    assert said is not None and int(said.group(1)) == 2
    selection = re.search(r'name="selection" value="([^"]+)"', dry.text)
    assert selection is not None
    form = {"csrf": token_of(dry.text), "selection": selection.group(1), "reason": "no charge"}
    job = signed.post("/bulk", data={**form, "action": "retry"}, auth=otto)
    for _ in range(200):
        state = signed.get(str(job.url) + "?live=1", auth=otto).text
        if 'data-state="finished"' in state:
            break
        threading.Event().wait(0.05)
    assert '<span id="job-done">2</span> done, 3 skipped' in state
    with psycopg.connect(db_url) as conn:
        pending = conn.execute(
            "SELECT id, key_generation FROM outbox.operations WHERE status = 'pending' ORDER BY id"
        ).fetchall()
    assert pending == [(i, 2) for i in sorted(found_nothing)]  # each under a new key generation


_LIST_KEYS = {
    "--provider": "provider",
    "--tenant": "tenant",
    "--status-reason": "status_reason",
    "--error": "error",
}


def test_every_filter_of_the_list_selects_what_the_cli_would(db_url: str) -> None:
    """Seeded random filter sets over a random population: the console's list (every page)
    shows exactly the operations the predicate selects, and its bulk dry run counts as many."""
    rng = random.Random(21)
    population = quarantine_population(db_url, rng, 90)
    with served(create_app(console(db_url))) as client:
        for _ in range(12):
            args, selects = random_filters(rng)
            params = {"status": "quarantined"}
            for option, value in zip(args[::2], args[1::2], strict=True):
                params[_LIST_KEYS.get(option, option.removeprefix("--"))] = value
            wanted = sorted((p["id"] for p in population if selects(p)), reverse=True)
            seen: list[int] = []
            url = "/operations?" + urlencode(params)
            while url:
                page = client.get(url).text
                seen += [int(i) for i in re.findall(r'<tr data-id="(\d+)">', page)]
                more = re.search(r'<a href="\?([^"]+)" rel="next">', page)
                url = "/operations?" + more.group(1).replace("&amp;", "&") if more else ""
            assert seen == wanted, params
            dry = client.get("/bulk", params=params).text
            counted = re.search(r'<strong id="count">(\d+)</strong>', dry)
            assert counted is not None and int(counted.group(1)) == len(wanted), params


def test_the_overview_counts_the_waiting_by_reason_and_the_key_windows_closing(
    db_url: str,
) -> None:
    rng = random.Random(22)
    population = quarantine_population(db_url, rng, 25)
    shown = console(db_url)
    with psycopg.connect(db_url) as conn:
        # Pending after a failed send, their windows closing in 30 min, in 2 h, and closed.
        closing = []
        for n, left in enumerate((timedelta(minutes=30), timedelta(hours=2), -timedelta(1))):
            row = conn.execute(
                "SELECT operation_id FROM outbox.enqueue('t', 'charge', %s, 'hook', 'x', '{}')",
                (f"w-{n}",),
            ).fetchone()
            assert row is not None
            conn.execute(
                "UPDATE outbox.operations SET first_sent_at = now() - %s + %s, attempts = 1, "
                "last_error_class = 'transient' WHERE id = %s",
                (shown.windows["hook"], left, row[0]),
            )
            closing.append(row[0])
        conn.execute(
            "INSERT INTO outbox.provider_health (provider, worker, state, reason, opened_at) "
            "VALUES ('hook2', 'w1', 'open', 'http_503', now()), "
            "('hook2', 'w2', 'open', 'http_503', now()), ('hook', 'w1', 'closed', NULL, NULL)"
        )
    with served(create_app(shown)) as client:
        page = client.get("/live/overview").text
    by_reason = {
        r: sum(1 for p in population if p["reason"] == r) for r in {p["reason"] for p in population}
    }
    for reason, count in by_reason.items():
        shown_count = re.search(
            rf"<tr><td>quarantined</td><td>{reason}</td><td class=\"num\">(\d+)</td>", page
        )
        assert shown_count is not None and int(shown_count.group(1)) == count, reason
    listed = re.findall(r'href="[^"]*/operations/(\d+)">\d+</a></td><td>t/charge/w-', page)
    assert [int(i) for i in listed] == [closing[2], closing[0]]  # closed first, then 30 min
    assert re.search(r"<tr><td>hook2</td><td>open</td><td class=\"num\">2</td>", page)
    assert "<tr><td>hook</td>" not in page.split("Breakers not closed")[1]


def test_failure_groups_of_a_huge_incident_are_made_of_the_oldest_and_say_so(
    db_url: str,
) -> None:
    population = quarantine_population(db_url, random.Random(23), 30)
    oldest = sorted(population, key=lambda p: -p["hours_ago"])[:7]
    with psycopg.connect(db_url) as conn:
        groups, waiting = reads.failure_groups(conn, examine=7)
    assert waiting == {"quarantined": 30}
    assert sum(g["operations"] for g in groups) == 7
    expected: dict[tuple[str, str, str], int] = {}
    for p in oldest:
        key = (p["provider"], p["error"], p["reason"])
        expected[key] = expected.get(key, 0) + 1
    assert {(g["provider"], g["error"], g["reason"]): g["operations"] for g in groups} == expected
