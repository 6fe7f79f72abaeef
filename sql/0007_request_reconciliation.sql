-- 0007: an operator sends a quarantined operation to reconciliation (reason operator_request),
-- so the reconciler checks the provider before anyone decides: the usual path for an operation
-- quarantined after attempts whose outcome was unknown.

CREATE FUNCTION outbox.request_reconciliation(operation_id bigint, reason text, actor text)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    op outbox.operations;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    op := outbox.lock_for_action(operation_id, 'reconcile', ARRAY['quarantined']);
    UPDATE outbox.operations o
    SET status = 'reconciling', status_reason = 'operator_request', checked_at = NULL,
        check_finding = NULL, updated_at = now(), status_changed_at = now()
    WHERE o.id = op.id;
    PERFORM outbox.write_audit(op, actor, 'reconcile', reason, 'reconciling', '{}'::jsonb);
    RETURN 'reconciling';
END;
$$;
