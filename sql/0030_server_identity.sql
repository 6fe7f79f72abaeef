-- 0030: which server answers, for the dispatcher's readiness probe (issue 23, cases 3 and 4).
--
-- After a failover the same DSN reaches another server: a promoted standby keeps the old
-- primary's system identifier but starts a new timeline, and a server restored elsewhere has
-- another identifier. The probe logs both with every "database lost" and "database reachable"
-- line, and when they change the dispatcher takes back at once the leases of its own that the
-- new server still holds for calls this process no longer makes (outbox/dispatch/maintenance.py).
--
-- SECURITY DEFINER: pg_control_system() may be revoked from ordinary roles on a hardened
-- server. Where even the owner may not call it, the identity is unknown (NULL), and the
-- dispatcher's leases are then taken back when they expire, as before 0030.

CREATE FUNCTION outbox.server_identity(
    OUT in_recovery boolean,
    OUT system_identifier text,
    OUT timeline integer,
    OUT server_now timestamptz
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    in_recovery := pg_is_in_recovery();
    server_now := now();
    BEGIN
        SELECT s.system_identifier::text INTO system_identifier FROM pg_control_system() AS s;
        IF NOT in_recovery THEN
            -- The timeline of the WAL being written: a promoted standby's new one at once (the
            -- checkpoint's, in pg_control_checkpoint(), changes only at the next checkpoint).
            timeline := ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int;
        END IF;
    EXCEPTION WHEN insufficient_privilege THEN
        system_identifier := NULL;
        timeline := NULL;
    END;
END;
$$;
REVOKE ALL ON FUNCTION outbox.server_identity() FROM PUBLIC;
COMMENT ON FUNCTION outbox.server_identity() IS
    'Whether this server is in recovery, its system identifier and WAL timeline (NULL where they '
    'cannot be read), and its clock: what the readiness probe of outbox run asks every second.';

DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_dispatcher') THEN
        GRANT EXECUTE ON FUNCTION outbox.server_identity() TO outbox_dispatcher;
    END IF;
END;
$$;
