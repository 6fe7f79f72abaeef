-- 0005: what operators and the reconciler need: the attempt budget after a replay, the last
-- reconciliation check's finding, and the operator actions as functions that change the status
-- and write the audit in one transaction.
--
-- SQLSTATEs: OB004 operator_refused (the action does not apply in the operation's status, or a
-- required argument is missing); P0002 (no_data_found) for an unknown operation id.

ALTER TABLE outbox.operations
    -- Attempts made before the last replay or retry: max_attempts counts from here, while the
    -- attempt numbers in outbox.attempts keep growing.
    ADD COLUMN attempt_base integer NOT NULL DEFAULT 0,
    -- The reconciler's (or an operator's) last look at the provider, and what it found.
    ADD COLUMN checked_at timestamptz,
    ADD COLUMN check_finding text,
    ADD CONSTRAINT operations_attempt_base_valid CHECK (attempt_base >= 0 AND attempt_base <= attempts),
    ADD CONSTRAINT operations_check_finding_valid CHECK (check_finding IN ('found', 'not_found'));

-- Lock an operation for an operator action, refusing statuses the action does not apply to.
CREATE FUNCTION outbox.lock_for_action(operation_id bigint, action text, allowed text[])
RETURNS outbox.operations
LANGUAGE plpgsql AS $$
DECLARE
    op outbox.operations;
BEGIN
    SELECT * INTO op FROM outbox.operations o WHERE o.id = lock_for_action.operation_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no operation with id %', lock_for_action.operation_id
            USING ERRCODE = 'no_data_found';
    END IF;
    IF NOT op.status = ANY (allowed) THEN
        RAISE EXCEPTION '% applies to % operations; operation % is %',
            action, array_to_string(allowed, ' or '), op.id, op.status
            USING ERRCODE = 'OB004';
    END IF;
    RETURN op;
END;
$$;

CREATE FUNCTION outbox.require_reason(actor text, reason text) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF actor IS NULL OR btrim(actor) = '' THEN
        RAISE EXCEPTION 'an operator action needs an actor' USING ERRCODE = 'OB004';
    END IF;
    IF reason IS NULL OR btrim(reason) = '' THEN
        RAISE EXCEPTION 'an operator action needs a reason' USING ERRCODE = 'OB004';
    END IF;
END;
$$;

CREATE FUNCTION outbox.write_audit(
    op outbox.operations, actor text, action text, reason text, to_status text, details jsonb
) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO outbox.audit (operation_id, actor, action, reason, from_status, to_status, details)
    VALUES (op.id, actor, action, reason, op.status, to_status,
            details || jsonb_build_object('db_user', session_user));
$$;

