-- 0055: a renamed operation type keeps its contracts' history (contract aliases), and an
-- operation's contract version is part of what outbox.get_operation returns (issue 42).
--
-- Alias. A type renamed from OLD to NEW publishes its versions under NEW (the same files, moved
-- in the repository), then `outbox contracts alias OLD NEW`: from then on every look-up of OLD's
-- contracts reads NEW's (get_contract; enqueue's version checks and requirement), so producers
-- still naming OLD are held to the same versions as those naming NEW, the dispatcher and the
-- inbox check OLD's operations against NEW's schemas, and operations enqueued under OLD keep their
-- type (their identity) and their history. The alias is refused unless every version published
-- under OLD is published under NEW with the same content (nothing an old operation was checked
-- against changes meaning), and NEW is no alias itself (no chains). OLD's row of contract_types
-- mirrors NEW's requirement from then on (set_contract_requirement updates both), so that an
-- enqueue naming no version still reads one row. An alias is kept for ever,
-- as published contracts are: removing it would leave OLD's operations with no contract.
-- Publishing a version under OLD afterwards is refused (it would never be read), but the same
-- content again is 'unchanged', as before; deprecating or retiring is done under NEW.
--
-- get_operation returns contract_version too: its result type changes, so it is dropped and
-- created again, and its grant given again (roles.sql grants it too).

CREATE TABLE outbox.contract_aliases (
    alias          text        NOT NULL,
    operation_type text        NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    created_by     text        NOT NULL,
    CONSTRAINT contract_aliases_pkey PRIMARY KEY (alias),
    CONSTRAINT contract_aliases_not_itself CHECK (alias <> operation_type)
);
COMMENT ON TABLE outbox.contract_aliases IS
    'A renamed operation type''s old name (alias), whose contract look-ups read the new name''s (sql/0055). Kept for ever.';
REVOKE ALL ON outbox.contract_aliases FROM PUBLIC;

CREATE FUNCTION outbox.contract_aliases_kept()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'a contract alias is kept: the operations enqueued under it read its contracts'
        USING ERRCODE = 'OB005';
END;
$$;
CREATE TRIGGER contract_aliases_kept BEFORE UPDATE OR DELETE ON outbox.contract_aliases
    FOR EACH ROW EXECUTE FUNCTION outbox.contract_aliases_kept();
CREATE TRIGGER contract_aliases_no_truncate BEFORE TRUNCATE ON outbox.contract_aliases
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.contract_aliases_kept();

-- The type whose contracts an operation type reads: its alias's target, or itself.
CREATE FUNCTION outbox.contract_type_of(operation_type text)
RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce((SELECT a.operation_type FROM outbox.contract_aliases a
                     WHERE a.alias = contract_type_of.operation_type),
                    contract_type_of.operation_type)
$$;

CREATE OR REPLACE FUNCTION outbox.get_contract(operation_type text, version integer)
RETURNS TABLE (canonical text, digest text, state text)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT c.canonical, c.digest, c.state FROM outbox.contracts c
    WHERE c.operation_type = outbox.contract_type_of(get_contract.operation_type)
      AND c.version = get_contract.version
$$;

