-- 0023: a reconciliation check knows every key it must find and says what it searched (issue 19).
--
-- A check was given the current key only (earlier generations' keys were guessed back from it),
-- a window that ended an hour after the last attempt however often it was checked again, and
-- nothing of the payload, so a lookup scanned every object of the type in its window. A
-- not-found said nothing of where it looked, and a search cut short could only say "not found".
--
-- claim_checks now also returns:
--   keys          every key the operation's attempts carried that may have reached the
--                 provider, with the current one: each generation's key, exactly;
--   payload       for the lookup's narrowing filters (a PaymentIntent's customer, say), as
--                 text: the reconciler decodes it, and a row it cannot decode blocks no other;
--   search_until  the window's end before the provider's slack: the last attempt or, if later,
--                 the previous check, so that each re-check searches further;
--   checked_now   the database's clock, against which the provider's retention of its records
--                 (Stripe lists events for 30 days) is measured;
--   api_version   the provider API version the operation was first sent with, which its
--                 lookups use too: what a field means depends on it;
--   sent_scope    where its first send went, as the provider names it (a Stripe account and
--                 the key's mode: "acct_1 live"): a lookup that would search elsewhere (the
--                 config's account or key changed since) says so instead of "not found".
-- operations.api_version keeps that version (RECORD_MANY sets it on the first attempt that may
-- have reached the provider): every retry is sent with it, so that an upgrade of outbox or of
-- the provider's SDK never changes the meaning of an operation already under way.
-- record_finding keeps the finding's details in check_details (what was searched, over which
-- window, why a search was cut short), and takes undecided without a reference: a search that
-- stopped at its page cap proves nothing either way, so `reconcile retry` needs --force.

ALTER TABLE outbox.operations ADD COLUMN check_details jsonb;
ALTER TABLE outbox.operations ADD COLUMN api_version text;
ALTER TABLE outbox.operations ADD COLUMN sent_scope text;

DROP FUNCTION outbox.claim_checks(text[], interval, integer);
CREATE FUNCTION outbox.claim_checks(providers text[], recheck_after interval, max_rows integer)
RETURNS TABLE (id bigint, provider text, action text, idempotency_key text,
               key_generation integer, attempts integer, first_sent_at timestamptz,
               last_attempt_at timestamptz, keys text[], payload text,
               search_until timestamptz, checked_now timestamptz, api_version text,
               sent_scope text)
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH due AS MATERIALIZED (
        SELECT o.id, o.checked_at AS checked_before
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
              coalesce(o.last_attempt_at, o.created_at),
              ARRAY(SELECT k FROM (SELECT a.idempotency_key FROM outbox.attempts a
                                   WHERE a.operation_id = o.id AND a.sent
                                   UNION SELECT o.idempotency_key) AS ks (k) ORDER BY k),
              o.payload::text,
              -- least() would take now() for a NULL: never checked, the last attempt it is.
              greatest(coalesce(o.last_attempt_at, o.created_at),
                       CASE WHEN due.checked_before IS NOT NULL
                            THEN least(due.checked_before, now()) END),
              now(), o.api_version, o.sent_scope
$$;
REVOKE ALL ON FUNCTION outbox.claim_checks(text[], interval, integer) FROM PUBLIC;
COMMENT ON FUNCTION outbox.claim_checks IS
    'Reconciling operations due for a provider lookup, marked checked as they are taken (SKIP LOCKED): one replica per check. With every key that may have reached the provider and the window to search.';

CREATE OR REPLACE FUNCTION outbox.record_finding(
    operation_id bigint, finding text, found_ref text, state text, actor text, details jsonb,
    expected_generation integer, expected_attempts integer
) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    op outbox.operations;
    v_details jsonb := coalesce(details, '{}'::jsonb);
    v_state text := left(state, 64);
BEGIN
    IF finding IS NULL OR finding NOT IN ('found', 'not_found', 'refused', 'undecided') THEN
        RAISE EXCEPTION 'a finding is found, not_found, refused or undecided, not %',
            coalesce(finding, 'NULL') USING ERRCODE = 'OB004';
    END IF;
    op := outbox.lock_for_action(operation_id, 'check', ARRAY['reconciling']);
    IF op.key_generation <> expected_generation OR op.attempts <> expected_attempts THEN
        RETURN 'stale';
    END IF;
    IF finding IN ('found', 'refused') AND (found_ref IS NULL OR btrim(found_ref) = '') THEN
        RAISE EXCEPTION 'a check that found an object must give its reference'
            USING ERRCODE = 'OB004';
    END IF;
    IF finding IN ('found', 'not_found') THEN
        PERFORM outbox.record_check(operation_id, CASE WHEN finding = 'found' THEN found_ref END,
                                    actor, v_details);
        UPDATE outbox.operations o SET check_state = v_state, check_details = v_details
        WHERE o.id = op.id;
        RETURN CASE WHEN finding = 'found' THEN 'succeeded' ELSE 'reconciling' END;
    END IF;
    IF finding = 'refused' THEN
        UPDATE outbox.operations o
        SET status = 'quarantined', status_reason = 'provider_declined', provider_ref = found_ref,
            checked_at = now(), check_finding = 'refused', check_state = v_state,
            check_details = v_details,
            -- As a permanent failure of the send path would say it: the class, and the
            -- provider's own words with its codes (card_declined: generic_decline: ...).
            last_error = left(concat_ws(': ', v_details->>'code', v_details->>'decline_code',
                                        coalesce(v_details->>'message', 'refused by the provider'
                                        )), 1000),
            last_error_class = 'permanent',
            updated_at = now(), status_changed_at = now()
        WHERE o.id = op.id;
        PERFORM outbox.write_audit(op, actor, 'check',
                                   'found at the provider, refused: ' || coalesce(v_state, '?'),
                                   'quarantined',
                                   v_details || jsonb_build_object('provider_ref', found_ref,
                                                                   'state', v_state));
        RETURN 'quarantined';
    END IF;
    UPDATE outbox.operations o
    SET checked_at = now(), check_finding = 'undecided', check_state = v_state,
        check_details = v_details, updated_at = now()
    WHERE o.id = op.id;
    IF op.check_finding IS DISTINCT FROM 'undecided' OR op.check_state IS DISTINCT FROM v_state THEN
        PERFORM outbox.write_audit(op, actor, 'check',
                                   CASE WHEN found_ref IS NULL
                                        THEN 'search incomplete, undecided: '
                                             || coalesce(v_details->>'reason', '?')
                                        ELSE 'found at the provider, undecided: '
                                             || coalesce(v_state, '?') END,
                                   'reconciling',
                                   v_details || jsonb_build_object('provider_ref', found_ref,
                                                                   'state', v_state));
    END IF;
    RETURN 'reconciling';
END;
$$;

DO $$
BEGIN
    -- The roles of sql/roles.sql, where they exist (that script grants it on a new database).
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_dispatcher') THEN
        GRANT EXECUTE ON FUNCTION outbox.claim_checks(text[], interval, integer)
            TO outbox_dispatcher;
        -- RECORD_MANY writes both: an attempt the provider did not act on grows attempt_base.
        GRANT UPDATE (attempt_base, api_version, sent_scope) ON outbox.operations
            TO outbox_dispatcher;
    END IF;
END;
$$;
