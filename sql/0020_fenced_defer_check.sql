-- 0020: a reconciler's deferral is fenced like its finding (issue 18).
--
-- record_check (0009) writes a finding only if the operation still has the key generation and
-- the attempt count the check was taken at: a check that outlived its operation's episode (an
-- operator retried it, a dispatcher sent it again and it came back to reconciling) changes
-- nothing. defer_check, after a failed lookup, checked only that the operation was reconciling,
-- so such a late deferral pushed back the check of the newer episode by up to its retry_in.
-- This version takes the same two expectations. The three-argument version stays for the
-- dispatchers of a rolling upgrade that still call it; statements.DEFER_CHECK calls this one.

CREATE FUNCTION outbox.defer_check(operation_id bigint, recheck_after interval, retry_in interval,
                                   expected_generation integer, expected_attempts integer)
RETURNS boolean
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH deferred AS (
        UPDATE outbox.operations o
        SET checked_at = now() - defer_check.recheck_after + defer_check.retry_in
        WHERE o.id = defer_check.operation_id AND o.status = 'reconciling'
          AND o.key_generation = defer_check.expected_generation
          AND o.attempts = defer_check.expected_attempts
        RETURNING 1
    )
    SELECT EXISTS (SELECT FROM deferred)
$$;
REVOKE ALL ON FUNCTION outbox.defer_check(bigint, interval, interval, integer, integer)
    FROM PUBLIC;
COMMENT ON FUNCTION outbox.defer_check(bigint, interval, interval, integer, integer) IS
    'After a failed lookup: the operation is due for another check after retry_in, if it is still in the episode the check was taken in (then true).';

DO $$
BEGIN
    -- The roles of sql/roles.sql, where they exist (that script grants it on a new database).
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_dispatcher') THEN
        GRANT EXECUTE ON FUNCTION
            outbox.defer_check(bigint, interval, interval, integer, integer) TO outbox_dispatcher;
    END IF;
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_operator') THEN
        GRANT EXECUTE ON FUNCTION
            outbox.defer_check(bigint, interval, interval, integer, integer) TO outbox_operator;
    END IF;
END;
$$;
