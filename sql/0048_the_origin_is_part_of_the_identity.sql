-- 0048: the sender's database is a column of the inbox's identity, not a part of its key
-- (issue 40; replaces 0046's keying, found wanting by a review the same day).
--
-- 0046 keyed a delivery that names its origin 'op:<origin>:<id>' and looked up 'op:<id>' as its
-- alias, a record from before its sender named the origin. That looked one way only: a
-- redelivery without the origin (an older dispatcher retrying after an upgraded one's delivery
-- was recorded, a message published before the upgrade) missed the newer record and ran again;
-- and the alias matched a record of ANY database's operation <id> from before the upgrade, so the
-- collision it was to end went on for the whole retention.
--
-- Now the identity is (tenant_id, handler, key, origin): the key of a delivery from outbox is
-- 'op:<id>' again, and origin is the sending database's id, or the nil UUID where the sender
-- did not name it (older senders, every key that is not an operation's). A delivery finds its
-- own origin's record first; failing that, for an operation key only, a record of the same
-- operation id from the other side of the upgrade, named or unnamed, WITH THE SAME BODY DIGEST:
-- the same operation always carries the same payload (enqueue's rows never change it), so a
-- record with another body is another database's operation, and this delivery is new. Left
-- open, and said in docs/design.md: an operation of another database with the same tenant,
-- handler, id and body, recorded before its sender named its origin, still answers for this one
-- until it expires.
--
-- The advisory lock stays the key's (all origins share it), so a delivery that names its origin
-- and one that does not cannot both miss the other's uncommitted record; two databases' ids
-- that meet at the same moment only make one wait. The downstream key of an external claim mixes
-- in the record's origin when it has one: two databases' operation 7 call downstream under two
-- keys. A body the receiver reads as bytes (not JSON) is checked against the fingerprint as the
-- exact bytes, where 0046 refused every such delivery.

ALTER TABLE outbox.inbox ADD COLUMN origin uuid NOT NULL
    DEFAULT '00000000-0000-0000-0000-000000000000';
ALTER TABLE outbox.inbox DROP CONSTRAINT inbox_identity,
    ADD CONSTRAINT inbox_identity UNIQUE (tenant_id, handler, key, origin);
-- Records 0046 keyed 'op:<origin>:<id>'.
UPDATE outbox.inbox i
SET origin = substr(i.key, 4, 36)::uuid, key = 'op:' || substr(i.key, 41)
WHERE i.key ~ '^op:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}:[0-9]{1,19}$';

-- The origin of a delivery whose sender names none.
CREATE FUNCTION outbox.unnamed_origin() RETURNS uuid
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp
AS $$ SELECT '00000000-0000-0000-0000-000000000000'::uuid $$;

-- The record of a delivery (its origin's), else for an operation key the record of the same
-- operation from the other side of an upgrade: named where this one is unnamed and the other
-- way round, with the same body digest; the oldest if there are several. FOR UPDATE when asked.
CREATE FUNCTION outbox.inbox_of_operation(tenant_id text, handler text, key text, origin uuid,
                                          digest bytea, for_update boolean)
RETURNS outbox.inbox
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_unnamed uuid := outbox.unnamed_origin();
    r         outbox.inbox;
BEGIN
    IF left(key, 3) <> 'op:' THEN
        RETURN NULL;  -- the INSERT finds this origin's record; only operations cross over
    END IF;
    FOR r IN
        SELECT * FROM outbox.inbox i
        WHERE i.tenant_id = inbox_of_operation.tenant_id
          AND i.handler = inbox_of_operation.handler AND i.key = inbox_of_operation.key
          AND (i.origin = inbox_of_operation.origin
               OR (i.body_digest = digest
                   AND (i.origin = v_unnamed) <> (inbox_of_operation.origin = v_unnamed)))
        ORDER BY i.origin <> inbox_of_operation.origin, i.id
        LIMIT 1
    LOOP
        IF for_update THEN
            PERFORM FROM outbox.inbox i WHERE i.id = r.id FOR UPDATE;
            SELECT * INTO r FROM outbox.inbox i WHERE i.id = r.id;
        END IF;
        RETURN r;
    END LOOP;
    RETURN NULL;
END;
$$;

-- The key a handler in external mode hands downstream (0042's, for an unnamed origin).
CREATE OR REPLACE FUNCTION outbox.inbox_downstream_key(tenant_id text, handler text, key text,
                                                       origin uuid)
RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
AS $$
    SELECT 'ib1_' || encode(sha256(s.key_secret || sha256(s.key_secret || convert_to(
               -- Qualified: outbox.installation has an origin of its own (0045).
               CASE WHEN inbox_downstream_key.origin = outbox.unnamed_origin()
                    THEN jsonb_build_array(tenant_id, handler, key)
                    ELSE jsonb_build_array(tenant_id, handler, key,
                                           inbox_downstream_key.origin::text) END::text,
               'UTF8'))), 'hex')
    FROM outbox.installation s
$$;
DROP FUNCTION outbox.inbox_downstream_key(text, text, text);

-- The fingerprint of a body read as JSON (jsonb's canonical text, as enqueue's) or, where the
-- receiver reads it as bytes, of the exact bytes (outbox sends the stored text as it is).
CREATE OR REPLACE FUNCTION outbox.inbox_fingerprint(body_json text, fingerprint bytea,
                                                    provider text, action text,
                                                    ordering_key text, body_raw bytea)
RETURNS bytea
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_computed bytea;
BEGIN
    IF fingerprint IS NULL THEN
        RETURN NULL;
    END IF;
    IF provider IS NOT NULL AND action IS NOT NULL AND body_json IS NOT NULL THEN
        v_computed := sha256(convert_to(provider || E'\n' || action || E'\n'
                                        || body_json::jsonb::text
                                        || coalesce(E'\n' || ordering_key, ''), 'UTF8'));
    ELSIF provider IS NOT NULL AND action IS NOT NULL AND body_raw IS NOT NULL THEN
        v_computed := sha256(convert_to(provider || E'\n' || action || E'\n', 'UTF8')
                             || body_raw
                             || convert_to(coalesce(E'\n' || ordering_key, ''), 'UTF8'));
    END IF;
    IF v_computed IS DISTINCT FROM fingerprint THEN
        RAISE EXCEPTION 'the body is not the one its sender enqueued: its fingerprint differs'
            USING ERRCODE = 'OB007',
                  HINT = 'A proxy may have re-encoded the body; outbox sends it as stored.';
    END IF;
    RETURN fingerprint;
END;
$$;
DROP FUNCTION outbox.inbox_fingerprint(text, bytea, text, text, text);
DROP FUNCTION outbox.inbox_of_alias(text, text, text, boolean);

DROP FUNCTION outbox.inbox_begin(text, text, text, text, bytea, interval, interval, text, bytea,
                                 text, text, text);
CREATE FUNCTION outbox.inbox_begin(
    tenant_id text, handler text, key text, body_json text, body_raw bytea,
    wait interval, retention interval, origin uuid DEFAULT NULL, fingerprint bytea DEFAULT NULL,
    provider text DEFAULT NULL, action text DEFAULT NULL, ordering_key text DEFAULT NULL,
    OUT decision text, OUT inbox_id bigint, OUT token uuid, OUT response_status integer,
    OUT response_headers jsonb, OUT response_body bytea)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_digest      bytea;
    v_fingerprint bytea;
    v_origin      uuid := coalesce(origin, outbox.unnamed_origin());
    v_lock        integer;
    r             outbox.inbox;
BEGIN
    PERFORM outbox.check_between('wait', wait, interval '0', interval '60 seconds');
    PERFORM outbox.check_between('retention', retention, interval '1 hour', interval '400 days');
    v_digest := outbox.inbox_admit(tenant_id, handler, key, body_json, body_raw);
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
        r := outbox.inbox_of_operation(tenant_id, handler, key, v_origin, v_digest, false);
        IF r.id IS NULL THEN
            INSERT INTO outbox.inbox AS i (tenant_id, handler, key, origin, state, body_digest,
                                           fingerprint, token, expires_at)
            VALUES (tenant_id, handler, key, v_origin, 'in_progress', v_digest, v_fingerprint,
                    gen_random_uuid(), now() + retention)
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

DROP FUNCTION outbox.inbox_claim(text, text, text, text, bytea, interval, integer, interval, text,
                                 bytea, text, text, text);
CREATE FUNCTION outbox.inbox_claim(
    tenant_id text, handler text, key text, body_json text, body_raw bytea,
    lease interval, max_claims integer, retention interval, origin uuid DEFAULT NULL,
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
    v_origin      uuid := coalesce(origin, outbox.unnamed_origin());
    v_lock        integer;
    r             outbox.inbox;
BEGIN
    PERFORM outbox.check_between('lease', lease, interval '1 second', interval '1 day');
    PERFORM outbox.check_count('max_claims', max_claims, 1, 100);
    PERFORM outbox.check_between('retention', retention, interval '1 hour', interval '400 days');
    v_digest := outbox.inbox_admit(tenant_id, handler, key, body_json, body_raw);
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
                                           body_digest, fingerprint, token, lease_expires_at,
                                           expires_at)
            VALUES (tenant_id, handler, key, v_origin, 'external', 'in_progress', v_digest,
                    v_fingerprint, gen_random_uuid(), now() + lease, now() + retention)
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
    outbox.unnamed_origin(),
    outbox.inbox_of_operation(text, text, text, uuid, bytea, boolean),
    outbox.inbox_downstream_key(text, text, text, uuid),
    outbox.inbox_fingerprint(text, bytea, text, text, text, bytea),
    outbox.inbox_begin(text, text, text, text, bytea, interval, interval, uuid, bytea, text,
                       text, text),
    outbox.inbox_claim(text, text, text, text, bytea, interval, integer, interval, uuid, bytea,
                       text, text, text)
FROM PUBLIC;

-- Dropped and created again: granted again where roles.sql has run.
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_consumer') THEN
        GRANT EXECUTE ON FUNCTION
            outbox.inbox_begin(text, text, text, text, bytea, interval, interval, uuid, bytea,
                               text, text, text),
            outbox.inbox_claim(text, text, text, text, bytea, interval, integer, interval, uuid,
                               bytea, text, text, text)
        TO outbox_consumer;
    END IF;
END;
$$;
