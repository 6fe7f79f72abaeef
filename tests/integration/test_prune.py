"""`outbox prune`: finished operations older than asked leave in batches with their attempts;
everything else stays, and so does the audit."""

from __future__ import annotations

from datetime import timedelta

import psycopg

from outbox.oncall.prune import prune_finished
from tests.support.cli import outbox_cli
from tests.support.dispatch import enqueue_many, rows


def finish(url: str, ids: list[int], status: str, ago: str) -> None:
    with psycopg.connect(url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = %s, provider_ref = 'ref', attempts = 1, "
            "finished_at = now() - %s::interval, status_changed_at = now() WHERE id = ANY(%s)",
            (status, ago, ids),
        )
        conn.execute(
            "INSERT INTO outbox.attempt_log (operation_id, attempt, idempotency_key, worker, "
            "started_at, outcome, sent) SELECT id, 1, idempotency_key, 'w', now(), "
            "'succeeded', true FROM outbox.operations WHERE id = ANY(%s)",
            (ids,),
        )


def test_prune_takes_old_finished_operations_in_batches_and_leaves_the_rest(db_url: str) -> None:
    old = enqueue_many(db_url, 7, prefix="old")
    recent = enqueue_many(db_url, 2, prefix="recent")
    waiting = enqueue_many(db_url, 3, prefix="waiting")
    finish(db_url, old[:6], "succeeded", "40 days")
    finish(db_url, recent, "succeeded", "1 day")
    with psycopg.connect(db_url) as conn:  # an old cancellation, audited
        conn.execute(
            "UPDATE outbox.operations SET status = 'quarantined', "
            "status_reason = 'permanent_failure' WHERE id = %s",
            (old[6],),
        )
        conn.execute("SELECT outbox.cancel_operation(%s, 'duplicate invoice', 'oncall')", (old[6],))
        conn.execute(
            "UPDATE outbox.operations SET finished_at = now() - interval '40 days' WHERE id = %s",
            (old[6],),
        )
        conn.execute(
            "UPDATE outbox.operations SET status = 'reconciling', status_reason = "
            "'key_window_passed' WHERE id = %s",
            (waiting[0],),
        )
    batches: list[int] = []
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert prune_finished(conn, timedelta(days=30), dry_run=True) == 7
        assert prune_finished(conn, timedelta(days=30), batch=3, on_batch=batches.append) == 7
        assert prune_finished(conn, timedelta(days=30)) == 0
    assert batches == [3, 3, 1]
    left = rows(db_url, "SELECT id FROM outbox.operations ORDER BY id")
    assert [i for (i,) in left] == sorted(recent + waiting)
    assert rows(db_url, "SELECT count(*) FROM outbox.attempts") == [(2,)]  # the recent ones'
    assert rows(db_url, "SELECT count(*) FROM outbox.audit WHERE operation_id = %s", (old[6],)) == [
        (1,)
    ]


def test_the_prune_command_reports_and_a_dry_run_deletes_nothing(
    cli_env: dict[str, str], db_url: str
) -> None:
    ids = enqueue_many(db_url, 4)
    finish(db_url, ids[:3], "succeeded", "2 hours")
    dry = outbox_cli(cli_env, "prune", "--older-than", "1h", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would prune 3 operation(s) finished more than 1h ago" in dry.stdout
    assert rows(db_url, "SELECT count(*) FROM outbox.operations") == [(4,)]
    done = outbox_cli(cli_env, "prune", "--older-than", "1h", "--batch", "2")
    assert done.returncode == 0, done.stderr
    assert "pruned 3 operation(s)" in done.stdout
    assert rows(db_url, "SELECT id, status FROM outbox.operations") == [(ids[3], "pending")]


def test_prune_needs_an_age(cli_env: dict[str, str]) -> None:
    done = outbox_cli(cli_env, "prune")
    assert done.returncode == 2 and "--older-than" in done.stderr


def test_prune_removes_the_locks_of_ordering_keys_no_unfinished_operation_uses(
    db_url: str, cli_env: dict[str, str]
) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "SELECT outbox.enqueue(tenant_id => 'acme', operation_type => 'x', "
            "operation_key => 'op-' || g, provider => 'hook', action => 'a', payload => '{}', "
            "ordering_key => 'key-' || (g % 5)) FROM generate_series(1, 10) g"
        )
    done = [
        i
        for (i,) in rows(
            db_url, "SELECT id FROM outbox.operations WHERE ordering_key IN ('key-1', 'key-2')"
        )
    ]
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET ordering_blocked = false WHERE id = ANY(%s)", (done,)
        )
    finish(db_url, done, "succeeded", "40 days")
    result = outbox_cli(cli_env, "prune", "--older-than", "30d", "--batch", "2")
    assert result.returncode == 0, result.stderr
    assert "pruned 2 idle ordering key(s)" in result.stdout
    assert rows(db_url, "SELECT ordering_key FROM outbox.ordering_keys ORDER BY 1") == [
        ("key-0",),
        ("key-3",),
        ("key-4",),
    ]
