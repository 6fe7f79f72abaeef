-- 0056: the inbox compares the contract a delivery names beside its fingerprint (issue 42).
--
-- Enqueue already refuses one identity under another contract version (OB001, sql/0053), and
-- deliveries carry the version (Outbox-Contract, sql/0054) beside the fingerprint, whose digest
-- does not cover it (docs/design.md, departure 30). A record now keeps the contract it was
-- delivered under, and a delivery of its identity that names another is a conflict, where both
-- name one: as with fingerprints, so that a record made before its sender named contracts, and
-- a redelivery from a sender that names them now, still replay.
--
-- inbox_begin and inbox_claim gain the argument with a default: a worker of the previous
-- version calls them with its twelve (thirteen) arguments and gets what it got before. A
-- function's arguments cannot change in place, so each is dropped and created again, and
-- granted again where the role exists (roles.sql grants them too).

ALTER TABLE outbox.inbox ADD COLUMN contract text;
COMMENT ON COLUMN outbox.inbox.contract IS
    'The contract the delivery named (Outbox-Contract, "<type>/v<N>"); NULL: none (sql/0056).';

DROP FUNCTION outbox.inbox_begin(text, text, text, text, bytea, interval, interval, uuid, bytea,
                                 text, text, text);
DROP FUNCTION outbox.inbox_claim(text, text, text, text, bytea, interval, integer, interval, uuid,
                                 bytea, text, text, text);

CREATE FUNCTION outbox.inbox_begin(tenant_id text, handler text, key text, body_json text, body_raw bytea, wait interval, retention interval, origin uuid DEFAULT NULL::uuid, fingerprint bytea DEFAULT NULL::bytea, provider text DEFAULT NULL::text, action text DEFAULT NULL::text, ordering_key text DEFAULT NULL::text, contract text DEFAULT NULL::text, OUT decision text, OUT inbox_id bigint, OUT token uuid, OUT response_status integer, OUT response_headers jsonb, OUT response_body bytea)
 RETURNS record
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_digest      bytea;
    v_fingerprint bytea;
    v_origin      uuid := coalesce(origin, outbox.unnamed_origin());
    -- bind_tenant's and bound_tenant's mark of this transaction (0038).
    v_stamp       text := to_char(transaction_timestamp() AT TIME ZONE 'UTC',
                                  'YYYYMMDDHH24MISSUS');
    v_lock        integer;
    r             outbox.inbox;
