"""`outbox web` in a real browser (issue 43): Debian's Chromium driven by Playwright, against
`outbox web --config` and `outbox run` as the commands a person starts, on a real PostgreSQL.

An operator finds a quarantined operation by its key, reads its timeline, replays it and
watches the overview count it succeeded without a reload; cancels a failure group in bulk
after its dry-run count; a viewer's forged POST and a POST without the form's token are
refused. With OUTBOX_CONSOLE_SHOTS set to a directory, each page is photographed there
(docs/console.md, "Screenshots")."""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from playwright import sync_api as playwright_api

from outbox.web.auth import hash_password
from tests.integration.test_bulk_actions import quarantine_population
from tests.support.daemon import OutboxProcess, wait_until, write_config
from tests.support.tools import require_tool

PASSWORD = "open sesame, 43"  # noqa: S105 (the test's own)
OPERATOR = ("otto", PASSWORD)
VIEWER = ("vera", PASSWORD)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def config(tmp_path: Path) -> Path:
    people = tmp_path / "people"
    hashed = hash_password(PASSWORD)
    people.write_text(f"vera viewer {hashed}\notto operator {hashed}\n")
    path = write_config(
        tmp_path / "outbox.toml",
        providers={"hook": {"type": "noop"}, "hook2": {"type": "noop"}},
        poll_interval="100ms",
    )
    path.write_text(path.read_text() + f'\n[web]\ncredentials_file = "{people}"\n')
    return path


@pytest.fixture
def console_url(db_url: str, config: Path, tmp_path: Path) -> Iterator[str]:
    """`outbox web --config` as a person starts it, on a free loopback port."""
    port = _free_port()
    log = (tmp_path / "web.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "outbox",
            "web",
            "--config",
            str(config),
            "--listen",
            f"127.0.0.1:{port}",
        ],
        env={**os.environ, "OUTBOX_DATABASE_URL": db_url},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            return httpx.get(url + "/", timeout=1).status_code == 401
        except httpx.HTTPError:
            return False

    try:
        wait_until(answers, timeout=30, what="outbox web to answer")
        yield url
    finally:
        process.terminate()
        process.wait(10)
        log.close()


@pytest.fixture
def browser() -> Iterator[Any]:
    chromium = require_tool("chromium")
    with playwright_api.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


def signed_in(browser: Any, who: tuple[str, str]) -> Any:
    context = browser.new_context(
        http_credentials={"username": who[0], "password": who[1]},
        viewport={"width": 1280, "height": 900},
    )
    context.set_default_timeout(15_000)
    return context.new_page()


def shot(page: Any, name: str) -> None:
    directory = os.environ.get("OUTBOX_CONSOLE_SHOTS")
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(directory) / f"{name}.png"), full_page=True)


def one_row(db_url: str, query: str, *params: Any) -> Any:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(query, params).fetchone()
    assert row is not None
    return row


def test_an_operator_finds_replays_and_watches_an_operation_succeed_without_a_reload(
    browser: Any, console_url: str, db_url: str, config: Path, tmp_path: Path
) -> None:
    (op,) = quarantine_population(db_url, random.Random(43), 1)
    key = one_row(db_url, "SELECT idempotency_key FROM outbox.operations WHERE id = %s", op["id"])[
        0
    ]
    page = signed_in(browser, OPERATOR)
    page.goto(console_url + "/")
    assert page.locator('[data-status="succeeded"] .n').inner_text() == "0"
    shot(page, "overview")
    # Found by its key, from the search box of any page.
    page.fill('input[name="q"]', key)
    page.press('input[name="q"]', "Enter")
    page.wait_for_url(re.compile(rf"/operations/{op['id']}$"))
    assert page.locator("#status").inner_text() == "quarantined"
    timeline = page.locator("table.timeline tbody tr")
    assert timeline.count() == 1 and op["error"] in timeline.first.inner_text()
    shot(page, "operation")
    page.fill('input[name="reason"]', "the endpoint is fixed")
    page.click('button[value="replay"]')
    page.wait_for_selector("text=replay: now pending")
    # The overview, left open, counts it succeeded once the dispatcher sent it: no reload.
    page.goto(console_url + "/")
    page.evaluate("window.__notReloaded = true")
    dispatcher = OutboxProcess(db_url, config, tmp_path / "run.log")
    try:
        # Playwright's own wait, which evaluates no string: the console's CSP forbids eval.
        playwright_api.expect(page.locator('[data-status="succeeded"] .n')).to_have_text(
            "1", timeout=30_000
        )
    finally:
        dispatcher.stop()
    assert page.evaluate("window.__notReloaded") is True
    assert one_row(db_url, "SELECT status FROM outbox.operations WHERE id = %s", op["id"]) == (
        "succeeded",
    )
    actor, action = one_row(
        db_url, "SELECT actor, action FROM outbox.audit WHERE operation_id = %s", op["id"]
    )
    assert (actor, action) == ("otto", "replay")


