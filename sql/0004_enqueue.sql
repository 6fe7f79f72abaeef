-- 0004: the producer interface: outbox.enqueue and outbox.get_operation, callable from any language
-- inside the producer's own transaction.
--
-- SQLSTATEs raised here (class OB is ours; PostgreSQL uses no class starting with O):
--   OB001  operation_conflict   the identity exists with another provider, action or payload
--   OB002  invalid_operation    an argument is malformed; the error's COLUMN field names it
--   OB003  audit_append_only    (0003) an UPDATE of outbox.audit

-- Rejects a missing, blank, over-long or control-character-bearing text argument, naming it.
CREATE FUNCTION outbox.check_text(field text, value text, max_length integer, required boolean DEFAULT true)
RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF value IS NULL THEN
        IF required THEN
            RAISE EXCEPTION '% is required', field USING ERRCODE = 'OB002', COLUMN = field;
        END IF;
        RETURN;
    END IF;
    IF btrim(value) = '' THEN
        RAISE EXCEPTION '% must not be empty', field USING ERRCODE = 'OB002', COLUMN = field;
    END IF;
    IF char_length(value) > max_length THEN
        RAISE EXCEPTION '% is % characters long; at most % are allowed',
            field, char_length(value), max_length
            USING ERRCODE = 'OB002', COLUMN = field;
    END IF;
    -- Identities end up in log lines, HTTP headers and operators' terminals.
    IF value ~ '[[:cntrl:]]' THEN
        RAISE EXCEPTION '% must not contain control characters', field
            USING ERRCODE = 'OB002', COLUMN = field;
    END IF;
END;
$$;

-- The idempotency key of an operation that brings none: a pure function of its identity, so the
-- same intent always carries the same key. 68 ASCII characters, safe for Stripe (at most 255) and
-- for an HTTP header.
CREATE FUNCTION outbox.derive_idempotency_key(tenant_id text, operation_type text, operation_key text)
RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT 'ob1_' || encode(sha256(convert_to(
        jsonb_build_array(tenant_id, operation_type, operation_key)::text, 'UTF8')), 'hex')
$$;

-- The largest payload enqueue accepts, in bytes of its JSON text. A DBA may change it per
-- database or role: ALTER DATABASE app SET outbox.max_payload_bytes = 4194304.
CREATE FUNCTION outbox.max_payload_bytes() RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT coalesce(nullif(current_setting('outbox.max_payload_bytes', true), '')::bigint, 1048576)
$$;

CREATE FUNCTION outbox.enqueue(
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
    traceparent     text        DEFAULT NULL
) RETURNS TABLE (operation_id bigint, outcome text)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_variable
DECLARE
    v_payload_text text;
    v_fingerprint  bytea;
    v_id           bigint;
    v_existing     bytea;
BEGIN
    PERFORM outbox.check_text('tenant_id', tenant_id, 128);
    PERFORM outbox.check_text('operation_type', operation_type, 128);
    PERFORM outbox.check_text('operation_key', operation_key, 255);
    PERFORM outbox.check_text('provider', provider, 64);
    PERFORM outbox.check_text('action', action, 128);
    PERFORM outbox.check_text('correlation_id', correlation_id, 255, false);

    IF payload IS NULL THEN
        RAISE EXCEPTION 'payload is required' USING ERRCODE = 'OB002', COLUMN = 'payload';
    END IF;
    IF jsonb_typeof(payload) <> 'object' THEN
        RAISE EXCEPTION 'payload must be a JSON object, not %', jsonb_typeof(payload)
            USING ERRCODE = 'OB002', COLUMN = 'payload';
    END IF;
    v_payload_text := payload::text;
    IF octet_length(v_payload_text) > outbox.max_payload_bytes() THEN
        RAISE EXCEPTION 'payload is % bytes of JSON; at most % are allowed',
            octet_length(v_payload_text), outbox.max_payload_bytes()
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
    -- jsonb's text form is canonical (keys sorted, whitespace normalised).
    v_fingerprint := sha256(convert_to(provider || E'\n' || action || E'\n' || v_payload_text, 'UTF8'));

    LOOP
        -- A concurrent enqueue of the same identity waits here for the other transaction to end,
        -- then does nothing; the read below sees its row.
        INSERT INTO outbox.operations AS o (
            tenant_id, operation_type, operation_key, fingerprint, provider, action, payload,
            idempotency_key, correlation_id, traceparent, max_attempts, available_at
        ) VALUES (
            tenant_id, operation_type, operation_key, v_fingerprint, provider, action, payload,
            coalesce(idempotency_key,
                     outbox.derive_idempotency_key(tenant_id, operation_type, operation_key)),
            correlation_id, traceparent, max_attempts, coalesce(available_at, now())
        )
        ON CONFLICT ON CONSTRAINT operations_identity DO NOTHING
        RETURNING o.id INTO v_id;

        IF v_id IS NOT NULL THEN
            -- Delivered only when the producer commits, and once per transaction however many
            -- operations it enqueued (PostgreSQL folds identical notifications).
            PERFORM pg_notify('outbox_enqueue', '');
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

COMMENT ON FUNCTION outbox.enqueue IS
    'Records an operation in the caller''s transaction: accepted (new) or duplicate; SQLSTATE OB001 on conflict, OB002 on invalid input.';

-- The read API: what the application shows instead of guessing. No row when the identity is unknown.
CREATE FUNCTION outbox.get_operation(tenant_id text, operation_type text, operation_key text)
RETURNS TABLE (
    operation_id     bigint,
    tenant_id        text,
    operation_type   text,
    operation_key    text,
    provider         text,
    action           text,
    status           text,
    status_reason    text,
    attempts         integer,
    provider_ref     text,
    result           jsonb,
    last_error       text,
    last_error_class text,
    idempotency_key  text,
    correlation_id   text,
    created_at       timestamptz,
    updated_at       timestamptz,
    available_at     timestamptz,
    finished_at      timestamptz
)
LANGUAGE sql STABLE AS $$
    SELECT o.id, o.tenant_id, o.operation_type, o.operation_key, o.provider, o.action, o.status,
           o.status_reason, o.attempts, o.provider_ref, o.result, o.last_error, o.last_error_class,
           o.idempotency_key, o.correlation_id, o.created_at, o.updated_at, o.available_at,
           o.finished_at
    FROM outbox.operations o
    WHERE o.tenant_id = get_operation.tenant_id
      AND o.operation_type = get_operation.operation_type
      AND o.operation_key = get_operation.operation_key
$$;
