-- 0021: a reconciliation finding carries the state of the object it found (issue 19).
--
-- record_check (0006, 0009) made every found object a success. A PaymentIntent whose
-- confirmation the issuer declined exists at Stripe too (status requires_payment_method,
-- last_payment_error set; Stripe saved the 402 under the key), so an operator who sent a
-- declined charge to reconciliation saw it become succeeded: an unpaid charge marked paid.
-- record_finding takes the provider's verdict on the object (outbox/providers/stripe_states.py):
--
--   found      the effect happened: succeeded, with the object's reference (as before);
--   refused    the provider acted and said no: quarantined, reason provider_declined, the
--              object's reference and the decline's details kept, never succeeded;
--   undecided  the object's state decides nothing yet (a payment awaiting the customer's
--              authentication): still reconciling, the state shown, for a person;
--   not_found  no object: still reconciling, "not found as of" (as before).
--
-- check_state keeps the object's status word at the last check, for `reconcile list/show`.

ALTER TABLE outbox.operations ADD COLUMN check_state text;
ALTER TABLE outbox.operations DROP CONSTRAINT operations_check_finding_valid;
ALTER TABLE outbox.operations ADD CONSTRAINT operations_check_finding_valid
    CHECK (check_finding IN ('found', 'not_found', 'refused', 'undecided')) NOT VALID;
ALTER TABLE outbox.operations VALIDATE CONSTRAINT operations_check_finding_valid;

CREATE FUNCTION outbox.record_finding(
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
    IF finding <> 'not_found' AND (found_ref IS NULL OR btrim(found_ref) = '') THEN
        RAISE EXCEPTION 'a check that found an object must give its reference'
            USING ERRCODE = 'OB004';
    END IF;
    IF finding IN ('found', 'not_found') THEN
        PERFORM outbox.record_check(operation_id, CASE WHEN finding = 'found' THEN found_ref END,
                                    actor, v_details);
        UPDATE outbox.operations o SET check_state = v_state WHERE o.id = op.id;
        RETURN CASE WHEN finding = 'found' THEN 'succeeded' ELSE 'reconciling' END;
    END IF;
    IF finding = 'refused' THEN
        UPDATE outbox.operations o
        SET status = 'quarantined', status_reason = 'provider_declined', provider_ref = found_ref,
            checked_at = now(), check_finding = 'refused', check_state = v_state,
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
    SET checked_at = now(), check_finding = 'undecided', check_state = v_state, updated_at = now()
    WHERE o.id = op.id;
    IF op.check_finding IS DISTINCT FROM 'undecided' OR op.check_state IS DISTINCT FROM v_state THEN
        PERFORM outbox.write_audit(op, actor, 'check',
                                   'found at the provider, undecided: ' || coalesce(v_state, '?'),
                                   'reconciling',
                                   v_details || jsonb_build_object('provider_ref', found_ref,
                                                                   'state', v_state));
    END IF;
    RETURN 'reconciling';
END;
$$;
REVOKE ALL ON FUNCTION outbox.record_finding(bigint, text, text, text, text, jsonb, integer,
                                             integer) FROM PUBLIC;
COMMENT ON FUNCTION outbox.record_finding IS
    'A reconciliation finding with the state of the object found: found (succeeded), refused (quarantined, provider_declined), undecided or not_found (still reconciling).';

DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_dispatcher') THEN
        GRANT EXECUTE ON FUNCTION outbox.record_finding(bigint, text, text, text, text, jsonb,
                                                        integer, integer) TO outbox_dispatcher;
    END IF;
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_operator') THEN
        GRANT EXECUTE ON FUNCTION outbox.record_finding(bigint, text, text, text, text, jsonb,
                                                        integer, integer) TO outbox_operator;
    END IF;
END;
$$;
