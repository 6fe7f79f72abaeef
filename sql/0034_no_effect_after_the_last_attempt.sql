-- 0034: a person's "no effect" waits 30 s after the last attempt, as a check's does (issue 37).
--
-- retry_operation (sql/0009) takes a not_found finding only when it was taken 30 s or more after
-- the last attempt: what the provider shows may not have an effect that young. 0032 recorded a
-- person's finding at any time, so one recorded too soon stayed too soon for good, and every
-- retry after it was refused. It is now refused when taken, saying why: look again in a moment.

CREATE OR REPLACE FUNCTION outbox.record_no_effect(operation_id bigint, reason text, actor text)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    op outbox.operations;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    op := outbox.lock_for_action(operation_id, 'no_effect', ARRAY['reconciling']);
    IF op.last_attempt_at > now() - interval '30 seconds' THEN
        RAISE EXCEPTION 'operation %: its last attempt was less than 30 s ago, and what the '
                        'provider shows may not have its effect yet: look again in a moment',
                        op.id
            USING ERRCODE = 'OB004';
    END IF;
    UPDATE outbox.operations o
    SET checked_at = now(), check_finding = 'not_found', check_state = NULL,
        check_details = jsonb_build_object('by', 'operator', 'actor', actor),
        updated_at = now()
    WHERE o.id = op.id;
    PERFORM outbox.write_audit(op, actor, 'no_effect', reason, 'reconciling',
                               jsonb_build_object('finding', 'not_found',
                                                  'previous_finding', op.check_finding,
                                                  'previous_state', op.check_state));
    RETURN 'reconciling';
END;
$$;
REVOKE ALL ON FUNCTION outbox.record_no_effect(bigint, text, text) FROM PUBLIC;
