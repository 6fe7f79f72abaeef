-- 0017: a cheaper enqueue, with the same rules, errors, privileges and tenant check.
--
-- Until now one call of outbox.enqueue was, on PostgreSQL 15:
-- * a SQL-language wrapper (0011, 0015). A SQL function with a SET clause is never inlined, and
--   its statements are parsed, analysed and planned again on every call;
-- * require_tenant's PL/pgSQL call, which itself calls bound_tenant (a SQL function, parsed
--   again too);
-- * insert_operation (0015), whose argument checks were seven PERFORMs of check_text: each a
--   full executor start-up and shut-down, around a function call that saves, sets and restores
--   search_path (its SET clause); then derive_idempotency_key and max_payload_bytes, SQL
--   functions parsed and planned again on every call for the same reason.
-- In the database that was about 150 us per call, against about 45 us for the same row's
-- INSERT as a statement of its own; with a COMMIT per call, 260 to 280 us against 55 to 60.
--
-- Now enqueue is one PL/pgSQL function. PL/pgSQL keeps its statements' plans for the session,
-- and evaluates an expression with no subquery (every check below) without starting an
-- executor. Nothing else changes:
-- * It stays SECURITY DEFINER with search_path pinned (restated here: CREATE OR REPLACE resets
--   the SET clauses); it keeps its owner, its comment and its grants (EXECUTE for
--   outbox_producer only, none for PUBLIC), since CREATE OR REPLACE keeps them.
-- * The tenant check comes first, as before. Its outcome is require_tenant's: when the
--   transaction is bound to this very tenant it passes without reading the catalog; otherwise,
--   if isolation is on, require_tenant itself raises its 42501.
-- * The checks and their messages are check_text's. The usual call tests every field at once
--   in one expression, made of check_text's own four conditions per field; when that expression
--   is not true, check_text runs on each field in the old order and raises exactly the error it
--   always raised. The checks of the payload, idempotency_key, max_attempts and traceparent
--   are 0015's, unchanged.
-- * The derived idempotency key is derive_idempotency_key's expression, written out (that
--   function stays, for the benchmarks and for anyone computing a key by hand;
--   tests/integration/test_enqueue.py asserts they agree). max_payload_bytes is written out
--   and dropped: enqueue was its only caller.
--
-- insert_operation is dropped: the old wrapper was its only caller, and no role could execute
-- it. A producer's call that began under the old wrapper at the very moment this commits could
-- fail to find it; the wrapper looks it up at the start of its call, so the window is that
-- lookup.

