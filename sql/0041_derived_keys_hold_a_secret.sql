-- 0041: derived idempotency keys mix in a secret of this installation (issue 38, 3i).
--
-- Until now a derived key was ob1_ and the SHA-256 of the operation's identity, which anyone
-- who knows the identity can compute: a client allowed to publish on a NATS stream could take
-- an operation's Nats-Msg-Id before outbox sent it (its message then counted as outbox's, and
-- outbox's as the duplicate), and two outbox databases that enqueue the same identity (two
-- environments, two regions, a restored copy beside the original) derived the same key for
-- every queue and provider they share.
--
-- Now each database holds a secret of its own, made here once: 32 random bytes in
-- outbox.installation, readable by the schema owner alone (enqueue reads it as the owner). New
-- operations get ob2_ and the hex SHA-256 of secret || SHA-256(secret || identity) (nested, so
-- that no length extension of the inner hash gives another key). Existing operations keep
-- their keys, stored with them: a retry, a replay and a reconciliation search use the stored
-- key, so nothing in flight changes. A caller's own key may take no ob<digits>_ form, in any
-- case. pg_dump carries the row, so a restored database derives the keys the original did;
-- a database that must derive another's keys (a move to a new server with fresh migrations)
-- copies the row (docs/operations.md, "Derived keys").
--
-- gen_random_uuid() is the randomness PostgreSQL 13+ has without pgcrypto: two version-4
-- UUIDs, 244 random bits.

CREATE TABLE outbox.installation (
    singleton   boolean PRIMARY KEY DEFAULT true CONSTRAINT installation_one_row CHECK (singleton),
    key_secret  bytea NOT NULL CONSTRAINT installation_key_secret_length
                    CHECK (octet_length(key_secret) >= 16),
    created_at  timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE outbox.installation IS 'This database''s secret, mixed into derived idempotency keys (sql/0041). The schema owner''s alone; never granted.';
REVOKE ALL ON outbox.installation FROM PUBLIC;
INSERT INTO outbox.installation (key_secret)
VALUES (decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex'));

-- The key enqueue derives for an identity, as enqueue writes it out below (the owner's only).
CREATE OR REPLACE FUNCTION outbox.derive_idempotency_key(tenant_id text, operation_type text,
                                                         operation_key text)
RETURNS text
LANGUAGE sql STABLE STRICT SET search_path = pg_catalog, pg_temp
AS $$
    SELECT 'ob2_' || encode(sha256(i.key_secret || sha256(i.key_secret || convert_to(
               jsonb_build_array(tenant_id, operation_type, operation_key)::text, 'UTF8'))),
               'hex')
    FROM outbox.installation i
$$;

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
    v_holder       outbox.operations;
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

    LOOP
        INSERT INTO outbox.operations AS o (
            tenant_id, operation_type, operation_key, fingerprint, provider, action, payload,
            idempotency_key, correlation_id, traceparent, max_attempts, available_at,
            scheduled, payload_bytes, ordering_key, ordering_blocked
        ) VALUES (
            tenant_id, operation_type, operation_key, v_fingerprint, provider, action, payload,
            v_key,
            correlation_id, traceparent, max_attempts, v_available_at,
            -- Not due yet: out of the claim index until a dispatcher stages it.
            v_available_at > now(), v_bytes,
            ordering_key, ordering_key IS NOT NULL
        )
        -- The identity, or the provider's key (operations_provider_key): either conflict.
        ON CONFLICT DO NOTHING
        RETURNING o.id INTO v_id;

        IF v_id IS NOT NULL THEN
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

        -- Not this identity: its key names another operation at the provider, whose answers
        -- this one would be given (or refused with). Its id only to the same tenant.
        SELECT * INTO v_holder FROM outbox.operations o
        WHERE o.provider = provider AND o.idempotency_key = v_key AND NOT o.key_shared;
        IF v_holder.id IS NOT NULL THEN
            RAISE EXCEPTION 'idempotency_key % already names another operation of provider %',
                v_key, provider
                USING ERRCODE = 'OB001', COLUMN = 'idempotency_key',
                      DETAIL = CASE WHEN v_holder.tenant_id = tenant_id
                                    THEN format('existing operation id: %s', v_holder.id)
                                    ELSE 'it belongs to another tenant' END,
                      HINT = 'a key is sent to the provider as it is: each operation needs its own';
        END IF;
    END LOOP;
END;
$function$;
