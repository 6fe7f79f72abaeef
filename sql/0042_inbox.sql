-- 0042: the inbox, the receiving half (issue 40; docs/design.md, "The inbox").
--
-- A worker that outbox (or any at-least-once sender) feeds records each delivery it handled,
-- in the same transaction as its business writes: one row per delivery identity (tenant,
-- handler, key). A repeat finds the row and gets the recorded outcome instead of a second run;
-- the same identity with another body is a conflict, counted in inbox_conflicts and never run;
-- a duplicate that arrives while the first is still in its transaction waits for it a bounded
-- time (lock_timeout on the unique index's entry) and is then told "in progress".
--
-- A worker's credential (outbox_consumer, roles.sql) reaches these tables only through the
-- functions below, as the dispatcher's does since 0040: it cannot delete a record (which would
-- let the next delivery run again: a second effect), record a 5xx, or complete another
-- delivery's record. The functions run inside the caller's transaction and never commit.
--
-- Why these columns and indexes: a record is born in_progress and completed in the same
-- transaction; the completion changes no indexed column, so it is a HOT update (fillfactor 80
-- leaves the room), and each delivery adds one entry to each of the two indexes.

CREATE TABLE outbox.inbox (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id        text NOT NULL,
    handler          text NOT NULL,
    key              text NOT NULL,
    -- 'transaction': recorded in the handler's own transaction (never committed in progress);
    -- 'external': a claim committed on its own, with a lease, for handlers that call out.
    mode             text NOT NULL DEFAULT 'transaction',
    state            text NOT NULL,
    -- SHA-256 of the body as jsonb's canonical text (keys ordered, spacing and number spelling
    -- normalised, as enqueue's fingerprint reads a payload), or of the raw bytes of a body that
    -- is not JSON.
    body_digest      bytea NOT NULL,
    -- Fences inbox_complete: only the transaction that began the record knows it.
    token            uuid NOT NULL,
    response_status  smallint,
    response_headers jsonb,
    response_body    bytea,
    -- External mode: the lease of the claim in progress (database clock), how many claims it
    -- took, the last failure's class, and when it was given up on.
    lease_expires_at timestamptz,
    claims           integer NOT NULL DEFAULT 1,
    last_error       text,
    abandoned_at     timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz,
    -- Set at the start, never changed (so the completion stays HOT): after it, inbox_prune may
    -- delete a completed record and a delivery under the same identity runs again.
    expires_at       timestamptz NOT NULL,
    CONSTRAINT inbox_identity UNIQUE (tenant_id, handler, key),
    CONSTRAINT inbox_mode_valid CHECK (mode IN ('transaction', 'external')),
    CONSTRAINT inbox_state_valid CHECK (state IN ('in_progress', 'completed', 'abandoned')),
    CONSTRAINT inbox_lease_only_external CHECK (lease_expires_at IS NULL OR mode = 'external'),
    CONSTRAINT inbox_last_error_bounded CHECK (char_length(last_error) <= 200),
    CONSTRAINT inbox_never_5xx CHECK (response_status BETWEEN 200 AND 499),
    CONSTRAINT inbox_response_bounded CHECK (octet_length(response_body) <= 1048576),
    CONSTRAINT inbox_completed_has_outcome CHECK (
        state <> 'completed' OR (completed_at IS NOT NULL AND response_status IS NOT NULL))
) WITH (fillfactor = 80);
COMMENT ON TABLE outbox.inbox IS 'One record per delivery identity a worker handled, committed with its business writes (sql/0042).';
REVOKE ALL ON outbox.inbox FROM PUBLIC;
CREATE INDEX inbox_expiry ON outbox.inbox (expires_at);
-- Only external claims, only while leased or abandoned: what the gauges and operators look for.
CREATE INDEX inbox_leases ON outbox.inbox (lease_expires_at) WHERE lease_expires_at IS NOT NULL;
CREATE INDEX inbox_abandoned ON outbox.inbox (abandoned_at) WHERE abandoned_at IS NOT NULL;

-- A conflict belongs to the second delivery, not to the record: the record keeps its outcome,
-- and operators see what else arrived under its identity, how often and when.
CREATE TABLE outbox.inbox_conflicts (
    inbox_id      bigint NOT NULL REFERENCES outbox.inbox ON DELETE CASCADE,
    body_digest   bytea NOT NULL,
    seen          integer NOT NULL DEFAULT 1,
    first_seen_at timestamptz NOT NULL DEFAULT now(),
    last_seen_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (inbox_id, body_digest)
);
COMMENT ON TABLE outbox.inbox_conflicts IS 'Deliveries that came under a recorded identity with another body (sql/0042).';
REVOKE ALL ON outbox.inbox_conflicts FROM PUBLIC;