-- OLD becomes an alias of NEW; audited. 'aliased', or 'unchanged' when it already is.
CREATE FUNCTION outbox.set_contract_alias(alias text, operation_type text, actor text,
                                          reason text)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_held text;
    v_differs text;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    PERFORM outbox.check_text('alias', alias, 128);
    PERFORM outbox.check_text('operation_type', operation_type, 128);
    -- One alias at a time, so that two cannot form a chain or a cycle between their checks.
    LOCK TABLE outbox.contract_aliases IN SHARE ROW EXCLUSIVE MODE;
    SELECT a.operation_type INTO v_held FROM outbox.contract_aliases a
    WHERE a.alias = set_contract_alias.alias;
    IF v_held = operation_type THEN
        RETURN 'unchanged';
    END IF;
    IF v_held IS NOT NULL THEN
        RAISE EXCEPTION '% is already an alias of %', alias, v_held
            USING ERRCODE = 'OB005', COLUMN = 'alias';
    END IF;
    IF alias = operation_type THEN
        RAISE EXCEPTION 'a type is no alias of itself' USING ERRCODE = 'OB002', COLUMN = 'alias';
    END IF;
    IF NOT EXISTS (SELECT FROM outbox.contracts c
                   WHERE c.operation_type = set_contract_alias.operation_type) THEN
        RAISE EXCEPTION 'operation type % has no published contract', operation_type
            USING ERRCODE = 'P0002', COLUMN = 'operation_type',
                  HINT = 'publish its versions first: outbox contracts push DIR';
    END IF;
    IF EXISTS (SELECT FROM outbox.contract_aliases a
               WHERE a.alias = set_contract_alias.operation_type
                  OR a.operation_type = set_contract_alias.alias) THEN
        RAISE EXCEPTION 'no chains of aliases: % or % is one end of another', alias,
            operation_type USING ERRCODE = 'OB002', COLUMN = 'alias';
    END IF;
    SELECT string_agg(format('v%s', o.version), ', ' ORDER BY o.version) INTO v_differs
    FROM outbox.contracts o
    LEFT JOIN outbox.contracts n
           ON n.operation_type = set_contract_alias.operation_type AND n.version = o.version
    WHERE o.operation_type = set_contract_alias.alias AND n.digest IS DISTINCT FROM o.digest;
    IF v_differs IS NOT NULL THEN
        RAISE EXCEPTION '% has versions % has not, or with other content: %', alias,
            operation_type, v_differs
            USING ERRCODE = 'OB008', COLUMN = 'alias',
                  HINT = 'publish each of them under the new name with the same content first';
    END IF;
    INSERT INTO outbox.contract_aliases (alias, operation_type, created_by)
    VALUES (alias, operation_type, actor);
    -- The requirement, mirrored under the alias (set_contract_requirement keeps it so): an
    -- enqueue that names no version reads one row of contract_types, as before aliases.
    INSERT INTO outbox.contract_types AS t (operation_type, versions_required, changed_by)
    SELECT set_contract_alias.alias, n.versions_required, actor
    FROM outbox.contract_types n WHERE n.operation_type = set_contract_alias.operation_type
    ON CONFLICT ON CONSTRAINT contract_types_pkey
    DO UPDATE SET versions_required = excluded.versions_required, changed_at = now(),
                  changed_by = excluded.changed_by;
    INSERT INTO outbox.audit (actor, action, reason, details)
    VALUES (actor, 'contract_alias', reason,
            jsonb_build_object('alias', alias, 'operation_type', operation_type));
    RETURN 'aliased';
END;
$$;

CREATE OR REPLACE FUNCTION outbox.publish_contract(operation_type text, version integer, canonical text,
                                        actor text, reason text,
                                        require_version boolean DEFAULT true)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_digest text;
    v_held text;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    PERFORM outbox.check_text('operation_type', operation_type, 128);
    IF version IS NULL OR version < 1 THEN
        RAISE EXCEPTION 'a contract''s version is a whole number from 1'
            USING ERRCODE = 'OB002', COLUMN = 'version';
    END IF;
    IF canonical IS NULL OR octet_length(canonical) > 65536
       OR jsonb_typeof(canonical::jsonb) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'a contract''s schema is a JSON object of at most 65536 bytes'
            USING ERRCODE = 'OB002', COLUMN = 'canonical';
    END IF;
    v_digest := encode(sha256(convert_to(canonical, 'UTF8')), 'hex');
    IF EXISTS (SELECT FROM outbox.contract_aliases a
               WHERE a.alias = publish_contract.operation_type) THEN
        -- Never read under this name again: the same content is 'unchanged', as before.
        SELECT c.digest INTO v_held FROM outbox.contracts c
        WHERE c.operation_type = publish_contract.operation_type
          AND c.version = publish_contract.version;
        IF v_held = v_digest THEN
            RETURN 'unchanged';
        END IF;
        RAISE EXCEPTION '% is an alias of %: publish under that name',
            operation_type, outbox.contract_type_of(operation_type)
            USING ERRCODE = 'OB002', COLUMN = 'operation_type';
    END IF;
    INSERT INTO outbox.contracts AS c (operation_type, version, canonical, digest, published_by)
    VALUES (publish_contract.operation_type, publish_contract.version, publish_contract.canonical,
            v_digest, actor)
    ON CONFLICT ON CONSTRAINT contracts_pkey DO NOTHING;
    IF FOUND THEN
        INSERT INTO outbox.contract_types AS t (operation_type, versions_required, changed_by)
        VALUES (publish_contract.operation_type, coalesce(require_version, true), actor)
        ON CONFLICT ON CONSTRAINT contract_types_pkey DO NOTHING;
        INSERT INTO outbox.audit (actor, action, reason, to_status, details)
        VALUES (actor, 'contract_publish', reason, 'active',
                jsonb_build_object('operation_type', operation_type, 'version', version,
                                   'digest', v_digest));
        RETURN 'published';
    END IF;
    SELECT c.digest INTO v_held FROM outbox.contracts c
    WHERE c.operation_type = publish_contract.operation_type
      AND c.version = publish_contract.version;
    IF v_held = v_digest THEN
        RETURN 'unchanged';
    END IF;
    RAISE EXCEPTION '%/v% is published with other content: publish the change as a new version',
        operation_type, version
        USING ERRCODE = 'OB008', COLUMN = 'canonical',
              DETAIL = format('published %s, pushed %s', v_held, v_digest);
