"""Every SQL statement outbox issues, in one place, each with its purpose.

Schema changes live in the numbered files of ``sql/``; this module holds the statements that run
against that schema. Parameters are always bound, never formatted into the text.

The schema as the migrations leave it, every function's definition in force included, is
``sql/schema.sql`` (generated: ``python -m outbox.db.schema_dump``). A statement that calls SQL
functions of outbox, or fires triggers of its tables, names them in a ``Relies on:`` line; one
without calls none and fires none (but the internal ones of the foreign key of attempts).
"""

from __future__ import annotations

from typing import Final

# The channel dispatchers LISTEN on. Not outbox.enqueue but the trigger it fires,
# operations_wake_dispatchers (outbox.wake_dispatchers(), sql/0029), notifies on it at the
# producer's COMMIT while a dispatcher is marked waiting (MARK_WAITING); where a synchronous
# standby is named, only the first such commit, which takes the marks and says so with the
# payload WAKE_TAKEN.
ENQUEUE_CHANNEL: Final = "outbox_enqueue"
WAKE_TAKEN: Final = "taken"

# --- producer API -------------------------------------------------------------------------------

# Record an operation in the caller's transaction (the SQL function validates and deduplicates).
# Relies on: outbox.enqueue() (sql/schema.sql); its INSERT fires, deferred to COMMIT, the
# triggers operations_wake_dispatchers and (with an ordering_key) operations_take_turn.
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
    traceparent     => %(traceparent)s::text,
    ordering_key    => %(ordering_key)s::text
)
"""
# With a contract's version (sql/0053): apart, so that a producer that names none runs on a
# schema from before it too.
ENQUEUE_UNDER_CONTRACT: Final = """
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
    traceparent     => %(traceparent)s::text,
    ordering_key    => %(ordering_key)s::text,
    contract_version => %(contract_version)s::integer
)
"""
# One published contract (sql/0052), for the producer's check of a payload before enqueue and the
# dispatcher's before the first send (outbox.dispatch.contracts).
GET_CONTRACT: Final = "SELECT canonical, digest, state FROM outbox.get_contract(%s, %s)"

# Bind this transaction to a tenant: set_config's third argument (true) makes the setting end
# with the transaction, so a pooled connection never carries it into the next one. Beside it,
# the start of this transaction, which outbox.bound_tenant() compares (sql/0038): a value left
# by a SET of the session names an earlier one, and binds nothing. What outbox.bind_tenant()
# does, written out, so that it needs neither that function nor its grant.
BIND_TENANT: Final = """
SELECT pg_catalog.set_config('outbox.tenant_id', %s::text, true),
       pg_catalog.set_config('outbox.tenant_bound_at',
           pg_catalog.to_char(pg_catalog.transaction_timestamp() AT TIME ZONE 'UTC',
                              'YYYYMMDDHH24MISSUS'), true)
"""

# An operation's persisted state by identity, through the read API function.
# Relies on: outbox.get_operation().
GET_OPERATION: Final = """
SELECT operation_id, tenant_id, operation_type, operation_key, provider, action, status,
       status_reason, attempts, provider_ref, result, last_error, last_error_class,
       idempotency_key, correlation_id, created_at, updated_at, available_at, finished_at,
       contract_version
FROM outbox.get_operation(%(tenant_id)s::text, %(operation_type)s::text, %(operation_key)s::text)
"""

# --- migrations ---------------------------------------------------------------------------------

# Serialises migrators across processes and hosts: a session-level advisory lock on a fixed key
# (the bytes of "outbox:m").
MIGRATION_LOCK_KEY: Final = int.from_bytes(b"outbox:m", "big")
ACQUIRE_MIGRATION_LOCK: Final = "SELECT pg_advisory_lock(%s)"
RELEASE_MIGRATION_LOCK: Final = "SELECT pg_advisory_unlock(%s)"

# Bound how long a statement queues for a lock: behind live traffic, fail fast and retry later.
SET_LOCK_TIMEOUT: Final = "SELECT pg_catalog.set_config('lock_timeout', %s, false)"
RESET_LOCK_TIMEOUT: Final = "RESET lock_timeout"
# Every session of outbox's runs with this search_path (issue 20): a function or operator that
# someone planted in public (where PostgreSQL before 15 let anyone create one) can never take
# over a call of ours, whose own objects are all named with their schema.
SEARCH_PATH: Final = "pg_catalog, pg_temp"
PIN_SEARCH_PATH: Final = "SELECT pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', false)"
RESET_SEARCH_PATH: Final = "RESET search_path"
SHOW_SEARCH_PATH: Final = "SELECT pg_catalog.current_setting('search_path')"

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

# --- dispatcher ---------------------------------------------------------------------------------
# The claim protocol: claim (one short transaction) -> call the provider with no transaction
# open -> record (one short transaction, fenced by the lease token and attempt number).
# Every write of the dispatcher's to operations and attempts is a SECURITY DEFINER function of
# sql/0040, which enforces the lifecycle's transitions, the lease fence and bounded arguments
# (outbox_dispatcher holds no INSERT, UPDATE or DELETE on either table): the statements below
# call them, and the comments say what each does. The claims are 0054's _v3, which add to each
# row what a delivery carries for its receiver (ordering key, fingerprint, origin: 0045's _v2)
# and the version of its contract, which the dispatcher checks the payload against before the
# first send.

# While a single (provider, tenant) group has claimable rows, a fair claim has nothing to share
# out: lease its oldest due rows, up to the limit and its provider's cap, without CLAIM's steps
# (a claim of one row at 0.28 against 0.68 ms of the database's CPU, of 100 rows 2.1 against
# 2.8 ms). Takes nothing when the first and the last entry of operations_claim_group belong to
# different groups: then CLAIM must run (outbox.db.store.Store.claim).
CLAIM_ONE_GROUP: Final = """
SELECT * FROM outbox.claim_one_group_v3(%(worker)s::text, %(lease)s::interval, %(limit)s::integer,
                                        %(cap_providers)s::text[], %(caps)s::integer[])
