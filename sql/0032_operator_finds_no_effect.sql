-- 0032: an operator's finding that the provider has no effect of an operation (issue 37).
--
-- A provider without a lookup (a webhook without one) can only be asked by a person: in its
-- dashboard, its logs, its owner. Having looked and found nothing, they had to `reconcile retry
-- --force`, which records no finding: the audit said "forced", not "looked, none there". This
-- records that finding as a check would, `not_found`, by the person and with their reason, so
-- that `reconcile retry` needs no --force (and `reconcile cancel` is the plain other way). The
-- 30-second rule of retry_operation holds as for any check: a finding taken within 30 s of the
-- last attempt proves nothing. The periodic reconciler may still ask a provider that has a
-- lookup, and its finding replaces the person's.

CREATE FUNCTION outbox.record_no_effect(operation_id bigint, reason text, actor text)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    op outbox.operations;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    op := outbox.lock_for_action(operation_id, 'no_effect', ARRAY['reconciling']);
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
COMMENT ON FUNCTION outbox.record_no_effect(bigint, text, text) IS
    'An operator found no effect at the provider: a not_found finding by a person, audited, '
    'after which reconcile retry needs no force.';

DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_operator') THEN
        GRANT EXECUTE ON FUNCTION outbox.record_no_effect(bigint, text, text) TO outbox_operator;
    END IF;
END;
$$;
