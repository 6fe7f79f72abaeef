-- roles.sql: outbox's least-privilege roles, and exactly their privileges in this database.
--
--   outbox_producer    (NOLOGIN; grant it to your application's login role) may call
--                      outbox.enqueue, outbox.get_operation and outbox.bind_tenant, and
--                      nothing else.
--   outbox_dispatcher  (LOGIN, for `outbox run`) reads operations, updates their state, lease
--                      and result columns, inserts attempts, records reconciliation findings
--                      through outbox.record_check and outbox.touch_check, and takes tokens from
--                      rate-limited providers' buckets through outbox.take_tokens and
--                      outbox.throttle_bucket.
--   outbox_operator    (NOLOGIN; grant it to each person's login role, so the audit names them)
--                      reads operations, attempts and the audit, and changes operations only
--                      through the SECURITY DEFINER operator functions, which write the audit.
--
-- Applied by `outbox migrate --with-roles` after the numbered migrations, or by hand by a DBA,
-- after `outbox migrate`, connected to the application's database as a role with CREATEROLE
-- that owns the outbox schema (or a superuser):
--     psql -v ON_ERROR_STOP=1 --single-transaction -f roles.sql "dbname=app"
-- Run it again after every upgrade: it is idempotent, and it first revokes everything these
-- roles hold in the outbox schema, so the result is exactly what this file grants.
--
-- Roles are cluster-wide: they are created once, and each database gets its own grants. An
-- existing role keeps its attributes (LOGIN, password, ...): set them with ALTER ROLE.

-- Create the roles that do not exist yet. Another database's migrate may create one at the same
-- moment: the loser of that race finds it created, which is all it wanted.
DO $roles$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT * FROM (VALUES ('outbox_producer', 'NOLOGIN'),
                                   ('outbox_dispatcher', 'LOGIN'),
                                   ('outbox_operator', 'NOLOGIN')) AS wanted (name, login)
    LOOP
        CONTINUE WHEN EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = r.name);
        BEGIN
            EXECUTE pg_catalog.format('CREATE ROLE %I %s', r.name, r.login);
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END LOOP;
END
$roles$;

-- The dispatcher's session limits, as outbox/db/connect.py SESSION_LIMITS sets them per
-- connection; set on the role too, because behind PgBouncer in transaction mode a connection's
-- SET would leak into other clients' transactions, and the server enforces
-- idle_in_transaction_session_timeout even when the client forgets. Only written when missing,
-- so a rerun does not touch the cluster-wide catalog. Not plan_cache_mode: it spares planning
-- only for prepared statements, and behind a transaction pooler outbox prepares none.
DO $limits$
DECLARE
    s record;
BEGIN
    FOR s IN SELECT * FROM (VALUES ('lock_timeout', '2s'),
                                   ('default_transaction_isolation', 'read committed'),
                                   ('statement_timeout', '30s'),
                                   ('idle_in_transaction_session_timeout', '60s'),
                                   ('jit', 'off'),
                                   -- Through a transaction pooler no session SET reaches it.
                                   ('search_path', 'pg_catalog, pg_temp'),
                                   -- PostgreSQL 14+: a claim whose client vanished is rolled back.
                                   ('client_connection_check_interval', '1s')) AS l (name, value)
    LOOP
        CONTINUE WHEN s.name = 'client_connection_check_interval'
                  AND pg_catalog.current_setting('server_version_num')::integer < 140000;
        CONTINUE WHEN EXISTS (SELECT FROM pg_catalog.pg_roles
                              WHERE rolname = 'outbox_dispatcher'
                                AND s.name || '=' || s.value = ANY (rolconfig));
        -- A list setting takes its value as a list: quoted, 'pg_catalog, pg_temp' would name
        -- one schema of that name. The values are this script's own.
        EXECUTE pg_catalog.format(CASE WHEN s.name = 'search_path'
                                       THEN 'ALTER ROLE outbox_dispatcher SET %I = %s'
                                       ELSE 'ALTER ROLE outbox_dispatcher SET %I = %L' END,
                                  s.name, s.value);
    END LOOP;
END
$limits$;

-- Start from nothing in this database, so a rerun converges on exactly the grants below.
-- (Revoking a table privilege revokes the same privilege on each of its columns too.)
REVOKE ALL ON ALL TABLES IN SCHEMA outbox
    FROM PUBLIC, outbox_producer, outbox_dispatcher, outbox_operator;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox
    FROM PUBLIC, outbox_producer, outbox_dispatcher, outbox_operator;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox
    FROM PUBLIC, outbox_producer, outbox_dispatcher, outbox_operator;
REVOKE ALL ON SCHEMA outbox FROM PUBLIC, outbox_producer, outbox_dispatcher, outbox_operator;

GRANT USAGE ON SCHEMA outbox TO outbox_producer, outbox_dispatcher, outbox_operator;

-- Producer: the two functions of the producer API, and the binding of a transaction to its
-- tenant under tenant isolation (0038).
GRANT EXECUTE ON FUNCTION
    outbox.enqueue(text, text, text, text, text, jsonb, text, text, timestamptz, integer, text,
                   text),
    outbox.get_operation(text, text, text),
    outbox.bind_tenant(text)
TO outbox_producer;

-- Dispatcher: what outbox/db/statements.py's CLAIM, RECORD, UNCLAIM, HEARTBEAT, RESCUE,
-- ATTEMPT_RECORDED, RECONCILING_TO_CHECK, GAUGES and NEARING_KEY_EXPIRY need, and no more.
-- It reads every column (the claim returns the payload) but may change only the state, lease
-- and result columns; identity, request, key, attempt budget and reconciliation findings are
-- beyond its reach (0010's trigger guards the first three against everyone).
GRANT SELECT ON outbox.operations TO outbox_dispatcher;
GRANT UPDATE (status, status_reason, available_at, scheduled, attempts, lease_owner,
              lease_token, lease_expires_at, first_sent_at, last_attempt_at, provider_ref, result,
              last_error, last_error_class, updated_at, status_changed_at, finished_at,
              -- Attempts the provider did not act on, and the API version of the first send
              -- (RECORD_MANY; sql/0023).
              attempt_base, api_version, sent_scope)
    ON outbox.operations TO outbox_dispatcher;
-- The payload limit the claim applies (0019); only the schema owner changes it.
GRANT SELECT ON outbox.limits TO outbox_dispatcher;
GRANT SELECT, INSERT ON outbox.attempts TO outbox_dispatcher;
-- Its own mark while it waits idle for wake-ups (MARK_WAITING, UNMARK_WAITING; see 0012), and
-- the count of commits that woke no one, which MARK_WAITING reads (0029).
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.waiting_dispatchers TO outbox_dispatcher;
GRANT SELECT ON SEQUENCE outbox.unnotified_commits TO outbox_dispatcher;
GRANT EXECUTE ON FUNCTION
    outbox.record_check(bigint, text, text, jsonb, integer, integer),
    outbox.record_finding(bigint, text, text, text, text, jsonb, integer, integer),
    outbox.touch_check(bigint),
    outbox.claim_checks(text[], interval, integer),
    outbox.defer_check(bigint, interval, interval),
    outbox.defer_check(bigint, interval, interval, integer, integer),
    outbox.repair_ordering_key(text, text),
    -- `outbox run` checks the schema at start-up (0027).
    outbox.schema_version(),
    -- MARK_WAITING tries the wake-up gate (0039; wake_lock_space for dispatchers of earlier
    -- versions, 0029); the readiness probe asks which server answers (0030).
    outbox.try_wake_gate(),
    outbox.wake_lock_space(),
    outbox.server_identity()
TO outbox_dispatcher;
-- Ordering keys whose next operation waits for a dispatcher (REPAIRS_DUE; see 0015).
GRANT SELECT ON outbox.ordering_repairs, outbox.ordering_modes TO outbox_dispatcher;
-- The shared token buckets of rate-limited providers (TAKE_TOKENS, THROTTLE_BUCKET; see 0016):
-- only through these functions, never the table itself.
GRANT EXECUTE ON FUNCTION
    outbox.take_tokens(text, double precision, double precision, integer, integer),
    outbox.throttle_bucket(text, double precision, double precision, interval)
TO outbox_dispatcher;

-- Each provider's breaker as this dispatcher last wrote it, and operators' requests to reset a
-- breaker or probe now (WRITE_HEALTH, RESTORE_HEALTH, PROVIDER_ACTIONS_SINCE; see 0031).
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.provider_health TO outbox_dispatcher;
GRANT SELECT ON outbox.provider_actions TO outbox_dispatcher;

-- Operator: read everything (`outbox reconcile/quarantine list|show`, `outbox status`); change
-- only through the functions that write the audit, including `outbox reconcile check`'s.
GRANT SELECT ON outbox.operations, outbox.attempts, outbox.audit, outbox.ordering_modes,
    outbox.ordering_repairs, outbox.limits, outbox.provider_health, outbox.provider_actions
    TO outbox_operator;
GRANT EXECUTE ON FUNCTION
    outbox.resolve_operation(bigint, text, text, text),
    outbox.cancel_operation(bigint, text, text),
    outbox.request_cancel(bigint, text, text),
    outbox.replay_operation(bigint, text, text),
    outbox.request_reconciliation(bigint, text, text),
    outbox.retry_operation(bigint, text, text, boolean),
    -- `outbox reconcile resolve --no-effect` (0032).
    outbox.record_no_effect(bigint, text, text),
    outbox.record_check(bigint, text, text, jsonb, integer, integer),
    outbox.record_finding(bigint, text, text, text, text, jsonb, integer, integer),
    outbox.touch_check(bigint),
    outbox.defer_check(bigint, interval, interval),
    outbox.defer_check(bigint, interval, interval, integer, integer),
    outbox.set_ordering_mode(text, text, text),
    outbox.set_ordering_mode(text, text, text, text),
    -- `outbox providers reset|probe` (0031).
    outbox.request_provider_action(text, text, text, text),
    outbox.schema_version()
TO outbox_operator;