-- A transaction that began a record and commits without its outcome would leave a row that
-- answers "in progress" to every repeat until it expires: refused at COMMIT instead, so the
-- whole transaction (business writes too) rolls back and the sender delivers again. As the
-- owner: it fires at the consumer's COMMIT, and the consumer may not read the table.
CREATE FUNCTION outbox.inbox_outcome_before_commit() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF EXISTS (SELECT FROM outbox.inbox i WHERE i.id = NEW.id AND i.state = 'in_progress') THEN
        RAISE EXCEPTION 'inbox record % has no outcome at commit', NEW.id
            USING ERRCODE = 'OB006',
                  HINT = 'call outbox.inbox_complete before COMMIT, or roll back';
    END IF;
    RETURN NULL;
END;
$$;
CREATE CONSTRAINT TRIGGER inbox_outcome_before_commit AFTER INSERT ON outbox.inbox
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.mode = 'transaction')
    EXECUTE FUNCTION outbox.inbox_outcome_before_commit();

-- What inbox_begin and inbox_claim check first (the owner's only; they run as the owner): the
-- identity and the body within bounds, the transaction bound to the delivery's tenant (42501 if
-- bound to another), so the handler's own tables see it under row-level security. Returns the
-- body's digest: the SHA-256 of jsonb's canonical text, or of the raw bytes.
CREATE FUNCTION outbox.inbox_admit(tenant_id text, handler text, key text, body_json text,
                                   body_raw bytea)
RETURNS bytea
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_bound text := outbox.bound_tenant();
BEGIN
    PERFORM outbox.check_text('tenant_id', tenant_id, 128);
    PERFORM outbox.check_text('key', key, 512);
    IF handler IS NULL OR handler !~ '^[a-z0-9][a-z0-9._-]{0,127}$' THEN
        RAISE EXCEPTION 'handler must be 1 to 128 of a-z, 0-9, ".", "_" and "-", starting with a '
                        'letter or digit' USING ERRCODE = 'OB002', COLUMN = 'handler';
    END IF;
    IF (body_json IS NULL) = (body_raw IS NULL) THEN
        RAISE EXCEPTION 'exactly one of body_json and body_raw is given' USING ERRCODE = '22023';
    END IF;
    IF coalesce(octet_length(body_json), octet_length(body_raw)) > 16777216 THEN
        RAISE EXCEPTION 'a body may be at most 16 MiB' USING ERRCODE = '22023';
    END IF;
    IF v_bound IS NOT NULL AND v_bound <> tenant_id THEN
        RAISE EXCEPTION 'this transaction is bound to another tenant'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    PERFORM outbox.bind_tenant(tenant_id);
    RETURN CASE WHEN body_json IS NOT NULL
                THEN sha256(convert_to(body_json::jsonb::text, 'UTF8'))
                ELSE sha256(body_raw) END;
END;
$$;

-- A delivery that came under a recorded identity with another body: counted (the owner's only).
CREATE FUNCTION outbox.inbox_count_conflict(inbox_id bigint, digest bytea) RETURNS void
LANGUAGE sql SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO outbox.inbox_conflicts AS c (inbox_id, body_digest)
    VALUES (inbox_count_conflict.inbox_id, inbox_count_conflict.digest)
    ON CONFLICT ON CONSTRAINT inbox_conflicts_pkey
    DO UPDATE SET seen = c.seen + 1, last_seen_at = now()
$$;

-- The first statement of a delivery's transaction (READ COMMITTED). Binds the transaction to
-- the delivery's tenant (so the handler's own tables see it under row-level security) and
-- decides: 'new' (a record in progress, this transaction's: run the handler, then
-- inbox_complete), 'replayed' (with the recorded response), 'conflict' (counted) or
-- 'in_progress' (another transaction holds the identity past `wait`).
CREATE FUNCTION outbox.inbox_begin(
    tenant_id text, handler text, key text, body_json text, body_raw bytea,
    wait interval, retention interval,
    OUT decision text, OUT inbox_id bigint, OUT token uuid, OUT response_status integer,
    OUT response_headers jsonb, OUT response_body bytea)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_digest bytea;
    v_wait   text;
    v_old    text := current_setting('lock_timeout');
    r        outbox.inbox;
