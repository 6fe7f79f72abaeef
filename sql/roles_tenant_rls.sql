-- roles_tenant_rls.sql: tenant isolation for producers, with row-level security (ENABLE and
-- FORCE) on outbox.operations. Applied after roles.sql by `outbox migrate --with-roles
-- --tenant-rls`, or by hand (psql -v ON_ERROR_STOP=1 --single-transaction -f ...), as the
-- owner of the outbox schema or a superuser. Idempotent; running migrate without --tenant-rls
-- later leaves isolation on.
--
-- A transaction acts for one tenant once it runs
--     SELECT outbox.bind_tenant('acme');   -- this transaction only
-- (outbox.bind_tenant(conn, "acme") in Python). The binding ends with the transaction, so a
-- pooled connection never carries it into the next one: it sets outbox.tenant_id and, beside
-- it, outbox.tenant_bound_at, the start of this transaction, and counts only where the two
-- agree (0038). A session-level SET of outbox.tenant_id, which would outlive the transaction,
-- binds nothing.
--
-- Who sees what:
--   outbox_dispatcher, outbox_operator  every tenant (policy operations_all_tenants).
--   producers                           never touch the table: outbox.enqueue and
--                                       outbox.get_operation refuse (42501) any tenant but the
--                                       bound one, and an unbound transaction altogether
--                                       (outbox.require_tenant, 0011).
--   the table owner                     FORCE subjects it to the policies too, which matters
--                                       because every SECURITY DEFINER function runs as the
--                                       owner: bound, it sees that tenant only (so the producer
--                                       entry points are fenced twice); unbound, every tenant
--                                       (operator functions, migrations, the DBA). A superuser
--                                       or BYPASSRLS owner skips all policies, which is why
--                                       0011 checks the tenant explicitly as well.
--   any other role granted access       the bound tenant's rows only; unbound, none.
-- outbox.attempts and outbox.audit carry no tenant and are readable by the dispatcher and
-- operator roles only.
--
-- To switch isolation off again:
--     ALTER TABLE outbox.operations NO FORCE ROW LEVEL SECURITY;
--     ALTER TABLE outbox.operations DISABLE ROW LEVEL SECURITY;

DO $rls$
DECLARE
    owner_role text := (SELECT pg_catalog.pg_get_userbyid(c.relowner) FROM pg_catalog.pg_class c
                        WHERE c.oid = 'outbox.operations'::regclass);
    -- The tenant this transaction bound, as outbox.bound_tenant() reads it (0038): NULL for none
    -- and for a value left from an earlier transaction.
    bound CONSTANT text :=
        'CASE WHEN pg_catalog.current_setting(''outbox.tenant_bound_at'', true) = '
        'pg_catalog.to_char(pg_catalog.transaction_timestamp() AT TIME ZONE ''UTC'', '
        '''YYYYMMDDHH24MISSUS'') '
        'THEN nullif(pg_catalog.current_setting(''outbox.tenant_id'', true), '''') END';
BEGIN
    -- Each change takes an ACCESS EXCLUSIVE lock on the table: skip the ones already made, so
    -- a rerun on every deploy does not queue behind live traffic.
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_policies WHERE schemaname = 'outbox'
                   AND tablename = 'operations' AND policyname = 'operations_all_tenants') THEN
        CREATE POLICY operations_all_tenants ON outbox.operations
            TO outbox_dispatcher, outbox_operator
            USING (true) WITH CHECK (true);
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_policies WHERE schemaname = 'outbox'
                   AND tablename = 'operations' AND policyname = 'operations_bound_tenant') THEN
        EXECUTE pg_catalog.format(
            'CREATE POLICY operations_bound_tenant ON outbox.operations TO PUBLIC '
            'USING (tenant_id = %s) WITH CHECK (tenant_id = %s)', bound, bound);
    END IF;
    -- Named per owner: after ALTER TABLE ... OWNER TO, a rerun adds the new owner's policy.
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_policies WHERE schemaname = 'outbox'
                   AND tablename = 'operations' AND policyname = 'operations_owner_' || owner_role) THEN
        EXECUTE pg_catalog.format(
            'CREATE POLICY %I ON outbox.operations TO %I '
            'USING ((%s) IS NULL OR tenant_id = %s) WITH CHECK ((%s) IS NULL OR tenant_id = %s)',
            'operations_owner_' || owner_role, owner_role, bound, bound, bound, bound);
    END IF;
    IF NOT (SELECT c.relrowsecurity AND c.relforcerowsecurity FROM pg_catalog.pg_class c
            WHERE c.oid = 'outbox.operations'::regclass) THEN
        ALTER TABLE outbox.operations ENABLE ROW LEVEL SECURITY;
        ALTER TABLE outbox.operations FORCE ROW LEVEL SECURITY;
    END IF;
END
$rls$;