"""

# A half-open breaker's probe (outbox.dispatch.breaker.Breaker): one due row of the provider, from
# the next five tenants after the last probe's (around to the first): of each, the ten newest due
# rows that have not failed (among its 200 newest) and its ten oldest. Rows that have not failed
# in this budget come first: the newest, then those handed back unsent, then the oldest never
# tried, the nearest tenant first, at random within each; failing that, the row whose last try
# is the oldest. The ordinary claim goes oldest first, so the failures that opened the breaker
# came from the oldest rows: the newest are the other part of the line, and a burst of bad
# payloads queued ahead of good ones is not every probe (issue 37). Every scan reads the claim
# index, forwards or backwards; SKIP LOCKED as in CLAIM.
CLAIM_PROBE: Final = """
SELECT * FROM outbox.claim_probe_v3(%(worker)s::text, %(provider)s::text, %(lease)s::interval,
                                    %(after_tenant)s::text)
"""

# Each provider's breaker in this dispatcher (outbox/dispatch/health.py; sql/0031), one row per
# provider and worker, written every few seconds.
WRITE_HEALTH: Final = """
INSERT INTO outbox.provider_health AS h (provider, worker, state, reason, failure_rate, calls,
                                         failing_alone, opened_at, next_probe_at, open_for,
                                         updated_at)
SELECT u.provider, %(worker)s, u.state, u.reason, u.failure_rate, u.calls, u.failing_alone,
       now() - u.opened_ago, now() + u.probe_in, u.open_for, now()
FROM unnest(%(providers)s::text[], %(states)s::text[], %(reasons)s::text[],
            %(rates)s::real[], %(calls)s::integer[], %(alone)s::integer[],
            %(opened_ago)s::interval[], %(probe_in)s::interval[], %(open_for)s::interval[])
     AS u (provider, state, reason, failure_rate, calls, failing_alone, opened_ago, probe_in,
           open_for)
ON CONFLICT (provider, worker) DO UPDATE
SET state = excluded.state, reason = excluded.reason, failure_rate = excluded.failure_rate,
    calls = excluded.calls, failing_alone = excluded.failing_alone,
    opened_at = excluded.opened_at, next_probe_at = excluded.next_probe_at,
    open_for = excluded.open_for, updated_at = excluded.updated_at
"""

# Every few minutes per dispatcher, not at each write (the table has no index on updated_at):
# rows no one has written for a day go, and so do rows dated more than a day ahead of this
# clock, which no dispatcher writes (any dispatcher login may write this table) and which would
# otherwise never go.
PRUNE_HEALTH: Final = """
DELETE FROM outbox.provider_health
WHERE updated_at < now() - interval '1 day' OR updated_at > now() + interval '1 day'
"""

# At start-up: for each of these providers, the newest word any dispatcher wrote in the last ten
# minutes, if that word is "not closed" and no operator reset the provider since the breaker
# opened (or since the row was written). A process that restarts (a crash loop, a deploy) starts
# with that breaker open instead of sending a burst to a provider that is down. A row dated
# ahead of this clock by more than a minute (a failover's skew) is not a dispatcher's: it is
# left out, so that it neither outlives a reset nor hides the newest real row.
RESTORE_HEALTH: Final = """
SELECT n.provider, n.reason,
       -- Bounded: a row written to keep a provider shut for ever (any dispatcher login may
       -- write this table) holds it for an hour at most, and only if no one resets it.
       extract(epoch FROM CASE WHEN isfinite(n.next_probe_at)
                               THEN least(greatest(n.next_probe_at - now(), interval '0'),
                                          interval '1 hour')
                               ELSE interval '0' END)::float8 AS probe_in,
       extract(epoch FROM least(greatest(coalesce(n.open_for, interval '0'), interval '0'),
                                interval '1 hour'))::float8 AS open_for
FROM (SELECT DISTINCT ON (h.provider) h.*
      FROM outbox.provider_health h
      WHERE h.provider = ANY (%(providers)s::text[])
        AND h.updated_at > now() - interval '10 minutes'
        AND h.updated_at <= now() + interval '1 minute'
      ORDER BY h.provider, h.updated_at DESC) n
WHERE n.state <> 'closed'
  AND NOT EXISTS (SELECT FROM outbox.provider_actions a
                  WHERE a.provider = n.provider AND a.action = 'reset'
                    -- least() passes over a NULL opened_at.
                    AND a.at >= least(n.opened_at, n.updated_at))
"""

# Operators' requests (`outbox providers reset|probe`) this dispatcher has not acted on yet.
PROVIDER_ACTIONS_SINCE: Final = """
SELECT id, provider, action FROM outbox.provider_actions WHERE id > %(after)s ORDER BY id
"""
LAST_PROVIDER_ACTION: Final = "SELECT coalesce(max(id), 0) FROM outbox.provider_actions"

# Lease due pending rows to this worker, a fair share from each (provider, tenant) group: a
# tenant's or a provider's backlog cannot fill every batch while another's operations wait. The
# groups are visited from just after the cursor (the first group of the last claim), wrapping
# around, so the head of the line rotates; each gets an even share of the batch (and of its
# provider's cap), then the groups with more fill what the others left. Within a group rows go
# oldest first. Every step reads the partial index operations_claim_group, which holds only
# claimable rows, so finished rows, rows waiting for their ordering key, rows not due yet (they
# are `scheduled`, out of the index until STAGE, sql/0019) and providers capped at 0 (breaker
# open, no rate tokens) cost nothing. SKIP LOCKED: concurrent dispatchers take other
# rows instead of queueing behind these.
CLAIM: Final = """
SELECT * FROM outbox.claim_fair_v3(%(worker)s::text, %(lease)s::interval, %(limit)s::integer,
                                   %(cap_providers)s::text[], %(caps)s::integer[],
                                   %(after_provider)s::text, %(after_tenant)s::text,
                                   %(max_groups)s::integer)
