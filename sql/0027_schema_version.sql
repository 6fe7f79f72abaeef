-- 0027: the schema's version, for `outbox run` to check at start-up (issue 21).
--
-- `outbox run` against an un-migrated database started anyway and looped on UndefinedTable
-- for ever, never naming `outbox migrate`. The dispatcher role may not read
-- outbox.schema_migrations, so this function tells it the newest migration applied; a database
-- without it is older than 0027 (or has no outbox schema at all).

CREATE FUNCTION outbox.schema_version() RETURNS integer
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT max(version) FROM outbox.schema_migrations
$$;
REVOKE ALL ON FUNCTION outbox.schema_version() FROM PUBLIC;
COMMENT ON FUNCTION outbox.schema_version() IS
    'The newest migration applied: outbox run refuses to start on an older schema than its own.';

DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_dispatcher') THEN
        GRANT EXECUTE ON FUNCTION outbox.schema_version() TO outbox_dispatcher;
    END IF;
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_operator') THEN
        GRANT EXECUTE ON FUNCTION outbox.schema_version() TO outbox_operator;
    END IF;
END;
$$;
