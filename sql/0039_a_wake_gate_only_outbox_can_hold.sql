-- 0039: the wake-up lock is one only outbox's roles can take (issue 38).
--
-- 0029's lock was the advisory key (outbox.wake_lock_space(), 0): producers hold it shared
-- from their COMMIT's wake-up check until their rows are visible, and a dispatcher about to
-- sleep tries it exclusively, claiming again after a short pause when it cannot get it. Any
-- role that can connect can take any advisory key, and pg_locks shows every key held to
-- everyone: one session holding this one kept every idle dispatcher polling (1,360
-- transactions in 10 s instead of 43) and made every commit notify. No secret key helps,
-- since pg_locks would show it the first time a producer held it.
--
-- Now the lock is a table's: outbox.wake_gate, which has no rows and which no role but the
-- owner may lock (LOCK TABLE needs a privilege on it, checked before the lock is taken; none is
-- granted, and producers and dispatchers reach it only through the SECURITY DEFINER functions
-- below). A producer's commit takes ROW EXCLUSIVE (as an INSERT would: producers never conflict
-- with each other), a dispatcher's mark tries SHARE, which conflicts with it. The protocol is
-- 0029's (docs/design.md, "Claim protocol", 10): both sides only ever try the lock (NOWAIT), a
-- producer that cannot take it notifies, and a dispatcher that cannot claims again instead of
-- sleeping, so no wake-up is lost and no COMMIT ever waits for it. Who can still hold it: the
-- schema owner and superusers, an autovacuum of the (empty) table now and then, a migration:
-- each costs notifications or short polls, as before.
--
-- A dispatcher of an earlier version still tries the advisory key in its MARK_WAITING, through
-- outbox.wake_lock_space(): that function now tries the gate first, and gives no key (NULL,
-- which the dispatcher takes for "a commit is in flight") when it cannot, so such a dispatcher
-- keeps its no-lost-wake-up guarantee during a rolling deploy.

CREATE TABLE outbox.wake_gate ();
REVOKE ALL ON outbox.wake_gate FROM PUBLIC;
COMMENT ON TABLE outbox.wake_gate IS
    'No rows: its lock is the wake-up lock. Producers hold ROW EXCLUSIVE from the wake-up check at '
    'COMMIT until their rows are visible; a dispatcher marking itself waiting tries SHARE '
    '(outbox.try_wake_gate). Only outbox''s functions lock it (sql/0039).';

-- True when no producer's commit is between its wake-up check and its rows becoming visible:
-- the gate is then held (SHARE) until the caller's transaction ends, and a commit that checks
-- meanwhile cannot take it, so it notifies. False at once otherwise.
CREATE FUNCTION outbox.try_wake_gate() RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    LOCK TABLE outbox.wake_gate IN SHARE MODE NOWAIT;
    RETURN true;
EXCEPTION WHEN lock_not_available THEN
    RETURN false;
END;
$$;
REVOKE ALL ON FUNCTION outbox.try_wake_gate() FROM PUBLIC;
COMMENT ON FUNCTION outbox.try_wake_gate() IS
    'A dispatcher marking itself waiting: true (and the wake-up gate held until the end of its '
    'transaction) when no commit is becoming visible unseen; false at once otherwise (sql/0039).';

-- For dispatchers of earlier versions, whose MARK_WAITING tries pg_try_advisory_xact_lock(
-- outbox.wake_lock_space(), 0): the key only once the gate is held, NULL (not quiet) otherwise.
CREATE OR REPLACE FUNCTION outbox.wake_lock_space() RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF outbox.try_wake_gate() THEN
        RETURN 1869968504;  -- 'outx' as a big-endian integer, 0029's
    END IF;
    RETURN NULL;
END;
$$;
COMMENT ON FUNCTION outbox.wake_lock_space() IS
    'For dispatchers of versions before sql/0039 only: tries the wake-up gate (try_wake_gate) '
    'and gives the key of 0029''s advisory lock only when it holds it, NULL otherwise.';

-- 0029's, with the gate for the advisory lock.
CREATE OR REPLACE FUNCTION outbox.wake_dispatchers() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    BEGIN
        -- Held from here until this transaction's rows are visible (locks outlast the commit's
        -- visibility), or not at all: never waited for.
        LOCK TABLE outbox.wake_gate IN ROW EXCLUSIVE MODE NOWAIT;
    EXCEPTION WHEN lock_not_available THEN
        -- A dispatcher is marking itself this instant (or the owner holds the gate): notify, as
        -- every commit did before 0029; one notification per transaction, however many rows.
        PERFORM pg_notify('outbox_enqueue', '');
        RETURN NULL;
    END;
    IF current_setting('synchronous_standby_names') = '' THEN
        -- No synchronous standby: a NOTIFY costs a commit little, so marks stay, and a
        -- dispatcher need not mark itself again after every wake-up (a statement each time).
        -- Nothing counted: a dispatcher whose mark stays claims once more after any fresh mark.
        IF EXISTS (SELECT 1 FROM outbox.waiting_dispatchers
                   WHERE seen_at > now() - interval '10 minutes') THEN
            PERFORM pg_notify('outbox_enqueue', '');
        END IF;
        RETURN NULL;
    END IF;
    DELETE FROM outbox.waiting_dispatchers w
    WHERE w.worker IN (SELECT m.worker FROM outbox.waiting_dispatchers m
                       WHERE m.seen_at > now() - interval '10 minutes'
                       FOR UPDATE SKIP LOCKED);
    IF FOUND THEN
        -- 'taken': the woken dispatchers are marked no more, and mark themselves again.
        PERFORM pg_notify('outbox_enqueue', 'taken');
    ELSE
        PERFORM nextval('outbox.unnotified_commits');
    END IF;
    RETURN NULL;
END;
$$;

-- MARK_WAITING, which the dispatcher runs, tries the gate through this function.
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_dispatcher') THEN
        GRANT EXECUTE ON FUNCTION outbox.try_wake_gate() TO outbox_dispatcher;
    END IF;
END;
$$;