"""

# Record attempts' outcomes and their operations' next statuses, one or many in a statement (the
# dispatcher's group commit), each only if this worker still holds the lease of that attempt: a
# worker whose lease expired matches no row and changes nothing. One attempt row per outcome
# recorded; returns (operation_id, attempt) of those recorded. An operation whose cancel an
# operator requested while it was in flight becomes cancelled instead of its next status (unless
# it succeeded): the trigger operations_cancel_when_attempt_ends (sql/0019) sees to it, here and
# in UNCLAIM and RESCUE.
# Relies on: triggers operations_cancel_when_attempt_ends (a cancel requested in flight) and
# operations_pass_turn (an ordered operation settles: the next of its key may go).
RECORD_MANY: Final = "SELECT * FROM outbox.record_attempts(%(worker)s::text, %(batch)s::jsonb)"

# Give a claimed row back without an attempt having been made: released at shutdown (to
# pending) or routed to reconciliation by the key-window rule before sending.
# Relies on: triggers operations_cancel_when_attempt_ends and, to reconciling,
# operations_pass_turn.
UNCLAIM: Final = """
SELECT * FROM outbox.unclaim(%(id)s::bigint, %(lease_token)s::uuid, %(status)s::text,
                              %(reason)s::text, %(delay)s::interval)
"""

# Did this worker's record of this attempt commit? Asked when its acknowledgement was lost.
# Not the rescuer's row for the attempt, which names the worker whose lease expired: that
# worker's record never committed.
# A record or unclaim that found no lease: is the row there at all? After a failover to a
# standby that lacked it (asynchronous replication), it is not, and "lease taken" would mislead.
# By id and key: the new primary's sequence may hand the lost row's id to another operation (a
# sequence logs its values ahead, and that WAL can be lost too).
OPERATION_EXISTS: Final = """
SELECT 1 FROM outbox.operations WHERE id = %(id)s AND idempotency_key = %(idempotency_key)s
"""

ATTEMPT_RECORDED: Final = """
SELECT 1 FROM outbox.attempts
WHERE operation_id = %(id)s AND attempt = %(attempt)s AND worker = %(worker)s
  AND error_class IS DISTINCT FROM 'lease_expired'
"""

# Renew the leases of calls still in flight, so a slow but live call is never rescued.
HEARTBEAT: Final = """
SELECT * FROM outbox.renew_leases(%(ids)s::bigint[], %(tokens)s::uuid[], %(lease)s::interval)
"""

# Take back rows whose dispatcher stopped renewing its lease. Its attempt may have reached the
# provider, so it is recorded as unknown and the key window starts from it. One that used up its
# budget is in doubt, as policy.after_failure has it: to reconciliation, never to quarantine,
# whose replay would send it again on a person's word alone.
# Relies on: triggers operations_cancel_when_attempt_ends and, when reconciling,
# operations_pass_turn.
RESCUE: Final = """
SELECT * FROM outbox.rescue_leases(%(limit)s::integer, %(max_attempts)s::integer)
"""

# Ordering keys whose next operation a settled head could not promote (a producer of the key was
# committing at that moment; sql/0015). Each is repaired in a transaction of its own.
# Oldest note first: a key whose lock a producer holds is re-dated by its failed repair
# (sql/0019), so it goes to the back of the line instead of holding up the keys behind it.
REPAIRS_DUE: Final = """
SELECT tenant_id, ordering_key FROM outbox.ordering_repairs
GROUP BY tenant_id, ordering_key ORDER BY min(noted_at) LIMIT %(limit)s::integer
"""
# Relies on: outbox.repair_ordering_key().
REPAIR_ORDERING_KEY: Final = "SELECT outbox.repair_ordering_key(%(tenant_id)s, %(ordering_key)s)"

# Scheduled operations that are due join the claim index (sql/0019): the oldest first, a batch
# at a time, SKIP LOCKED so that the stagers of several processes split the work. Returns how
# many were staged and how long until the next scheduled one is due (NULL: none is scheduled).
STAGE: Final = "SELECT * FROM outbox.stage_due(%(limit)s::integer)"

# Which server session answers: two connections that get the same one go through a
# transaction-mode pooler (outbox.db.connect's check at startup).
SERVER_PID: Final = "SELECT pg_catalog.pg_backend_pid()"

# A session setting for this connection (set_config with is_local = false).
SET_SESSION_LIMIT: Final = "SELECT pg_catalog.set_config(%s, %s, false)"

# Only the fault tests' simulated bug (failpoints.LEAK_TRANSACTION) takes a row lock like this.
LOCK_OPERATION: Final = "SELECT id FROM outbox.operations WHERE id = %s FOR UPDATE"

# An idle dispatcher that LISTENs marks itself waiting, so that the next producer's commit
# notifies (sql/0029); it refreshes the mark while idle, and clears up marks of dispatchers long
# dead. In the same transaction it tries the wake-up lock, the gate only outbox's roles can
# take (sql/0039): true when no producer's commit was between its wake-up check and its rows
# becoming visible, so that sleeping loses no wake-up; and reads the count of commits that woke
# no one, to tell whether one went by since its last mark (then it claims once more).
# Relies on: outbox.try_wake_gate().
MARK_WAITING: Final = """
WITH expired AS (
    DELETE FROM outbox.waiting_dispatchers
    WHERE seen_at < now() - interval '1 hour' AND worker <> %(worker)s
), marked AS (
    INSERT INTO outbox.waiting_dispatchers (worker) VALUES (%(worker)s)
    ON CONFLICT (worker) DO UPDATE SET seen_at = now()
    RETURNING worker
)
SELECT outbox.try_wake_gate() AS quiet,
       (SELECT CASE WHEN is_called THEN last_value ELSE 0 END
        FROM outbox.unnotified_commits) AS unnotified
FROM marked
"""

# Busy with a backlog (or stopping): producers need not notify on this dispatcher's account.
UNMARK_WAITING: Final = "DELETE FROM outbox.waiting_dispatchers WHERE worker = %(worker)s"

# Wake-ups: dispatchers LISTEN on the channel of ENQUEUE_CHANNEL.
LISTEN: Final = "LISTEN outbox_enqueue"

# Is this connection still alive? Sent on the LISTEN connection after a quiet spell.
PROBE: Final = "SELECT 1"

# Readiness (outbox/db/probe.py): a writable primary answers. A standby, or a demoted primary,
# is in recovery and not one to be ready on. The system identifier and timeline tell a failover's
# new server from the old one; the clock dates the change.
# Relies on: outbox.server_identity() (sql/0030).
PROBE_SERVER: Final = """
SELECT in_recovery, system_identifier, timeline, server_now FROM outbox.server_identity()
"""

# Leases of this worker that no call of this process holds, taken before ``since``: after a
# failover, rows whose records the new server lost (docs/operations.md, "Database failover").
# Made expired, so that the rescuer takes them back now, as it takes back any lease: recorded as
# an attempt of unknown outcome, and re-sent with the same key.
EXPIRE_STRAY_LEASES: Final = """
SELECT * FROM outbox.expire_stray_leases(%(worker)s::text, %(held)s::uuid[],
                                          %(since)s::timestamptz)