def test_an_operator_cancels_a_failure_group_in_bulk_after_its_dry_run(
    browser: Any, console_url: str, db_url: str
) -> None:
    population = quarantine_population(db_url, random.Random(7), 30)
    page = signed_in(browser, OPERATOR)
    page.goto(console_url + "/failures")
    shot(page, "failures")
    first = page.locator("table.groups tbody tr").first
    cells = first.locator("td").all_inner_texts()
    provider, error, reason, count = cells[1], cells[2], cells[3], int(cells[4])
    group = [
        p
        for p in population
        if (p["provider"], p["error"], p["reason"]) == (provider, error, reason)
    ]
    assert len(group) == count > 0
    first.locator("a.bulk").click()
    assert int(page.locator("#count").inner_text()) == count  # the dry run: nothing changed yet
    assert one_row(db_url, "SELECT count(*) FROM outbox.audit") == (0,)
    shot(page, "bulk")
    page.fill('input[name="reason"]', "the customer closed these invoices")
    page.click('button[value="cancel"]')
    page.wait_for_selector('[data-state="finished"]', timeout=30_000)
    shot(page, "job")
    assert f"{count}" in page.locator("#job-done").inner_text()
    with psycopg.connect(db_url) as conn:
        cancelled = {
            r[0]
            for r in conn.execute(
                "SELECT operation_id FROM outbox.audit WHERE action = 'cancel' AND actor = 'otto'"
            )
        }
        left = conn.execute(
            "SELECT count(*) FROM outbox.operations WHERE status = 'quarantined'"
        ).fetchone()
    assert cancelled == {p["id"] for p in group}
    assert left == (len(population) - count,)


def test_a_viewers_forged_post_and_a_post_without_the_token_are_refused(
    browser: Any, console_url: str, db_url: str
) -> None:
    (op,) = quarantine_population(db_url, random.Random(9), 1)
    url = f"{console_url}/operations/{op['id']}/act"
    operator = signed_in(browser, OPERATOR)
    operator.goto(f"{console_url}/operations/{op['id']}")
    token = operator.locator('input[name="csrf"]').first.get_attribute("value")
    # The operator's own browser, without the form's token: refused.
    bare = operator.request.post(url, form={"action": "cancel", "reason": "no token"})
    assert bare.status == 403
    viewer = signed_in(browser, VIEWER)
    viewer.goto(f"{console_url}/operations/{op['id']}")
    shot(viewer, "operation-viewer")
    assert viewer.locator('button[name="action"]').count() == 0  # offered nothing
    forged = viewer.request.post(url, form={"action": "cancel", "reason": "forged", "csrf": token})
    assert forged.status == 403
    assert one_row(db_url, "SELECT status FROM outbox.operations WHERE id = %s", op["id"]) == (
        "quarantined",
    )
    assert one_row(db_url, "SELECT count(*) FROM outbox.audit") == (0,)
    # Every page the viewer may read renders.
    for path in ("/", "/operations", "/failures", "/reconcile", "/operations?status=quarantined"):
        viewer.goto(console_url + path)
        assert viewer.locator("h1").count() == 1, path
    shot(viewer, "reconcile")
