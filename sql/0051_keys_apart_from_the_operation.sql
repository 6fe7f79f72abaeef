-- 0051: an operation's identity and provider key are kept apart from its row (issue 41, step C).
--
-- Until now outbox.operations held both uniqueness rules itself: operations_identity (tenant,
-- type, key) and operations_provider_key (provider, key). Every claim and every record writes a
-- new version of the row (never HOT: status and the lease are in the claim and lease indexes),
-- and each version put an entry into both unique indexes, whose keys are random (a hash, a
-- caller's key) and whose insert checks the earlier version under the same key: two of the
-- eight index entries per operation, on the hot path, for values that never change. In bare
-- workers without them the drain ran 1.23x, 1.39x with 0050's ledger (issue 41;
-- bench/README.md, "Lifecycles in bare workers").
--
-- Now outbox.operation_keys holds one row per operation, written once by enqueue: its
-- identity (the primary key) and its provider key (unique per provider; NULL for an operation
-- that shares its key with older ones, key_shared of sql/0024, as the partial index left those
-- out). enqueue inserts it first, with the operation's id taken from the sequence, so its ON
-- CONFLICT answers both rules before the operation exists; a claim or a record never touches
-- it. Triggers keep it true for every other writer: an UPDATE of idempotency_key (reconcile
-- retry's next generation) moves the key, a DELETE (prune, an owner's hand) or a TRUNCATE of
-- operations takes its rows too. A row inserted into outbox.operations by hand, bypassing
-- enqueue, has no keys row: its identity is not guarded (the roles grant no such INSERT).
--
-- The table has no row-level security and is granted to outbox_operator alone (to find an
-- operation by identity): uniqueness is across tenants. Before this, under tenant isolation
-- with a schema owner that is not a superuser, enqueue could not see another tenant's operation
-- holding the caller's key (FORCE binds the owner to the bound tenant), and its loop of insert
-- and look-up never ended: a producer's enqueue spun until its statement_timeout. enqueue's
-- loop is also bounded now: a conflict whose holder vanishes three times running (deleted
-- between the insert and the look-up) is a serialization failure, 40001, to retry.
--
-- The migration takes an ACCESS EXCLUSIVE lock on outbox.operations for the copy (docs/
-- operations.md, "Upgrading to migration 0051": about a second per million operations here):
-- enqueues and claims wait for it. Dispatchers of earlier versions keep working, nothing they
-- call changes; earlier CLIs look an identity up in outbox.operations, now without an index.

LOCK TABLE outbox.operations IN ACCESS EXCLUSIVE MODE;

-- Filled first, indexed after: one sort per index instead of one insert per row.
CREATE TABLE outbox.operation_keys (
    tenant_id       text   NOT NULL,
    operation_type  text   NOT NULL,
    operation_key   text   NOT NULL,
    operation_id    bigint NOT NULL,
    provider        text   NOT NULL,
    idempotency_key text
);
COMMENT ON TABLE outbox.operation_keys IS 'Each operation''s identity and provider key, written once by enqueue; unique across tenants (sql/0051).';
COMMENT ON COLUMN outbox.operation_keys.idempotency_key IS 'The key the operation sends now (reconcile retry moves it); NULL for an operation that shares its key with older ones (operations.key_shared).';
REVOKE ALL ON outbox.operation_keys FROM PUBLIC;

INSERT INTO outbox.operation_keys
    (tenant_id, operation_type, operation_key, operation_id, provider, idempotency_key)
SELECT o.tenant_id, o.operation_type, o.operation_key, o.id, o.provider,
       CASE WHEN NOT o.key_shared THEN o.idempotency_key END
FROM outbox.operations o;

ALTER TABLE outbox.operation_keys
    ADD CONSTRAINT operation_keys_identity PRIMARY KEY (tenant_id, operation_type, operation_key),
    ADD CONSTRAINT operation_keys_provider_key UNIQUE (provider, idempotency_key);

ALTER TABLE outbox.operations DROP CONSTRAINT operations_identity;
DROP INDEX outbox.operations_provider_key;

-- reconcile retry's next generation (and any other change of the key) moves the keys row: the
-- key the operation sends is the one no other may take.
CREATE FUNCTION outbox.operation_keys_follow_key() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE outbox.operation_keys k
    SET idempotency_key = CASE WHEN NOT NEW.key_shared THEN NEW.idempotency_key END
    WHERE k.tenant_id = NEW.tenant_id AND k.operation_type = NEW.operation_type
      AND k.operation_key = NEW.operation_key AND k.operation_id = NEW.id;
    RETURN NULL;
