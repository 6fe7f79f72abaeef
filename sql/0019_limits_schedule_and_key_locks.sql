-- 0019: nothing a producer writes can stop delivery (issue 17).
--
-- 1. Limits at the door that a producer cannot lift. The payload limit was a setting, and any
--    session could `SET outbox.max_payload_bytes` before calling enqueue; it now lives in
--    outbox.limits, which only the schema owner can change. enqueue also refuses what the
--    dispatcher could not carry (nesting deeper than 64 levels, numbers of 1e100 or more in
--    magnitude), an available_at that is not finite or more than 10 years ahead, and
--    max_attempts above 1000. An available_at in the past means now: it is stored as now(),
--    so a producer can neither page the on-call engineer through the oldest-pending gauge nor
--    jump its own group's line.
-- 2. Rows that are not due yet leave the claim index. The fair claim (0014) visits the
--    (provider, tenant) groups of operations_claim_group one probe each, at most 200 a claim;
--    200 tenants with one operation each scheduled for tomorrow filled every visit, and the due
--    operations of a tenant sorting after them were never claimed. A pending row whose
--    available_at lies ahead is now `scheduled`, kept in an index of its own, and a dispatcher
--    stages it (statements.STAGE) into the claim index once it is due, as River's and Oban's
--    schedulers do. The claim's work is then proportional to the groups that have work.
-- 3. Ordering keys serialise on row locks of outbox.ordering_keys, which no role but outbox's
--    own functions can reach, instead of advisory locks, which any role may take (a producer of
--    one tenant hung another tenant's COMMIT), which collide when two keys hash alike, and of
--    which one transaction can hold only a few thousand ("out of shared memory" at the COMMIT
--    of 20,000 ordered operations). A transaction's keys are noted in outbox.ordering_turns as
--    it enqueues (the setting outbox.ordering_locks grew by concatenation, O(n^2), and a
--    producer could write any lock into it) and locked at COMMIT in one order.
-- 4. Operators can cancel a pending operation, and an operation in flight, which is cancelled
--    when its attempt ends: never by recording an outcome the attempt did not have.

-- --- 1. limits ------------------------------------------------------------------------------

-- One row. Only the owner of the schema changes it: `UPDATE outbox.limits SET
-- max_payload_bytes = 4194304;` Producers cannot read or write it (enqueue reads it as owner).
CREATE TABLE outbox.limits (
    one               boolean PRIMARY KEY DEFAULT true CHECK (one),
    -- Bytes of a payload's JSON text (jsonb's own text form). At least 4 KiB, so that enqueue
    -- need not read this table for the usual small payload; at most 64 MiB: a claim of 100 rows
    -- is held in the dispatcher's memory at once.
    max_payload_bytes integer NOT NULL DEFAULT 1048576
        CHECK (max_payload_bytes BETWEEN 4096 AND 67108864)
);
COMMENT ON TABLE outbox.limits IS
    'Limits only the schema owner may change: max_payload_bytes (bytes of the JSON text of a '
    'payload, 4096 to 67108864; enqueue refuses larger payloads, the claim hands none over).';
-- A limit a DBA set the old way (ALTER DATABASE app SET outbox.max_payload_bytes = ...) is
-- carried over, within the new bounds. Read in the migrator's own session.
INSERT INTO outbox.limits (max_payload_bytes)
SELECT least(greatest(coalesce(
           CASE WHEN current_setting('outbox.max_payload_bytes', true) ~ '^[0-9]{1,9}$'
                THEN current_setting('outbox.max_payload_bytes', true)::integer END,
           1048576), 4096), 67108864);
REVOKE ALL ON outbox.limits FROM PUBLIC;

-- Rows written before these checks existed. A pending row due at '-infinity' (or before 1970:
-- no schedule) is due now; one not due for more than ten years ('infinity' included) is no
-- schedule either, and is quarantined with the reason, for a person to replay or cancel. Any
-- other row with a time Python cannot read (get_operation raised) keeps its creation time.
UPDATE outbox.operations
SET available_at = now()
WHERE status = 'pending' AND available_at < timestamptz '1970-01-01 00:00:00+00';
UPDATE outbox.operations
SET status = 'quarantined', status_reason = 'invalid_available_at',
    last_error = 'available_at ' || available_at::text || ' is not finite or more than 10 '
                 'years ahead (refused at enqueue since sql/0019)',
    -- The time itself is in the message: past the year 9999 Python cannot even read it.
    available_at = created_at,
    last_error_class = 'permanent', updated_at = now(), status_changed_at = now()