"""

# --- operators ----------------------------------------------------------------------------------

# The operations in one status that need a person, oldest first; served by operations_attention.
# The filters are those of `list` and of the bulk actions (outbox/oncall/operators.py, Filters);
# NULL means "any". Paged by keyset on (status_changed_at, id): a page stays right while earlier
# rows leave the status, as they do while someone replays them.
_FILTERS: Final = """
  AND (%(provider)s::text IS NULL OR provider = %(provider)s::text)
  AND (%(reason)s::text IS NULL OR status_reason = %(reason)s::text)
  -- --error: the last attempt's error class (unknown_provider, http_422, ...), what `show` prints
  AND (%(error)s::text IS NULL
       OR (SELECT a.error_class FROM outbox.attempts a WHERE a.operation_id = o.id
           ORDER BY a.attempt DESC LIMIT 1) = %(error)s::text)
  AND (%(tenant)s::text IS NULL OR tenant_id = %(tenant)s::text)
  -- --since as a duration is measured on the database clock, like every other age.
  AND (%(since_ago)s::interval IS NULL OR status_changed_at >= now() - %(since_ago)s::interval)
  AND (%(since_at)s::timestamptz IS NULL OR status_changed_at >= %(since_at)s::timestamptz)
  AND (%(after_at)s::timestamptz IS NULL
       OR (status_changed_at, id) > (%(after_at)s::timestamptz, %(after_id)s::bigint))
ORDER BY status_changed_at, id
LIMIT %(limit)s::integer
"""
_ATTENTION_WHERE: Final = (
    """
FROM outbox.operations o
WHERE status = %(status)s::text"""
    + _FILTERS
)

# With each one's idempotency key (`list --json`): what a person searches a provider for.
LIST_ATTENTION: Final = (
    """
SELECT id, tenant_id, operation_type, operation_key, provider, action, status_reason, attempts,
       last_error_class, last_error, status_changed_at, idempotency_key,
       extract(epoch FROM now() - status_changed_at)::float8 AS age_seconds,
       checked_at, check_finding, check_state
"""
    + _ATTENTION_WHERE
)

# The ids a bulk action acts on: taken once, shown, confirmed, then acted on one by one, so that
# the action touches exactly what the person saw counted (operations that match later do not).
SELECT_ATTENTION_IDS: Final = "SELECT id" + _ATTENTION_WHERE

# `outbox pending list`: the pending operations whose last attempt failed (retrying: waiting out
# a backoff, or their provider's breaker), oldest in the status first, with the filters of `list`
# (--error: the last attempt's error class, `error` here). Served by the partial index
# operations_pending_failed (sql/0033), which holds those rows only: never a read of every
# pending row.
LIST_PENDING_FAILED: Final = (
    """
SELECT id, tenant_id, operation_type, operation_key, provider, action, attempts, attempt_base,
       max_attempts, last_error_class, last_error, status_changed_at, scheduled,
       ordering_blocked, idempotency_key,
       extract(epoch FROM now() - status_changed_at)::float8 AS age_seconds,
       greatest(extract(epoch FROM available_at - now()), 0)::float8 AS due_in_seconds,
       (SELECT a.error_class FROM outbox.attempts a WHERE a.operation_id = o.id
        ORDER BY a.attempt DESC LIMIT 1) AS error
FROM outbox.operations o
WHERE status = 'pending' AND last_error_class IS NOT NULL"""
    + _FILTERS
)

# The first rows of what a bulk action is about to act on, as `list` shows them (its preview).
LIST_IDS: Final = """
SELECT id, tenant_id, operation_type, operation_key, provider, action, status_reason, attempts,
       last_error_class, last_error, status_changed_at,
       extract(epoch FROM now() - status_changed_at)::float8 AS age_seconds,
       checked_at, check_finding, check_state
FROM outbox.operations
WHERE id = ANY (%(ids)s::bigint[])
ORDER BY status_changed_at, id
"""

# One operation, everything but the payload (shown only when asked for, as its stored JSON text:
# decoding it here would turn exact numbers into floats, and fail on a row no one can decode).
SHOW_OPERATION: Final = """
SELECT id, tenant_id, operation_type, operation_key, provider, action, status, status_reason,
       attempts, attempt_base, max_attempts, idempotency_key, key_generation, correlation_id,
       available_at, first_sent_at, last_attempt_at, provider_ref, result, last_error,
       last_error_class, checked_at, check_finding, check_state, check_details, created_at,
       updated_at, finished_at, encode(fingerprint, 'hex') AS fingerprint, contract_version,
       extract(epoch FROM now() - status_changed_at)::float8 AS age_seconds,
       CASE WHEN %(with_payload)s::boolean THEN payload::text END AS payload
FROM outbox.operations
WHERE id = %(id)s
"""

# Through the keys (sql/0051): the operation's row has no index on its identity. Joined to the
# operation, so that the row-level security of outbox.operations decides what is found.
FIND_BY_IDENTITY: Final = """
SELECT o.id FROM outbox.operation_keys k JOIN outbox.operations o ON o.id = k.operation_id
WHERE k.tenant_id = %(tenant_id)s AND k.operation_type = %(operation_type)s
  AND k.operation_key = %(operation_key)s
"""

ATTEMPT_HISTORY: Final = """
SELECT attempt, started_at, finished_at, worker, outcome, sent, error_class, error_message,
       http_status, provider_request_id, idempotency_key
FROM outbox.attempts WHERE operation_id = %(id)s ORDER BY attempt
"""

AUDIT_HISTORY: Final = """
SELECT at, actor, coalesce(db_user, details->>'db_user') AS db_user, action, reason,
       from_status, to_status, details