BEGIN
    PERFORM outbox.check_between('wait', wait, interval '0', interval '60 seconds');
    PERFORM outbox.check_between('retention', retention, interval '1 hour', interval '400 days');
    v_digest := outbox.inbox_admit(tenant_id, handler, key, body_json, body_raw);
    -- lock_timeout 0 would mean "wait for ever": a wait of 0 is one millisecond.
    v_wait := greatest(1, ceil(extract(epoch FROM wait) * 1000))::bigint || 'ms';

    -- A record deleted between the INSERT and the SELECT (pruned or forgotten): try again.
    FOR attempt IN 1..3 LOOP
        BEGIN
            PERFORM set_config('lock_timeout', v_wait, true);
            INSERT INTO outbox.inbox AS i (tenant_id, handler, key, state, body_digest, token,
                                           expires_at)
            VALUES (tenant_id, handler, key, 'in_progress', v_digest, gen_random_uuid(),
                    now() + retention)
            ON CONFLICT ON CONSTRAINT inbox_identity DO NOTHING
            RETURNING i.id, i.token INTO inbox_id, token;
            PERFORM set_config('lock_timeout', v_old, true);
        EXCEPTION WHEN lock_not_available THEN
            -- The first delivery's transaction still holds the identity: rolled back to here,
            -- lock_timeout included.
            decision := 'in_progress';
            RETURN;
        END;
        IF inbox_id IS NOT NULL THEN
            decision := 'new';
            RETURN;
        END IF;
        SELECT * INTO r FROM outbox.inbox i
        WHERE i.tenant_id = inbox_begin.tenant_id AND i.handler = inbox_begin.handler
          AND i.key = inbox_begin.key;
        CONTINUE WHEN NOT FOUND;
        inbox_id := r.id;
        IF r.body_digest <> v_digest THEN
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

-- The outcome of a delivery begun in this transaction, fenced by its token and by the tenant
-- inbox_begin bound: false for any other record or one already completed. Only what a sender may be answered again is recorded: a 5xx
-- is refused, since recording it would answer every redelivery with the failure.
CREATE FUNCTION outbox.inbox_complete(inbox_id bigint, token uuid, status integer,
                                      headers jsonb, body bytea)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF status IS NULL OR status NOT BETWEEN 200 AND 499 THEN
        RAISE EXCEPTION 'only a 2xx, 3xx or 4xx outcome is recorded, not %', status
            USING ERRCODE = '22023';
    END IF;
    IF jsonb_typeof(headers) IS DISTINCT FROM 'array' OR jsonb_array_length(headers) > 64
       OR octet_length(headers::text) > 16384
       OR EXISTS (SELECT FROM jsonb_array_elements(headers) h
                  WHERE jsonb_typeof(h) <> 'array' OR jsonb_array_length(h) <> 2
                     OR jsonb_typeof(h -> 0) <> 'string' OR jsonb_typeof(h -> 1) <> 'string') THEN
        RAISE EXCEPTION 'headers are at most 64 [name, value] pairs of strings, 16 KiB in all'
            USING ERRCODE = '22023';
    END IF;
    IF body IS NULL OR octet_length(body) > 1048576 THEN
        RAISE EXCEPTION 'a recorded body is given and at most 1 MiB' USING ERRCODE = '22023';
    END IF;
    -- The tenant too, explicitly: an owner that is a superuser or BYPASSRLS skips the
    -- policies of roles_tenant_rls.sql (as 0011 says of enqueue).
    UPDATE outbox.inbox i
    SET state = 'completed', completed_at = now(), response_status = status,
        response_headers = headers, response_body = body, lease_expires_at = NULL
    WHERE i.id = inbox_complete.inbox_id AND i.token = inbox_complete.token
      AND i.state = 'in_progress' AND i.tenant_id = outbox.bound_tenant();
    RETURN FOUND;
END;
$$;

