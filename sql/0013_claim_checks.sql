-- The daemon's reconciler claims the checks it makes.
--
-- Every replica runs a reconciler. Before this, each read the same reconciling operations and
-- asked the provider about each of them at the same moment; the replicas that lost the race to
-- record a found effect then logged it as an effect "no longer reconciling" (a false alarm), and
-- the provider answered every lookup once per replica. claim_checks takes the due operations
-- with SKIP LOCKED and marks them checked as it takes them, so each is looked up by one replica.
--
-- A lookup that fails (the provider down, rate limited) proves nothing either way: defer_check
-- makes it due again after retry_in rather than after a whole recheck_after.

CREATE FUNCTION outbox.claim_checks(providers text[], recheck_after interval, max_rows integer)
RETURNS TABLE (id bigint, provider text, action text, idempotency_key text,
               key_generation integer, attempts integer, first_sent_at timestamptz,
               last_attempt_at timestamptz)
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH due AS MATERIALIZED (
        SELECT o.id
        FROM outbox.operations o
        WHERE o.status = 'reconciling'
          AND o.provider = ANY (claim_checks.providers)
          AND (o.checked_at IS NULL OR o.checked_at < now() - claim_checks.recheck_after)
        ORDER BY o.status_changed_at, o.id
        LIMIT claim_checks.max_rows
        FOR UPDATE SKIP LOCKED
    )
    UPDATE outbox.operations o SET checked_at = now()
    FROM due
    WHERE o.id = due.id
    RETURNING o.id, o.provider, o.action, o.idempotency_key, o.key_generation, o.attempts,
              coalesce(o.first_sent_at, o.created_at), coalesce(o.last_attempt_at, o.created_at)
$$;
REVOKE ALL ON FUNCTION outbox.claim_checks(text[], interval, integer) FROM PUBLIC;
COMMENT ON FUNCTION outbox.claim_checks IS
    'Reconciling operations due for a provider lookup, marked checked as they are taken (SKIP LOCKED): one replica per check.';

CREATE FUNCTION outbox.defer_check(operation_id bigint, recheck_after interval, retry_in interval)
RETURNS void
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    UPDATE outbox.operations o
    SET checked_at = now() - defer_check.recheck_after + defer_check.retry_in
    WHERE o.id = defer_check.operation_id AND o.status = 'reconciling';
$$;
REVOKE ALL ON FUNCTION outbox.defer_check(bigint, interval, interval) FROM PUBLIC;
COMMENT ON FUNCTION outbox.defer_check IS
    'After a failed lookup: the operation is due for another check after retry_in.';