FROM outbox.audit WHERE operation_id = %(id)s ORDER BY at, id
"""

# Operator actions: each a SQL function that changes the status and writes the audit at once.
# Relies on: the function named, and its UPDATE fires the triggers of a status change:
# operations_pass_turn (RESOLVE, CANCEL, REQUEST_CANCEL, REQUEST_RECONCILIATION, RECORD_FINDING
# when found or refused), operations_rejoin_line (REPLAY, RETRY) and operations_immutable (RETRY:
# the key moves to its next generation).
RESOLVE: Final = "SELECT outbox.resolve_operation(%(id)s, %(provider_ref)s, %(reason)s, %(actor)s)"
CANCEL: Final = "SELECT outbox.cancel_operation(%(id)s, %(reason)s, %(actor)s)"
# `outbox cancel`: any unfinished operation; one in flight when its attempt ends (sql/0019).
REQUEST_CANCEL: Final = "SELECT outbox.request_cancel(%(id)s, %(reason)s, %(actor)s)"
REPLAY: Final = "SELECT outbox.replay_operation(%(id)s, %(reason)s, %(actor)s)"
REQUEST_RECONCILIATION: Final = (
    "SELECT outbox.request_reconciliation(%(id)s, %(reason)s, %(actor)s)"
)
RETRY: Final = "SELECT outbox.retry_operation(%(id)s, %(reason)s, %(actor)s, %(force)s)"
# `reconcile resolve --no-effect`: a person found no effect at the provider; recorded as a
# not_found finding with their reason, so that retry needs no force (sql/0032).
# Relies on: outbox.record_no_effect().
RECORD_NO_EFFECT: Final = "SELECT outbox.record_no_effect(%(id)s, %(reason)s, %(actor)s)"
# Of these reconciling operations, those `reconcile retry` takes without --force: a not_found
# finding taken 30 s or more after the last attempt, as retry_operation (sql/0009) requires; the
# function itself still decides, row by row, under its lock.
RETRYABLE_IDS: Final = """
SELECT id FROM outbox.operations
WHERE id = ANY (%(ids)s::bigint[]) AND status = 'reconciling' AND check_finding = 'not_found'
  AND NOT coalesce(checked_at < last_attempt_at + interval '30 seconds', false)
"""
# Of these reconciling operations, those whose last attempt was 30 s ago or more: a person's
# "no effect" is taken of those only (outbox.record_no_effect, sql/0034; the function decides).
SETTLED_IDS: Final = """
SELECT id FROM outbox.operations
WHERE id = ANY (%(ids)s::bigint[]) AND status = 'reconciling'
  AND NOT coalesce(last_attempt_at > now() - interval '30 seconds', false)
"""
# The status of each of these operations (`reconcile resolve --refs-file`: every line's
# operation must be reconciling before any is resolved).
STATUS_OF_IDS: Final = """
SELECT id, status FROM outbox.operations WHERE id = ANY (%(ids)s::bigint[])
"""
# A finding with the found object's state: found, refused, undecided or not_found (sql/0021).
# Returns the operation's status after it, or 'stale' if it moved on since the check was taken.
RECORD_FINDING: Final = """
SELECT outbox.record_finding(%(id)s, %(finding)s, %(found_ref)s, %(state)s, %(actor)s,
                             %(details)s::jsonb, %(generation)s::integer, %(attempts)s::integer)
"""
# A look-up failed: note the time, so the periodic reconciler moves on to other operations.
# A failed lookup proves nothing: the operation is due again after retry_in (sql/0013). Fenced
# as RECORD_FINDING is: a check of an earlier episode of the operation defers nothing (sql/0020).
# Relies on: outbox.defer_check(bigint, interval, interval, integer, integer).
DEFER_CHECK: Final = """
SELECT outbox.defer_check(%(id)s, %(recheck_after)s::interval, %(retry_in)s::interval,
                          %(generation)s::integer, %(attempts)s::integer)
"""

# Ordering keys: the operation types with a mode of their own, and setting one (sql/0015).
LIST_ORDERING_MODES: Final = (
    "SELECT operation_type, on_failure, updated_at, updated_by FROM outbox.ordering_modes "
    "ORDER BY operation_type"
)
# Relies on: outbox.set_ordering_mode(text, text, text, text).
SET_ORDERING_MODE: Final = (
    "SELECT outbox.set_ordering_mode(%(operation_type)s, %(mode)s, %(actor)s, %(reason)s)"
)

# --- reconciler ---------------------------------------------------------------------------------

# Reconciling operations to look up at their provider: one by id, or every one not checked since
# ``recheck_after`` (NULL: all), oldest first.
RECONCILING_TO_CHECK: Final = """
SELECT id, provider, action, idempotency_key, key_generation, attempts,
       -- From the first attempt of any key generation (sql/0022), not just the current one's.
       least(coalesce(first_sent_at, created_at),
             (SELECT min(a.started_at) FROM outbox.attempts a
              WHERE a.operation_id = o.id AND a.sent)) AS first_sent_at,
       coalesce(last_attempt_at, created_at) AS last_attempt_at,
       -- Every key that may have reached the provider, and a window that grows with each
       -- re-check (sql/0023). Not the payload: `reconcile check --all` may list 100,000 rows,
       -- so each check reads its own (CHECK_PAYLOAD).
       ARRAY(SELECT k FROM (SELECT a.idempotency_key FROM outbox.attempts a
                            WHERE a.operation_id = o.id AND a.sent
                            UNION SELECT o.idempotency_key) AS ks (k) ORDER BY k) AS keys,
       greatest(coalesce(last_attempt_at, created_at),
                CASE WHEN checked_at IS NOT NULL THEN least(checked_at, now()) END) AS search_until,
       now() AS checked_now, api_version, sent_scope
FROM outbox.operations o
WHERE status = 'reconciling'
  AND (%(id)s::bigint IS NULL OR id = %(id)s::bigint)
  -- `reconcile check` with filters: the ids they selected (outbox/cli/bulk.py).
  AND (%(ids)s::bigint[] IS NULL OR id = ANY (%(ids)s::bigint[]))
  -- Only providers that can be asked: the others wait for a person, and must not fill every batch.
  -- NULL: any provider (one operation asked for by id, whose provider may not be configured).
  AND (%(providers)s::text[] IS NULL OR provider = ANY (%(providers)s::text[]))
  AND (%(recheck_after)s::interval IS NULL OR checked_at IS NULL
       OR checked_at < now() - %(recheck_after)s::interval)
