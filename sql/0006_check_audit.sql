-- 0006: a reconciliation check writes the audit only when its finding changes, so a periodic
-- reconciler does not add a row per operation every few minutes; checked_at still says "as of".

CREATE OR REPLACE FUNCTION outbox.record_check(
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
    IF op.check_finding IS DISTINCT FROM 'not_found' THEN
        PERFORM outbox.write_audit(op, actor, 'check',
                                   'not found at the provider as of ' || now()::text,
                                   'reconciling', details);
    END IF;
    RETURN 'reconciling';
END;
$$;
