-- 0009: operator and reconciliation rules tightened after review.
-- * retry: a NULL force is no force; a "not found" taken right after the last attempt proves
--   little (Stripe may still complete an indeterminate request), so it must be 30 s younger.
-- * record_check: a blank reference is no evidence; a finding made for an older key generation
--   or an older set of attempts than the row has now is stale and is not recorded.
-- * the audit refuses DELETE and TRUNCATE too (a DBA who must trim it disables the triggers).

CREATE OR REPLACE FUNCTION outbox.retry_operation(
    operation_id bigint, reason text, actor text, force boolean DEFAULT false
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    op outbox.operations;
    forced boolean := coalesce(force, false);
    first_key text;
    new_key text;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    op := outbox.lock_for_action(operation_id, 'retry', ARRAY['reconciling']);
    IF NOT forced AND op.check_finding IS DISTINCT FROM 'not_found' THEN
        RAISE EXCEPTION 'operation % was not checked against the provider, or its effect was found; '
                        'run `outbox reconcile check %` first, or retry with --force', op.id, op.id
            USING ERRCODE = 'OB004';
    END IF;
    IF NOT forced AND op.checked_at < op.last_attempt_at + interval '30 seconds' THEN
        RAISE EXCEPTION 'operation %: the last check came too soon after the last attempt to prove '
                        'anything; run `outbox reconcile check %` again, or retry with --force',
                        op.id, op.id
            USING ERRCODE = 'OB004';
    END IF;
    first_key := CASE WHEN op.key_generation = 1 THEN op.idempotency_key
                      ELSE left(op.idempotency_key,
                                length(op.idempotency_key) - length(':r' || op.key_generation)) END;
    new_key := outbox.key_for_generation(first_key, op.key_generation + 1);
    UPDATE outbox.operations o
    SET status = 'pending', status_reason = NULL, idempotency_key = new_key,
        key_generation = o.key_generation + 1, first_sent_at = NULL, attempt_base = o.attempts,
        available_at = now(), checked_at = NULL, check_finding = NULL, updated_at = now(),
        status_changed_at = now()
    WHERE o.id = op.id;
    PERFORM outbox.write_audit(op, actor, 'retry', reason, 'pending', jsonb_build_object(
        'previous_key', op.idempotency_key, 'new_key', new_key, 'forced', forced,
        'key_generation', op.key_generation + 1));
    RETURN 'pending';
END;
$$;

-- The reconciler passes the key generation and attempt count it looked up for; a row that moved
-- on since (a retry, a replay) gets no stale finding. Returns 'stale' then.
CREATE FUNCTION outbox.record_check(
    operation_id bigint, found_ref text, actor text, details jsonb,
    expected_generation integer, expected_attempts integer
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    op outbox.operations;
BEGIN
    op := outbox.lock_for_action(operation_id, 'check', ARRAY['reconciling']);
    IF op.key_generation <> expected_generation OR op.attempts <> expected_attempts THEN
        RETURN 'stale';
    END IF;
    IF found_ref IS NOT NULL AND btrim(found_ref) = '' THEN
        RAISE EXCEPTION 'a check that found the effect must give its reference' USING ERRCODE = 'OB004';
    END IF;
    RETURN outbox.record_check(operation_id, found_ref, actor, coalesce(details, '{}'::jsonb));
END;
$$;

CREATE FUNCTION outbox.audit_is_kept() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'outbox.audit keeps every row: % is refused', TG_OP
        USING ERRCODE = 'OB003', TABLE = 'audit', SCHEMA = 'outbox';
END;
$$;

CREATE TRIGGER audit_no_delete BEFORE DELETE ON outbox.audit
    FOR EACH ROW EXECUTE FUNCTION outbox.audit_is_kept();
CREATE TRIGGER audit_no_truncate BEFORE TRUNCATE ON outbox.audit
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.audit_is_kept();

-- Mark a reconciling operation as looked at without a finding (the look-up failed), so the
-- periodic reconciler moves on to others instead of retrying it first every pass.
CREATE FUNCTION outbox.touch_check(operation_id bigint) RETURNS void
LANGUAGE sql AS $$
    UPDATE outbox.operations o SET checked_at = now()
    WHERE o.id = touch_check.operation_id AND o.status = 'reconciling';
$$;