ORDER BY status_changed_at, id
LIMIT %(limit)s::integer
"""

# `outbox reconcile check`: the providers of the reconciling operations it is about to check (one
# by id, those of ids, or every one), so that it builds those alone: an on-call laptop need not
# hold every provider's secret. Reads the index operations_attention (or the primary key).
RECONCILING_PROVIDERS: Final = """
SELECT DISTINCT provider FROM outbox.operations
WHERE status = 'reconciling'
  AND (%(id)s::bigint IS NULL OR id = %(id)s::bigint)
  AND (%(ids)s::bigint[] IS NULL OR id = ANY (%(ids)s::bigint[]))
"""

# `outbox providers`: every dispatcher's breakers, newest first within each provider; rows not
# written for `stale` are a process that is gone (or cannot reach the database). Any dispatcher
# login may write this table, so what no dispatcher writes comes back NULL (shown as unknown):
# a time infinite or more than a century from now (Python holds no year past 9999), a rate that
# is no share (NaN, Infinity), an open period below 0 or over a century. A row dated more than a
# minute ahead of this clock is `suspect` (RESTORE_HEALTH leaves it out). probe_in: the next
# probe from now, 0 if overdue (the row's own time is up to 30 s old).
PROVIDER_HEALTH: Final = """
SELECT h.provider, h.worker, h.state, h.reason,
       CASE WHEN h.failure_rate BETWEEN 0 AND 1 THEN h.failure_rate END AS failure_rate,
       h.calls, h.failing_alone,
       CASE WHEN h.opened_at BETWEEN b.earliest AND b.latest THEN h.opened_at END AS opened_at,
       CASE WHEN h.next_probe_at BETWEEN b.earliest AND b.latest
            THEN h.next_probe_at END AS next_probe_at,
       CASE WHEN h.next_probe_at BETWEEN b.earliest AND b.latest
            THEN greatest(h.next_probe_at - now(), interval '0') END AS probe_in,
       CASE WHEN h.open_for BETWEEN interval '0' AND interval '100 years'
            THEN h.open_for END AS open_for,
       CASE WHEN h.updated_at BETWEEN b.earliest AND b.latest THEN h.updated_at END AS updated_at,
       h.updated_at < now() - %(stale)s::interval AS stale,
       h.updated_at > now() + interval '1 minute' AS suspect
FROM outbox.provider_health h,
     (SELECT now() - interval '100 years' AS earliest, now() + interval '100 years' AS latest) b
WHERE %(provider)s::text IS NULL OR h.provider = %(provider)s::text
ORDER BY h.provider, h.updated_at DESC, h.worker
"""
# `outbox providers reset|probe`: the request every dispatcher acts on, with its audit row.
# Relies on: outbox.request_provider_action().
REQUEST_PROVIDER_ACTION: Final = (
    "SELECT outbox.request_provider_action(%(provider)s, %(action)s, %(actor)s, %(reason)s)"
)

# The newest migration applied (sql/0027), checked by `outbox run` at start-up.
# Relies on: outbox.schema_version().
SCHEMA_VERSION: Final = "SELECT outbox.schema_version()"

# One operation's payload, as text, for the check of a row listed without it.
CHECK_PAYLOAD: Final = "SELECT payload::text FROM outbox.operations WHERE id = %(id)s"

# The daemon's passes: the due checks, marked checked as they are taken, so that each is looked
# up by one replica (sql/0013).
# Relies on: outbox.claim_checks().
CLAIM_CHECKS: Final = """
SELECT * FROM outbox.claim_checks(%(providers)s::text[], %(recheck_after)s::interval,
                                  %(limit)s::integer)
"""

# --- pruning ------------------------------------------------------------------------------------

# One batch of finished operations, oldest ids first, from just after the last batch. The scan
# walks the primary key, so it needs no index of its own; SKIP LOCKED leaves alone a row an
# operator is acting on. Attempts follow by ON DELETE CASCADE, the keys rows by a statement
# trigger (sql/0051), freeing each identity and key.
PRUNE_BATCH: Final = """
WITH doomed AS (
    SELECT id FROM outbox.operations
    WHERE id > %(after)s::bigint
      AND status IN ('succeeded', 'cancelled')
      AND finished_at < now() - %(older_than)s::interval
    ORDER BY id
    LIMIT %(batch)s::integer
    FOR UPDATE SKIP LOCKED
)
DELETE FROM outbox.operations o USING doomed WHERE o.id = doomed.id
RETURNING o.id
"""

# One batch of ordering keys (sql/0019's lock rows), from just after the last batch: those with
# no unfinished operation left go. SKIP LOCKED: a key a producer is committing under right now
# stays; should a producer lock it a moment after it went, lock_ordering_key makes it again.
# Returns how many went and the last key visited (no row: the walk is done).
PRUNE_ORDERING_KEYS: Final = """
WITH visited AS MATERIALIZED (
    SELECT k.tenant_id, k.ordering_key FROM outbox.ordering_keys k
    WHERE (k.tenant_id, k.ordering_key) > (%(after_tenant)s::text, %(after_key)s::text)
    ORDER BY k.tenant_id, k.ordering_key
    LIMIT %(batch)s::integer
    FOR UPDATE SKIP LOCKED
),
gone AS (
    DELETE FROM outbox.ordering_keys k USING visited v
    WHERE k.tenant_id = v.tenant_id AND k.ordering_key = v.ordering_key
      -- Neither a head (operations_ordering_heads) nor one waiting (operations_ordering_blocked).
      AND NOT EXISTS (SELECT 1 FROM outbox.operations o
                      WHERE o.tenant_id = k.tenant_id AND o.ordering_key = k.ordering_key
                        AND o.ordering_key IS NOT NULL AND NOT o.ordering_blocked
                        AND o.status IN ('pending', 'in_flight', 'quarantined', 'reconciling'))
      AND NOT EXISTS (SELECT 1 FROM outbox.operations o
                      WHERE o.ordering_blocked AND o.tenant_id = k.tenant_id
                        AND o.ordering_key = k.ordering_key)
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone), last.tenant_id, last.ordering_key
FROM (SELECT tenant_id, ordering_key FROM visited
      ORDER BY tenant_id DESC, ordering_key DESC LIMIT 1) AS last
