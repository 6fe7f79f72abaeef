"""Every SQL statement outbox issues, in one place, each with its purpose.

Schema changes live in the numbered files of ``sql/``; this module holds the statements that run
against that schema. Parameters are always bound, never formatted into the text.
"""

from __future__ import annotations

from typing import Final

# The channel outbox.enqueue notifies on commit; dispatchers LISTEN on it.
ENQUEUE_CHANNEL: Final = "outbox_enqueue"

# --- producer API -------------------------------------------------------------------------------

# Record an operation in the caller's transaction (the SQL function validates and deduplicates).
ENQUEUE: Final = """
SELECT operation_id, outcome FROM outbox.enqueue(
    tenant_id       => %(tenant_id)s::text,
    operation_type  => %(operation_type)s::text,
    operation_key   => %(operation_key)s::text,
    provider        => %(provider)s::text,
    action          => %(action)s::text,
    payload         => %(payload)s::jsonb,
    correlation_id  => %(correlation_id)s::text,
    idempotency_key => %(idempotency_key)s::text,
    available_at    => %(available_at)s::timestamptz,
    max_attempts    => %(max_attempts)s::integer,
    traceparent     => %(traceparent)s::text
)
"""

# An operation's persisted state by identity, through the read API function.
GET_OPERATION: Final = """
SELECT operation_id, tenant_id, operation_type, operation_key, provider, action, status,
       status_reason, attempts, provider_ref, result, last_error, last_error_class,
       idempotency_key, correlation_id, created_at, updated_at, available_at, finished_at
FROM outbox.get_operation(%(tenant_id)s::text, %(operation_type)s::text, %(operation_key)s::text)
"""

# --- status -------------------------------------------------------------------------------------

# How many operations are in each status.
COUNT_BY_STATUS: Final = "SELECT status, count(*) FROM outbox.operations GROUP BY status"

# Age of the oldest pending operation that is due now, by the database clock; served by the
# partial claim index. NULL when none is due.
OLDEST_DUE_PENDING_AGE: Final = """
SELECT extract(epoch FROM now() - min(available_at))::float8
FROM outbox.operations
WHERE status = 'pending' AND available_at <= now()
"""

# --- migrations ---------------------------------------------------------------------------------

# Serialises migrators across processes and hosts: a session-level advisory lock on a fixed key
# (the bytes of "outbox:m").
MIGRATION_LOCK_KEY: Final = int.from_bytes(b"outbox:m", "big")
ACQUIRE_MIGRATION_LOCK: Final = "SELECT pg_advisory_lock(%s)"
RELEASE_MIGRATION_LOCK: Final = "SELECT pg_advisory_unlock(%s)"

# Bound how long a statement queues for a lock: behind live traffic, fail fast and retry later.
SET_LOCK_TIMEOUT: Final = "SELECT set_config('lock_timeout', %s, false)"
RESET_LOCK_TIMEOUT: Final = "RESET lock_timeout"

CREATE_SCHEMA: Final = "CREATE SCHEMA IF NOT EXISTS outbox"

# The record of applied migrations; created by the runner itself, before the first migration.
CREATE_MIGRATIONS_TABLE: Final = """
CREATE TABLE IF NOT EXISTS outbox.schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    applied_by text        NOT NULL DEFAULT current_user
)
"""

# Which migrations this database has, with the checksum of each file as it was applied.
APPLIED_MIGRATIONS: Final = (
    "SELECT version, name, checksum FROM outbox.schema_migrations ORDER BY version"
)

RECORD_MIGRATION: Final = (
    "INSERT INTO outbox.schema_migrations (version, name, checksum) VALUES (%s, %s, %s)"
)
