"""The SQL the console issues of its own; what it shares with the CLI (the lists of `reconcile`
and `quarantine`, `show`, every action) it runs through outbox.oncall and outbox.db.statements,
so that the same fences and checks hold.

Each query reads through a partial index or a bounded range (docs/console.md, "What each page
costs"): the console is opened when something is wrong, often on a big table.
"""

from __future__ import annotations

from typing import Final

# The reconciling and quarantined operations by reason: the oldest %(examine)s of each status
# through operations_attention (each status a literal, so that the partial index serves it);
# WAITING_BY_STATUS counts them all. 0.7 s at 300,000 waiting when every one was read.
ATTENTION_BY_REASON: Final = """
SELECT status, coalesce(status_reason, '') AS reason, count(*) AS operations,
       extract(epoch FROM now() - min(status_changed_at))::float8 AS oldest_seconds
FROM ((SELECT status, status_reason, status_changed_at FROM outbox.operations
       WHERE status = 'reconciling' ORDER BY status_changed_at LIMIT %(examine)s::integer)
      UNION ALL
      (SELECT status, status_reason, status_changed_at FROM outbox.operations
       WHERE status = 'quarantined' ORDER BY status_changed_at LIMIT %(examine)s::integer)) AS o
GROUP BY status, status_reason
ORDER BY status, count(*) DESC
"""

# Unfinished operations whose key window closes within the horizon: they go to reconciliation
# unless they succeed first. A pending row that was sent has the error class of the attempt that
# failed it (every record of a failure writes one; only a retry under a new key, which clears
# first_sent_at too, and a success clear it), so the due ones are read through
# operations_pending_failed, which holds only those, not through the claim index, which holds
# every pending row (2.2 s at ten million rows with 700,000 pending, bench/console.py); the
# waiting and the scheduled through their own indexes, and the in-flight rows.
# Relies on: pending AND first_sent_at IS NOT NULL implies last_error_class IS NOT NULL.
KEY_WINDOW_CLOSING: Final = """
WITH w AS (
    SELECT * FROM unnest(%(providers)s::text[], %(windows)s::interval[])
        AS p (provider, closes_after)
), candidates AS (
    SELECT o.id FROM w CROSS JOIN LATERAL (
        SELECT o.id FROM outbox.operations o
        WHERE o.provider = w.provider AND o.status = 'pending' AND o.last_error_class IS NOT NULL
          AND o.first_sent_at IS NOT NULL
          AND o.first_sent_at + w.closes_after < now() + %(horizon)s::interval
        UNION
        SELECT o.id FROM outbox.operations o
        WHERE o.ordering_blocked AND o.provider = w.provider AND o.first_sent_at IS NOT NULL
          AND o.first_sent_at + w.closes_after < now() + %(horizon)s::interval
        UNION
        SELECT o.id FROM outbox.operations o
        WHERE o.scheduled AND o.provider = w.provider AND o.first_sent_at IS NOT NULL
          AND o.first_sent_at + w.closes_after < now() + %(horizon)s::interval
        UNION
        SELECT o.id FROM outbox.operations o
        WHERE o.status = 'in_flight' AND o.provider = w.provider AND o.first_sent_at IS NOT NULL
          AND o.first_sent_at + w.closes_after < now() + %(horizon)s::interval
    ) AS o
)
SELECT o.id, o.tenant_id, o.operation_type, o.operation_key, o.provider, o.status, o.attempts,
       extract(epoch FROM o.first_sent_at + w.closes_after - now())::float8 AS closes_in_seconds
FROM outbox.operations o JOIN candidates c ON c.id = o.id JOIN w ON w.provider = o.provider
ORDER BY o.first_sent_at + w.closes_after, o.id
LIMIT %(limit)s::integer
"""

# Each provider's breaker as its dispatchers last wrote it, the open or probing ones only, and
# the providers an operator paused (outbox providers pause): a few rows per provider.
BREAKERS: Final = """
SELECT provider, state, count(*) AS dispatchers, max(reason) AS reason,
       max(failure_rate)::float8 AS failure_rate, min(opened_at) AS opened_at
FROM outbox.provider_health
WHERE state <> 'closed' AND updated_at > now() - interval '10 minutes'
GROUP BY provider, state
ORDER BY provider
"""

# The inbox's conflicts seen in the last day (a delivery under a recorded identity with another
# body, or another contract): a small table, read at most CONFLICTS_SHOWN + 1 rows, since a
# hostile sender could fill it.
INBOX_CONFLICTS_TODAY: Final = """
SELECT count(*) AS conflicts FROM (
    SELECT 1 FROM outbox.inbox_conflicts
    WHERE last_seen_at > now() - interval '24 hours'
    LIMIT %(limit)s::integer
) AS c
"""

