-- 0022: a reconciliation check searches from the first attempt of any key generation (issue 19).
--
-- `outbox reconcile retry` moves an operation to its next key generation and resets
-- first_sent_at, which starts the new generation's key window. The checks searched the
-- provider for objects created from first_sent_at on: after a retry, an object that generation 1
-- created more than the lookup's slack earlier was never listed, and the operator was told
-- "not found" while a charge existed. A check now searches from the earliest attempt of the
-- operation that may have reached the provider, whichever generation made it (outbox.attempts
-- keeps them all), and never from later than the operation's first send.

CREATE OR REPLACE FUNCTION outbox.claim_checks(providers text[], recheck_after interval,
                                               max_rows integer)
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
              least(coalesce(o.first_sent_at, o.created_at),
                    (SELECT min(a.started_at) FROM outbox.attempts a
                     WHERE a.operation_id = o.id AND a.sent)),
              coalesce(o.last_attempt_at, o.created_at)
$$;
