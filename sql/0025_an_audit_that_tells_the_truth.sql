-- 0025: an audit that tells the truth (issue 20).
--
-- * Who really acted: the database's session_user, in a column of its own beside the actor a
--   person claimed with --actor (free text). Rows written before this kept it in
--   details->>'db_user'; `show` reads either.
-- * Bounded text: an actor of at most 255 characters, a reason of at most 2000 (a 50 MB reason
--   was accepted). Text is stored as given; the CLI and the logs escape its control characters
--   when they show it (outbox/safe_text.py).
-- * Every operator action writes a row: `ordering set-mode` too, which concerns an operation
--   type rather than one operation (operation_id NULL), with an optional reason.

ALTER TABLE outbox.audit ADD COLUMN db_user text;
-- Not in the ADD: a default there would be written into every old row as the migrator's name.
ALTER TABLE outbox.audit ALTER COLUMN db_user SET DEFAULT session_user;
ALTER TABLE outbox.audit ALTER COLUMN operation_id DROP NOT NULL;

CREATE OR REPLACE FUNCTION outbox.require_reason(actor text, reason text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF actor IS NULL OR btrim(actor) = '' THEN
        RAISE EXCEPTION 'an operator action needs an actor' USING ERRCODE = 'OB004';
    END IF;
    IF reason IS NULL OR btrim(reason) = '' THEN
        RAISE EXCEPTION 'an operator action needs a reason' USING ERRCODE = 'OB004';
    END IF;
    IF char_length(actor) > 255 THEN
        RAISE EXCEPTION 'the actor is % characters long; at most 255 are allowed',
            char_length(actor) USING ERRCODE = 'OB004';
    END IF;
    IF char_length(reason) > 2000 THEN
        RAISE EXCEPTION 'the reason is % characters long; at most 2000 are allowed',
            char_length(reason) USING ERRCODE = 'OB004';
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION outbox.write_audit(
    op outbox.operations, actor text, action text, reason text, to_status text, details jsonb
) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO outbox.audit (operation_id, actor, action, reason, from_status, to_status, details,
                              db_user)
    VALUES (op.id, actor, action, reason, op.status, to_status,
            details || jsonb_build_object('db_user', session_user), session_user);
$$;

-- The operator's choice of block or skip (0015, 0019), now with its audit row.
CREATE FUNCTION outbox.set_ordering_mode(operation_type text, on_failure text, actor text,
                                         reason text)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    v_key record;
    v_promoted integer := 0;
    v_before text;
BEGIN
    IF on_failure IS NULL OR on_failure NOT IN ('block', 'skip') THEN
        RAISE EXCEPTION 'on_failure must be block or skip, not %', coalesce(on_failure, 'NULL')
            USING ERRCODE = 'OB002', COLUMN = 'on_failure';
    END IF;
    PERFORM outbox.check_text('operation_type', operation_type, 128);
    PERFORM outbox.check_text('actor', actor, 255);
    PERFORM outbox.check_text('reason', reason, 2000, false);
    SELECT m.on_failure INTO v_before FROM outbox.ordering_modes m
    WHERE m.operation_type = operation_type;
    INSERT INTO outbox.ordering_modes AS m (operation_type, on_failure, updated_by)
    VALUES (operation_type, on_failure, actor)
    ON CONFLICT ON CONSTRAINT ordering_modes_pkey
    DO UPDATE SET on_failure = EXCLUDED.on_failure, updated_at = now(),
                  updated_by = EXCLUDED.updated_by;
    IF on_failure = 'skip' THEN
        FOR v_key IN
            SELECT DISTINCT o.tenant_id, o.ordering_key
            FROM outbox.operations o
            WHERE o.operation_type = operation_type AND o.ordering_key IS NOT NULL
              AND NOT o.ordering_blocked AND o.status IN ('quarantined', 'reconciling')
            ORDER BY o.tenant_id, o.ordering_key
        LOOP
            PERFORM outbox.lock_ordering_key(v_key.tenant_id, v_key.ordering_key);
            IF outbox.promote_next(v_key.tenant_id, v_key.ordering_key) IS NOT NULL THEN
                v_promoted := v_promoted + 1;
            END IF;
        END LOOP;
    END IF;
    INSERT INTO outbox.audit (operation_id, actor, action, reason, details, db_user)
    VALUES (NULL, actor, 'ordering_mode',
            coalesce(nullif(btrim(reason), ''), 'ordering set-mode, no reason given'),
            jsonb_build_object('operation_type', operation_type, 'on_failure', on_failure,
                               'before', coalesce(v_before, 'block'), 'keys_released', v_promoted,
                               'db_user', session_user),
            session_user);
    RETURN v_promoted;
END;
$$;
REVOKE ALL ON FUNCTION outbox.set_ordering_mode(text, text, text, text) FROM PUBLIC;

CREATE OR REPLACE FUNCTION outbox.set_ordering_mode(operation_type text, on_failure text,
                                                    actor text)
RETURNS integer
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT outbox.set_ordering_mode(operation_type, on_failure, actor, NULL::text)
$$;

DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_operator') THEN
        GRANT EXECUTE ON FUNCTION outbox.set_ordering_mode(text, text, text, text)
            TO outbox_operator;
    END IF;
END;
$$;