"""

COUNT_PRUNABLE: Final = """
SELECT count(*) FROM outbox.operations
WHERE status IN ('succeeded', 'cancelled') AND finished_at < now() - %(older_than)s::interval
"""

# --- gauges -------------------------------------------------------------------------------------

# The database-wide gauges, one cheap statement on a timer: every count but succeeded reads a
# partial index; succeeded is exact while the table is small and estimated from the planner's
# row count after that (EXACT_COUNT_LIMIT in outbox.daemon.gauges).
GAUGES: Final = """
SELECT
    -- Three partial indexes between them hold every pending row: the claimable, the waiting
    -- for their ordering key, and the scheduled (which may be waiting as well).
    (SELECT count(*) FROM outbox.operations
     WHERE status = 'pending' AND NOT ordering_blocked AND NOT scheduled)
      + (SELECT count(*) FROM outbox.operations WHERE ordering_blocked)
      + (SELECT count(*) FROM outbox.operations WHERE scheduled AND NOT ordering_blocked)
      AS pending,
    (SELECT count(*) FROM outbox.operations WHERE ordering_blocked) AS ordering_blocked,
    (SELECT count(*) FROM outbox.operations WHERE status = 'in_flight') AS in_flight,
    (SELECT count(*) FROM outbox.operations WHERE status = 'reconciling') AS reconciling,
    (SELECT count(*) FROM outbox.operations WHERE status = 'quarantined') AS quarantined,
    (SELECT count(*) FROM outbox.operations WHERE status = 'cancelled') AS cancelled,
    (SELECT CASE WHEN c.reltuples < %(exact_limit)s
                 THEN (SELECT count(*) FROM outbox.operations WHERE status = 'succeeded')
                 END
     FROM pg_class c WHERE c.oid = 'outbox.operations'::regclass) AS succeeded_exact,
    (SELECT greatest(c.reltuples, 0)::bigint FROM pg_class c
     WHERE c.oid = 'outbox.operations'::regclass) AS estimated_rows,
    -- The oldest due pending operation's age, overall and per provider (the alerts hold back a
    -- provider's age while its credentials are refused: one cause pages once). Providers not in
    -- %(providers)s share one entry, '_unconfigured' (outbox/observability/metric_labels.py): a
    -- producer that names a thousand providers adds no entries.
    (SELECT max(e.age::float8) FROM jsonb_each_text(g.by_provider) AS e (provider, age))
      AS oldest_pending_age,
    g.by_provider AS oldest_pending_by_provider,
    (SELECT extract(epoch FROM now() - min(status_changed_at))::float8 FROM outbox.operations
     WHERE status = 'reconciling') AS oldest_reconciling_age
FROM (SELECT
    -- The earliest row of each (provider, tenant) group by a loose index scan: one probe per
    -- group instead of a read of every pending row.
    -- A scheduled row that is due but not staged yet (no dispatcher runs) counts too, for its
    -- provider. The time is bounded below: a row written around enqueue's checks (0019) with
    -- '-infinity' must not break the gauges.
    (WITH RECURSIVE heads AS (
         (SELECT provider, tenant_id, available_at FROM outbox.operations
          WHERE status = 'pending' AND NOT ordering_blocked AND NOT scheduled
          ORDER BY provider, tenant_id, available_at LIMIT 1)
         UNION ALL
         SELECT nx.* FROM heads h CROSS JOIN LATERAL (
             SELECT provider, tenant_id, available_at FROM outbox.operations
             WHERE status = 'pending' AND NOT ordering_blocked AND NOT scheduled
               AND (provider, tenant_id) > (h.provider, h.tenant_id)
             ORDER BY provider, tenant_id, available_at LIMIT 1) nx
     ),
     due AS (
         SELECT provider, available_at FROM heads WHERE available_at <= now()
         UNION ALL
         (SELECT provider, available_at FROM outbox.operations
          WHERE scheduled AND NOT ordering_blocked AND available_at <= now()
          ORDER BY available_at LIMIT 1)
     )
     SELECT coalesce(jsonb_object_agg(d.provider, d.age), '{}'::jsonb)
     FROM (SELECT CASE WHEN provider = ANY (%(providers)s::text[]) THEN provider
                       ELSE '_unconfigured' END AS provider,
                  extract(epoch FROM now() - min(greatest(available_at,
                                                 now() - interval '100 years')))::float8 AS age
           FROM due GROUP BY 1) AS d) AS by_provider
) AS g
"""

# Operations waiting for an earlier one with their ordering key, by what holds up the key: the
# status of its head, or 'none' when it has none (a repair is due; sql/0015). Reads the two small
# ordering indexes only.
ORDERING_BLOCKED: Final = """
SELECT coalesce(h.status, 'none') AS behind, count(*) AS keys, sum(b.waiting)::bigint AS waiting
FROM (SELECT tenant_id, ordering_key, count(*) AS waiting FROM outbox.operations
      WHERE ordering_blocked GROUP BY tenant_id, ordering_key) AS b
LEFT JOIN LATERAL (
    SELECT o.status FROM outbox.operations o
    WHERE o.tenant_id = b.tenant_id AND o.ordering_key = b.ordering_key
      AND o.ordering_key IS NOT NULL AND NOT o.ordering_blocked
      AND o.status IN ('pending', 'in_flight', 'quarantined', 'reconciling')
    -- In mode skip a set-aside operation stays beside the head: the head is the one that waits.
    ORDER BY o.status IN ('pending', 'in_flight') DESC, o.id
    LIMIT 1
) AS h ON true
GROUP BY 1 ORDER BY 1
"""

# `outbox status`: the due pending operations per provider (the claim's index, provider first,
# read as a skip scan: one probe per provider), each count capped, and when the first of them
# would be quarantined as unknown_provider should no dispatcher know the provider (enqueue time
# plus the grace, outbox/dispatch/dispatcher.py). The cap on providers bounds a table a hostile
# producer filled with a million provider names.
PENDING_BY_PROVIDER: Final = """
WITH RECURSIVE names (provider) AS (
    (SELECT provider FROM outbox.operations
     WHERE status = 'pending' AND NOT ordering_blocked AND NOT scheduled
     ORDER BY provider LIMIT 1)
    UNION ALL
    SELECT (SELECT o.provider FROM outbox.operations o
            WHERE o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
              AND o.provider > n.provider
            ORDER BY o.provider LIMIT 1)
    FROM names n WHERE n.provider IS NOT NULL
)
SELECT n.provider, c.due, c.first_enqueued + %(grace)s::interval AS quarantined_from,
       c.first_enqueued + %(grace)s::interval <= now() AS quarantine_due