BEGIN
    -- The common case in one test (the header says why and that it matches the helpers).
    IF coalesce(wait BETWEEN interval '0' AND interval '60 seconds'
                AND retention BETWEEN interval '1 hour' AND interval '400 days'
                AND btrim(tenant_id) <> '' AND char_length(tenant_id) <= 128
                AND btrim(key) <> '' AND char_length(key) <= 512
                AND char_length(handler) <= 128 AND handler ~ '^[a-z0-9][a-z0-9._-]*$'
                AND (body_json IS NULL) <> (body_raw IS NULL)
                AND coalesce(octet_length(body_json), octet_length(body_raw)) <= 16777216
                AND (tenant_id || key) !~ '[\u0001-\u001f\u007f-\u009f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f]'
                AND (current_setting('outbox.tenant_bound_at', true) IS DISTINCT FROM v_stamp
                     OR coalesce(nullif(current_setting('outbox.tenant_id', true), ''), tenant_id)
                        = tenant_id),
                false) THEN
        PERFORM set_config('outbox.tenant_id', tenant_id, true),
                set_config('outbox.tenant_bound_at', v_stamp, true);
        v_digest := CASE WHEN body_json IS NOT NULL
                         THEN sha256(convert_to(body_json::jsonb::text, 'UTF8'))
                         ELSE sha256(body_raw) END;
    ELSE
        -- Raises what is wrong, in the order 0042 checked it.
        PERFORM outbox.check_between('wait', wait, interval '0', interval '60 seconds');
        PERFORM outbox.check_between('retention', retention, interval '1 hour',
                                     interval '400 days');
        v_digest := outbox.inbox_admit(tenant_id, handler, key, body_json, body_raw);
    END IF;
    IF contract IS NOT NULL THEN  -- "<type>/v<N>", as outbox.inbox.http reads Outbox-Contract
        PERFORM outbox.check_text('contract', contract, 160);
    END IF;
    IF fingerprint IS NOT NULL THEN  -- no call at all for a delivery that brings none
        v_fingerprint := outbox.inbox_fingerprint(body_json, fingerprint, provider, action,
                                                  ordering_key, body_raw);
    END IF;
    -- The lock of the key, whatever the origin: a delivery from a sender that names it and one
    -- from a sender that does not must not both miss the other's uncommitted record.
    v_lock := hashtext(tenant_id || E'\n' || handler || E'\n' || key);
    -- Nested, not AND: SQL does not promise to evaluate the cheap test first.
    IF NOT pg_try_advisory_xact_lock(2828, v_lock) THEN  -- 2828 = 0x0B0C
        IF NOT outbox.inbox_wait_lock(v_lock, wait) THEN
            -- The first delivery's transaction still holds the identity.
            decision := 'in_progress';
            RETURN;
        END IF;
    END IF;

    -- A record deleted between the INSERT and the SELECT (pruned or forgotten): try again.
    FOR attempt IN 1..3 LOOP
        IF left(key, 3) = 'op:' THEN  -- only an operation's record crosses origins
            r := outbox.inbox_of_operation(tenant_id, handler, key, v_origin, v_digest, false);
        END IF;
        IF r.id IS NULL THEN
            INSERT INTO outbox.inbox AS i (tenant_id, handler, key, origin, state, body_digest,
                                           fingerprint, contract, token, expires_at)
            VALUES (tenant_id, handler, key, v_origin, 'in_progress', v_digest, v_fingerprint,
                    contract, gen_random_uuid(), now() + retention)
            ON CONFLICT ON CONSTRAINT inbox_identity DO NOTHING
            RETURNING i.id, i.token INTO inbox_id, token;
            IF inbox_id IS NOT NULL THEN
                decision := 'new';
                RETURN;
            END IF;
            SELECT * INTO r FROM outbox.inbox i
            WHERE i.tenant_id = inbox_begin.tenant_id AND i.handler = inbox_begin.handler
              AND i.key = inbox_begin.key AND i.origin = v_origin;
            CONTINUE WHEN NOT FOUND;
        END IF;
        inbox_id := r.id;
        -- Another contract is another intent, where both name one (as with fingerprints).
        IF r.body_digest <> v_digest OR r.fingerprint <> v_fingerprint
           OR r.contract <> inbox_begin.contract THEN
            PERFORM outbox.inbox_count_conflict(r.id, v_digest);
            decision := 'conflict';
            RETURN;
        END IF;
        IF r.state = 'completed' THEN
            decision := 'replayed';
            response_status := r.response_status;
            response_headers := r.response_headers;
            response_body := r.response_body;
            RETURN;
        END IF;
        -- An external claim: still leased, or abandoned for a person.
        decision := CASE WHEN r.state = 'abandoned' THEN 'abandoned' ELSE 'in_progress' END;
        RETURN;
    END LOOP;
    decision := 'in_progress';
END;
$function$;

CREATE FUNCTION outbox.inbox_claim(tenant_id text, handler text, key text, body_json text, body_raw bytea, lease interval, max_claims integer, retention interval, origin uuid DEFAULT NULL::uuid, fingerprint bytea DEFAULT NULL::bytea, provider text DEFAULT NULL::text, action text DEFAULT NULL::text, ordering_key text DEFAULT NULL::text, contract text DEFAULT NULL::text, OUT decision text, OUT inbox_id bigint, OUT token uuid, OUT claims integer, OUT downstream_key text, OUT retry_after interval, OUT response_status integer, OUT response_headers jsonb, OUT response_body bytea)
 RETURNS record
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_digest      bytea;
    v_fingerprint bytea;
    v_origin      uuid := coalesce(origin, outbox.unnamed_origin());
    v_lock        integer;
    r             outbox.inbox;