END;
$$;
REVOKE ALL ON FUNCTION outbox.operation_keys_follow_key() FROM PUBLIC;
CREATE TRIGGER operations_move_key AFTER UPDATE OF idempotency_key, key_shared
    ON outbox.operations FOR EACH ROW
    WHEN (OLD.idempotency_key IS DISTINCT FROM NEW.idempotency_key
          OR OLD.key_shared IS DISTINCT FROM NEW.key_shared)
    EXECUTE FUNCTION outbox.operation_keys_follow_key();

-- A deleted operation frees its identity and its key, as its rows' index entries did: once per
-- statement (prune deletes in batches), through the statement's deleted rows.
CREATE FUNCTION outbox.operation_keys_follow_deletes() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        TRUNCATE outbox.operation_keys;
    ELSE
        DELETE FROM outbox.operation_keys k USING gone g
        WHERE k.tenant_id = g.tenant_id AND k.operation_type = g.operation_type
          AND k.operation_key = g.operation_key AND k.operation_id = g.id;
    END IF;
    RETURN NULL;
END;
$$;
REVOKE ALL ON FUNCTION outbox.operation_keys_follow_deletes() FROM PUBLIC;
CREATE TRIGGER operations_forget_keys AFTER DELETE ON outbox.operations
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT
    EXECUTE FUNCTION outbox.operation_keys_follow_deletes();
CREATE TRIGGER operations_truncate_keys AFTER TRUNCATE ON outbox.operations
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.operation_keys_follow_deletes();

