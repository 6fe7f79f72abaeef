-- 0011: the SQL functions are the only doors into outbox for producers and operators.
--
-- * The entry points run as their owner (SECURITY DEFINER), so a role needs EXECUTE on one
--   function instead of privileges on the tables: a producer that may enqueue cannot read or
--   write the table directly, an operator cannot change a row without writing the audit.
-- * Every function pins search_path to pg_catalog then pg_temp (temporary objects can never
--   shadow anything) and names outbox objects in full, so a caller's search_path cannot swap in
--   its own table, function or operator.
-- * Nobody may EXECUTE any of them by default (PostgreSQL grants EXECUTE to PUBLIC): sql/roles.sql
--   grants each role its own. A migration that adds or replaces a function must keep these
--   properties (CREATE OR REPLACE resets SECURITY DEFINER and SET clauses);
--   tests/integration/test_roles.py checks every function of the schema.
-- * With tenant isolation on (sql/roles_tenant_rls.sql), the producer entry points act only for
--   the tenant the transaction is bound to: SQLSTATE 42501 otherwise.
--
-- Upgrading: roles other than the owner that called outbox.enqueue with table privileges need
-- EXECUTE now: `outbox migrate --with-roles`, then GRANT outbox_producer TO that role.

-- The tenant this transaction is bound to (set_config('outbox.tenant_id', 'acme', true)), or NULL.
-- Once a session has set a custom setting, reading it after the transaction gives '' rather than
-- NULL, hence the nullif.
CREATE FUNCTION outbox.bound_tenant() RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT nullif(current_setting('outbox.tenant_id', true), '')
$$;

-- With tenant isolation on, refuse to act for any tenant but the bound one.
-- Checked here explicitly, not left to the row-level policies alone: the producer entry points
-- run as the table owner, and a superuser or BYPASSRLS owner (the usual migrator) is never
-- subject to row-level security, FORCE or not. Isolation is on exactly when the operations table
-- has row-level security enabled, so the switch is one fact, not two.
CREATE FUNCTION outbox.require_tenant(tenant_id text) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    bound text := outbox.bound_tenant();
BEGIN
    IF tenant_id IS NULL OR btrim(tenant_id) = ''
       OR NOT (SELECT c.relrowsecurity FROM pg_catalog.pg_class c
               WHERE c.oid = 'outbox.operations'::regclass) THEN
        RETURN;  -- a missing or blank tenant_id is enqueue's OB002
    END IF;
    IF bound IS NULL THEN
        RAISE EXCEPTION 'tenant isolation is on: bind this transaction to its tenant first'
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'SELECT set_config(''outbox.tenant_id'', <tenant>, true) in the same '
                         'transaction, or outbox.bind_tenant(conn, tenant) in Python';
    END IF;
    IF bound <> tenant_id THEN
        RAISE EXCEPTION 'this transaction is bound to tenant %: it may not act for tenant %',
            bound, tenant_id
            USING ERRCODE = 'insufficient_privilege';
    END IF;
END;
$$;

-- enqueue keeps its body (0004) under a new name, called only from the checked entry point.
ALTER FUNCTION outbox.enqueue(text, text, text, text, text, jsonb, text, text, timestamptz,
                              integer, text)
    RENAME TO insert_operation;
COMMENT ON FUNCTION outbox.insert_operation IS
    'The body of outbox.enqueue, without the tenant check; not executable by any role.';

CREATE FUNCTION outbox.enqueue(
    tenant_id       text,
    operation_type  text,
    operation_key   text,
    provider        text,
    action          text,
    payload         jsonb,
    correlation_id  text        DEFAULT NULL,
    idempotency_key text        DEFAULT NULL,
    available_at    timestamptz DEFAULT NULL,
    max_attempts    integer     DEFAULT NULL,
    traceparent     text        DEFAULT NULL
) RETURNS TABLE (operation_id bigint, outcome text)
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT outbox.require_tenant(enqueue.tenant_id);
    SELECT * FROM outbox.insert_operation(
        enqueue.tenant_id, enqueue.operation_type, enqueue.operation_key, enqueue.provider,
        enqueue.action, enqueue.payload, enqueue.correlation_id, enqueue.idempotency_key,
        enqueue.available_at, enqueue.max_attempts, enqueue.traceparent);
$$;

COMMENT ON FUNCTION outbox.enqueue IS
    'Records an operation in the caller''s transaction: accepted (new) or duplicate; SQLSTATE OB001 on conflict, OB002 on invalid input, 42501 for another tenant than the bound one.';

CREATE OR REPLACE FUNCTION outbox.get_operation(tenant_id text, operation_type text,
                                                operation_key text)
RETURNS TABLE (
    operation_id     bigint,
    tenant_id        text,
    operation_type   text,
    operation_key    text,
    provider         text,
    action           text,
    status           text,
    status_reason    text,
    attempts         integer,
    provider_ref     text,
    result           jsonb,
    last_error       text,
    last_error_class text,
    idempotency_key  text,
    correlation_id   text,
    created_at       timestamptz,
    updated_at       timestamptz,
    available_at     timestamptz,
    finished_at      timestamptz
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT outbox.require_tenant(get_operation.tenant_id);
    SELECT o.id, o.tenant_id, o.operation_type, o.operation_key, o.provider, o.action, o.status,
           o.status_reason, o.attempts, o.provider_ref, o.result, o.last_error, o.last_error_class,
           o.idempotency_key, o.correlation_id, o.created_at, o.updated_at, o.available_at,
           o.finished_at
    FROM outbox.operations o
    WHERE o.tenant_id = get_operation.tenant_id
      AND o.operation_type = get_operation.operation_type
      AND o.operation_key = get_operation.operation_key
$$;

-- The operator actions and the reconciler's findings: each changes a row and writes the audit
-- in one call, as the owner.
ALTER FUNCTION outbox.resolve_operation(bigint, text, text, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.cancel_operation(bigint, text, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.replay_operation(bigint, text, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.request_reconciliation(bigint, text, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.retry_operation(bigint, text, text, boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.record_check(bigint, text, text, jsonb, integer, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.touch_check(bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;

-- Helpers, called only from the functions above (as the owner): pinned too, executable by no role.
ALTER FUNCTION outbox.check_text(text, text, integer, boolean) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.derive_idempotency_key(text, text, text) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.max_payload_bytes() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.insert_operation(text, text, text, text, text, jsonb, text, text,
                                       timestamptz, integer, text)
    SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.lock_for_action(bigint, text, text[]) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.require_reason(text, text) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.write_audit(outbox.operations, text, text, text, text, jsonb)
    SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.key_for_generation(text, integer) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.record_check(bigint, text, text, jsonb) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.audit_is_append_only() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox.audit_is_kept() SET search_path = pg_catalog, pg_temp;

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox FROM PUBLIC;
