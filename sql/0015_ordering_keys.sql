-- 0015: ordering keys. Operations enqueued with the same ordering_key (per tenant) reach the
-- provider one at a time, in enqueue order; operations with different keys run in parallel.
--
-- Of each key's operations, one at most is "the head": not ordering_blocked, and pending, in
-- flight, or (in mode block) quarantined or reconciling. Every other operation of the key waits
-- with ordering_blocked set, out of the claim index (0014), so a long queue behind one key
-- costs the claim nothing. When the head is settled (succeeded, cancelled, or set aside in mode
-- skip), the next operation by id takes its place (promote_next).
--
-- Who decides, and why it cannot race:
-- * A producer's new ordered operation is inserted waiting. At COMMIT a deferred trigger
--   (take_turn) takes the key's advisory lock, then, if the key has no head, promotes its
--   earliest waiting operation: this one, unless the key was between heads.
--   The producer holds the lock only for its commit, never across its own transaction, and
--   takes all its keys' locks at once in one order (from outbox.ordering_locks), so two
--   producers cannot deadlock.
-- * Whoever settles a head (the dispatcher's record or rescue, an operator) promotes the next
--   under the same lock, but only tries for it: it holds row locks, and waiting for a producer's
--   commit while holding them could deadlock. When the try fails a producer of that key is
--   committing right now, and may not yet see the head settled; the key is noted in
--   ordering_repairs and a dispatcher promotes under the lock within a second
--   (repair_ordering_key). With the lock held, both sides read after the other's commit:
--   every query in a plpgsql function takes a fresh snapshot.

-- Per operation type: whether a quarantined or reconciling operation holds up the later ones of
-- its key (block, the default) or lets them go on (skip).
CREATE TABLE outbox.ordering_modes (
    operation_type text        PRIMARY KEY,
    on_failure     text        NOT NULL CHECK (on_failure IN ('block', 'skip')),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    updated_by     text        NOT NULL
);
COMMENT ON TABLE outbox.ordering_modes IS
    'Per operation type: block (default) or skip the later operations of an ordering key '
    'while an earlier one is quarantined or reconciling. Set with outbox.set_ordering_mode.';

-- Keys whose next operation must be promoted by a dispatcher (see above). Duplicates are fine.
CREATE TABLE outbox.ordering_repairs (
    tenant_id    text        NOT NULL,
    ordering_key text        NOT NULL,
    noted_at     timestamptz NOT NULL DEFAULT now()
);

-- The head of a key, if any: small (one row per key at most), read on every turn.
CREATE INDEX operations_ordering_heads ON outbox.operations (tenant_id, ordering_key)
    WHERE ordering_key IS NOT NULL AND NOT ordering_blocked
      AND status IN ('pending', 'in_flight', 'quarantined', 'reconciling');

-- The ordering key is part of the request, like the payload: 0010's guard, one column longer.
CREATE OR REPLACE FUNCTION outbox.operations_keep_immutable() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    changed text;
BEGIN
    changed := CASE
        WHEN NEW.tenant_id IS DISTINCT FROM OLD.tenant_id THEN 'tenant_id'
        WHEN NEW.operation_type IS DISTINCT FROM OLD.operation_type THEN 'operation_type'
        WHEN NEW.operation_key IS DISTINCT FROM OLD.operation_key THEN 'operation_key'
        WHEN NEW.provider IS DISTINCT FROM OLD.provider THEN 'provider'
        WHEN NEW.action IS DISTINCT FROM OLD.action THEN 'action'
        WHEN NEW.payload IS DISTINCT FROM OLD.payload THEN 'payload'
        WHEN NEW.fingerprint IS DISTINCT FROM OLD.fingerprint THEN 'fingerprint'
        WHEN NEW.ordering_key IS DISTINCT FROM OLD.ordering_key THEN 'ordering_key'
    END;
    IF changed IS NULL
       AND (NEW.idempotency_key IS DISTINCT FROM OLD.idempotency_key
            OR NEW.key_generation IS DISTINCT FROM OLD.key_generation)
       AND NOT (OLD.status = 'reconciling' AND NEW.status = 'pending'
                AND NEW.key_generation = OLD.key_generation + 1
                AND NEW.idempotency_key
                    = outbox.next_generation_key(OLD.idempotency_key, OLD.key_generation)) THEN
        changed := CASE WHEN NEW.idempotency_key IS DISTINCT FROM OLD.idempotency_key
                        THEN 'idempotency_key' ELSE 'key_generation' END;
    END IF;
    IF changed IS NOT NULL THEN
        RAISE EXCEPTION 'operation %: % never changes after enqueue', OLD.id, changed
            USING ERRCODE = 'OB005', COLUMN = changed, TABLE = 'operations', SCHEMA = 'outbox',
                  HINT = 'a different request is a new operation; only `outbox reconcile retry` '
                         'moves the idempotency key to its next generation';
    END IF;
    RETURN NEW;
END;
$$;

DROP TRIGGER operations_immutable ON outbox.operations;
CREATE TRIGGER operations_immutable
    BEFORE UPDATE OF tenant_id, operation_type, operation_key, provider, action, payload,
                     fingerprint, idempotency_key, key_generation, ordering_key
    ON outbox.operations
    FOR EACH ROW EXECUTE FUNCTION outbox.operations_keep_immutable();

-- The advisory lock of one key: the two-integer form, in a space of its own (the first integer),
-- so it never meets the single-bigint locks of migrations or of the application.
CREATE FUNCTION outbox.ordering_lock(tenant_id text, ordering_key text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT hashtext(tenant_id || E'\n' || ordering_key) $$;

CREATE FUNCTION outbox.ordering_lock_space() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT hashtext('outbox.ordering') $$;

CREATE FUNCTION outbox.ordering_mode(operation_type text) RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce((SELECT m.on_failure FROM outbox.ordering_modes m
                     WHERE m.operation_type = ordering_mode.operation_type), 'block')
$$;

-- Does the key have a head other than operation except_id?
CREATE FUNCTION outbox.ordering_has_head(tenant_id text, ordering_key text, except_id bigint)
RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (
        SELECT 1 FROM outbox.operations o
        WHERE o.tenant_id = ordering_has_head.tenant_id
          AND o.ordering_key = ordering_has_head.ordering_key
          AND NOT o.ordering_blocked
          AND o.status IN ('pending', 'in_flight', 'quarantined', 'reconciling')
          AND o.id <> ordering_has_head.except_id
          AND (o.status IN ('pending', 'in_flight')
               OR outbox.ordering_mode(o.operation_type) = 'block'))
$$;

-- With the key's lock held: make the earliest waiting operation the head, unless there is one.
-- Returns the id promoted, or NULL.
CREATE FUNCTION outbox.promote_next(tenant_id text, ordering_key text) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    v_next bigint;
BEGIN
    LOOP
        IF outbox.ordering_has_head(tenant_id, ordering_key, 0) THEN
            RETURN NULL;
        END IF;
        SELECT o.id INTO v_next FROM outbox.operations o
        WHERE o.tenant_id = tenant_id AND o.ordering_key = ordering_key AND o.ordering_blocked
        ORDER BY o.id LIMIT 1;
        IF v_next IS NULL THEN
            RETURN NULL;
        END IF;
        -- Re-checked under the row lock; if it changed meanwhile, look again.
        UPDATE outbox.operations o SET ordering_blocked = false, updated_at = now()
        WHERE o.id = v_next AND o.ordering_blocked AND o.status = 'pending';
        IF FOUND THEN
            -- An idle dispatcher would otherwise find it only at its next poll (see 0012).
            IF EXISTS (SELECT 1 FROM outbox.waiting_dispatchers
                       WHERE seen_at > now() - interval '10 minutes') THEN
                PERFORM pg_notify('outbox_enqueue', '');
            END IF;
            RETURN v_next;
        END IF;
    END LOOP;
END;
$$;

-- At a producer's COMMIT, for each ordered operation it inserted: its turn, now or later.
-- SECURITY DEFINER: it fires as the producer's role, which may not touch the table.
CREATE FUNCTION outbox.take_turn() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_locks text := current_setting('outbox.ordering_locks', true);
BEGIN
    IF coalesce(v_locks, '') <> '' THEN
        -- The first firing of the transaction locks every key of it, in ascending order.
        PERFORM pg_advisory_xact_lock(outbox.ordering_lock_space(), k)
        FROM (SELECT DISTINCT k FROM unnest(string_to_array(v_locks, ',')::integer[]) AS u(k)
              ORDER BY k) AS keys;
        PERFORM set_config('outbox.ordering_locks', '', true);
    END IF;
    -- Already held, unless the row came in some other way than enqueue.
    PERFORM pg_advisory_xact_lock(outbox.ordering_lock_space(),
                                  outbox.ordering_lock(NEW.tenant_id, NEW.ordering_key));
    -- Not simply "this one, if the key has no head": the key may be between heads, its next
    -- operation promoted by nobody yet (a repair is due), and that one goes first.
    PERFORM outbox.promote_next(NEW.tenant_id, NEW.ordering_key);
    RETURN NULL;
END;
$$;

CREATE CONSTRAINT TRIGGER operations_take_turn
    AFTER INSERT ON outbox.operations
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL)
    EXECUTE FUNCTION outbox.take_turn();

-- A head settled: the next operation of its key goes, if the key's lock can be had at once.
CREATE FUNCTION outbox.pass_turn() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF OLD.ordering_blocked
       OR (NEW.status IN ('quarantined', 'reconciling')
           AND outbox.ordering_mode(NEW.operation_type) = 'block') THEN
        RETURN NULL;  -- it was not the head, or it still is
    END IF;
    -- Settled from quarantined or reconciling (resolved, cancelled) or set aside in mode skip:
    -- if it was not the head, promote_next finds the head in place and changes nothing.
    IF pg_try_advisory_xact_lock(outbox.ordering_lock_space(),
                                 outbox.ordering_lock(NEW.tenant_id, NEW.ordering_key)) THEN
        PERFORM outbox.promote_next(NEW.tenant_id, NEW.ordering_key);
    ELSE
        INSERT INTO outbox.ordering_repairs (tenant_id, ordering_key)
        VALUES (NEW.tenant_id, NEW.ordering_key);
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER operations_pass_turn
    AFTER UPDATE OF status ON outbox.operations
    FOR EACH ROW
    WHEN (NEW.ordering_key IS NOT NULL AND OLD.status IS DISTINCT FROM NEW.status
          AND NEW.status IN ('succeeded', 'cancelled', 'quarantined', 'reconciling'))
    EXECUTE FUNCTION outbox.pass_turn();

-- An operation back to pending from quarantine or reconciliation (an operator's replay or
-- retry) rejoins the line if its key went on without it (mode skip): it waits for the head,
-- and, being earlier, goes next. Only operators make this change, so it may wait for the lock.
CREATE FUNCTION outbox.rejoin_line() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(outbox.ordering_lock_space(),
                                  outbox.ordering_lock(NEW.tenant_id, NEW.ordering_key));
    NEW.ordering_blocked := outbox.ordering_has_head(NEW.tenant_id, NEW.ordering_key, NEW.id);
    RETURN NEW;
END;
$$;

CREATE TRIGGER operations_rejoin_line
    BEFORE UPDATE OF status ON outbox.operations
    FOR EACH ROW
    WHEN (NEW.ordering_key IS NOT NULL AND NEW.status = 'pending'
          AND OLD.status IN ('quarantined', 'reconciling'))
    EXECUTE FUNCTION outbox.rejoin_line();

-- A dispatcher's repair of one key noted in ordering_repairs: it may wait for the lock, holding
-- nothing else (one key per call, in its own transaction).
CREATE FUNCTION outbox.repair_ordering_key(tenant_id text, ordering_key text) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
BEGIN
    PERFORM pg_advisory_xact_lock(outbox.ordering_lock_space(),
                                  outbox.ordering_lock(tenant_id, ordering_key));
    DELETE FROM outbox.ordering_repairs r
    WHERE r.tenant_id = tenant_id AND r.ordering_key = ordering_key;
    RETURN outbox.promote_next(tenant_id, ordering_key);
END;
$$;

-- An operator's choice of block or skip for an operation type. Switching to skip lets the keys
-- held up by that type's quarantined or reconciling operations go on at once.
CREATE FUNCTION outbox.set_ordering_mode(operation_type text, on_failure text, actor text)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    v_key record;
    v_promoted integer := 0;
BEGIN
    IF on_failure IS NULL OR on_failure NOT IN ('block', 'skip') THEN
        RAISE EXCEPTION 'on_failure must be block or skip, not %', coalesce(on_failure, 'NULL')
            USING ERRCODE = 'OB002', COLUMN = 'on_failure';
    END IF;
    PERFORM outbox.check_text('operation_type', operation_type, 128);
    PERFORM outbox.check_text('actor', actor, 255);
    INSERT INTO outbox.ordering_modes AS m (operation_type, on_failure, updated_by)
    VALUES (operation_type, on_failure, actor)
    ON CONFLICT ON CONSTRAINT ordering_modes_pkey
    DO UPDATE SET on_failure = EXCLUDED.on_failure, updated_at = now(),
                  updated_by = EXCLUDED.updated_by;
    IF on_failure = 'skip' THEN
        -- In the producers' lock order, so that this can never deadlock with them.
        FOR v_key IN
            SELECT DISTINCT o.tenant_id, o.ordering_key,
                   outbox.ordering_lock(o.tenant_id, o.ordering_key) AS lock
            FROM outbox.operations o
            WHERE o.operation_type = operation_type AND o.ordering_key IS NOT NULL
              AND NOT o.ordering_blocked AND o.status IN ('quarantined', 'reconciling')
            ORDER BY lock
        LOOP
            PERFORM pg_advisory_xact_lock(outbox.ordering_lock_space(), v_key.lock);
            IF outbox.promote_next(v_key.tenant_id, v_key.ordering_key) IS NOT NULL THEN
                v_promoted := v_promoted + 1;
            END IF;
        END LOOP;
    END IF;
    RETURN v_promoted;
END;
$$;

CREATE FUNCTION outbox.insert_operation(
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
    PERFORM outbox.check_text('ordering_key', ordering_key, 255, false);

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
    -- The ordering key is part of the intent: the same identity with another key is a conflict.
    -- Without one the fingerprint is what it always was.
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
            coalesce(idempotency_key,
                     outbox.derive_idempotency_key(tenant_id, operation_type, operation_key)),
            correlation_id, traceparent, max_attempts, coalesce(available_at, now()),
            -- An ordered operation waits until its turn is settled at commit (take_turn).
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
-- enqueue with ordering_key. The old signatures go: a call naming only the old arguments would
-- otherwise match two functions.
DROP FUNCTION outbox.enqueue(text, text, text, text, text, jsonb, text, text, timestamptz,
                             integer, text);
DROP FUNCTION outbox.insert_operation(text, text, text, text, text, jsonb, text, text,
                                      timestamptz, integer, text);

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
    traceparent     text        DEFAULT NULL,
    ordering_key    text        DEFAULT NULL
) RETURNS TABLE (operation_id bigint, outcome text)
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT outbox.require_tenant(enqueue.tenant_id);
    SELECT * FROM outbox.insert_operation(
        enqueue.tenant_id, enqueue.operation_type, enqueue.operation_key, enqueue.provider,
        enqueue.action, enqueue.payload, enqueue.correlation_id, enqueue.idempotency_key,
        enqueue.available_at, enqueue.max_attempts, enqueue.traceparent, enqueue.ordering_key);
$$;

COMMENT ON FUNCTION outbox.enqueue IS
    'Records an operation in the caller''s transaction: accepted (new) or duplicate; SQLSTATE OB001 on conflict, OB002 on invalid input, 42501 for another tenant than the bound one. Operations with the same ordering_key (per tenant) are sent one at a time, in enqueue order.';

REVOKE ALL ON FUNCTION outbox.enqueue(text, text, text, text, text, jsonb, text, text,
                                      timestamptz, integer, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.insert_operation(text, text, text, text, text, jsonb, text, text,
                                               timestamptz, integer, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.ordering_lock(text, text), outbox.ordering_lock_space(),
    outbox.ordering_mode(text), outbox.ordering_has_head(text, text, bigint),
    outbox.promote_next(text, text), outbox.take_turn(), outbox.pass_turn(),
    outbox.rejoin_line(), outbox.repair_ordering_key(text, text),
    outbox.set_ordering_mode(text, text, text)
FROM PUBLIC;

-- Where the roles exist (sql/roles.sql), the new functions get the grants the old ones had.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_producer') THEN
        GRANT EXECUTE ON FUNCTION outbox.enqueue(text, text, text, text, text, jsonb, text, text,
                                                 timestamptz, integer, text, text)
        TO outbox_producer;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_dispatcher') THEN
        GRANT SELECT ON outbox.ordering_repairs, outbox.ordering_modes TO outbox_dispatcher;
        GRANT EXECUTE ON FUNCTION outbox.repair_ordering_key(text, text) TO outbox_dispatcher;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_operator') THEN
        GRANT SELECT ON outbox.ordering_repairs, outbox.ordering_modes TO outbox_operator;
        GRANT EXECUTE ON FUNCTION outbox.set_ordering_mode(text, text, text) TO outbox_operator;
    END IF;
END;
$$;
