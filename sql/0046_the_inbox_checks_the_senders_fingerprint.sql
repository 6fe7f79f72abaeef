-- 0046: the inbox knows a delivery by its sender's database too, and checks the body against
-- the fingerprint that the sender's enqueue computed (issue 40; the sender half is 0045).
--
-- Identity. A delivery from outbox that names its origin is keyed 'op:<origin>:<operation id>',
-- so that operation 1234 of one database and 1234 of another are two records. A record written
-- before its sender named its origin is keyed 'op:<operation id>': a redelivery of that
-- operation from an upgraded sender passes that key as `alias`, and finds the record there
-- rather than running again. Both kinds of key take the transaction-level advisory lock of the
-- alias (the bare operation key), so that a delivery from an old dispatcher and one from a new
-- one cannot both miss the other's uncommitted record. A claim (external mode) takes it too now:
-- its transaction is one statement, so the lock is held for that long.
--
-- Fingerprint. `fingerprint` is what the sender says enqueue stored: SHA-256 of provider, '\n',
-- action, '\n', the payload's jsonb text and, with an ordering key, '\n' and the key. The
-- receiver computes the same from the body it got (jsonb's canonical text, as enqueue's) and the
-- provider, action and ordering key that came with it. Another result means the body is not the
-- one enqueued (a proxy that re-encoded its numbers, a body built from a part of the payload):
-- refused with OB007, nothing written, answered 400 as a malformed delivery. The record keeps
-- the fingerprint: `outbox inbox show` prints the same hex as the sender's `outbox show`. Two
-- deliveries of one identity conflict when their body digests differ, or their fingerprints
-- where both have one.
--
-- inbox_begin and inbox_claim gain the new arguments with defaults: a worker of the previous
-- version calls them with its seven (eight) arguments and gets what it got before. A function's
-- arguments cannot change in place, so each is dropped and created again, and granted again.

ALTER TABLE outbox.inbox ADD COLUMN fingerprint bytea;

-- The fingerprint of what a delivery carries, checked against the one its sender sent; NULL
-- when the sender sent none. The owner's only.
CREATE FUNCTION outbox.inbox_fingerprint(body_json text, fingerprint bytea, provider text,
                                         action text, ordering_key text)
RETURNS bytea
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_computed bytea;
BEGIN
    IF fingerprint IS NULL THEN
        RETURN NULL;
    END IF;
    IF body_json IS NOT NULL AND provider IS NOT NULL AND action IS NOT NULL THEN
        v_computed := sha256(convert_to(provider || E'\n' || action || E'\n'
                                        || body_json::jsonb::text
                                        || coalesce(E'\n' || ordering_key, ''), 'UTF8'));
    END IF;
    IF v_computed IS DISTINCT FROM fingerprint THEN
        RAISE EXCEPTION 'the body is not the one its sender enqueued: its fingerprint differs'
            USING ERRCODE = 'OB007',
                  HINT = 'A proxy may have re-encoded the JSON body; outbox sends it as stored.';
    END IF;
    RETURN fingerprint;
END;
$$;

-- The key a handler in external mode hands downstream: of the record's own identity, so that a
-- record found under its alias keeps the key its first claim handed out.
CREATE FUNCTION outbox.inbox_downstream_key(tenant_id text, handler text, key text)
RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
AS $$
    SELECT 'ib1_' || encode(sha256(s.key_secret || sha256(s.key_secret || convert_to(
               jsonb_build_array(tenant_id, handler, key)::text, 'UTF8'))), 'hex')
    FROM outbox.installation s
$$;

-- The record of a delivery's alias, if any: one written before its sender named its origin.
-- Locked FOR UPDATE when asked (a claim changes it).
CREATE FUNCTION outbox.inbox_of_alias(tenant_id text, handler text, alias text,
                                      for_update boolean)
RETURNS outbox.inbox
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    r outbox.inbox;
BEGIN
    IF for_update THEN
        SELECT * INTO r FROM outbox.inbox i
        WHERE i.tenant_id = inbox_of_alias.tenant_id AND i.handler = inbox_of_alias.handler
          AND i.key = alias
        FOR UPDATE;
    ELSE
        SELECT * INTO r FROM outbox.inbox i
        WHERE i.tenant_id = inbox_of_alias.tenant_id AND i.handler = inbox_of_alias.handler
          AND i.key = alias;
    END IF;
    RETURN r;