-- enqueue as in sql/0041, but for its loop.
CREATE OR REPLACE FUNCTION outbox.enqueue(tenant_id text, operation_type text, operation_key text, provider text, action text, payload jsonb, correlation_id text DEFAULT NULL::text, idempotency_key text DEFAULT NULL::text, available_at timestamp with time zone DEFAULT NULL::timestamp with time zone, max_attempts integer DEFAULT NULL::integer, traceparent text DEFAULT NULL::text, ordering_key text DEFAULT NULL::text)
 RETURNS TABLE(operation_id bigint, outcome text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $function$
#variable_conflict use_variable
DECLARE
    v_payload_text text;
    v_bytes        integer;
    v_max_bytes    integer;
    v_max_values   integer;
    v_values       integer;
    v_available_at timestamptz;
    v_fingerprint  bytea;
    v_id           bigint;
    v_existing     bytea;
    v_isolated     boolean;
    v_key          text;
    v_secret       bytea;
    v_new          bigint;
    v_holder_tenant text;
BEGIN
    -- The tenant check (require_tenant, 0011), as in 0017: skipped for the tenant this
    -- transaction bound (bound_tenant(), 0038: a value from an earlier transaction is none).
    IF (CASE WHEN current_setting('outbox.tenant_bound_at', true)
                  = to_char(transaction_timestamp() AT TIME ZONE 'UTC', 'YYYYMMDDHH24MISSUS')
             THEN nullif(current_setting('outbox.tenant_id', true), '') END)
           IS DISTINCT FROM tenant_id
       AND btrim(tenant_id) <> '' THEN
        SELECT c.relrowsecurity INTO v_isolated FROM pg_catalog.pg_class c
        WHERE c.oid = 'outbox.operations'::regclass;
        IF v_isolated THEN
            PERFORM outbox.require_tenant(tenant_id);  -- raises its 42501
        END IF;
    END IF;

    -- check_text's conditions on every text field at once, as in 0017; the characters no
    -- identity may hold (check_text, above) by one match over all seven fields together.
    IF (    tenant_id IS NOT NULL AND btrim(tenant_id) <> '' AND char_length(tenant_id) <= 128
        AND operation_type IS NOT NULL AND btrim(operation_type) <> ''
            AND char_length(operation_type) <= 128
        AND operation_key IS NOT NULL AND btrim(operation_key) <> ''
            AND char_length(operation_key) <= 255
        AND provider IS NOT NULL AND btrim(provider) <> '' AND char_length(provider) <= 64
        AND action IS NOT NULL AND btrim(action) <> '' AND char_length(action) <= 128
        AND (correlation_id IS NULL
             OR (btrim(correlation_id) <> '' AND char_length(correlation_id) <= 255))
        AND (ordering_key IS NULL
             OR (btrim(ordering_key) <> '' AND char_length(ordering_key) <= 255))
        -- No space of any kind (Unicode's Zs) at either end of a field: between the fields'
        -- ends, U+0001 (refused in any field, so no field holds it here).
        AND (E'\x01' || tenant_id || E'\x01' || operation_type || E'\x01' || operation_key
             || E'\x01' || provider || E'\x01' || action || E'\x01'
             || coalesce(correlation_id, '') || E'\x01' || coalesce(ordering_key, '') || E'\x01')
            !~ '\x01[\u0020\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]|[\u0020\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]\x01'
        AND (tenant_id || operation_type || operation_key || provider || action
             || coalesce(correlation_id, '') || coalesce(ordering_key, ''))
            !~ '[\u0001-\u001f\u007f-\u009f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f]'
       ) IS NOT TRUE THEN
        PERFORM outbox.check_text('tenant_id', tenant_id, 128);
        PERFORM outbox.check_text('operation_type', operation_type, 128);
        PERFORM outbox.check_text('operation_key', operation_key, 255);
        PERFORM outbox.check_text('provider', provider, 64);
        PERFORM outbox.check_text('action', action, 128);
        PERFORM outbox.check_text('correlation_id', correlation_id, 255, false);
        PERFORM outbox.check_text('ordering_key', ordering_key, 255, false);
        PERFORM outbox.check_ends('tenant_id', tenant_id);
        PERFORM outbox.check_ends('operation_type', operation_type);
        PERFORM outbox.check_ends('operation_key', operation_key);
        PERFORM outbox.check_ends('provider', provider);
        PERFORM outbox.check_ends('action', action);
        PERFORM outbox.check_ends('correlation_id', correlation_id);
        PERFORM outbox.check_ends('ordering_key', ordering_key);
    END IF;

    IF payload IS NULL THEN
        RAISE EXCEPTION 'payload is required' USING ERRCODE = 'OB002', COLUMN = 'payload';
    END IF;
    IF jsonb_typeof(payload) <> 'object' THEN
        RAISE EXCEPTION 'payload must be a JSON object, not %', jsonb_typeof(payload)
            USING ERRCODE = 'OB002', COLUMN = 'payload';
    END IF;
    v_payload_text := payload::text;
    v_bytes := octet_length(v_payload_text);
    -- outbox.limits is read only for a payload over the least limit it can hold (4 KiB).
    IF v_bytes > 4096 THEN
        SELECT l.max_payload_bytes, l.max_payload_elements INTO v_max_bytes, v_max_values
        FROM outbox.limits l;
        v_max_bytes := coalesce(v_max_bytes, 1048576);  -- the row deleted: the defaults
        v_max_values := coalesce(v_max_values, 100000);
        IF v_bytes > v_max_bytes THEN
            RAISE EXCEPTION 'payload is % bytes of JSON; at most % are allowed',
                v_bytes, v_max_bytes
                USING ERRCODE = 'OB002', COLUMN = 'payload',
                      HINT = 'the limit is outbox.limits.max_payload_bytes, set by the owner '
                             'of the outbox schema';
        END IF;
    END IF;
    -- What the dispatcher could not carry (outbox/payloads.py): first the depth, so that the
    -- number check never walks a document nested absurdly deep.
    IF jsonb_path_exists(payload,
                         'strict $.**{64} ? (@.type() == "object" || @.type() == "array")') THEN
        RAISE EXCEPTION 'payload nests objects and arrays deeper than 64 levels'
            USING ERRCODE = 'OB002', COLUMN = 'payload';
    END IF;
    -- Its values, the payload object included (0037). Each takes two bytes of the text at the
    -- least ("0," and "[]" alike; PostgreSQL writes ", " between them), so only a payload of
    -- twice the limit's bytes can hold too many. Of those, only one whose commas and opening
    -- brackets outnumber the limit is counted (each value but the first of its container
    -- follows a comma; a container's first, its bracket); the rest are ordinary data.
    IF v_bytes > 4096 AND v_bytes >= 2 * v_max_values
       AND v_bytes - octet_length(translate(v_payload_text, ',[{', '')) >= v_max_values THEN
        v_values := jsonb_array_length(jsonb_path_query_array(payload, 'strict $.**.type()'));
        IF v_values > v_max_values THEN
            RAISE EXCEPTION 'payload holds % JSON values (objects, arrays, strings, numbers, '
                            'booleans and nulls, itself included); at most % are allowed',
                v_values, v_max_values
                USING ERRCODE = 'OB002', COLUMN = 'payload',
                      HINT = 'the limit is outbox.limits.max_payload_elements, set by the owner '
                             'of the outbox schema';
        END IF;
    END IF;
    IF jsonb_path_exists(payload,
                         'strict $.** ? (@.type() == "number" && (@ >= 1e100 || @ <= -1e100))')
    THEN
        RAISE EXCEPTION 'payload holds a number of 1e100 or more in magnitude; at most 100 '
                        'digits before the decimal point are allowed'
            USING ERRCODE = 'OB002', COLUMN = 'payload',
                  HINT = 'send such a value as a string';
    END IF;
    -- Visible ASCII only: the key travels in an HTTP header and Stripe allows 255 characters.
    IF idempotency_key IS NOT NULL AND idempotency_key !~ '^[!-~]{1,255}$' THEN
        RAISE EXCEPTION 'idempotency_key must be 1 to 255 visible ASCII characters without spaces'
            USING ERRCODE = 'OB002', COLUMN = 'idempotency_key';
    END IF;
    -- outbox's own keys: derived ones (ob1_ and a hash anyone can compute of an identity,
    -- before 0041; ob2_ since, and any ob<N>_ to come), and the later generations of any key
    -- (:r2...). A caller taking one would occupy the key of an operation not enqueued yet, or
    -- of a reconcile retry. In any case (0036): a provider that compares keys without regard
    -- to case takes OB1_... for ob1_....
    IF idempotency_key ~* '^ob[0-9]+_' OR idempotency_key ~* ':r[0-9]+$' THEN
        RAISE EXCEPTION 'idempotency_key may not begin with ob<digits>_ (ob1_, ob2_) or end '
                        'with :r and a number, '
                        'in any case: outbox keeps those forms for the keys it makes'
            USING ERRCODE = 'OB002', COLUMN = 'idempotency_key';
    END IF;
    -- The derived key mixes in this installation's secret (0041): no one who knows only the
    -- identity can compute it, and two databases never derive the same key.
    IF idempotency_key IS NULL THEN
        SELECT i.key_secret INTO v_secret FROM outbox.installation i;
        IF v_secret IS NULL THEN
            RAISE EXCEPTION 'outbox.installation has no key secret'
                USING ERRCODE = '55000',
                      HINT = 'the schema owner restores its row from a backup of this database '
                             '(docs/operations.md, "Derived keys")';
        END IF;
        v_key := 'ob2_' || encode(sha256(v_secret || sha256(v_secret || convert_to(
                     jsonb_build_array(tenant_id, operation_type, operation_key)::text,
                     'UTF8'))), 'hex');
    ELSE
        v_key := idempotency_key;
    END IF;
    IF max_attempts IS NOT NULL AND max_attempts < 1 THEN
        RAISE EXCEPTION 'max_attempts must be at least 1, not %', max_attempts
            USING ERRCODE = 'OB002', COLUMN = 'max_attempts';
    END IF;
    IF max_attempts > 1000 THEN
        RAISE EXCEPTION 'max_attempts may be at most 1000, not %', max_attempts
            USING ERRCODE = 'OB002', COLUMN = 'max_attempts';
    END IF;
    IF available_at IS NOT NULL
       AND (NOT isfinite(available_at) OR available_at > now() + interval '10 years') THEN
        RAISE EXCEPTION 'available_at must be a finite time at most 10 years ahead, not %',
            available_at
            USING ERRCODE = 'OB002', COLUMN = 'available_at';
    END IF;
    v_available_at := greatest(coalesce(available_at, now()), now());
    IF traceparent IS NOT NULL
       AND traceparent !~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$' THEN
        RAISE EXCEPTION 'traceparent must be a W3C trace context header value'
            USING ERRCODE = 'OB002', COLUMN = 'traceparent';
    END IF;

    -- What this tenant may enqueue, where an operator said so (enqueue_allowances).
    IF EXISTS (SELECT FROM outbox.enqueue_allowances) THEN
        PERFORM outbox.require_allowance(tenant_id, provider, action);
    END IF;

    v_fingerprint := sha256(convert_to(provider || E'\n' || action || E'\n' || v_payload_text
                                       || coalesce(E'\n' || ordering_key, ''), 'UTF8'));


    -- The keys row first (sql/0051): its ON CONFLICT answers both rules, the identity and the
    -- provider's key (operation_keys_provider_key), before the operation exists. Bounded: a
    -- holder that vanishes between the insert and the look-up (deleted) is looked for again
    -- twice, then the caller retries (40001), rather than spinning here.
    FOR v_round IN 1..3 LOOP
        v_new := nextval('outbox.operations_id_seq');
        INSERT INTO outbox.operation_keys AS k (
            tenant_id, operation_type, operation_key, operation_id, provider, idempotency_key
        ) VALUES (tenant_id, operation_type, operation_key, v_new, provider, v_key)
        ON CONFLICT DO NOTHING
        RETURNING k.operation_id INTO v_id;

        IF v_id IS NOT NULL THEN
            INSERT INTO outbox.operations AS o (
                id, tenant_id, operation_type, operation_key, fingerprint, provider, action,
                payload, idempotency_key, correlation_id, traceparent, max_attempts,
                available_at, scheduled, payload_bytes, ordering_key, ordering_blocked
            ) OVERRIDING SYSTEM VALUE VALUES (
                v_id, tenant_id, operation_type, operation_key, v_fingerprint, provider, action,
                payload, v_key, correlation_id, traceparent, max_attempts, v_available_at,
                -- Not due yet: out of the claim index until a dispatcher stages it.
                v_available_at > now(), v_bytes,
                ordering_key, ordering_key IS NOT NULL
            );
            IF ordering_key IS NOT NULL THEN
                -- Its turn is taken at COMMIT, with this transaction's other keys (take_turn).
                INSERT INTO outbox.ordering_turns AS t (xid, tenant_id, ordering_key)
                VALUES (pg_current_xact_id(), tenant_id, ordering_key) ON CONFLICT DO NOTHING;
            END IF;
            operation_id := v_id;
            outcome := 'accepted';
            RETURN NEXT;
            RETURN;
        END IF;

        -- This identity's operation: the same tenant's, so visible under row-level security.
        SELECT k.operation_id, o.fingerprint INTO v_id, v_existing
        FROM outbox.operation_keys k
        JOIN outbox.operations o ON o.id = k.operation_id
        WHERE k.tenant_id = tenant_id
          AND k.operation_type = operation_type
          AND k.operation_key = operation_key;

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

        -- Not this identity: its key names another operation at the provider, whose answers
        -- this one would be given (or refused with). Read from the keys, which row-level
        -- security does not hide: the holder may be another tenant's. Its id only to the same
        -- tenant.
        SELECT k.operation_id, k.tenant_id INTO v_id, v_holder_tenant
        FROM outbox.operation_keys k
        WHERE k.provider = provider AND k.idempotency_key = v_key;
        IF v_id IS NOT NULL THEN
            RAISE EXCEPTION 'idempotency_key % already names another operation of provider %',
                v_key, provider
                USING ERRCODE = 'OB001', COLUMN = 'idempotency_key',
                      DETAIL = CASE WHEN v_holder_tenant = tenant_id
                                    THEN format('existing operation id: %s', v_id)
                                    ELSE 'it belongs to another tenant' END,
                      HINT = 'a key is sent to the provider as it is: each operation needs its own';
        END IF;
    END LOOP;
    RAISE EXCEPTION 'operation %/%/% conflicted with an operation that was deleted meanwhile, '
                    'three times', tenant_id, operation_type, operation_key
        USING ERRCODE = '40001', HINT = 'retry the transaction';
END;
$function$;

-- By identity through the keys (the operation's row has no index on it since this migration).
CREATE OR REPLACE FUNCTION outbox.get_operation(tenant_id text, operation_type text,
                                                operation_key text)
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
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT outbox.require_tenant(get_operation.tenant_id);
    SELECT o.id, o.tenant_id, o.operation_type, o.operation_key, o.provider, o.action, o.status,
           o.status_reason, o.attempts, o.provider_ref, o.result, o.last_error, o.last_error_class,
           o.idempotency_key, o.correlation_id, o.created_at, o.updated_at, o.available_at,
           o.finished_at
    FROM outbox.operation_keys k
    JOIN outbox.operations o ON o.id = k.operation_id
    WHERE k.tenant_id = get_operation.tenant_id
      AND k.operation_type = get_operation.operation_type
      AND k.operation_key = get_operation.operation_key
$$;

-- `outbox show`'s look-up by identity (FIND_BY_IDENTITY) reads the keys: the operator's, where
-- the role exists already (roles.sql grants it too), so a rolling upgrade needs no rerun of it.
DO $grant$
BEGIN
    IF to_regrole('outbox_operator') IS NOT NULL THEN
        GRANT SELECT ON outbox.operation_keys TO outbox_operator;
    END IF;
END
$grant$;