END;
$$;

CREATE OR REPLACE FUNCTION outbox.set_contract_state(operation_type text, version integer, state text,
                                          actor text, reason text)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_was text;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    IF state IS NULL OR state NOT IN ('active', 'deprecated', 'retired') THEN
        RAISE EXCEPTION 'a contract''s state is active, deprecated or retired'
            USING ERRCODE = 'OB002', COLUMN = 'state';
    END IF;
    SELECT c.state INTO v_was FROM outbox.contracts c
    WHERE c.operation_type = set_contract_state.operation_type
      AND c.version = set_contract_state.version
    FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no contract %/v% is published', operation_type, version
            USING ERRCODE = 'P0002';
    END IF;
    IF EXISTS (SELECT FROM outbox.contract_aliases a
               WHERE a.alias = set_contract_state.operation_type) THEN
        RAISE EXCEPTION '% is an alias of %: its versions'' states are that type''s',
            operation_type, outbox.contract_type_of(operation_type)
            USING ERRCODE = 'OB002', COLUMN = 'operation_type';
    END IF;
    IF v_was = state THEN
        RETURN 'unchanged';
    END IF;
    UPDATE outbox.contracts c SET state = set_contract_state.state, state_changed_at = now()
    WHERE c.operation_type = set_contract_state.operation_type
      AND c.version = set_contract_state.version;
    INSERT INTO outbox.audit (actor, action, reason, from_status, to_status, details)
    VALUES (actor, 'contract_' || state, reason, v_was, state,
            jsonb_build_object('operation_type', operation_type, 'version', version));
    RETURN state;
END;
$$;

CREATE OR REPLACE FUNCTION outbox.set_contract_requirement(operation_type text, required boolean,
                                                actor text, reason text)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_was boolean;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    IF required IS NULL THEN
        RAISE EXCEPTION 'required is true or false' USING ERRCODE = 'OB002', COLUMN = 'required';
    END IF;
    IF EXISTS (SELECT FROM outbox.contract_aliases a
               WHERE a.alias = set_contract_requirement.operation_type) THEN
        RAISE EXCEPTION '% is an alias of %: that type''s requirement holds for both',
            operation_type, outbox.contract_type_of(operation_type)
            USING ERRCODE = 'OB002', COLUMN = 'operation_type';
    END IF;
    SELECT t.versions_required INTO v_was FROM outbox.contract_types t
    WHERE t.operation_type = set_contract_requirement.operation_type FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'operation type % has no published contract', operation_type
            USING ERRCODE = 'P0002';
    END IF;
    IF v_was = required THEN
        RETURN 'unchanged';
    END IF;
    -- The type's aliases keep rows of their own that say the same (set_contract_alias): enqueue
    -- then reads one row for an operation that names no version, whatever its type's name.
    UPDATE outbox.contract_types t
    SET versions_required = required, changed_at = now(), changed_by = actor
    WHERE t.operation_type = set_contract_requirement.operation_type
       OR t.operation_type IN (SELECT a.alias FROM outbox.contract_aliases a
                               WHERE a.operation_type = set_contract_requirement.operation_type);
    INSERT INTO outbox.audit (actor, action, reason, details)
    VALUES (actor, CASE WHEN required THEN 'contract_require' ELSE 'contract_allow_unversioned' END,
            reason, jsonb_build_object('operation_type', operation_type));
    RETURN CASE WHEN required THEN 'required' ELSE 'not required' END;
END;
$$;