-- Deletes at most `batch` completed records past their retention, oldest first, skipping rows
-- another transaction holds; returns how many. Never a record in progress: expiry must not turn
-- work under way into new work.
CREATE FUNCTION outbox.inbox_prune(batch integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_count integer;
BEGIN
    PERFORM outbox.check_count('batch', batch, 1, 10000);
    DELETE FROM outbox.inbox
    WHERE id IN (SELECT i.id FROM outbox.inbox i
                 WHERE i.expires_at < now() AND i.state = 'completed'
                 ORDER BY i.expires_at LIMIT batch FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END;
$$;

-- External mode (handlers that call out before they can answer): the claim commits on its own,
-- with a lease on the database clock, so that it survives the handler's calls; every later write
-- is fenced by the claim's token. 'new' and 'reclaimed' run the handler; a live lease is
-- 'in_progress' (retry_after: the lease left); an expired lease is reclaimed (claims + 1, a new
-- token) until max_claims claims were taken, then 'abandoned' for a person (outbox inbox
-- release). The downstream key derives from the identity alone and this installation's secret
-- (as 0041 derives ob2_ keys): every claim, and a record forgotten and made again, hands the
-- handler the same key for its own outbound calls, and nobody without the secret can take it
-- at the downstream provider first. Two reclaimers serialise on the row's lock.
CREATE FUNCTION outbox.inbox_claim(
    tenant_id text, handler text, key text, body_json text, body_raw bytea,
    lease interval, max_claims integer, retention interval,
    OUT decision text, OUT inbox_id bigint, OUT token uuid, OUT claims integer,
    OUT downstream_key text, OUT retry_after interval, OUT response_status integer,
    OUT response_headers jsonb, OUT response_body bytea)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_digest bytea;
    r        outbox.inbox;
BEGIN
    PERFORM outbox.check_between('lease', lease, interval '1 second', interval '1 day');
    PERFORM outbox.check_count('max_claims', max_claims, 1, 100);
    PERFORM outbox.check_between('retention', retention, interval '1 hour', interval '400 days');
    v_digest := outbox.inbox_admit(tenant_id, handler, key, body_json, body_raw);
    SELECT 'ib1_' || encode(sha256(s.key_secret || sha256(s.key_secret || convert_to(
               jsonb_build_array(inbox_claim.tenant_id, inbox_claim.handler,
                                 inbox_claim.key)::text, 'UTF8'))), 'hex')
    INTO downstream_key FROM outbox.installation s;

    FOR attempt IN 1..3 LOOP
        INSERT INTO outbox.inbox AS i (tenant_id, handler, key, mode, state, body_digest, token,
                                       lease_expires_at, expires_at)
        VALUES (tenant_id, handler, key, 'external', 'in_progress', v_digest, gen_random_uuid(),
                now() + lease, now() + retention)
        ON CONFLICT ON CONSTRAINT inbox_identity DO NOTHING
        RETURNING i.id, i.token, i.claims INTO inbox_id, token, claims;
        IF inbox_id IS NOT NULL THEN
            decision := 'new';
            RETURN;
        END IF;
        SELECT * INTO r FROM outbox.inbox i
        WHERE i.tenant_id = inbox_claim.tenant_id AND i.handler = inbox_claim.handler
          AND i.key = inbox_claim.key
        FOR UPDATE;
        CONTINUE WHEN NOT FOUND;
        inbox_id := r.id;
        claims := r.claims;
        IF r.body_digest <> v_digest THEN
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
        -- Only a lease that ran out counts toward abandoning (a worker that died or stalled,
        -- as a message that crashes every worker would make it): a claim handed back by
        -- inbox_fail (lease NULL) is taken again without counting; the sender's own retry
        -- limits bound those.
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

-- A claim's heartbeat: its lease renewed, only under its token and while in progress. False: the
-- lease was lost (reclaimed by another delivery): the handler must stop and write nothing more.
CREATE FUNCTION outbox.inbox_renew(inbox_id bigint, token uuid, lease interval)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox.check_between('lease', lease, interval '1 second', interval '1 day');
    UPDATE outbox.inbox i SET lease_expires_at = now() + lease
    WHERE i.id = inbox_renew.inbox_id AND i.token = inbox_renew.token
      AND i.state = 'in_progress' AND i.mode = 'external';
    RETURN FOUND;
END;
$$;

-- A claim that failed (the handler raised, a downstream call timed out) is handed back: its lease
-- ends now, so the next delivery takes it at once, with the same downstream key, and without
-- counting toward abandoning it. Fenced by the token.
CREATE FUNCTION outbox.inbox_fail(inbox_id bigint, token uuid, error text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE outbox.inbox i SET lease_expires_at = NULL, last_error = left(error, 200)
    WHERE i.id = inbox_fail.inbox_id AND i.token = inbox_fail.token
      AND i.state = 'in_progress' AND i.mode = 'external';
    RETURN FOUND;
END;
$$;

-- An operator's `outbox inbox release`: an abandoned claim (or one whose lease expired) gets its
-- claims back, so that the next delivery reclaims it, under the same downstream key. Audited.
CREATE FUNCTION outbox.inbox_release(inbox_id bigint, reason text, actor text)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    r outbox.inbox;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    SELECT * INTO r FROM outbox.inbox i WHERE i.id = inbox_release.inbox_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'inbox record % does not exist', inbox_id USING ERRCODE = 'no_data_found';
    END IF;
    IF NOT (r.state = 'abandoned' OR (r.state = 'in_progress' AND r.mode = 'external'
                                      AND coalesce(r.lease_expires_at <= now(), true))) THEN
        RAISE EXCEPTION 'inbox record % is %: only an abandoned claim, or one whose lease '
                        'expired, is released', r.id, r.state USING ERRCODE = 'OB004';
    END IF;
    UPDATE outbox.inbox i SET state = 'in_progress', claims = 0, abandoned_at = NULL,
           lease_expires_at = NULL, token = gen_random_uuid()
    WHERE i.id = r.id;
    INSERT INTO outbox.audit (operation_id, actor, action, reason, details)
    VALUES (NULL, actor, 'inbox_release', reason,
            jsonb_build_object('inbox_id', r.id, 'tenant_id', r.tenant_id, 'handler', r.handler,
                               'key', r.key, 'state', r.state, 'claims', r.claims));
    RETURN 'released';
END;
$$;

-- The inbox's gauges (outbox/inbox/gauges.py), per handler, for a worker whose role reads no
-- table: external claims in progress under a lease, the oldest of them, and abandoned records.
-- Read from the partial indexes inbox_leases and inbox_abandoned: cheap on a table of millions.
CREATE FUNCTION outbox.inbox_gauges()
RETURNS TABLE (handler text, in_progress bigint, oldest_in_progress interval, abandoned bigint)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT i.handler,
           count(*) FILTER (WHERE i.lease_expires_at IS NOT NULL),
           max(now() - i.created_at) FILTER (WHERE i.lease_expires_at IS NOT NULL),
           count(*) FILTER (WHERE i.abandoned_at IS NOT NULL)
    FROM outbox.inbox i
    WHERE i.lease_expires_at IS NOT NULL OR i.abandoned_at IS NOT NULL
    GROUP BY i.handler
$$;

-- An operator's `outbox inbox forget`: deletes one record, so that the next delivery under its
-- identity runs the handler again (after a fix, for a refusal recorded by a bug). A record of a
-- success stands for an effect that exists: forgetting it takes `force`. Audited, with the
-- record's identity, since the row itself is gone.
CREATE FUNCTION outbox.inbox_forget(inbox_id bigint, reason text, actor text, force boolean)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    r outbox.inbox;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    SELECT * INTO r FROM outbox.inbox i WHERE i.id = inbox_forget.inbox_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'inbox record % does not exist', inbox_id USING ERRCODE = 'no_data_found';
    END IF;
    IF r.response_status < 300 AND NOT coalesce(force, false) THEN
        RAISE EXCEPTION 'inbox record % recorded a success (%): its effect exists, and the next '
                        'delivery would make another', r.id, r.response_status
            USING ERRCODE = 'OB004', HINT = 'forget it anyway with force (--force)';
    END IF;
    DELETE FROM outbox.inbox i WHERE i.id = r.id;
    INSERT INTO outbox.audit (operation_id, actor, action, reason, details)
    VALUES (NULL, actor, 'inbox_forget', reason,
            jsonb_build_object('inbox_id', r.id, 'tenant_id', r.tenant_id, 'handler', r.handler,
                               'key', r.key, 'state', r.state,
                               'response_status', r.response_status, 'force', force));
    RETURN 'forgotten';
END;
$$;

REVOKE ALL ON FUNCTION outbox.inbox_outcome_before_commit(),
    outbox.inbox_admit(text, text, text, text, bytea), outbox.inbox_count_conflict(bigint, bytea),
    outbox.inbox_begin(text, text, text, text, bytea, interval, interval),
    outbox.inbox_complete(bigint, uuid, integer, jsonb, bytea), outbox.inbox_prune(integer),
    outbox.inbox_forget(bigint, text, text, boolean),
    outbox.inbox_claim(text, text, text, text, bytea, interval, integer, interval),
    outbox.inbox_renew(bigint, uuid, interval), outbox.inbox_fail(bigint, uuid, text),
    outbox.inbox_release(bigint, text, text), outbox.inbox_gauges()
    FROM PUBLIC;
