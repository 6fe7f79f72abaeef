-- 0043: the conflicts counted against one inbox record are bounded (issue 40).
--
-- 0042 kept one row per distinct body that came under a recorded identity. A sender that sends
-- a new body under the same key on every try (a timestamp in the payload, a hostile producer, a
-- retry loop that regenerates its request) grew outbox.inbox_conflicts by one row per delivery,
-- without bound, for as long as the record lives. Now a record keeps at most 32 distinct bodies;
-- every further body is counted in one overflow row whose digest is empty ('other bodies'). The
-- total seen stays exact; operators still see the first 32 digests, their counts and times.
--
-- The bound is read from the primary key (inbox_id, body_digest) with a LIMIT: at most 32 index
-- entries per conflict. Two transactions adding a new body at once may both pass the check, so
-- the bound holds within the number of concurrent conflicting deliveries; the overflow row keeps
-- the table from growing past that.

CREATE OR REPLACE FUNCTION outbox.inbox_count_conflict(inbox_id bigint, digest bytea) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_digest bytea := digest;
BEGIN
    IF NOT EXISTS (SELECT FROM outbox.inbox_conflicts c
                   WHERE c.inbox_id = inbox_count_conflict.inbox_id AND c.body_digest = digest)
       AND (SELECT count(*) FROM (SELECT FROM outbox.inbox_conflicts c
                                  WHERE c.inbox_id = inbox_count_conflict.inbox_id
                                  LIMIT 32) AS kept) >= 32 THEN
        v_digest := '\x'::bytea;  -- the overflow row: 'other bodies'
    END IF;
    INSERT INTO outbox.inbox_conflicts AS c (inbox_id, body_digest)
    VALUES (inbox_count_conflict.inbox_id, v_digest)
    ON CONFLICT ON CONSTRAINT inbox_conflicts_pkey
    DO UPDATE SET seen = c.seen + 1, last_seen_at = now();
END;
$$;
COMMENT ON FUNCTION outbox.inbox_count_conflict(bigint, bytea) IS
    'Counts a conflicting delivery against its record: at most 32 distinct bodies, then one overflow row (sql/0043).';