CREATE OR REPLACE FUNCTION outbox.enqueue(tenant_id text, operation_type text, operation_key text, provider text, action text, payload jsonb, correlation_id text DEFAULT NULL::text, idempotency_key text DEFAULT NULL::text, available_at timestamp with time zone DEFAULT NULL::timestamp with time zone, max_attempts integer DEFAULT NULL::integer, traceparent text DEFAULT NULL::text, ordering_key text DEFAULT NULL::text, contract_version integer DEFAULT NULL::integer)
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
    v_existing_version integer;
    v_contract     text;
    v_contract_type text;
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

    -- The contract (sql/0052, 0053): a type with contracts names a published version that is
    -- not retired. The payload's check against the schema is the Python API's before the row
    -- exists and the dispatcher's before the first send: this server has no JSON Schema. A
    -- renamed type's old name reads the new name's contracts (contract_aliases, 0055); its
    -- requirement is mirrored under its own name, so an enqueue without a version reads one
    -- row, as before aliases.
    IF contract_version IS NULL THEN
        IF EXISTS (SELECT FROM outbox.contract_types t
                   WHERE t.operation_type = operation_type AND t.versions_required) THEN
            RAISE EXCEPTION 'operation type % has contracts: name its contract_version',
                operation_type
                USING ERRCODE = 'OB009', COLUMN = 'contract_version';
        END IF;
    ELSE
        v_contract_type := coalesce((SELECT a.operation_type FROM outbox.contract_aliases a
                                     WHERE a.alias = operation_type), operation_type);
        SELECT c.state INTO v_contract FROM outbox.contracts c
        WHERE c.operation_type = v_contract_type AND c.version = contract_version;
        IF v_contract IS NULL THEN
            RAISE EXCEPTION 'no contract %/v% is published', operation_type, contract_version
                USING ERRCODE = 'OB009', COLUMN = 'contract_version',
                      HINT = 'publish it first: outbox contracts push DIR';
        END IF;
        IF v_contract = 'retired' THEN
            RAISE EXCEPTION 'contract %/v% is retired: enqueue under an active version',
                operation_type, contract_version
                USING ERRCODE = 'OB009', COLUMN = 'contract_version';
        END IF;
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
                available_at, scheduled, payload_bytes, ordering_key, ordering_blocked,
                contract_version
            ) OVERRIDING SYSTEM VALUE VALUES (
                v_id, tenant_id, operation_type, operation_key, v_fingerprint, provider, action,
                payload, v_key, correlation_id, traceparent, max_attempts, v_available_at,
                -- Not due yet: out of the claim index until a dispatcher stages it.
                v_available_at > now(), v_bytes,
                ordering_key, ordering_key IS NOT NULL, contract_version
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
        SELECT k.operation_id, o.fingerprint, o.contract_version
        INTO v_id, v_existing, v_existing_version
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
            IF v_existing_version IS DISTINCT FROM contract_version THEN
                RAISE EXCEPTION 'operation %/%/% already exists under contract version %',
                    tenant_id, operation_type, operation_key,
                    coalesce(v_existing_version::text, 'none')
                    USING ERRCODE = 'OB001', COLUMN = 'contract_version',
                          DETAIL = format('existing operation id: %s', v_id),
                          HINT = 'the same key under another version is another intent';
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

DROP FUNCTION outbox.get_operation(text, text, text);
CREATE FUNCTION outbox.get_operation(tenant_id text, operation_type text, operation_key text)
RETURNS TABLE (operation_id bigint, tenant_id text, operation_type text, operation_key text,
               provider text, action text, status text, status_reason text, attempts integer,
               provider_ref text, result jsonb, last_error text, last_error_class text,
               idempotency_key text, correlation_id text, created_at timestamptz,
               updated_at timestamptz, available_at timestamptz, finished_at timestamptz,
               contract_version integer)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $function$
    SELECT outbox.require_tenant(get_operation.tenant_id);
    SELECT o.id, o.tenant_id, o.operation_type, o.operation_key, o.provider, o.action, o.status,
           o.status_reason, o.attempts, o.provider_ref, o.result, o.last_error, o.last_error_class,
           o.idempotency_key, o.correlation_id, o.created_at, o.updated_at, o.available_at,
           o.finished_at, o.contract_version
    FROM outbox.operation_keys k
    JOIN outbox.operations o ON o.id = k.operation_id
    WHERE k.tenant_id = get_operation.tenant_id
      AND k.operation_type = get_operation.operation_type
      AND k.operation_key = get_operation.operation_key
$function$;

REVOKE ALL ON FUNCTION
    outbox.contract_aliases_kept(),
    outbox.contract_type_of(text),
    outbox.set_contract_alias(text, text, text, text),
    outbox.get_operation(text, text, text)
FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_producer') THEN
        GRANT EXECUTE ON FUNCTION outbox.get_operation(text, text, text) TO outbox_producer;
    END IF;
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_operator') THEN
        GRANT EXECUTE ON FUNCTION outbox.set_contract_alias(text, text, text, text)
            TO outbox_operator;
        GRANT SELECT ON outbox.contract_aliases TO outbox_operator;
    END IF;
END;
$$;