WHERE status = 'pending' AND NOT ordering_blocked AND available_at > now() + interval '10 years';
-- One waiting for its ordering key's turn keeps its place in line (quarantined, it would count
-- as a head and go before the earlier ones): it is due in ten years instead.
UPDATE outbox.operations SET available_at = now() + interval '10 years'
WHERE ordering_blocked AND available_at > now() + interval '10 years';
-- One pass over the table for both: rows with more attempts allowed than enqueue now accepts.
UPDATE outbox.operations
SET available_at = CASE WHEN isfinite(available_at) THEN available_at ELSE created_at END,
    -- Not least(): it would turn NULL (the dispatcher's own max_attempts) into 1000.
    max_attempts = CASE WHEN max_attempts > 1000 THEN 1000 ELSE max_attempts END
WHERE NOT isfinite(available_at) OR max_attempts > 1000;

-- --- 2. scheduled rows ----------------------------------------------------------------------

ALTER TABLE outbox.operations ADD COLUMN scheduled boolean NOT NULL DEFAULT false;
-- Bytes of the payload's JSON text, as enqueue measured it against the limit: the claim compares
-- this, not the stored size, which compression makes up to ~90 times smaller (a 60 MB payload of
-- the old, liftable setting is 0.7 MB stored) and EXTERNAL storage larger. NULL for rows from
-- before: the unfinished ones are measured below; a finished one is never claimed again.
ALTER TABLE outbox.operations ADD COLUMN payload_bytes integer;
UPDATE outbox.operations SET payload_bytes = octet_length(payload::text)
WHERE status IN ('pending', 'in_flight', 'quarantined', 'reconciling');
-- Only a pending operation waits for its time; every other status clears the mark.
ALTER TABLE outbox.operations
    ADD CONSTRAINT operations_scheduled_only_pending CHECK (NOT scheduled OR status = 'pending');

UPDATE outbox.operations SET scheduled = true
WHERE status = 'pending' AND available_at > now();

-- The claim index holds the rows that are due (or were, when last written): 0014's, without
-- the scheduled ones.
DROP INDEX outbox.operations_claim_group;
CREATE INDEX operations_claim_group ON outbox.operations (provider, tenant_id, available_at, id)
    WHERE status = 'pending' AND NOT ordering_blocked AND NOT scheduled;
-- The scheduled rows by time: the stager takes the due ones from its front; the gauges count
-- them per provider (hence the included columns: no heap visit for a count).
CREATE INDEX operations_scheduled ON outbox.operations (available_at, id)
    INCLUDE (provider, first_sent_at, ordering_blocked) WHERE scheduled;

-- --- 3. ordering-key locks ------------------------------------------------------------------

-- One row per ordering key: its lock. Created at the COMMIT of the key's first operation;
-- `outbox prune` removes the rows of keys with no unfinished operation.
CREATE TABLE outbox.ordering_keys (
    tenant_id    text NOT NULL,
    ordering_key text NOT NULL,
    PRIMARY KEY (tenant_id, ordering_key)
);
COMMENT ON TABLE outbox.ordering_keys IS
    'The lock of each ordering key: producers lock it at COMMIT, settlers try it (sql/0019).';
REVOKE ALL ON outbox.ordering_keys FROM PUBLIC;
INSERT INTO outbox.ordering_keys (tenant_id, ordering_key)
SELECT DISTINCT tenant_id, ordering_key FROM outbox.operations
WHERE ordering_key IS NOT NULL
  AND status IN ('pending', 'in_flight', 'quarantined', 'reconciling');

-- The ordering keys each open transaction enqueued under, until its COMMIT takes their turns.
-- UNLOGGED: rows of transactions in progress, which a crash ends anyway.
CREATE UNLOGGED TABLE outbox.ordering_turns (
    xid          xid8 NOT NULL,
    tenant_id    text NOT NULL,
    ordering_key text NOT NULL,
    PRIMARY KEY (xid, tenant_id, ordering_key)
);
COMMENT ON TABLE outbox.ordering_turns IS
    'Ordering keys enqueued by transactions in progress; emptied by their COMMIT (take_turn).';
REVOKE ALL ON outbox.ordering_turns FROM PUBLIC;

-- Wait for a key's lock; creates its row the first time. Not SECURITY DEFINER: called only by
-- outbox's own functions, which are.
CREATE FUNCTION outbox.lock_ordering_key(tenant_id text, ordering_key text) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
BEGIN
    LOOP
        PERFORM 1 FROM outbox.ordering_keys k
        WHERE k.tenant_id = tenant_id AND k.ordering_key = ordering_key FOR UPDATE;
        EXIT WHEN FOUND;
        -- A new key, or one pruned a moment ago. Inserted: ours until we commit. Inserted by
        -- another transaction meanwhile: locked on the next round.
        INSERT INTO outbox.ordering_keys AS k (tenant_id, ordering_key)
        VALUES (tenant_id, ordering_key) ON CONFLICT DO NOTHING;
        EXIT WHEN FOUND;
    END LOOP;
END;
$$;

-- The key's lock if it can be had at once: a settler holds row locks, and must never wait for
-- a producer's COMMIT. False when another transaction holds it, or the key has no row yet.
CREATE FUNCTION outbox.try_lock_ordering_key(tenant_id text, ordering_key text) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
BEGIN
    PERFORM 1 FROM outbox.ordering_keys k
    WHERE k.tenant_id = tenant_id AND k.ordering_key = ordering_key FOR UPDATE SKIP LOCKED;
    RETURN FOUND;
END;
$$;

-- At a producer's COMMIT: the first firing of the transaction locks every key it enqueued
-- under, in one order (tenant_id, ordering_key), so two producers cannot deadlock, gives each
-- its turn, and clears the transaction's notes. A later firing finds its own key's note gone (a
-- look-up of one key: scanning the transaction's notes again would meet every note just
-- deleted, O(n^2) over 20,000 operations) and only makes sure of its key, which this
-- transaction holds already; so does a row that came in some other way than enqueue.
-- A producer at REPEATABLE READ or SERIALIZABLE reads with the snapshot of its transaction's
-- start even under the lock, and would not see a head settled meanwhile (the key left with no
-- head); and its insert of a new key's row could fail its COMMIT (40001). It takes no lock:
-- its keys are noted for the dispatchers' repair, which runs at READ COMMITTED, within a second.
CREATE OR REPLACE FUNCTION outbox.take_turn() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_xid xid8 := pg_current_xact_id();
    -- This row's key still noted: this is the first firing for the transaction's notes.
    v_first boolean := EXISTS (SELECT 1 FROM outbox.ordering_turns t
                               WHERE t.xid = v_xid AND t.tenant_id = NEW.tenant_id
                                 AND t.ordering_key = NEW.ordering_key);
    v_key record;
BEGIN
    IF current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted') THEN
        IF v_first THEN
            INSERT INTO outbox.ordering_repairs (tenant_id, ordering_key)
            SELECT t.tenant_id, t.ordering_key FROM outbox.ordering_turns t WHERE t.xid = v_xid;
            DELETE FROM outbox.ordering_turns t WHERE t.xid = v_xid;
        ELSE
            INSERT INTO outbox.ordering_repairs (tenant_id, ordering_key)
            VALUES (NEW.tenant_id, NEW.ordering_key);
        END IF;
        RETURN NULL;
    END IF;
    IF v_first THEN
        FOR v_key IN
            SELECT t.tenant_id, t.ordering_key FROM outbox.ordering_turns t
            WHERE t.xid = v_xid
            ORDER BY t.tenant_id, t.ordering_key
        LOOP
            PERFORM outbox.lock_ordering_key(v_key.tenant_id, v_key.ordering_key);
            PERFORM outbox.promote_next(v_key.tenant_id, v_key.ordering_key);
        END LOOP;
        DELETE FROM outbox.ordering_turns t WHERE t.xid = v_xid;
        RETURN NULL;
    END IF;
    PERFORM outbox.lock_ordering_key(NEW.tenant_id, NEW.ordering_key);
    PERFORM outbox.promote_next(NEW.tenant_id, NEW.ordering_key);
    RETURN NULL;
END;
$$;

-- A head settled: the next operation of its key goes, if the key's lock can be had at once;
-- otherwise a dispatcher's repair promotes it (0015).
CREATE OR REPLACE FUNCTION outbox.pass_turn() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF OLD.ordering_blocked
       OR (NEW.status IN ('quarantined', 'reconciling')
           AND outbox.ordering_mode(NEW.operation_type) = 'block') THEN
        RETURN NULL;  -- it was not the head, or it still is
    END IF;
    IF outbox.try_lock_ordering_key(NEW.tenant_id, NEW.ordering_key) THEN
        PERFORM outbox.promote_next(NEW.tenant_id, NEW.ordering_key);
    ELSE
        INSERT INTO outbox.ordering_repairs (tenant_id, ordering_key)
        VALUES (NEW.tenant_id, NEW.ordering_key);
    END IF;
    RETURN NULL;
END;
$$;

-- An operator's replay or retry rejoins the line (0015); operators may wait for the lock.
CREATE OR REPLACE FUNCTION outbox.rejoin_line() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox.lock_ordering_key(NEW.tenant_id, NEW.ordering_key);
    NEW.ordering_blocked := outbox.ordering_has_head(NEW.tenant_id, NEW.ordering_key, NEW.id);
    RETURN NEW;
END;
$$;

-- A dispatcher's repair of one key noted in ordering_repairs. It never waits for the key's
-- lock: a producer may hold it for a whole transaction (SET CONSTRAINTS ... IMMEDIATE fires
-- take_turn early), and one such key must not stall the repairs of every other. A key it
-- cannot lock goes to the back of the line (its notes re-dated); NULL then.
CREATE OR REPLACE FUNCTION outbox.repair_ordering_key(tenant_id text, ordering_key text)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
BEGIN
    IF NOT outbox.try_lock_ordering_key(tenant_id, ordering_key) THEN
        -- No row yet (the key's first operations came before 0019): make one, then try again.
        INSERT INTO outbox.ordering_keys AS k (tenant_id, ordering_key)
        VALUES (tenant_id, ordering_key) ON CONFLICT DO NOTHING;
        IF NOT FOUND AND NOT outbox.try_lock_ordering_key(tenant_id, ordering_key) THEN
            UPDATE outbox.ordering_repairs r SET noted_at = now()
            WHERE r.tenant_id = tenant_id AND r.ordering_key = ordering_key;
            RETURN NULL;
        END IF;
    END IF;
    DELETE FROM outbox.ordering_repairs r
    WHERE r.tenant_id = tenant_id AND r.ordering_key = ordering_key;
    RETURN outbox.promote_next(tenant_id, ordering_key);
END;
$$;

CREATE INDEX ordering_repairs_noted ON outbox.ordering_repairs (noted_at);

-- An operator's choice of block or skip (0015); the keys released are locked in the producers'
-- order.
CREATE OR REPLACE FUNCTION outbox.set_ordering_mode(operation_type text, on_failure text,
                                                    actor text)
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
        FOR v_key IN
            SELECT DISTINCT o.tenant_id, o.ordering_key
            FROM outbox.operations o
            WHERE o.operation_type = operation_type AND o.ordering_key IS NOT NULL
              AND NOT o.ordering_blocked AND o.status IN ('quarantined', 'reconciling')
            ORDER BY o.tenant_id, o.ordering_key
        LOOP
            PERFORM outbox.lock_ordering_key(v_key.tenant_id, v_key.ordering_key);
            IF outbox.promote_next(v_key.tenant_id, v_key.ordering_key) IS NOT NULL THEN
                v_promoted := v_promoted + 1;
            END IF;
        END LOOP;
    END IF;
    RETURN v_promoted;
END;
$$;

DROP FUNCTION outbox.ordering_lock(text, text);
DROP FUNCTION outbox.ordering_lock_space();
REVOKE ALL ON FUNCTION outbox.lock_ordering_key(text, text),
    outbox.try_lock_ordering_key(text, text) FROM PUBLIC;

-- --- 4. cancelling any unfinished operation -------------------------------------------------

-- When an operator asked to cancel an operation that was in flight: it is cancelled when that
-- attempt ends (operations_cancel_when_attempt_ends).
ALTER TABLE outbox.operations ADD COLUMN cancel_requested_at timestamptz;

-- `outbox cancel`: give up on any unfinished operation; nothing more will be sent. Pending,
-- quarantined, reconciling: cancelled now, except a pending one an earlier attempt of which may
-- have reached the provider (first_sent_at): "cancelled" would say the effect never happened,
-- so it goes to reconciliation (reason cancel_requested), where a check or a person decides. In
-- flight: the attempt under way is not interrupted (it may already have reached the provider);
-- the operation is settled when it ends (operations_cancel_when_attempt_ends). Returns the
-- status now. (`reconcile cancel` and `quarantine cancel` keep cancel_operation, which refuses
-- any other status than theirs.)
CREATE FUNCTION outbox.request_cancel(operation_id bigint, reason text, actor text)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    op outbox.operations;
BEGIN
    PERFORM outbox.require_reason(actor, reason);
    op := outbox.lock_for_action(operation_id, 'cancel',
                                 ARRAY['pending', 'in_flight', 'reconciling', 'quarantined']);
    IF op.status = 'in_flight' THEN
        IF op.cancel_requested_at IS NULL THEN
            UPDATE outbox.operations o SET cancel_requested_at = now(), updated_at = now()
            WHERE o.id = op.id;
        END IF;
        PERFORM outbox.write_audit(op, actor, 'cancel_requested', reason, 'in_flight',
                                   jsonb_build_object('attempt', op.attempts));
        RETURN 'in_flight';
    END IF;
    IF op.status = 'pending' AND op.first_sent_at IS NOT NULL THEN
        UPDATE outbox.operations o
        SET status = 'reconciling', status_reason = 'cancel_requested', scheduled = false,
            ordering_blocked = false, checked_at = NULL, check_finding = NULL,
            updated_at = now(), status_changed_at = now()
        WHERE o.id = op.id;
        PERFORM outbox.write_audit(op, actor, 'cancel_requested', reason, 'reconciling',
            jsonb_build_object('first_sent_at', op.first_sent_at));
        RETURN 'reconciling';
    END IF;
    UPDATE outbox.operations o
    SET status = 'cancelled', status_reason = 'cancelled by operator', scheduled = false,
        ordering_blocked = false, updated_at = now(), status_changed_at = now(),
        finished_at = now()
    WHERE o.id = op.id;
    PERFORM outbox.write_audit(op, actor, 'cancel', reason, 'cancelled', '{}'::jsonb);
    RETURN 'cancelled';
END;
$$;

-- The attempt of an operation whose cancel was requested ended (recorded, released, or its
-- lease rescued). Succeeded: it stays succeeded, the cancel came too late. Otherwise, if this
-- attempt or an earlier one may have reached the provider (first_sent_at, which the record and
-- the rescue set for such an attempt), to reconciliation (reason cancel_requested): nothing more
-- is sent, and "cancelled" would claim an effect that may exist never happened. Else cancelled.
-- The attempt's own outcome is in outbox.attempts either way. SECURITY DEFINER: it fires as the
-- dispatcher, which may not write the audit.
CREATE FUNCTION outbox.cancel_when_attempt_ends() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NEW.status = 'succeeded' THEN
        PERFORM outbox.write_audit(OLD, 'outbox', 'cancel_not_applied',
            'the attempt under way when the cancel was requested succeeded', 'succeeded',
            jsonb_build_object('requested_at', OLD.cancel_requested_at));
        RETURN NEW;
    END IF;
    IF NEW.first_sent_at IS NOT NULL THEN
        PERFORM outbox.write_audit(OLD, 'outbox', 'cancel_to_reconciliation',
            'cancel requested while the operation was in flight; its attempts may have reached '
            'the provider, so reconciliation decides', 'reconciling',
            jsonb_build_object('requested_at', OLD.cancel_requested_at,
                               'instead_of', NEW.status));
        NEW.status := 'reconciling';
        NEW.status_reason := 'cancel_requested';
        NEW.scheduled := false;
        NEW.finished_at := NULL;
        RETURN NEW;
    END IF;
    PERFORM outbox.write_audit(OLD, 'outbox', 'cancel',
        'cancel requested while the operation was in flight; applied when its attempt ended',
        'cancelled', jsonb_build_object('requested_at', OLD.cancel_requested_at,
                                        'instead_of', NEW.status));
    NEW.status := 'cancelled';
    NEW.status_reason := 'cancelled by operator';
    NEW.scheduled := false;
    NEW.finished_at := now();
    RETURN NEW;
END;
$$;
REVOKE ALL ON FUNCTION outbox.cancel_when_attempt_ends(),
    outbox.request_cancel(bigint, text, text) FROM PUBLIC;

CREATE TRIGGER operations_cancel_when_attempt_ends
    BEFORE UPDATE OF status ON outbox.operations
    FOR EACH ROW
    WHEN (OLD.status = 'in_flight' AND OLD.cancel_requested_at IS NOT NULL
          AND NEW.status <> 'in_flight')
    EXECUTE FUNCTION outbox.cancel_when_attempt_ends();

-- --- enqueue, with all of the above -------------------------------------------------------

CREATE OR REPLACE FUNCTION outbox.enqueue(
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
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    v_payload_text text;
    v_bytes        integer;
    v_max_bytes    integer;
    v_available_at timestamptz;
    v_fingerprint  bytea;
    v_id           bigint;
    v_existing     bytea;
    v_isolated     boolean;
BEGIN
    -- The tenant check (require_tenant, 0011), as in 0017.
    IF nullif(current_setting('outbox.tenant_id', true), '') IS DISTINCT FROM tenant_id
       AND btrim(tenant_id) <> '' THEN
        SELECT c.relrowsecurity INTO v_isolated FROM pg_catalog.pg_class c
        WHERE c.oid = 'outbox.operations'::regclass;
        IF v_isolated THEN
            PERFORM outbox.require_tenant(tenant_id);  -- raises its 42501
        END IF;
    END IF;

    -- check_text's conditions (0004) on every text field at once, as in 0017.
    IF (    tenant_id IS NOT NULL AND btrim(tenant_id) <> ''
            AND char_length(tenant_id) <= 128 AND tenant_id !~ '[[:cntrl:]]'
        AND operation_type IS NOT NULL AND btrim(operation_type) <> ''
            AND char_length(operation_type) <= 128 AND operation_type !~ '[[:cntrl:]]'
        AND operation_key IS NOT NULL AND btrim(operation_key) <> ''
            AND char_length(operation_key) <= 255 AND operation_key !~ '[[:cntrl:]]'
        AND provider IS NOT NULL AND btrim(provider) <> ''
            AND char_length(provider) <= 64 AND provider !~ '[[:cntrl:]]'
        AND action IS NOT NULL AND btrim(action) <> ''
            AND char_length(action) <= 128 AND action !~ '[[:cntrl:]]'
        AND (correlation_id IS NULL
             OR (btrim(correlation_id) <> '' AND char_length(correlation_id) <= 255
                 AND correlation_id !~ '[[:cntrl:]]'))
        AND (ordering_key IS NULL
             OR (btrim(ordering_key) <> '' AND char_length(ordering_key) <= 255
                 AND ordering_key !~ '[[:cntrl:]]'))
       ) IS NOT TRUE THEN
        PERFORM outbox.check_text('tenant_id', tenant_id, 128);
        PERFORM outbox.check_text('operation_type', operation_type, 128);
        PERFORM outbox.check_text('operation_key', operation_key, 255);
        PERFORM outbox.check_text('provider', provider, 64);
        PERFORM outbox.check_text('action', action, 128);
        PERFORM outbox.check_text('correlation_id', correlation_id, 255, false);
        PERFORM outbox.check_text('ordering_key', ordering_key, 255, false);
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
        SELECT l.max_payload_bytes INTO v_max_bytes FROM outbox.limits l;
        v_max_bytes := coalesce(v_max_bytes, 1048576);  -- the row deleted: the default
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

    v_fingerprint := sha256(convert_to(provider || E'\n' || action || E'\n' || v_payload_text
                                       || coalesce(E'\n' || ordering_key, ''), 'UTF8'));

    LOOP
        INSERT INTO outbox.operations AS o (
            tenant_id, operation_type, operation_key, fingerprint, provider, action, payload,
            idempotency_key, correlation_id, traceparent, max_attempts, available_at,
            scheduled, payload_bytes, ordering_key, ordering_blocked
        ) VALUES (
            tenant_id, operation_type, operation_key, v_fingerprint, provider, action, payload,
            coalesce(idempotency_key,
                     'ob1_' || encode(sha256(convert_to(
                         jsonb_build_array(tenant_id, operation_type, operation_key)::text,
                         'UTF8')), 'hex')),
            correlation_id, traceparent, max_attempts, v_available_at,
            -- Not due yet: out of the claim index until a dispatcher stages it.
            v_available_at > now(), v_bytes,
            ordering_key, ordering_key IS NOT NULL
        )
        ON CONFLICT ON CONSTRAINT operations_identity DO NOTHING
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
    END LOOP;
END;
$$;

-- Where the roles exist (sql/roles.sql), the dispatcher gets what the new statements need:
-- the limit the claim applies, and the scheduled mark it clears and sets.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_dispatcher') THEN
        GRANT SELECT ON outbox.limits TO outbox_dispatcher;
        GRANT UPDATE (scheduled) ON outbox.operations TO outbox_dispatcher;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_operator') THEN
        GRANT SELECT ON outbox.limits TO outbox_operator;
        GRANT EXECUTE ON FUNCTION outbox.request_cancel(bigint, text, text) TO outbox_operator;
    END IF;
END;
$$;