CREATE OR REPLACE FUNCTION outbox.enqueue(
    tenant_id       text,
    operation_type  text,
    operation_key   text,
    provider        text,
    action          text,
    payload         jsonb,
    correlation_id  text        DEFAULT NULL,
    idempotency_key text        DEFAULT NULL,
    available_at    timestamptz DEFAULT NULL,
    max_attempts    integer     DEFAULT NULL,
    traceparent     text        DEFAULT NULL,
    ordering_key    text        DEFAULT NULL
) RETURNS TABLE (operation_id bigint, outcome text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    v_payload_text text;
    v_max_bytes    bigint;
    v_fingerprint  bytea;
    v_id           bigint;
    v_existing     bytea;
    v_isolated     boolean;
BEGIN
    -- The tenant check (require_tenant, 0011). A transaction bound to this very tenant may act
    -- for it whether isolation is on or not, so only another binding, or none, costs the
    -- catalog read; a missing or blank tenant_id is OB002 below.
    IF nullif(current_setting('outbox.tenant_id', true), '') IS DISTINCT FROM tenant_id
       AND btrim(tenant_id) <> '' THEN
        SELECT c.relrowsecurity INTO v_isolated FROM pg_catalog.pg_class c
        WHERE c.oid = 'outbox.operations'::regclass;
        IF v_isolated THEN
            PERFORM outbox.require_tenant(tenant_id);  -- raises its 42501
        END IF;
    END IF;

    -- check_text's conditions (0004), field by field: required, not blank, not too long, no
    -- control characters. IS NOT TRUE: a NULL here must take the slow path, never skip it.
    IF (    tenant_id IS NOT NULL AND btrim(tenant_id) <> ''
            AND char_length(tenant_id) <= 128 AND tenant_id !~ '[[:cntrl:]]'
        AND operation_type IS NOT NULL AND btrim(operation_type) <> ''
            AND char_length(operation_type) <= 128 AND operation_type !~ '[[:cntrl:]]'
        AND operation_key IS NOT NULL AND btrim(operation_key) <> ''
            AND char_length(operation_key) <= 255 AND operation_key !~ '[[:cntrl:]]'
        AND provider IS NOT NULL AND btrim(provider) <> ''
            AND char_length(provider) <= 64 AND provider !~ '[[:cntrl:]]'
        AND action IS NOT NULL AND btrim(action) <> ''
            AND char_length(action) <= 128 AND action !~ '[[:cntrl:]]'
        AND (correlation_id IS NULL
             OR (btrim(correlation_id) <> '' AND char_length(correlation_id) <= 255
                 AND correlation_id !~ '[[:cntrl:]]'))
        AND (ordering_key IS NULL
             OR (btrim(ordering_key) <> '' AND char_length(ordering_key) <= 255
                 AND ordering_key !~ '[[:cntrl:]]'))
       ) IS NOT TRUE THEN
        -- One of them is invalid: check_text raises the error (OB002, COLUMN the field).
        PERFORM outbox.check_text('tenant_id', tenant_id, 128);
        PERFORM outbox.check_text('operation_type', operation_type, 128);
        PERFORM outbox.check_text('operation_key', operation_key, 255);
        PERFORM outbox.check_text('provider', provider, 64);
        PERFORM outbox.check_text('action', action, 128);
        PERFORM outbox.check_text('correlation_id', correlation_id, 255, false);
        PERFORM outbox.check_text('ordering_key', ordering_key, 255, false);
    END IF;

    IF payload IS NULL THEN
        RAISE EXCEPTION 'payload is required' USING ERRCODE = 'OB002', COLUMN = 'payload';
    END IF;
    IF jsonb_typeof(payload) <> 'object' THEN
        RAISE EXCEPTION 'payload must be a JSON object, not %', jsonb_typeof(payload)
            USING ERRCODE = 'OB002', COLUMN = 'payload';
    END IF;
    v_payload_text := payload::text;
    -- The largest payload accepted, in bytes of its JSON text: 1 MiB unless a DBA set another
    -- (ALTER DATABASE app SET outbox.max_payload_bytes = 4194304).
    v_max_bytes := coalesce(nullif(current_setting('outbox.max_payload_bytes', true), '')::bigint,
                            1048576);
    IF octet_length(v_payload_text) > v_max_bytes THEN
        RAISE EXCEPTION 'payload is % bytes of JSON; at most % are allowed',
            octet_length(v_payload_text), v_max_bytes
            USING ERRCODE = 'OB002', COLUMN = 'payload',
                  HINT = 'the limit is the setting outbox.max_payload_bytes';
    END IF;
    -- Visible ASCII only: the key travels in an HTTP header and Stripe allows 255 characters.
    IF idempotency_key IS NOT NULL AND idempotency_key !~ '^[!-~]{1,255}$' THEN
        RAISE EXCEPTION 'idempotency_key must be 1 to 255 visible ASCII characters without spaces'
            USING ERRCODE = 'OB002', COLUMN = 'idempotency_key';
    END IF;
    IF max_attempts IS NOT NULL AND max_attempts < 1 THEN
        RAISE EXCEPTION 'max_attempts must be at least 1, not %', max_attempts
            USING ERRCODE = 'OB002', COLUMN = 'max_attempts';
    END IF;
    IF traceparent IS NOT NULL
       AND traceparent !~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$' THEN
        RAISE EXCEPTION 'traceparent must be a W3C trace context header value'
            USING ERRCODE = 'OB002', COLUMN = 'traceparent';
    END IF;

    -- provider and action hold no control characters, so a newline separates them unambiguously;
    -- jsonb's text form is canonical (keys sorted, whitespace normalised). The ordering key is
    -- part of the intent (0015); without one the fingerprint is what it always was.
    v_fingerprint := sha256(convert_to(provider || E'\n' || action || E'\n' || v_payload_text
                                       || coalesce(E'\n' || ordering_key, ''), 'UTF8'));

    LOOP
        -- A concurrent enqueue of the same identity waits here for the other transaction to end,
        -- then does nothing; the read below sees its row.
        INSERT INTO outbox.operations AS o (
            tenant_id, operation_type, operation_key, fingerprint, provider, action, payload,
            idempotency_key, correlation_id, traceparent, max_attempts, available_at,
            ordering_key, ordering_blocked
        ) VALUES (
            tenant_id, operation_type, operation_key, v_fingerprint, provider, action, payload,
            -- outbox.derive_idempotency_key(tenant_id, operation_type, operation_key), written
            -- out: a SQL function with a SET clause would be parsed again on every call.
            coalesce(idempotency_key,
                     'ob1_' || encode(sha256(convert_to(
                         jsonb_build_array(tenant_id, operation_type, operation_key)::text,
                         'UTF8')), 'hex')),
            correlation_id, traceparent, max_attempts, coalesce(available_at, now()),
            -- An ordered operation waits until its turn is settled at commit (take_turn, 0015).
            ordering_key, ordering_key IS NOT NULL
        )
        ON CONFLICT ON CONSTRAINT operations_identity DO NOTHING
        RETURNING o.id INTO v_id;

        IF v_id IS NOT NULL THEN
            IF ordering_key IS NOT NULL THEN
                -- take_turn locks every key of this transaction at commit, in one order.
                PERFORM set_config('outbox.ordering_locks',
                    concat_ws(',', nullif(current_setting('outbox.ordering_locks', true), ''),
                              outbox.ordering_lock(tenant_id, ordering_key)), true);
            END IF;
            -- No NOTIFY here: the trigger operations_wake_dispatchers sends one at commit, and
            -- only while a dispatcher waits for it (0012).
            operation_id := v_id;
            outcome := 'accepted';
            RETURN NEXT;
            RETURN;
        END IF;

        SELECT o.id, o.fingerprint INTO v_id, v_existing
        FROM outbox.operations o
        WHERE o.tenant_id = tenant_id
          AND o.operation_type = operation_type
          AND o.operation_key = operation_key;

        IF v_id IS NOT NULL THEN
            IF v_existing <> v_fingerprint THEN
                RAISE EXCEPTION 'operation %/%/% already exists with another provider, action or payload',
                    tenant_id, operation_type, operation_key
                    USING ERRCODE = 'OB001',
                          DETAIL = format('existing operation id: %s', v_id),
                          HINT = 'a different intent needs its own operation_key';
            END IF;
            operation_id := v_id;
            outcome := 'duplicate';
            RETURN NEXT;
            RETURN;
        END IF;
        -- The row that conflicted was deleted before we could read it (pruned): insert again.
    END LOOP;
END;
$$;

DROP FUNCTION outbox.insert_operation(text, text, text, text, text, jsonb, text, text,
                                      timestamptz, integer, text, text);
DROP FUNCTION outbox.max_payload_bytes();