END;
$$;

-- The identity's lock (0044), after pg_try_advisory_xact_lock(2828, lock) failed: wait for it
-- at most `wait`; false when it is still held then.
CREATE FUNCTION outbox.inbox_wait_lock(lock integer, wait interval)
RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_old text;
BEGIN
    v_old := current_setting('lock_timeout');
    BEGIN
        -- lock_timeout 0 would mean "wait for ever": a wait of 0 is one millisecond.
        PERFORM set_config('lock_timeout',
                           greatest(1, ceil(extract(epoch FROM wait) * 1000))::bigint || 'ms',
                           true);
        PERFORM pg_advisory_xact_lock(2828, lock);
        PERFORM set_config('lock_timeout', v_old, true);
    EXCEPTION WHEN lock_not_available THEN
        -- Another transaction still holds the identity: rolled back to here, lock_timeout
        -- included.
        RETURN false;
    END;
    RETURN true;
END;
$$;

DROP FUNCTION outbox.inbox_begin(text, text, text, text, bytea, interval, interval);
CREATE FUNCTION outbox.inbox_begin(
    tenant_id text, handler text, key text, body_json text, body_raw bytea,
    wait interval, retention interval, alias text DEFAULT NULL, fingerprint bytea DEFAULT NULL,
    provider text DEFAULT NULL, action text DEFAULT NULL, ordering_key text DEFAULT NULL,
    OUT decision text, OUT inbox_id bigint, OUT token uuid, OUT response_status integer,
    OUT response_headers jsonb, OUT response_body bytea)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_digest      bytea;
    v_fingerprint bytea;
    v_lock        integer;
    r             outbox.inbox;
BEGIN
    PERFORM outbox.check_between('wait', wait, interval '0', interval '60 seconds');
    PERFORM outbox.check_between('retention', retention, interval '1 hour', interval '400 days');
    v_digest := outbox.inbox_admit(tenant_id, handler, key, body_json, body_raw);
    IF fingerprint IS NOT NULL THEN  -- no call at all for a delivery that brings none
        v_fingerprint := outbox.inbox_fingerprint(body_json, fingerprint, provider, action,
                                                  ordering_key);
    END IF;
    IF alias IS NOT NULL THEN
        PERFORM outbox.check_text('alias', alias, 512);
    END IF;
    -- The lock of the alias where there is one: both keys of one operation take the same.
    v_lock := hashtext(tenant_id || E'\n' || handler || E'\n' || coalesce(alias, key));
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
        IF alias IS NOT NULL THEN
            r := outbox.inbox_of_alias(tenant_id, handler, alias, false);
        END IF;
        IF r.id IS NULL THEN
            INSERT INTO outbox.inbox AS i (tenant_id, handler, key, state, body_digest,
                                           fingerprint, token, expires_at)
            VALUES (tenant_id, handler, key, 'in_progress', v_digest, v_fingerprint,
                    gen_random_uuid(), now() + retention)
            ON CONFLICT ON CONSTRAINT inbox_identity DO NOTHING
            RETURNING i.id, i.token INTO inbox_id, token;
            IF inbox_id IS NOT NULL THEN
                decision := 'new';
                RETURN;
            END IF;
            SELECT * INTO r FROM outbox.inbox i
            WHERE i.tenant_id = inbox_begin.tenant_id AND i.handler = inbox_begin.handler
              AND i.key = inbox_begin.key;
            CONTINUE WHEN NOT FOUND;
        END IF;
        inbox_id := r.id;
        IF r.body_digest <> v_digest OR r.fingerprint <> v_fingerprint THEN
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
$$;

