-- Wake-ups that cost producers nothing while every dispatcher is busy.
--
-- A NOTIFY takes a cluster-wide lock at commit: single-row notifying inserts top out near a
-- third of plain inserts, however many clients. A dispatcher with a backlog claims again as soon
-- as a slot frees and needs no wake-up; only an idle one does. So an idle dispatcher records
-- that it waits (outbox.waiting_dispatchers), and a producer's commit notifies only then.
--
-- The check runs at commit (a deferred constraint trigger), not when enqueue is called, so a
-- producer that enqueues early in a long transaction still sees a dispatcher that went idle in
-- the meantime. A dispatcher marks itself waiting before its last claim, and sleeps only if
-- that claim is short: a row committed before the mark is claimed then, one committed after it
-- notifies. Whatever slips between is claimed at the next poll (poll_interval).

-- UNLOGGED: this is the state of live processes; a crash of the server empties it, which is
-- right, since every dispatcher reconnects and marks itself again.
CREATE UNLOGGED TABLE outbox.waiting_dispatchers (
    worker  text        PRIMARY KEY,
    seen_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE outbox.waiting_dispatchers IS
    'Dispatchers idle and LISTENing: producers notify only while one is here. Rows older than '
    '10 minutes (a dispatcher that died waiting) are ignored; dispatchers refresh theirs.';

-- SECURITY DEFINER: a deferred trigger fires at the producer's COMMIT, after enqueue (which runs
-- as the owner) has returned, so as the producer's own role, which may not read this table.
CREATE FUNCTION outbox.wake_dispatchers() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox.waiting_dispatchers
               WHERE seen_at > now() - interval '10 minutes') THEN
        -- Folded by PostgreSQL into one notification per transaction.
        PERFORM pg_notify('outbox_enqueue', '');
    END IF;
    RETURN NULL;
END;
$$;
REVOKE ALL ON FUNCTION outbox.wake_dispatchers() FROM PUBLIC;

CREATE CONSTRAINT TRIGGER operations_wake_dispatchers
    AFTER INSERT ON outbox.operations
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION outbox.wake_dispatchers();

-- enqueue's body (0004) without its unconditional NOTIFY.
CREATE OR REPLACE FUNCTION outbox.insert_operation(
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
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
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
            -- No NOTIFY here: the trigger operations_wake_dispatchers sends one at commit, and
            -- only while a dispatcher waits for it.
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
