-- 0029: one wake-up per idle period, so that synchronous replication costs producers nothing
-- more (issue 23; docs/design.md, "Wake-ups").
--
-- A NOTIFY takes a database-wide lock at COMMIT and holds it until the transaction ends, which
-- under synchronous replication includes the wait for the standby's flush. Every notifying
-- commit then queues behind the one before it: with a standby 10 ms away, eight producers at
-- 150 commits/s waited 95 ms each instead of 12 (bench/README.md, "Enqueue under synchronous
-- replication"). 0012 asked producers to notify only while a dispatcher waited idle; an idle
-- dispatcher waits between every two arrivals, so at a trickle every commit notified.
--
-- Now, where a synchronous standby is named (synchronous_standby_names), the first producer to
-- commit in an idle period takes the dispatchers' marks (deletes them) and notifies with the
-- payload 'taken'; the ones after it find no mark, or a mark it holds (SKIP LOCKED), and do
-- not notify, but count themselves (outbox.unnotified_commits). A dispatcher told its mark was
-- taken marks itself again when it next runs out of work, and claims once more if the count
-- moved since its last mark: a commit between its claim and its mark saw no mark. Without a
-- synchronous standby, marks stay and commits notify while one exists, as in 0012: a NOTIFY
-- then costs a commit little, and marking again after every wake-up would cost the dispatcher
-- a statement per operation at a trickle (bench/README.md, the A/B of issue 23).
--
-- No wake-up is lost by this. A producer that does not notify holds a shared advisory lock
-- (below) from its COMMIT's check until its rows are visible. A dispatcher about to sleep marks
-- itself and, in the same transaction, tries that lock exclusively: if it gets it, every commit
-- that checked before its mark is visible to its next claim, and every later one sees the mark;
-- if it does not, some commit it may not see yet may not wake it, and it claims again after a
-- short pause instead of sleeping (outbox/dispatch/claims.py). A producer that cannot get the
-- shared lock (the dispatcher holds it for an instant, or another role took the key) notifies
-- as before 0029: a role that holds the lock slows wake-ups down to a short poll or brings back
-- the old cost, and never blocks a COMMIT, since neither side ever waits for it.

-- The two-integer advisory key of the wake-up lock: a space of its own (the first integer), so
-- no single-bigint lock of a migration or of the application can meet it.
CREATE FUNCTION outbox.wake_lock_space() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 1869968504 $$;  -- 'outx' as a big-endian integer
REVOKE ALL ON FUNCTION outbox.wake_lock_space() FROM PUBLIC;
COMMENT ON FUNCTION outbox.wake_lock_space() IS
    'First key of the advisory lock pair (wake_lock_space(), 0) that producers hold shared from '
    'the wake-up check at COMMIT until their rows are visible (sql/0029).';

-- Counts commits that checked for a mark and woke no one. A dispatcher reads it as it marks
-- itself: unchanged since its last mark, no commit since then can have missed it, and it may
-- sleep without claiming once more. A sequence, because it counts outside transactions: the
-- count moves at the commit's check, before its rows are visible (the lock covers that part).
CREATE SEQUENCE outbox.unnotified_commits AS bigint CYCLE;
COMMENT ON SEQUENCE outbox.unnotified_commits IS
    'Commits that woke no dispatcher: read by a dispatcher marking itself waiting (sql/0029).';

CREATE OR REPLACE FUNCTION outbox.wake_dispatchers() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(outbox.wake_lock_space(), 0) THEN
        -- A dispatcher is marking itself this instant (or some role holds the key): notify, as
        -- every commit did before 0029; one notification per transaction, however many rows.
        PERFORM pg_notify('outbox_enqueue', '');
        RETURN NULL;
    END IF;
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
REVOKE ALL ON FUNCTION outbox.wake_dispatchers() FROM PUBLIC;

COMMENT ON TABLE outbox.waiting_dispatchers IS
    'Dispatchers idle and LISTENing. The first producer to commit while one is here deletes the '
    'marks and notifies; the dispatchers mark themselves again when next idle (sql/0029). Marks '
    'older than 10 minutes (a dispatcher that died waiting) are ignored.';

-- MARK_WAITING, which the dispatcher runs, names the lock's key and reads the count.
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_dispatcher') THEN
        GRANT EXECUTE ON FUNCTION outbox.wake_lock_space() TO outbox_dispatcher;
        GRANT SELECT ON SEQUENCE outbox.unnotified_commits TO outbox_dispatcher;
    END IF;
END;
$$;