DROP FUNCTION outbox.inbox_claim(text, text, text, text, bytea, interval, integer, interval);
CREATE FUNCTION outbox.inbox_claim(
    tenant_id text, handler text, key text, body_json text, body_raw bytea,
    lease interval, max_claims integer, retention interval, alias text DEFAULT NULL,
    fingerprint bytea DEFAULT NULL, provider text DEFAULT NULL, action text DEFAULT NULL,
    ordering_key text DEFAULT NULL,
    OUT decision text, OUT inbox_id bigint, OUT token uuid, OUT claims integer,
    OUT downstream_key text, OUT retry_after interval, OUT response_status integer,
    OUT response_headers jsonb, OUT response_body bytea)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_digest      bytea;
    v_fingerprint bytea;
    v_lock        integer;
    r             outbox.inbox;
BEGIN
    PERFORM outbox.check_between('lease', lease, interval '1 second', interval '1 day');
    PERFORM outbox.check_count('max_claims', max_claims, 1, 100);
    PERFORM outbox.check_between('retention', retention, interval '1 hour', interval '400 days');
    v_digest := outbox.inbox_admit(tenant_id, handler, key, body_json, body_raw);
    IF fingerprint IS NOT NULL THEN  -- no call at all for a delivery that brings none
        v_fingerprint := outbox.inbox_fingerprint(body_json, fingerprint, provider, action,
                                                  ordering_key);
    END IF;
    IF alias IS NOT NULL THEN
        PERFORM outbox.check_text('alias', alias, 512);
    END IF;
    -- Claims hold it for their one statement: a minute is far past any of them.
    v_lock := hashtext(tenant_id || E'\n' || handler || E'\n' || coalesce(alias, key));
    IF NOT pg_try_advisory_xact_lock(2828, v_lock) THEN
        IF NOT outbox.inbox_wait_lock(v_lock, interval '1 minute') THEN
            decision := 'in_progress';
            retry_after := interval '1 second';
            RETURN;
        END IF;
    END IF;

    FOR attempt IN 1..3 LOOP
        IF alias IS NOT NULL THEN
            r := outbox.inbox_of_alias(tenant_id, handler, alias, true);
        END IF;
        IF r.id IS NULL THEN
            INSERT INTO outbox.inbox AS i (tenant_id, handler, key, mode, state, body_digest,
                                           fingerprint, token, lease_expires_at, expires_at)
            VALUES (tenant_id, handler, key, 'external', 'in_progress', v_digest, v_fingerprint,
                    gen_random_uuid(), now() + lease, now() + retention)
            ON CONFLICT ON CONSTRAINT inbox_identity DO NOTHING
            RETURNING i.id, i.token, i.claims INTO inbox_id, token, claims;
            IF inbox_id IS NOT NULL THEN
                decision := 'new';
                downstream_key := outbox.inbox_downstream_key(tenant_id, handler, key);
                RETURN;
            END IF;
            SELECT * INTO r FROM outbox.inbox i
            WHERE i.tenant_id = inbox_claim.tenant_id AND i.handler = inbox_claim.handler
              AND i.key = inbox_claim.key
            FOR UPDATE;
            CONTINUE WHEN NOT FOUND;
        END IF;
        inbox_id := r.id;
        claims := r.claims;
        downstream_key := outbox.inbox_downstream_key(r.tenant_id, r.handler, r.key);
        IF r.body_digest <> v_digest OR r.fingerprint <> v_fingerprint THEN
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
$$;

REVOKE ALL ON FUNCTION
    outbox.inbox_fingerprint(text, bytea, text, text, text),
    outbox.inbox_downstream_key(text, text, text),
    outbox.inbox_of_alias(text, text, text, boolean),
    outbox.inbox_wait_lock(integer, interval),
    outbox.inbox_begin(text, text, text, text, bytea, interval, interval, text, bytea, text,
                       text, text),
    outbox.inbox_claim(text, text, text, text, bytea, interval, integer, interval, text, bytea,
                       text, text, text)
FROM PUBLIC;

-- Dropped and created again: granted again where roles.sql has run.
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_consumer') THEN
        GRANT EXECUTE ON FUNCTION
            outbox.inbox_begin(text, text, text, text, bytea, interval, interval, text, bytea,
                               text, text, text),
            outbox.inbox_claim(text, text, text, text, bytea, interval, integer, interval, text,
                               bytea, text, text, text)
        TO outbox_consumer;
    END IF;
END;
$$;
