-- roles.sql: outbox's least-privilege roles, and exactly their privileges in this database.
--
--   outbox_producer    (NOLOGIN; grant it to your application's login role) may call
--                      outbox.enqueue, outbox.get_operation and outbox.bind_tenant, and
--                      nothing else.
--   outbox_dispatcher  (NOLOGIN; grant it to the login role `outbox run` connects as) reads
--                      operations and attempts, and changes them only through the SECURITY
--                      DEFINER functions of sql/0040 (claim, record, unclaim, renew, rescue,
--                      stage), which enforce the lifecycle's transitions, the lease fence and
--                      bounded arguments; records reconciliation findings through
--                      outbox.record_check and outbox.touch_check, and takes tokens from
--                      rate-limited providers' buckets through outbox.take_tokens and
--                      outbox.throttle_bucket.
--   outbox_operator    (NOLOGIN; grant it to each person's login role, so the audit names them)
--                      reads operations, attempts and the audit, and changes operations only
--                      through the SECURITY DEFINER operator functions, which write the audit;
--                      reads the inbox's records and conflicts.
--   outbox_consumer    (NOLOGIN; grant it to a worker's login role) records the deliveries it
--                      handles through outbox.inbox_begin and outbox.inbox_complete (sql/0042),
--                      prunes expired records through outbox.inbox_prune, binds its tenant, and
--                      touches no outbox table itself.
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
--
-- The dispatcher's login is a member of outbox_dispatcher, with a password of its own:
--     CREATE ROLE outbox_run LOGIN PASSWORD '...' IN ROLE outbox_dispatcher;
-- and this file, run again, gives every such member the session limits below. An
-- outbox_dispatcher created LOGIN by an earlier version stays so (the dispatchers that log in
-- as it keep working) and gets a WARNING here: create the member login, switch `outbox run`
-- to it, then ALTER ROLE outbox_dispatcher NOLOGIN.

-- Create the roles that do not exist yet. Another database's migrate may create one at the same
-- moment: the loser of that race finds it created, which is all it wanted.
DO $roles$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT * FROM (VALUES ('outbox_producer', 'NOLOGIN'),
                                   ('outbox_dispatcher', 'NOLOGIN'),
                                   ('outbox_operator', 'NOLOGIN'),
                                   ('outbox_consumer', 'NOLOGIN')) AS wanted (name, login)
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
-- connection; set on the roles too, because behind PgBouncer in transaction mode a
-- connection's SET would leak into other clients' transactions, and the server enforces
-- idle_in_transaction_session_timeout even when the client forgets. A role's settings apply
-- only to sessions that log in as it, never to its members: so they are set on
-- outbox_dispatcher and on every login role that is a member of it (directly or not). Only
-- written when missing, so a rerun does not touch the cluster-wide catalog. Not
-- plan_cache_mode: it spares planning only for prepared statements, and behind a transaction
-- pooler outbox prepares none.
DO $limits$
DECLARE
    s record;
    r record;
BEGIN
    FOR r IN WITH RECURSIVE members (oid) AS (
                 SELECT oid FROM pg_catalog.pg_roles WHERE rolname = 'outbox_dispatcher'
                 UNION
                 SELECT m.member FROM pg_catalog.pg_auth_members m JOIN members ON m.roleid = members.oid
             )
             SELECT rolname, rolconfig FROM pg_catalog.pg_roles
             WHERE oid IN (SELECT oid FROM members)
               AND (rolname = 'outbox_dispatcher' OR rolcanlogin) AND NOT rolsuper
    LOOP
        FOR s IN SELECT * FROM (VALUES ('lock_timeout', '2s'),
                                       ('default_transaction_isolation', 'read committed'),
                                       ('statement_timeout', '30s'),
                                       ('idle_in_transaction_session_timeout', '60s'),
                                       ('jit', 'off'),
                                       -- Through a transaction pooler no session SET reaches it.
                                       ('search_path', 'pg_catalog, pg_temp'),
                                       -- PostgreSQL 14+: a claim whose client vanished is rolled
                                       -- back.
                                       ('client_connection_check_interval', '1s')) AS l (name, value)
        LOOP
            CONTINUE WHEN s.name = 'client_connection_check_interval'
                      AND pg_catalog.current_setting('server_version_num')::integer < 140000;
            CONTINUE WHEN s.name || '=' || s.value = ANY (r.rolconfig);
            -- A list setting takes its value as a list: quoted, 'pg_catalog, pg_temp' would name
            -- one schema of that name. The values are this script's own.
            EXECUTE pg_catalog.format(CASE WHEN s.name = 'search_path'
                                           THEN 'ALTER ROLE %I SET %I = %s'
                                           ELSE 'ALTER ROLE %I SET %I = %L' END,
                                      r.rolname, s.name, s.value);
        END LOOP;
    END LOOP;
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_dispatcher' AND rolcanlogin)
    THEN
        RAISE WARNING 'outbox_dispatcher can log in: create a login that is a member of it, '
                      'switch outbox run to it, then ALTER ROLE outbox_dispatcher NOLOGIN '
                      '(docs/operations.md, "Roles")';
    END IF;
END
$limits$;

-- Start from nothing in this database, so a rerun converges on exactly the grants below.
-- (Revoking a table privilege revokes the same privilege on each of its columns too.)
REVOKE ALL ON ALL TABLES IN SCHEMA outbox
    FROM PUBLIC, outbox_producer, outbox_dispatcher, outbox_operator, outbox_consumer;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox
    FROM PUBLIC, outbox_producer, outbox_dispatcher, outbox_operator, outbox_consumer;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox
    FROM PUBLIC, outbox_producer, outbox_dispatcher, outbox_operator, outbox_consumer;
REVOKE ALL ON SCHEMA outbox FROM PUBLIC, outbox_producer, outbox_dispatcher, outbox_operator, outbox_consumer;

GRANT USAGE ON SCHEMA outbox
    TO outbox_producer, outbox_dispatcher, outbox_operator, outbox_consumer;

-- Producer: the two functions of the producer API, and the binding of a transaction to its
-- tenant under tenant isolation (0038).
GRANT EXECUTE ON FUNCTION
    outbox.enqueue(text, text, text, text, text, jsonb, text, text, timestamptz, integer, text,
                   text, integer),
    outbox.get_operation(text, text, text),
    outbox.bind_tenant(text)
TO outbox_producer;

-- Dispatcher: what outbox/db/statements.py's statements need, and no more. It reads every
-- column (the claim returns the payload) and changes operations and attempts only through the
-- functions of sql/0040, which enforce the lifecycle's transitions, the lease fence and bounded
-- arguments: no INSERT, UPDATE or DELETE on either table.
GRANT SELECT ON outbox.operations TO outbox_dispatcher;
GRANT EXECUTE ON FUNCTION
    outbox.claim_fair(text, interval, integer, text[], integer[], text, text, integer),
    outbox.claim_one_group(text, interval, integer, text[], integer[]),
    outbox.claim_probe(text, text, interval, text),
    outbox.claim_fair_v2(text, interval, integer, text[], integer[], text, text, integer),
    outbox.claim_one_group_v2(text, interval, integer, text[], integer[]),
    outbox.claim_probe_v2(text, text, interval, text),
    outbox.claim_fair_v3(text, interval, integer, text[], integer[], text, text, integer),
    outbox.claim_one_group_v3(text, interval, integer, text[], integer[]),
    outbox.claim_probe_v3(text, text, interval, text),
    outbox.record_attempts(text, jsonb),
    outbox.unclaim(bigint, uuid, text, text, interval),
    outbox.renew_leases(bigint[], uuid[], interval),
    outbox.rescue_leases(integer, integer),
    outbox.stage_due(integer),
    outbox.expire_stray_leases(text, uuid[], timestamptz)
TO outbox_dispatcher;
-- The payload limit the claim applies (0019); only the schema owner changes it.
GRANT SELECT ON outbox.limits TO outbox_dispatcher;
-- outbox.attempts is a view of attempt_log and operations read with the reader's privileges
-- (sql/0050): both are granted.
GRANT SELECT ON outbox.attempts, outbox.attempt_log TO outbox_dispatcher;
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
GRANT SELECT ON outbox.operations, outbox.attempts, outbox.attempt_log, outbox.audit,
    outbox.ordering_modes, outbox.ordering_repairs, outbox.limits, outbox.provider_health,
    outbox.provider_actions
    TO outbox_operator;
-- `outbox show` finds an operation by its identity through the keys (sql/0051). Every tenant's:
-- the operator reads every tenant's operations anyway; no other role reads this table.
GRANT SELECT ON outbox.operation_keys TO outbox_operator;
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
    outbox.schema_version(),
    -- The origin every delivery of this database carries (0045), for `outbox inbox show`.
    outbox.origin()
TO outbox_operator;

-- Operator: the inbox's records and the conflicts seen against them (`outbox inbox`, 0042);
-- forgets a record through the audited function, and prunes.
GRANT SELECT ON outbox.inbox, outbox.inbox_conflicts TO outbox_operator;
GRANT EXECUTE ON FUNCTION
    outbox.inbox_forget(bigint, text, text, boolean),
    outbox.inbox_release(bigint, text, text),
    outbox.inbox_prune(integer),
    outbox.inbox_gauges()
TO outbox_operator;

-- Consumer: a worker records its deliveries in its own transactions through the functions of
-- sql/0042, which fence every record by its token and refuse a 5xx; no table privilege, so its
-- credential cannot delete a record (the next delivery would run again) nor write another's.
GRANT EXECUTE ON FUNCTION
    outbox.inbox_begin(text, text, text, text, bytea, interval, interval, uuid, bytea, text, text,
                       text, text),
    outbox.inbox_complete(bigint, uuid, integer, jsonb, bytea),
    outbox.inbox_prune(integer),
    -- External mode: the claim, its heartbeat and its failure.
    outbox.inbox_claim(text, text, text, text, bytea, interval, integer, interval, uuid, bytea,
                       text, text, text, text),
    outbox.inbox_renew(bigint, uuid, interval),
    outbox.inbox_fail(bigint, uuid, text),
    -- Its gauges (outbox/inbox/gauges.py).
    outbox.inbox_gauges(),
    outbox.bind_tenant(text)
TO outbox_consumer;

-- Contracts (sql/0052): producers, dispatchers and workers read one published version through
-- outbox.get_contract, never the table; operators read the table and publish, deprecate,
-- retire or reactivate through the audited functions (`outbox contracts`).
GRANT EXECUTE ON FUNCTION outbox.get_contract(text, integer)
TO outbox_producer, outbox_dispatcher, outbox_operator, outbox_consumer;
GRANT SELECT ON outbox.contracts, outbox.contract_types, outbox.contract_aliases
    TO outbox_operator;
GRANT EXECUTE ON FUNCTION
    outbox.publish_contract(text, integer, text, text, text, boolean),
    outbox.set_contract_state(text, integer, text, text, text),
    -- Whether a type's producers must name a version (0053).
    outbox.set_contract_requirement(text, boolean, text, text),
    outbox.set_contract_alias(text, text, text, text)
TO outbox_operator;