-- Mark an operation succeeded with the provider's reference, on a person's or the reconciler's
-- evidence.
CREATE FUNCTION outbox.resolve_operation(
    operation_id bigint, provider_ref text, reason text, actor text
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    op outbox.operations;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    IF provider_ref IS NULL OR btrim(provider_ref) = '' THEN
        RAISE EXCEPTION 'resolve needs the provider''s reference of the effect' USING ERRCODE = 'OB004';
    END IF;
    op := outbox.lock_for_action(operation_id, 'resolve', ARRAY['reconciling', 'quarantined']);
    UPDATE outbox.operations o
    SET status = 'succeeded', provider_ref = resolve_operation.provider_ref, status_reason = NULL,
        updated_at = now(), status_changed_at = now(), finished_at = now()
    WHERE o.id = op.id;
    PERFORM outbox.write_audit(op, actor, 'resolve', reason, 'succeeded',
                               jsonb_build_object('provider_ref', provider_ref));
    RETURN 'succeeded';
END;
$$;

-- Give up on an operation: nothing more will be sent.
CREATE FUNCTION outbox.cancel_operation(operation_id bigint, reason text, actor text)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    op outbox.operations;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    op := outbox.lock_for_action(operation_id, 'cancel', ARRAY['reconciling', 'quarantined']);
    UPDATE outbox.operations o
    SET status = 'cancelled', status_reason = 'cancelled by operator', updated_at = now(),
        status_changed_at = now(), finished_at = now()
    WHERE o.id = op.id;
    PERFORM outbox.write_audit(op, actor, 'cancel', reason, 'cancelled', '{}'::jsonb);
    RETURN 'cancelled';
END;
$$;

-- Send a quarantined operation again, with the same key and a fresh attempt budget. The
-- dispatcher's key-window rule still applies: past its window it lands in reconciling.
CREATE FUNCTION outbox.replay_operation(operation_id bigint, reason text, actor text)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    op outbox.operations;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    op := outbox.lock_for_action(operation_id, 'replay', ARRAY['quarantined']);
    UPDATE outbox.operations o
    SET status = 'pending', status_reason = NULL, attempt_base = o.attempts,
        available_at = now(), updated_at = now(), status_changed_at = now()
    WHERE o.id = op.id;
    PERFORM outbox.write_audit(op, actor, 'replay', reason, 'pending', '{}'::jsonb);
    RETURN 'pending';
END;
$$;

-- The key an operation carries in key generation ``generation``: the first key, suffixed.
CREATE FUNCTION outbox.key_for_generation(first_key text, generation integer) RETURNS text
LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT CASE
        WHEN generation = 1 THEN first_key
        WHEN octet_length(first_key) + octet_length(':r' || generation) <= 255
            THEN first_key || ':r' || generation
        -- Too long for Stripe's 255 characters with a suffix: a hash of it, still deterministic.
        ELSE 'ob1_' || encode(sha256(convert_to(first_key, 'UTF8')), 'hex') || ':r' || generation
    END
$$;

-- Send a reconciling operation again under a new key generation: a deliberate new request,
-- allowed only when the last check found nothing at the provider (or forced).
CREATE FUNCTION outbox.retry_operation(
    operation_id bigint, reason text, actor text, force boolean DEFAULT false
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    op outbox.operations;
    first_key text;
    new_key text;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    op := outbox.lock_for_action(operation_id, 'retry', ARRAY['reconciling']);
    IF op.check_finding IS DISTINCT FROM 'not_found' AND NOT force THEN
        RAISE EXCEPTION 'operation % was not checked against the provider, or its effect was found; '
                        'run `outbox reconcile check %` first, or retry with --force', op.id, op.id
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
        'previous_key', op.idempotency_key, 'new_key', new_key, 'forced', force,
        'key_generation', op.key_generation + 1));
    RETURN 'pending';
END;
$$;

-- Record what a look at the provider found: the effect (the operation succeeded with its
-- reference) or nothing as of now (it stays reconciling for a person to decide).
CREATE FUNCTION outbox.record_check(
    operation_id bigint, found_ref text, actor text, details jsonb DEFAULT '{}'::jsonb
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    op outbox.operations;
BEGIN
    op := outbox.lock_for_action(operation_id, 'check', ARRAY['reconciling']);
    IF found_ref IS NOT NULL THEN
        UPDATE outbox.operations o
        SET status = 'succeeded', provider_ref = found_ref, status_reason = NULL,
            checked_at = now(), check_finding = 'found', updated_at = now(),
            status_changed_at = now(), finished_at = now()
        WHERE o.id = op.id;
        PERFORM outbox.write_audit(op, actor, 'check', 'found at the provider', 'succeeded',
                                   details || jsonb_build_object('provider_ref', found_ref));
        RETURN 'succeeded';
    END IF;
    UPDATE outbox.operations o
    SET checked_at = now(), check_finding = 'not_found', updated_at = now()
    WHERE o.id = op.id;
    PERFORM outbox.write_audit(op, actor, 'check',
                               'not found at the provider as of ' || now()::text, 'reconciling',
                               details);
    RETURN 'reconciling';
END;
$$;
