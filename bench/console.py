"""How long each page of `outbox web` takes to render with 100,000 operations (issue 43: under a
second on this machine), served by uvicorn on loopback and read by httpx, as a browser would.

The operations are a mix a console is opened on: most succeeded, some pending, 2 % quarantined
and 1 % reconciling over two providers, three error classes and two reasons, each waiting one
with its attempt. Prints each page's median over the rounds, and met or missed."""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import _support
import httpx
import psycopg
import uvicorn

from outbox.config.loader import settings_from_mapping
from outbox.web.app import REFRESH_SECONDS, Console, Options, open_pool
from outbox.web.pages import create_app

TARGET_SECONDS = 1.0

# The operations, shaped as they are inserted (what outbox.enqueue writes, as bench/_support.py's
# bulk insert, plus where each one is in its life): 10 million rows take minutes, not the hour
# an UPDATE of each would.
_INSERT = """
INSERT INTO outbox.operations (
    tenant_id, operation_type, operation_key, fingerprint, provider, action, payload,
    idempotency_key, payload_bytes, status, status_reason, attempts, first_sent_at,
    last_error_class, finished_at, provider_ref)
SELECT 'bench', 'bench.op', 'op-' || i,
       sha256(convert_to(t.provider || E'\\nbench\\n' || t.payload::text, 'UTF8')),
       t.provider, 'bench', t.payload,
       outbox.derive_idempotency_key('bench', 'bench.op', 'op-' || i),
       octet_length(t.payload::text),
       CASE WHEN i %% 100 < 2 THEN 'quarantined' WHEN i %% 100 = 2 THEN 'reconciling'
            WHEN i %% 100 < 10 THEN 'pending' ELSE 'succeeded' END,
       CASE WHEN i %% 100 < 2 THEN (ARRAY['permanent_failure', 'attempts_exhausted'])[1 + i %% 2]
            WHEN i %% 100 = 2 THEN 'key_window_passed' END,
       CASE WHEN i %% 100 < 10 THEN 0 ELSE 1 END,
       CASE WHEN i %% 100 < 3 THEN now() - interval '1 hour' END,
       CASE WHEN i %% 100 < 3 THEN 'permanent' END,
       CASE WHEN i %% 100 >= 10 THEN now() END,
       CASE WHEN i %% 100 >= 10 THEN 'ref-' || i END
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i
CROSS JOIN LATERAL (SELECT CASE WHEN i %% 2 = 0 THEN 'hook' ELSE 'hook2' END AS provider,
                           jsonb_build_object('n', i) AS payload) AS t
"""
CHUNK = 500_000
_ATTEMPTS = """
INSERT INTO outbox.attempt_log (operation_id, attempt, idempotency_key, worker, started_at,
                                outcome, sent, error_class)
SELECT id, 1, idempotency_key, 'bench', now(), 'permanent', true,
       (ARRAY['http_422', 'http_500', 'timeout'])[1 + id % 3]
FROM outbox.operations WHERE status IN ('quarantined', 'reconciling')
"""


@contextmanager
def served(console: Console) -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(console), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def pages(db_url: str) -> dict[str, str]:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT min(id) FROM outbox.operations WHERE status = 'quarantined'"
        ).fetchone()
    waiting = row[0] if row else 1
    return {
        "overview": "/",
        "overview's live part, within the refresh (one read for every tab)": "/live/overview",
        "operations": "/operations",
        "operations, quarantined": "/operations?status=quarantined",
        "operations, one tenant and type": "/operations?tenant=bench&operation_type=bench.op",
        "one operation": f"/operations/{waiting}",
        "one operation with its payload": f"/operations/{waiting}?payload=1",
        "search by id": f"/operations?q={waiting}",
        "failures": "/failures",
        "reconciliation": "/reconcile",
        "bulk dry run, quarantined": "/bulk?status=quarantined",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--operations", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="20,000 operations, 3 rounds")
    args = parser.parse_args()
    count, rounds = (20_000, 3) if args.quick else (args.operations, args.rounds)
    _support.print_machine()
    with _support.fresh_database(prefix="console_") as db_url:
        with psycopg.connect(db_url, autocommit=True) as conn:
            for first in range(0, count, CHUNK):
                last = min(first + CHUNK, count) - 1
                conn.execute(_INSERT, {"first": first, "last": last})
            conn.execute(_ATTEMPTS)
            conn.execute("VACUUM ANALYZE outbox.operations")
        settings = settings_from_mapping(
            {"providers": {"hook": {"type": "noop"}, "hook2": {"type": "noop"}}}, environ={}
        )
        console = Console(open_pool(db_url), settings, Options(), dsn=db_url)
        timings: dict[str, list[float]] = {name: [] for name in pages(db_url)}
        with served(console) as base, httpx.Client(base_url=base, timeout=30) as client:
            for _ in range(rounds):
                # Past the overview's shared read, so that each round's overview reads anew.
                time.sleep(REFRESH_SECONDS + 0.1)
                for name, path in pages(db_url).items():  # round-robin: noise hits all alike
                    began = time.perf_counter()
                    answer = client.get(path, follow_redirects=True)
                    timings[name].append(time.perf_counter() - began)
                    answer.raise_for_status()
    print(f"\n{count:,} operations, {rounds} rounds; each page's median and slowest\n")
    print("| page | median ms | slowest ms | under 1 s |")
    print("|---|---:|---:|---|")
    for name, seconds in timings.items():
        middle = statistics.median(seconds)
        verdict = "met" if max(seconds) < TARGET_SECONDS else "missed"
        print(f"| {name} | {middle * 1000:.1f} | {max(seconds) * 1000:.1f} | {verdict} |")


if __name__ == "__main__":
    main()
