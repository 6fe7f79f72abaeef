-- 0044: a delivery's first statement costs less (issue 40: the inbox's added latency).
--
-- 0042's inbox_begin bounded a duplicate's wait by setting lock_timeout around its INSERT inside
-- an exception block: every delivery paid a subtransaction (its own XID, a longer commit record,
-- a pg_subtrans page) and two set_config calls, though almost none has a duplicate in flight.
-- Now every delivery's transaction first takes a transaction-level advisory lock on its
-- identity. Taken at once (pg_try_advisory_xact_lock), no other inbox transaction holds the
-- identity, so the INSERT cannot wait on one: no lock_timeout and no exception block. Only a
-- delivery that finds the lock taken (a duplicate in flight) waits for it, under lock_timeout
-- `wait` in an exception block as before, and then inserts or finds the first one's committed
-- record. The lock is the pair (0x0B0C, hashtext of the identity): its own space, apart from
-- an application's single-bigint advisory locks; two identities with the same hash only make
-- the later one wait, never share a record. A claim (external mode) does not take it: its
-- transaction is one statement, so a delivery that meets one in flight waits that long.
--
-- bound_tenant() becomes PL/pgSQL: as a SQL function with a SET clause it was parsed and planned
-- again on every call (it is never inlined), twice per delivery and once per enqueue.

CREATE OR REPLACE FUNCTION outbox.bound_tenant() RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN CASE WHEN current_setting('outbox.tenant_bound_at', true)
                     = to_char(transaction_timestamp() AT TIME ZONE 'UTC', 'YYYYMMDDHH24MISSUS')
                THEN nullif(current_setting('outbox.tenant_id', true), '') END;
END;
$$;

CREATE OR REPLACE FUNCTION outbox.inbox_begin(
    tenant_id text, handler text, key text, body_json text, body_raw bytea,
    wait interval, retention interval,
    OUT decision text, OUT inbox_id bigint, OUT token uuid, OUT response_status integer,
    OUT response_headers jsonb, OUT response_body bytea)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_digest bytea;
    v_lock   integer;
    v_old    text;
    r        outbox.inbox;
BEGIN
    PERFORM outbox.check_between('wait', wait, interval '0', interval '60 seconds');
    PERFORM outbox.check_between('retention', retention, interval '1 hour', interval '400 days');
    v_digest := outbox.inbox_admit(tenant_id, handler, key, body_json, body_raw);
    v_lock := hashtext(tenant_id || E'\n' || handler || E'\n' || key);
    IF NOT pg_try_advisory_xact_lock(2828, v_lock) THEN  -- 2828 = 0x0B0C
        v_old := current_setting('lock_timeout');
        BEGIN
            -- lock_timeout 0 would mean "wait for ever": a wait of 0 is one millisecond.
            PERFORM set_config('lock_timeout',
                               greatest(1, ceil(extract(epoch FROM wait) * 1000))::bigint || 'ms',
                               true);
            PERFORM pg_advisory_xact_lock(2828, v_lock);
            PERFORM set_config('lock_timeout', v_old, true);
        EXCEPTION WHEN lock_not_available THEN
            -- The first delivery's transaction still holds the identity: rolled back to here,
            -- lock_timeout included.
            decision := 'in_progress';
            RETURN;
        END;
    END IF;

    -- A record deleted between the INSERT and the SELECT (pruned or forgotten): try again.
    FOR attempt IN 1..3 LOOP
        INSERT INTO outbox.inbox AS i (tenant_id, handler, key, state, body_digest, token,
                                       expires_at)
        VALUES (tenant_id, handler, key, 'in_progress', v_digest, gen_random_uuid(),
                now() + retention)
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