FROM names n
CROSS JOIN LATERAL (
    SELECT count(*) AS due, min(s.created_at) AS first_enqueued
    FROM (SELECT o.created_at FROM outbox.operations o
          WHERE o.status = 'pending' AND NOT o.ordering_blocked AND NOT o.scheduled
            AND o.provider = n.provider
          LIMIT %(count_limit)s::integer) AS s
) AS c
WHERE n.provider IS NOT NULL
LIMIT %(provider_limit)s::integer
"""

# `outbox status`: per provider, the pending operations whose last attempt failed, by that
# attempt's error class (what `pending list --error` takes): "50 pending with http_500". A skip
# scan of the partial index operations_pending_failed (sql/0033: one probe per provider), at most
# %(count_limit)s of each provider's rows (the oldest), each with one probe of the attempts'
# primary key: bounded whatever the table's size.
PENDING_FAILED_BY_PROVIDER: Final = """
WITH RECURSIVE names (provider) AS (
    (SELECT provider FROM outbox.operations
     WHERE status = 'pending' AND last_error_class IS NOT NULL
     ORDER BY provider LIMIT 1)
    UNION ALL
    SELECT (SELECT o.provider FROM outbox.operations o
            WHERE o.status = 'pending' AND o.last_error_class IS NOT NULL
              AND o.provider > n.provider
            ORDER BY o.provider LIMIT 1)
    FROM names n WHERE n.provider IS NOT NULL
)
SELECT n.provider, e.error, count(*) AS pending
FROM (SELECT provider FROM names WHERE provider IS NOT NULL
      LIMIT %(provider_limit)s::integer) AS n
CROSS JOIN LATERAL (
    SELECT (SELECT a.error_class FROM outbox.attempts a WHERE a.operation_id = o.id
            ORDER BY a.attempt DESC LIMIT 1) AS error
    FROM outbox.operations o
    WHERE o.status = 'pending' AND o.last_error_class IS NOT NULL AND o.provider = n.provider
    ORDER BY o.status_changed_at, o.id
    LIMIT %(count_limit)s::integer
) AS e
GROUP BY n.provider, e.error
ORDER BY n.provider, count(*) DESC, e.error
"""

# Per provider: pending operations whose key window closes within the hour, so they will go to
# reconciliation unless they succeed first.
NEARING_KEY_EXPIRY: Final = """
-- Pending rows are in one of three partial indexes: the claim's (provider first), while they
-- wait behind an ordering key the waiting rows', while not due the scheduled rows' (which
-- carries provider and first_sent_at). A condition that names none of their predicates reads
-- the whole table: 1.8 s at ten million rows (bench/growth.py).
SELECT p.provider,
       (SELECT count(*) FROM outbox.operations o
        WHERE o.provider = p.provider AND o.status = 'pending' AND NOT o.ordering_blocked
          AND NOT o.scheduled AND o.first_sent_at IS NOT NULL
          AND o.first_sent_at + p.closes_after < now() + interval '1 hour')
     + (SELECT count(*) FROM outbox.operations o
        WHERE o.ordering_blocked AND o.provider = p.provider
          AND o.first_sent_at IS NOT NULL
          AND o.first_sent_at + p.closes_after < now() + interval '1 hour')
     + (SELECT count(*) FROM outbox.operations o
        WHERE o.scheduled AND NOT o.ordering_blocked AND o.provider = p.provider
          AND o.first_sent_at IS NOT NULL
          AND o.first_sent_at + p.closes_after < now() + interval '1 hour')
FROM unnest(%(providers)s::text[], %(windows)s::interval[]) AS p(provider, closes_after)
"""

# --- demo ---------------------------------------------------------------------------------------

DEMO_COUNTS: Final = """
SELECT status, count(*) FROM outbox.operations WHERE tenant_id = %(tenant)s
GROUP BY status ORDER BY status
"""

DEMO_REPORT: Final = """
SELECT id, operation_key, provider, status, attempts, provider_ref, status_reason
FROM outbox.operations WHERE tenant_id = %(tenant)s ORDER BY id
"""

# The payload as the dispatcher sends it (its stored JSON text), for the queue demo's repeat: a
# JetStream duplicate counts as ours only if the kept message's body is the same bytes.
DEMO_PAYLOAD: Final = """
SELECT payload::text FROM outbox.operations WHERE id = %(id)s
"""

# --- provider limits ----------------------------------------------------------------------------
# The token buckets of rate-limited providers, shared by every replica (sql/0016). Refilled by
# the database clock only.

# Give back unused tokens and take new ones, several providers in one round trip. The providers
# come sorted by name, so two dispatchers lock bucket rows in the same order and never deadlock.
# Relies on: outbox.take_tokens().
TAKE_TOKENS: Final = """
SELECT b.provider, t.granted, t.tokens
FROM unnest(%(providers)s::text[], %(rates)s::float8[], %(bursts)s::float8[],
            %(wanted)s::integer[], %(returned)s::integer[])
     WITH ORDINALITY AS b(provider, rate, burst, wanted, returned, n)
CROSS JOIN LATERAL outbox.take_tokens(b.provider, b.rate, b.burst, b.wanted, b.returned) AS t
ORDER BY b.n
"""

# A 429: the provider's bucket goes into debt for the provider's Retry-After.
# Relies on: outbox.throttle_bucket().
THROTTLE_BUCKET: Final = """
SELECT outbox.throttle_bucket(%(provider)s::text, %(rate)s::float8, %(burst)s::float8,
                              %(pause)s::interval)
"""