# The console's own list: every status, newest first, paged by id. The CLI's lists (oldest in
# the status first) cover reconciling and quarantined with their own index; this one answers
# "what happened lately" and a search. A filter that matches few of many rows reads far: each
# page stops at the statement timeout the console sets, and says so.
LIST_OPERATIONS: Final = """
SELECT id, tenant_id, operation_type, operation_key, provider, action, status, status_reason,
       attempts, last_error_class, created_at, status_changed_at, contract_version,
       extract(epoch FROM now() - status_changed_at)::float8 AS age_seconds
FROM outbox.operations o
WHERE (%(status)s::text IS NULL OR status = %(status)s::text)
  AND (%(provider)s::text IS NULL OR provider = %(provider)s::text)
  AND (%(reason)s::text IS NULL OR status_reason = %(reason)s::text)
  -- The last attempt's error class, as the CLI's --error and the failure groups take it.
  AND (%(error)s::text IS NULL
       OR (SELECT a.error_class FROM outbox.attempts a WHERE a.operation_id = o.id
           ORDER BY a.attempt DESC LIMIT 1) = %(error)s::text)
  AND (%(tenant)s::text IS NULL OR tenant_id = %(tenant)s::text)
  AND (%(operation_type)s::text IS NULL OR operation_type = %(operation_type)s::text)
  AND (%(since_ago)s::interval IS NULL OR status_changed_at >= now() - %(since_ago)s::interval)
  AND (%(before)s::bigint IS NULL OR id < %(before)s::bigint)
ORDER BY id DESC
LIMIT %(limit)s::integer
"""

# A search by the key an operation sends now (a retry moves it to the next generation), through
# outbox.operation_keys' (provider, idempotency_key) key: one probe per provider of a loose index
# scan. Joined to the operation, so that row-level security decides. (By identity: the CLI's
# FIND_BY_IDENTITY.)
FIND_BY_IDEMPOTENCY_KEY: Final = """
WITH RECURSIVE providers (provider) AS (
    (SELECT provider FROM outbox.operation_keys ORDER BY provider LIMIT 1)
    UNION ALL
    SELECT (SELECT k.provider FROM outbox.operation_keys k WHERE k.provider > p.provider
            ORDER BY k.provider LIMIT 1)
    FROM providers p WHERE p.provider IS NOT NULL
)
SELECT o.id FROM providers p
JOIN outbox.operation_keys k ON k.provider = p.provider AND k.idempotency_key = %(key)s
JOIN outbox.operations o ON o.id = k.operation_id
LIMIT 20
"""

# A provider's reference and a correlation id have no index (each would cost every operation
# an index entry, issue 41): searched among the newest operations only, in a bounded id range.
FIND_RECENT_BY_REFERENCE: Final = """
SELECT id FROM outbox.operations
WHERE id > (SELECT coalesce(max(id), 0) FROM outbox.operations) - %(window)s::bigint
  AND (provider_ref = %(text)s OR correlation_id = %(text)s)
ORDER BY id DESC
LIMIT 20
"""

# Failures grouped by cause: provider, the last attempt's error class (as `--error` selects
# them) and the status reason, for the operations that wait for a person: the oldest
# %(examine)s of each status, through operations_attention, the error one index probe per row
# (an incident of a million waiting would otherwise cost seconds; WAITING_BY_STATUS says how
# many there are in all).
FAILURE_GROUPS: Final = """
SELECT status, provider, coalesce(error, '') AS error, coalesce(status_reason, '') AS reason,
       count(*) AS operations,
       extract(epoch FROM now() - min(status_changed_at))::float8 AS oldest_seconds
FROM (
    SELECT o.status, o.provider, o.status_reason, o.status_changed_at,
           (SELECT a.error_class FROM outbox.attempts a WHERE a.operation_id = o.id
            ORDER BY a.attempt DESC LIMIT 1) AS error
    -- Each status named as a literal: only then does the planner take the partial index
    -- (a status from a join is not known to be one of its two, and it read the whole table).
    FROM ((SELECT * FROM outbox.operations WHERE status = 'reconciling'
           ORDER BY status_changed_at LIMIT %(examine)s::integer)
          UNION ALL
          (SELECT * FROM outbox.operations WHERE status = 'quarantined'
           ORDER BY status_changed_at LIMIT %(examine)s::integer)) AS o
) AS f
GROUP BY status, provider, error, status_reason
ORDER BY count(*) DESC, status, provider, error, status_reason
LIMIT %(limit)s::integer
"""

# How many operations wait for a person, by status: index-only through operations_attention.
WAITING_BY_STATUS: Final = """
SELECT status, count(*) AS operations FROM outbox.operations
WHERE status IN ('reconciling', 'quarantined')
GROUP BY status
"""

# The database's clock, which every key window is measured on (a page never trusts its own).
DB_NOW: Final = "SELECT now()"

# Whether the console's role could change outbox's tables without the audited functions: it
# needs no more than outbox_operator, which changes operations only through them.
TOO_PRIVILEGED: Final = """
SELECT current_user AS role,
       r.rolsuper OR has_table_privilege('outbox.operations', 'UPDATE')
           OR has_table_privilege('outbox.audit', 'DELETE') AS too_privileged
FROM pg_roles r WHERE r.rolname = current_user
"""

# The console's session: a statement that reads too far is stopped after 5 s, not left to hold
# a connection; no JIT, which compiled the gauges' query afresh on every read at ten million rows
# (outbox.db.connect.SESSION_LIMITS says so for the daemon). Not through a transaction pooler,
# where a session setting would reach other clients (docs/pgbouncer.md): there the role's own
# settings rule.
SESSION_SETTINGS: Final = "SET statement_timeout = '5s'; SET jit = off"