BEGIN
    PERFORM outbox.check_between('lease', lease, interval '1 second', interval '1 day');
    PERFORM outbox.check_count('max_claims', max_claims, 1, 100);
    PERFORM outbox.check_between('retention', retention, interval '1 hour', interval '400 days');
    v_digest := outbox.inbox_admit(tenant_id, handler, key, body_json, body_raw);
    IF contract IS NOT NULL THEN  -- "<type>/v<N>", as outbox.inbox.http reads Outbox-Contract
        PERFORM outbox.check_text('contract', contract, 160);
    END IF;
    IF fingerprint IS NOT NULL THEN  -- no call at all for a delivery that brings none
        v_fingerprint := outbox.inbox_fingerprint(body_json, fingerprint, provider, action,
                                                  ordering_key, body_raw);
    END IF;
    -- Claims hold it for their one statement: a minute is far past any of them.
    v_lock := hashtext(tenant_id || E'\n' || handler || E'\n' || key);
    IF NOT pg_try_advisory_xact_lock(2828, v_lock) THEN
        IF NOT outbox.inbox_wait_lock(v_lock, interval '1 minute') THEN
            decision := 'in_progress';
            retry_after := interval '1 second';
            RETURN;
        END IF;
    END IF;

    FOR attempt IN 1..3 LOOP
        r := outbox.inbox_of_operation(tenant_id, handler, key, v_origin, v_digest, true);
        IF r.id IS NULL THEN
            INSERT INTO outbox.inbox AS i (tenant_id, handler, key, origin, mode, state,
                                           body_digest, fingerprint, contract, token,
                                           lease_expires_at, expires_at)
            VALUES (tenant_id, handler, key, v_origin, 'external', 'in_progress', v_digest,
                    v_fingerprint, contract, gen_random_uuid(), now() + lease, now() + retention)
            ON CONFLICT ON CONSTRAINT inbox_identity DO NOTHING
            RETURNING i.id, i.token, i.claims INTO inbox_id, token, claims;
            IF inbox_id IS NOT NULL THEN
                decision := 'new';
                downstream_key := outbox.inbox_downstream_key(tenant_id, handler, key, v_origin);
                RETURN;
            END IF;
            SELECT * INTO r FROM outbox.inbox i
            WHERE i.tenant_id = inbox_claim.tenant_id AND i.handler = inbox_claim.handler
              AND i.key = inbox_claim.key AND i.origin = v_origin
            FOR UPDATE;
            CONTINUE WHEN NOT FOUND;
        END IF;
        inbox_id := r.id;
        claims := r.claims;
        downstream_key := outbox.inbox_downstream_key(r.tenant_id, r.handler, r.key, r.origin);
        -- Another contract is another intent, where both name one (as with fingerprints).
        IF r.body_digest <> v_digest OR r.fingerprint <> v_fingerprint
           OR r.contract <> inbox_claim.contract THEN
            PERFORM outbox.inbox_count_conflict(r.id, v_digest);
            decision := 'conflict';
            RETURN;
        END IF;
        IF r.state = 'completed' THEN
            decision := 'replayed';
            response_status := r.response_status;
            response_headers := r.response_headers;
            response_body := r.response_body;
            RETURN;
        END IF;
        IF r.state = 'abandoned' THEN
            decision := 'abandoned';
            RETURN;
        END IF;
        IF r.lease_expires_at > now() THEN
            decision := 'in_progress';
            retry_after := r.lease_expires_at - now();
            RETURN;
        END IF;
        -- Only a lease that ran out counts toward abandoning (0042).
        IF r.lease_expires_at IS NOT NULL AND r.claims >= max_claims THEN
            UPDATE outbox.inbox i SET state = 'abandoned', abandoned_at = now(),
                   lease_expires_at = NULL
            WHERE i.id = r.id;
            decision := 'abandoned';
            RETURN;
        END IF;
        UPDATE outbox.inbox i
        SET claims = CASE WHEN r.lease_expires_at IS NULL THEN greatest(r.claims, 1)
                          ELSE r.claims + 1 END,
            token = gen_random_uuid(), lease_expires_at = now() + lease
        WHERE i.id = r.id
        RETURNING i.token, i.claims INTO token, claims;
        decision := 'reclaimed';
        RETURN;
    END LOOP;
    decision := 'in_progress';
    retry_after := interval '1 second';
END;
$function$;

REVOKE ALL ON FUNCTION
    outbox.inbox_begin(text, text, text, text, bytea, interval, interval, uuid, bytea, text, text,
                       text, text),
    outbox.inbox_claim(text, text, text, text, bytea, interval, integer, interval, uuid, bytea,
                       text, text, text, text)
FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_consumer') THEN
        GRANT EXECUTE ON FUNCTION
            outbox.inbox_begin(text, text, text, text, bytea, interval, interval, uuid, bytea,
                               text, text, text, text),
            outbox.inbox_claim(text, text, text, text, bytea, interval, integer, interval, uuid,
                               bytea, text, text, text, text)
        TO outbox_consumer;
    END IF;
END;
$$;
