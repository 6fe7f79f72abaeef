-- roles_tenant_rls.sql: tenant isolation for producers and workers, with row-level security
-- (ENABLE and FORCE) on outbox.operations and outbox.inbox (the inbox's records, sql/0042).
-- Applied after roles.sql by `outbox migrate --with-roles --tenant-rls`, or by hand (psql -v
-- ON_ERROR_STOP=1 --single-transaction -f ...), as the owner of the outbox schema or a
-- superuser. Idempotent; running migrate without --tenant-rls later leaves isolation on.
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
-- outbox.inbox has the same three kinds of policy (inbox_all_tenants for outbox_operator):
-- outbox.inbox_begin binds the delivery's tenant, so a worker's functions, running as the
-- owner, see that tenant's records only.
-- outbox.attempts and outbox.audit carry no tenant and are readable by the dispatcher and
-- operator roles only; outbox.inbox_conflicts by the operator only. outbox.operation_keys
-- (sql/0051) has no policy on purpose: an identity and a provider key are unique across
-- tenants, and enqueue, bound to one tenant, must see another's key to refuse it. Only the
-- operator reads it.
--
-- To switch isolation off again:
--     ALTER TABLE outbox.operations NO FORCE ROW LEVEL SECURITY;
--     ALTER TABLE outbox.operations DISABLE ROW LEVEL SECURITY;
-- and the same for outbox.inbox.

DO $rls$
DECLARE
    -- The tenant this transaction bound, as outbox.bound_tenant() reads it (0038): NULL for none
    -- and for a value left from an earlier transaction.
    bound CONSTANT text :=
        'CASE WHEN pg_catalog.current_setting(''outbox.tenant_bound_at'', true) = '
        'pg_catalog.to_char(pg_catalog.transaction_timestamp() AT TIME ZONE ''UTC'', '
        '''YYYYMMDDHH24MISSUS'') '
        'THEN nullif(pg_catalog.current_setting(''outbox.tenant_id'', true), '''') END';
    t record;
    owner_role text;
BEGIN
    -- Each table, and the roles that see every tenant of it.
    FOR t IN SELECT * FROM (VALUES ('operations', 'outbox_dispatcher, outbox_operator'),
                                   ('inbox', 'outbox_operator')) AS tables (name, all_tenants)
    LOOP
        owner_role := (SELECT pg_catalog.pg_get_userbyid(c.relowner) FROM pg_catalog.pg_class c
                       WHERE c.relnamespace = 'outbox'::regnamespace AND c.relname = t.name);
        -- Each change takes an ACCESS EXCLUSIVE lock on the table: skip the ones already made,
        -- so a rerun on every deploy does not queue behind live traffic.
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_policies WHERE schemaname = 'outbox'
                       AND tablename = t.name AND policyname = t.name || '_all_tenants') THEN
            EXECUTE pg_catalog.format(
                'CREATE POLICY %I ON outbox.%I TO %s USING (true) WITH CHECK (true)',
                t.name || '_all_tenants', t.name, t.all_tenants);
        END IF;
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_policies WHERE schemaname = 'outbox'
                       AND tablename = t.name AND policyname = t.name || '_bound_tenant') THEN
            EXECUTE pg_catalog.format(
                'CREATE POLICY %I ON outbox.%I TO PUBLIC '
                'USING (tenant_id = %s) WITH CHECK (tenant_id = %s)',
                t.name || '_bound_tenant', t.name, bound, bound);
        END IF;
        -- Named per owner: after ALTER TABLE ... OWNER TO, a rerun adds the new owner's policy.
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_policies WHERE schemaname = 'outbox'
                       AND tablename = t.name AND policyname = t.name || '_owner_' || owner_role)
        THEN
            EXECUTE pg_catalog.format(
                'CREATE POLICY %I ON outbox.%I TO %I '
                'USING ((%s) IS NULL OR tenant_id = %s) WITH CHECK ((%s) IS NULL OR tenant_id = %s)',
                t.name || '_owner_' || owner_role, t.name, owner_role, bound, bound, bound, bound);
        END IF;
        IF NOT (SELECT c.relrowsecurity AND c.relforcerowsecurity FROM pg_catalog.pg_class c
                WHERE c.relnamespace = 'outbox'::regnamespace AND c.relname = t.name) THEN
            EXECUTE pg_catalog.format('ALTER TABLE outbox.%I ENABLE ROW LEVEL SECURITY', t.name);
            EXECUTE pg_catalog.format('ALTER TABLE outbox.%I FORCE ROW LEVEL SECURITY', t.name);
        END IF;
    END LOOP;
END
$rls$;
